//! End-to-end checks of the wgpu backend through tm-model: whole models against transformers.
//!
//! - Every float Hugging Face fixture in `fixtures/` on wgpu with f32 weights: logits at every
//!   prompt position within 1e-3 of the logit range of transformers' (`reference.json`), and
//!   greedy decoding through the paged KV cache giving transformers' tokens.
//! - The same with f16 weights: logits within [`F16_TOL`] of the range, and at every greedy step
//!   (teacher-forced on transformers' tokens) transformers' token is the argmax or within the
//!   tolerance of it.
//! - The AWQ and GPTQ int4 fixtures (the fused-dequant int4 kernels): logits within the layout's
//!   own change plus 1e-3 of the range of transformers on the dequantized weights.
//! - The `llama` fixture on a backend whose storage bindings are capped at 16 KiB, so the
//!   embedding table, the LM head, the KV cache and the logits are all bound in windows.
//! - A decode step is one queue submission.
//!
//! The tests need a wgpu adapter; a software one (Mesa lavapipe) counts only with
//! `TM_WGPU_ALLOW_CPU=1`. Without one they print `skipped: no wgpu adapter (...)` and pass.
//! Fixtures are found through `TM_FIXTURES`, else next to the crate, else `./fixtures` (the test
//! binary may run from a repository copy at another path).

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Instant;
use tm_core::sampling::argmax;
use tm_core::Ops;
use tm_model::config::ModelConfig;
use tm_model::generate::Session;
use tm_model::llama::LlamaModel;
use tm_model::weights::SafetensorsCheckpoint;
use tm_wgpu::{WgpuBackend, WgpuOptions};

/// Logit tolerance with f32 weights, as a fraction of the prompt's logit range.
const F32_TOL: f32 = 1e-3;
/// Logit tolerance with f16 weights, as a fraction of the prompt's logit range.
const F16_TOL: f32 = 5e-3;

const FLOAT_FIXTURES: &[&str] = &[
    "llama",
    "llama3_rope",
    "llama_linear_rope",
    "llama_dynamic_rope",
    "llama_yarn_rope",
    "mistral",
    "qwen2",
    "qwen3",
    "internlm2",
];

/// A backend with `opts` over the environment's adapter choice, or `None` (printed) without one.
fn open(test: &str, tweak: impl FnOnce(&mut WgpuOptions)) -> Option<WgpuBackend> {
    let mut opts = WgpuOptions::from_env();
    tweak(&mut opts);
    match WgpuBackend::open(opts) {
        Ok(b) => Some(b),
        Err(e) => {
            println!("{test}: skipped: no wgpu adapter ({e})");
            None
        }
    }
}

fn fixtures_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TM_FIXTURES").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    let next_to_crate = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    if next_to_crate.is_dir() {
        next_to_crate
    } else {
        PathBuf::from("fixtures")
    }
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array().expect("array").iter().map(|x| x.as_u64().expect("integer") as u32).collect()
}

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array().expect("array").iter().map(|x| x.as_f64().expect("number") as f32).collect()
}

fn load(ops: &dyn Ops, dir: &Path) -> LlamaModel {
    let ckpt = SafetensorsCheckpoint::open(dir).unwrap_or_else(|e| panic!("opening {}: {e}", dir.display()));
    let cfg = ModelConfig::from_dir(dir).unwrap_or_else(|e| panic!("config of {}: {e}", dir.display()));
    LlamaModel::load(ops, &ckpt, cfg, &mut |_| {}).unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()))
}

/// How strictly a run is judged.
#[derive(Clone, Copy)]
struct Judge {
    /// Logit tolerance as a fraction of the range.
    tol: f32,
    /// Extra absolute tolerance per prompt, from `reference.json` (the int4 layout's own change).
    layout_key: Option<&'static str>,
    /// Greedy: exact tokens (true) or transformers' token within the tolerance of the argmax.
    exact_greedy: bool,
}

