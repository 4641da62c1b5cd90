//! Model hyper-parameters, from a Hugging Face `config.json` (or built from GGUF metadata).
//!
//! Both config layouts are read: the classic `rope_theta` + `rope_scaling` and the newer
//! `rope_parameters` object written by transformers 5.

use crate::error::{ModelError, Result};
use serde_json::Value;
use std::path::Path;
use tm_core::rope::{RopeConfig, RopeScaling, RopeStyle};

/// The model families tm runs, all on the Llama graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// `LlamaForCausalLM` (Llama 2 and 3).
    Llama,
    /// `MistralForCausalLM` (optional sliding window).
    Mistral,
    /// `Qwen2ForCausalLM` (q/k/v bias).
    Qwen2,
    /// `Qwen3ForCausalLM` (per-head q/k RMSNorm).
    Qwen3,
    /// `InternLM2ForCausalLM` (packed `wqkv`, mapped onto the Llama graph).
    InternLM2,
}

/// Architectures accepted in `config.json`, for error messages.
pub const SUPPORTED_ARCHITECTURES: &str =
    "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, InternLM2ForCausalLM";

impl Arch {
    /// Parses an `architectures` entry.
    pub fn from_hf(name: &str) -> Option<Arch> {
        Some(match name {
            "LlamaForCausalLM" => Arch::Llama,
            "MistralForCausalLM" => Arch::Mistral,
            "Qwen2ForCausalLM" => Arch::Qwen2,
            "Qwen3ForCausalLM" => Arch::Qwen3,
            "InternLM2ForCausalLM" => Arch::InternLM2,
            _ => return None,
        })
    }
}

/// Everything the graph needs to know about a model's shape.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Model family.
    pub arch: Arch,
    /// Residual stream width.
    pub hidden_size: usize,
    /// MLP inner width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (GQA when fewer than query heads).
    pub num_kv_heads: usize,
    /// Features per head.
    pub head_dim: usize,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// Rotary embedding.
    pub rope: RopeConfig,
    /// Longest context the model supports.
    pub max_position_embeddings: usize,
    /// Whether the LM head reuses the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Whether q/k/v projections have biases.
    pub qkv_bias: bool,
    /// Whether q and k get a per-head RMSNorm before RoPE.
    pub qk_norm: bool,
    /// Sliding attention window, if any.
    pub sliding_window: Option<usize>,
}

