//! Int16 activations, the default path ([`super::matmul_int4`] / [`super::matmul_int8`]):
//! `d_x = max|x| / 32767` per 32-block, exact integer dots with `madd` (i16 × i16 → i32), or
//! AVX-VNNI's `vpdpwssd` (`madd` and the add in one).
//!
//! No i32 overflow: a block's dot is at most `32 · 15 · 32767 < 2²⁴` for int4 weights (so its
//! conversion to f32 is exact, too) and `32 · 128 · 32767 < 2²⁸` for int8.
//!
//! # Activation layout
//! The scalar path stores each row plainly (block `b` at `32 b`). The AVX2 path stores blocks in
//! pairs `A = 2p`, `B = 2p + 1` (a last odd block is paired with a zero block), 64 values at
//! `64 p`, as four vectors of 16 in the order the weights decode in ([`pair_pos`]):
//! `X0 = A[0, 2, .., 14] B[0, 2, .., 14]`, `X1 = A[16, 18, .., 30] B[16, ..]`,
//! `X2 = A[1, 3, .., 15] B[1, ..]`, `X3 = A[17, 19, .., 31] B[17, ..]`.
//! - int4: the 32 weight bytes of the pair, read as 16-bit words, hold in word `k` (`k < 8` for
//!   A, `8 + k` for B) the nibbles of columns `2k` (bits 0..4), `2k + 16` (4..8), `2k + 1`
//!   (8..12) and `2k + 17` (12..16): masks and shifts give `X0`..`X3`'s partners.
//! - int8: the 64 weight bytes of the pair, with the 128-bit halves regrouped as
//!   `A[0..16] B[0..16]` and `A[16..32] B[16..32]`, read as words hold columns `2k` (low byte) and
//!   `2k + 1` (high byte), sign-extended by shifts.
//!
//! Each `madd` then sums two adjacent products; lanes 0..4 of the sum of the four `madd`s are
//! block A's partial sums, lanes 4..8 block B's.
//!
//! The AVX-512 path ([`Isa::Avx512Vnni`], `q16_avx512.rs`) takes two pairs at a time, so it stores
//! them as quads of four blocks (128 values at `128 u` for pairs `2u`, `2u + 1`): vector `Xm` of
//! pair `2u` then that of pair `2u + 1`, 32 values each ([`quad_pos`]), rows padded to a multiple
//! of four blocks. 64 int4 weight bytes then decode into the four 512-bit partners at once.

use super::{drive, with_scratch, Acts, HostQuantView, Isa, Kernel, OutPtr, Shape, BLOCK};
use std::ops::Range;

/// The quantization levels: `q_x = round(x / d_x)` with `d_x = max|x| / LEVELS`.
const LEVELS: f32 = 32767.0;

/// Quantizes `x` to int16 into this thread's scratch and computes `out` from it.
pub(super) fn matmul(isa: Isa, sh: &Shape, w: &HostQuantView<'_>, x: &[f32], out: &mut [f32], kernel: Kernel) {
    with_scratch(|s| {
        let acts = &mut s.q16;
        quantize(isa, x, sh, acts);
        let acts = &*acts;
        let out = OutPtr(out.as_mut_ptr());
        drive(sh, kernel, |rows, j, na| rows_dot(isa, sh, w, acts, rows, j, na, kernel, out));
    });
}

/// Position of column `c` of the `h`-th block (0: A, 1: B) of a pair within the pair's 64 values
/// in the AVX2 layout.
#[cfg_attr(not(test), allow(dead_code))]
pub(super) fn pair_pos(h: usize, c: usize) -> usize {
    let m = usize::from(c >= 16) + 2 * (c & 1);
    m * 16 + h * 8 + (c % 16) / 2
}

/// Position of column `c` of the `k`-th block (`k < 4`) of a quad within the quad's 128 values in
/// the AVX-512 layout.
#[cfg_attr(not(test), allow(dead_code))]
pub(super) fn quad_pos(k: usize, c: usize) -> usize {
    let m = usize::from(c >= 16) + 2 * (c & 1);
    m * 32 + (k / 2) * 16 + (k % 2) * 8 + (c % 16) / 2
}

