//! End-to-end checks of the CUDA backend through tm-model: whole models, not single ops.
//!
//! - Every tiny Hugging Face fixture in `fixtures/` loaded on CUDA (f32 and bf16): logits at every
//!   prompt position against transformers' (`reference.json`), and greedy decoding, teacher-forced
//!   on the CPU backend's tokens, picking the CPU's token at every step (f32: exactly, and also
//!   transformers' tokens and top logits; bf16: or a token within the bf16 tolerance of it).
//! - The default model (SmolLM2-135M-Instruct Q4_1 GGUF), when present (`TM_DEFAULT_MODEL` or the
//!   cache; nothing is downloaded): the same greedy text as the CPU for three prompts × 32 tokens
//!   (f32; a divergence only at a near-tie), the bf16 agreement length reported, and logits against
//!   `fixtures/smollm2_reference.json`.
//! - The serving engine on CUDA: concurrent requests complete, and (f32) produce exactly what each
//!   produces alone in a `Session`.
//!
//! Without a CUDA device every test prints `skipped: no CUDA device (<reason>)` and passes.
//! Fixtures are found through `TM_FIXTURES`, else next to the crate, else `./fixtures` (the test
//! binary may run from a repository copy at another path). `TM_CUDA_DEVICE` picks the GPU.

use std::ops::ControlFlow;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use serde_json::Value;
use tm_core::sampling::{argmax, SamplingParams};
use tm_core::{DType, Ops};
use tm_cpu::CpuBackend;
use tm_cuda::{CudaBackend, CudaOptions};
use tm_model::engine::{Engine, EngineConfig, FinishReason, Request};
use tm_model::generate::{GenerateOptions, Session};
use tm_model::kv_cache::KvCacheDtype;
use tm_model::loader::LoadedModel;

/// Block size of the CUDA sessions.
const BLOCK: usize = 16;

/// Logit tolerance against transformers, as a fraction of the prompt's logit range.
fn logit_tolerance(dtype: DType) -> f32 {
    if dtype == DType::F32 {
        1e-3
    } else {
        5e-2
    }
}

/// Turns any error into a `String` naming what failed.
trait Ctx<T> {
    /// `Err(e)` becomes `"{what} failed: {e}"`.
    fn ctx(self, what: impl std::fmt::Display) -> Result<T, String>;
}

impl<T, E: std::fmt::Display> Ctx<T> for Result<T, E> {
    fn ctx(self, what: impl std::fmt::Display) -> Result<T, String> {
        self.map_err(|e| format!("{what} failed: {e}"))
    }
}

/// `true` (after printing why) when there is no usable CUDA device.
fn no_gpu(test: &str) -> bool {
    match tm_cuda::probe() {
        Ok(_) => false,
        Err(e) => {
            println!("{test}: skipped: no CUDA device ({e})");
            true
        }
    }
}

/// The text of a caught panic.
fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".into())
}

/// Runs `f`, turning a panic into an error.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| Err(format!("{what} panicked: {}", panic_message(&*p))))
}

/// The CUDA backend for `dtype`, opened once per process.
fn cuda(dtype: DType) -> Result<Arc<dyn Ops>, String> {
    type Opened = Vec<(DType, Result<Arc<dyn Ops>, String>)>;
    static OPENED: OnceLock<Mutex<Opened>> = OnceLock::new();
    let mut opened = OPENED.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, b)) = opened.iter().find(|(d, _)| *d == dtype) {
        return b.clone();
    }
    let ordinal = std::env::var("TM_CUDA_DEVICE").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    let b = guarded("CudaBackend::open", || {
        CudaBackend::open(CudaOptions {
            ordinal,
            dtype,
            memory_cap: None,
            cuda_graphs: false,
            memory_model: Default::default(),
        })
        .map(|b| Arc::new(b) as Arc<dyn Ops>)
        .ctx(format!("CudaBackend::open(device {ordinal}, {dtype})"))
    });
    opened.push((dtype, b.clone()));
    b
}

/// The fixtures directory (see the module docs).
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

/// Loads `path` on `ops`.
fn load(path: &Path, ops: &dyn Ops, on: &str) -> Result<LoadedModel, String> {
    guarded("loading", || {
        tm_model::loader::load(path, ops, &mut |_, _| {}).ctx(format!("loading {} on {on}", path.display()))
    })
}

/// What one test found: problems fail it at the end; notes are printed.
#[derive(Default)]
struct Report {
    problems: Vec<String>,
}

impl Report {
    fn ok(&self, what: &str) {
        println!("ok   {what}");
    }
    fn fail(&mut self, what: String) {
        println!("FAIL {what}");
        self.problems.push(what);
    }
    /// Records `r`'s error, if any, as a problem.
    fn record(&mut self, head: &str, r: Result<(), String>) {
        if let Err(e) = r {
            self.fail(format!("{head}: {e}"));
        }
    }
    fn finish(self, test: &str) {
        assert!(self.problems.is_empty(), "{test}: {} problem(s):\n{}", self.problems.len(), self.problems.join("\n"));
    }
}

