//! The AWQ quantizer (activation-aware weight quantization, Lin et al. 2023), written from the
//! paper and AutoAWQ's description of it: f32 weights plus calibration statistics in, AutoAWQ
//! "GEMM" int4 tensors out.
//!
//! # The algorithm, per decoder layer
//! Linear layers that read the same input form a *group*; each group gets one positive scale per
//! input channel `s`, multiplied into the weights' columns (`W · diag(s)`) and divided out of the
//! input (`x / s`), which leaves the float product unchanged but lets the salient channels (those
//! with large activations) use more of the 4-bit grid:
//!
//! | group | linears | input | `1/s` folded into |
//! |-------|---------|-------|-------------------|
//! | attention in | q, k, v | attention RMSNorm output | the attention RMSNorm weight |
//! | attention out | o | attention output | v's rows (and bias); only without GQA |
//! | MLP in | gate, up | MLP RMSNorm output | the MLP RMSNorm weight |
//! | MLP out | down | `silu(gate) · up` | up's rows |
//!
//! 1. **Scale search** ([`search_scales`]): `s = x̄^α / w̄^(1-α)` ("duo scaling"), with `x̄` the
//!    mean `|x|` of each input channel, `w̄` the mean over output rows of `|w|` relative to its
//!    group's max, normalised so that `sqrt(max(s) · min(s)) = 1`; α on AutoAWQ's grid `i / 20`,
//!    `i = 0..20`. The loss is the mean squared error of the group's outputs,
//!    `|X W'ᵀ - X Wᵀ|²` with `W' = Q(W · diag(s)) · diag(1/s)` and `Q` the int4 quantizer below,
//!    summed over the group's linears. The unscaled weights (`s = 1`, plain round-to-nearest) are
//!    a candidate too, so the search never does worse than RTN on the calibration data.
//! 2. **Folding** ([`apply_scales`]): every group's scale is applied at once (the searches all
//!    used the original weights, as AutoAWQ's do).
//! 3. **Clipping search** ([`search_clip`]): for every linear except q and k (whose errors the
//!    attention softmax amplifies; AutoAWQ skips them too), and every output row and group, the
//!    weights are clamped to `±m · (1 - i/20)`, `i = 0..10`, with `m` the group's max `|w|`; the
//!    clamp whose quantized partial products `x_g · w_g` have the least squared error wins.
//! 4. **Quantization** ([`AwqGemm::quantize`]): asymmetric 4-bit per group of `group_size`
//!    inputs, `s = (max - min) / 15` (rounded to f16, at least `1e-5 / 15`),
//!    `z = clamp(-round(min / s), 0, 15)`, `q = clamp(round(w / s) + z, 0, 15)`, `w ≈ (q - z) · s`
//!    (AutoAWQ's formula), packed in AutoAWQ's GEMM layout with [`crate::awq::pack_awq_matrix`].
//!
//! # Where it departs from AutoAWQ
//! - The scale-search loss is the output error of the group's own linears (q, k, v together;
//!   gate and up together), not of the whole attention block or MLP as AutoAWQ measures it for
//!   the input groups. It needs no attention and no MLP here, and ranks scales much the same way.
//! - Losses come from the input's second-moment (Gram) matrix `G = Σ_t x_tᵀ x_t`
//!   ([`InputStats`]): `|X Eᵀ|² = Σ_rows e G eᵀ` for any weight error `E`. The statistics of a
//!   linear take `in²` floats however many calibration tokens there are, and every token counts
//!   in the clipping search (AutoAWQ subsamples 512 for it).
//! - `s = 1` is a candidate in the scale search (see step 1), and searches run in f32 with the
//!   scale rounded to f16 exactly as it is stored, where AutoAWQ searches in the model's f16.

mod layer;
mod pack;
mod search;
mod stats;

pub use layer::{
    apply_scales, quantize_layer, DecoderLayer, GroupReport, LayerScales, LayerStats, Linear, QuantizedLayer,
};
pub use pack::{pseudo_quantize, AwqGemm};
pub use search::{apply_clip, search_clip, search_scales, ScaleSearch};
pub use stats::InputStats;

use tm_core::{Error, Result};

/// AutoAWQ's grid: scale exponents `i / GRID` and clip ratios `1 - i / GRID`.
pub const GRID: usize = 20;
/// The clipping search shrinks the max `|w|` of a group by at most this fraction.
pub const MAX_SHRINK: f32 = 0.5;

/// A row-major `[rows, cols]` f32 matrix (a linear layer's weight is `[out, in]`).
#[derive(Clone, Debug, PartialEq)]
pub struct Matrix {
    /// Rows (output features of a weight).
    pub rows: usize,
    /// Columns (input features of a weight).
    pub cols: usize,
    /// `rows * cols` values, row by row.
    pub data: Vec<f32>,
}

impl Matrix {
    /// A matrix from its values; errors when `data` is not `rows * cols` long.
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Result<Matrix> {
        let n = crate::checked_mul(rows, cols, "matrix size")?;
        if data.len() != n {
            return Err(Error::shape(format!("matrix [{rows}, {cols}]"), n, data.len()));
        }
        Ok(Matrix { rows, cols, data })
    }

    /// Row `r`.
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// Multiplies column `c` by `s[c]` (a scale moved into the weight from its input).
    pub fn mul_cols(&mut self, s: &[f32]) {
        for row in self.data.chunks_exact_mut(self.cols) {
            row.iter_mut().zip(s).for_each(|(w, s)| *w *= s);
        }
    }

    /// Divides row `r` by `s[r]` (a scale moved out of the weight's outputs).
    pub fn div_rows(&mut self, s: &[f32]) {
        for (row, s) in self.data.chunks_exact_mut(self.cols).zip(s) {
            row.iter_mut().for_each(|w| *w /= s);
        }
    }
}

/// What the quantizer is asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AwqParams {
    /// Inputs per quantization group: a multiple of 32 dividing every linear's inputs.
    pub group_size: usize,
    /// Whether to run the scale search (off: plain round-to-nearest, for comparisons).
    pub search_scales: bool,
    /// Whether to run the clipping search.
    pub search_clip: bool,
}

impl AwqParams {
    /// The full AWQ algorithm with groups of `group_size` inputs.
    pub fn awq(group_size: usize) -> AwqParams {
        AwqParams { group_size, search_scales: true, search_clip: true }
    }

    /// Plain round-to-nearest with the same quantizer and packing (no scales, no clipping).
    pub fn rtn(group_size: usize) -> AwqParams {
        AwqParams { group_size, search_scales: false, search_clip: false }
    }
}
