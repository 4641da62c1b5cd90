//! Shared helpers of the engine tests: the tiny fixture model, an engine over it, prompts and
//! the single-sequence reference.

#![allow(dead_code)]

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tm_core::sampling::SamplingParams;
use tm_core::Ops;
use tm_cpu::CpuBackend;
use tm_model::engine::{Engine, EngineConfig, EngineStats, Request};
use tm_model::generate::{GenerateOptions, Session};
use tm_model::loader::LoadedModel;

/// The tiny random-weight Llama fixture on the CPU.
pub fn fixture(name: &str) -> (Arc<LoadedModel>, Arc<dyn Ops>) {
    let ops: Arc<dyn Ops> = Arc::new(CpuBackend::new());
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(name);
    let m = tm_model::loader::load(&dir, ops.as_ref(), &mut |_, _| {}).expect("fixture loads");
    (Arc::new(m), ops)
}

/// A small-block engine config: `num_blocks` blocks of 4 tokens, 32-token steps.
pub fn config(num_blocks: usize, prefix_caching: bool) -> EngineConfig {
    EngineConfig {
        block_size: 4,
        num_blocks,
        max_batched_tokens: 32,
        max_batch_size: 8,
        max_queue: 64,
        max_model_len: None,
        enable_prefix_caching: prefix_caching,
        kv_cache_dtype: Default::default(),
    }
}

/// Deterministic pseudo-random prompt of `len` tokens below `vocab`.
pub fn prompt(seed: u64, len: usize, vocab: usize) -> Vec<u32> {
    let mut rng = tm_core::sampling::Rng::new(seed);
    (0..len).map(|_| (rng.next_u64() % vocab as u64) as u32).collect()
}

/// A request for `ids` generating exactly `n` tokens (end of sequence ignored).
pub fn forced(ids: &[u32], n: usize, sampling: SamplingParams) -> Request {
    let mut r = Request::tokens(ids.to_vec()).with_max_tokens(n).with_sampling(sampling);
    r.ignore_eos = true;
    r
}

/// What `generate::Session` produces for `ids` (no stop tokens).
pub fn session_output(m: &LoadedModel, ops: &dyn Ops, ids: &[u32], n: usize, sampling: SamplingParams) -> Vec<u32> {
    let mut s = Session::new(&m.model, ops, 256, 16).unwrap();
    let opts = GenerateOptions { max_tokens: n, sampling, stop_ids: Vec::new() };
    s.generate(ids, &opts, &mut |_| ControlFlow::Continue(())).unwrap().0
}

/// Polls the engine's stats until `pred` holds (panics after 10 s).
pub fn wait_for(engine: &Engine, pred: impl Fn(&EngineStats) -> bool) -> EngineStats {
    let t = Instant::now();
    loop {
        let s = engine.stats();
        if pred(&s) {
            return s;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "timed out waiting; stats: {s:?}");
        std::thread::sleep(Duration::from_millis(2));
    }
}
