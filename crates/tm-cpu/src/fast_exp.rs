//! `exp` over slices for the attention's softmax and the MLP's SiLU: eight lanes at a time in AVX2
//! where the CPU has it (picked at run time), the same arithmetic one value at a time elsewhere,
//! instead of one libm call per element.
//!
//! `e^x = 2^n · e^r` with `n = round(x / ln 2)` and `r = x - n ln 2` (ln 2 split in two parts, so
//! `r` is exact to well below f32's precision), `e^r` by its Taylor series to degree 7 on
//! `|r| <= ln 2 / 2` (truncation below 3e-9 relative), `2^n` built in the exponent bits. Inputs
//! below [`UNDERFLOW`] give 0 (their true values are below f32's normal range); inputs above
//! [`OVERFLOW`] are clamped to it rather than handled (the softmax only takes `x <= 0`; SiLU's
//! `g / (1 + e^-g)` is then below `1e-36` in size where the true value is smaller still). NaN gives
//! NaN.

/// Below this, `exp` returns 0 (`e^-87.3` is about f32's smallest normal number).
pub const UNDERFLOW: f32 = -87.3;
/// Inputs are clamped to at most this (`2^n` must stay a finite f32: `e^88` is 1.65e38).
pub const OVERFLOW: f32 = 88.0;

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 = LN2_HI + LN2_LO, LN2_HI with few enough bits that `n * LN2_HI` is exact.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Adding and subtracting 1.5 * 2^23 rounds to the nearest integer.
const ROUND: f32 = 12_582_912.0;
/// The Taylor coefficients of `e^r`, highest degree first.
const TAYLOR: [f32; 8] = [1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0];

/// `e^x` for one value (see the module docs); the eight-lane form gives the same bits.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let xc = x.clamp(UNDERFLOW, OVERFLOW);
    let n = (xc * LOG2E + ROUND) - ROUND;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let p = TAYLOR[1..].iter().fold(TAYLOR[0], |p, &c| p * r + c);
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    if x < UNDERFLOW {
        0.0
    } else {
        p * scale
    }
}

/// `s[i] = exp(s[i] - shift)` for every element; returns their sum.
pub fn exp_shifted_sum(s: &mut [f32], shift: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the CPU has AVX2.
        return unsafe { avx2::exp_shifted_sum(s, shift) };
    }
    let mut total = 0.0;
    for v in s {
        *v = exp(*v - shift);
        total += *v;
    }
    total
}

/// `out[i] = silu(gate[i]) * up[i]`, with `silu(g) = g / (1 + e^-g)`. The slices have the same
/// length (else only the common prefix is written).
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: the CPU has AVX2.
        return unsafe { avx2::silu_mul(gate, up, out) };
    }
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = silu_one(g, u);
    }
}

/// One element of [`silu_mul`]; the eight-lane form gives the same bits.
#[inline(always)]
fn silu_one(g: f32, u: f32) -> f32 {
    g / (1.0 + exp(-g)) * u
}