// ---------------------------------------------------------------------------------------------
// (a) The Hugging Face fixtures.
// ---------------------------------------------------------------------------------------------

fn check_fixture(name: &str) {
    if no_gpu(name) {
        return;
    }
    let dir = fixtures_dir().join(name);
    let reference = read_json(&dir.join("reference.json"));
    let cpu = CpuBackend::new();
    let cpu_model = load(&dir, &cpu, "cpu").unwrap_or_else(|e| panic!("{e}"));
    let mut report = Report::default();
    for dtype in [DType::F32, DType::BF16] {
        let head = format!("{name} [{dtype}]");
        let r = guarded(&head, || fixture_on(&head, &dir, &reference, &cpu_model, &cpu, dtype, &mut report));
        report.record(&head, r);
    }
    report.finish(name);
}

/// The fixture checks for one dtype; mismatches go to `report`, errors are returned.
fn fixture_on(
    head: &str,
    dir: &Path,
    reference: &Value,
    cpu_model: &LoadedModel,
    cpu: &CpuBackend,
    dtype: DType,
    report: &mut Report,
) -> Result<(), String> {
    let gpu = cuda(dtype)?;
    let m = load(dir, gpu.as_ref(), &format!("cuda {dtype}"))?;
    let vocab = m.model.config.vocab_size;
    for (pi, prompt) in reference["prompts"].as_array().expect("prompts").iter().enumerate() {
        let ids = u32s(&prompt["ids"]);
        let head = format!("{head} prompt {pi} ({} tokens)", ids.len());
        let mut gs = Session::new(&m.model, gpu.as_ref(), 256, BLOCK).ctx("cuda Session::new")?;

        // Logits at every prompt position against transformers.
        let got = gs.prompt_logits(&ids).ctx("cuda prompt_logits")?;
        let want: Vec<Vec<f32>> = prompt["logits"].as_array().expect("logits").iter().map(f32s).collect();
        if got.len() != want.len() * vocab {
            report.fail(format!("{head}: {} logits, want {} × {vocab}", got.len(), want.len()));
            continue;
        }
        let (mut lo, mut hi, mut worst) = (f32::MAX, f32::MIN, (0f32, 0usize, 0usize));
        for (p, row) in want.iter().enumerate() {
            for (t, &w) in row.iter().enumerate() {
                lo = lo.min(w);
                hi = hi.max(w);
                let d = (got[p * vocab + t] - w).abs();
                let d = if d.is_nan() { f32::INFINITY } else { d };
                if d > worst.0 {
                    worst = (d, p, t);
                }
            }
        }
        let tol = logit_tolerance(dtype) * (hi - lo);
        let (d, p, t) = worst;
        let what = format!(
            "{head}: logits vs transformers: max |diff| {d:.3e} at position {p} token {t} (cuda {}, transformers {}); \
             tolerance {tol:.3e} ({} of the range {:.3})",
            got[p * vocab + t],
            want[p][t],
            logit_tolerance(dtype),
            hi - lo
        );
        if d <= tol {
            report.ok(&what);
        } else {
            report.fail(what);
        }

        // Greedy decoding, both backends fed the CPU's token at every step.
        let want_ids = u32s(&prompt["greedy_ids"]);
        let want_top = f32s(&prompt["greedy_top_logits"]);
        let mut cs = Session::new(&cpu_model.model, cpu, 256, 4).ctx("cpu Session::new")?;
        gs.truncate(0);
        let mut gl = gs.append(&ids).ctx("cuda append (prefill)")?;
        let mut cl = cs.append(&ids).ctx("cpu append (prefill)")?;
        let mut steps = Vec::new();
        let mut bad = Vec::new();
        for (step, (&want_id, &top)) in want_ids.iter().zip(&want_top).enumerate() {
            let (g, c) = (argmax(&gl), argmax(&cl));
            steps.push(g);
            if g != c {
                let margin = cl[c as usize] - cl[g as usize];
                let what = format!(
                    "step {step}: cuda picks {g} (logit {}), cpu {c} (cpu's margin over {g}: {margin:.3e})",
                    gl[g as usize]
                );
                if dtype == DType::F32 || margin > 2.0 * tol {
                    bad.push(what);
                } else {
                    println!("note {head}: near-tie accepted at {what}");
                }
            }
            if dtype == DType::F32 {
                if g != want_id {
                    bad.push(format!("step {step}: cuda picks {g}, transformers {want_id}"));
                } else if (gl[g as usize] - top).abs() > tol.max(1e-4) {
                    bad.push(format!("step {step}: top logit {} vs transformers {top}", gl[g as usize]));
                }
            }
            if step + 1 < want_ids.len() {
                gl = gs.append(&[c]).ctx(format!("cuda append (step {step})"))?;
                cl = cs.append(&[c]).ctx(format!("cpu append (step {step})"))?;
            }
        }
        if bad.is_empty() {
            report.ok(&format!("{head}: greedy {} steps agree with the cpu: {steps:?}", want_ids.len()));
        } else {
            report.fail(format!("{head}: greedy (teacher-forced on the cpu's tokens): {}", bad.join("; ")));
        }
    }
    Ok(())
}

