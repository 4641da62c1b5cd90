//! A tiny Llama with enough heads for 8 tensor-parallel ranks, for the tp tests: hidden 64,
//! 8 query heads of 8, 2 layers, MLP width 128, f32 weights filled with fixed pseudo-random
//! values (the same bytes on every run). The fixtures have only 4 heads, so tp=8 needs this.
//!
//! Uses `plan_common`'s checkpoint writer: declare `mod plan_common;` next to `mod tp_common;`.

#![allow(dead_code)]

use crate::plan_common::{temp_dir, write_checkpoint, Spec};
use std::path::{Path, PathBuf};

/// Hidden size of the eight-head model.
pub const HIDDEN: usize = 64;
/// Query heads.
pub const HEADS: usize = 8;
/// Width of a head.
pub const HEAD_DIM: usize = HIDDEN / HEADS;
/// MLP width (divides by 8).
pub const INTER: usize = 128;
/// Decoder layers.
pub const LAYERS: usize = 2;

/// The shape of one eight-head checkpoint.
#[derive(Clone, Copy, Debug)]
pub struct EightHeads {
    /// KV heads: 2 (each replicated on 4 ranks at tp=8) or 8 (one per rank at tp=8).
    pub kv_heads: usize,
    /// Vocabulary: divisible by the world for a vocab-parallel embedding and LM head, or not
    /// (they are then replicated).
    pub vocab: usize,
    /// Whether the LM head is the embedding (no `lm_head.weight` in the checkpoint).
    pub tied: bool,
}

fn config(m: EightHeads) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": m.kv_heads,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": LAYERS,
        "vocab_size": m.vocab,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": m.tied,
        "bos_token_id": 377,
        "eos_token_id": [381, 378],
        "torch_dtype": "float32"
    })
}

fn tensors(m: EightHeads) -> Vec<Spec> {
    let kv = m.kv_heads * HEAD_DIM;
    let mut t: Vec<Spec> = vec![
        ("model.embed_tokens.weight".into(), "F32", vec![m.vocab, HIDDEN]),
        ("model.norm.weight".into(), "F32", vec![HIDDEN]),
    ];
    if !m.tied {
        t.push(("lm_head.weight".into(), "F32", vec![m.vocab, HIDDEN]));
    }
    for i in 0..LAYERS {
        let p = format!("model.layers.{i}");
        for (name, shape) in [
            ("input_layernorm.weight", vec![HIDDEN]),
            ("post_attention_layernorm.weight", vec![HIDDEN]),
            ("self_attn.q_proj.weight", vec![HEADS * HEAD_DIM, HIDDEN]),
            ("self_attn.k_proj.weight", vec![kv, HIDDEN]),
            ("self_attn.v_proj.weight", vec![kv, HIDDEN]),
            ("self_attn.o_proj.weight", vec![HIDDEN, HEADS * HEAD_DIM]),
            ("mlp.gate_proj.weight", vec![INTER, HIDDEN]),
            ("mlp.up_proj.weight", vec![INTER, HIDDEN]),
            ("mlp.down_proj.weight", vec![HIDDEN, INTER]),
        ] {
            t.push((format!("{p}.{name}"), "F32", shape));
        }
    }
    t
}

/// A checkpoint directory made by [`write_eight_heads`], removed when dropped (a failing test
/// included).
pub struct TempCheckpoint(PathBuf);

impl TempCheckpoint {
    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempCheckpoint {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

/// Writes the checkpoint (config.json, model.safetensors, and the llama fixture's tokenizer,
/// whose 384 ids fit a vocabulary of 384) into a fresh temp directory named after `tag`, which
/// must be unique among the tests running at once.
pub fn write_eight_heads(tag: &str, m: EightHeads) -> TempCheckpoint {
    let dir = TempCheckpoint(temp_dir(&format!("tp8-{tag}")));
    write_checkpoint(dir.path(), &config(m), &tensors(m), true);
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/llama");
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture.join(file), dir.path().join(file)).unwrap();
    }
    dir
}
