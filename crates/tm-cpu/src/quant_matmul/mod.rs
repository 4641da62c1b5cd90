//! Quantized matrix products on the CPU: `out[n, rows] = x[n, cols] · Wᵀ` with `W` in tm's int4 or
//! int8 group layout ([`tm_core::quant`]), dequantized on the fly (the f32 matrix is never built).
//!
//! # Three ways to compute
//! - [`matmul_int4`] / [`matmul_int8`] (the default): each call first quantizes every activation
//!   row to **int16** in blocks of 32 (`x ≈ q_x · d_x` with `d_x = max|x| / 32767`, and
//!   `s_x = d_x · Σ q_x` kept per block), then for each weight block computes the exact integer
//!   dot product `Σ q_w · q_x` (i16 × i16 → i32 `madd`, or `vpdpwssd` with AVX-VNNI) and combines
//!   `out = Σ_blocks scale_w · d_x · (Σ q_w · q_x) + min_w · s_x` (int8 weights have no min term).
//!   On SmolLM2-135M (Q4_1, Q8_0 head) its logits are within 0.012 (3e-4 of the largest logit) of
//!   the exact path's and within 0.005 of transformers' on the top 64 tokens; int8 activations are
//!   off by up to 2.2 and 0.86, enough to change a greedy answer.
//! - [`matmul_int4_q8`] / [`matmul_int8_q8`]: the same with **int8** activations
//!   (`d_x = max|x| / 127`, like llama.cpp's `Q8_1`): `maddubs` dots, 256 times less accurate
//!   (see below), about 10% faster at decode and 20% at prefill. Opt-in.
//! - [`matmul_int4_exact`] / [`matmul_int8_exact`]: f32 activations; each weight block is
//!   dequantized in registers to exactly the values [`tm_quant::dequantize`] gives, and the dot is
//!   f32 FMA. Only f32 summation rounding separates it from dequantize-then-matmul; 2.6 times
//!   slower than the int16 path at decode, 2 times at prefill.
//!
//! # Error of the quantized-activation paths
//! Rounding the activations to `Q` levels (`Q = 32767` or `127`) moves each element by at most
//! `d_x / 2 = max|x_b| / 2Q` of its block `b`, so for an activation row `x` the rounding error
//! vector `e` has `‖e‖² ≤ Σ_blocks 32 · (max|x_b| / 2Q)² ≤ 8 ‖x‖² / Q²`. By Cauchy–Schwarz the
//! error of one output is then at most `‖w‖ · ‖e‖ ≤ (2√2 / Q) · ‖x‖ · ‖w‖`, where `w` is the
//! dequantized weight row: [`ACT_QUANT_REL_ERROR`] (`8.6e-5`) for int16 activations,
//! [`ACT_Q8_REL_ERROR`] (`0.022`) for int8; on top of that only f32 summation rounding (the
//! integer dots are exact, and their conversion to f32 is exact for int4 weights). The bound is
//! for adversarial data; for ordinary (uncorrelated) data the rounding errors are independent and
//! the error is about `(0.6 / Q) · ‖x‖ · ‖w‖ / √cols` (measured with int8 activations: worst of
//! 64 outputs `4e-4` at 576 columns, 50 times below the bound). Blocks holding outliers are the
//! weak spot: their other elements get the outlier's step size. Non-finite activations give
//! non-finite outputs (a block holding a NaN gets `d_x = NaN`, one holding an infinity
//! `d_x = ∞`).
//!
//! # Implementation
//! AVX2 (+FMA, F16C) kernels, with AVX-VNNI where the CPU has it, 512-bit int16-activation
//! kernels where it has AVX-512 VNNI (`q16_avx512.rs`), chosen at run time ([`Isa::best`]), and a
//! portable scalar path that is also the reference the vector paths are
//! tested against (all quantize the activations identically; they differ only in the order of
//! the f32 sums).
//!
//! - Rows of `W` are split into a few chunks per rayon thread (multiples of 4 rows). Calls from
//!   outside the rayon pool pay a cross-thread hand-off each (about 7 µs here); running the whole
//!   forward pass inside the pool (`rayon::scope(|_| ...)`) avoids it.
//! - A chunk is computed in register tiles of `R` weight rows × `NA` activation rows (4×1 for
//!   decode, 1×4 for prefill; 2×4 on AVX-512, which has the registers), so that one decoded
//!   weight block serves `NA` activation rows and
//!   there are several independent accumulators. For prefill the weight rows are also tiled so
//!   that a tile stays in L1 while all activation rows pass over it.
//! - Two 32-column blocks are processed per 32 weight bytes (int4) or 64 (int8), and the
//!   quantized activations are stored in the order the weights decode in, so no shuffles are
//!   needed in the inner loop: the two blocks' partial sums land in the two 128-bit halves of one
//!   register. int16 activations (`q16.rs`): the int4 bytes are read as 16-bit words, and a mask,
//!   two shifts-and-masks and one shift give four vectors of 16 nibbles each (columns `2k`,
//!   `2k + 16`, `2k + 1`, `2k + 17` of both blocks), each multiplied with one `madd`; int8 bytes
//!   are sign-extended in place (shift left, arithmetic shift right) into the same four vectors.
//!   int8 activations (`q8.rs`): two `maddubs` per block pair.
//! - The next row tile is prefetched in software while the current one computes: the per-chunk
//!   streams are short and the hardware prefetcher stops at 4 KiB pages (about 1.4× at n = 1).
//! - The quantized activations live in a thread-local buffer that is reused across calls (taken
//!   out for the duration of a call, so re-entrant calls are safe).
//!
//! # Speed
//! Measured on the 2-core x86-64 development VM (Sapphire Rapids, AVX-VNNI; SmolLM2-135M-shaped
//! weights, 66 MB int4 body and 30 MB int8 head, `tests::bench_smollm2_135m`, called from inside
//! the pool), milliseconds per step of all 211 matrix products:
//!
//! | path        | n = 1 | n = 16 | n = 64 |
//! |-------------|-------|--------|--------|
//! | int16 acts  | 3.3   | 31     | 118    |
//! | int8 acts   | 3.0   | 28     | 104    |
//! | exact f32   | 8.8   | 56     | 216    |
//!
//! Without AVX-VNNI the int16 path's kernels take about 15% longer. The machine's memory
//! bandwidth varies with its neighbours; the n = 1 numbers can double.
//!
//! The int16 path on AVX-512 against AVX-VNNI, alternated in one process
//! (`TM_QBENCH_ISAS=AvxVnni,Avx512Vnni TM_QBENCH_N=1,16,64`, three runs, medians): n = 1 3.7-3.9
//! vs 3.4-3.6 ms, n = 16 35.3-37.1 vs 27.8-30.1 ms, n = 64 137-162 vs 104-111 ms (about 1.3x for
//! prefill; the 512-bit `vpdpwssd` has 1.5x the 256-bit one's throughput here, and the decode,
//! factor and conversion work per multiply-add halves).