/// One fixture on `ops`; returns the worst logit error as a fraction of the range.
fn check(name: &str, ops: &dyn Ops, judge: Judge) -> f32 {
    let dir = fixtures_dir().join(name);
    let reference = read_json(&dir.join("reference.json"));
    let model = load(ops, &dir);
    let vocab = model.config.vocab_size;
    let mut worst = 0f32;
    for (pi, prompt) in reference["prompts"].as_array().expect("prompts").iter().enumerate() {
        let ids = u32s(&prompt["ids"]);
        let mut session = Session::new(&model, ops, 256, 16).unwrap_or_else(|e| panic!("{name}: session: {e}"));
        let got = session.prompt_logits(&ids).unwrap_or_else(|e| panic!("{name}: prompt_logits: {e}"));
        let want: Vec<Vec<f32>> = prompt["logits"].as_array().expect("logits").iter().map(f32s).collect();
        assert_eq!(got.len(), want.len() * vocab, "{name} prompt {pi}: logit count");
        let (mut lo, mut hi, mut max_diff) = (f32::MAX, f32::MIN, 0f32);
        for (pos, row) in want.iter().enumerate() {
            for (j, &w) in row.iter().enumerate() {
                lo = lo.min(w);
                hi = hi.max(w);
                max_diff = max_diff.max((got[pos * vocab + j] - w).abs());
            }
        }
        let range = hi - lo;
        let layout = judge.layout_key.map_or(0.0, |k| prompt[k].as_f64().unwrap_or(0.0) as f32);
        let tol = judge.tol * range + layout;
        println!("{name} prompt {pi}: max |logit diff| {max_diff:.3e} (tolerance {tol:.3e}, range {range:.2})");
        assert!(max_diff <= tol, "{name} prompt {pi}: max |logit diff| {max_diff} > {tol}");
        worst = worst.max(max_diff / range);

        // Greedy decoding through the KV cache, fed transformers' tokens.
        let want_ids = u32s(&prompt["greedy_ids"]);
        let want_top = f32s(&prompt["greedy_top_logits"]);
        let margins = prompt.get("greedy_margins").map(f32s);
        session.truncate(0);
        let mut logits = session.append(&ids).unwrap_or_else(|e| panic!("{name}: append: {e}"));
        for (step, &want_t) in want_ids.iter().enumerate() {
            if margins.as_ref().is_some_and(|m| m[step] <= 2.0 * tol) {
                break; // a near-tie: either token is right, and the sequences may part
            }
            let t = argmax(&logits);
            if judge.exact_greedy {
                assert_eq!(t, want_t, "{name} prompt {pi}: greedy step {step}");
                let top = logits[t as usize];
                assert!((top - want_top[step]).abs() <= tol.max(1e-4), "{name}: step {step}: top logit {top}");
            } else {
                let gap = logits[t as usize] - logits[want_t as usize];
                assert!(
                    gap <= tol,
                    "{name} prompt {pi}: step {step}: transformers' token {want_t} is {gap} below the argmax {t}"
                );
            }
            if step + 1 < want_ids.len() {
                logits = session.append(&[want_t]).unwrap_or_else(|e| panic!("{name}: append: {e}"));
            }
        }
    }
    worst
}

#[test]
fn float_fixtures_f32_weights_match_transformers() {
    let Some(g) = open("float_fixtures_f32", |_| {}) else { return };
    let start = Instant::now();
    let judge = Judge { tol: F32_TOL, layout_key: None, exact_greedy: true };
    for name in FLOAT_FIXTURES {
        let worst = check(name, &g, judge);
        println!("ok   {name} [f32 weights]: worst {worst:.2e} of the logit range");
    }
    println!("float fixtures, f32 weights: {:?}", start.elapsed());
}

#[test]
fn float_fixtures_f16_weights_match_transformers() {
    let Some(g) = open("float_fixtures_f16", |o| o.f16_weights = true) else { return };
    let start = Instant::now();
    let judge = Judge { tol: F16_TOL, layout_key: None, exact_greedy: false };
    for name in FLOAT_FIXTURES {
        let worst = check(name, &g, judge);
        println!("ok   {name} [f16 weights]: worst {worst:.2e} of the logit range");
    }
    println!("float fixtures, f16 weights: {:?}", start.elapsed());
}

#[test]
fn int4_fixtures_match_dequantized_transformers() {
    let Some(g) = open("int4_fixtures", |_| {}) else { return };
    let judge = Judge { tol: F32_TOL, layout_key: Some("f16_min_logit_change"), exact_greedy: true };
    for name in ["llama-awq", "llama-gptq"] {
        let worst = check(name, &g, judge);
        println!("ok   {name} [int4]: worst {worst:.2e} of the logit range");
    }
}

#[test]
fn windowed_bindings_match_transformers() {
    let Some(g) = open("windowed_bindings", |o| o.max_binding = Some(16 << 10)) else { return };
    println!("storage bindings capped at {} bytes", g.gpu().max_binding());
    let judge = Judge { tol: F32_TOL, layout_key: None, exact_greedy: true };
    for name in ["llama", "qwen2"] {
        let worst = check(name, &g, judge);
        println!("ok   {name} [16 KiB bindings]: worst {worst:.2e} of the logit range");
    }
    let judge = Judge { tol: F32_TOL, layout_key: Some("f16_min_logit_change"), exact_greedy: true };
    check("llama-awq", &g, judge);
}

#[test]
fn a_decode_step_is_one_submission() {
    let Some(g) = open("one_submission", |_| {}) else { return };
    let model = load(&g, &fixtures_dir().join("llama"));
    let mut session = Session::new(&model, &g, 256, 16).expect("session");
    let mut logits = session.append(&[1, 2, 3, 4]).expect("prefill");
    for step in 0..4 {
        let before = g.gpu().submissions();
        logits = session.append(&[argmax(&logits)]).expect("decode");
        let used = g.gpu().submissions() - before;
        println!("decode step {step}: {used} submission(s)");
        assert_eq!(used, 1, "decode step {step}");
    }
}
