//! FP8 E4M3 ("e4m3fn", the OCP 8-bit float format NVIDIA's Hopper and Ada tensor cores use):
//! the encoding of an 8-bit KV cache.
//!
//! A code is `s eeee mmm`: sign, a 4-bit exponent with bias 7 and a 3-bit mantissa.
//! - exponent field 1..=15: `(-1)^s * 2^(e - 7) * (1 + m / 8)`;
//! - exponent field 0 (subnormal): `(-1)^s * 2^-6 * (m / 8)` = `(-1)^s * m * 2^-9`;
//! - `s 1111 111` (0x7f, 0xff) is NaN; there are no infinities, so the largest finite value is
//!   `0x7e` = `1.75 * 2^8` = 448.
//!
//! [`encode`] rounds to the nearest code, ties to the even code (the one with an even mantissa),
//! and saturates: every value of magnitude 448 or more (infinities included) becomes ±448, as
//! CUDA's `__nv_cvt_float2_to_fp8x2(.., __NV_SATFINITE, __NV_E4M3)` does. NaN becomes 0x7f.
//! [`decode`] is exact (every code is an f32, f16 and bf16 value).
//!
//! The KV cache stores keys and values with scale 1.0 (what vLLM does when a checkpoint brings
//! no KV scales): a key or value component beyond ±448 saturates, and magnitudes below 2^-9
//! (half of it rounds to zero) lose their precision. Keys and values of the supported models
//! are well inside that range.

/// One FP8 E4M3 value, stored as its code.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(transparent)]
pub struct E4M3(pub u8);

/// The largest finite E4M3 value.
pub const MAX: f32 = 448.0;
/// The code of +448 (the saturated value).
pub const MAX_CODE: u8 = 0x7e;
/// The code NaN encodes to.
pub const NAN_CODE: u8 = 0x7f;

/// Decodes one code from its bits (see the module docs).
const fn decode_bits(code: u8) -> f32 {
    let sign = ((code as u32) & 0x80) << 24;
    let exp = ((code >> 3) & 0xf) as u32;
    let man = (code & 0x7) as u32;
    if exp == 0xf && man == 0x7 {
        return f32::from_bits(sign | 0x7fc0_0000);
    }
    if exp == 0 {
        // m * 2^-9: m is 0..=7, the product exact.
        let v = man as f32 * (1.0 / 512.0);
        return if sign != 0 { -v } else { v };
    }
    // Same mantissa, exponent rebased from bias 7 to f32's 127.
    f32::from_bits(sign | ((exp + 120) << 23) | (man << 20))
}

const fn decode_table() -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = decode_bits(i as u8);
        i += 1;
    }
    t
}

/// Every code's value, indexed by the code.
static DECODE: [f32; 256] = decode_table();

/// The value of an E4M3 code (exact; NaN for 0x7f and 0xff).
#[inline]
pub fn decode(code: u8) -> f32 {
    DECODE[code as usize]
}