#[test]
fn fixture_llama_sharded_f32() {
    check_fixture("llama");
}

#[test]
fn fixture_llama3_rope_bf16() {
    check_fixture("llama3_rope");
}

#[test]
fn fixture_linear_rope() {
    check_fixture("llama_linear_rope");
}

#[test]
fn fixture_dynamic_rope() {
    check_fixture("llama_dynamic_rope");
}

#[test]
fn fixture_yarn_rope() {
    check_fixture("llama_yarn_rope");
}

#[test]
fn fixture_mistral() {
    check_fixture("mistral");
}

#[test]
fn fixture_qwen2_bias_tied_f16() {
    check_fixture("qwen2");
}

#[test]
fn fixture_qwen3_qk_norm() {
    check_fixture("qwen3");
}

#[test]
fn fixture_internlm2() {
    check_fixture("internlm2");
}

// ---------------------------------------------------------------------------------------------
// (b) The default model, when present.
// ---------------------------------------------------------------------------------------------

/// The default model's file from `TM_DEFAULT_MODEL` or the cache; `None` (skip) when neither
/// has it. Never downloads.
fn default_model_file(test: &str) -> Option<PathBuf> {
    use tm_model::default_model::{default_model_cache_path, DEFAULT_MODEL_ENV};
    let path = match std::env::var_os(DEFAULT_MODEL_ENV).filter(|p| !p.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => match default_model_cache_path() {
            Ok(p) => p,
            Err(e) => {
                println!("{test}: skipped: no cache directory for the default model ({e})");
                return None;
            }
        },
    };
    if path.is_file() {
        Some(path)
    } else {
        println!("{test}: skipped: the default model is not at {} (set {DEFAULT_MODEL_ENV})", path.display());
        None
    }
}

/// Prompt ids: the chat template for `chat`, else the plain text with BOS.
fn prompt_ids(m: &LoadedModel, text: &str, chat: bool) -> Result<Vec<u32>, String> {
    if chat {
        let msgs = [tm_model::chat_template::ChatMessage::new("user", text)];
        let rendered =
            m.template.render(&msgs, true, m.tokenizer.bos_token().unwrap_or(""), "").ctx("rendering the chat")?;
        m.tokenizer.encode(&rendered, false).ctx("tokenizing")
    } else {
        m.tokenizer.encode(text, true).ctx("tokenizing")
    }
}

/// Greedy generation of up to `n` tokens, stopping at end of sequence.
fn greedy(m: &LoadedModel, ops: &dyn Ops, ids: &[u32], n: usize) -> Result<Vec<u32>, String> {
    greedy_kv(m, ops, ids, n, KvCacheDtype::Auto)
}

/// [`greedy`] with the KV cache stored as `kv`.
fn greedy_kv(m: &LoadedModel, ops: &dyn Ops, ids: &[u32], n: usize, kv: KvCacheDtype) -> Result<Vec<u32>, String> {
    let mut s = Session::with_kv_dtype(&m.model, ops, 512, BLOCK, kv).ctx("Session::with_kv_dtype")?;
    let opts =
        GenerateOptions { max_tokens: n, sampling: SamplingParams::greedy(), stop_ids: m.tokenizer.eos_ids().to_vec() };
    Ok(s.generate(ids, &opts, &mut |_| ControlFlow::Continue(())).ctx("generate")?.0)
}

/// The next-token logits after `ids`.
fn next_logits(m: &LoadedModel, ops: &dyn Ops, ids: &[u32]) -> Result<Vec<f32>, String> {
    let mut s = Session::new(&m.model, ops, 512, BLOCK).ctx("Session::new")?;
    s.append(ids).ctx("append")
}

/// Layers of the whole default model, which `fixtures/smollm2_reference.json` describes.
const SMOLLM2_LAYERS: usize = 30;

/// Largest CPU logit margin at which a CUDA run may pick another greedy token (f32: the CPU's
/// int16-activation products differ from exact f32 by up to ~0.012 on this model).
fn near_tie(dtype: DType) -> f32 {
    if dtype == DType::F32 {
        0.05
    } else {
        1.0
    }
}

