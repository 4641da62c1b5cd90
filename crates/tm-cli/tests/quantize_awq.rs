//! `tm-cli quantize --awq` end to end: fixture models quantized, reloaded by tm's own loader
//! (the AutoAWQ GEMM reader of `tm_model::hf_quant`), and compared with the float model; and
//! the errors for inputs it cannot quantize.
//!
//! # What is compared
//! The fixtures are tiny random models (hidden 64, 2 layers, vocabulary 384), with groups of 32
//! inputs. For each prompt the float model's greedy continuation is generated, then both models
//! read prompt + continuation at once (teacher forcing) and their logits are compared at every
//! position: top-1 agreement (the quantized model picks the float model's token), and the logit
//! error relative to the float logits' range. Random models have flat logits (top-1/top-2
//! margins of a few hundredths), so int4 noise flips some near-ties; the thresholds sit under
//! the measured values with room for platform rounding, and the AWQ model must not be worse
//! than plain round-to-nearest (`--rtn`) in logit error.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use tm_core::sampling::argmax;
use tm_cpu::CpuBackend;
use tm_model::generate::Session;
use tm_model::llama::LlamaModel;
use tm_model::loader::Checkpoint;

fn tm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tm-cli")).args(args).output().unwrap()
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(name)
}

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tm-quantize-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Runs quantize on a fixture into a fresh directory; panics with stderr on failure.
/// `tag` keeps the directories of tests running at the same time apart.
fn quantize(name: &str, method: &str, tag: &str, extra: &[&str]) -> PathBuf {
    let out = tmp(&format!("{name}{method}-{tag}"));
    let (model, out_s) = (fixture(name), out.to_string_lossy().into_owned());
    let mut args = vec!["quantize", method, "--model", model.to_str().unwrap(), "--out", &out_s, "--group-size", "32"];
    args.extend_from_slice(extra);
    let r = tm(&args);
    let stderr = String::from_utf8_lossy(&r.stderr);
    assert!(r.status.success(), "quantize {name} {method} failed:\n{stderr}");
    eprintln!("{stderr}");
    out
}

fn load(dir: &Path, ops: &CpuBackend) -> LlamaModel {
    let ckpt = Checkpoint::open(dir).unwrap();
    LlamaModel::load(ops, ckpt.source.as_ref(), ckpt.config.clone(), &mut |_| {}).unwrap()
}

/// Agreement of a quantized model with the float one over the fixture's prompts.
#[derive(Debug)]
struct Agreement {
    positions: usize,
    /// Positions where both models' top token is the same.
    top1_same: usize,
    /// Worst |logit difference| over the float logits' range at that position.
    max_rel: f32,
    /// Root mean square logit difference over the float logits' standard deviation.
    rms_rel: f32,
}

fn prompts(name: &str) -> Vec<Vec<u32>> {
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(name).join("reference.json")).unwrap()).unwrap();
    let mut out: Vec<Vec<u32>> = r["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect())
        .collect();
    // Two more, built from the fixture's own first prompt shifted through the vocabulary, so
    // that the comparison does not rest on two prompts only.
    let vocab = 384;
    for k in [7u32, 101] {
        out.push(out[0].iter().map(|t| (t + k) % vocab).collect());
    }
    out
}

