//! A GGUF file as a [`TensorSource`] with Hugging Face tensor names, and its model config.
//!
//! GGUF names map onto Hugging Face ones (`blk.N.attn_q.weight` → `model.layers.N.self_attn.q_proj.weight`,
//! `token_embd` → `model.embed_tokens`, `output_norm` → `model.norm`, `output` → `lm_head`, ...).
//! llama.cpp's converter permutes the rows of `attn_q`/`attn_k` of llama-architecture models so
//! that rotating interleaved pairs `(2i, 2i+1)` equals Hugging Face's rotate-half on the original
//! rows; tm keeps the stored rows and uses [`RopeStyle::Interleaved`] for those models.

use crate::config::{Arch, ModelConfig};
use crate::error::{ModelError, Result};
use crate::gguf::{GgmlType, GgufFile};
use crate::weights::{Encoding, TensorRef, TensorSource};
use std::path::Path;
use tm_core::rope::{RopeConfig, RopeScaling, RopeStyle};

/// A GGUF file whose tensors are looked up by Hugging Face names.
pub struct GgufSource {
    file: GgufFile,
}

fn gguf_name(hf: &str) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, name) = rest.split_once('.')?;
    let mapped = match name {
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.q_proj.bias" => "attn_q.bias",
        "self_attn.k_proj.bias" => "attn_k.bias",
        "self_attn.v_proj.bias" => "attn_v.bias",
        "self_attn.q_norm.weight" => "attn_q_norm.weight",
        "self_attn.k_norm.weight" => "attn_k_norm.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        _ => return None,
    };
    Some(format!("blk.{layer}.{mapped}"))
}

impl GgufSource {
    /// Opens (memory-maps) a GGUF file.
    pub fn open(path: &Path) -> Result<Self> {
        Ok(GgufSource { file: GgufFile::open(path)? })
    }

    /// The parsed file.
    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    /// The model config from the file's metadata.
    pub fn config(&self) -> Result<ModelConfig> {
        let f = &self.file;
        let arch_name = f.architecture()?.to_string();
        let (arch, style) = match arch_name.as_str() {
            "llama" => (Arch::Llama, RopeStyle::Interleaved),
            "mistral" => (Arch::Mistral, RopeStyle::Interleaved),
            "qwen2" => (Arch::Qwen2, RopeStyle::Half),
            "qwen3" => (Arch::Qwen3, RopeStyle::Half),
            other => {
                return Err(ModelError::UnknownArchitecture {
                    arch: other.into(),
                    path: f.path().to_path_buf(),
                    supported: "llama, mistral, qwen2, qwen3 (GGUF)".into(),
                })
            }
        };
        let key = |s: &str| format!("{arch_name}.{s}");
        let u = |s: &str| f.get_u32(&key(s)).map(|v| v as usize);
        let opt_u = |s: &str| f.get_opt::<u32>(&key(s)).ok().flatten().map(|v| v as usize);
        let hidden_size = u("embedding_length")?;
        let num_heads = u("attention.head_count")?;
        let num_kv_heads = opt_u("attention.head_count_kv").unwrap_or(num_heads);
        let head_dim = opt_u("attention.key_length").unwrap_or(hidden_size / num_heads.max(1));
        let max_pos = opt_u("context_length").unwrap_or(4096);
        let vocab_size = match opt_u("vocab_size") {
            Some(v) => v,
            None => f.get_str_array("tokenizer.ggml.tokens")?.len(),
        };
        let base = f.get_opt::<f32>(&key("rope.freq_base")).ok().flatten().unwrap_or(10000.0) as f64;
        let scaling_type = f.get_str_opt(&key("rope.scaling.type"))?.unwrap_or("none").to_string();
        let factor = f.get_opt::<f32>(&key("rope.scaling.factor")).ok().flatten().unwrap_or(1.0) as f64;
        let scaling = match scaling_type.as_str() {
            "none" => RopeScaling::None,
            "linear" => RopeScaling::Linear { factor },
            other => {
                return Err(ModelError::Config {
                    path: f.path().to_path_buf(),
                    field: key("rope.scaling.type"),
                    message: format!("`{other}` is not supported for GGUF models yet"),
                })
            }
        };
        let rope = RopeConfig { dim: head_dim, base, scaling, style };
        let cfg = ModelConfig {
            arch,
            hidden_size,
            intermediate_size: u("feed_forward_length")?,
            num_layers: u("block_count")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            rms_norm_eps: f.get_f32(&key("attention.layer_norm_rms_epsilon")).unwrap_or(1e-5),
            rope,
            max_position_embeddings: max_pos,
            tie_word_embeddings: f.tensor_info("output.weight").is_none(),
            qkv_bias: f.tensor_info("blk.0.attn_q.bias").is_some(),
            qk_norm: f.tensor_info("blk.0.attn_q_norm.weight").is_some(),
            sliding_window: None,
        };
        if cfg.num_heads == 0 || cfg.num_kv_heads == 0 || !cfg.num_heads.is_multiple_of(cfg.num_kv_heads) {
            return Err(ModelError::format(f.path(), "head counts in the metadata cannot be grouped"));
        }
        if let Some((field, why)) = cfg.implausible_field() {
            let gguf_key = match field {
                "hidden_size" => "embedding_length",
                "intermediate_size" => "feed_forward_length",
                "num_hidden_layers" => "block_count",
                "vocab_size" => "vocab_size (or the tokenizer's tokens)",
                "max_position_embeddings" => "context_length",
                "head_dim" => "attention.key_length (or embedding_length / attention.head_count)",
                _ => "attention.layer_norm_rms_epsilon",
            };
            return Err(ModelError::Config { path: f.path().to_path_buf(), field: key(gguf_key), message: why });
        }
        // tm rotates whole heads; a model rotating part of each head would run, wrongly.
        if let Some(d) = opt_u("rope.dimension_count").filter(|&d| d != head_dim) {
            return Err(ModelError::Config {
                path: f.path().to_path_buf(),
                field: key("rope.dimension_count"),
                message: format!("{d} rotary dimensions of {head_dim}-element heads: partial rotary is not supported"),
            });
        }
        cfg.rope.validate()?;
        Ok(cfg)
    }
}

