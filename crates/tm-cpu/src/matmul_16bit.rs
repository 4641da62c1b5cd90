//! Matrix products `out = x Wᵀ` against f16 or bf16 weights held as stored, at half the bytes of
//! f32: a fused widen-and-dot kernel for a few rows (decode reads each weight once, from memory,
//! at 2 bytes), and for more rows panels of weight rows widened to f32 on each thread and
//! multiplied by faer (the widening is then a small part of the work: one pass over the panel
//! against `n` multiply-adds per weight).
//!
//! Both widenings are exact (every f16 and bf16 value is an f32), so the products differ from
//! the f32-weight ones only in summation order.

use faer::{Accum, MatMut, MatRef};
use half::{bf16, f16, slice::HalfFloatSliceExt};
use rayon::prelude::*;
use std::cell::RefCell;

use crate::quant_matmul::Isa;

/// A dense weight's values `[rows, cols]`, row-major, in their 16-bit storage format.
#[derive(Clone, Copy, Debug)]
pub enum Half16<'a> {
    /// IEEE half precision.
    F16(&'a [f16]),
    /// bfloat16 (the top half of an f32).
    Bf16(&'a [bf16]),
}

impl Half16<'_> {
    /// How many values it holds.
    pub fn len(self) -> usize {
        match self {
            Half16::F16(v) => v.len(),
            Half16::Bf16(v) => v.len(),
        }
    }

    /// Whether it holds no values.
    pub fn is_empty(self) -> bool {
        self.len() == 0
    }

    /// Values `start..start + dst.len()`, widened into `dst`.
    pub fn widen_into(self, start: usize, dst: &mut [f32]) {
        let end = start + dst.len();
        match self {
            Half16::F16(v) => v[start..end].convert_to_f32_slice(dst),
            Half16::Bf16(v) => {
                for (d, s) in dst.iter_mut().zip(&v[start..end]) {
                    *d = f32::from_bits(u32::from(s.to_bits()) << 16);
                }
            }
        }
    }
}

/// The most input rows the fused kernel takes; more go through widened panels and faer.
pub const FUSED_MAX_ROWS: usize = 4;
/// Weight rows widened into one panel (256 KiB of f32 per thousand columns).
const PANEL_ROWS: usize = 64;
/// Chunks of the output's columns per thread (so that uneven chunks even out).
const CHUNKS_PER_THREAD: usize = 4;
/// The fewest weight rows a thread's chunk has.
const MIN_CHUNK_ROWS: usize = 64;

/// The scratch the panel path holds, over every thread of rayon's current pool, for weights of
/// `cols` columns: one widened panel per thread (products of more than [`FUSED_MAX_ROWS`] rows;
/// each thread keeps its panel for later calls). The memory plan charges it.
pub fn panel_scratch_bytes(cols: usize) -> u64 {
    (rayon::current_num_threads() * PANEL_ROWS * cols * std::mem::size_of::<f32>()) as u64
}

/// `out[n, rows] = x[n, cols] · Wᵀ` for `w` of `rows * cols` values, with the fastest kernel
/// this CPU runs. The caller checks the lengths (`x.len() == n * cols`, `out.len() == n * rows`,
/// `w.len() == rows * cols`).
pub fn matmul(x: &[f32], n: usize, w: Half16<'_>, rows: usize, cols: usize, out: &mut [f32]) {
    matmul_with(Isa::best(), x, n, w, rows, cols, out)
}

/// [`matmul`] with the fused kernel in `isa` ([`Isa::Scalar`], or the AVX2 kernel for the x86
/// ones; an `isa` this CPU lacks falls back to scalar).
pub fn matmul_with(isa: Isa, x: &[f32], n: usize, w: Half16<'_>, rows: usize, cols: usize, out: &mut [f32]) {
    let simd = isa != Isa::Scalar && isa.available();
    debug_assert!(x.len() == n * cols && out.len() == n * rows && w.len() == rows * cols);
    if n == 0 || rows == 0 {
        return;
    }
    let chunks = rayon::current_num_threads() * CHUNKS_PER_THREAD;
    let chunk = rows.div_ceil(chunks).next_multiple_of(PANEL_ROWS).max(MIN_CHUNK_ROWS);
    let dst = MatMut::from_row_major_slice_mut(out, n, rows);
    let lhs = MatRef::from_row_major_slice(x, n, cols);
    dst.par_col_chunks_mut(chunk).enumerate().for_each(|(i, d)| {
        let first = i * chunk;
        if n <= FUSED_MAX_ROWS {
            fused_rows(simd, x, n, w, first, cols, d);
        } else {
            panels(lhs, w, first, cols, d);
        }
    });
}

