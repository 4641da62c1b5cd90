//! Quantized matrix products on the CPU: `out[n, rows] = x[n, cols] · Wᵀ` with `W` in tm's int4 or
//! int8 group layout ([`tm_core::quant`]), dequantized on the fly (the f32 matrix is never built).
//!
//! # Two ways to compute
//! - [`matmul_int4`] / [`matmul_int8`] (the fast path): each call first quantizes every
//!   activation row to int8 in blocks of 32 (like llama.cpp's `Q8_1`: `x ≈ q_x · d_x`, with
//!   `d_x = max|x| / 127` and `s_x = d_x · Σ q_x` kept per block), then for each weight block does
//!   an integer dot product `Σ q_w · q_x` and combines
//!   `out = Σ_blocks scale_w · d_x · (Σ q_w · q_x) + min_w · s_x` (int8 weights have no min term).
//! - [`matmul_int4_exact`] / [`matmul_int8_exact`]: f32 activations; each weight block is
//!   dequantized in registers to exactly the values [`tm_quant::dequantize`] gives, and the dot is
//!   f32 FMA. Slower, but only f32 summation rounding separates it from dequantize-then-matmul.
//!
//! # Error of the fast path
//! Rounding the activations to int8 moves each element by at most `d_x / 2` of its block, so for
//! an activation row `x` the rounding error vector `e` has
//! `‖e‖² ≤ Σ_blocks 32 · (max|x_b| / 254)² ≤ 8 ‖x‖² / 127²`. By Cauchy–Schwarz the error of one
//! output is then at most `‖w‖ · ‖e‖ ≤ (2√2 / 127) · ‖x‖ · ‖w‖` = [`ACT_QUANT_REL_ERROR`]` · ‖x‖ · ‖w‖`,
//! where `w` is the dequantized weight row; on top of that only f32 summation rounding. The bound
//! is for adversarial data; for ordinary (uncorrelated) data the rounding errors are independent
//! and the error is about `0.005 · ‖x‖ · ‖w‖ / √cols` (measured: worst of 64 outputs `4e-4` at 576
//! columns, 50 times below the bound). Non-finite activations give non-finite outputs (a block
//! holding a NaN gets `d_x = NaN`).
//!
//! # Implementation
//! An AVX2 (+FMA, F16C) path chosen at run time ([`Isa::best`]) and a portable scalar path that is
//! also the reference the AVX2 path is tested against (both quantize the activations identically;
//! they differ only in the order of the f32 sums).
//!
//! - Rows of `W` are split into a few chunks per rayon thread (multiples of 4 rows). Calls from
//!   outside the rayon pool pay a cross-thread hand-off each (about 7 µs here); running the whole
//!   forward pass inside the pool (`rayon::scope(|_| ...)`) avoids it — 1.5 ms per token for a
//!   SmolLM2-135M-sized model.
//! - A chunk is computed in register tiles of `R` weight rows × `NA` activation rows with
//!   `R · NA = 4` independent accumulators (4×1 for decode, 1×4 for prefill), so that one decoded
//!   weight block serves `NA` activation rows and FMA latency is hidden. For prefill the weight
//!   rows are also tiled so that a tile stays in L1 while all activation rows pass over it.
//! - int4: two 32-column blocks are processed per 32-byte weight load. Their low nibbles are
//!   columns 0..16 of each block and the high nibbles columns 16..32, so the activations are
//!   stored pair-interleaved (`A[0..16] B[0..16] A[16..32] B[16..32]`) and two `maddubs` plus an
//!   add give both blocks' partial sums in the two 128-bit halves of one register: about 5 µops per
//!   block instead of 8.
//! - The next row tile is prefetched in software while the current one computes: the per-chunk
//!   streams are short and the hardware prefetcher stops at 4 KiB pages (about 1.4× at n = 1).
//! - The quantized activations live in a thread-local buffer that is reused across calls (taken
//!   out for the duration of a call, so re-entrant calls are safe).
//!
//! Measured on the 2-core x86-64 development VM (AVX2; 96 MB of SmolLM2-135M-shaped weights, see
//! `tests::bench_smollm2_135m`): n = 1 about 3.2 ms per token of matmuls (310 tok/s, 28–38 GB/s)
//! from inside the pool, 4.6 ms from outside; prefill about 155 GFLOP/s (580 tok/s at n = 64).
//! The machine's memory bandwidth varies with its neighbours; the n = 1 numbers can halve.

use std::cell::Cell;
use std::ops::Range;

use rayon::prelude::*;
use tm_core::{Error, Result};
use tm_quant::{QuantKind, BLOCK};

pub use tm_quant::HostQuantView;

/// Bound on the error of [`matmul_int4`] / [`matmul_int8`] relative to dequantize-then-f32-matmul,
/// per output element, as a multiple of `‖x_row‖₂ · ‖w_row‖₂`: `2√2 / 127` (see the module docs),
/// rounded up.
pub const ACT_QUANT_REL_ERROR: f32 = 0.022_272;

/// Below this many multiply-adds a call runs on the calling thread only.
const PAR_MIN_MACS: usize = 1 << 16;

/// Bytes of weight rows to keep in L1 while several activation rows pass over them.
const L1_TILE_BYTES: usize = 16 * 1024;

/// Activation rows that share each decoded weight block.
const MAX_NA: usize = 4;

/// Which instruction set the kernels use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable Rust; the reference for the vector paths.
    Scalar,
    /// x86-64 AVX2 with FMA and F16C.
    Avx2,
}

impl Isa {
    /// The fastest instruction set this CPU supports.
    pub fn best() -> Isa {
        if Isa::Avx2.available() {
            Isa::Avx2
        } else {
            Isa::Scalar
        }
    }

