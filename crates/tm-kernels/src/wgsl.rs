//! WGSL compute kernels for the wgpu backend (`tm-wgpu`), embedded as source text.
//!
//! Every kernel is compiled as [`COMMON`] followed by its own source (the matrix products as
//! [`COMMON`], a weight variant and [`MATMUL_TILED`] or [`MATMUL_GEMV`]). Binding 0 of every kernel is a uniform
//! buffer of 16 u32 parameters (floats bit-cast); the other bindings are storage buffers, in the
//! order each file lists them. Byte and f16 tensors are bound as `array<u32>`.

/// Shared helpers and the parameter binding.
pub const COMMON: &str = include_str!("../wgsl/common.wgsl");
/// Embedding from a dense f32 table.
pub const EMBEDDING_F32: &str = include_str!("../wgsl/embedding_f32.wgsl");
/// Embedding from an int4 table.
pub const EMBEDDING_Q4: &str = include_str!("../wgsl/embedding_q4.wgsl");
/// Embedding from an int8 table.
pub const EMBEDDING_Q8: &str = include_str!("../wgsl/embedding_q8.wgsl");
/// RMSNorm and the fused residual add + RMSNorm (entry points `rms_norm`, `add_rms_norm`).
pub const RMS_NORM: &str = include_str!("../wgsl/rms_norm.wgsl");
/// Rotary position embedding, both pair layouts.
pub const ROPE: &str = include_str!("../wgsl/rope.wgsl");
/// `silu(gate) * up`.
pub const SILU_MUL: &str = include_str!("../wgsl/silu_mul.wgsl");
/// `x += y`.
pub const ADD: &str = include_str!("../wgsl/add.wgsl");
/// Row gather.
pub const GATHER_ROWS: &str = include_str!("../wgsl/gather_rows.wgsl");
/// KV-cache scatter through the slot mapping.
pub const WRITE_KV: &str = include_str!("../wgsl/write_kv.wgsl");
/// The tiled matrix product body; needs a weight variant's `load_w`.
pub const MATMUL_TILED: &str = include_str!("../wgsl/matmul_tiled.wgsl");
/// The matrix-vector body for up to [`GEMV_MAX_TOKENS`] tokens; needs a weight variant's `load_w`.
pub const MATMUL_GEMV: &str = include_str!("../wgsl/matmul_gemv.wgsl");
/// Most tokens the `gemv_*` kernels take in one dispatch.
pub const GEMV_MAX_TOKENS: usize = 8;
/// Dense f32 weight variant of the matrix product.
pub const MATMUL_F32: &str = include_str!("../wgsl/matmul_f32.wgsl");
/// int4 (dequant-fused) weight variant of the matrix product.
pub const MATMUL_Q4: &str = include_str!("../wgsl/matmul_q4.wgsl");
/// int8 (dequant-fused) weight variant of the matrix product.
pub const MATMUL_Q8: &str = include_str!("../wgsl/matmul_q8.wgsl");
/// Causal paged attention with an online softmax.
pub const ATTENTION: &str = include_str!("../wgsl/attention.wgsl");

/// A kernel: its cache name, its source parts (concatenated in order) and its entry point.
#[derive(Clone, Copy, Debug)]
pub struct Kernel {
    /// Unique name (pipeline cache key).
    pub name: &'static str,
    /// Source parts, concatenated in order.
    pub parts: &'static [&'static str],
    /// Entry point.
    pub entry: &'static str,
}

impl Kernel {
    /// The full WGSL source.
    pub fn source(&self) -> String {
        self.parts.concat()
    }
}

macro_rules! kernel {
    ($name:literal, $entry:literal, $($part:expr),+) => {
        Kernel { name: $name, parts: &[COMMON, $($part),+], entry: $entry }
    };
}

/// Every kernel the wgpu backend uses.
pub const KERNELS: &[Kernel] = &[
    kernel!("embedding_f32", "main", EMBEDDING_F32),
    kernel!("embedding_q4", "main", EMBEDDING_Q4),
    kernel!("embedding_q8", "main", EMBEDDING_Q8),
    kernel!("rms_norm", "rms_norm", RMS_NORM),
    kernel!("add_rms_norm", "add_rms_norm", RMS_NORM),
    kernel!("rope", "main", ROPE),
    kernel!("silu_mul", "main", SILU_MUL),
    kernel!("add", "main", ADD),
    kernel!("gather_rows", "main", GATHER_ROWS),
    kernel!("write_kv", "main", WRITE_KV),
    kernel!("matmul_f32", "main", MATMUL_F32, MATMUL_TILED),
    kernel!("matmul_q4", "main", MATMUL_Q4, MATMUL_TILED),
    kernel!("matmul_q8", "main", MATMUL_Q8, MATMUL_TILED),
    kernel!("gemv_f32", "main", MATMUL_F32, MATMUL_GEMV),
    kernel!("gemv_q4", "main", MATMUL_Q4, MATMUL_GEMV),
    kernel!("gemv_q8", "main", MATMUL_Q8, MATMUL_GEMV),
    kernel!("attention", "main", ATTENTION),
];

/// The kernel named `name`.
pub fn kernel(name: &str) -> Option<&'static Kernel> {
    KERNELS.iter().find(|k| k.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_names_are_unique_and_sources_define_their_entry_points() {
        for (i, k) in KERNELS.iter().enumerate() {
            assert!(KERNELS[..i].iter().all(|o| o.name != k.name), "duplicate kernel {}", k.name);
            assert!(k.source().contains(&format!("fn {}(", k.entry)), "{} lacks fn {}", k.name, k.entry);
            assert_eq!(kernel(k.name).map(|f| f.entry), Some(k.entry));
        }
        assert!(kernel("no such kernel").is_none());
    }
}
