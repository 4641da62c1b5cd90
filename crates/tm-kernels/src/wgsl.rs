//! WGSL compute kernels for the wgpu backend (`tm-wgpu`), embedded as source text.
//!
//! Every kernel is compiled as [`COMMON`] followed by its own source (the matrix products as
//! [`COMMON`], a weight variant and [`MATMUL_TILED`] or, with a reduction, [`MATMUL_GEMV`]).
//! Binding 0 of every kernel is a uniform buffer of 16 u32 parameters (floats bit-cast); the
//! other bindings are storage buffers, in the order each file lists them. Byte and f16 tensors
//! are bound as `array<u32>`. A kernel with host inputs (token ids, positions, slots, block
//! tables) reads them from binding 1, named `inputs`; the backend binds it with a dynamic offset
//! into a staging buffer. [`bindings`] reads the layout back from the source.

/// Shared helpers and the parameter binding.
pub const COMMON: &str = include_str!("../wgsl/common.wgsl");
/// Embedding from a dense f32 table.
pub const EMBEDDING_F32: &str = include_str!("../wgsl/embedding_f32.wgsl");
/// Embedding from a dense f16 table.
pub const EMBEDDING_F16: &str = include_str!("../wgsl/embedding_f16.wgsl");
/// Embedding from an int4 table.
pub const EMBEDDING_Q4: &str = include_str!("../wgsl/embedding_q4.wgsl");
/// Embedding from an int8 table.
pub const EMBEDDING_Q8: &str = include_str!("../wgsl/embedding_q8.wgsl");
/// RMSNorm and the fused residual add + RMSNorm (entry points `rms_norm`, `add_rms_norm`).
pub const RMS_NORM: &str = include_str!("../wgsl/rms_norm.wgsl");
/// Rotary position embedding, both pair layouts.
pub const ROPE: &str = include_str!("../wgsl/rope.wgsl");
/// The rotary-embedding arithmetic shared by [`ROPE`] and [`ROPE_WRITE_KV`] (before them).
pub const ROPE_MATH: &str = include_str!("../wgsl/rope_math.wgsl");
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
/// The matrix-vector body for up to [`GEMV_MAX_TOKENS`] tokens; needs a weight variant's
/// `load_w` and a reduction's `wg_sum`.
pub const MATMUL_GEMV: &str = include_str!("../wgsl/matmul_gemv.wgsl");
/// The bindings, overrides and row-sum writer of [`GEMV_BLOCK`] (before it).
pub const GEMV_ROWS: &str = include_str!("../wgsl/gemv_rows.wgsl");
/// The matrix-vector body for dense weights with a column count divisible by 8 (16-byte loads),
/// one row per workgroup; needs a `load_w8` variant and a reduction's `wg_sum`.
pub const GEMV_VEC: &str = include_str!("../wgsl/gemv_vec.wgsl");
/// Dense f32 `load_w8` for [`GEMV_VEC`].
pub const GEMV_VEC_F32: &str = include_str!("../wgsl/gemv_vec_f32.wgsl");
/// Dense f16 `load_w8` for [`GEMV_VEC`].
pub const GEMV_VEC_F16: &str = include_str!("../wgsl/gemv_vec_f16.wgsl");
/// The matrix-vector body for group-quantized weights, a 32-column block per thread step and
/// several rows per workgroup (overrides `ROWS`, `WG`); needs a `load_block`/`block_dot`
/// variant, a reduction's `wg_sum4` and [`GEMV_ROWS`].
pub const GEMV_BLOCK: &str = include_str!("../wgsl/gemv_block.wgsl");
/// int4 `load_block` for [`GEMV_BLOCK`].
pub const GEMV_BLOCK_Q4: &str = include_str!("../wgsl/gemv_block_q4.wgsl");
/// int8 `load_block` for [`GEMV_BLOCK`].
pub const GEMV_BLOCK_Q8: &str = include_str!("../wgsl/gemv_block_q8.wgsl");
/// Most tokens the `gemv_*` kernels take in one dispatch.
pub const GEMV_MAX_TOKENS: usize = 8;
/// Workgroup sum through shared memory.
pub const REDUCE_SHARED: &str = include_str!("../wgsl/reduce_shared.wgsl");
/// Workgroup sum with subgroup operations (needs wgpu's `SUBGROUP` feature).
pub const REDUCE_SUBGROUP: &str = include_str!("../wgsl/reduce_subgroup.wgsl");
/// Dense f32 weight variant of the matrix product.
pub const MATMUL_F32: &str = include_str!("../wgsl/matmul_f32.wgsl");
/// Dense f16 weight variant of the matrix product.
pub const MATMUL_F16: &str = include_str!("../wgsl/matmul_f16.wgsl");
/// int4 (dequant-fused) weight variant of the matrix product.
pub const MATMUL_Q4: &str = include_str!("../wgsl/matmul_q4.wgsl");
/// int8 (dequant-fused) weight variant of the matrix product.
pub const MATMUL_Q8: &str = include_str!("../wgsl/matmul_q8.wgsl");
/// RoPE on q and k and the KV-cache write in one launch.
pub const ROPE_WRITE_KV: &str = include_str!("../wgsl/rope_write_kv.wgsl");
/// Causal paged attention with an online softmax, over the whole cache or one window of it.
pub const ATTENTION: &str = include_str!("../wgsl/attention.wgsl");
/// Merges the per-window partial states of [`ATTENTION`].
pub const ATTENTION_COMBINE: &str = include_str!("../wgsl/attention_combine.wgsl");

