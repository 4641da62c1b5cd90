//! Paged KV-cache storage: per layer, a key and a value tensor of
//! `[num_blocks, block_size, kv_heads, head_dim]`, and a free list of blocks. A tensor-parallel
//! rank's cache holds only its KV heads ([`KvCache::for_shard`]). Keys and values are stored in
//! the activation dtype or, with [`KvCacheDtype::Fp8`], as FP8 E4M3 (one byte per element).

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::llama::ShardLayout;
use std::fmt;
use tm_core::{DType, Ops, Tensor, TensorDesc};

/// What the KV cache stores keys and values as (`--kv-cache-dtype`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KvCacheDtype {
    /// The backend's activation dtype (bf16/f16 on GPUs, f32 on the CPU).
    #[default]
    Auto,
    /// FP8 E4M3 with scale 1.0 (what vLLM's `--kv-cache-dtype fp8` does when a checkpoint brings
    /// no KV scales): half the bytes of a 16-bit cache, so twice the tokens in the same memory
    /// and half the traffic of decode attention. Conversion rounds to nearest even and
    /// saturates: components beyond ±448 are clipped and magnitudes below 2^-9 lose precision
    /// (see `tm_core::fp8`).
    Fp8,
}

impl KvCacheDtype {
    /// The storage dtype on a backend whose activations are `activation`.
    pub fn resolve(self, activation: DType) -> DType {
        match self {
            KvCacheDtype::Auto => activation,
            KvCacheDtype::Fp8 => DType::F8E4M3,
        }
    }

    /// Parses `auto`, `fp8` or `fp8_e4m3` (case-insensitive).
    pub fn parse(s: &str) -> Result<KvCacheDtype> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(KvCacheDtype::Auto),
            "fp8" | "fp8_e4m3" | "fp8e4m3" | "e4m3" => Ok(KvCacheDtype::Fp8),
            other => Err(ModelError::InvalidInput(format!(
                "--kv-cache-dtype {other:?}: expected `auto` (the activation dtype) or `fp8` (E4M3)"
            ))),
        }
    }
}

impl fmt::Display for KvCacheDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KvCacheDtype::Auto => "auto",
            KvCacheDtype::Fp8 => "fp8",
        })
    }
}

/// Key/value storage for every layer.
#[derive(Debug)]
pub struct KvCache {
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks per layer.
    pub num_blocks: usize,
    layers: Vec<(Tensor, Tensor)>,
}

impl KvCache {
    /// Bytes one block takes across all layers (keys and values) stored as `dtype` (the
    /// resolved [`KvCacheDtype`]: 1 byte per element for [`DType::F8E4M3`]).
    pub fn bytes_per_block(cfg: &ModelConfig, dtype: DType, block_size: usize) -> u64 {
        (2 * cfg.num_layers * dtype.storage_bytes(block_size * cfg.kv_dim())) as u64
    }

    /// Bytes one block takes on the rank `layout` describes (its KV heads only).
    pub fn bytes_per_block_shard(cfg: &ModelConfig, layout: &ShardLayout, dtype: DType, block_size: usize) -> u64 {
        (2 * cfg.num_layers * dtype.storage_bytes(block_size * layout.kv_dim())) as u64
    }

    /// Allocates `num_blocks` blocks of `block_size` tokens for every layer, in the activation
    /// dtype.
    pub fn new(ops: &dyn Ops, cfg: &ModelConfig, num_blocks: usize, block_size: usize) -> Result<KvCache> {
        Self::for_shard(ops, cfg, &ShardLayout::single(cfg), num_blocks, block_size, KvCacheDtype::Auto)
    }

