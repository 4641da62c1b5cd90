//! Typed launchers for the `tm-kernels` CUDA kernels: one function per kernel family, taking
//! device pointers and sizes, choosing the launch configuration and the dtype variant.

pub mod attention;
pub mod elementwise;
pub mod gemv;
pub mod q4_gemm;
pub mod q4_gemv;
pub mod q4_slab;
pub mod quant;
pub mod sampling;

use tm_core::quant::{int4_tiles_fit, Int4Layout};
use tm_core::{DType, Error, Result};

/// The `int tiled` argument every int4 kernel takes last (0 row-major, 1 tile-major, 2 tile-major
/// with tile-ordered scales and mins: ABI.md "int4 layouts"), after checking that a `[rows, cols]`
/// weight can be in that layout.
pub fn layout_arg(op: &str, layout: Int4Layout, rows: usize, cols: usize) -> Result<crate::runtime::KernelArg> {
    match layout {
        Int4Layout::RowMajor => Ok(crate::runtime::KernelArg::I32(0)),
        Int4Layout::Tiles16x128 if int4_tiles_fit(rows, cols) => Ok(crate::runtime::KernelArg::I32(1)),
        Int4Layout::TilesAndScales16x128 if int4_tiles_fit(rows, cols) => Ok(crate::runtime::KernelArg::I32(2)),
        Int4Layout::Tiles16x128 | Int4Layout::TilesAndScales16x128 => Err(Error::invalid(format!(
            "{op}: a {rows} x {cols} int4 weight cannot be tile-major (rows % 16 and cols % 128 must be 0)"
        ))),
    }
}

/// The kernel-name suffix of an activation dtype (`f32`, `f16`, `bf16`).
pub fn suffix(dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::F16 => Ok("f16"),
        DType::BF16 => Ok("bf16"),
        other => {
            Err(Error::DType { op: "cuda kernel".into(), expected: "f32, f16 or bf16".into(), got: other.to_string() })
        }
    }
}
