//! The serving engine over tensor-parallel CPU ranks: concurrent requests give what the
//! single-rank engine gives (greedy, and seeded sampling with penalties, whose random streams
//! come back from rank 0), log-probabilities included; a stalled rank fails the requests in
//! flight with the deadline error, and the engine stops and says why. The llama fixture runs on
//! 2 and 4 ranks, an eight-head Llama written by the test on 8.

mod engine_common;
mod plan_common;
mod tp_common;

use engine_common::*;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tm_core::sampling::SamplingParams;
use tm_core::{Comm, LocalComm};
use tm_model::engine::{Engine, EngineConfig, FinishReason, TpModelInfo};
use tm_model::loader::{load_tp, LoadedTp};
use tm_model::tp::{cpu_backend_factory, TpOptions};
use tp_common::{write_eight_heads, EightHeads};

fn llama_fixture() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/llama")
}

fn tp_engine(
    dir: &Path,
    world: usize,
    config: &EngineConfig,
    stall: Option<(usize, u64)>,
    timeout: Duration,
) -> Engine {
    let comms = LocalComm::group(world)
        .into_iter()
        .map(|c| match stall {
            Some((r, n)) if c.rank() == r => Box::new(c.stall_after(n)) as Box<dyn Comm>,
            _ => Box::new(c) as Box<dyn Comm>,
        })
        .collect();
    let opts = TpOptions {
        comm_timeout: timeout,
        num_blocks: config.num_blocks,
        block_size: config.block_size,
        max_tokens: config.max_batched_tokens,
        max_logit_rows: config.max_batch_size,
        kv_cache_dtype: Default::default(),
        spin: Duration::ZERO,
    };
    let LoadedTp { path, name, group, tokenizer, template } =
        load_tp(dir, comms, cpu_backend_factory(), opts).expect("tp checkpoint loads");
    let config_model = group.config().clone();
    let info = Arc::new(TpModelInfo { path, name, tokenizer, template, config: config_model });
    Engine::start_tp(info, group, config.clone()).expect("tp engine starts")
}

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.8,
        top_p: 0.9,
        top_k: 20,
        repetition_penalty: 1.3,
        presence_penalty: 0.5,
        seed,
        ..SamplingParams::default()
    }
}

/// Six concurrent requests (greedy and seeded sampling with penalties, 3 log-probabilities a
/// token) on the checkpoint in `dir`: every world in `worlds` gives the single-rank engine's
/// tokens and log-probabilities.
fn check_engine(dir: &Path, worlds: &[usize]) {
    let ops: Arc<dyn tm_core::Ops> = Arc::new(tm_cpu::CpuBackend::new());
    let m = Arc::new(tm_model::loader::load(dir, ops.as_ref(), &mut |_, _| {}).expect("checkpoint loads"));
    let vocab = m.model.config.vocab_size;
    let prompts: Vec<Vec<u32>> =
        [5usize, 37, 12, 64, 3, 21].iter().enumerate().map(|(i, &len)| prompt(i as u64, len, vocab)).collect();
    let cfg = config(128, true);
    let requests = |p: &[u32], i: usize| {
        let mut r = if i.is_multiple_of(2) {
            forced(p, 10, SamplingParams::greedy())
        } else {
            forced(p, 10, sampled(i as u64))
        };
        r.logprobs = Some(3);
        r
    };
    let one = Engine::start(Arc::clone(&m), Arc::clone(&ops), cfg.clone()).unwrap();
    let want: Vec<_> = prompts.iter().enumerate().map(|(i, p)| one.submit(requests(p, i)).unwrap()).collect();
    let want: Vec<_> = want.into_iter().map(|s| s.wait()).collect();
    for &world in worlds {
        let engine = tp_engine(dir, world, &cfg, None, Duration::from_secs(30));
        let got: Vec<_> = prompts.iter().enumerate().map(|(i, p)| engine.submit(requests(p, i)).unwrap()).collect();
        for (i, (g, w)) in got.into_iter().zip(&want).enumerate() {
            let g = g.wait();
            assert_eq!(g.finish_reason, FinishReason::Length, "tp={world} prompt {i}");
            assert_eq!(g.token_ids, w.token_ids, "tp={world} prompt {i}");
            let (gl, wl) = (&g.logprobs, &w.logprobs);
            assert_eq!(gl.len(), 10, "tp={world} prompt {i}");
            assert_eq!(gl.len(), wl.len());
            for (a, b) in gl.iter().zip(wl) {
                assert_eq!(a.token, b.token);
                assert!((a.logprob - b.logprob).abs() < 1e-3, "tp={world} prompt {i}: {a:?} vs {b:?}");
            }
        }
        assert!(engine.failure().is_none());
        engine.shutdown(Duration::from_secs(5)).unwrap();
    }
}

#[test]
fn tp_engine_matches_the_single_rank_engine() {
    check_engine(&llama_fixture(), &[2, 4]);
}

/// Eight ranks: 8 query heads one per rank, the 2 KV heads each replicated on 4 ranks, and the
/// vocabulary of 384 split 48 rows a rank.
#[test]
fn tp8_engine_matches_the_single_rank_engine() {
    let dir = write_eight_heads("engine", EightHeads { kv_heads: 2, vocab: 384, tied: false });
    check_engine(dir.path(), &[8]);
}

#[test]
fn a_stalled_rank_fails_the_requests_and_stops_the_engine() {
    let (m, _) = fixture("llama");
    let vocab = m.model.config.vocab_size;
    let timeout = Duration::from_millis(500);
    // Collective #0 is the start-up self-test; the stall hits the third step.
    let engine = tp_engine(&llama_fixture(), 2, &config(64, false), Some((1, 1 + 2 * 5)), timeout);
    let t0 = Instant::now();
    let streams: Vec<_> =
        (0..3).map(|i| engine.submit(forced(&prompt(i, 6, vocab), 8, SamplingParams::greedy())).unwrap()).collect();
    for s in streams {
        let c = s.wait();
        assert_eq!(c.finish_reason, FinishReason::Error, "{c:?}");
        let msg = c.error.unwrap_or_default();
        assert!(msg.contains("rank 1 did not arrive") && msg.contains("timed out"), "{msg}");
    }
    let took = t0.elapsed();
    assert!(took < timeout * 3, "the requests failed after {took:?}");
    let why = engine.failure().expect("the engine reports why it stopped");
    assert!(why.contains("rank 1 did not arrive"), "{why}");
    let refused = engine.submit(forced(&prompt(9, 4, vocab), 2, SamplingParams::greedy())).unwrap_err().to_string();
    assert!(refused.contains("stopped"), "{refused}");
    let t1 = Instant::now();
    engine.shutdown(Duration::from_secs(1)).unwrap();
    assert!(t1.elapsed() < Duration::from_secs(3), "shutdown took {:?}", t1.elapsed());
}