/// The E4M3 code nearest to `x`: round to nearest, ties to even, saturating at ±448; NaN gives
/// [`NAN_CODE`]. The sign of zero is kept.
pub fn encode(x: f32) -> u8 {
    if x.is_nan() {
        return NAN_CODE;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a >= MAX {
        return sign | MAX_CODE;
    }
    // Below the smallest normal (2^-6) the codes are the multiples of 2^-9 (code = m); m = 8
    // after rounding up is code 0x08 = 2^-6, the smallest normal, so no special case.
    if a < 1.0 / 64.0 {
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    // a in [2^e, 2^(e+1)) with e in -6..=8: the mantissa steps are 2^(e-3). Scaling by a power
    // of two is exact, so r is the one rounding; r = 16 carries into the next exponent.
    let e = ((a.to_bits() >> 23) as i32) - 127;
    let r = (a * f32::from_bits(((127 + 3 - e) as u32) << 23)).round_ties_even() as i32;
    sign | (((e + 7) << 3) + (r - 8)) as u8
}

/// Encodes `src` into `dst` (equal lengths).
pub fn encode_slice(src: &[f32], dst: &mut [u8]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = encode(s);
    }
}

/// Decodes `src` into `dst` (equal lengths).
pub fn decode_slice(src: &[u8], dst: &mut [f32]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = decode(s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The format definition, evaluated in f64.
    fn by_definition(code: u8) -> f64 {
        let s = if code & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = ((code >> 3) & 0xf) as i32;
        let m = (code & 7) as f64;
        if e == 0 {
            s * 2f64.powi(-6) * (m / 8.0)
        } else {
            s * 2f64.powi(e - 7) * (1.0 + m / 8.0)
        }
    }

    #[test]
    fn decode_matches_the_definition_for_all_256_codes() {
        for c in 0..=255u8 {
            let got = decode(c);
            if c & 0x7f == 0x7f {
                assert!(got.is_nan(), "code {c:#04x} is NaN");
                continue;
            }
            assert_eq!(got as f64, by_definition(c), "code {c:#04x}");
            assert_eq!(got.is_sign_negative(), c & 0x80 != 0, "sign of code {c:#04x}");
        }
        assert_eq!(decode(0x7e), 448.0);
        assert_eq!(decode(0xfe), -448.0);
        assert_eq!(decode(0x38), 1.0);
        assert_eq!(decode(0x01), 2f32.powi(-9));
        assert_eq!(decode(0x08), 2f32.powi(-6));
        assert_eq!(decode(0x07), 7.0 * 2f32.powi(-9));
    }

    #[test]
    fn every_finite_code_round_trips() {
        for c in 0..=255u8 {
            if c & 0x7f != 0x7f {
                assert_eq!(encode(decode(c)), c, "code {c:#04x} = {}", decode(c));
            }
        }
    }

    #[test]
    fn nan_encodes_to_the_nan_code() {
        assert_eq!(encode(f32::NAN), NAN_CODE);
        assert_eq!(encode(-f32::NAN), NAN_CODE);
        assert!(decode(0xff).is_nan() && decode(0x7f).is_nan());
    }

    #[test]
    fn saturates_at_448() {
        for x in [448.0f32, 449.0, 463.9, 464.0, 480.0, 1e6, f32::MAX, f32::INFINITY] {
            assert_eq!(encode(x), MAX_CODE, "{x}");
            assert_eq!(encode(-x), 0x80 | MAX_CODE, "-{x}");
        }
        // just below: 447 is nearer 448 than 416
        assert_eq!(encode(447.0), MAX_CODE);
        assert_eq!(encode(420.0), 0x7d);
    }

    #[test]
    fn rounds_to_nearest_with_ties_to_even() {
        // Between every pair of neighbouring finite positive codes: the midpoint goes to the even
        // code, a hair off it to the nearer one.
        for c in 0..0x7eu8 {
            let (lo, hi) = (decode(c) as f64, decode(c + 1) as f64);
            let mid = ((lo + hi) / 2.0) as f32;
            assert_eq!(mid as f64, (lo + hi) / 2.0, "midpoint exact in f32");
            let even = if c % 2 == 0 { c } else { c + 1 };
            assert_eq!(encode(mid), even, "tie between {c:#04x} and {:#04x}", c + 1);
            assert_eq!(encode(-mid), 0x80 | even, "negative tie at {c:#04x}");
            let below = f32::from_bits(mid.to_bits() - 1);
            let above = f32::from_bits(mid.to_bits() + 1);
            assert_eq!(encode(below), c, "below the midpoint of {c:#04x}");
            assert_eq!(encode(above), c + 1, "above the midpoint of {c:#04x}");
        }
        assert_eq!(encode(2f32.powi(-10)), 0, "half the smallest subnormal ties to zero");
        assert_eq!(encode(1.0625), 0x38, "1 + 1/16 ties down to 1.0 (even)");
        assert_eq!(encode(1.1875), 0x3a, "1 + 3/16 ties up to 1.25 (even)");
    }

    #[test]
    fn zero_keeps_its_sign_and_tiny_values_flush() {
        assert_eq!(encode(0.0), 0x00);
        assert_eq!(encode(-0.0), 0x80);
        assert_eq!(encode(1e-30), 0x00);
        assert_eq!(encode(f32::from_bits(1)), 0x00, "f32 subnormal");
        assert_eq!(encode(-1e-30), 0x80);
    }

    #[test]
    fn slices_convert_elementwise() {
        let src = [0.3f32, -2.5, 1000.0, 0.0];
        let mut codes = [0u8; 4];
        encode_slice(&src, &mut codes);
        let mut back = [0f32; 4];
        decode_slice(&codes, &mut back);
        assert_eq!(back, [0.3125, -2.5, 448.0, 0.0]);
    }
}
