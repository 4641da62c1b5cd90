//! Int8 activations ([`super::matmul_int4_q8`] / [`super::matmul_int8_q8`]): like llama.cpp's
//! `Q8_1`, `d_x = max|x| / 127` per 32-block, and `maddubs` dots.

use super::{drive, with_scratch, Acts, HostQuantView, Isa, Kernel, OutPtr, Shape, BLOCK};
use std::ops::Range;

/// Quantizes `x` to int8 into this thread's scratch and computes `out` from it.
pub(super) fn matmul(isa: Isa, sh: &Shape, w: &HostQuantView<'_>, x: &[f32], out: &mut [f32], kernel: Kernel) {
    let layout = if isa.avx2() && kernel == Kernel::Int4 { Layout::Pairs } else { Layout::Plain };
    with_scratch(|s| {
        let acts = &mut s.q8;
        quantize(isa, x, sh, layout, acts);
        let acts = &*acts;
        let out = OutPtr(out.as_mut_ptr());
        drive(sh, kernel, |rows, j, na| rows_dot(isa, sh, w, acts, rows, j, na, kernel, out));
    });
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

/// Offsets of the low and high 16 columns of block `b` (of `nb`) within a quantized row.
fn block_offsets(layout: Layout, b: usize, nb: usize) -> (usize, usize) {
    if layout == Layout::Pairs && (b | 1) < nb {
        let base = (b & !1) * BLOCK + (b & 1) * 16;
        (base, base + 32)
    } else {
        (b * BLOCK, b * BLOCK + 16)
    }
}

fn quantize(isa: Isa, x: &[f32], sh: &Shape, layout: Layout, acts: &mut Acts<i8>) {
    let nb = sh.nb;
    acts.fill(x, sh, sh.cols, |(((xr, qr), dr), sr)| {
        for (b, xb) in xr.chunks_exact(BLOCK).enumerate() {
            let mut q = [0i8; BLOCK];
            let (d, sum) = quantize_block(isa, xb.try_into().unwrap_or(&[0.0; BLOCK]), &mut q);
            let (lo, hi) = block_offsets(layout, b, nb);
            qr[lo..lo + 16].copy_from_slice(&q[..16]);
            qr[hi..hi + 16].copy_from_slice(&q[16..]);
            dr[b] = d;
            sr[b] = d * sum as f32;
        }
    });
}

/// Quantizes one 32-block: returns `d_x` and `Σ q_x`. Both instruction sets give identical results.
pub(super) fn quantize_block(isa: Isa, x: &[f32; BLOCK], q: &mut [i8; BLOCK]) -> (f32, i32) {
    #[cfg(target_arch = "x86_64")]
    if isa.avx2() {
        // SAFETY: the AVX2 instruction sets are only used after `check` confirmed AVX2/FMA/F16C.
        return unsafe { avx2::quantize_block(x, q) };
    }
    let _ = isa;
    quantize_block_scalar(x, q)
}

pub(super) fn quantize_block_scalar(x: &[f32; BLOCK], q: &mut [i8; BLOCK]) -> (f32, i32) {
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

/// Writes `out[j + t][r]` for `r` in `rows`, `t < na` (`na <= MAX_NA`).
#[allow(clippy::too_many_arguments)]
fn rows_dot(
    isa: Isa,
    sh: &Shape,
    w: &HostQuantView<'_>,
    acts: &Acts<i8>,
    rows: Range<usize>,
    j: usize,
    na: usize,
    kernel: Kernel,
    out: OutPtr,
) {
    #[cfg(target_arch = "x86_64")]
    if isa.avx2() {
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

fn scalar_int4_row(sh: &Shape, w: &HostQuantView<'_>, acts: &Acts<i8>, r: usize, j: usize) -> f32 {
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

fn scalar_int8_row(sh: &Shape, w: &HostQuantView<'_>, acts: &Acts<i8>, r: usize, j: usize) -> f32 {
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

// ---------------------------------------------------------------------------------------------
// AVX2 kernels.

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use std::ops::Range;

    use super::super::simd::{
        octet_factors, prefetch_rows_ahead, spread, write_tile, TileRows, LANE_IDX, PAIR_IDX, PREFETCH_TILES,
    };
    use super::{Acts, HostQuantView, OutPtr, Shape, BLOCK};

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
        acts: &Acts<i8>,
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
        acts: &Acts<i8>,
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

    /// Weight rows `r0..r0 + R` against activation rows `j..j + NA`: the per-lane partial sums
    /// (summed horizontally by the caller).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn int4_tile<const R: usize, const NA: usize, const G1: bool>(
        sh: &Shape,
        w: &HostQuantView<'_>,
        acts: &Acts<i8>,
        r0: usize,
        j: usize,
    ) -> [[__m256; NA]; R] {
        let nb = sh.nb;
        let spread = spread(sh.bpg);
        let rows = TileRows::<i8, R, NA>::new(sh, w, acts, r0, j, sh.cols / 2);
        let TileRows { wrow, qx, .. } = rows;
        let low = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); NA]; R];
        let mut b0 = 0;
        while b0 < nb {
            let kend = (nb - b0).min(8);
            // the 8 blocks' factors scale_w * d_x; their min terms min_w * s_x folded straight
            // into the accumulator lanes
            let fac = octet_factors::<_, G1, R, NA>(sh, w, &rows, b0, spread, Some(&mut acc));
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
        acts: &Acts<i8>,
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
        acts: &Acts<i8>,
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

    /// Int8 weight rows `r0..r0 + R` against activation rows `j..j + NA`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn int8_tile<const R: usize, const NA: usize, const G1: bool>(
        sh: &Shape,
        w: &HostQuantView<'_>,
        acts: &Acts<i8>,
        r0: usize,
        j: usize,
    ) -> [[__m256; NA]; R] {
        let nb = sh.nb;
        let spread = spread(sh.bpg);
        let rows = TileRows::<i8, R, NA>::new(sh, w, acts, r0, j, sh.cols);
        let TileRows { wrow, qx, .. } = rows;
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); NA]; R];
        let mut b0 = 0;
        while b0 < nb {
            let kend = (nb - b0).min(8);
            let fac = octet_factors::<_, G1, R, NA>(sh, w, &rows, b0, spread, None);
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
}
