//! Zero-point int4 checkpoints (AutoAWQ "GEMM" and GPTQ) repacked into the tm int4 layout.
//!
//! Both formats store a linear layer `y = x Wᵀ` with `in_features` inputs and `out_features`
//! outputs as three tensors:
//!
//! | tensor    | dtype  | shape                        | holds                                        |
//! |-----------|--------|------------------------------|----------------------------------------------|
//! | `qweight` | int32  | AWQ `[in, out/8]`, GPTQ `[in/8, out]` | the 4-bit values `q`, 8 per word     |
//! | `qzeros`  | int32  | `[in/group, out/8]`          | the 4-bit zero points `z`, 8 per word        |
//! | `scales`  | f16    | `[in/group, out]`            | the scale `s` of each group of each output   |
//!
//! and a weight is `W[o][i] = (q - z) · s` with `g = i / group_size` the group of input `i`.
//! Words are little-endian; nibble `n` of a word is bits `4n .. 4n + 4`. Where the 8 values of a
//! word go differs: AWQ packs 8 *outputs* per word in an interleaved order ([`crate::awq`]), GPTQ
//! packs 8 *inputs* of `qweight` (and 8 outputs of `qzeros`) in sequential order and, in its
//! original ("v1") checkpoint format, stores `z - 1` ([`crate::gptq`]).
//!
//! # The mapping onto tm's layout, and its rounding error
//! tm stores `w = q · scale + min` ([`tm_core::quant`]), so `(q - z) · s` becomes `scale = s`,
//! `min = -z · s`: the nibbles are moved (never expanded to floats) and transposed to
//! `[out, in]`. `scale` is `s` itself when the checkpoint's scales are f16 (always, for AutoAWQ and
//! AutoGPTQ); `-z · s` is computed exactly (in f64) and rounded to f16 once. That rounding is the
//! only difference from the exact formula: for every weight,
//! `|tm - (q - z) · s| = |f16(-z·s) + z·s| <= 2⁻¹¹ · |z·s| <= 16 · s · 2⁻¹¹ = s / 128`,
//! i.e. at most 1/128 of one quantization step (`2⁻²⁵` absolute when `z·s` is an f16 subnormal),
//! against the up to `s / 2` that quantizing the weights cost in the first place. The error is
//! the same for the whole group (a small per-group offset). With f32 or bf16 scales the scale
//! is also rounded to f16 (relative error `<= 2⁻¹¹`).

use half::{bf16, f16};
use tm_core::{DType, Error, Result};

use crate::{checked_mul, validate_dims, HostQuant};

/// Which packing a zero-point int4 checkpoint uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ZeroPointFormat {
    /// AutoAWQ "GEMM": `qweight` `[in, out/8]`, 8 outputs per word in AWQ's interleaved order
    /// (see [`crate::awq`]); zero points stored as they are.
    Awq,
    /// GPTQ: `qweight` `[in/8, out]`, 8 inputs per word in sequential order (see
    /// [`crate::gptq`]). `zero_offset` is added to every stored zero point: 1 for the original
    /// checkpoint format (`checkpoint_format: "gptq"`, which stores `z - 1`), 0 for `"gptq_v2"`.
    Gptq {
        /// Added to each stored zero point (0 or 1).
        zero_offset: u8,
    },
}

/// The tensors of one zero-point int4 linear layer, borrowed as the raw little-endian bytes of
/// the checkpoint (no alignment needed).
#[derive(Clone, Copy, Debug)]
pub struct ZeroPointInt4<'a> {
    /// How `qweight` and `qzeros` are packed.
    pub format: ZeroPointFormat,
    /// Inputs (`cols` of the tm matrix): a multiple of 32 and of `group_size`.
    pub in_features: usize,
    /// Outputs (`rows` of the tm matrix): a multiple of 8.
    pub out_features: usize,
    /// Inputs per group: a multiple of 32 dividing `in_features` (`in_features` itself for one
    /// group per output channel).
    pub group_size: usize,
    /// `in * out / 8` int32 words (see [`ZeroPointFormat`] for the shape).
    pub qweight: &'a [u8],
    /// `[in / group_size, out / 8]` int32 words.
    pub qzeros: &'a [u8],
    /// `[in / group_size, out]` scales of dtype `scales_dtype`.
    pub scales: &'a [u8],
    /// f16 (AutoAWQ, AutoGPTQ), bf16 or f32.
    pub scales_dtype: DType,
}

/// Word `i` of a little-endian int32 buffer.
pub(crate) fn word(bytes: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]])
}

/// Nibble `n` (bits `4n .. 4n + 4`) of a word.
pub(crate) fn nibble(w: u32, n: usize) -> u8 {
    ((w >> (4 * n)) & 0xF) as u8
}