fn agreement(float_dir: &Path, quant_dir: &Path, name: &str, gen: usize) -> Agreement {
    let ops = CpuBackend::new();
    let (float, quant) = (load(float_dir, &ops), load(quant_dir, &ops));
    let vocab = float.config.vocab_size;
    let mut a = Agreement { positions: 0, top1_same: 0, max_rel: 0.0, rms_rel: 0.0 };
    let (mut sq, mut var) = (0f64, 0f64);
    for prompt in prompts(name) {
        let mut sf = Session::new(&float, &ops, 256, 16).unwrap();
        let mut seq = prompt.clone();
        let mut logits = sf.append(&prompt).unwrap();
        for _ in 0..gen {
            let t = argmax(&logits);
            seq.push(t);
            logits = sf.append(&[t]).unwrap();
        }
        let lf = sf.prompt_logits(&seq).unwrap();
        let mut sq_ = Session::new(&quant, &ops, 256, 16).unwrap();
        let lq = sq_.prompt_logits(&seq).unwrap();
        for (rf, rq) in lf.chunks_exact(vocab).zip(lq.chunks_exact(vocab)) {
            a.positions += 1;
            a.top1_same += usize::from(argmax(rf) == argmax(rq));
            let (lo, hi) = rf.iter().fold((f32::MAX, f32::MIN), |(l, h), v| (l.min(*v), h.max(*v)));
            let mean = rf.iter().sum::<f32>() / vocab as f32;
            let d = rf.iter().zip(rq).fold(0f32, |m, (f, q)| m.max((f - q).abs()));
            a.max_rel = a.max_rel.max(d / (hi - lo));
            sq += rf.iter().zip(rq).map(|(f, q)| ((f - q) as f64).powi(2)).sum::<f64>();
            var += rf.iter().map(|f| ((f - mean) as f64).powi(2)).sum::<f64>();
        }
    }
    a.rms_rel = (sq / var).sqrt() as f32;
    a
}

fn check_fixture(name: &str, min_top1: f64, max_rms: f32) {
    let awq = quantize(name, "--awq", "agree", &["--samples", "8", "--seq-len", "128"]);
    let rtn = quantize(name, "--rtn", "agree", &[]);
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(awq.join("config.json")).unwrap()).unwrap();
    let q = &cfg["quantization_config"];
    assert_eq!(
        (q["quant_method"].as_str(), q["bits"].as_u64(), q["group_size"].as_u64()),
        (Some("awq"), Some(4), Some(32))
    );
    assert_eq!((q["version"].as_str(), q["zero_point"].as_bool()), (Some("gemm"), Some(true)));
    assert!(awq.join("tokenizer.json").is_file());
    let ckpt = Checkpoint::open(&awq).unwrap();
    assert!(ckpt.source.contains("model.layers.1.mlp.down_proj.weight"));
    let t = ckpt.source.tensor("model.layers.0.self_attn.q_proj.weight").unwrap();
    assert_eq!(t.encoding, tm_model::weights::Encoding::Awq);

    let a = agreement(&fixture(name), &awq, name, 24);
    let r = agreement(&fixture(name), &rtn, name, 24);
    let pct = |x: &Agreement| 100.0 * x.top1_same as f64 / x.positions as f64;
    eprintln!(
        "{name}: AWQ top-1 agreement {}/{} ({:.1}%), logit error max {:.3} rms {:.4} of the float logits' range/std; \
         RTN {}/{} ({:.1}%), max {:.3} rms {:.4}",
        a.top1_same,
        a.positions,
        pct(&a),
        a.max_rel,
        a.rms_rel,
        r.top1_same,
        r.positions,
        pct(&r),
        r.max_rel,
        r.rms_rel
    );
    assert!(pct(&a) >= min_top1, "{name}: top-1 agreement {:.1}% < {min_top1}%", pct(&a));
    assert!(a.rms_rel <= max_rms, "{name}: rms logit error {} > {max_rms}", a.rms_rel);
    assert!(a.rms_rel <= r.rms_rel * 1.05, "{name}: AWQ ({}) worse than RTN ({})", a.rms_rel, r.rms_rel);
    for d in [awq, rtn] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn awq_llama_fixture_close_to_float() {
    check_fixture("llama", 55.0, 0.3);
}

#[test]
fn awq_qwen2_fixture_close_to_float() {
    // q/k/v biases (v's divided by the folded scales), tied embeddings, f16 weights, no GQA
    // scaling of o (2 kv heads for 4 heads).
    check_fixture("qwen2", 55.0, 0.3);
}

#[test]
fn awq_qwen3_fixture_close_to_float() {
    // Per-head q/k RMSNorm (copied as they are) and an explicit head_dim.
    check_fixture("qwen3", 55.0, 0.3);
}

