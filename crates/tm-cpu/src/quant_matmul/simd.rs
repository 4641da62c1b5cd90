//! AVX2 helpers shared by the kernels.

use std::arch::x86_64::*;

use super::{Acts, HostQuantView, OutPtr, Shape};

/// Where the rows of an `R x NA` register tile start: weight rows `r0..r0 + R`, activation rows
/// `j..j + NA`.
#[derive(Clone, Copy)]
pub(super) struct TileRows<T, const R: usize, const NA: usize> {
    /// Each weight row's packed bytes.
    pub wrow: [*const u8; R],
    /// Each weight row's first group in the scales (and mins).
    pub goff: [usize; R],
    /// Each activation row's quantized values.
    pub qx: [*const T; NA],
    /// Each activation row's block scales `d_x`.
    pub dx: [*const f32; NA],
    /// Each activation row's `d_x · Σ q_x` per block.
    pub sx: [*const f32; NA],
}

impl<T, const R: usize, const NA: usize> TileRows<T, R, NA> {
    /// # Safety
    /// `r0 + R <= sh.rows` with `row_bytes` bytes per packed weight row, `j + NA <= sh.n`, and
    /// `acts` quantized for `sh`.
    #[inline(always)]
    pub(super) unsafe fn new(
        sh: &Shape,
        w: &HostQuantView<'_>,
        acts: &Acts<T>,
        r0: usize,
        j: usize,
        row_bytes: usize,
    ) -> Self {
        let at = |t: usize| (j + t) * sh.nbp;
        TileRows {
            wrow: std::array::from_fn(|i| w.packed.as_ptr().add((r0 + i) * row_bytes)),
            goff: std::array::from_fn(|i| (r0 + i) * sh.groups),
            qx: std::array::from_fn(|t| acts.qs.as_ptr().add((j + t) * acts.stride)),
            dx: std::array::from_fn(|t| acts.d.as_ptr().add(at(t))),
            sx: std::array::from_fn(|t| acts.s.as_ptr().add(at(t))),
        }
    }
}

/// `-1` lanes then `0` lanes: `LANE_MASK[8 - k..]` keeps the first `k` lanes.
static LANE_MASK: [i32; 16] = [-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0];

/// The sum of the eight lanes.
#[inline(always)]
pub(crate) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[inline(always)]
pub(super) unsafe fn h2f(h: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// How group scales spread over the 8 blocks of an octet.
#[derive(Clone, Copy)]
pub(super) enum Spread {
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

/// The factors of the octet of blocks from `b0` (to `b0 + 8` or the row's end) of a tile: for
/// each (weight row, activation row) the blocks' `scale_w · d_x`, returned (lanes past the row's
/// end zero); with `mins` (int4 weights), the blocks' min terms `min_w · s_x` added into its
/// lanes.
///
/// # Safety
/// AVX2/FMA/F16C present; `rows` made for `sh`, `w` and activations quantized for `sh`;
/// `b0 < sh.nb`.
#[inline(always)]
pub(super) unsafe fn octet_factors<T, const G1: bool, const R: usize, const NA: usize>(
    sh: &Shape,
    w: &HostQuantView<'_>,
    rows: &TileRows<T, R, NA>,
    b0: usize,
    spread: Spread,
    mut mins: Option<&mut [[__m256; NA]; R]>,
) -> [[__m256; NA]; R] {
    let kend = (sh.nb - b0).min(8);
    let mask = _mm256_loadu_ps(LANE_MASK.as_ptr().add(8 - kend).cast());
    let (sc, mn, len) =
        (w.scales.as_ptr().cast::<u16>(), w.mins.unwrap_or_default().as_ptr().cast::<u16>(), w.scales.len());
    let mut fac = [[_mm256_setzero_ps(); NA]; R];
    for (i, fi) in fac.iter_mut().enumerate() {
        let sv = octet_f16::<G1>(sc, len, rows.goff[i], b0, kend, sh.bpg, spread, mask);
        match mins.as_deref_mut() {
            Some(m) => {
                let mv = octet_f16::<G1>(mn, len, rows.goff[i], b0, kend, sh.bpg, spread, mask);
                for (t, (f, a)) in fi.iter_mut().zip(m[i].iter_mut()).enumerate() {
                    *f = _mm256_mul_ps(sv, _mm256_loadu_ps(rows.dx[t].add(b0)));
                    *a = _mm256_fmadd_ps(mv, _mm256_loadu_ps(rows.sx[t].add(b0)), *a);
                }
            }
            None => {
                for (f, dx) in fi.iter_mut().zip(&rows.dx) {
                    *f = _mm256_mul_ps(sv, _mm256_loadu_ps(dx.add(b0)));
                }
            }
        }
    }
    fac
}

pub(super) fn spread(bpg: usize) -> Spread {
    if bpg.is_power_of_two() {
        Spread::Pow2(bpg.trailing_zeros())
    } else {
        Spread::Other
    }
}

/// Row tiles ahead to prefetch: the next tile's weights are requested while this one computes,
/// which lets the short per-chunk streams run at memory speed (the hardware prefetcher stops at
/// 4 KiB pages and ramps up slowly).
pub(super) const PREFETCH_TILES: usize = 1;

/// Prefetches the packed bytes, scales and mins of rows `r..r + count` into L1 (addresses past
/// the end are harmless: prefetches never fault).
#[inline(always)]
pub(super) unsafe fn prefetch_rows_ahead(
    w: &HostQuantView<'_>,
    r: usize,
    count: usize,
    row_bytes: usize,
    groups: usize,
) {
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
pub(super) unsafe fn write_tile<const R: usize, const NA: usize>(
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

/// Index vectors that spread lanes `2q` and `2q + 1` of a factor octet over the low and
/// high 128-bit halves (the two blocks of pair `q`).
pub(super) static PAIR_IDX: [[i32; 8]; 4] =
    [[0, 0, 0, 0, 1, 1, 1, 1], [2, 2, 2, 2, 3, 3, 3, 3], [4, 4, 4, 4, 5, 5, 5, 5], [6, 6, 6, 6, 7, 7, 7, 7]];

/// Index vectors broadcasting lane `k` of a factor octet.
pub(super) static LANE_IDX: [[i32; 8]; 8] = [[0; 8], [1; 8], [2; 8], [3; 8], [4; 8], [5; 8], [6; 8], [7; 8]];