/// A kernel: its cache name, its source parts (concatenated in order) and its entry point.
#[derive(Clone, Copy, Debug)]
pub struct Kernel {
    /// Unique name (pipeline cache key).
    pub name: &'static str,
    /// Source parts, concatenated in order.
    pub parts: &'static [&'static str],
    /// Entry point.
    pub entry: &'static str,
    /// Whether the kernel uses subgroup operations: the device must be opened with wgpu's
    /// `SUBGROUP` feature (naga takes the builtins without an `enable` directive).
    pub subgroups: bool,
}

impl Kernel {
    /// The full WGSL source.
    pub fn source(&self) -> String {
        self.parts.concat()
    }
}

macro_rules! kernel {
    ($name:literal, $entry:literal, $($part:expr),+) => {
        Kernel { name: $name, parts: &[COMMON, $($part),+], entry: $entry, subgroups: false }
    };
}

macro_rules! subgroup_kernel {
    ($name:literal, $entry:literal, $($part:expr),+) => {
        Kernel { name: $name, parts: &[COMMON, $($part),+], entry: $entry, subgroups: true }
    };
}

/// Every kernel the wgpu backend uses.
pub const KERNELS: &[Kernel] = &[
    kernel!("embedding_f32", "main", EMBEDDING_F32),
    kernel!("embedding_f16", "main", EMBEDDING_F16),
    kernel!("embedding_q4", "main", EMBEDDING_Q4),
    kernel!("embedding_q8", "main", EMBEDDING_Q8),
    kernel!("rms_norm", "rms_norm", RMS_NORM),
    kernel!("add_rms_norm", "add_rms_norm", RMS_NORM),
    kernel!("rope", "main", ROPE_MATH, ROPE),
    kernel!("silu_mul", "main", SILU_MUL),
    kernel!("add", "main", ADD),
    kernel!("gather_rows", "main", GATHER_ROWS),
    kernel!("write_kv", "main", WRITE_KV),
    kernel!("rope_write_kv", "main", ROPE_MATH, ROPE_WRITE_KV),
    kernel!("matmul_f32", "main", MATMUL_F32, MATMUL_TILED),
    kernel!("matmul_f16", "main", MATMUL_F16, MATMUL_TILED),
    kernel!("matmul_q4", "main", MATMUL_Q4, MATMUL_TILED),
    kernel!("matmul_q8", "main", MATMUL_Q8, MATMUL_TILED),
    kernel!("gemv_f32", "main", MATMUL_F32, REDUCE_SHARED, MATMUL_GEMV),
    kernel!("gemv_f16", "main", MATMUL_F16, REDUCE_SHARED, MATMUL_GEMV),
    subgroup_kernel!("gemv_f32_sg", "main", MATMUL_F32, REDUCE_SUBGROUP, MATMUL_GEMV),
    subgroup_kernel!("gemv_f16_sg", "main", MATMUL_F16, REDUCE_SUBGROUP, MATMUL_GEMV),
    kernel!("gemv_vec_f32", "main", GEMV_VEC_F32, REDUCE_SHARED, GEMV_VEC),
    kernel!("gemv_vec_f16", "main", GEMV_VEC_F16, REDUCE_SHARED, GEMV_VEC),
    subgroup_kernel!("gemv_vec_f32_sg", "main", GEMV_VEC_F32, REDUCE_SUBGROUP, GEMV_VEC),
    subgroup_kernel!("gemv_vec_f16_sg", "main", GEMV_VEC_F16, REDUCE_SUBGROUP, GEMV_VEC),
    kernel!("gemv_vec_q4", "main", GEMV_BLOCK_Q4, REDUCE_SHARED, GEMV_ROWS, GEMV_BLOCK),
    kernel!("gemv_vec_q8", "main", GEMV_BLOCK_Q8, REDUCE_SHARED, GEMV_ROWS, GEMV_BLOCK),
    subgroup_kernel!("gemv_vec_q4_sg", "main", GEMV_BLOCK_Q4, REDUCE_SUBGROUP, GEMV_ROWS, GEMV_BLOCK),
    subgroup_kernel!("gemv_vec_q8_sg", "main", GEMV_BLOCK_Q8, REDUCE_SUBGROUP, GEMV_ROWS, GEMV_BLOCK),
    kernel!("attention", "main", ATTENTION),
    kernel!("attention_combine", "main", ATTENTION_COMBINE),
];