/// Quantizes every row of `x` (scalar: plain layout; AVX2: pair layout, rows padded to an even
/// number of blocks; AVX-512: quad layout, padded to a multiple of four blocks).
pub(super) fn quantize(isa: Isa, x: &[f32], sh: &Shape, acts: &mut Acts<i16>) {
    let quads = isa == Isa::Avx512Vnni;
    let stride = sh.nb.next_multiple_of(if quads { 4 } else { 2 }) * BLOCK;
    acts.fill(x, sh, stride, |(((xr, qr), dr), sr)| {
        #[cfg(target_arch = "x86_64")]
        if isa.avx2() {
            // SAFETY: the AVX2 instruction sets are only used after `check` confirmed that the CPU
            // has AVX2/FMA/F16C; `qr` holds `nb` rounded up to even blocks (to four for quads),
            // `dr` and `sr` at least `nb` values.
            unsafe {
                if quads {
                    avx2::quantize_row::<true>(xr, qr, dr, sr)
                } else {
                    avx2::quantize_row::<false>(xr, qr, dr, sr)
                }
            };
            return;
        }
        let _ = isa;
        for (b, xb) in xr.chunks_exact(BLOCK).enumerate() {
            let q = (&mut qr[b * BLOCK..(b + 1) * BLOCK]).try_into().unwrap_or_else(|_| unreachable!());
            let (d, sum) = quantize_block_scalar(xb.try_into().unwrap_or(&[0.0; BLOCK]), q);
            dr[b] = d;
            sr[b] = d * sum as f32;
        }
    });
}