#[test]
fn default_model_greedy_text_matches_cpu() {
    let test = "default_model_greedy_text_matches_cpu";
    if no_gpu(test) {
        return;
    }
    let Some(path) = default_model_file(test) else { return };
    let cpu = CpuBackend::new();
    let cm = load(&path, &cpu, "cpu").unwrap_or_else(|e| panic!("{e}"));
    let prompts = [
        ("What is the capital of France?", true),
        ("Once upon a time", false),
        ("Write a short poem about the sea.", true),
    ];
    let mut cpu_out = Vec::new();
    for &(text, chat) in &prompts {
        let ids = prompt_ids(&cm, text, chat).unwrap_or_else(|e| panic!("{e}"));
        let out = greedy(&cm, &cpu, &ids, 32).unwrap_or_else(|e| panic!("cpu {e}"));
        cpu_out.push((ids, out));
    }
    let mut report = Report::default();
    for dtype in [DType::F32, DType::BF16] {
        let head = format!("default model [{dtype}]");
        let r = guarded(&head, || {
            let gpu = cuda(dtype)?;
            let gm = load(&path, gpu.as_ref(), &format!("cuda {dtype}"))?;
            for ((ids, want), &(text, _)) in cpu_out.iter().zip(&prompts) {
                let got = greedy(&gm, gpu.as_ref(), ids, 32).map_err(|e| format!("cuda {e}"))?;
                let agree = got.iter().zip(want).take_while(|(a, b)| a == b).count();
                let shown = |t: &[u32]| gm.tokenizer.decode(t, false).unwrap_or_else(|e| format!("<{e}>"));
                let what = format!(
                    "{head} {text:?}: {agree} of {} tokens agree with the cpu\n    cuda: {:?}\n    cpu:  {:?}",
                    want.len(),
                    shown(&got),
                    shown(want)
                );
                if got == *want {
                    report.ok(&what);
                    continue;
                }
                // Where they part: how close was the CPU's choice to CUDA's?
                let prefix: Vec<u32> = ids.iter().chain(&want[..agree]).copied().collect();
                let cl = next_logits(&cm, &cpu, &prefix).map_err(|e| format!("cpu {e}"))?;
                let gl = next_logits(&gm, gpu.as_ref(), &prefix).map_err(|e| format!("cuda {e}"))?;
                // The tokens each run really picked there (the argmax of a fresh prefill when it
                // stopped instead: an end-of-sequence token).
                let c = want.get(agree).map_or_else(|| argmax(&cl), |&t| t) as usize;
                let g = got.get(agree).map_or_else(|| argmax(&gl), |&t| t) as usize;
                let margin = cl[c] - cl[g];
                let what = format!(
                    "{what}\n    first difference at token {agree}: cpu {c}, cuda {g}; the cpu's margin of {c} over {g}: {margin:.4}"
                );
                if margin <= near_tie(dtype) {
                    report.ok(&format!("{what} (a near-tie: accepted)"));
                } else {
                    report.fail(what);
                }
            }
            // Logits against transformers (fixtures/smollm2_reference.json), made from the whole
            // model: a copy cut to fewer layers (scripts/truncate_gguf.py) is checked against the
            // CPU only.
            let layers = gm.model.config.num_layers;
            if layers != SMOLLM2_LAYERS {
                println!(
                    "{head}: transformers comparison skipped: the model has {layers} layers, not {SMOLLM2_LAYERS}"
                );
                return Ok(());
            }
            let reference = read_json(&fixtures_dir().join("smollm2_reference.json"));
            let vocab = gm.model.config.vocab_size;
            for case in reference["cases"].as_array().expect("cases") {
                let ids = u32s(&case["ids"]);
                let mut s = Session::new(&gm.model, gpu.as_ref(), 512, BLOCK).ctx("Session::new")?;
                let logits = s.prompt_logits(&ids).ctx("cuda prompt_logits")?;
                let (mut worst, mut tol_at, mut ratio) = (0f32, 0f32, -1f32);
                let mut argmax_wrong = Vec::new();
                for pos in case["positions"].as_array().expect("positions") {
                    let p = pos["position"].as_u64().expect("position") as usize;
                    let row = &logits[p * vocab..(p + 1) * vocab];
                    let range = (pos["max"].as_f64().expect("max") - pos["min"].as_f64().expect("min")) as f32;
                    let tol = if dtype == DType::F32 { 2e-3 } else { 4e-2 } * range;
                    let top = u32s(&pos["top_ids"]);
                    if argmax(row) != top[0] && dtype == DType::F32 {
                        argmax_wrong.push(p);
                    }
                    for (id, want) in top.iter().zip(f32s(&pos["top_logits"])) {
                        let d = (row[*id as usize] - want).abs();
                        let r = if d.is_nan() { f32::INFINITY } else { d / tol };
                        if r > ratio {
                            (worst, tol_at, ratio) = (d, tol, r);
                        }
                    }
                }
                let what = format!(
                    "{head} {:?}: top logits vs transformers: worst |diff| {worst:.4} (tolerance there {tol_at:.4}){}",
                    case["text"].as_str().unwrap_or(""),
                    if argmax_wrong.is_empty() {
                        String::new()
                    } else {
                        format!("; argmax differs at {argmax_wrong:?}")
                    }
                );
                if ratio <= 1.0 && argmax_wrong.is_empty() {
                    report.ok(&what);
                } else {
                    report.fail(what);
                }
            }
            Ok(())
        });
        report.record(&head, r);
    }
    report.finish(test);
}