#[cfg(target_arch = "x86_64")]
fn avx2() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avx2"))
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// [`super::exp_shifted_sum`] eight lanes at a time (the same operations as [`exp`], no
    /// fused multiply-adds, so the same bits).
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn exp_shifted_sum(s: &mut [f32], shift: f32) -> f32 {
        let sh = _mm256_set1_ps(shift);
        let mut acc = _mm256_setzero_ps();
        let mut chunks = s.chunks_exact_mut(8);
        for c in chunks.by_ref() {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), sh));
            _mm256_storeu_ps(c.as_mut_ptr(), e);
            acc = _mm256_add_ps(acc, e);
        }
        let mut total = crate::quant_matmul::simd::hsum(acc);
        for v in chunks.into_remainder() {
            *v = exp(*v - shift);
            total += *v;
        }
        total
    }

    /// [`super::silu_mul`] eight lanes at a time (the same operations as `silu_one`).
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
        let len = out.len().min(gate.len()).min(up.len());
        let (mut i, one, sign) = (0, _mm256_set1_ps(1.0), _mm256_set1_ps(-0.0));
        while i + 8 <= len {
            let g = _mm256_loadu_ps(gate.as_ptr().add(i));
            let e = exp8(_mm256_xor_ps(g, sign));
            let s = _mm256_div_ps(g, _mm256_add_ps(one, e));
            _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_mul_ps(s, _mm256_loadu_ps(up.as_ptr().add(i))));
            i += 8;
        }
        for k in i..len {
            out[k] = silu_one(gate[k], up[k]);
        }
    }

    #[inline(always)]
    unsafe fn exp8(x: __m256) -> __m256 {
        let set = _mm256_set1_ps;
        // `min`/`max` return their second operand when either is NaN: `x` second keeps a NaN.
        let xc = _mm256_max_ps(set(UNDERFLOW), _mm256_min_ps(set(OVERFLOW), x));
        let n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(xc, set(LOG2E)), set(ROUND)), set(ROUND));
        let r = _mm256_sub_ps(_mm256_sub_ps(xc, _mm256_mul_ps(n, set(LN2_HI))), _mm256_mul_ps(n, set(LN2_LO)));
        let mut p = set(TAYLOR[0]);
        for &c in &TAYLOR[1..] {
            p = _mm256_add_ps(_mm256_mul_ps(p, r), set(c));
        }
        let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
        let e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
        // lanes below UNDERFLOW: 0
        _mm256_andnot_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(x, set(UNDERFLOW)), e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_f64_within_two_ulp_and_underflows_to_zero() {
        let mut worst = 0f64;
        // every 1/4096 from -100 to 88
        for i in -409_600..=360_448 {
            let x = i as f32 / 4096.0;
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            if x < UNDERFLOW {
                assert_eq!(got, 0.0, "exp({x})");
                continue;
            }
            let rel = (got - want).abs() / want;
            worst = worst.max(rel);
            assert!(rel <= 2.0 * f32::EPSILON as f64, "exp({x}) = {got}, want {want} (relative error {rel:e})");
        }
        assert!(worst > 0.0);
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn nan_stays_nan() {
        assert!(exp(f32::NAN).is_nan());
        let mut s = [0.0, f32::NAN, -1.0, 0.5, -2.0, -3.0, -4.0, -5.0, f32::NAN];
        exp_shifted_sum(&mut s, 0.0);
        assert!(s[1].is_nan() && s[8].is_nan() && s[0] == 1.0, "{s:?}");
        let mut out = [0.0; 9];
        silu_mul(&[1.0, f32::NAN, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, f32::NAN], &[1.0; 9], &mut out);
        assert!(out[1].is_nan() && out[8].is_nan() && out[2] == 0.0, "{out:?}");
    }

    #[test]
    fn silu_mul_matches_f64_and_the_scalar_form() {
        // every 1/64 from -120 to 120, times a few multipliers; slices of odd lengths
        let gate: Vec<f32> = (-7680..=7680).map(|i| i as f32 / 64.0).collect();
        let up: Vec<f32> = (0..gate.len()).map(|i| [1.0, -0.75, 3.0][i % 3]).collect();
        let mut out = vec![f32::NAN; gate.len()];
        silu_mul(&gate, &up, &mut out);
        for ((&g, &u), &o) in gate.iter().zip(&up).zip(&out) {
            assert_eq!(o.to_bits(), silu_one(g, u).to_bits(), "silu({g}) * {u}");
            let want = g as f64 / (1.0 + (-g as f64).exp()) * u as f64;
            // a few ulp where the exponential is in range; below -87.3 both are ~0
            let tol = if g < -87.0 { 1e-35 } else { 4.0 * f32::EPSILON as f64 * want.abs() };
            assert!((o as f64 - want).abs() <= tol, "silu({g}) * {u} = {o}, want {want}");
        }
        for len in [0, 1, 7, 9, 17] {
            let mut part = vec![f32::NAN; len];
            silu_mul(&gate[3..3 + len], &up[3..3 + len], &mut part);
            assert_eq!(part, out[3..3 + len]);
        }
    }

    #[test]
    fn slice_form_matches_the_scalar_form_and_sums() {
        for len in [0, 1, 7, 8, 9, 64, 100] {
            let x: Vec<f32> = (0..len).map(|i| -((i * 37 % 101) as f32) / 7.0 + 3.0).collect();
            let mut s = x.clone();
            let total = exp_shifted_sum(&mut s, 3.0);
            let mut want_total = 0f64;
            for (g, &x) in s.iter().zip(&x) {
                assert_eq!(*g, exp(x - 3.0), "len {len}, x {x}");
                want_total += ((x - 3.0) as f64).exp();
            }
            assert!(
                (total as f64 - want_total).abs() <= 1e-6 * want_total.max(1e-30),
                "len {len}: {total} vs {want_total}"
            );
        }
    }
}
