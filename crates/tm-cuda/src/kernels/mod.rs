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

use tm_core::{DType, Error, Result};

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