// ---------------------------------------------------------------------------------------------
// (c) The engine on CUDA.
// ---------------------------------------------------------------------------------------------

/// A request for `ids` generating exactly `n` tokens.
fn forced(ids: &[u32], n: usize, sampling: SamplingParams) -> Request {
    let mut r = Request::tokens(ids.to_vec()).with_max_tokens(n).with_sampling(sampling);
    r.ignore_eos = true;
    r
}

/// Deterministic pseudo-random prompt of `len` tokens below `vocab`.
fn random_prompt(seed: u64, len: usize, vocab: usize) -> Vec<u32> {
    let mut rng = tm_core::sampling::Rng::new(seed);
    (0..len).map(|_| (rng.next_u64() % vocab as u64) as u32).collect()
}

/// Eight concurrent greedy requests and one seeded sampled request on the `llama` fixture, the KV
/// cache stored as `kv`. f32: each greedy output equals what a CUDA `Session` produces alone;
/// bf16: the agreement is reported.
fn engine_on(dtype: DType, kv: KvCacheDtype, report: &mut Report) -> Result<(), String> {
    let head = format!("engine llama fixture [{dtype}, kv {kv}]");
    let gpu = cuda(dtype)?;
    let m = Arc::new(load(&fixtures_dir().join("llama"), gpu.as_ref(), &format!("cuda {dtype}"))?);
    let vocab = m.model.config.vocab_size;
    let prompts: Vec<Vec<u32>> = [5usize, 37, 12, 64, 3, 21, 50, 9]
        .iter()
        .enumerate()
        .map(|(i, &n)| random_prompt(i as u64, n, vocab))
        .collect();
    let config = EngineConfig {
        block_size: BLOCK,
        num_blocks: 128,
        max_batched_tokens: 48,
        max_batch_size: 8,
        max_queue: 64,
        max_model_len: None,
        enable_prefix_caching: true,
        kv_cache_dtype: kv,
    };
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let mut s = Session::with_kv_dtype(&m.model, gpu.as_ref(), 256, BLOCK, kv).ctx("Session::new")?;
            let opts = GenerateOptions { max_tokens: 12, sampling: SamplingParams::greedy(), stop_ids: Vec::new() };
            Ok(s.generate(p, &opts, &mut |_| ControlFlow::Continue(())).ctx("cuda generate")?.0)
        })
        .collect::<Result<_, String>>()?;
    let engine = Engine::start(Arc::clone(&m), Arc::clone(&gpu), config).ctx("Engine::start")?;
    let sampled = SamplingParams { temperature: 1.0, top_p: 0.9, seed: 5, ..Default::default() };
    let mut streams: Vec<_> = prompts
        .iter()
        .map(|p| engine.submit(forced(p, 12, SamplingParams::greedy())).ctx("submit"))
        .collect::<Result<_, String>>()?;
    streams.push(engine.submit(forced(&prompts[3], 12, sampled)).ctx("submit")?);
    for (i, s) in streams.into_iter().enumerate() {
        let c = s.wait();
        let what = format!("{head} request {i}");
        if c.finish_reason != FinishReason::Length || c.token_ids.len() != 12 {
            report.fail(format!(
                "{what}: finished {:?} with {} tokens (want Length, 12); error {:?}",
                c.finish_reason,
                c.token_ids.len(),
                c.error
            ));
        } else if i < alone.len() && c.token_ids != alone[i] {
            let agree = c.token_ids.iter().zip(&alone[i]).take_while(|(a, b)| a == b).count();
            let msg = format!("{what}: batched {:?} vs alone {:?} ({agree} agree)", c.token_ids, alone[i]);
            if dtype == DType::F32 {
                report.fail(msg);
            } else {
                println!("note {msg}");
            }
        } else {
            report.ok(&format!("{what}: {:?}", c.token_ids));
        }
    }
    engine.shutdown(Duration::from_secs(10)).ctx("engine shutdown")
}

/// Four concurrent chat requests on the default model (bf16), when present: all finish with text.
fn engine_default_model(path: &Path, report: &mut Report) -> Result<(), String> {
    let gpu = cuda(DType::BF16)?;
    let m = Arc::new(load(path, gpu.as_ref(), "cuda bf16")?);
    let engine =
        Engine::start(Arc::clone(&m), Arc::clone(&gpu), EngineConfig { num_blocks: 256, ..Default::default() })
            .ctx("Engine::start")?;
    let questions = ["What is the capital of France?", "Name three colors.", "What is 2 + 2?", "Say hello."];
    let streams: Vec<_> = questions
        .iter()
        .map(|q| {
            let ids = prompt_ids(&m, q, true)?;
            engine.submit(Request::tokens(ids).with_max_tokens(24)).ctx("submit")
        })
        .collect::<Result<_, String>>()?;
    for (q, s) in questions.iter().zip(streams) {
        let c = s.wait();
        let what = format!("engine default model [bf16] {q:?} → {:?} ({:?})", c.text, c.finish_reason);
        let finished = matches!(c.finish_reason, FinishReason::Length | FinishReason::Stop);
        if finished && !c.token_ids.is_empty() {
            report.ok(&what);
        } else {
            report.fail(format!("{what}; error {:?}", c.error));
        }
    }
    engine.shutdown(Duration::from_secs(10)).ctx("engine shutdown")
}