impl ModelConfig {
    /// Reads `config.json` from a model directory.
    pub fn from_dir(dir: &Path) -> Result<ModelConfig> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        let json: Value =
            serde_json::from_str(&text).map_err(|e| ModelError::format(&path, format!("invalid JSON: {e}")))?;
        Self::from_json(&json, &path)
    }

    /// Builds the config from parsed `config.json`; `path` is named in errors.
    pub fn from_json(j: &Value, path: &Path) -> Result<ModelConfig> {
        let field_err = |field: &str, message: &str| ModelError::Config {
            path: path.to_path_buf(),
            field: field.into(),
            message: message.into(),
        };
        let arch_name = j
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .ok_or_else(|| field_err("architectures", "missing"))?;
        let arch = Arch::from_hf(arch_name).ok_or_else(|| ModelError::UnknownArchitecture {
            arch: arch_name.into(),
            path: path.to_path_buf(),
            supported: SUPPORTED_ARCHITECTURES.into(),
        })?;
        let usize_field = |name: &str| -> Result<usize> {
            j.get(name)
                .and_then(Value::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| field_err(name, "missing or not a non-negative integer"))
        };
        let opt_usize = |name: &str| j.get(name).and_then(Value::as_u64).map(|v| v as usize);
        let hidden_size = usize_field("hidden_size")?;
        let num_heads = usize_field("num_attention_heads")?;
        let num_kv_heads = opt_usize("num_key_value_heads").unwrap_or(num_heads);
        if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(field_err(
                "num_key_value_heads",
                &format!("{num_heads} heads cannot be grouped onto {num_kv_heads} kv heads"),
            ));
        }
        let head_dim = match opt_usize("head_dim") {
            Some(d) => d,
            None if hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => {
                return Err(field_err("head_dim", "missing and hidden_size is not divisible by num_attention_heads"))
            }
        };
        let max_position_embeddings = opt_usize("max_position_embeddings").unwrap_or(4096);
        let rope = parse_rope(j, head_dim, max_position_embeddings).map_err(|m| field_err("rope_scaling", &m))?;
        let flag = |name: &str| j.get(name).and_then(Value::as_bool);
        if flag("mlp_bias") == Some(true) {
            return Err(field_err("mlp_bias", "MLP biases are not supported"));
        }
        let qkv_bias = match arch {
            Arch::Qwen2 => true,
            Arch::InternLM2 => flag("bias").unwrap_or(false),
            _ => flag("attention_bias").unwrap_or(false),
        };
        if arch == Arch::InternLM2 && qkv_bias {
            return Err(field_err("bias", "InternLM2 with biases is not supported"));
        }
        let sliding_window = match arch {
            Arch::Mistral => opt_usize("sliding_window"),
            Arch::Qwen2 | Arch::Qwen3 if flag("use_sliding_window") == Some(true) => opt_usize("sliding_window"),
            _ => None,
        };
        if sliding_window == Some(0) {
            return Err(field_err("sliding_window", "0 is no window: leave it out or null for full attention"));
        }
        let cfg = ModelConfig {
            arch,
            hidden_size,
            intermediate_size: usize_field("intermediate_size")?,
            num_layers: usize_field("num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: usize_field("vocab_size")?,
            rms_norm_eps: j.get("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-6) as f32,
            rope,
            max_position_embeddings,
            tie_word_embeddings: flag("tie_word_embeddings").unwrap_or(false),
            qkv_bias,
            qk_norm: arch == Arch::Qwen3,
            sliding_window,
        };
        // Before the rotary settings, whose check would blame `rope_scaling` for a bad head_dim.
        if let Some((field, why)) = cfg.implausible_field() {
            return Err(field_err(field, &why));
        }
        cfg.rope.validate().map_err(|e| field_err("rope_scaling", &e.to_string()))?;
        Ok(cfg)
    }

    /// The first size or constant no model can run with, as (its Hugging Face config field, why),
    /// or `None`; both checkpoint formats check it (GGUF naming its own keys).
    pub fn implausible_field(&self) -> Option<(&'static str, String)> {
        let sizes = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_layers),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        if let Some((field, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return Some((field, "must be positive".into()));
        }
        if let Some(why) = bad_head_dim(self.head_dim) {
            return Some(("head_dim", why));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            return Some(("rms_norm_eps", format!("{} is not a finite non-negative number", self.rms_norm_eps)));
        }
        None
    }

    /// Longest sequence the model handles: `max_position_embeddings`, times the factor for
    /// dynamic NTK scaling (whose config keeps the original length).
    pub fn context_length(&self) -> usize {
        match self.rope.scaling {
            RopeScaling::Dynamic { factor, .. } => (self.max_position_embeddings as f64 * factor) as usize,
            _ => self.max_position_embeddings,
        }
    }

    /// Width of the q projection.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }
    /// Width of the k and v projections.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

fn parse_rope(j: &Value, head_dim: usize, max_pos: usize) -> std::result::Result<RopeConfig, String> {
    let params = j.get("rope_parameters").filter(|v| v.is_object());
    let scaling = j.get("rope_scaling").filter(|v| v.is_object()).or(params);
    let base = j
        .get("rope_theta")
        .and_then(Value::as_f64)
        .or_else(|| params.and_then(|p| p.get("rope_theta")).and_then(Value::as_f64))
        .unwrap_or(10000.0);
    let f = |key: &str| scaling.and_then(|s| s.get(key)).and_then(Value::as_f64);
    let kind =
        scaling.and_then(|s| s.get("rope_type").or_else(|| s.get("type"))).and_then(Value::as_str).unwrap_or("default");
    let factor = || f("factor").ok_or_else(|| format!("rope type `{kind}` needs `factor`"));
    let original = |default: usize| f("original_max_position_embeddings").map_or(default, |v| v as usize);
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: factor()? },
        "dynamic" => RopeScaling::Dynamic { factor: factor()?, original_max: max_pos },
        "llama3" => RopeScaling::Llama3 {
            factor: factor()?,
            low_freq_factor: f("low_freq_factor").unwrap_or(1.0),
            high_freq_factor: f("high_freq_factor").unwrap_or(4.0),
            original_max: f("original_max_position_embeddings")
                .ok_or("llama3 rope needs `original_max_position_embeddings`")? as usize,
        },
        "yarn" => {
            let original_max = original(max_pos);
            RopeScaling::Yarn {
                factor: f("factor").unwrap_or(max_pos as f64 / original_max as f64),
                original_max,
                beta_fast: f("beta_fast").filter(|v| *v != 0.0).unwrap_or(32.0),
                beta_slow: f("beta_slow").filter(|v| *v != 0.0).unwrap_or(1.0),
                attention_factor: f("attention_factor"),
                mscale: f("mscale"),
                mscale_all_dim: f("mscale_all_dim"),
                truncate: scaling.and_then(|s| s.get("truncate")).and_then(Value::as_bool).unwrap_or(true),
            }
        }
        other => {
            return Err(format!("rope type `{other}` is not supported (default, linear, dynamic, llama3, yarn are)"))
        }
    };
    let dim = match f("partial_rotary_factor") {
        Some(p) if p != 1.0 => return Err(format!("partial_rotary_factor {p} is not supported")),
        _ => head_dim,
    };
    Ok(RopeConfig { dim, base, scaling, style: RopeStyle::Half })
}

