//! The int16-activation kernels ([`super::q16`]) on 512-bit vectors ([`super::Isa::Avx512Vnni`]):
//! four 32-column blocks a step instead of two, with AVX-512 VNNI's `vpdpwssd`.
//!
//! The activations are in the quad layout ([`super::q16::quad_pos`]): for quad `u` (blocks
//! `4u..4u + 4`) vector `Xm` holds the AVX2 pair layout's `Xm` of pair `2u` in its low 256 bits and
//! that of pair `2u + 1` in its high 256 bits. The weights need no new layout:
//! - int4: the 64 bytes of the quad, read as 16-bit words, are the two pairs' 32 bytes side by
//!   side, so the AVX2 decode (a mask, two shifts-and-masks, one shift) on 512 bits gives the
//!   partners of `X0`..`X3`;
//! - int8: two 64-byte loads (blocks `A B` and `C D`) regrouped by 128-bit lanes into
//!   `A[0..16] B[0..16] C[0..16] D[0..16]` and `A[16..32] B[16..32] ..`, then sign-extended as in
//!   the AVX2 path.
//!
//! Lanes `4k..4k + 4` of the sum of the four `vpdpwssd`s are block `k`'s partial sums. Each block's
//! factor `scale_w · d_x` is spread over its four lanes by one permutation of the octet's eight
//! factors. A row's last quad may be short: its missing weight bytes are read as zeros by masked
//! loads (which never fault), its missing activations are the layout's zero padding, and its
//! factors past the row's blocks are zero.

use std::arch::x86_64::*;
use std::ops::Range;

use super::simd::{octet_factors, prefetch_rows_ahead, spread, write_tile, TileRows, PREFETCH_TILES};
use super::{Acts, HostQuantView, OutPtr, Shape, BLOCK};

/// Index vectors that spread lanes `4q..4q + 4` of a factor octet over four lanes each (the four
/// blocks of quad `q` of the octet).
static QUAD_IDX: [[i32; 16]; 2] =
    [[0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3], [4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7]];

/// Weight rows `rows` (int4 if `INT4`, else int8) against activation rows `j..j + na`, written to
/// `out`.
///
/// # Safety
/// AVX2/FMA/F16C and AVX-512 F/BW/VNNI present; `w` validated for `sh` and the kind; `acts`
/// quantized for `sh` in the quad layout; `rows.end <= sh.rows`, `j + na <= sh.n`,
/// `na <= MAX_NA`; nobody else writes these output rows meanwhile.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn rows<const INT4: bool>(
    sh: &Shape,
    w: &HostQuantView<'_>,
    acts: &Acts<i16>,
    rows: Range<usize>,
    j: usize,
    na: usize,
    out: OutPtr,
) {
    match na {
        1 => rows_tiled::<INT4, 4, 1>(sh, w, acts, rows, j, out),
        2 => rows_tiled::<INT4, 2, 2>(sh, w, acts, rows, j, out),
        3 => rows_tiled::<INT4, 1, 3>(sh, w, acts, rows, j, out),
        _ => rows_tiled::<INT4, 2, 4>(sh, w, acts, rows, j, out),
    }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
unsafe fn rows_tiled<const INT4: bool, const R: usize, const NA: usize>(
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
            tile::<INT4, R, NA, true>(sh, w, acts, r, j)
        } else {
            tile::<INT4, R, NA, false>(sh, w, acts, r, j)
        };
        write_tile(&acc, out, sh.rows, r, j);
        r += R;
    }
    while r < rows.end {
        let acc = tile::<INT4, 1, NA, false>(sh, w, acts, r, j);
        write_tile(&acc, out, sh.rows, r, j);
        r += 1;
    }
}

/// `acc + madd(a, b)` in one instruction, `vpdpwssd` (written as assembly: the compiler otherwise
/// splits the intrinsic back into `vpmaddwd` and `vpaddd`, which measured about 10% slower).
///
/// # Safety
/// The CPU has AVX-512 F and VNNI.
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn dpwssd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
    let mut r = acc;
    std::arch::asm!(
        "vpdpwssd {r}, {a}, {b}",
        r = inout(zmm_reg) r,
        a = in(zmm_reg) a,
        b = in(zmm_reg) b,
        options(pure, nomem, nostack, preserves_flags)
    );
    r
}

/// The mask of the first `bytes` (at most 64) bytes of a 512-bit load.
#[inline(always)]
fn byte_mask(bytes: usize) -> __mmask64 {
    if bytes >= 64 {
        !0
    } else {
        (1u64 << bytes) - 1
    }
}

