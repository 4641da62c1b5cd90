//! Engine settings and the counters it reports.

use crate::config::ModelConfig;
use crate::kv_cache::{KvCache, KvCacheDtype};
use tm_core::DType;

/// Settings of an [`super::Engine`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks to allocate. The memory plan (`crate::plan`) computes it from the device's
    /// memory; [`EngineConfig::blocks_for_bytes`] converts a byte budget.
    pub num_blocks: usize,
    /// Most tokens in one step (prefill chunks plus decode tokens).
    pub max_batched_tokens: usize,
    /// Most sequences in one step.
    pub max_batch_size: usize,
    /// Most requests waiting for their first step; more are rejected.
    pub max_queue: usize,
    /// Longest sequence (prompt plus output); the model's context length when `None`. Capped
    /// by what the KV cache holds.
    pub max_model_len: Option<usize>,
    /// Reuse the KV blocks of prompts seen before.
    pub enable_prefix_caching: bool,
    /// What the KV cache stores keys and values as (the activation dtype, or FP8 E4M3). A
    /// tensor-parallel group takes it from its `TpOptions` instead.
    pub kv_cache_dtype: KvCacheDtype,
}

impl Default for EngineConfig {
    /// Block size 64, 256 blocks, 8192 tokens and 256 sequences per step, 1024 queued
    /// requests, prefix caching on, the KV cache in the activation dtype.
    fn default() -> Self {
        EngineConfig {
            block_size: 64,
            num_blocks: 256,
            max_batched_tokens: 8192,
            max_batch_size: 256,
            max_queue: 1024,
            max_model_len: None,
            enable_prefix_caching: true,
            kv_cache_dtype: KvCacheDtype::Auto,
        }
    }
}

impl EngineConfig {
    /// How many blocks of `block_size` tokens fit in `bytes` of KV cache for `model` with
    /// keys and values stored as `dtype` (the resolved [`EngineConfig::kv_cache_dtype`]).
    pub fn blocks_for_bytes(model: &ModelConfig, dtype: DType, block_size: usize, bytes: u64) -> usize {
        let per_block = KvCache::bytes_per_block(model, dtype, block_size.max(1)).max(1);
        (bytes / per_block) as usize
    }
}

/// A snapshot of the engine's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Sequences holding KV blocks (being prefilled or decoded).
    pub running: usize,
    /// Sequences waiting for blocks (new or preempted).
    pub waiting: usize,
    /// Requests submitted but not yet started (what `max_queue` limits).
    pub queued: usize,
    /// KV blocks referenced by sequences.
    pub kv_blocks_used: usize,
    /// Unreferenced KV blocks kept for the prefix cache (reusable, evictable).
    pub kv_blocks_cached: usize,
    /// KV blocks in all.
    pub kv_blocks_total: usize,
    /// Highest `kv_blocks_used` seen.
    pub kv_blocks_peak: usize,
    /// KV blocks handed out so far (blocks reused from the prefix cache not counted).
    pub kv_blocks_allocated: u64,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_cache_queried_tokens: u64,
    /// Prompt tokens found in the prefix cache.
    pub prefix_cache_hit_tokens: u64,
    /// Sequences preempted (recomputed later) for lack of blocks.
    pub preemptions: u64,
    /// Forward steps run.
    pub steps: u64,
    /// Tokens run through the model.
    pub tokens_computed: u64,
    /// Requests finished (any reason).
    pub requests_finished: u64,
    /// Engine-thread time spent scheduling steps, in microseconds.
    pub schedule_us: u64,
    /// Engine-thread time spent in the model (inputs, forward pass, sampling), in microseconds.
    pub model_us: u64,
    /// Engine-thread time spent handing out sampled tokens (detokenizing, stop strings, sending
    /// events), in microseconds.
    pub output_us: u64,
}
