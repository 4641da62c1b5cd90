//! tm's CPU logits and greedy continuations against Hugging Face transformers, for tiny
//! random-weight checkpoints of every supported architecture (made by scripts/make_fixtures.py).

use serde_json::Value;
use std::path::{Path, PathBuf};
use tm_core::sampling::argmax;
use tm_cpu::CpuBackend;
use tm_model::config::ModelConfig;
use tm_model::generate::Session;
use tm_model::llama::LlamaModel;
use tm_model::weights::SafetensorsCheckpoint;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(name)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

fn check_fixture(name: &str) {
    let dir = fixture(name);
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let ops = CpuBackend::new();
    let ckpt = SafetensorsCheckpoint::open(&dir).unwrap();
    let model = LlamaModel::load(&ops, &ckpt, cfg, &mut |_| {}).unwrap();
    let vocab = model.config.vocab_size;
    for prompt in reference["prompts"].as_array().unwrap() {
        let prompt_ids = ids(&prompt["ids"]);
        let mut session = Session::new(&model, &ops, 256, 4).unwrap();
        // Logits at every prompt position.
        let got = session.prompt_logits(&prompt_ids).unwrap();
        let want: Vec<Vec<f32>> = prompt["logits"].as_array().unwrap().iter().map(floats).collect();
        assert_eq!(got.len(), want.len() * vocab);
        let (mut lo, mut hi, mut max_diff) = (f32::MAX, f32::MIN, 0f32);
        for (pos, row) in want.iter().enumerate() {
            for (j, &w) in row.iter().enumerate() {
                lo = lo.min(w);
                hi = hi.max(w);
                max_diff = max_diff.max((got[pos * vocab + j] - w).abs());
            }
        }
        let tol = 1e-3 * (hi - lo);
        assert!(max_diff <= tol, "{name}: max |logit diff| {max_diff} > {tol} (1e-3 of the range)");

        // Greedy continuation, token by token, through the KV cache.
        let want_ids = ids(&prompt["greedy_ids"]);
        let want_top = floats(&prompt["greedy_top_logits"]);
        session.truncate(0);
        let mut logits = session.append(&prompt_ids).unwrap();
        let mut got_ids = Vec::new();
        for (step, &top) in want_top.iter().enumerate() {
            let t = argmax(&logits);
            got_ids.push(t);
            assert!(
                (logits[t as usize] - top).abs() <= tol.max(1e-4),
                "{name}: step {step}: top logit {} vs transformers {top}",
                logits[t as usize]
            );
            if step + 1 < want_top.len() {
                logits = session.append(&[t]).unwrap();
            }
        }
        assert_eq!(got_ids, want_ids, "{name}: greedy continuation differs");
    }
}

#[test]
fn llama_sharded_f32() {
    check_fixture("llama");
}

#[test]
fn llama3_rope_scaling_bf16() {
    check_fixture("llama3_rope");
}

#[test]
fn linear_rope_scaling() {
    check_fixture("llama_linear_rope");
}

#[test]
fn dynamic_rope_scaling() {
    check_fixture("llama_dynamic_rope");
}

#[test]
fn yarn_rope_scaling() {
    check_fixture("llama_yarn_rope");
}

#[test]
fn mistral() {
    check_fixture("mistral");
}

#[test]
fn qwen2_bias_tied_f16() {
    check_fixture("qwen2");
}

#[test]
fn qwen3_qk_norm() {
    check_fixture("qwen3");
}

#[test]
fn internlm2_packed_wqkv_gives_llama_logits() {
    check_fixture("internlm2");
}

#[test]
fn missing_tensor_is_named() {
    let dir = fixture("llama");
    let mut cfg = ModelConfig::from_dir(&dir).unwrap();
    cfg.num_layers = 3; // the checkpoint has 2
    let ckpt = SafetensorsCheckpoint::open(&dir).unwrap();
    let err = LlamaModel::load(&CpuBackend::new(), &ckpt, cfg, &mut |_| {}).unwrap_err().to_string();
    assert!(err.contains("model.layers.2.self_attn.q_proj.weight"), "{err}");
}

#[test]
fn wrong_shape_is_named() {
    let dir = fixture("llama");
    let mut cfg = ModelConfig::from_dir(&dir).unwrap();
    cfg.intermediate_size += 1;
    let ckpt = SafetensorsCheckpoint::open(&dir).unwrap();
    let err = LlamaModel::load(&CpuBackend::new(), &ckpt, cfg, &mut |_| {}).unwrap_err().to_string();
    assert!(err.contains("mlp.gate_proj.weight") && err.contains("safetensors"), "{err}");
}

#[test]
fn truncated_safetensors_is_an_error() {
    let src = fixture("qwen3").join("model.safetensors");
    let tmp = std::env::temp_dir().join(format!("tm-trunc-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let bytes = std::fs::read(&src).unwrap();
    std::fs::write(tmp.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    let err = SafetensorsCheckpoint::open(&tmp).err().expect("truncated file must fail").to_string();
    assert!(err.contains("model.safetensors") && err.contains("the file is truncated"), "{err}");
    std::fs::remove_dir_all(&tmp).ok();
}