    /// Whether this CPU can run the instruction set.
    pub fn available(self) -> bool {
        match self {
            Isa::Scalar => true,
            Isa::Avx2 => avx2_available(),
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2_available() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx2_available() -> bool {
    false
}

/// `out[n, rows] = x[n, cols] · Wᵀ` for an int4 `W`, through int8-quantized activations, with the
/// best instruction set. Errors when the shapes or the weight's parts do not fit.
pub fn matmul_int4(x: &[f32], n: usize, w: &HostQuantView<'_>, out: &mut [f32]) -> Result<()> {
    matmul_int4_with(Isa::best(), x, n, w, out)
}

/// [`matmul_int4`] with a chosen instruction set (errors if the CPU lacks it).
pub fn matmul_int4_with(isa: Isa, x: &[f32], n: usize, w: &HostQuantView<'_>, out: &mut [f32]) -> Result<()> {
    let sh = check(isa, x, n, w, out, QuantKind::Int4)?;
    with_acts(|acts| {
        acts.quantize(isa, x, &sh, if isa == Isa::Avx2 { Layout::Pairs } else { Layout::Plain });
        run(isa, &sh, w, acts, out, Kernel::Int4);
    });
    Ok(())
}

/// `out[n, rows] = x[n, cols] · Wᵀ` for an int8 `W`, through int8-quantized activations, with the
/// best instruction set. Errors when the shapes or the weight's parts do not fit.
pub fn matmul_int8(x: &[f32], n: usize, w: &HostQuantView<'_>, out: &mut [f32]) -> Result<()> {
    matmul_int8_with(Isa::best(), x, n, w, out)
}

/// [`matmul_int8`] with a chosen instruction set (errors if the CPU lacks it).
pub fn matmul_int8_with(isa: Isa, x: &[f32], n: usize, w: &HostQuantView<'_>, out: &mut [f32]) -> Result<()> {
    let sh = check(isa, x, n, w, out, QuantKind::Int8)?;
    with_acts(|acts| {
        acts.quantize(isa, x, &sh, Layout::Plain);
        run(isa, &sh, w, acts, out, Kernel::Int8);
    });
    Ok(())
}

/// `out[n, rows] = x[n, cols] · Wᵀ` for an int4 `W` with f32 activations: each weight block is
/// dequantized in registers and multiplied with f32 FMA. Errors when shapes or parts do not fit.
pub fn matmul_int4_exact(x: &[f32], n: usize, w: &HostQuantView<'_>, out: &mut [f32]) -> Result<()> {
    matmul_int4_exact_with(Isa::best(), x, n, w, out)
}

/// [`matmul_int4_exact`] with a chosen instruction set (errors if the CPU lacks it).
pub fn matmul_int4_exact_with(isa: Isa, x: &[f32], n: usize, w: &HostQuantView<'_>, out: &mut [f32]) -> Result<()> {
    let sh = check(isa, x, n, w, out, QuantKind::Int4)?;
    run_exact(isa, &sh, w, x, out, Kernel::Int4);
    Ok(())
}

/// `out[n, rows] = x[n, cols] · Wᵀ` for an int8 `W` with f32 activations (see
/// [`matmul_int4_exact`]).
pub fn matmul_int8_exact(x: &[f32], n: usize, w: &HostQuantView<'_>, out: &mut [f32]) -> Result<()> {
    matmul_int8_exact_with(Isa::best(), x, n, w, out)
}

/// [`matmul_int8_exact`] with a chosen instruction set (errors if the CPU lacks it).
pub fn matmul_int8_exact_with(isa: Isa, x: &[f32], n: usize, w: &HostQuantView<'_>, out: &mut [f32]) -> Result<()> {
    let sh = check(isa, x, n, w, out, QuantKind::Int8)?;
    run_exact(isa, &sh, w, x, out, Kernel::Int8);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Shapes, scratch and the parallel driver.

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kernel {
    Int4,
    Int8,
}

/// Validated dimensions of one call.
#[derive(Clone, Copy, Debug)]
struct Shape {
    n: usize,
    rows: usize,
    cols: usize,
    /// 32-column blocks per row.
    nb: usize,
    /// `nb` rounded up to a multiple of 8: the stride of the per-block activation arrays.
    nbp: usize,
    /// Groups per row.
    groups: usize,
    /// Blocks per group.
    bpg: usize,
}

fn check(isa: Isa, x: &[f32], n: usize, w: &HostQuantView<'_>, out: &[f32], kind: QuantKind) -> Result<Shape> {
    if !isa.available() {
        return Err(Error::Unsupported(format!("quantized matmul: {isa:?} is not available on this CPU")));
    }
    match kind {
        QuantKind::Int4 => w.expect_int4()?,
        QuantKind::Int8 => w.expect_int8()?,
    }
    let xs = n.checked_mul(w.cols).ok_or_else(|| Error::invalid("quantized matmul: n * cols overflows"))?;
    if x.len() != xs {
        return Err(Error::shape("quantized matmul input x", [n, w.cols], x.len()));
    }
    let os = n.checked_mul(w.rows).ok_or_else(|| Error::invalid("quantized matmul: n * rows overflows"))?;
    if out.len() != os {
        return Err(Error::shape("quantized matmul output", [n, w.rows], out.len()));
    }
    let nb = w.cols / BLOCK;
    let groups = w.cols / w.group_size;
    Ok(Shape { n, rows: w.rows, cols: w.cols, nb, nbp: nb.div_ceil(8) * 8, groups, bpg: w.group_size / BLOCK })
}

/// Activations quantized to int8 per 32-block.
#[derive(Default)]
struct Acts {
    /// `[n, cols]` int8 values, in [`Layout`] order.
    qs: Vec<i8>,
    /// `[n, nbp]` block scales `d_x` (zero past `nb`).
    d: Vec<f32>,
    /// `[n, nbp]` `d_x · Σ q_x` per block (zero past `nb`).
    s: Vec<f32>,
}

/// Byte order of the quantized activations within a row.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Layout {
    /// Block `b` at `32 b`, columns in order.
    Plain,
    /// Blocks `2p` and `2p + 1` (A and B) interleaved in 16-byte halves at `64 p`:
    /// `A[0..16], B[0..16], A[16..32], B[16..32]` — the order of the low and high nibbles of the
    /// 32 weight bytes of the two blocks, so one 32-byte weight load serves both blocks. A last odd
    /// block is plain.
    Pairs,
}

thread_local! {
    static ACTS: Cell<Acts> = Cell::new(Acts::default());
}

/// Runs `f` with this thread's activation buffer. The buffer is taken out of the thread-local for
/// the duration, so a nested call (rayon work-stealing into another matmul on this thread) just
/// gets a fresh one instead of aliasing it.
fn with_acts<R>(f: impl FnOnce(&mut Acts) -> R) -> R {
    let mut acts = ACTS.with(Cell::take);
    let r = f(&mut acts);
    ACTS.with(|c| c.set(acts));
    r
}

/// Offsets of the low and high 16 columns of block `b` (of `nb`) within a quantized row.
fn block_offsets(layout: Layout, b: usize, nb: usize) -> (usize, usize) {
    if layout == Layout::Pairs && (b | 1) < nb {
        let base = (b & !1) * BLOCK + (b & 1) * 16;
        (base, base + 32)
    } else {
        (b * BLOCK, b * BLOCK + 16)
    }
}

impl Acts {
    fn quantize(&mut self, isa: Isa, x: &[f32], sh: &Shape, layout: Layout) {
        fn reset<T: Copy + Default>(v: &mut Vec<T>, len: usize) {
            v.clear();
            v.resize(len, T::default());
        }
        reset(&mut self.qs, sh.n * sh.cols);
        reset(&mut self.d, sh.n * sh.nbp);
        reset(&mut self.s, sh.n * sh.nbp);
        if sh.cols == 0 {
            return;
        }
        let nb = sh.nb;
        type RowParts<'a> = (((&'a [f32], &'a mut [i8]), &'a mut [f32]), &'a mut [f32]);
        let one_row = |(((xr, qr), dr), sr): RowParts<'_>| {
            for (b, xb) in xr.chunks_exact(BLOCK).enumerate() {
                let mut q = [0i8; BLOCK];
                let (d, sum) = quantize_block(isa, xb.try_into().unwrap_or(&[0.0; BLOCK]), &mut q);
                let (lo, hi) = block_offsets(layout, b, nb);
                qr[lo..lo + 16].copy_from_slice(&q[..16]);
                qr[hi..hi + 16].copy_from_slice(&q[16..]);
                dr[b] = d;
                sr[b] = d * sum as f32;
            }
        };
        if sh.n >= 8 && sh.n * sh.cols >= PAR_MIN_MACS / 4 {
            x.par_chunks_exact(sh.cols)
                .zip(self.qs.par_chunks_exact_mut(sh.cols))
                .zip(self.d.par_chunks_exact_mut(sh.nbp))
                .zip(self.s.par_chunks_exact_mut(sh.nbp))
                .for_each(one_row);
        } else {
            x.chunks_exact(sh.cols)
                .zip(self.qs.chunks_exact_mut(sh.cols))
                .zip(self.d.chunks_exact_mut(sh.nbp))
                .zip(self.s.chunks_exact_mut(sh.nbp))
                .for_each(one_row);
        }
    }
}

/// Quantizes one 32-block: returns `d_x` and `Σ q_x`. Both instruction sets give identical results.
fn quantize_block(isa: Isa, x: &[f32; BLOCK], q: &mut [i8; BLOCK]) -> (f32, i32) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
        // SAFETY: `Isa::Avx2` is only used after `check` confirmed the CPU has AVX2/FMA/F16C.
        return unsafe { avx2::quantize_block(x, q) };
    }
    let _ = isa;
    quantize_block_scalar(x, q)
}

fn quantize_block_scalar(x: &[f32; BLOCK], q: &mut [i8; BLOCK]) -> (f32, i32) {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = if x.iter().any(|v| v.is_nan()) { f32::NAN } else { amax / 127.0 };
    let id = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0i32;
    for (qi, &v) in q.iter_mut().zip(x) {
        *qi = (v * id).round_ties_even() as i8;
        sum += *qi as i32;
    }
    (d, sum)
}

/// The output pointer shared by the row chunks; each chunk writes only its own rows.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: the chunks write disjoint elements (distinct rows) and the owner waits for all of them.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// # Safety
    /// `i` must be in bounds of the output and written by one chunk only.
    unsafe fn write(self, i: usize, v: f32) {
        *self.0.add(i) = v;
    }
}

/// Calls `f` on chunks of `0..rows` (multiples of 4 rows but the last), in parallel when the
/// work is large enough.
fn for_row_chunks(rows: usize, macs_per_row: usize, f: impl Fn(Range<usize>) + Sync) {
    let threads = rayon::current_num_threads();
    if threads <= 1 || rows < 8 || rows.saturating_mul(macs_per_row) < PAR_MIN_MACS {
        f(0..rows);
        return;
    }
    let chunks = (threads * 4).min(rows / 4);
    let per = rows.div_ceil(chunks).next_multiple_of(4);
    (0..rows.div_ceil(per)).into_par_iter().for_each(|c| f(c * per..((c + 1) * per).min(rows)));
}