#[test]
fn engine_concurrent_requests() {
    let test = "engine_concurrent_requests";
    if no_gpu(test) {
        return;
    }
    let mut report = Report::default();
    for (dtype, kv) in [
        (DType::F32, KvCacheDtype::Auto),
        (DType::BF16, KvCacheDtype::Auto),
        (DType::F32, KvCacheDtype::Fp8),
        (DType::BF16, KvCacheDtype::Fp8),
    ] {
        let r = guarded("engine", || engine_on(dtype, kv, &mut report));
        report.record(&format!("engine llama fixture [{dtype}, kv {kv}]"), r);
    }
    if let Some(path) = default_model_file(test) {
        let r = guarded("engine", || engine_default_model(&path, &mut report));
        report.record("engine default model [bf16]", r);
    }
    report.finish(test);
}

// ---------------------------------------------------------------------------------------------
// (c') The FP8 KV cache end to end.
// ---------------------------------------------------------------------------------------------

/// With an FP8 E4M3 KV cache, the CUDA logits along every fixture prompt stay within
/// `logit_tolerance + 6%` of the range of the CPU's logits with an fp8 cache (the CPU's own
/// fp8-vs-f32 drift is up to ~5% of the range on these fixtures, and a GPU whose K/V differ in the
/// last bit rounds a few codes the other way; a broken conversion is off by tens of percent), and
/// (f32) the greedy top-1 token agrees at 90% of the positions or more.
#[test]
fn fp8_kv_cache_logits_match_cpu() {
    let test = "fp8_kv_cache_logits_match_cpu";
    if no_gpu(test) {
        return;
    }
    let mut report = Report::default();
    let cpu = CpuBackend::new();
    for (fixture, dtype) in
        [("llama", DType::F32), ("llama3_rope", DType::BF16), ("qwen2", DType::F16), ("qwen3", DType::BF16)]
    {
        let head = format!("fp8 cache {fixture} [{dtype}] vs cpu fp8");
        let r = guarded(&head, || {
            let gpu = cuda(dtype)?;
            let path = fixtures_dir().join(fixture);
            let (mg, mc) = (load(&path, gpu.as_ref(), "cuda")?, load(&path, &cpu, "cpu")?);
            let vocab = mc.model.config.vocab_size;
            let reference = read_json(&path.join("reference.json"));
            let (mut worst, mut same, mut total) = (0f32, 0usize, 0usize);
            for p in reference["prompts"].as_array().ok_or("reference.json has no prompts")? {
                let mut ids = u32s(&p["ids"]);
                ids.extend(u32s(&p["greedy_ids"]));
                let mut sg =
                    Session::with_kv_dtype(&mg.model, gpu.as_ref(), 256, BLOCK, KvCacheDtype::Fp8).ctx("session")?;
                let mut sc = Session::with_kv_dtype(&mc.model, &cpu, 256, BLOCK, KvCacheDtype::Fp8).ctx("session")?;
                let (g, c) = (sg.prompt_logits(&ids).ctx("cuda logits")?, sc.prompt_logits(&ids).ctx("cpu logits")?);
                if g.len() != c.len() {
                    return Err(format!("{} cuda logits, {} cpu", g.len(), c.len()));
                }
                let lo = c.iter().copied().fold(f32::MAX, f32::min);
                let hi = c.iter().copied().fold(f32::MIN, f32::max);
                let diff = g.iter().zip(&c).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                worst = worst.max(if diff.is_finite() { diff / (hi - lo) } else { f32::INFINITY });
                for (a, b) in g.chunks(vocab).zip(c.chunks(vocab)) {
                    total += 1;
                    same += usize::from(argmax(a) == argmax(b));
                }
            }
            let bound = logit_tolerance(dtype) + 0.06;
            println!(
                "{head}: max |cuda - cpu| {:.2}% of the range (bound {:.1}%), top-1 agrees at {same}/{total}",
                100.0 * worst,
                100.0 * bound
            );
            if worst > bound {
                return Err(format!(
                    "logits differ by {:.2}% of the range (bound {:.1}%)",
                    100.0 * worst,
                    100.0 * bound
                ));
            }
            // f32 computes K and V as the CPU does, so nearly every code and top-1 token agrees;
            // 16-bit runs round K and V first, so their agreement is reported only.
            if dtype == DType::F32 && same * 10 < total * 9 {
                return Err(format!("top-1 agrees at only {same}/{total} positions"));
            }
            Ok(())
        });
        match r {
            Ok(()) => report.ok(&head),
            Err(e) => report.fail(format!("{head}: {e}")),
        }
    }
    report.finish(test);
}