/// The weights of the quad of `blocks` (1 to 4) blocks starting at block `b` of the row at
/// `wrow`, as the four i16 vectors that pair with the activations' `X0`..`X3` (blocks past
/// `blocks` read as zeros).
#[inline(always)]
unsafe fn decode_quad<const INT4: bool>(wrow: *const u8, b: usize, blocks: usize) -> [__m512i; 4] {
    if INT4 {
        let p = wrow.wrapping_add(b * 16);
        let v = if blocks == 4 {
            _mm512_loadu_si512(p.cast())
        } else {
            _mm512_maskz_loadu_epi8(byte_mask(16 * blocks), p.cast())
        };
        let m4 = _mm512_set1_epi16(0x000F);
        [
            _mm512_and_si512(v, m4),
            _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4),
            _mm512_and_si512(_mm512_srli_epi16::<8>(v), m4),
            _mm512_srli_epi16::<12>(v),
        ]
    } else {
        let p = wrow.wrapping_add(b * BLOCK);
        let (ab, cd) = if blocks == 4 {
            (_mm512_loadu_si512(p.cast()), _mm512_loadu_si512(p.wrapping_add(2 * BLOCK).cast()))
        } else {
            let first = BLOCK * blocks.min(2);
            let second = BLOCK * blocks.saturating_sub(2);
            (
                _mm512_maskz_loadu_epi8(byte_mask(first), p.cast()),
                _mm512_maskz_loadu_epi8(byte_mask(second), p.wrapping_add(2 * BLOCK).cast()),
            )
        };
        // 128-bit lanes of `ab`: A[0..16] A[16..32] B[0..16] B[16..32]; likewise `cd`.
        let lo = _mm512_shuffle_i64x2::<0x88>(ab, cd);
        let hi = _mm512_shuffle_i64x2::<0xDD>(ab, cd);
        [
            _mm512_srai_epi16::<8>(_mm512_slli_epi16::<8>(lo)),
            _mm512_srai_epi16::<8>(_mm512_slli_epi16::<8>(hi)),
            _mm512_srai_epi16::<8>(lo),
            _mm512_srai_epi16::<8>(hi),
        ]
    }
}

/// Weight rows `r0..r0 + R` against activation rows `j..j + NA`: the per-lane partial sums
/// (8 lanes each, summed horizontally by the caller).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn tile<const INT4: bool, const R: usize, const NA: usize, const G1: bool>(
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
    let mut acc = [[_mm512_setzero_ps(); NA]; R];
    // The int4 min terms, eight blocks a step.
    let mut macc = [[_mm256_setzero_ps(); NA]; R];
    // Opaque to the compiler, which would otherwise rebuild the constant indices in the loop.
    let qidx: [__m512i; 2] = std::hint::black_box([
        _mm512_loadu_si512(QUAD_IDX[0].as_ptr().cast()),
        _mm512_loadu_si512(QUAD_IDX[1].as_ptr().cast()),
    ]);
    let mut b0 = 0;
    while b0 < nb {
        let kend = (nb - b0).min(8);
        // the 8 blocks' factors scale_w * d_x; (int4) their min terms min_w * s_x into `macc`
        let fac = octet_factors::<_, G1, R, NA>(sh, w, &rows, b0, spread, if INT4 { Some(&mut macc) } else { None });
        let quad = |q: usize, blocks: usize, acc: &mut [[__m512; NA]; R]| {
            let b = b0 + 4 * q;
            let mut e = [[_mm512_setzero_si512(); 4]; R];
            for i in 0..R {
                e[i] = decode_quad::<INT4>(wrow[i], b, blocks);
            }
            for t in 0..NA {
                let xp = qx[t].add(b * BLOCK);
                let x = [
                    _mm512_loadu_si512(xp.cast()),
                    _mm512_loadu_si512(xp.add(32).cast()),
                    _mm512_loadu_si512(xp.add(64).cast()),
                    _mm512_loadu_si512(xp.add(96).cast()),
                ];
                for i in 0..R {
                    let dot = _mm512_madd_epi16(e[i][0], x[0]);
                    let dot = dpwssd(dpwssd(dpwssd(dot, e[i][1], x[1]), e[i][2], x[2]), e[i][3], x[3]);
                    let f = _mm512_permutexvar_ps(qidx[q], _mm512_castps256_ps512(fac[i][t]));
                    acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), f, acc[i][t]);
                }
            }
        };
        if kend == 8 {
            quad(0, 4, &mut acc);
            quad(1, 4, &mut acc);
        } else {
            quad(0, kend.min(4), &mut acc);
            if kend > 4 {
                quad(1, kend - 4, &mut acc);
            }
        }
        b0 += 8;
    }
    // Each 16-lane sum folded to 8 lanes, plus the min terms: the 256-bit tiles' result type.
    let mut sums = [[_mm256_setzero_ps(); NA]; R];
    for ((s_row, a_row), m_row) in sums.iter_mut().zip(&acc).zip(&macc) {
        for ((s, a), m) in s_row.iter_mut().zip(a_row).zip(m_row) {
            let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(*a)));
            *s = _mm256_add_ps(_mm256_add_ps(_mm512_castps512_ps256(*a), high), *m);
        }
    }
    sums
}