/// Why `head_dim` cannot be a head's size (zero or odd: rotary embeddings pair its elements).
fn bad_head_dim(head_dim: usize) -> Option<String> {
    (head_dim == 0 || !head_dim.is_multiple_of(2)).then(|| format!("{head_dim} must be even and positive"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 10})
    }

    #[test]
    fn unknown_architecture_names_it() {
        let mut j = base();
        j["architectures"] = json!(["GPTNeoXForCausalLM"]);
        let e = ModelConfig::from_json(&j, Path::new("x/config.json")).unwrap_err().to_string();
        assert!(e.contains("GPTNeoXForCausalLM") && e.contains("x/config.json"), "{e}");
    }

    #[test]
    fn reads_both_rope_layouts() {
        let mut j = base();
        j["rope_theta"] = json!(500000.0);
        j["rope_scaling"] = json!({"rope_type": "linear", "factor": 2.0});
        let a = ModelConfig::from_json(&j, Path::new("c")).unwrap();
        let mut k = base();
        k["rope_parameters"] = json!({"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0});
        let b = ModelConfig::from_json(&k, Path::new("c")).unwrap();
        assert_eq!(a.rope, b.rope);
        assert_eq!(a.rope.base, 500000.0);
        assert_eq!(a.head_dim, 16);
    }

    #[test]
    fn impossible_sizes_name_their_field() {
        let cases = [
            ("hidden_size", json!(0), "hidden_size"),
            ("num_hidden_layers", json!(0), "num_hidden_layers"),
            ("vocab_size", json!(0), "vocab_size"),
            ("intermediate_size", json!(0), "intermediate_size"),
            ("max_position_embeddings", json!(0), "max_position_embeddings"),
            ("head_dim", json!(0), "head_dim"),
            ("head_dim", json!(7), "head_dim"),
            ("rms_norm_eps", json!(-1.0), "rms_norm_eps"),
        ];
        for (key, value, field) in cases {
            let mut j = base();
            j[key] = value.clone();
            let e = ModelConfig::from_json(&j, Path::new("c")).unwrap_err().to_string();
            assert!(e.contains(&format!("field `{field}`")), "{key} = {value}: {e}");
        }
        assert!(ModelConfig::from_json(&base(), Path::new("c")).is_ok());
        let mut j = base();
        j["architectures"] = json!(["MistralForCausalLM"]);
        j["sliding_window"] = json!(0);
        let e = ModelConfig::from_json(&j, Path::new("c")).unwrap_err().to_string();
        assert!(e.contains("field `sliding_window`"), "{e}");
        j["sliding_window"] = json!(null);
        assert_eq!(ModelConfig::from_json(&j, Path::new("c")).unwrap().sliding_window, None);
    }

    #[test]
    fn bad_gqa_is_an_error() {
        let mut j = base();
        j["num_key_value_heads"] = json!(3);
        assert!(ModelConfig::from_json(&j, Path::new("c")).is_err());
    }
}
