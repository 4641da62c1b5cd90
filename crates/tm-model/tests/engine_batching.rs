//! The engine on the tiny fixture: concurrent requests produce exactly what each produces
//! alone (and what `generate::Session` produces), prefix hits change nothing but the work done,
//! and a cache of a few blocks still completes everything through preemption.

mod engine_common;

use engine_common::*;
use std::sync::Arc;
use tm_core::sampling::SamplingParams;
use tm_model::engine::{Engine, FinishReason};

fn prompts(vocab: usize) -> Vec<Vec<u32>> {
    [5usize, 37, 12, 64, 3, 21, 50, 9].iter().enumerate().map(|(i, &len)| prompt(i as u64, len, vocab)).collect()
}

#[test]
fn concurrent_greedy_requests_match_each_alone_and_the_session() {
    let (m, ops) = fixture("llama");
    let vocab = m.model.config.vocab_size;
    let prompts = prompts(vocab);
    let engine = Engine::start(Arc::clone(&m), Arc::clone(&ops), config(128, true)).unwrap();
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| engine.submit(forced(p, 12, SamplingParams::greedy())).unwrap().wait().token_ids)
        .collect();
    for (p, a) in prompts.iter().zip(&alone) {
        assert_eq!(a, &session_output(&m, ops.as_ref(), p, 12, SamplingParams::greedy()), "engine vs session");
    }
    // Concurrently, on a fresh engine (no prefix cache from the runs above) and the same one.
    for engine in [Engine::start(Arc::clone(&m), Arc::clone(&ops), config(128, true)).unwrap(), engine] {
        let streams: Vec<_> =
            prompts.iter().map(|p| engine.submit(forced(p, 12, SamplingParams::greedy())).unwrap()).collect();
        for (i, s) in streams.into_iter().enumerate() {
            let c = s.wait();
            assert_eq!(c.finish_reason, FinishReason::Length);
            assert_eq!(c.token_ids, alone[i], "prompt {i}");
            assert_eq!(c.usage.completion_tokens, 12);
            assert_eq!(c.usage.prompt_tokens, prompts[i].len());
        }
        let s = wait_for(&engine, |s| s.running == 0 && s.waiting == 0);
        assert_eq!(s.kv_blocks_used, 0);
    }
}

#[test]
fn seeded_sampling_is_the_same_batched_or_alone() {
    let (m, ops) = fixture("qwen3");
    let vocab = m.model.config.vocab_size;
    let prompts = prompts(vocab);
    let params = |i: usize| SamplingParams { temperature: 1.0, top_p: 0.9, seed: 100 + i as u64, ..Default::default() };
    let engine = Engine::start(Arc::clone(&m), Arc::clone(&ops), config(128, false)).unwrap();
    let alone: Vec<_> =
        prompts.iter().enumerate().map(|(i, p)| engine.submit(forced(p, 10, params(i))).unwrap().wait()).collect();
    for (i, p) in prompts.iter().enumerate() {
        assert_eq!(alone[i].token_ids, session_output(&m, ops.as_ref(), p, 10, params(i)));
    }
    let streams: Vec<_> =
        prompts.iter().enumerate().map(|(i, p)| engine.submit(forced(p, 10, params(i))).unwrap()).collect();
    for (i, s) in streams.into_iter().enumerate() {
        assert_eq!(s.wait().token_ids, alone[i].token_ids);
    }
}

#[test]
fn prefix_hits_give_identical_outputs_with_fewer_blocks() {
    let (m, ops) = fixture("llama");
    let vocab = m.model.config.vocab_size;
    let shared = prompt(42, 40, vocab);
    let mut second = shared.clone();
    second.extend(prompt(43, 6, vocab));
    let run = |caching: bool| {
        let engine = Engine::start(Arc::clone(&m), Arc::clone(&ops), config(64, caching)).unwrap();
        let mut out = Vec::new();
        let mut allocated = Vec::new();
        for p in [&shared, &shared, &second] {
            let before = engine.stats().kv_blocks_allocated;
            out.push(engine.submit(forced(p, 8, SamplingParams::greedy())).unwrap().wait());
            allocated.push(wait_for(&engine, |s| s.running == 0).kv_blocks_allocated - before);
        }
        (out, allocated, engine.stats())
    };
    let (cold, cold_blocks, cold_stats) = run(false);
    let (warm, warm_blocks, warm_stats) = run(true);
    eprintln!("blocks allocated per request: {cold_blocks:?} without, {warm_blocks:?} with prefix caching");
    for (c, w) in cold.iter().zip(&warm) {
        assert_eq!(c.token_ids, w.token_ids);
        assert_eq!(c.text, w.text);
    }
    assert_eq!(cold.iter().map(|c| c.usage.cached_prompt_tokens).collect::<Vec<_>>(), vec![0, 0, 0]);
    // The repeat finds all 10 blocks (its last token is recomputed); the extension finds 10 too.
    assert_eq!(warm.iter().map(|c| c.usage.cached_prompt_tokens).collect::<Vec<_>>(), vec![0, 39, 40]);
    assert!(warm_blocks[1] < cold_blocks[1] && warm_blocks[2] < cold_blocks[2], "{warm_blocks:?} vs {cold_blocks:?}");
    assert!(warm_stats.tokens_computed < cold_stats.tokens_computed);
    assert_eq!(warm_stats.prefix_cache_hit_tokens, 79);
    assert!(warm_stats.kv_blocks_cached > 0 && warm_stats.kv_blocks_used == 0);
}

#[test]
fn a_cache_of_a_few_blocks_completes_everything_by_preemption() {
    let (m, ops) = fixture("llama");
    let vocab = m.model.config.vocab_size;
    let prompts = prompts(vocab);
    let big = Engine::start(Arc::clone(&m), Arc::clone(&ops), config(128, false)).unwrap();
    let alone: Vec<_> =
        prompts.iter().map(|p| big.submit(forced(p, 16, SamplingParams::greedy())).unwrap().wait().token_ids).collect();
    for caching in [false, true] {
        // 21 blocks of 4 tokens: the longest request (64 + 16 tokens) just fits on its own.
        let small = Engine::start(Arc::clone(&m), Arc::clone(&ops), config(21, caching)).unwrap();
        let streams: Vec<_> =
            prompts.iter().map(|p| small.submit(forced(p, 16, SamplingParams::greedy())).unwrap()).collect();
        for (i, s) in streams.into_iter().enumerate() {
            let c = s.wait();
            assert_eq!(c.finish_reason, FinishReason::Length, "{:?}", c.error);
            assert_eq!(c.token_ids, alone[i], "prompt {i} (prefix caching {caching})");
        }
        let s = wait_for(&small, |s| s.running == 0 && s.waiting == 0);
        assert!(s.preemptions > 0, "{s:?}");
        assert_eq!((s.kv_blocks_used, s.kv_blocks_peak <= 21), (0, true));
        small.shutdown(std::time::Duration::from_secs(5)).unwrap();
    }
}