/// The kernel named `name`.
pub fn kernel(name: &str) -> Option<&'static Kernel> {
    KERNELS.iter().find(|k| k.name == name)
}

/// What a binding of a kernel is, as its source declares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BindingKind {
    /// The uniform parameter block.
    Uniform,
    /// A storage buffer the kernel only reads.
    ReadOnly,
    /// A storage buffer the kernel writes.
    ReadWrite,
    /// The read-only host inputs (`inputs`), bound with a dynamic offset.
    Inputs,
}

/// The bindings of group 0 that `source` declares, in binding order:
/// `(index, kind)` for every `@group(0) @binding(i) var<...> name` line.
pub fn bindings(source: &str) -> Vec<(u32, BindingKind)> {
    let mut out = Vec::new();
    for line in source.lines() {
        let line = line.trim();
        let Some(rest) = line.strip_prefix("@group(0) @binding(") else { continue };
        let Some((index, decl)) = rest.split_once(')') else { continue };
        let Ok(index) = index.trim().parse::<u32>() else { continue };
        let kind = if decl.contains("var<uniform>") {
            BindingKind::Uniform
        } else if decl.contains("read_write") {
            BindingKind::ReadWrite
        } else if decl.contains(" inputs:") {
            BindingKind::Inputs
        } else {
            BindingKind::ReadOnly
        };
        out.push((index, kind));
    }
    out.sort_by_key(|b| b.0);
    out.dedup_by_key(|b| b.0);
    out
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

    #[test]
    fn bindings_are_read_from_the_source() {
        let b = bindings(&kernel("attention").map(|k| k.source()).unwrap_or_default());
        use BindingKind::*;
        assert_eq!(b, vec![(0, Uniform), (1, Inputs), (2, ReadOnly), (3, ReadOnly), (4, ReadOnly), (5, ReadWrite)]);
        for k in KERNELS {
            let b = bindings(&k.source());
            assert_eq!(b[0], (0, Uniform), "{}", k.name);
            assert!(b.iter().enumerate().all(|(i, &(j, _))| i as u32 == j), "{}: bindings not dense", k.name);
            assert!(b.iter().skip(2).all(|&(_, kind)| kind != Inputs), "{}: inputs not at binding 1", k.name);
        }
        assert!(kernel("gemv_vec_q4_sg").is_some_and(|k| k.subgroups && k.source().contains("subgroupAdd")));
    }
}
