//! f32 activations ([`super::matmul_int4_exact`] / [`super::matmul_int8_exact`]): each weight
//! block is dequantized in registers and multiplied with f32 FMA.

use super::{drive, HostQuantView, Isa, Kernel, OutPtr, Shape, BLOCK};
use std::ops::Range;

/// Computes `out` from the f32 activations `x`.
pub(super) fn matmul(isa: Isa, sh: &Shape, w: &HostQuantView<'_>, x: &[f32], out: &mut [f32], kernel: Kernel) {
    let out = OutPtr(out.as_mut_ptr());
    drive(sh, kernel, |rows, j, na| exact_rows(isa, sh, w, x, rows, j, na, kernel, out));
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
    if isa.avx2() {
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

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use std::ops::Range;

    use super::super::simd::{h2f, hsum, prefetch_rows_ahead};
    use super::{HostQuantView, Kernel, OutPtr, Shape, BLOCK};

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