    /// Allocates `num_blocks` blocks of `block_size` tokens stored as `kv_dtype` for every
    /// layer, holding the KV heads of the rank `layout` describes. Fails with an error naming
    /// `--kv-cache-dtype` when the backend cannot use that cache.
    pub fn for_shard(
        ops: &dyn Ops,
        cfg: &ModelConfig,
        layout: &ShardLayout,
        num_blocks: usize,
        block_size: usize,
        kv_dtype: KvCacheDtype,
    ) -> Result<KvCache> {
        if num_blocks == 0 || block_size == 0 {
            return Err(ModelError::InvalidInput("the KV cache needs at least one block of at least one token".into()));
        }
        let dtype = check_supported(ops, kv_dtype)?;
        let desc = TensorDesc::new(dtype, &[num_blocks, block_size, layout.kv_heads.len(), cfg.head_dim]);
        let layers = (0..cfg.num_layers)
            .map(|_| Ok((ops.zeros(desc.clone(), "kv cache")?, ops.zeros(desc.clone(), "kv cache")?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(KvCache { block_size, num_blocks, layers })
    }

    /// The dtype keys and values are stored in.
    pub fn dtype(&self) -> DType {
        self.layers.first().map_or(DType::F32, |(k, _)| k.dtype())
    }

    /// The key and value tensors of layer `i`.
    pub fn layer_mut(&mut self, i: usize) -> (&mut Tensor, &mut Tensor) {
        let (k, v) = &mut self.layers[i];
        (k, v)
    }

    /// Copies whole blocks, `(src, dst)` in order, in every layer's keys and values (the
    /// copy of copy-on-write). Host-accessible caches are copied in place; others go through a
    /// download and upload of each tensor, which is slow (a device copy op can replace it).
    pub fn copy_blocks(&mut self, ops: &dyn Ops, pairs: &[(u32, u32)]) -> Result<()> {
        if pairs.is_empty() {
            return Ok(());
        }
        if let Some(&(s, d)) =
            pairs.iter().find(|&&(s, d)| s as usize >= self.num_blocks || d as usize >= self.num_blocks)
        {
            return Err(ModelError::InvalidInput(format!(
                "cannot copy KV block {s} to {d}: the cache has {} blocks",
                self.num_blocks
            )));
        }
        for (k, v) in &mut self.layers {
            for t in [k, v] {
                let block_bytes = t.desc().bytes() / self.num_blocks;
                ops.copy_chunks(t, block_bytes, pairs)?;
            }
        }
        Ok(())
    }
}

/// The storage dtype of `kv_dtype` on `ops`, or an error naming `--kv-cache-dtype` and the
/// backend when the backend's kernels cannot use it.
pub fn check_supported(ops: &dyn Ops, kv_dtype: KvCacheDtype) -> Result<DType> {
    let dtype = kv_dtype.resolve(ops.activation_dtype());
    if !ops.supports_kv_cache_dtype(dtype) {
        return Err(ModelError::InvalidInput(format!(
            "--kv-cache-dtype {kv_dtype}: the {} backend ({}) cannot keep a {dtype} KV cache; use \
             --kv-cache-dtype auto, or the cpu or cuda backend",
            format!("{:?}", ops.device().kind()).to_lowercase(),
            ops.device().name()
        )));
    }
    Ok(dtype)
}

/// A free list of KV blocks (single-sequence use; the engine's block manager adds reference
/// counts and prefix caching).
#[derive(Debug)]
pub struct BlockPool {
    free: Vec<u32>,
}

impl BlockPool {
    /// All `num_blocks` blocks free.
    pub fn new(num_blocks: usize) -> Self {
        BlockPool { free: (0..num_blocks as u32).rev().collect() }
    }
    /// Takes a free block.
    pub fn take(&mut self) -> Option<u32> {
        self.free.pop()
    }
    /// Returns blocks to the pool.
    pub fn give_back(&mut self, blocks: impl IntoIterator<Item = u32>) {
        self.free.extend(blocks);
    }
    /// Number of free blocks.
    pub fn free_count(&self) -> usize {
        self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tm_cpu::CpuBackend;

    #[test]
    fn copy_blocks_copies_whole_blocks_in_every_layer() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/llama");
        let cfg = ModelConfig::from_dir(&dir).expect("fixture config");
        let ops = CpuBackend::new();
        let mut kv = KvCache::new(&ops, &cfg, 6, 4).expect("cache");
        for i in 0..cfg.num_layers {
            let (k, v) = kv.layer_mut(i);
            for (j, x) in k.host_mut::<f32>().unwrap().iter_mut().enumerate() {
                *x = (i * 100_000 + j) as f32;
            }
            for (j, x) in v.host_mut::<f32>().unwrap().iter_mut().enumerate() {
                *x = -((i * 100_000 + j) as f32);
            }
        }
        kv.copy_blocks(&ops, &[(1, 4), (5, 0)]).expect("copy");
        let per_block = 4 * cfg.kv_dim();
        for i in 0..cfg.num_layers {
            let (k, _) = kv.layer_mut(i);
            let k = k.host::<f32>().unwrap();
            for (src, dst) in [(1usize, 4usize), (5, 0)] {
                assert_eq!(k[dst * per_block..(dst + 1) * per_block], k[src * per_block..(src + 1) * per_block]);
            }
            assert_eq!(k[2 * per_block], (i * 100_000 + 2 * per_block) as f32, "other blocks untouched");
        }
        assert!(kv.copy_blocks(&ops, &[(6, 0)]).is_err());
    }

    #[test]
    fn an_fp8_cache_takes_one_byte_per_element() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/llama");
        let cfg = ModelConfig::from_dir(&dir).expect("fixture config");
        let ops = CpuBackend::new();
        let layout = ShardLayout::single(&cfg);
        let kv = KvCache::for_shard(&ops, &cfg, &layout, 3, 4, KvCacheDtype::Fp8).expect("cache");
        assert_eq!(kv.dtype(), DType::F8E4M3);
        let f8 = KvCache::bytes_per_block(&cfg, DType::F8E4M3, 16);
        assert_eq!(f8, (2 * cfg.num_layers * 16 * cfg.kv_dim()) as u64);
        assert_eq!(2 * f8, KvCache::bytes_per_block(&cfg, DType::BF16, 16));
        assert_eq!(4 * f8, KvCache::bytes_per_block(&cfg, DType::F32, 16));
        assert_eq!(KvCacheDtype::parse("FP8").unwrap(), KvCacheDtype::Fp8);
        assert_eq!(KvCacheDtype::parse("auto").unwrap(), KvCacheDtype::Auto);
        let err = KvCacheDtype::parse("int8").unwrap_err().to_string();
        assert!(err.contains("--kv-cache-dtype"), "{err}");
    }
}