// ---------------------------------------------------------------------------------------------
// (d) CUDA graphs: replayed decode steps give what eager steps give.
// ---------------------------------------------------------------------------------------------

/// Greedy text with CUDA graphs on equals greedy text with them off (f32 and bf16), and the
/// graphs were really replayed.
#[test]
fn cuda_graphs_replay_matches_eager() {
    if no_gpu("cuda_graphs_replay_matches_eager") {
        return;
    }
    let mut report = Report::default();
    for (fixture, dtype, kv) in [
        ("llama", DType::F32, KvCacheDtype::Auto),
        ("qwen3", DType::BF16, KvCacheDtype::Auto),
        ("mistral", DType::BF16, KvCacheDtype::Auto),
        ("qwen3", DType::BF16, KvCacheDtype::Fp8),
    ] {
        let head = format!("graphs {fixture} {dtype} kv {kv}");
        let r = guarded(&head, || {
            let ordinal = std::env::var("TM_CUDA_DEVICE").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
            let graphs = CudaBackend::open(CudaOptions {
                ordinal,
                dtype,
                memory_cap: None,
                cuda_graphs: true,
                memory_model: Default::default(),
            })
            .ctx("CudaBackend::open with graphs")?;
            let eager = cuda(dtype)?;
            let path = fixtures_dir().join(fixture);
            let (m_graph, m_eager) = (load(&path, &graphs, "cuda+graphs")?, load(&path, eager.as_ref(), "cuda")?);
            let ids = prompt_ids(&m_eager, "Once upon a time there was", false)?;
            let a = greedy_kv(&m_graph, &graphs, &ids, 40, kv)?;
            let b = greedy_kv(&m_eager, eager.as_ref(), &ids, 40, kv)?;
            let (replayed, ran, captured) = graphs.graph_stats().unwrap_or_default();
            println!("{head}: {} tokens; graphs: {replayed} replayed, {ran} eager, {captured} captured", a.len());
            if a != b {
                return Err(format!("graph tokens {a:?} != eager tokens {b:?}"));
            }
            if a.len() > 4 && replayed == 0 {
                return Err(format!("no step was replayed from a graph ({ran} eager, {captured} captured)"));
            }
            Ok(())
        });
        match r {
            Ok(()) => report.ok(&head),
            Err(e) => report.fail(format!("{head}: {e}")),
        }
    }
    report.finish("cuda_graphs_replay_matches_eager");
}

// ---------------------------------------------------------------------------------------------
// (e) The AWQ and GPTQ int4 fixtures (self-contained: uses only the helpers above).
// ---------------------------------------------------------------------------------------------

/// `fixtures/llama-awq` and `fixtures/llama-gptq` on CUDA (f32, f16, bf16) against their
/// transformers references, as `tm-model/tests/hf_int4_fixtures.rs` checks them on the CPU: the
/// reference runs on the dequantized weights `(q - z) * s`, and tm holds `q * s + f16(-z * s)`,
/// whose effect on the logits the generator measured (`f16_min_logit_change`), so at every prompt
/// position the logits must be within that plus the backend's tolerance
/// ([`logit_tolerance`] of the logit range); the last position is also compared with transformers
/// run on exactly tm's weights (`last_logits_f16_min`) within the backend's tolerance alone.
/// Greedy tokens must be transformers' while its top1-top2 margin exceeds twice the tolerance
/// (f32: at least 5 steps compared, like the CPU test).
#[test]
fn int4_fixtures_awq_gptq() {
    let test = "int4_fixtures_awq_gptq";
    if no_gpu(test) {
        return;
    }
    let _serial = int4_lock();
    let mut report = Report::default();
    for name in ["llama-awq", "llama-gptq"] {
        let dir = fixtures_dir().join(name);
        let reference = read_json(&dir.join("reference.json"));
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let head = format!("{name} [{dtype}]");
            let r = guarded(&head, || int4_fixture_on(&head, &dir, &reference, dtype, &mut report));
            report.record(&head, r);
        }
    }
    report.finish(test);
}

