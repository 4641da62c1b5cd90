//! Round-to-nearest quantizers into the tm layout.
//!
//! - [`quantize_int4`]: asymmetric, per group `min = min(w)` and `scale = (max(w) - min) / 15`
//!   (the Q4_1 / AWQ zero-point form `w ≈ q * scale + min`).
//! - [`quantize_int8`]: symmetric, per group `scale = max|w| / 127`, `q` in `-127..=127`.
//!
//! Both guarantee `|dequantized - w| <= scale / 2` per element (up to f32 rounding of the
//! dequantization itself): the f16 `min` is rounded towards minus infinity and the f16 `scale`
//! towards plus infinity, so that every weight of the group lies inside the representable range
//! `[min, min + 15 * scale]` (int4) or `[-127 * scale, 127 * scale]` (int8) and rounding to the
//! nearest level is never clamped by more than rounding noise.

use half::f16;
use tm_core::{Error, Result};

use crate::{checked_mul, validate_dims, HostQuant};

/// The largest f16 that is `<= x` (`-inf` below the f16 range).
fn f16_down(x: f32) -> f16 {
    let h = f16::from_f32(x);
    if h.to_f32() <= x {
        return h;
    }
    let b = h.to_bits();
    if b & 0x7FFF == 0 {
        f16::from_bits(0x8001)
    } else if b & 0x8000 == 0 {
        f16::from_bits(b - 1)
    } else {
        f16::from_bits(b + 1)
    }
}

/// The smallest f16 that is `>= x` (`+inf` above the f16 range).
fn f16_up(x: f32) -> f16 {
    let h = f16::from_f32(x);
    if h.to_f32() >= x {
        return h;
    }
    let b = h.to_bits();
    if b & 0x7FFF == 0 {
        f16::from_bits(0x0001)
    } else if b & 0x8000 == 0 {
        f16::from_bits(b + 1)
    } else {
        f16::from_bits(b - 1)
    }
}

fn check_input(weights: &[f32], rows: usize, cols: usize, group_size: usize) -> Result<()> {
    validate_dims(rows, cols, group_size)?;
    let n = checked_mul(rows, cols, "weight count")?;
    if weights.len() != n {
        return Err(Error::shape(format!("weights to quantize [{rows}, {cols}]"), n, weights.len()));
    }
    if let Some(i) = weights.iter().position(|w| !w.is_finite()) {
        return Err(Error::invalid(format!(
            "weight ({}, {}) is {}; only finite weights quantize",
            i / cols,
            i % cols,
            weights[i]
        )));
    }
    Ok(())
}

fn range_error(kind: &str, r: usize, g: usize, lo: f32, hi: f32) -> Error {
    Error::invalid(format!(
        "{kind} quantization of row {r}, group {g}: values in [{lo}, {hi}] need a scale or min outside f16"
    ))
}

/// Quantizes row-major `[rows, cols]` f32 weights to int4 with an asymmetric scale and min per
/// group of `group_size` columns (a multiple of 32 dividing `cols`).
///
/// Errors on bad dimensions, non-finite weights, or groups whose scale or min does not fit f16.
pub fn quantize_int4(weights: &[f32], rows: usize, cols: usize, group_size: usize) -> Result<HostQuant> {
    check_input(weights, rows, cols, group_size)?;
    let groups = cols / group_size;
    let mut packed = vec![0u8; rows * cols / 2];
    let mut scales = Vec::with_capacity(rows * groups);
    let mut mins = Vec::with_capacity(rows * groups);
    for r in 0..rows {
        let row = &weights[r * cols..(r + 1) * cols];
        let prow = &mut packed[r * cols / 2..(r + 1) * cols / 2];
        for (g, grp) in row.chunks_exact(group_size).enumerate() {
            let lo = grp.iter().copied().fold(f32::INFINITY, f32::min);
            let hi = grp.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let min = f16_down(lo);
            let scale = f16_up((hi - min.to_f32()) / 15.0);
            if !min.is_finite() || !scale.is_finite() {
                return Err(range_error("int4", r, g, lo, hi));
            }
            let (m, s) = (min.to_f32(), scale.to_f32());
            let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
            for (i, &w) in grp.iter().enumerate() {
                let q = ((w - m) * inv).round().clamp(0.0, 15.0) as u8;
                let c = g * group_size + i;
                let (byte, high) = tm_core::quant::int4_position(c);
                prow[byte] |= if high { q << 4 } else { q };
            }
            scales.push(scale);
            mins.push(min);
        }
    }
    Ok(HostQuant { rows, cols, group_size, packed, scales, mins: Some(mins) })
}

/// Quantizes row-major `[rows, cols]` f32 weights to int8 with a symmetric scale per group of
/// `group_size` columns (a multiple of 32 dividing `cols`); values are in `-127..=127`.
///
/// Errors on bad dimensions, non-finite weights, or groups whose scale does not fit f16.
pub fn quantize_int8(weights: &[f32], rows: usize, cols: usize, group_size: usize) -> Result<HostQuant> {
    check_input(weights, rows, cols, group_size)?;
    let groups = cols / group_size;
    let mut packed = Vec::with_capacity(rows * cols);
    let mut scales = Vec::with_capacity(rows * groups);
    for r in 0..rows {
        let row = &weights[r * cols..(r + 1) * cols];
        for (g, grp) in row.chunks_exact(group_size).enumerate() {
            let amax = grp.iter().fold(0.0f32, |a, w| a.max(w.abs()));
            let scale = f16_up(amax / 127.0);
            if !scale.is_finite() {
                return Err(range_error("int8", r, g, -amax, amax));
            }
            let s = scale.to_f32();
            let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
            packed.extend(grp.iter().map(|&w| ((w * inv).round().clamp(-127.0, 127.0) as i8) as u8));
            scales.push(scale);
        }
    }
    Ok(HostQuant { rows, cols, group_size, packed, scales, mins: None })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directed_f16_rounding() {
        for &x in &[0.0f32, -0.0, 1e-9, -1e-9, 0.1, -0.1, 1.0, 3.3, -2.7, 65504.0, 1e-5] {
            let d = f16_down(x);
            let u = f16_up(x);
            assert!(d.to_f32() <= x && u.to_f32() >= x, "{x}: {d} {u}");
            assert!(u.to_bits() == d.to_bits() || (u.to_f32() - d.to_f32()) > 0.0);
        }
        assert!(f16_up(70000.0).is_infinite());
        assert!(f16_down(-70000.0).is_infinite());
    }
}
