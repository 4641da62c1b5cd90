//! The FP8 E4M3 KV cache on the CPU backend: logits stay close to those of the f32 cache on the
//! fixtures (but not equal: the cache really is 8-bit), greedy continuations match Hugging Face
//! where the fixtures' margins allow, and the serving engine runs with it.

mod engine_common;

use engine_common::{forced, prompt};
use serde_json::Value;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tm_core::sampling::{argmax, SamplingParams};
use tm_core::Ops;
use tm_cpu::CpuBackend;
use tm_model::engine::{Engine, EngineConfig};
use tm_model::generate::{GenerateOptions, Session};
use tm_model::kv_cache::KvCacheDtype;
use tm_model::loader::{load, LoadedModel};

fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(name)
}

fn load_fixture(name: &str) -> (Arc<LoadedModel>, Arc<dyn Ops>) {
    let ops: Arc<dyn Ops> = Arc::new(CpuBackend::new());
    let m = load(&fixture_dir(name), ops.as_ref(), &mut |_, _| {}).expect("fixture loads");
    (Arc::new(m), ops)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// What the fp8 cache changes on one fixture, over every position of its reference prompts and
/// of transformers' greedy continuations (teacher-forced, so one early flip does not cascade).
struct Drift {
    /// Largest |fp8 − f32| logit difference, as a fraction of the f32 logits' range.
    worst: f32,
    /// Positions whose top-1 token is the same with both caches.
    same_top1: usize,
    /// Positions compared.
    positions: usize,
}

fn drift(name: &str) -> Drift {
    let (m, ops) = load_fixture(name);
    let vocab = m.model.config.vocab_size;
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture_dir(name).join("reference.json")).unwrap()).unwrap();
    let mut exact = Session::new(&m.model, ops.as_ref(), 256, 4).unwrap();
    let mut fp8 = Session::with_kv_dtype(&m.model, ops.as_ref(), 256, 4, KvCacheDtype::Fp8).unwrap();
    let mut d = Drift { worst: 0.0, same_top1: 0, positions: 0 };
    for p in reference["prompts"].as_array().unwrap() {
        let mut tokens = ids(&p["ids"]);
        tokens.extend(ids(&p["greedy_ids"]));
        let want = exact.prompt_logits(&tokens).unwrap();
        let got = fp8.prompt_logits(&tokens).unwrap();
        assert_eq!(want.len(), got.len());
        let lo = want.iter().copied().fold(f32::MAX, f32::min);
        let hi = want.iter().copied().fold(f32::MIN, f32::max);
        let diff = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        d.worst = d.worst.max(diff / (hi - lo));
        for (w, g) in want.chunks(vocab).zip(got.chunks(vocab)) {
            d.positions += 1;
            d.same_top1 += usize::from(argmax(w) == argmax(g));
        }
    }
    d
}

/// Measured on this commit (max logit difference as a share of the range; top-1 agreement):
/// llama 3.25% (55/59), llama3_rope 5.18% (52/59), mistral 4.62% (51/57), qwen2 2.79% (55/57),
/// qwen3 2.84% (54/57), internlm2 3.25% (55/59); 322/348 = 92.5% in all. An E4M3 value carries
/// a relative error of up to 1/16, and these random-weight fixtures have top-1/top-2 gaps as
/// small as 0.01, so greedy text is not expected to match exactly here. The bounds (8% of the
/// range, 90% top-1 agreement over all fixtures) are far from what a broken conversion gives: an
/// exponent bias off by one in the decoder gave 42% of the range and 11/59 on llama. The lower
/// bound proves the fp8 cache was really used.
#[test]
fn fp8_logits_stay_close_to_the_f32_cache_on_the_fixtures() {
    let (mut same, mut total) = (0, 0);
    for name in ["llama", "llama3_rope", "mistral", "qwen2", "qwen3", "internlm2"] {
        let d = drift(name);
        eprintln!(
            "{name}: max |fp8 - f32 cache| logit difference {:.2}% of the range; top-1 agrees at {}/{} positions",
            100.0 * d.worst,
            d.same_top1,
            d.positions
        );
        assert!(d.worst < 0.08, "{name}: fp8 cache logits differ by {} of the range", d.worst);
        assert!(d.worst > 1e-6, "{name}: fp8 logits are identical to the f32 cache: the fp8 path was not taken");
        same += d.same_top1;
        total += d.positions;
    }
    assert!(same * 10 >= total * 9, "top-1 agreement {same}/{total} is below 90%");
}