impl ZeroPointInt4<'_> {
    /// Groups per output: `in_features / group_size`.
    pub fn groups(&self) -> usize {
        self.in_features.checked_div(self.group_size).unwrap_or(0)
    }

    /// Checks the dimensions against tm's layout and every byte length against the shapes.
    pub fn validate(&self) -> Result<()> {
        let (n_in, n_out) = (self.in_features, self.out_features);
        validate_dims(n_out, n_in, self.group_size)?;
        if n_out == 0 || !n_out.is_multiple_of(8) {
            return Err(Error::invalid(format!("{n_out} output features is not a positive multiple of 8")));
        }
        if let ZeroPointFormat::Gptq { zero_offset } = self.format {
            if zero_offset > 1 {
                return Err(Error::invalid(format!("GPTQ zero offset {zero_offset} (0 or 1)")));
            }
        }
        let groups = self.groups();
        let check = |what: &str, want: usize, got: usize| {
            if want != got {
                Err(Error::shape(format!("{what} bytes"), want, got))
            } else {
                Ok(())
            }
        };
        check("qweight", checked_mul(n_in, n_out / 2, "qweight bytes")?, self.qweight.len())?;
        check("qzeros", checked_mul(groups, n_out / 2, "qzeros bytes")?, self.qzeros.len())?;
        let scale_bytes = match self.scales_dtype {
            DType::F16 | DType::BF16 => 2,
            DType::F32 => 4,
            other => return Err(Error::invalid(format!("scales of dtype {other} (f16, bf16 or f32 expected)"))),
        };
        check("scales", checked_mul(checked_mul(groups, n_out, "scales")?, scale_bytes, "scales")?, self.scales.len())
    }

    /// Scale `k` of the row-major `[groups, out]` scales, widened exactly.
    fn scale(&self, k: usize) -> f64 {
        let b = self.scales;
        match self.scales_dtype {
            DType::F32 => f32::from_le_bytes([b[4 * k], b[4 * k + 1], b[4 * k + 2], b[4 * k + 3]]) as f64,
            DType::BF16 => bf16::from_le_bytes([b[2 * k], b[2 * k + 1]]).to_f64(),
            _ => f16::from_le_bytes([b[2 * k], b[2 * k + 1]]).to_f64(),
        }
    }

    /// The zero point of output `o` in group `g`, with the format's offset applied (`0..=16`).
    fn zero(&self, g: usize, o: usize) -> u8 {
        let w = word(self.qzeros, g * (self.out_features / 8) + o / 8);
        match self.format {
            ZeroPointFormat::Awq => crate::awq::unpack_awq(w)[o % 8],
            ZeroPointFormat::Gptq { zero_offset } => nibble(w, o % 8) + zero_offset,
        }
    }

    /// The stored 4-bit value for output `o`, input `i`.
    fn value(&self, o: usize, i: usize) -> u8 {
        match self.format {
            ZeroPointFormat::Awq => {
                crate::awq::unpack_awq(word(self.qweight, i * (self.out_features / 8) + o / 8))[o % 8]
            }
            ZeroPointFormat::Gptq { .. } => nibble(word(self.qweight, (i / 8) * self.out_features + o), i % 8),
        }
    }

    /// Repacks into tm's int4 layout (`[rows = out, cols = in]`, see the module docs for the
    /// mapping and its error). Nothing the size of the weights is allocated besides the result.
    ///
    /// Errors on bad dimensions or lengths, and on a group whose scale or `-z · s` is not finite
    /// in f16 (naming its output row and group).
    pub fn to_tm(&self) -> Result<HostQuant> {
        self.validate()?;
        let (n_in, n_out, groups) = (self.in_features, self.out_features, self.groups());
        let mut scales = vec![f16::ZERO; n_out * groups];
        let mut mins = vec![f16::ZERO; n_out * groups];
        for g in 0..groups {
            for o in 0..n_out {
                let s = self.scale(g * n_out + o);
                let z = self.zero(g, o);
                let scale = f16::from_f64(s);
                let min = f16::from_f64(-(z as f64) * s);
                if !scale.is_finite() || !min.is_finite() {
                    return Err(Error::invalid(format!(
                        "output {o}, group {g}: scale {s} with zero point {z} does not fit f16 (scale and -zero*scale)"
                    )));
                }
                scales[o * groups + g] = scale;
                mins[o * groups + g] = min;
            }
        }
        let packed = match self.format {
            ZeroPointFormat::Awq => crate::awq::repack_qweight(self.qweight, n_in, n_out),
            ZeroPointFormat::Gptq { .. } => crate::gptq::repack_qweight(self.qweight, n_in, n_out),
        };
        Ok(HostQuant { rows: n_out, cols: n_in, group_size: self.group_size, packed, scales, mins: Some(mins) })
    }

    /// The exact weights `(q - z) · s` as row-major `[out, in]` f32, element by element from the
    /// format's definition (the slow second path the repacking is tested against).
    pub fn dequantize_reference(&self) -> Result<Vec<f32>> {
        self.validate()?;
        let (n_in, n_out) = (self.in_features, self.out_features);
        let mut out = Vec::with_capacity(n_in * n_out);
        for o in 0..n_out {
            for i in 0..n_in {
                let g = i / self.group_size;
                let q = self.value(o, i) as f64;
                let z = self.zero(g, o) as f64;
                out.push(((q - z) * self.scale(g * n_out + o)) as f32);
            }
        }
        Ok(out)
    }
}