/// Output columns `first..first + d.ncols()` by the fused kernel.
fn fused_rows(simd: bool, x: &[f32], n: usize, w: Half16<'_>, first: usize, cols: usize, mut d: MatMut<'_, f32>) {
    let mut sums = [0f32; FUSED_MAX_ROWS];
    for j in 0..d.ncols() {
        dots(simd, x, n, w, (first + j) * cols, cols, &mut sums[..n]);
        for (i, &s) in sums[..n].iter().enumerate() {
            d[(i, j)] = s;
        }
    }
}

/// `sums[i] = x_i · w[start..start + cols]` for the `n <= FUSED_MAX_ROWS` rows of `x`, in AVX2
/// when `simd` (which the caller has checked this CPU runs).
fn dots(simd: bool, x: &[f32], n: usize, w: Half16<'_>, start: usize, cols: usize, sums: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: the CPU has AVX2, FMA and F16C (`Isa::available`); the slices hold what the kernel reads
        // (`x` is `n` rows of `cols`, `w` holds `start + cols` values).
        unsafe { avx2::dots(x, n, w, start, cols, sums) };
        return;
    }
    // Elsewhere: the row widened a piece at a time on the stack.
    const PIECE: usize = 64;
    let mut piece = [0f32; PIECE];
    sums.fill(0.0);
    for k in (0..cols).step_by(PIECE) {
        let len = PIECE.min(cols - k);
        w.widen_into(start + k, &mut piece[..len]);
        for (i, s) in sums.iter_mut().enumerate() {
            *s += x[i * cols + k..i * cols + k + len].iter().zip(&piece[..len]).map(|(a, b)| a * b).sum::<f32>();
        }
    }
}