use std::cell::Cell;
use std::ops::Range;

use rayon::prelude::*;
use tm_core::{Error, Result};
use tm_quant::{QuantKind, BLOCK};

pub use tm_quant::HostQuantView;

mod exact;
mod q16;
#[cfg(target_arch = "x86_64")]
mod q16_avx512;
mod q8;
#[cfg(target_arch = "x86_64")]
pub(crate) mod simd;
#[cfg(test)]
pub(crate) mod tests;

/// Bound on the error of [`matmul_int4`] / [`matmul_int8`] (int16 activations) relative to
/// dequantize-then-f32-matmul, per output element, as a multiple of `‖x_row‖₂ · ‖w_row‖₂`:
/// `2√2 / 32767` (see the module docs), rounded up.
pub const ACT_QUANT_REL_ERROR: f32 = 8.633e-5;

/// The same bound for [`matmul_int4_q8`] / [`matmul_int8_q8`] (int8 activations): `2√2 / 127`,
/// rounded up.
pub const ACT_Q8_REL_ERROR: f32 = 0.022_272;

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
    /// [`Isa::Avx2`] plus AVX-VNNI (Alder Lake, Sapphire Rapids, Zen 5 and later): the int16
    /// activation path fuses its multiply-adds into `vpdpwssd`; the other paths are as
    /// [`Isa::Avx2`].
    AvxVnni,
    /// [`Isa::Avx2`] plus AVX-512 F, BW and VNNI (Ice Lake server, Sapphire Rapids, Zen 4 and
    /// later): the int16 activation path runs on 512-bit vectors, four 32-column blocks a step
    /// (`q16_avx512.rs`); the other paths are as [`Isa::Avx2`].
    Avx512Vnni,
}