/// Weight rows per L1 tile.
fn tile_rows(row_bytes: usize) -> usize {
    (L1_TILE_BYTES / row_bytes.max(1)).max(4) / 4 * 4
}

fn run(isa: Isa, sh: &Shape, w: &HostQuantView<'_>, acts: &Acts, out: &mut [f32], kernel: Kernel) {
    let out = OutPtr(out.as_mut_ptr());
    let row_bytes = match kernel {
        Kernel::Int4 => sh.cols / 2,
        Kernel::Int8 => sh.cols,
    };
    let tile = tile_rows(row_bytes);
    let sh = *sh;
    for_row_chunks(sh.rows, sh.cols * sh.n, |range| {
        let mut t0 = range.start;
        while t0 < range.end {
            let t1 = (t0 + tile).min(range.end);
            let mut j = 0;
            while j < sh.n {
                let na = (sh.n - j).min(MAX_NA);
                rows_dot(isa, &sh, w, acts, t0..t1, j, na, kernel, out);
                j += na;
            }
            t0 = t1;
        }
    });
}

/// Writes `out[j + t][r]` for `r` in `rows`, `t < na` (`na <= MAX_NA`).
#[allow(clippy::too_many_arguments)]
fn rows_dot(
    isa: Isa,
    sh: &Shape,
    w: &HostQuantView<'_>,
    acts: &Acts,
    rows: Range<usize>,
    j: usize,
    na: usize,
    kernel: Kernel,
    out: OutPtr,
) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
        // SAFETY: the CPU has AVX2/FMA/F16C (checked), and `check` validated every length the
        // kernels index with: packed/scales/mins against `rows`, `cols`, `group_size`; the
        // activation buffers were sized from the same shape (in `Layout::Pairs` for int4); `rows`
        // and `j..j + na` are in range and the output rows are this chunk's only.
        unsafe {
            match kernel {
                Kernel::Int4 => avx2::int4_rows(sh, w, acts, rows, j, na, out),
                Kernel::Int8 => avx2::int8_rows(sh, w, acts, rows, j, na, out),
            }
        }
        return;
    }
    let _ = isa;
    for r in rows {
        for t in 0..na {
            let v = match kernel {
                Kernel::Int4 => scalar_int4_row(sh, w, acts, r, j + t),
                Kernel::Int8 => scalar_int8_row(sh, w, acts, r, j + t),
            };
            // SAFETY: `(j + t) * rows + r < n * rows`, the checked output length; row `r` is
            // written by this chunk only.
            unsafe { out.write((j + t) * sh.rows + r, v) };
        }
    }
}

fn scalar_int4_row(sh: &Shape, w: &HostQuantView<'_>, acts: &Acts, r: usize, j: usize) -> f32 {
    let wrow = &w.packed[r * sh.cols / 2..(r + 1) * sh.cols / 2];
    let scales = &w.scales[r * sh.groups..(r + 1) * sh.groups];
    let mins = &w.mins.unwrap_or_default()[r * sh.groups..(r + 1) * sh.groups];
    let qx = &acts.qs[j * sh.cols..(j + 1) * sh.cols];
    let (d, s) = (&acts.d[j * sh.nbp..], &acts.s[j * sh.nbp..]);
    let (mut acc, mut macc) = (0.0f32, 0.0f32);
    for b in 0..sh.nb {
        let g = b / sh.bpg;
        let (wb, xb) = (&wrow[b * 16..b * 16 + 16], &qx[b * BLOCK..b * BLOCK + BLOCK]);
        let mut dot = 0i32;
        for i in 0..16 {
            dot += (wb[i] & 0x0F) as i32 * xb[i] as i32 + (wb[i] >> 4) as i32 * xb[i + 16] as i32;
        }
        acc += dot as f32 * (scales[g].to_f32() * d[b]);
        macc += mins[g].to_f32() * s[b];
    }
    acc + macc
}

fn scalar_int8_row(sh: &Shape, w: &HostQuantView<'_>, acts: &Acts, r: usize, j: usize) -> f32 {
    let wrow = &w.packed[r * sh.cols..(r + 1) * sh.cols];
    let scales = &w.scales[r * sh.groups..(r + 1) * sh.groups];
    let qx = &acts.qs[j * sh.cols..(j + 1) * sh.cols];
    let d = &acts.d[j * sh.nbp..];
    let mut acc = 0.0f32;
    for b in 0..sh.nb {
        let (wb, xb) = (&wrow[b * BLOCK..(b + 1) * BLOCK], &qx[b * BLOCK..(b + 1) * BLOCK]);
        let dot: i32 = wb.iter().zip(xb).map(|(&a, &b)| (a as i8) as i32 * b as i32).sum();
        acc += dot as f32 * (scales[b / sh.bpg].to_f32() * d[b]);
    }
    acc
}

fn run_exact(isa: Isa, sh: &Shape, w: &HostQuantView<'_>, x: &[f32], out: &mut [f32], kernel: Kernel) {
    let out = OutPtr(out.as_mut_ptr());
    let row_bytes = match kernel {
        Kernel::Int4 => sh.cols / 2,
        Kernel::Int8 => sh.cols,
    };
    let tile = tile_rows(row_bytes);
    let sh = *sh;
    for_row_chunks(sh.rows, sh.cols * sh.n, |range| {
        let mut t0 = range.start;
        while t0 < range.end {
            let t1 = (t0 + tile).min(range.end);
            let mut j = 0;
            while j < sh.n {
                let na = (sh.n - j).min(MAX_NA);
                exact_rows(isa, &sh, w, x, t0..t1, j, na, kernel, out);
                j += na;
            }
            t0 = t1;
        }
    });
}

/// Exact-path version of [`rows_dot`]: `x` is the f32 `[n, cols]` input.
#[allow(clippy::too_many_arguments)]
fn exact_rows(
    isa: Isa,
    sh: &Shape,
    w: &HostQuantView<'_>,
    x: &[f32],
    rows: Range<usize>,
    j: usize,
    na: usize,
    kernel: Kernel,
    out: OutPtr,
) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
        // SAFETY: CPU features checked; `check` validated the weight and `x.len() == n * cols`;
        // `rows` and `j..j + na` are in range and the output rows are this chunk's only.
        unsafe { avx2::exact_rows(sh, w, x, rows, j, na, kernel, out) };
        return;
    }
    let _ = isa;
    let gs = sh.bpg * BLOCK;
    for r in rows {
        let scales = &w.scales[r * sh.groups..(r + 1) * sh.groups];
        for t in j..j + na {
            let xr = &x[t * sh.cols..(t + 1) * sh.cols];
            let mut acc = 0.0f32;
            match kernel {
                Kernel::Int4 => {
                    let wrow = &w.packed[r * sh.cols / 2..(r + 1) * sh.cols / 2];
                    let mins = &w.mins.unwrap_or_default()[r * sh.groups..(r + 1) * sh.groups];
                    for b in 0..sh.nb {
                        let g = b / sh.bpg;
                        let (s, m) = (scales[g].to_f32(), mins[g].to_f32());
                        for i in 0..16 {
                            let v = wrow[b * 16 + i];
                            acc += ((v & 0x0F) as f32 * s + m) * xr[b * BLOCK + i];
                            acc += ((v >> 4) as f32 * s + m) * xr[b * BLOCK + 16 + i];
                        }
                    }
                }
                Kernel::Int8 => {
                    let wrow = &w.packed[r * sh.cols..(r + 1) * sh.cols];
                    for ((wg, xg), s) in wrow.chunks_exact(gs).zip(xr.chunks_exact(gs)).zip(scales) {
                        let s = s.to_f32();
                        for (&q, &xv) in wg.iter().zip(xg) {
                            acc += (q as i8) as f32 * s * xv;
                        }
                    }
                }
            }
            // SAFETY: `t * rows + r < n * rows`, the checked output length; row `r` is this
            // chunk's only.
            unsafe { out.write(t * sh.rows + r, acc) };
        }
    }
}