thread_local! {
    /// Each thread's widened panel, reused across calls.
    static PANEL: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Output columns `first..first + d.ncols()` as panels of widened weight rows times `lhs`.
fn panels(lhs: MatRef<'_, f32>, w: Half16<'_>, first: usize, cols: usize, mut d: MatMut<'_, f32>) {
    PANEL.with(|cell| {
        let mut panel = cell.borrow_mut();
        let mut j = 0;
        while j < d.ncols() {
            let len = PANEL_ROWS.min(d.ncols() - j);
            panel.resize(len * cols, 0.0);
            w.widen_into((first + j) * cols, &mut panel[..len * cols]);
            let rhs = MatRef::from_row_major_slice(&panel[..len * cols], len, cols).transpose();
            tm_quant::f32_products::matmul_here(d.as_mut().subcols_mut(j, len), Accum::Replace, lhs, rhs);
            j += len;
        }
    });
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Half16, FUSED_MAX_ROWS};
    use crate::quant_matmul::simd::hsum;
    use std::arch::x86_64::*;

    /// How far ahead of each row's loads the kernel prefetches, in values (2 KiB): the hardware
    /// prefetcher alone left the loop at about half the bytes per second faer reaches on f32.
    const PREFETCH_AHEAD: usize = 1024;

    /// Eight weights at `p`, widened (bf16 or f16).
    #[inline(always)]
    unsafe fn load8<const BF16: bool>(p: *const u16) -> __m256 {
        let raw = _mm_loadu_si128(p.cast());
        if BF16 {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(raw)))
        } else {
            _mm256_cvtph_ps(raw)
        }
    }

    /// [`super::dots`] in AVX2: 16 weights a step, two accumulators per input row, the row
    /// prefetched ahead of the loads.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `x.len() >= n * cols`, `w.len() >= start + cols`,
    /// `n <= FUSED_MAX_ROWS`, `sums.len() >= n`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dots(x: &[f32], n: usize, w: Half16<'_>, start: usize, cols: usize, sums: &mut [f32]) {
        match (n, w) {
            (1, Half16::Bf16(v)) => dots_n::<1, true>(x, v.as_ptr().cast(), start, cols, sums, w),
            (2, Half16::Bf16(v)) => dots_n::<2, true>(x, v.as_ptr().cast(), start, cols, sums, w),
            (3, Half16::Bf16(v)) => dots_n::<3, true>(x, v.as_ptr().cast(), start, cols, sums, w),
            (_, Half16::Bf16(v)) => dots_n::<4, true>(x, v.as_ptr().cast(), start, cols, sums, w),
            (1, Half16::F16(v)) => dots_n::<1, false>(x, v.as_ptr().cast(), start, cols, sums, w),
            (2, Half16::F16(v)) => dots_n::<2, false>(x, v.as_ptr().cast(), start, cols, sums, w),
            (3, Half16::F16(v)) => dots_n::<3, false>(x, v.as_ptr().cast(), start, cols, sums, w),
            (_, Half16::F16(v)) => dots_n::<4, false>(x, v.as_ptr().cast(), start, cols, sums, w),
        }
    }

    #[inline(always)]
    unsafe fn dots_n<const N: usize, const BF16: bool>(
        x: &[f32],
        wp: *const u16,
        start: usize,
        cols: usize,
        sums: &mut [f32],
        w: Half16<'_>,
    ) {
        const { assert!(N <= FUSED_MAX_ROWS) };
        let (xp, wp) = (x.as_ptr(), wp.add(start));
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        let mut k = 0;
        while k + 16 <= cols {
            if k % 32 == 0 {
                // one cache line of weights, PREFETCH_AHEAD values ahead
                _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(k + PREFETCH_AHEAD).cast());
            }
            let (w0, w1) = (load8::<BF16>(wp.add(k)), load8::<BF16>(wp.add(k + 8)));
            for (i, a) in acc.iter_mut().enumerate() {
                let xr = xp.add(i * cols + k);
                a[0] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w0, a[0]);
                a[1] = _mm256_fmadd_ps(_mm256_loadu_ps(xr.add(8)), w1, a[1]);
            }
            k += 16;
        }
        let mut tail = [0f32; 16];
        w.widen_into(start + k, &mut tail[..cols - k]);
        for (i, (a, s)) in acc.iter().zip(sums.iter_mut()).enumerate() {
            let rest: f32 = tail[..cols - k].iter().zip(&x[i * cols + k..(i + 1) * cols]).map(|(t, v)| t * v).sum();
            *s = hsum(_mm256_add_ps(a[0], a[1])) + rest;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `x · Wᵀ` by the definition, in f64, from the widened weights, with each element's sum of
    /// the terms' magnitudes (what bounds f32 rounding in any summation order).
    fn naive(x: &[f32], n: usize, w: &[f32], rows: usize, cols: usize) -> Vec<(f64, f64)> {
        let mut out = vec![(0f64, 0f64); n * rows];
        for i in 0..n {
            for r in 0..rows {
                let terms = (0..cols).map(|k| x[i * cols + k] as f64 * w[r * cols + k] as f64);
                out[i * rows + r] = terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()));
            }
        }
        out
    }

    #[test]
    fn products_match_the_definition_for_both_formats_and_paths() {
        // fused (n <= 4) and panel paths, columns with and without a 16-wide tail, row counts
        // around the chunk and panel sizes, a thread pool of 1 and of 5
        for threads in [1, 5] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            for (n, rows, cols) in [
                (1, 1, 1),
                (1, 37, 64),
                (2, 129, 23),
                (3, 16, 48),
                (4, 70, 100),
                (5, 33, 17),
                (40, 300, 96),
                (9, 1000, 40),
            ] {
                let x: Vec<f32> = (0..n * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
                let raw: Vec<f32> = (0..rows * cols).map(|i| ((i * 53 % 97) as f32 - 48.0) / 24.0).collect();
                for format in ["f16", "bf16"] {
                    let (h16, b16): (Vec<f16>, Vec<bf16>) = (
                        raw.iter().map(|&v| f16::from_f32(v)).collect(),
                        raw.iter().map(|&v| bf16::from_f32(v)).collect(),
                    );
                    let (w, widened): (Half16<'_>, Vec<f32>) = if format == "f16" {
                        (Half16::F16(&h16), h16.iter().map(|v| v.to_f32()).collect())
                    } else {
                        (Half16::Bf16(&b16), b16.iter().map(|v| v.to_f32()).collect())
                    };
                    let want = naive(&x, n, &widened, rows, cols);
                    for isa in [Isa::Scalar, Isa::best()] {
                        let mut out = vec![f32::NAN; n * rows];
                        pool.install(|| matmul_with(isa, &x, n, w, rows, cols, &mut out));
                        for (i, (o, (w, magnitude))) in out.iter().zip(&want).enumerate() {
                            // `cols` roundings of at most f32's unit roundoff each
                            assert!(
                                (*o as f64 - w).abs() <= cols as f64 * f32::EPSILON as f64 * magnitude,
                                "{format} {isa:?} {n}x{rows}x{cols}, {threads} threads, element {i}: {o} against {w}"
                            );
                        }
                    }
                }
            }
        }
    }
}
