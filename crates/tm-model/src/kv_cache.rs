//! Paged KV-cache storage: per layer, a key and a value tensor of
//! `[num_blocks, block_size, kv_heads, head_dim]`, and a free list of blocks.

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use tm_core::{DType, Ops, Tensor, TensorDesc};

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
    /// Bytes one block takes across all layers (keys and values).
    pub fn bytes_per_block(cfg: &ModelConfig, dtype: DType, block_size: usize) -> u64 {
        (2 * cfg.num_layers * dtype.storage_bytes(block_size * cfg.kv_dim())) as u64
    }

    /// Allocates `num_blocks` blocks of `block_size` tokens for every layer.
    pub fn new(ops: &dyn Ops, cfg: &ModelConfig, num_blocks: usize, block_size: usize) -> Result<KvCache> {
        if num_blocks == 0 || block_size == 0 {
            return Err(ModelError::InvalidInput("the KV cache needs at least one block of at least one token".into()));
        }
        let desc = TensorDesc::new(ops.activation_dtype(), &[num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim]);
        let layers = (0..cfg.num_layers)
            .map(|_| Ok((ops.zeros(desc.clone(), "kv cache")?, ops.zeros(desc.clone(), "kv cache")?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(KvCache { block_size, num_blocks, layers })
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
