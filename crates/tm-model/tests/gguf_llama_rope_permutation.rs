//! llama-architecture GGUF files store `attn_q`/`attn_k` with each head's rows permuted (as
//! llama.cpp's converter does) so that interleaved RoPE applies. tm keeps those rows and rotates
//! interleaved pairs. This test writes the Llama fixture as such a GGUF and checks that tm gives
//! transformers' logits — and that without the permutation it would not.

use serde_json::Value;
use std::path::Path;
use tm_cpu::CpuBackend;
use tm_model::generate::Session;
use tm_model::gguf::writer::GgufWriter;
use tm_model::gguf::GgufValue;
use tm_model::llama::LlamaModel;
use tm_model::loader::GgufSource;
use tm_model::weights::{SafetensorsCheckpoint, TensorSource};

/// llama.cpp's converter: per head, row `2i` ← row `i`, row `2i+1` ← row `i + head_dim/2`.
fn permute_rows(w: &[f32], rows: usize, cols: usize, heads: usize) -> Vec<f32> {
    let hd = rows / heads;
    let mut out = vec![0f32; w.len()];
    for h in 0..heads {
        for i in 0..hd / 2 {
            for (dst, src) in [(2 * i, i), (2 * i + 1, i + hd / 2)] {
                let (d, s) = ((h * hd + dst) * cols, (h * hd + src) * cols);
                out[d..d + cols].copy_from_slice(&w[s..s + cols]);
            }
        }
    }
    out
}

fn gguf_name(hf: &str) -> String {
    let pairs = [
        ("model.embed_tokens", "token_embd"),
        ("model.norm", "output_norm"),
        ("lm_head", "output"),
        ("input_layernorm", "attn_norm"),
        ("post_attention_layernorm", "ffn_norm"),
        ("self_attn.q_proj", "attn_q"),
        ("self_attn.k_proj", "attn_k"),
        ("self_attn.v_proj", "attn_v"),
        ("self_attn.o_proj", "attn_output"),
        ("mlp.gate_proj", "ffn_gate"),
        ("mlp.up_proj", "ffn_up"),
        ("mlp.down_proj", "ffn_down"),
        ("model.layers.", "blk."),
    ];
    pairs.iter().fold(hf.to_string(), |s, (a, b)| s.replace(a, b))
}

fn write_gguf(dir: &Path, out: &Path, permute: bool) {
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let ckpt = SafetensorsCheckpoint::open(dir).unwrap();
    let (heads, kv_heads) =
        (cfg["num_attention_heads"].as_u64().unwrap(), cfg["num_key_value_heads"].as_u64().unwrap());
    let mut w = GgufWriter::new();
    let u = |v: &Value| GgufValue::U32(v.as_u64().unwrap() as u32);
    w.add_metadata("general.architecture", GgufValue::String("llama".into()))
        .add_metadata("llama.block_count", u(&cfg["num_hidden_layers"]))
        .add_metadata("llama.embedding_length", u(&cfg["hidden_size"]))
        .add_metadata("llama.feed_forward_length", u(&cfg["intermediate_size"]))
        .add_metadata("llama.attention.head_count", GgufValue::U32(heads as u32))
        .add_metadata("llama.attention.head_count_kv", GgufValue::U32(kv_heads as u32))
        .add_metadata("llama.context_length", u(&cfg["max_position_embeddings"]))
        .add_metadata("llama.vocab_size", u(&cfg["vocab_size"]))
        .add_metadata("llama.rope.freq_base", GgufValue::F32(cfg["rope_theta"].as_f64().unwrap() as f32))
        .add_metadata(
            "llama.attention.layer_norm_rms_epsilon",
            GgufValue::F32(cfg["rms_norm_eps"].as_f64().unwrap() as f32),
        );
    let mut names: Vec<String> = ckpt.names().map(String::from).collect();
    names.sort();
    for name in names {
        let t = ckpt.tensor(&name).unwrap();
        let mut vals: Vec<f32> = bytemuck::pod_collect_to_vec(t.bytes);
        let dims: Vec<u64> = t.shape.iter().rev().map(|&d| d as u64).collect();
        if permute && (name.contains("q_proj") || name.contains("k_proj")) {
            let h = if name.contains("q_proj") { heads } else { kv_heads } as usize;
            vals = permute_rows(&vals, t.shape[0], t.shape[1], h);
        }
        w.add_f32_tensor(gguf_name(&name), &dims, &vals);
    }
    w.write_to(out).unwrap();
}

fn max_logit_error(permute: bool) -> (f32, f32) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/llama");
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let out = std::env::temp_dir().join(format!("tm-llama-permuted-{permute}-{}.gguf", std::process::id()));
    write_gguf(&dir, &out, permute);
    let src = GgufSource::open(&out).unwrap();
    let ops = CpuBackend::new();
    let model = LlamaModel::load(&ops, &src, src.config().unwrap(), &mut |_| {}).unwrap();
    let prompt = &reference["prompts"][0];
    let ids: Vec<u32> = prompt["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let got = Session::new(&model, &ops, 64, 4).unwrap().prompt_logits(&ids).unwrap();
    let want: Vec<f32> = prompt["logits"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32))
        .collect();
    std::fs::remove_file(&out).ok();
    let range = want.iter().cloned().fold(f32::MIN, f32::max) - want.iter().cloned().fold(f32::MAX, f32::min);
    (got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max), range)
}

#[test]
fn permuted_gguf_with_interleaved_rope_gives_transformers_logits() {
    let (err, range) = max_logit_error(true);
    assert!(err <= 1e-3 * range, "max error {err} (range {range})");
}

#[test]
fn unpermuted_rows_would_be_wrong() {
    let (err, range) = max_logit_error(false);
    assert!(err > 1e-2 * range, "the permutation should matter: error {err} (range {range})");
}