impl TensorSource for GgufSource {
    fn tensor(&self, name: &str) -> Result<TensorRef<'_>> {
        let missing = || ModelError::MissingTensor { name: name.into(), path: self.file.path().to_path_buf() };
        let gname = gguf_name(name).ok_or_else(missing)?;
        let info = self.file.tensor_info(&gname).ok_or_else(|| ModelError::MissingTensor {
            name: format!("{gname} (for {name})"),
            path: self.file.path().to_path_buf(),
        })?;
        let encoding = match info.ggml_type() {
            GgmlType::Q4_0 => Encoding::Q4_0,
            GgmlType::Q4_1 => Encoding::Q4_1,
            GgmlType::Q8_0 => Encoding::Q8_0,
            t => match t.dtype() {
                Some(d) => Encoding::Plain(d),
                None => {
                    return Err(ModelError::format(
                        self.file.path(),
                        format!("tensor `{gname}` has type {t:?}, which tm cannot load (F32, F16, BF16, Q4_0, Q4_1, Q8_0 are supported)"),
                    ))
                }
            },
        };
        Ok(TensorRef {
            name: gname.clone(),
            encoding,
            shape: info.shape(),
            bytes: self.file.tensor_data(&gname)?,
            file: self.file.path(),
            parts: None,
        })
    }
    fn contains(&self, name: &str) -> bool {
        gguf_name(name).is_some_and(|g| self.file.tensor_info(&g).is_some())
    }
    fn location(&self) -> &Path {
        self.file.path()
    }
    fn total_bytes(&self) -> u64 {
        self.file.tensors().iter().map(|t| t.byte_size() as u64).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::gguf_name;

    #[test]
    fn names_map_to_gguf() {
        assert_eq!(gguf_name("model.layers.3.self_attn.q_proj.weight").as_deref(), Some("blk.3.attn_q.weight"));
        assert_eq!(gguf_name("lm_head.weight").as_deref(), Some("output.weight"));
        assert_eq!(gguf_name("model.layers.0.mlp.down_proj.weight").as_deref(), Some("blk.0.ffn_down.weight"));
        assert_eq!(gguf_name("nonsense"), None);
    }
}
