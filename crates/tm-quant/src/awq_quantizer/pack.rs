//! The AWQ int4 quantizer (asymmetric, zero point per group) and AutoAWQ's GEMM packing.

use super::Matrix;
use crate::awq::pack_awq_matrix;
use crate::zero_point::{ZeroPointFormat, ZeroPointInt4};
use half::f16;
use tm_core::{DType, Error, Result};

/// Levels of a 4-bit value.
const MAX_Q: f32 = 15.0;

/// The scale (as stored, in f16) and zero point of a group of weights:
/// `s = max(max - min, 1e-5) / 15`, `z = clamp(-round(min / s), 0, 15)`, rounding ties to even
/// like `torch.round` in AutoAWQ's `pseudo_quantize_tensor`.
fn group_params(w: &[f32]) -> (f16, f32) {
    let lo = w.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = w.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let scale = f16::from_f32((hi - lo).max(1e-5) / MAX_Q);
    let z = (-(lo / scale.to_f32()).round_ties_even()).clamp(0.0, MAX_Q);
    (scale, z)
}

/// The 4-bit value of `w` with scale `s` and zero point `z` (ties to even, as `torch.round`).
fn level(w: f32, s: f32, z: f32) -> f32 {
    ((w / s).round_ties_even() + z).clamp(0.0, MAX_Q)
}

/// Quantizes and dequantizes in place, group by group along each row of `w` (`[.., cols]`
/// row-major with `cols` a multiple of `group_size`): what the weights become in the checkpoint.
pub fn pseudo_quantize(w: &mut [f32], group_size: usize) {
    for g in w.chunks_exact_mut(group_size) {
        let (scale, z) = group_params(g);
        let s = scale.to_f32();
        g.iter_mut().for_each(|w| *w = (level(*w, s, z) - z) * s);
    }
}

/// One linear layer in AutoAWQ's "GEMM" layout (see [`crate::awq`] and [`crate::zero_point`]).
#[derive(Clone, Debug, PartialEq)]
pub struct AwqGemm {
    /// Inputs.
    pub in_features: usize,
    /// Outputs (a multiple of 8).
    pub out_features: usize,
    /// Inputs per group.
    pub group_size: usize,
    /// `[in, out / 8]` words: 8 outputs per word in AWQ's nibble order.
    pub qweight: Vec<u32>,
    /// `[in / group_size, out / 8]` words of zero points, packed the same way.
    pub qzeros: Vec<u32>,
    /// `[in / group_size, out]` scales.
    pub scales: Vec<f16>,
}