/// Names the kernels' instruction set instead of the fastest one detected: `avx512-vnni`,
/// `avx-vnni`, `avx2` or `portable` (for comparisons, or to step around a kernel on one CPU).
pub const ISA_ENV: &str = "TM_CPU_ISA";

impl Isa {
    /// Every instruction set, fastest first.
    pub const ALL: [Isa; 4] = [Isa::Avx512Vnni, Isa::AvxVnni, Isa::Avx2, Isa::Scalar];

    /// The instruction set the kernels use: the fastest this CPU supports, unless [`ISA_ENV`]
    /// names another it supports (a name it does not know or a set the CPU lacks is ignored
    /// with a warning). Decided once per process.
    pub fn best() -> Isa {
        use std::sync::OnceLock;
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| {
            let detected = Isa::detected();
            match std::env::var(ISA_ENV) {
                Ok(name) => Isa::chosen(&name, detected).unwrap_or_else(|why| {
                    tracing::warn!("{ISA_ENV}={name}: {why}; using {}", detected.describe());
                    detected
                }),
                Err(_) => detected,
            }
        })
    }

    /// The fastest instruction set this CPU supports.
    pub fn detected() -> Isa {
        Isa::ALL.into_iter().find(|i| i.available()).unwrap_or(Isa::Scalar)
    }

    /// The instruction set [`ISA_ENV`]'s value `name` asks for, if this CPU has it.
    fn chosen(name: &str, detected: Isa) -> std::result::Result<Isa, String> {
        let isa = Isa::ALL.into_iter().find(|i| i.env_name() == name.trim().to_ascii_lowercase()).ok_or_else(|| {
            let names: Vec<&str> = Isa::ALL.iter().map(|i| i.env_name()).collect();
            format!("not one of {}", names.join(", "))
        })?;
        if !isa.available() {
            return Err(format!("this CPU lacks {} (it has {})", isa.describe(), detected.describe()));
        }
        Ok(isa)
    }

    /// The name [`ISA_ENV`] takes for the instruction set.
    pub fn env_name(self) -> &'static str {
        match self {
            Isa::Scalar => "portable",
            Isa::Avx2 => "avx2",
            Isa::AvxVnni => "avx-vnni",
            Isa::Avx512Vnni => "avx512-vnni",
        }
    }

    /// Whether this CPU can run the instruction set.
    pub fn available(self) -> bool {
        match self {
            Isa::Scalar => true,
            Isa::Avx2 => avx2_available(),
            Isa::AvxVnni => avx2_available() && avx_vnni_available(),
            Isa::Avx512Vnni => avx2_available() && avx512_vnni_available(),
        }
    }

    /// What the instruction set is called, for people ("AVX-512 VNNI", "portable (no AVX2)").
    pub fn describe(self) -> &'static str {
        match self {
            Isa::Scalar => "portable (no AVX2)",
            Isa::Avx2 => "AVX2",
            Isa::AvxVnni => "AVX-VNNI",
            Isa::Avx512Vnni => "AVX-512 VNNI",
        }
    }

    /// Whether the AVX2 kernels run (AVX2, FMA and F16C are present).
    fn avx2(self) -> bool {
        matches!(self, Isa::Avx2 | Isa::AvxVnni | Isa::Avx512Vnni)
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

/// AVX-VNNI (the VEX-encoded 256-bit form).
#[cfg(target_arch = "x86_64")]
fn avx_vnni_available() -> bool {
    is_x86_feature_detected!("avxvnni")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx_vnni_available() -> bool {
    false
}

/// AVX-512 F, BW and VNNI (the OS saving the ZMM state is part of the detection).
#[cfg(target_arch = "x86_64")]
fn avx512_vnni_available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx512_vnni_available() -> bool {
    false
}

/// `out[n, rows] = x[n, cols] · Wᵀ` for an int4 `W`, through int16-quantized activations (error
/// bound [`ACT_QUANT_REL_ERROR`]), with the best instruction set. Errors when the shapes or the
/// weight's parts do not fit.
pub fn matmul_int4(x: &[f32], n: usize, w: &HostQuantView<'_>, out: &mut [f32]) -> Result<()> {
    matmul_int4_with(Isa::best(), x, n, w, out)
}

/// [`matmul_int4`] with a chosen instruction set (errors if the CPU lacks it).
pub fn matmul_int4_with(isa: Isa, x: &[f32], n: usize, w: &HostQuantView<'_>, out: &mut [f32]) -> Result<()> {
    let sh = check(isa, x, n, w, out, QuantKind::Int4)?;
    q16::matmul(isa, &sh, w, x, out, Kernel::Int4);
    Ok(())
}

/// `out[n, rows] = x[n, cols] · Wᵀ` for an int8 `W`, through int16-quantized activations (error
/// bound [`ACT_QUANT_REL_ERROR`]), with the best instruction set. Errors when the shapes or the
/// weight's parts do not fit.
pub fn matmul_int8(x: &[f32], n: usize, w: &HostQuantView<'_>, out: &mut [f32]) -> Result<()> {
    matmul_int8_with(Isa::best(), x, n, w, out)
}

/// [`matmul_int8`] with a chosen instruction set (errors if the CPU lacks it).
pub fn matmul_int8_with(isa: Isa, x: &[f32], n: usize, w: &HostQuantView<'_>, out: &mut [f32]) -> Result<()> {
    let sh = check(isa, x, n, w, out, QuantKind::Int8)?;
    q16::matmul(isa, &sh, w, x, out, Kernel::Int8);
    Ok(())
}

/// `out[n, rows] = x[n, cols] · Wᵀ` for an int4 `W`, through int8-quantized activations (error
/// bound [`ACT_Q8_REL_ERROR`]: faster for prefill, but noticeably less accurate than
/// [`matmul_int4`]). Errors when the shapes or the weight's parts do not fit.
pub fn matmul_int4_q8(x: &[f32], n: usize, w: &HostQuantView<'_>, out: &mut [f32]) -> Result<()> {
    matmul_int4_q8_with(Isa::best(), x, n, w, out)
}

/// [`matmul_int4_q8`] with a chosen instruction set (errors if the CPU lacks it).
pub fn matmul_int4_q8_with(isa: Isa, x: &[f32], n: usize, w: &HostQuantView<'_>, out: &mut [f32]) -> Result<()> {
    let sh = check(isa, x, n, w, out, QuantKind::Int4)?;
    q8::matmul(isa, &sh, w, x, out, Kernel::Int4);
    Ok(())
}

/// `out[n, rows] = x[n, cols] · Wᵀ` for an int8 `W`, through int8-quantized activations (see
/// [`matmul_int4_q8`]).
pub fn matmul_int8_q8(x: &[f32], n: usize, w: &HostQuantView<'_>, out: &mut [f32]) -> Result<()> {
    matmul_int8_q8_with(Isa::best(), x, n, w, out)
}

/// [`matmul_int8_q8`] with a chosen instruction set (errors if the CPU lacks it).
pub fn matmul_int8_q8_with(isa: Isa, x: &[f32], n: usize, w: &HostQuantView<'_>, out: &mut [f32]) -> Result<()> {
    let sh = check(isa, x, n, w, out, QuantKind::Int8)?;
    q8::matmul(isa, &sh, w, x, out, Kernel::Int8);
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
    exact::matmul(isa, &sh, w, x, out, Kernel::Int4);
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
    exact::matmul(isa, &sh, w, x, out, Kernel::Int8);
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

impl Shape {
    /// Bytes of one weight row.
    fn row_bytes(&self, kernel: Kernel) -> usize {
        match kernel {
            Kernel::Int4 => self.cols / 2,
            Kernel::Int8 => self.cols,
        }
    }
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

/// Activations quantized per 32-block to integers `T` (`i8` or `i16`).
struct Acts<T> {
    /// `[n, stride]` quantized values, in the order the kernels read them.
    qs: Vec<T>,
    /// Elements per row of `qs`.
    stride: usize,
    /// `[n, nbp]` block scales `d_x` (zero past `nb`).
    d: Vec<f32>,
    /// `[n, nbp]` `d_x · Σ q_x` per block (zero past `nb`).
    s: Vec<f32>,
}

impl<T> Default for Acts<T> {
    fn default() -> Self {
        Acts { qs: Vec::new(), stride: 0, d: Vec::new(), s: Vec::new() }
    }
}

/// One quantized activation row: `(x, q, d, s)`.
type RowParts<'a, T> = (((&'a [f32], &'a mut [T]), &'a mut [f32]), &'a mut [f32]);

impl<T: Copy + Default + Send + Sync> Acts<T> {
    /// Sizes the buffers for `sh` with `stride` quantized values per row (zeroed), then calls
    /// `one_row` for every activation row, in parallel when that pays.
    fn fill(&mut self, x: &[f32], sh: &Shape, stride: usize, one_row: impl Fn(RowParts<'_, T>) + Sync + Send) {
        fn reset<T: Copy + Default>(v: &mut Vec<T>, len: usize) {
            v.clear();
            v.resize(len, T::default());
        }
        reset(&mut self.qs, sh.n * stride);
        reset(&mut self.d, sh.n * sh.nbp);
        reset(&mut self.s, sh.n * sh.nbp);
        self.stride = stride;
        if sh.cols == 0 {
            return;
        }
        if sh.n >= 8 && sh.n * sh.cols >= PAR_MIN_MACS / 4 {
            x.par_chunks_exact(sh.cols)
                .zip(self.qs.par_chunks_exact_mut(stride))
                .zip(self.d.par_chunks_exact_mut(sh.nbp))
                .zip(self.s.par_chunks_exact_mut(sh.nbp))
                .for_each(one_row);
        } else {
            x.chunks_exact(sh.cols)
                .zip(self.qs.chunks_exact_mut(stride))
                .zip(self.d.chunks_exact_mut(sh.nbp))
                .zip(self.s.chunks_exact_mut(sh.nbp))
                .for_each(one_row);
        }
    }
}

/// Per-thread scratch for the quantized activations.
#[derive(Default)]
struct Scratch {
    q16: Acts<i16>,
    q8: Acts<i8>,
}

thread_local! {
    static SCRATCH: Cell<Scratch> = Cell::new(Scratch::default());
}

/// Runs `f` with this thread's scratch. The scratch is taken out of the thread-local for the
/// duration, so a nested call (rayon work-stealing into another matmul on this thread) just gets a
/// fresh one instead of aliasing it.
fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    let mut s = SCRATCH.with(Cell::take);
    let r = f(&mut s);
    SCRATCH.with(|c| c.set(s));
    r
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

/// Calls `f(rows, j, na)` for every L1 tile `rows` of weight rows (tiles of a chunk in order,
/// chunks in parallel) and every group `j..j + na` of at most [`MAX_NA`] activation rows; each
/// call computes (and writes) `out[j..j + na][rows]`.
fn drive(sh: &Shape, kernel: Kernel, f: impl Fn(Range<usize>, usize, usize) + Sync) {
    let tile = tile_rows(sh.row_bytes(kernel));
    for_row_chunks(sh.rows, sh.cols * sh.n, |range| {
        let mut t0 = range.start;
        while t0 < range.end {
            let t1 = (t0 + tile).min(range.end);
            let mut j = 0;
            while j < sh.n {
                let na = (sh.n - j).min(MAX_NA);
                f(t0..t1, j, na);
                j += na;
            }
            t0 = t1;
        }
    });
}