/// The serving engine with an fp8 cache (paged, batched, chunked prefill) generates what a
/// session with an fp8 cache generates, and its blocks are one byte per element.
#[test]
fn the_engine_runs_with_an_fp8_cache() {
    let (m, ops) = load_fixture("llama");
    let vocab = m.model.config.vocab_size;
    let config = EngineConfig {
        block_size: 4,
        num_blocks: 128,
        max_batched_tokens: 32,
        max_batch_size: 8,
        kv_cache_dtype: KvCacheDtype::Fp8,
        ..EngineConfig::default()
    };
    let engine = Engine::start(Arc::clone(&m), Arc::clone(&ops), config).unwrap();
    let prompts: Vec<Vec<u32>> =
        [5usize, 37, 12, 50].iter().enumerate().map(|(i, &n)| prompt(i as u64, n, vocab)).collect();
    let streams: Vec<_> =
        prompts.iter().map(|p| engine.submit(forced(p, 10, SamplingParams::greedy())).unwrap()).collect();
    for (p, s) in prompts.iter().zip(streams) {
        let got = s.wait().token_ids;
        let mut session = Session::with_kv_dtype(&m.model, ops.as_ref(), 256, 16, KvCacheDtype::Fp8).unwrap();
        let opts = GenerateOptions { max_tokens: 10, sampling: SamplingParams::greedy(), stop_ids: Vec::new() };
        let want = session.generate(p, &opts, &mut |_| ControlFlow::Continue(())).unwrap().0;
        assert_eq!(got, want, "engine vs session, both with an fp8 cache");
    }
}

/// On the real default model (SmolLM2-135M-Instruct): along the f32 cache's greedy chat
/// answers (teacher-forced), the fp8 cache picks the same top-1 token at nearly every position.
/// (Free-running greedy text can part ways at a near-tie: with the fp8 cache "Name three
/// colors." is answered "1. Red: This is a classic color…" instead of "1. Red\n2. Blue…".)
/// Skips, saying so, when the model cannot be fetched.
#[test]
fn default_model_top1_agrees_with_an_fp8_cache() {
    let path = match tm_model::default_model::default_model_path(&mut |m| eprintln!("{m}")) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("skipping: default model not available: {e}");
            return;
        }
    };
    let ops: Arc<dyn Ops> = Arc::new(CpuBackend::new());
    let m = load(&path, ops.as_ref(), &mut |_, _| {}).unwrap();
    let tok = &m.tokenizer;
    let vocab = m.model.config.vocab_size;
    let opts = GenerateOptions { max_tokens: 48, sampling: SamplingParams::greedy(), stop_ids: tok.eos_ids().to_vec() };
    let (mut same, mut total, mut worst) = (0usize, 0usize, 0f32);
    for q in ["What is the capital of France?", "Name three colors.", "What is 2 + 2?", "Write a haiku about rain."] {
        let messages = [tm_model::chat_template::ChatMessage::new("user", q)];
        let text = m.template.render(&messages, true, tok.bos_token().unwrap_or(""), "").unwrap();
        let mut tokens = tok.encode(&text, false).unwrap();
        let prompt_len = tokens.len();
        let mut exact = Session::new(&m.model, ops.as_ref(), 512, 16).unwrap();
        tokens.extend(exact.generate(&tokens.clone(), &opts, &mut |_| ControlFlow::Continue(())).unwrap().0);
        let want = exact.prompt_logits(&tokens).unwrap();
        let mut fp8 = Session::with_kv_dtype(&m.model, ops.as_ref(), 512, 16, KvCacheDtype::Fp8).unwrap();
        let got = fp8.prompt_logits(&tokens).unwrap();
        let lo = want.iter().copied().fold(f32::MAX, f32::min);
        let hi = want.iter().copied().fold(f32::MIN, f32::max);
        let diff = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        worst = worst.max(diff / (hi - lo));
        // the positions that predict the answer tokens
        for (w, g) in want.chunks(vocab).zip(got.chunks(vocab)).skip(prompt_len - 1).take(tokens.len() - prompt_len) {
            total += 1;
            same += usize::from(argmax(w) == argmax(g));
        }
    }
    eprintln!(
        "default model: top-1 agrees at {same}/{total} answer positions; max logit diff {:.2}% of the range",
        100.0 * worst
    );
    assert!(worst < 0.08, "fp8 cache logits differ by {worst} of the range");
    assert!(same * 10 >= total * 9, "top-1 agreement {same}/{total} is below 90%");
}