/// Without the searches, the quantizer is AutoAWQ's `pseudo_quantize_tensor` and packing, which
/// scripts/make_quant_fixtures.py reimplements in PyTorch from AutoAWQ's sources to make
/// fixtures/llama-awq from fixtures/llama: `--rtn` must reproduce that checkpoint bit for bit
/// (every qweight, qzeros and scales word, and the f16 embeddings, norms and LM head).
#[test]
fn rtn_reproduces_the_python_packed_fixture() {
    let ours = quantize("llama", "--rtn", "bits", &[]);
    let read = |dir: &Path| std::fs::read(dir.join("model.safetensors")).unwrap();
    let (a, b) = (read(&ours), read(&fixture("llama-awq")));
    let (a, b) =
        (safetensors::SafeTensors::deserialize(&a).unwrap(), safetensors::SafeTensors::deserialize(&b).unwrap());
    let mut names = a.names();
    names.sort();
    let mut want = b.names();
    want.sort();
    assert_eq!(names, want);
    for n in names {
        let (x, y) = (a.tensor(n).unwrap(), b.tensor(n).unwrap());
        assert_eq!((x.dtype(), x.shape()), (y.dtype(), y.shape()), "{n}");
        let differ = x.data().iter().zip(y.data()).filter(|(p, q)| p != q).count();
        assert_eq!(differ, 0, "{n}: {differ} of {} bytes differ", x.data().len());
    }
    let _ = std::fs::remove_dir_all(ours);
}

fn expect_error(args: &[&str], needles: &[&str]) {
    let r = tm(args);
    let stderr = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success(), "{args:?} succeeded");
    for n in needles {
        assert!(stderr.contains(n), "{n:?} missing from: {stderr}");
    }
}

#[test]
fn bad_inputs_are_clear_errors() {
    let llama = fixture("llama");
    let llama = llama.to_str().unwrap();
    let out = tmp("err");
    let out_s = out.to_str().unwrap();
    // Group size not dividing hidden_size 64.
    expect_error(
        &["quantize", "--awq", "--model", llama, "--out", out_s],
        &["--group-size 128", "hidden_size of 64", "--group-size 64"],
    );
    expect_error(&["quantize", "--awq", "--model", llama, "--out", out_s, "--group-size", "48"], &["multiple of 32"]);
    // Missing calibration file.
    expect_error(
        &[
            "quantize",
            "--awq",
            "--model",
            llama,
            "--out",
            out_s,
            "--group-size",
            "32",
            "--calib",
            "/nonexistent/calib.txt",
        ],
        &["--calib /nonexistent/calib.txt"],
    );
    // Already quantized.
    let awq = fixture("llama-awq");
    expect_error(
        &["quantize", "--awq", "--model", awq.to_str().unwrap(), "--out", out_s, "--group-size", "32"],
        &["already quantized", "AWQ"],
    );
    // Unknown architecture.
    let odd = tmp("arch");
    std::fs::create_dir_all(&odd).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("llama").join("config.json")).unwrap()).unwrap();
    cfg["architectures"] = serde_json::json!(["GPT2LMHeadModel"]);
    std::fs::write(odd.join("config.json"), cfg.to_string()).unwrap();
    expect_error(
        &["quantize", "--awq", "--model", odd.to_str().unwrap(), "--out", out_s, "--group-size", "32"],
        &["GPT2LMHeadModel"],
    );
    // InternLM2 is known to tm but not to quantize.
    let internlm = fixture("internlm2");
    expect_error(
        &["quantize", "--awq", "--model", internlm.to_str().unwrap(), "--out", out_s, "--group-size", "32"],
        &["InternLM2", "quantize supports"],
    );
    // No method, and an output that would be overwritten.
    expect_error(&["quantize", "--model", llama, "--out", out_s], &["--awq"]);
    expect_error(
        &["quantize", "--awq", "--model", llama, "--out", odd.to_str().unwrap(), "--group-size", "32"],
        &["not empty"],
    );
    assert!(!out.exists(), "a failed run left {out_s} behind");
    let _ = std::fs::remove_dir_all(odd);
}