/// Little-endian bytes of words (the checkpoint's int32 tensors).
fn le_bytes(words: &[u32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

impl AwqGemm {
    /// Quantizes `w` (`[out, in]`) with groups of `group_size` inputs (see the module docs of
    /// [`crate::awq_quantizer`] for the formula). `name` is used in errors.
    ///
    /// Errors when `out` is not a multiple of 8, the group size is not a multiple of 32 dividing
    /// `in`, a weight is not finite, or a group's scale or `-zero · scale` overflows f16.
    pub fn quantize(w: &Matrix, group_size: usize, name: &str) -> Result<AwqGemm> {
        let (n_out, n_in) = (w.rows, w.cols);
        crate::validate_dims(n_out, n_in, group_size).map_err(|e| Error::invalid(format!("{name}: {e}")))?;
        if n_out == 0 || !n_out.is_multiple_of(8) {
            return Err(Error::invalid(format!("{name}: {n_out} outputs is not a positive multiple of 8")));
        }
        if let Some(i) = w.data.iter().position(|v| !v.is_finite()) {
            return Err(Error::invalid(format!("{name}: weight ({}, {}) is {}", i / n_in, i % n_in, w.data[i])));
        }
        let groups = n_in / group_size;
        // Transposed to [in, out] for the packing, which runs along the outputs.
        let mut q_t = vec![0u8; n_in * n_out];
        let mut z_t = vec![0u8; groups * n_out];
        let mut scales = vec![f16::ZERO; groups * n_out];
        for o in 0..n_out {
            for (g, grp) in w.row(o).chunks_exact(group_size).enumerate() {
                let (scale, z) = group_params(grp);
                let s = scale.to_f32();
                if !scale.is_finite() || !f16::from_f32(z * s).is_finite() {
                    return Err(Error::invalid(format!(
                        "{name}: output {o}, group {g}: weights too large for f16 scales (scale {s}, zero {z})"
                    )));
                }
                scales[g * n_out + o] = scale;
                z_t[g * n_out + o] = z as u8;
                for (i, &v) in grp.iter().enumerate() {
                    q_t[(g * group_size + i) * n_out + o] = level(v, s, z) as u8;
                }
            }
        }
        let pack = |v: &[u8], rows| pack_awq_matrix(v, rows, n_out).ok_or_else(|| Error::invalid("AWQ packing"));
        Ok(AwqGemm {
            in_features: n_in,
            out_features: n_out,
            group_size,
            qweight: pack(&q_t, n_in)?,
            qzeros: pack(&z_t, groups)?,
            scales,
        })
    }

    /// `qweight` as the checkpoint's little-endian int32 bytes.
    pub fn qweight_bytes(&self) -> Vec<u8> {
        le_bytes(&self.qweight)
    }

    /// `qzeros` as the checkpoint's little-endian int32 bytes.
    pub fn qzeros_bytes(&self) -> Vec<u8> {
        le_bytes(&self.qzeros)
    }

    /// `scales` as the checkpoint's little-endian f16 bytes.
    pub fn scales_bytes(&self) -> Vec<u8> {
        self.scales.iter().flat_map(|s| s.to_le_bytes()).collect()
    }

    /// The weights as the checkpoint defines them, `(q - z) · s` (`[out, in]`), read back
    /// through [`ZeroPointInt4`], the loader's own unpacking.
    pub fn dequantize(&self) -> Result<Vec<f32>> {
        let (qweight, qzeros, scales) = (self.qweight_bytes(), self.qzeros_bytes(), self.scales_bytes());
        ZeroPointInt4 {
            format: ZeroPointFormat::Awq,
            in_features: self.in_features,
            out_features: self.out_features,
            group_size: self.group_size,
            qweight: &qweight,
            qzeros: &qzeros,
            scales: &scales,
            scales_dtype: DType::F16,
        }
        .dequantize_reference()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weights(rows: usize, cols: usize, seed: u32) -> Matrix {
        let mut x = seed.wrapping_mul(2654435761).max(1);
        let data = (0..rows * cols)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x % 2001) as f32 / 1000.0 - 1.0
            })
            .collect();
        Matrix::new(rows, cols, data).unwrap()
    }

    /// Packing then unpacking with the loader's reader gives back the pseudo-quantized weights,
    /// and every group's error is within half a step.
    #[test]
    fn packed_weights_read_back_as_quantized() {
        let w = weights(24, 96, 3);
        let q = AwqGemm::quantize(&w, 32, "test").unwrap();
        assert_eq!((q.qweight.len(), q.qzeros.len(), q.scales.len()), (96 * 3, 3 * 3, 3 * 24));
        let back = q.dequantize().unwrap();
        let mut pq = w.data.clone();
        pseudo_quantize(&mut pq, 32);
        for (i, (a, b)) in back.iter().zip(&pq).enumerate() {
            assert!((a - b).abs() <= 1e-6 * (1.0 + b.abs()), "{i}: {a} vs {b}");
        }
        for o in 0..24 {
            for g in 0..3 {
                let grp = &w.row(o)[32 * g..32 * (g + 1)];
                let (lo, hi) = grp.iter().fold((f32::MAX, f32::MIN), |(l, h), v| (l.min(*v), h.max(*v)));
                let step = q.scales[g * 24 + o].to_f32();
                assert!((step - (hi - lo) / 15.0).abs() <= 1e-3 * step);
                for i in 0..32 {
                    let err = (back[o * 96 + 32 * g + i] - grp[i]).abs();
                    // Half a step, plus the clamp of a max that the rounded zero point moved.
                    assert!(err <= 1.001 * step, "({o}, {g}, {i}): error {err} > step {step}");
                }
            }
        }
        // A hand-checked group: values 0..=15 times 0.5 minus 2 quantize exactly.
        let exact: Vec<f32> = (0..32).map(|i| (i % 16) as f32 * 0.5 - 2.0).collect();
        let m = Matrix::new(8, 32, exact.repeat(8)).unwrap();
        let q = AwqGemm::quantize(&m, 32, "exact").unwrap();
        assert_eq!(q.scales[0].to_f32(), 0.5);
        assert_eq!(crate::awq::unpack_awq(q.qzeros[0]), [4; 8]);
        assert_eq!(q.dequantize().unwrap(), exact.repeat(8));
    }

    #[test]
    fn bad_shapes_are_named() {
        let w = weights(12, 64, 1);
        assert!(AwqGemm::quantize(&w, 32, "x.q_proj").unwrap_err().to_string().contains("x.q_proj: 12 outputs"));
        let w = weights(8, 64, 1);
        let e = AwqGemm::quantize(&w, 128, "x.o_proj").unwrap_err().to_string();
        assert!(e.contains("x.o_proj") && e.contains("group size 128"), "{e}");
        let mut w = weights(8, 64, 1);
        w.data[70] = f32::INFINITY;
        assert!(AwqGemm::quantize(&w, 32, "x").unwrap_err().to_string().contains("(1, 6)"));
    }
}
