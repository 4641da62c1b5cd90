//! tm-quant: group-wise int4/int8 weights in the layout of [`tm_core::quant`].
//!
//! Everything here is host-side and works on plain byte slices and `Vec`s:
//!
//! - [`HostQuant`] / [`HostQuantView`]: the host form of [`tm_core::quant::QuantWeight`] (owned
//!   and borrowed), with validation of every length before anything indexes into them.
//! - [`gguf`]: import of GGUF/ggml `Q4_0`, `Q4_1` and `Q8_0` blocks into the tm layout by copying
//!   the packed bits (never expanding to floats), and a reference dequantizer written straight
//!   from the ggml block formulas.
//! - [`reference`](mod@reference): the obvious, slow reference dequantizer for the tm layout and nibble
//!   packing helpers.
//! - [`quantize`]: round-to-nearest quantizers (asymmetric min/max int4, symmetric int8).
//! - [`zero_point`], [`awq`], [`gptq`]: AutoAWQ "GEMM" and GPTQ int4 checkpoints
//!   (`qweight`/`qzeros`/`scales`, `w = (q - z) * s`) repacked into the tm layout, with their
//!   nibble orders.
//! - [`awq_quantizer`]: the AWQ algorithm (scale and clipping searches from calibration
//!   statistics) writing AutoAWQ GEMM tensors.
//! - [`f32_products`]: faer's f32 products, followed by clearing the SIMD state they leave
//!   behind (every faer product in tm goes through it).
//!
//! # Which layout a weight uses
//! An int4 weight always has `mins` (the layout is `w = q * scale + min`); an int8 weight never
//! has them (`w = q * scale`). [`HostQuant::kind`] reads the kind off that, and validation checks
//! that `packed` has the matching length (`rows * cols / 2` or `rows * cols`).

pub mod awq;
pub mod awq_quantizer;
pub mod f32_products;
pub mod gguf;
pub mod gptq;
pub mod quantize;
pub mod reference;
pub mod zero_point;

pub use gguf::{dequantize_gguf_reference, import_gguf, import_q4_0, import_q4_1, import_q8_0, GgufType};
pub use quantize::{quantize_int4, quantize_int8};
pub use reference::{dequantize, dequantize_view, pack_int4, unpack_int4};
pub use zero_point::{ZeroPointFormat, ZeroPointInt4};

use half::f16;
use tm_core::{Error, Result};

/// Columns per quantization block: the unit of nibble packing and of GGUF blocks.
pub const BLOCK: usize = 32;

/// Which of the two quantized layouts a weight uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantKind {
    /// 4-bit values with an f16 scale and min per group: `w = q * scale + min`, `q` in `0..16`.
    Int4,
    /// Signed 8-bit values with an f16 scale per group: `w = q * scale`.
    Int8,
}

/// A group-quantized `[rows, cols]` matrix held in host memory, before upload to a device.
///
/// The layout is the one documented in [`tm_core::quant`]. The fields are public so that loaders
/// can build and take apart the parts freely; every consumer in this crate and in the kernels
/// validates them (see [`HostQuantView::validate`]) before use.
#[derive(Clone, Debug, PartialEq)]
pub struct HostQuant {
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// Columns per group: a multiple of 32 that divides `cols`.
    pub group_size: usize,
    /// int4: `rows * cols / 2` packed nibbles; int8: `rows * cols` `i8` values as bytes.
    pub packed: Vec<u8>,
    /// `[rows, cols / group_size]` scales.
    pub scales: Vec<f16>,
    /// `[rows, cols / group_size]` mins for int4; `None` for int8.
    pub mins: Option<Vec<f16>>,
}

impl HostQuant {
    /// The layout: [`QuantKind::Int4`] when `mins` is present, else [`QuantKind::Int8`].
    pub fn kind(&self) -> QuantKind {
        if self.mins.is_some() {
            QuantKind::Int4
        } else {
            QuantKind::Int8
        }
    }

    /// A borrowed view of the parts.
    pub fn view(&self) -> HostQuantView<'_> {
        HostQuantView {
            rows: self.rows,
            cols: self.cols,
            group_size: self.group_size,
            packed: &self.packed,
            scales: &self.scales,
            mins: self.mins.as_deref(),
        }
    }

    /// Checks every length against the layout and returns the kind.
    pub fn validate(&self) -> Result<QuantKind> {
        self.view().validate()
    }
}