// ---------------------------------------------------------------------------------------------
// AVX2 kernels.

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use std::ops::Range;

    use super::{Acts, HostQuantView, Kernel, OutPtr, Shape, BLOCK};

    /// `-1` lanes then `0` lanes: `LANE_MASK[8 - k..]` keeps the first `k` lanes.
    static LANE_MASK: [i32; 16] = [-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0];

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    #[inline(always)]
    unsafe fn h2f(h: u16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
    }

    /// Quantizes 32 floats to int8 with `d = max|x| / 127`; returns `(d, Σ q)`. Matches
    /// `quantize_block_scalar` exactly (same `d`, `1/d` and round-half-to-even).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn quantize_block(x: &[f32; BLOCK], q: &mut [i8; BLOCK]) -> (f32, i32) {
        let p = x.as_ptr();
        let v = [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)), _mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24))];
        let sign = _mm256_set1_ps(-0.0);
        let a = _mm256_max_ps(
            _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
            _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])),
        );
        let nan = _mm256_or_ps(
            _mm256_or_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(v[0], v[0]), _mm256_cmp_ps::<_CMP_UNORD_Q>(v[1], v[1])),
            _mm256_or_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(v[2], v[2]), _mm256_cmp_ps::<_CMP_UNORD_Q>(v[3], v[3])),
        );
        let m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_movehdup_ps(m));
        let amax = _mm_cvtss_f32(m);
        let d = if _mm256_movemask_ps(nan) != 0 { f32::NAN } else { amax / 127.0 };
        let id = _mm256_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
        const RN: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        let i0 = _mm256_cvtps_epi32(_mm256_round_ps::<RN>(_mm256_mul_ps(v[0], id)));
        let i1 = _mm256_cvtps_epi32(_mm256_round_ps::<RN>(_mm256_mul_ps(v[1], id)));
        let i2 = _mm256_cvtps_epi32(_mm256_round_ps::<RN>(_mm256_mul_ps(v[2], id)));
        let i3 = _mm256_cvtps_epi32(_mm256_round_ps::<RN>(_mm256_mul_ps(v[3], id)));
        // Saturating packs interleave the 128-bit lanes; the permute restores column order.
        let p16 = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        let p8 = _mm256_permutevar8x32_epi32(p16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(q.as_mut_ptr().cast(), p8);
        // Sum the stored (saturated) values so that the sum always matches `q`.
        let wide = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(p8)), _mm256_set1_epi16(1));
        let wide2 = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(p8)), _mm256_set1_epi16(1));
        let s = _mm256_add_epi32(wide, wide2);
        let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        (d, _mm_cvtsi128_si32(s))
    }

    /// How group scales spread over the 8 blocks of an octet.
    #[derive(Clone, Copy)]
    enum Spread {
        /// `bpg = 2^k`: the octet starting at block `b0` uses groups `b0 >> k ..`, lane `i` group
        /// `(b0 + i) >> k`.
        Pow2(u32),
        /// Any other blocks-per-group: filled one lane at a time.
        Other,
    }

    /// The f16 values of `p[goff..goff + groups]` (a row's scales or mins) for blocks
    /// `b0..b0 + 8`, as f32; lanes past `kend` are zero.
    ///
    /// # Safety
    /// `p` is valid for `len` halves, `goff + (nb - 1) / bpg < len`, `b0 + kend <= nb`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn octet_f16<const G1: bool>(
        p: *const u16,
        len: usize,
        goff: usize,
        b0: usize,
        kend: usize,
        bpg: usize,
        spread: Spread,
        mask: __m256,
    ) -> __m256 {
        if G1 && goff + b0 + 8 <= len {
            let f = _mm256_cvtph_ps(_mm_loadu_si128(p.add(goff + b0).cast()));
            return if kend < 8 { _mm256_and_ps(f, mask) } else { f };
        }
        if let Spread::Pow2(k) = spread {
            let g0 = goff + (b0 >> k);
            let cnt = (8usize >> k).max(1);
            if g0 + cnt <= len {
                let q = p.add(g0);
                let raw = match cnt {
                    8 => _mm_loadu_si128(q.cast()),
                    4 => _mm_loadl_epi64(q.cast()),
                    2 => _mm_cvtsi32_si128(q.cast::<i32>().read_unaligned()),
                    _ => _mm_cvtsi32_si128(*q as i32),
                };
                let f = match k {
                    0 => _mm256_cvtph_ps(raw),
                    1 => _mm256_permutevar8x32_ps(
                        _mm256_castps128_ps256(_mm_cvtph_ps(raw)),
                        _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3),
                    ),
                    2 => _mm256_permutevar8x32_ps(
                        _mm256_castps128_ps256(_mm_cvtph_ps(raw)),
                        _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1),
                    ),
                    _ => _mm256_set1_ps(_mm_cvtss_f32(_mm_cvtph_ps(raw))),
                };
                return if kend < 8 { _mm256_and_ps(f, mask) } else { f };
            }
        }
        let mut t = [0.0f32; 8];
        let (mut g, mut pos) = (b0 / bpg, b0 % bpg);
        for v in t.iter_mut().take(kend) {
            *v = h2f(*p.add(goff + g));
            pos += 1;
            if pos == bpg {
                pos = 0;
                g += 1;
            }
        }
        _mm256_loadu_ps(t.as_ptr())
    }

    fn spread(bpg: usize) -> Spread {
        if bpg.is_power_of_two() {
            Spread::Pow2(bpg.trailing_zeros())
        } else {
            Spread::Other
        }
    }

    /// Row tiles ahead to prefetch: the next tile's weights are requested while this one computes,
    /// which lets the short per-chunk streams run at memory speed (the hardware prefetcher stops at
    /// 4 KiB pages and ramps up slowly).
    const PREFETCH_TILES: usize = 1;

    /// Prefetches the packed bytes, scales and mins of rows `r..r + count` into L1 (addresses past
    /// the end are harmless: prefetches never fault).
    #[inline(always)]
    unsafe fn prefetch_rows_ahead(w: &HostQuantView<'_>, r: usize, count: usize, row_bytes: usize, groups: usize) {
        let lines = |base: *const u8, start: usize, len: usize| {
            let mut off = start;
            while off < start + len {
                _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(off).cast());
                off += 64;
            }
        };
        lines(w.packed.as_ptr(), r * row_bytes, count * row_bytes);
        lines(w.scales.as_ptr().cast(), r * groups * 2, count * groups * 2);
        if let Some(m) = w.mins {
            lines(m.as_ptr().cast(), r * groups * 2, count * groups * 2);
        }
    }

    /// Writes the `R x NA` results of a tile into `out[j + t][r0 + i]`.
    #[inline(always)]
    unsafe fn write_tile<const R: usize, const NA: usize>(
        acc: &[[__m256; NA]; R],
        out: OutPtr,
        rows: usize,
        r0: usize,
        j: usize,
    ) {
        for (i, a) in acc.iter().enumerate() {
            for (t, v) in a.iter().enumerate() {
                out.write((j + t) * rows + r0 + i, hsum(*v));
            }
        }
    }

    /// Int4 rows `rows` against activation rows `j..j + na`, written to `out`.
    ///
    /// # Safety
    /// AVX2/FMA/F16C present; `w` validated int4 for `sh`; `acts` quantized for `sh` in
    /// `Layout::Pairs`; `rows.end <= sh.rows`, `j + na <= sh.n`, `na <= MAX_NA`; nobody else
    /// writes these output rows meanwhile.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn int4_rows(
        sh: &Shape,
        w: &HostQuantView<'_>,
        acts: &Acts,
        rows: Range<usize>,
        j: usize,
        na: usize,
        out: OutPtr,
    ) {
        // Four independent accumulators per tile hide the FMA latency.
        match na {
            1 => int4_rows_tiled::<4, 1>(sh, w, acts, rows, j, out),
            2 => int4_rows_tiled::<2, 2>(sh, w, acts, rows, j, out),
            3 => int4_rows_tiled::<1, 3>(sh, w, acts, rows, j, out),
            _ => int4_rows_tiled::<1, 4>(sh, w, acts, rows, j, out),
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn int4_rows_tiled<const R: usize, const NA: usize>(
        sh: &Shape,
        w: &HostQuantView<'_>,
        acts: &Acts,
        rows: Range<usize>,
        j: usize,
        out: OutPtr,
    ) {
        let mut r = rows.start;
        let g1 = sh.bpg == 1;
        while r + R <= rows.end {
            prefetch_rows_ahead(w, r + PREFETCH_TILES * R, R, sh.cols / 2, sh.groups);
            let acc = if g1 {
                int4_tile::<R, NA, true>(sh, w, acts, r, j)
            } else {
                int4_tile::<R, NA, false>(sh, w, acts, r, j)
            };
            write_tile(&acc, out, sh.rows, r, j);
            r += R;
        }
        while r < rows.end {
            let acc = int4_tile::<1, NA, false>(sh, w, acts, r, j);
            write_tile(&acc, out, sh.rows, r, j);
            r += 1;
        }
    }

    /// Index vectors that spread lanes `2q` and `2q + 1` of a factor octet over the low and
    /// high 128-bit halves (the two blocks of pair `q`).
    static PAIR_IDX: [[i32; 8]; 4] =
        [[0, 0, 0, 0, 1, 1, 1, 1], [2, 2, 2, 2, 3, 3, 3, 3], [4, 4, 4, 4, 5, 5, 5, 5], [6, 6, 6, 6, 7, 7, 7, 7]];

    /// Weight rows `r0..r0 + R` against activation rows `j..j + NA`: the per-lane partial sums
    /// (summed horizontally by the caller).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn int4_tile<const R: usize, const NA: usize, const G1: bool>(
        sh: &Shape,
        w: &HostQuantView<'_>,
        acts: &Acts,
        r0: usize,
        j: usize,
    ) -> [[__m256; NA]; R] {
        let nb = sh.nb;
        let sc = w.scales.as_ptr().cast::<u16>();
        let mn = w.mins.unwrap_or_default().as_ptr().cast::<u16>();
        let len = w.scales.len();
        let spread = spread(sh.bpg);
        let mut wrow = [std::ptr::null::<u8>(); R];
        let mut goff = [0usize; R];
        for i in 0..R {
            wrow[i] = w.packed.as_ptr().add((r0 + i) * sh.cols / 2);
            goff[i] = (r0 + i) * sh.groups;
        }
        let mut qx = [std::ptr::null::<i8>(); NA];
        let mut dx = [std::ptr::null::<f32>(); NA];
        let mut sx = [std::ptr::null::<f32>(); NA];
        for t in 0..NA {
            qx[t] = acts.qs.as_ptr().add((j + t) * sh.cols);
            dx[t] = acts.d.as_ptr().add((j + t) * sh.nbp);
            sx[t] = acts.s.as_ptr().add((j + t) * sh.nbp);
        }
        let low = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); NA]; R];
        let mut b0 = 0;
        while b0 < nb {
            let kend = (nb - b0).min(8);
            let mask = _mm256_loadu_ps(LANE_MASK.as_ptr().add(8 - kend).cast());
            // Per (row, activation row): the 8 block factors scale_w * d_x, and the min term
            // min_w * s_x of the 8 blocks folded straight into the accumulator lanes.
            let mut fac = [[_mm256_setzero_ps(); NA]; R];
            for i in 0..R {
                let sv = octet_f16::<G1>(sc, len, goff[i], b0, kend, sh.bpg, spread, mask);
                let mv = octet_f16::<G1>(mn, len, goff[i], b0, kend, sh.bpg, spread, mask);
                for t in 0..NA {
                    fac[i][t] = _mm256_mul_ps(sv, _mm256_loadu_ps(dx[t].add(b0)));
                    acc[i][t] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(sx[t].add(b0)), acc[i][t]);
                }
            }
            // Pairs of blocks: 32 weight bytes hold both blocks; low nibbles are the low 16
            // columns of each, high nibbles the high 16, matching the `Layout::Pairs` activations.
            // Pair sums of maddubs stay below 2 * 2 * 15 * 127 < i16::MAX.
            let pair = |q: usize, acc: &mut [[__m256; NA]; R]| {
                let b = b0 + 2 * q;
                let idx = _mm256_loadu_si256(PAIR_IDX[q].as_ptr().cast());
                let mut xl = [_mm256_setzero_si256(); NA];
                let mut xh = [_mm256_setzero_si256(); NA];
                for t in 0..NA {
                    xl[t] = _mm256_loadu_si256(qx[t].add(b * BLOCK).cast());
                    xh[t] = _mm256_loadu_si256(qx[t].add(b * BLOCK + 32).cast());
                }
                for i in 0..R {
                    let v = _mm256_loadu_si256(wrow[i].add(b * 16).cast());
                    let lo = _mm256_and_si256(v, low);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                    for t in 0..NA {
                        let s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl[t]), _mm256_maddubs_epi16(hi, xh[t]));
                        let dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
                        let f = _mm256_permutevar8x32_ps(fac[i][t], idx);
                        acc[i][t] = _mm256_fmadd_ps(dot, f, acc[i][t]);
                    }
                }
            };
            if kend == 8 {
                for q in 0..4 {
                    pair(q, &mut acc);
                }
            } else {
                for q in 0..kend / 2 {
                    pair(q, &mut acc);
                }
                if kend % 2 == 1 {
                    // The row's last block, unpaired: plain activation layout.
                    let k = kend - 1;
                    let b = b0 + k;
                    let shift = _mm256_setr_epi64x(0, 0, 4, 4);
                    let idx = _mm256_set1_epi32(k as i32);
                    for i in 0..R {
                        let raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(wrow[i].add(b * 16).cast()));
                        let wq = _mm256_and_si256(_mm256_srlv_epi64(raw, shift), low);
                        for t in 0..NA {
                            let xq = _mm256_loadu_si256(qx[t].add(b * BLOCK).cast());
                            let dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wq, xq), ones);
                            let f = _mm256_permutevar8x32_ps(fac[i][t], idx);
                            acc[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), f, acc[i][t]);
                        }
                    }
                }
            }
            b0 += 8;
        }
        acc
    }

    /// Int8 rows `rows` against activation rows `j..j + na`, written to `out`.
    ///
    /// # Safety
    /// As [`int4_rows`], for an int8 weight and `Layout::Plain` activations.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn int8_rows(
        sh: &Shape,
        w: &HostQuantView<'_>,
        acts: &Acts,
        rows: Range<usize>,
        j: usize,
        na: usize,
        out: OutPtr,
    ) {
        match na {
            1 => int8_rows_tiled::<4, 1>(sh, w, acts, rows, j, out),
            2 => int8_rows_tiled::<2, 2>(sh, w, acts, rows, j, out),
            3 => int8_rows_tiled::<1, 3>(sh, w, acts, rows, j, out),
            _ => int8_rows_tiled::<1, 4>(sh, w, acts, rows, j, out),
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn int8_rows_tiled<const R: usize, const NA: usize>(
        sh: &Shape,
        w: &HostQuantView<'_>,
        acts: &Acts,
        rows: Range<usize>,
        j: usize,
        out: OutPtr,
    ) {
        let mut r = rows.start;
        let g1 = sh.bpg == 1;
        while r + R <= rows.end {
            prefetch_rows_ahead(w, r + PREFETCH_TILES * R, R, sh.cols, sh.groups);
            let acc = if g1 {
                int8_tile::<R, NA, true>(sh, w, acts, r, j)
            } else {
                int8_tile::<R, NA, false>(sh, w, acts, r, j)
            };
            write_tile(&acc, out, sh.rows, r, j);
            r += R;
        }
        while r < rows.end {
            let acc = int8_tile::<1, NA, false>(sh, w, acts, r, j);
            write_tile(&acc, out, sh.rows, r, j);
            r += 1;
        }
    }

    /// Index vectors broadcasting lane `k` of a factor octet.
    static LANE_IDX: [[i32; 8]; 8] = [[0; 8], [1; 8], [2; 8], [3; 8], [4; 8], [5; 8], [6; 8], [7; 8]];

    /// Int8 weight rows `r0..r0 + R` against activation rows `j..j + NA`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn int8_tile<const R: usize, const NA: usize, const G1: bool>(
        sh: &Shape,
        w: &HostQuantView<'_>,
        acts: &Acts,
        r0: usize,
        j: usize,
    ) -> [[__m256; NA]; R] {
        let nb = sh.nb;
        let sc = w.scales.as_ptr().cast::<u16>();
        let len = w.scales.len();
        let spread = spread(sh.bpg);
        let mut wrow = [std::ptr::null::<u8>(); R];
        let mut goff = [0usize; R];
        for i in 0..R {
            wrow[i] = w.packed.as_ptr().add((r0 + i) * sh.cols);
            goff[i] = (r0 + i) * sh.groups;
        }
        let mut qx = [std::ptr::null::<i8>(); NA];
        let mut dx = [std::ptr::null::<f32>(); NA];
        for t in 0..NA {
            qx[t] = acts.qs.as_ptr().add((j + t) * sh.cols);
            dx[t] = acts.d.as_ptr().add((j + t) * sh.nbp);
        }
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); NA]; R];
        let mut b0 = 0;
        while b0 < nb {
            let kend = (nb - b0).min(8);
            let mask = _mm256_loadu_ps(LANE_MASK.as_ptr().add(8 - kend).cast());
            let mut fac = [[_mm256_setzero_ps(); NA]; R];
            for i in 0..R {
                let sv = octet_f16::<G1>(sc, len, goff[i], b0, kend, sh.bpg, spread, mask);
                for t in 0..NA {
                    fac[i][t] = _mm256_mul_ps(sv, _mm256_loadu_ps(dx[t].add(b0)));
                }
            }
            let block = |k: usize, acc: &mut [[__m256; NA]; R]| {
                let b = b0 + k;
                let idx = _mm256_loadu_si256(LANE_IDX[k].as_ptr().cast());
                let mut xq = [_mm256_setzero_si256(); NA];
                for t in 0..NA {
                    xq[t] = _mm256_loadu_si256(qx[t].add(b * BLOCK).cast());
                }
                for i in 0..R {
                    let wv = _mm256_loadu_si256(wrow[i].add(b * BLOCK).cast());
                    // maddubs wants unsigned x signed: |w| x (x with w's sign). |w| <= 128 and
                    // |x| <= 127, so the pair sums stay below i16::MAX.
                    let wabs = _mm256_sign_epi8(wv, wv);
                    for t in 0..NA {
                        let p = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xq[t], wv));
                        let dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
                        acc[i][t] = _mm256_fmadd_ps(dot, _mm256_permutevar8x32_ps(fac[i][t], idx), acc[i][t]);
                    }
                }
            };
            if kend == 8 {
                for k in 0..8 {
                    block(k, &mut acc);
                }
            } else {
                for k in 0..kend {
                    block(k, &mut acc);
                }
            }
            b0 += 8;
        }
        acc
    }

    /// Exact path: rows `rows` against f32 activation rows `j..j + na`, written to `out`.
    ///
    /// # Safety
    /// AVX2/FMA/F16C present; `w` validated for `sh` and `kernel`; `x.len() == n * cols`;
    /// `rows.end <= sh.rows`, `j + na <= sh.n`, `na <= MAX_NA`; nobody else writes these rows.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn exact_rows(
        sh: &Shape,
        w: &HostQuantView<'_>,
        x: &[f32],
        rows: Range<usize>,
        j: usize,
        na: usize,
        kernel: Kernel,
        out: OutPtr,
    ) {
        match (kernel, na) {
            (Kernel::Int4, 1) => exact_rows_na::<true, 1, 4>(sh, w, x, rows, j, out),
            (Kernel::Int4, 2) => exact_rows_na::<true, 2, 2>(sh, w, x, rows, j, out),
            (Kernel::Int4, 3) => exact_rows_na::<true, 3, 2>(sh, w, x, rows, j, out),
            (Kernel::Int4, _) => exact_rows_na::<true, 4, 2>(sh, w, x, rows, j, out),
            (Kernel::Int8, 1) => exact_rows_na::<false, 1, 4>(sh, w, x, rows, j, out),
            (Kernel::Int8, 2) => exact_rows_na::<false, 2, 2>(sh, w, x, rows, j, out),
            (Kernel::Int8, 3) => exact_rows_na::<false, 3, 2>(sh, w, x, rows, j, out),
            (Kernel::Int8, _) => exact_rows_na::<false, 4, 2>(sh, w, x, rows, j, out),
        }
    }

    /// Each weight block is dequantized in registers to exactly the reference values
    /// (`q * scale + min`: `q * scale` is exact in f32, so the FMA rounds once, like the
    /// reference) and multiplied into `NA` activation rows with `A` accumulators each.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn exact_rows_na<const INT4: bool, const NA: usize, const A: usize>(
        sh: &Shape,
        w: &HostQuantView<'_>,
        x: &[f32],
        rows: Range<usize>,
        j: usize,
        out: OutPtr,
    ) {
        let row_bytes = if INT4 { sh.cols / 2 } else { sh.cols };
        let low = _mm_set1_epi8(0x0F);
        let mut xs = [std::ptr::null::<f32>(); NA];
        for (t, p) in xs.iter_mut().enumerate() {
            *p = x.as_ptr().add((j + t) * sh.cols);
        }
        for r in rows {
            prefetch_rows_ahead(w, r + 2, 1, row_bytes, sh.groups);
            let wrow = w.packed.as_ptr().add(r * row_bytes);
            let sc = w.scales.as_ptr().cast::<u16>().add(r * sh.groups);
            let mn = w.mins.unwrap_or_default().as_ptr().cast::<u16>();
            let mut acc = [[_mm256_setzero_ps(); A]; NA];
            let mut b = 0;
            for g in 0..sh.groups {
                let s = _mm256_set1_ps(h2f(*sc.add(g)));
                let m = if INT4 { _mm256_set1_ps(h2f(*mn.add(r * sh.groups + g))) } else { _mm256_setzero_ps() };
                for _ in 0..sh.bpg {
                    let mut wv = [_mm256_setzero_ps(); 4];
                    if INT4 {
                        let raw = _mm_loadu_si128(wrow.add(b * 16).cast());
                        let lo = _mm_and_si128(raw, low);
                        let hi = _mm_and_si128(_mm_srli_epi16::<4>(raw), low);
                        let q = [lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)];
                        for i in 0..4 {
                            wv[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q[i])), s, m);
                        }
                    } else {
                        for (i, v) in wv.iter_mut().enumerate() {
                            let q = _mm_loadl_epi64(wrow.add(b * BLOCK + i * 8).cast());
                            *v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), s);
                        }
                    }
                    for t in 0..NA {
                        let xb = xs[t].add(b * BLOCK);
                        for i in 0..4 {
                            acc[t][i % A] = _mm256_fmadd_ps(wv[i], _mm256_loadu_ps(xb.add(i * 8)), acc[t][i % A]);
                        }
                    }
                    b += 1;
                }
            }
            for (t, a) in acc.iter().enumerate() {
                let mut v = a[0];
                for ai in &a[1..] {
                    v = _mm256_add_ps(v, *ai);
                }
                out.write((j + t) * sh.rows + r, hsum(v));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;
    use tm_quant::{dequantize, quantize_int4, quantize_int8, HostQuant};

    /// xorshift64* in `[-1, 1)`.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> f32 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            let v = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
            v as f32 / (1u64 << 23) as f32 - 1.0
        }
        fn vec(&mut self, len: usize, offset: f32) -> Vec<f32> {
            (0..len).map(|_| self.next() + offset).collect()
        }
        fn byte(&mut self) -> u8 {
            ((self.next() + 1.0) * 128.0) as u8
        }
    }

    fn naive(x: &[f32], n: usize, w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        let mut out = vec![0.0; n * rows];
        for j in 0..n {
            for r in 0..rows {
                let s: f64 = (0..cols).map(|c| x[j * cols + c] as f64 * w[r * cols + c] as f64).sum();
                out[j * rows + r] = s as f32;
            }
        }
        out
    }

    fn norm(v: &[f32]) -> f32 {
        v.iter().map(|a| a * a).sum::<f32>().sqrt()
    }

    /// `Σ |x| |w|` per output: the scale of f32 summation rounding.
    fn abs_dot(x: &[f32], n: usize, w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        let xa: Vec<f32> = x.iter().map(|v| v.abs()).collect();
        let wa: Vec<f32> = w.iter().map(|v| v.abs()).collect();
        naive(&xa, n, &wa, rows, cols)
    }

    /// The activations as the fast path sees them: quantized with the scalar reference quantizer
    /// and expanded back to f32.
    fn requantized(x: &[f32]) -> Vec<f32> {
        let mut out = Vec::with_capacity(x.len());
        for xb in x.chunks_exact(BLOCK) {
            let mut q = [0i8; BLOCK];
            let (d, _) = quantize_block_scalar(xb.try_into().unwrap(), &mut q);
            out.extend(q.iter().map(|&v| v as f32 * d));
        }
        out
    }

    fn isas() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2].into_iter().filter(|i| i.available()).collect()
    }

    type Mm = fn(Isa, &[f32], usize, &HostQuantView<'_>, &mut [f32]) -> Result<()>;

    /// Checks the fast and exact paths of every instruction set against the reference.
    fn check_all(q: &HostQuant, n: usize, x: &[f32], fast: Mm, exact: Mm, label: &str) {
        let (rows, cols) = (q.rows, q.cols);
        let wd = dequantize(q).unwrap();
        let reference = naive(x, n, &wd, rows, cols);
        let xq = requantized(x);
        let reference_q = naive(&xq, n, &wd, rows, cols);
        let mag = abs_dot(x, n, &wd, rows, cols);
        let mut fast_results = Vec::new();
        for isa in isas() {
            let mut out = vec![f32::NAN; n * rows];
            fast(isa, x, n, &q.view(), &mut out).unwrap();
            let mut ex = vec![f32::NAN; n * rows];
            exact(isa, x, n, &q.view(), &mut ex).unwrap();
            for j in 0..n {
                let xn = norm(&x[j * cols..(j + 1) * cols]);
                for r in 0..rows {
                    let i = j * rows + r;
                    let wn = norm(&wd[r * cols..(r + 1) * cols]);
                    let slack = 2e-6 * mag[i] + 1e-6;
                    // Exact path: only summation order separates it from the reference.
                    assert!(
                        (ex[i] - reference[i]).abs() <= slack,
                        "{label} {isa:?} exact ({j},{r}): {} vs {}",
                        ex[i],
                        reference[i]
                    );
                    // Fast path: exactly the product with the int8-rounded activations...
                    let mag_q = mag[i] * 1.01 + 1e-6;
                    assert!(
                        (out[i] - reference_q[i]).abs() <= 2e-6 * mag_q,
                        "{label} {isa:?} fast vs requantized ({j},{r}): {} vs {}",
                        out[i],
                        reference_q[i]
                    );
                    // ...and within the documented bound of the unrounded product.
                    let bound = ACT_QUANT_REL_ERROR * xn * wn + slack;
                    assert!(
                        (out[i] - reference[i]).abs() <= bound,
                        "{label} {isa:?} fast ({j},{r}): {} vs {} (bound {bound})",
                        out[i],
                        reference[i]
                    );
                }
            }
            fast_results.push((isa, out, mag.clone()));
        }
        // Scalar and AVX2 differ only in f32 summation order.
        if let [(_, a, m), (_, b, _)] = fast_results.as_slice() {
            for i in 0..a.len() {
                assert!(
                    (a[i] - b[i]).abs() <= 1e-6 * m[i] + 1e-7,
                    "{label} scalar vs avx2 at {i}: {} vs {}",
                    a[i],
                    b[i]
                );
            }
        }
    }

    const SHAPES: &[(usize, usize, usize)] = &[
        (37, 256, 32),
        (37, 256, 128),
        (1, 32, 32),
        (5, 96, 32),
        (19, 576, 32),
        (7, 192, 64),
        (9, 384, 128),
        (11, 576, 64),
        (3, 288, 96),
        (4, 768, 256),
        (3, 1536, 512),
        (301, 320, 32),
        (6, 480, 32),
        (9, 224, 32),
        (13, 64, 64),
    ];

    #[test]
    fn int4_matches_dequantized_reference() {
        let mut rng = Rng(0x1234_5678_9ABC_DEF1);
        for &(rows, cols, gs) in SHAPES {
            for n in [1, 7, 4, 2] {
                let w = rng.vec(rows * cols, 0.3);
                let q = quantize_int4(&w, rows, cols, gs).unwrap();
                let mut x = rng.vec(n * cols, 0.1);
                x[cols / 2] = 8.0; // an outlier
                let label = format!("int4 [{rows}x{cols}] gs {gs} n {n}");
                check_all(&q, n, &x, matmul_int4_with, matmul_int4_exact_with, &label);
            }
        }
    }

    #[test]
    fn int4_raw_random_parts() {
        // Every nibble value, arbitrary (also negative) scales and mins.
        let mut rng = Rng(42);
        for &(rows, cols, gs) in SHAPES {
            let groups = cols / gs;
            let q = HostQuant {
                rows,
                cols,
                group_size: gs,
                packed: (0..rows * cols / 2).map(|_| rng.byte()).collect(),
                scales: (0..rows * groups).map(|_| f16::from_f32(rng.next() * 0.05)).collect(),
                mins: Some((0..rows * groups).map(|_| f16::from_f32(rng.next() * 0.4)).collect()),
            };
            for n in [1, 7] {
                let x = rng.vec(n * cols, 0.0);
                check_all(&q, n, &x, matmul_int4_with, matmul_int4_exact_with, &format!("raw int4 {rows}x{cols}/{gs}"));
            }
        }
    }

    #[test]
    fn int8_matches_dequantized_reference() {
        let mut rng = Rng(7);
        for &(rows, cols, gs) in SHAPES {
            for n in [1, 7, 3] {
                let w = rng.vec(rows * cols, -0.2);
                let mut q = quantize_int8(&w, rows, cols, gs).unwrap();
                q.packed[0] = 0x80; // -128 is not produced by the quantizer but is valid input
                let x = rng.vec(n * cols, 0.0);
                let label = format!("int8 [{rows}x{cols}] gs {gs} n {n}");
                check_all(&q, n, &x, matmul_int8_with, matmul_int8_exact_with, &label);
            }
        }
    }

    #[test]
    fn activation_quantizers_agree() {
        let mut rng = Rng(99);
        let mut cases: Vec<[f32; BLOCK]> = (0..200)
            .map(|i| {
                let mut b = [0.0; BLOCK];
                let scale = 10f32.powi(i % 7 - 3);
                b.iter_mut().for_each(|v| *v = rng.next() * scale);
                b
            })
            .collect();
        cases.push([0.0; BLOCK]);
        let mut ties = [0.0f32; BLOCK];
        ties.iter_mut().enumerate().for_each(|(i, v)| *v = (i as f32 - 16.0) * 0.5);
        ties[0] = 127.0;
        cases.push(ties);
        for c in &cases {
            let mut qs = [0i8; BLOCK];
            let (ds, ss) = quantize_block_scalar(c, &mut qs);
            assert_eq!(ss, qs.iter().map(|&v| v as i32).sum::<i32>());
            if Isa::Avx2.available() {
                let mut qa = [0i8; BLOCK];
                let (da, sa) = quantize_block(Isa::Avx2, c, &mut qa);
                assert_eq!((qs, ds.to_bits(), ss), (qa, da.to_bits(), sa));
            }
        }
        let mut nan = [1.0f32; BLOCK];
        nan[3] = f32::NAN;
        for isa in isas() {
            assert!(quantize_block(isa, &nan, &mut [0; BLOCK]).0.is_nan());
        }
    }

    #[test]
    fn empty_and_degenerate_shapes() {
        let q = quantize_int4(&[], 0, 64, 32).unwrap();
        let mut out = vec![];
        matmul_int4(&[0.5; 128], 2, &q.view(), &mut out).unwrap();
        let q = quantize_int4(&[0.5; 64], 1, 64, 32).unwrap();
        matmul_int4(&[], 0, &q.view(), &mut out).unwrap();
        let q = HostQuant { rows: 3, cols: 0, group_size: 32, packed: vec![], scales: vec![], mins: Some(vec![]) };
        let mut out = vec![1.0; 6];
        matmul_int4(&[], 2, &q.view(), &mut out).unwrap();
        assert_eq!(out, vec![0.0; 6]);
    }

    #[test]
    fn concurrent_and_nested_calls() {
        // Calls from many rayon workers at once (each of which fans out again) must neither
        // deadlock nor share the thread-local activation buffer.
        let mut rng = Rng(11);
        let (rows, cols) = (96, 256);
        let q = quantize_int4(&rng.vec(rows * cols, 0.0), rows, cols, 64).unwrap();
        let xs: Vec<Vec<f32>> = (0..16).map(|i| rng.vec((i % 5 + 1) * cols, 0.0)).collect();
        let expect: Vec<Vec<f32>> = xs
            .iter()
            .map(|x| {
                let mut o = vec![0.0; x.len() / cols * rows];
                matmul_int4(x, x.len() / cols, &q.view(), &mut o).unwrap();
                o
            })
            .collect();
        let got: Vec<Vec<f32>> = xs
            .par_iter()
            .map(|x| {
                let mut o = vec![0.0; x.len() / cols * rows];
                matmul_int4(x, x.len() / cols, &q.view(), &mut o).unwrap();
                o
            })
            .collect();
        assert_eq!(got, expect);
    }

    #[test]
    fn malformed_inputs_are_errors() {
        let q4 = quantize_int4(&[0.5; 128], 2, 64, 32).unwrap();
        let q8 = quantize_int8(&[0.5; 128], 2, 64, 32).unwrap();
        let x = vec![1.0; 64];
        let mut out = vec![0.0; 2];
        assert!(matmul_int4(&x, 1, &q4.view(), &mut out).is_ok());
        assert!(matmul_int4(&x[1..], 1, &q4.view(), &mut out).is_err());
        assert!(matmul_int4(&x, 1, &q4.view(), &mut out[1..]).is_err());
        assert!(matmul_int4(&x, usize::MAX, &q4.view(), &mut out).is_err());
        assert!(matmul_int4(&x, 1, &q8.view(), &mut out).is_err());
        assert!(matmul_int8(&x, 1, &q4.view(), &mut out).is_err());
        assert!(matmul_int4_exact(&x, 1, &q8.view(), &mut out).is_err());
        assert!(matmul_int8_exact(&x, 2, &q8.view(), &mut out).is_err());
        let mut bad = q4.clone();
        bad.scales.pop();
        assert!(matmul_int4(&x, 1, &bad.view(), &mut out).is_err());
        let mut bad = q4.clone();
        bad.packed.push(0);
        assert!(matmul_int4(&x, 1, &bad.view(), &mut out).is_err());
        let mut bad = q8.clone();
        bad.group_size = 48;
        assert!(matmul_int8(&x, 1, &bad.view(), &mut out).is_err());
        if !Isa::Avx2.available() {
            assert!(matmul_int4_with(Isa::Avx2, &x, 1, &q4.view(), &mut out).is_err());
        }
    }

    /// A raw random int4 (Q4_1-like, group 32) or int8 (Q8_0-like) weight.
    fn raw_weight(rng: &mut Rng, rows: usize, cols: usize, int4: bool) -> HostQuant {
        let groups = cols / 32;
        HostQuant {
            rows,
            cols,
            group_size: 32,
            packed: (0..rows * cols / if int4 { 2 } else { 1 }).map(|_| rng.byte()).collect(),
            scales: (0..rows * groups).map(|_| f16::from_f32(0.01 + 0.01 * rng.next())).collect(),
            mins: int4.then(|| (0..rows * groups).map(|_| f16::from_f32(-0.08 + 0.01 * rng.next())).collect()),
        }
    }

    /// Matmul throughput for a SmolLM2-135M-shaped model: 30 layers of hidden 576, intermediate
    /// 1536, 9 q / 3 kv heads of 64 (q, k, v, o, gate, up, down in int4 group 32, i.e. Q4_1), and
    /// a 49152-row Q8_0 LM head; 96 MB of weights, streamed from memory once per step. Run with
    /// `cargo test --release -p tm-cpu --lib quant_matmul::tests::bench_smollm2 -- --ignored --nocapture`
    /// (`TM_QBENCH_QUICK=1`: only the fast path).
    ///
    /// "in pool" calls the kernels from a rayon worker (the forward pass inside `rayon::scope`),
    /// "outside" from a plain thread, which pays a cross-thread hand-off per call.
    #[test]
    #[ignore]
    fn bench_smollm2_135m() {
        use std::time::Instant;
        let (hidden, inter, layers, q_dim, kv_dim, vocab) = (576, 1536, 30, 9 * 64, 3 * 64, 49152);
        let mut rng = Rng(5);
        let shapes = [
            (q_dim, hidden),
            (kv_dim, hidden),
            (kv_dim, hidden),
            (hidden, q_dim),
            (inter, hidden),
            (inter, hidden),
            (hidden, inter),
        ];
        let model: Vec<Vec<HostQuant>> =
            (0..layers).map(|_| shapes.iter().map(|&(r, c)| raw_weight(&mut rng, r, c, true)).collect()).collect();
        let head = raw_weight(&mut rng, vocab, hidden, false);
        let layer_macs: usize = shapes.iter().map(|&(r, c)| r * c).sum();
        let (body_macs, head_macs) = (layer_macs * layers, vocab * hidden);
        let bytes = |q: &HostQuant| q.packed.len() + 2 * q.scales.len() + q.mins.as_ref().map_or(0, |m| 2 * m.len());
        let body_bytes: usize = model.iter().flatten().map(bytes).sum();
        let head_bytes = bytes(&head);
        println!(
            "threads {}, isa {:?}; weights: body {:.1} MB int4, head {:.1} MB int8; {:.1} MFLOP per token",
            rayon::current_num_threads(),
            Isa::best(),
            body_bytes as f64 / 1e6,
            head_bytes as f64 / 1e6,
            2.0 * (body_macs + head_macs) as f64 / 1e6
        );
        type F = fn(&[f32], usize, &HostQuantView<'_>, &mut [f32]) -> Result<()>;
        let quick = std::env::var_os("TM_QBENCH_QUICK").is_some();
        let mut cases: Vec<(&str, F, F, usize, bool)> =
            vec![("int8-act", matmul_int4, matmul_int8, 1, true), ("int8-act", matmul_int4, matmul_int8, 1, false)];
        if !quick {
            cases.extend([
                ("int8-act", matmul_int4 as F, matmul_int8 as F, 16, true),
                ("int8-act", matmul_int4, matmul_int8, 64, true),
                ("exact-f32", matmul_int4_exact, matmul_int8_exact, 1, true),
                ("exact-f32", matmul_int4_exact, matmul_int8_exact, 16, true),
            ]);
        }
        for (name, f4, f8, n, in_pool) in cases {
            let x_h = rng.vec(n * inter, 0.0);
            let mut out_h = vec![0.0; n * inter];
            let mut logits = vec![0.0; n * vocab];
            let reps = if n == 1 { 100 } else { (800 / n).max(3) };
            let mut times = Vec::with_capacity(reps);
            let mut run = || {
                for rep in 0..reps + 3 {
                    let t0 = Instant::now();
                    for layer in &model {
                        for q in layer {
                            f4(&x_h[..n * q.cols], n, &q.view(), &mut out_h[..n * q.rows]).unwrap();
                        }
                    }
                    let t1 = Instant::now();
                    f8(&x_h[..n * hidden], n, &head.view(), &mut logits).unwrap();
                    if rep >= 3 {
                        times.push(((t1 - t0).as_secs_f64(), t1.elapsed().as_secs_f64()));
                    }
                }
            };
            if in_pool {
                rayon::scope(|_| run());
            } else {
                run();
            }
            let median = |mut v: Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            let body_t = median(times.iter().map(|t| t.0).collect());
            let head_t = median(times.iter().map(|t| t.1).collect());
            let total = median(times.iter().map(|t| t.0 + t.1).collect());
            let gflops = |macs: usize, t: f64| 2.0 * (macs * n) as f64 / t / 1e9;
            println!(
                "{name:9} n={n:2} {:7}: {:6.2} ms/step = {:6.1} tok/s, {:5.1} GFLOP/s; body {:5.2} ms \
                 {:5.1} GB/s; head {:5.2} ms {:5.1} GB/s",
                if in_pool { "in pool" } else { "outside" },
                total * 1e3,
                n as f64 / total,
                gflops(body_macs + head_macs, total),
                body_t * 1e3,
                body_bytes as f64 / body_t / 1e9,
                head_t * 1e3,
                head_bytes as f64 / head_t / 1e9,
            );
        }
    }

    /// Single matrices at n = 1, hot in cache, on 1 and 2 threads:
    /// `cargo test --release -p tm-cpu --lib quant_matmul::tests::bench_hot -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn bench_hot_single_matrices() {
        use std::time::Instant;
        let mut rng = Rng(5);
        for &(rows, cols, int4) in
            &[(1536usize, 576usize, true), (576, 1536, true), (192, 576, true), (8192, 576, true), (8192, 576, false)]
        {
            let q = raw_weight(&mut rng, rows, cols, int4);
            let bytes = q.packed.len() + 2 * q.scales.len() + q.mins.as_ref().map_or(0, |m| 2 * m.len());
            let x = rng.vec(cols, 0.0);
            let mut out = vec![0.0; rows];
            for threads in [1usize, 2] {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                pool.install(|| {
                    let f = if int4 { matmul_int4 } else { matmul_int8 };
                    let reps = 2000;
                    for _ in 0..10 {
                        f(&x, 1, &q.view(), &mut out).unwrap();
                    }
                    let t = Instant::now();
                    for _ in 0..reps {
                        f(&x, 1, &q.view(), &mut out).unwrap();
                    }
                    let dt = t.elapsed().as_secs_f64() / reps as f64;
                    println!(
                        "{} {rows}x{cols} {threads}t: {:7.2} us, {:.2} ns/block, {:5.1} GB/s, {:5.1} GFLOP/s",
                        if int4 { "int4" } else { "int8" },
                        dt * 1e6,
                        dt * 1e9 / (rows * cols / 32) as f64,
                        bytes as f64 / dt / 1e9,
                        2.0 * (rows * cols) as f64 / dt / 1e9
                    );
                });
            }
        }
    }
}