/// Quantizes one 32-block to int16: returns `d_x` and `Σ q_x`. The reference for the AVX2
/// quantizer, which gives identical values.
pub(super) fn quantize_block_scalar(x: &[f32; BLOCK], q: &mut [i16; BLOCK]) -> (f32, i32) {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = if x.iter().any(|v| v.is_nan()) { f32::NAN } else { amax / LEVELS };
    let id = if amax > 0.0 { LEVELS / amax } else { 0.0 };
    let mut sum = 0i32;
    for (qi, &v) in q.iter_mut().zip(x) {
        *qi = (v * id).round_ties_even() as i16;
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
    acts: &Acts<i16>,
    rows: Range<usize>,
    j: usize,
    na: usize,
    kernel: Kernel,
    out: OutPtr,
) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512Vnni {
        // SAFETY: the CPU has AVX2/FMA/F16C and AVX-512 F/BW/VNNI (checked); `check` validated
        // every length the kernels index with, the activations are in the quad layout, `rows` and
        // `j..j + na` are in range and the output rows are this chunk's only.
        unsafe {
            match kernel {
                Kernel::Int4 => super::q16_avx512::rows::<true>(sh, w, acts, rows, j, na, out),
                Kernel::Int8 => super::q16_avx512::rows::<false>(sh, w, acts, rows, j, na, out),
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa.avx2() {
        // SAFETY: the CPU has AVX2/FMA/F16C, and AVX-VNNI for `Isa::AvxVnni` (checked), and
        // `check` validated every length the kernels index with: packed/scales/mins against
        // `rows`, `cols`, `group_size`; the activation buffers were sized from the same shape, in
        // the pair layout; `rows` and `j..j + na` are in range and the output rows are this
        // chunk's only.
        unsafe {
            match (kernel, isa == Isa::AvxVnni) {
                (Kernel::Int4, false) => avx2::rows::<true, false>(sh, w, acts, rows, j, na, out),
                (Kernel::Int4, true) => avx2::rows::<true, true>(sh, w, acts, rows, j, na, out),
                (Kernel::Int8, false) => avx2::rows::<false, false>(sh, w, acts, rows, j, na, out),
                (Kernel::Int8, true) => avx2::rows::<false, true>(sh, w, acts, rows, j, na, out),
            }
        }
        return;
    }
    let _ = isa;
    for r in rows {
        for t in j..j + na {
            let v = match kernel {
                Kernel::Int4 => scalar_int4_row(sh, w, acts, r, t),
                Kernel::Int8 => scalar_int8_row(sh, w, acts, r, t),
            };
            // SAFETY: `t * rows + r < n * rows`, the checked output length; row `r` is written by
            // this chunk only.
            unsafe { out.write(t * sh.rows + r, v) };
        }
    }
}

fn scalar_int4_row(sh: &Shape, w: &HostQuantView<'_>, acts: &Acts<i16>, r: usize, j: usize) -> f32 {
    let wrow = &w.packed[r * sh.cols / 2..(r + 1) * sh.cols / 2];
    let scales = &w.scales[r * sh.groups..(r + 1) * sh.groups];
    let mins = &w.mins.unwrap_or_default()[r * sh.groups..(r + 1) * sh.groups];
    let qx = &acts.qs[j * acts.stride..(j + 1) * acts.stride];
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

fn scalar_int8_row(sh: &Shape, w: &HostQuantView<'_>, acts: &Acts<i16>, r: usize, j: usize) -> f32 {
    let wrow = &w.packed[r * sh.cols..(r + 1) * sh.cols];
    let scales = &w.scales[r * sh.groups..(r + 1) * sh.groups];
    let qx = &acts.qs[j * acts.stride..(j + 1) * acts.stride];
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
        octet_factors, prefetch_rows_ahead, spread, write_tile, TileRows, PAIR_IDX, PREFETCH_TILES,
    };
    use super::{Acts, HostQuantView, OutPtr, Shape, BLOCK, LEVELS};

    /// `acc + madd(a, b)` in one instruction: AVX-VNNI's `vpdpwssd` (VEX-encoded; written as
    /// assembly, as the compiler may split the intrinsic back into `vpmaddwd` and `vpaddd`).
    ///
    /// # Safety
    /// The CPU has AVX-VNNI.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn dpwssd(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        let mut r = acc;
        std::arch::asm!(
            "{{vex}} vpdpwssd {r}, {a}, {b}",
            r = inout(ymm_reg) r,
            a = in(ymm_reg) a,
            b = in(ymm_reg) b,
            options(pure, nomem, nostack, preserves_flags)
        );
        r
    }

    /// Quantizes the 32 floats at `p`: `round(x / d)` as four i32 vectors (columns 0..8, 8..16,
    /// 16..24, 24..32) and `d`, exactly as `quantize_block_scalar` (same `d`, `1/d` and
    /// round-half-to-even).
    #[inline(always)]
    unsafe fn quantize_block(p: *const f32) -> ([__m256i; 4], f32) {
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
        let d = if _mm256_movemask_ps(nan) != 0 { f32::NAN } else { amax / LEVELS };
        let id = _mm256_set1_ps(if amax > 0.0 { LEVELS / amax } else { 0.0 });
        const RN: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        let q = |v: __m256| _mm256_cvtps_epi32(_mm256_round_ps::<RN>(_mm256_mul_ps(v, id)));
        ([q(v[0]), q(v[1]), q(v[2]), q(v[3])], d)
    }

    /// The even (`IMM = 0x88`) or odd (`0xDD`) lanes of `a0 a1` (16 columns of block A, i32) and
    /// `c0 c1` (block B), as i16: `[A's 8 | B's 8]`, each in column order.
    #[inline(always)]
    unsafe fn take<const IMM: i32>(a0: __m256i, a1: __m256i, c0: __m256i, c1: __m256i) -> __m256i {
        let sh = |u: __m256i, v: __m256i| {
            _mm256_castps_si256(_mm256_shuffle_ps::<IMM>(_mm256_castsi256_ps(u), _mm256_castsi256_ps(v)))
        };
        // `sh` gives columns [0 2 8 10 | 4 6 12 14] (+1 for odd); the pack interleaves A and B
        // per 128-bit lane, and the permutation puts the 32-bit pairs back in order.
        let packed = _mm256_packs_epi32(sh(a0, a1), sh(c0, c1));
        _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
    }

    /// Quantizes one activation row into the pair layout, or the quad layout if `QUADS` (see the
    /// module docs).
    ///
    /// # Safety
    /// AVX2/FMA/F16C present; `q` holds at least `nb` rounded up to even blocks (to a multiple of
    /// four if `QUADS`), `d` and `s` at least `nb` values, where `nb = x.len() / 32`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn quantize_row<const QUADS: bool>(x: &[f32], q: &mut [i16], d: &mut [f32], s: &mut [f32]) {
        let nb = x.len() / BLOCK;
        debug_assert!(q.len() >= nb.next_multiple_of(if QUADS { 4 } else { 2 }) * BLOCK);
        debug_assert!(d.len() >= nb && s.len() >= nb);
        let ones = _mm256_set1_epi16(1);
        let mut b = 0;
        while b < nb {
            let (a, da) = quantize_block(x.as_ptr().add(b * BLOCK));
            let (c, dc) = if b + 1 < nb {
                quantize_block(x.as_ptr().add((b + 1) * BLOCK))
            } else {
                ([_mm256_setzero_si256(); 4], 0.0)
            };
            let xs = [
                take::<0x88>(a[0], a[1], c[0], c[1]),
                take::<0x88>(a[2], a[3], c[2], c[3]),
                take::<0xDD>(a[0], a[1], c[0], c[1]),
                take::<0xDD>(a[2], a[3], c[2], c[3]),
            ];
            // Vector `m` of the pair: at `16 m` of the pair's 64 values, or at `32 m` of its quad's
            // 128, after the other pair's if this is the quad's second.
            let (dst, step) = if QUADS {
                (q.as_mut_ptr().add((b & !3) * BLOCK + 16 * ((b / 2) & 1)), 32)
            } else {
                (q.as_mut_ptr().add(b * BLOCK), 16)
            };
            let mut sum = _mm256_setzero_si256();
            for (m, v) in xs.iter().enumerate() {
                _mm256_storeu_si256(dst.add(step * m).cast(), *v);
                // Sum the stored (saturated) values so that the sums always match `q`.
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(*v, ones));
            }
            let h = _mm_hadd_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256::<1>(sum));
            let h = _mm_hadd_epi32(h, h);
            d[b] = da;
            s[b] = da * _mm_cvtsi128_si32(h) as f32;
            if b + 1 < nb {
                d[b + 1] = dc;
                s[b + 1] = dc * _mm_extract_epi32::<1>(h) as f32;
            }
            b += 2;
        }
    }

    /// Weight rows `rows` (int4 if `INT4`, else int8) against activation rows `j..j + na`,
    /// written to `out`, with `vpdpwssd` if `VNNI`.
    ///
    /// # Safety
    /// AVX2/FMA/F16C (and AVX-VNNI if `VNNI`) present; `w` validated for `sh` and the kind;
    /// `acts` quantized for `sh` in the pair layout; `rows.end <= sh.rows`, `j + na <= sh.n`,
    /// `na <= MAX_NA`; nobody else writes these output rows meanwhile.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn rows<const INT4: bool, const VNNI: bool>(
        sh: &Shape,
        w: &HostQuantView<'_>,
        acts: &Acts<i16>,
        rows: Range<usize>,
        j: usize,
        na: usize,
        out: OutPtr,
    ) {
        // Several independent accumulators per tile hide the FMA latency.
        match na {
            1 => rows_tiled::<INT4, VNNI, 4, 1>(sh, w, acts, rows, j, out),
            2 => rows_tiled::<INT4, VNNI, 2, 2>(sh, w, acts, rows, j, out),
            3 => rows_tiled::<INT4, VNNI, 1, 3>(sh, w, acts, rows, j, out),
            _ => rows_tiled::<INT4, VNNI, 1, 4>(sh, w, acts, rows, j, out),
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows_tiled<const INT4: bool, const VNNI: bool, const R: usize, const NA: usize>(
        sh: &Shape,
        w: &HostQuantView<'_>,
        acts: &Acts<i16>,
        rows: Range<usize>,
        j: usize,
        out: OutPtr,
    ) {
        let row_bytes = if INT4 { sh.cols / 2 } else { sh.cols };
        let mut r = rows.start;
        let g1 = sh.bpg == 1;
        while r + R <= rows.end {
            prefetch_rows_ahead(w, r + PREFETCH_TILES * R, R, row_bytes, sh.groups);
            let acc = if g1 {
                tile::<INT4, VNNI, R, NA, true>(sh, w, acts, r, j)
            } else {
                tile::<INT4, VNNI, R, NA, false>(sh, w, acts, r, j)
            };
            write_tile(&acc, out, sh.rows, r, j);
            r += R;
        }
        while r < rows.end {
            let acc = tile::<INT4, VNNI, 1, NA, false>(sh, w, acts, r, j);
            write_tile(&acc, out, sh.rows, r, j);
            r += 1;
        }
    }

    /// The weights of the block pair starting at block `b` of the row at `wrow`, as the four i16
    /// vectors that pair with the activations' `X0`..`X3`. `full`: block `b + 1` exists (else it
    /// reads as zeros).
    #[inline(always)]
    unsafe fn decode_pair<const INT4: bool>(wrow: *const u8, b: usize, full: bool) -> [__m256i; 4] {
        if INT4 {
            let p = wrow.add(b * 16);
            let v = if full { _mm256_loadu_si256(p.cast()) } else { _mm256_zextsi128_si256(_mm_loadu_si128(p.cast())) };
            let m4 = _mm256_set1_epi16(0x000F);
            [
                _mm256_and_si256(v, m4),
                _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4),
                _mm256_and_si256(_mm256_srli_epi16::<8>(v), m4),
                _mm256_srli_epi16::<12>(v),
            ]
        } else {
            let p = wrow.add(b * BLOCK);
            let va = _mm256_loadu_si256(p.cast());
            let vb = if full { _mm256_loadu_si256(p.add(BLOCK).cast()) } else { _mm256_setzero_si256() };
            let lo = _mm256_permute2x128_si256::<0x20>(va, vb);
            let hi = _mm256_permute2x128_si256::<0x31>(va, vb);
            [
                _mm256_srai_epi16::<8>(_mm256_slli_epi16::<8>(lo)),
                _mm256_srai_epi16::<8>(_mm256_slli_epi16::<8>(hi)),
                _mm256_srai_epi16::<8>(lo),
                _mm256_srai_epi16::<8>(hi),
            ]
        }
    }

    /// Weight rows `r0..r0 + R` against activation rows `j..j + NA`: the per-lane partial sums
    /// (summed horizontally by the caller).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn tile<const INT4: bool, const VNNI: bool, const R: usize, const NA: usize, const G1: bool>(
        sh: &Shape,
        w: &HostQuantView<'_>,
        acts: &Acts<i16>,
        r0: usize,
        j: usize,
    ) -> [[__m256; NA]; R] {
        let nb = sh.nb;
        let row_bytes = if INT4 { sh.cols / 2 } else { sh.cols };
        let spread = spread(sh.bpg);
        let rows = TileRows::<i16, R, NA>::new(sh, w, acts, r0, j, row_bytes);
        let TileRows { wrow, qx, .. } = rows;
        let mut acc = [[_mm256_setzero_ps(); NA]; R];
        // The factor spreads for the 4 pairs of an octet. Opaque to the compiler, which would
        // otherwise turn each `vpermps` with a constant index into two shuffles.
        let pidx: [__m256i; 4] = std::hint::black_box([
            _mm256_loadu_si256(PAIR_IDX[0].as_ptr().cast()),
            _mm256_loadu_si256(PAIR_IDX[1].as_ptr().cast()),
            _mm256_loadu_si256(PAIR_IDX[2].as_ptr().cast()),
            _mm256_loadu_si256(PAIR_IDX[3].as_ptr().cast()),
        ]);
        let mut b0 = 0;
        while b0 < nb {
            let kend = (nb - b0).min(8);
            // the 8 blocks' factors scale_w * d_x; (int4) their min terms min_w * s_x folded
            // straight into the accumulator lanes
            let fac = octet_factors::<_, G1, R, NA>(sh, w, &rows, b0, spread, if INT4 { Some(&mut acc) } else { None });
            let pair = |q: usize, full: bool, acc: &mut [[__m256; NA]; R]| {
                let b = b0 + 2 * q;
                let mut xv = [[_mm256_setzero_si256(); 4]; NA];
                for t in 0..NA {
                    for (m, v) in xv[t].iter_mut().enumerate() {
                        *v = _mm256_loadu_si256(qx[t].add(b * BLOCK + 16 * m).cast());
                    }
                }
                for i in 0..R {
                    let e = decode_pair::<INT4>(wrow[i], b, full);
                    for t in 0..NA {
                        let x = &xv[t];
                        let dot = if VNNI {
                            let z = _mm256_setzero_si256();
                            dpwssd(dpwssd(dpwssd(dpwssd(z, e[0], x[0]), e[1], x[1]), e[2], x[2]), e[3], x[3])
                        } else {
                            let d01 = _mm256_add_epi32(_mm256_madd_epi16(e[0], x[0]), _mm256_madd_epi16(e[1], x[1]));
                            let d23 = _mm256_add_epi32(_mm256_madd_epi16(e[2], x[2]), _mm256_madd_epi16(e[3], x[3]));
                            _mm256_add_epi32(d01, d23)
                        };
                        let f = _mm256_permutevar8x32_ps(fac[i][t], pidx[q]);
                        acc[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), f, acc[i][t]);
                    }
                }
            };
            if kend == 8 {
                for q in 0..4 {
                    pair(q, true, &mut acc);
                }
            } else {
                for q in 0..kend / 2 {
                    pair(q, true, &mut acc);
                }
                if kend % 2 == 1 {
                    // The row's last block, paired with zeros (its factor lane past `kend` is 0).
                    pair(kend / 2, false, &mut acc);
                }
            }
            b0 += 8;
        }
        acc
    }
}