/// A borrowed group-quantized matrix: the form the CPU kernels take.
///
/// Build it from the slices of a [`tm_core::quant::QuantWeight`]'s tensors
/// (`packed.host::<u8>()`, `scales.host::<half::f16>()`, `mins.host::<half::f16>()`), or from a
/// [`HostQuant`] with [`HostQuant::view`]. For int8, `packed` is the `i8` values reinterpreted as
/// bytes (`bytemuck` casts either way).
#[derive(Clone, Copy, Debug)]
pub struct HostQuantView<'a> {
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// Columns per group: a multiple of 32 that divides `cols`.
    pub group_size: usize,
    /// int4: `rows * cols / 2` packed nibbles; int8: `rows * cols` `i8` values as bytes.
    pub packed: &'a [u8],
    /// `[rows, cols / group_size]` scales.
    pub scales: &'a [f16],
    /// `[rows, cols / group_size]` mins for int4; `None` for int8.
    pub mins: Option<&'a [f16]>,
}

impl<'a> HostQuantView<'a> {
    /// Builds a view and validates it (see [`HostQuantView::validate`]).
    pub fn new(
        rows: usize,
        cols: usize,
        group_size: usize,
        packed: &'a [u8],
        scales: &'a [f16],
        mins: Option<&'a [f16]>,
    ) -> Result<Self> {
        let view = HostQuantView { rows, cols, group_size, packed, scales, mins };
        view.validate()?;
        Ok(view)
    }

    /// The layout: [`QuantKind::Int4`] when `mins` is present, else [`QuantKind::Int8`].
    pub fn kind(&self) -> QuantKind {
        if self.mins.is_some() {
            QuantKind::Int4
        } else {
            QuantKind::Int8
        }
    }

    /// Groups per row: `cols / group_size` (0 when `group_size` is 0; validation rejects that).
    pub fn groups(&self) -> usize {
        self.cols.checked_div(self.group_size).unwrap_or(0)
    }

    /// Checks the group size and every slice length against the layout; returns the kind.
    pub fn validate(&self) -> Result<QuantKind> {
        let kind = self.kind();
        validate_dims(self.rows, self.cols, self.group_size)?;
        let groups = self.cols / self.group_size;
        let n_scales = checked_mul(self.rows, groups, "scale count")?;
        let n_packed = match kind {
            QuantKind::Int4 => checked_mul(self.rows, self.cols / 2, "packed bytes")?,
            QuantKind::Int8 => checked_mul(self.rows, self.cols, "packed bytes")?,
        };
        let what = match kind {
            QuantKind::Int4 => "int4",
            QuantKind::Int8 => "int8",
        };
        if self.packed.len() != n_packed {
            return Err(Error::shape(format!("{what} packed bytes"), n_packed, self.packed.len()));
        }
        if self.scales.len() != n_scales {
            return Err(Error::shape(format!("{what} scales"), n_scales, self.scales.len()));
        }
        if let Some(mins) = self.mins {
            if mins.len() != n_scales {
                return Err(Error::shape("int4 mins", n_scales, mins.len()));
            }
        }
        Ok(kind)
    }

    /// Validates and checks that the weight is int4.
    pub fn expect_int4(&self) -> Result<()> {
        match self.validate()? {
            QuantKind::Int4 => Ok(()),
            QuantKind::Int8 => Err(Error::DType {
                op: "int4 weight".into(),
                expected: "int4 (with mins)".into(),
                got: "int8 (no mins)".into(),
            }),
        }
    }

    /// Validates and checks that the weight is int8.
    pub fn expect_int8(&self) -> Result<()> {
        match self.validate()? {
            QuantKind::Int8 => Ok(()),
            QuantKind::Int4 => Err(Error::DType {
                op: "int8 weight".into(),
                expected: "int8 (no mins)".into(),
                got: "int4 (with mins)".into(),
            }),
        }
    }
}

/// Checks `group_size` is a non-zero multiple of 32 that divides `cols`.
pub fn validate_dims(rows: usize, cols: usize, group_size: usize) -> Result<()> {
    if group_size == 0 || !group_size.is_multiple_of(BLOCK) || !cols.is_multiple_of(group_size) {
        return Err(Error::invalid(format!(
            "group size {group_size} must be a non-zero multiple of {BLOCK} dividing {cols} columns \
             (matrix of {rows} rows)"
        )));
    }
    Ok(())
}

/// `a * b`, or an error naming `what` when it overflows `usize`.
pub(crate) fn checked_mul(a: usize, b: usize, what: &str) -> Result<usize> {
    a.checked_mul(b).ok_or_else(|| Error::invalid(format!("{what} overflows: {a} * {b}")))
}