/// The same int4 fixture checks with the large-batch slab path (`tm_core::q4_slab`: dequantize a
/// slab of rows, cuBLASLt into the output's columns) forced for every product from one token up
/// (f16 and bf16; decode steps of one token still take the int4 GEMV first), with 1 MiB slabs.
/// The slab buffer is reserved by the session's workspace, as in serving. The slab path must
/// have run.
#[test]
fn int4_fixtures_by_slabs() {
    let test = "int4_fixtures_by_slabs";
    if no_gpu(test) {
        return;
    }
    let _serial = int4_lock();
    let on = tm_core::q4_slab::SlabPolicy { enabled: true, min_tokens: 1 };
    tm_cuda::set_slab_policy(Some((on, 1 << 20)));
    let before = tm_cuda::slab_products();
    let mut report = Report::default();
    for name in ["llama-awq", "llama-gptq"] {
        let dir = fixtures_dir().join(name);
        let reference = read_json(&dir.join("reference.json"));
        for dtype in [DType::F16, DType::BF16] {
            let head = format!("{name} by slabs [{dtype}]");
            let r = guarded(&head, || int4_fixture_on(&head, &dir, &reference, dtype, &mut report));
            report.record(&head, r);
        }
    }
    let ran = tm_cuda::slab_products() - before;
    tm_cuda::set_slab_policy(None);
    if ran == 0 {
        report.fail("the slab path was forced but no product took it".into());
    } else {
        report.ok(&format!("{ran} int4 products took the slab path"));
    }
    report.finish(test);
}

/// Serializes the int4 fixture tests: `int4_fixtures_by_slabs` forces the slab policy for the
/// whole process. Run side by side on one H200 (two backends on GPU 0), both tests failed with
/// logit errors of 3-4 where each passes alone and with `--test-threads=1`; that interaction is
/// not understood yet (see the session notes), so they never overlap.
fn int4_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// The int4 fixture checks for one dtype; mismatches go to `report`, errors are returned.
fn int4_fixture_on(head: &str, dir: &Path, reference: &Value, dtype: DType, report: &mut Report) -> Result<(), String> {
    let gpu = cuda(dtype)?;
    let m = load(dir, gpu.as_ref(), &format!("cuda {dtype}"))?;
    let vocab = m.model.config.vocab_size;
    for (pi, prompt) in reference["prompts"].as_array().expect("prompts").iter().enumerate() {
        let ids = u32s(&prompt["ids"]);
        let head = format!("{head} prompt {pi} ({} tokens)", ids.len());
        let mut s = Session::new(&m.model, gpu.as_ref(), 256, BLOCK).ctx("cuda Session::new")?;
        let got = s.prompt_logits(&ids).ctx("cuda prompt_logits")?;
        let want: Vec<Vec<f32>> = prompt["logits"].as_array().expect("logits").iter().map(f32s).collect();
        if got.len() != want.len() * vocab {
            report.fail(format!("{head}: {} logits, want {} × {vocab}", got.len(), want.len()));
            continue;
        }
        let (mut lo, mut hi, mut max_diff) = (f32::MAX, f32::MIN, 0f32);
        for (p, row) in want.iter().enumerate() {
            for (t, &w) in row.iter().enumerate() {
                lo = lo.min(w);
                hi = hi.max(w);
                let d = (got[p * vocab + t] - w).abs();
                max_diff = max_diff.max(if d.is_nan() { f32::INFINITY } else { d });
            }
        }
        let backend_tol = logit_tolerance(dtype) * (hi - lo);
        let layout = prompt["f16_min_logit_change"].as_f64().expect("f16_min_logit_change") as f32;
        let tol = layout + backend_tol;
        let as_tm = f32s(&prompt["last_logits_f16_min"]);
        let last = &got[(want.len() - 1) * vocab..];
        let own = last.iter().zip(&as_tm).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        let own = if own.is_nan() { f32::INFINITY } else { own };
        let what = format!(
            "{head}: max |logit diff| vs dequantized weights {max_diff:.3e} (tolerance {tol:.3e} = layout {layout:.3e} \
             + backend {backend_tol:.3e}); last position vs tm's own weights {own:.3e} (tolerance {backend_tol:.3e})"
        );
        if max_diff <= tol && own <= backend_tol {
            report.ok(&what);
        } else {
            report.fail(what);
        }

        let want_ids = u32s(&prompt["greedy_ids"]);
        let margins = f32s(&prompt["greedy_margins"]);
        s.truncate(0);
        let mut logits = s.append(&ids).ctx("cuda append (prefill)")?;
        let mut compared = 0;
        let mut bad = None;
        for (step, &want_id) in want_ids.iter().enumerate() {
            if margins[step] <= 2.0 * tol {
                break;
            }
            let t = argmax(&logits);
            if t != want_id {
                bad = Some(format!("step {step}: cuda picks {t}, transformers {want_id} (margin {})", margins[step]));
                break;
            }
            compared += 1;
            logits = s.append(&[t]).ctx(format!("cuda append (step {step})"))?;
        }
        match bad {
            Some(b) => report.fail(format!("{head}: greedy: {b}")),
            None if dtype == DType::F32 && compared < 5 => {
                report.fail(format!("{head}: greedy: only {compared} steps compared"))
            }
            None => report.ok(&format!("{head}: greedy {compared} steps agree with transformers (until a near-tie)")),
        }
    }
    Ok(())
}
