//! Writing the quantized checkpoint: AutoAWQ "GEMM" tensors and f16 floats in one
//! `model.safetensors`, `config.json` with the `quantization_config` transformers and AutoAWQ
//! write, and the tokenizer files copied over.

use anyhow::{bail, Context, Result};
use half::f16;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use tm_quant::awq_quantizer::AwqGemm;

/// Files besides the weights that make a model directory loadable (those present are copied).
const TOKENIZER_FILES: [&str; 10] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
];

/// The tensors of the output checkpoint, by name.
#[derive(Default)]
pub struct Output {
    tensors: BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>,
}

impl Output {
    /// Adds a float tensor, stored as f16 (as AutoAWQ stores the tensors it does not quantize).
    /// Errors, naming the tensor, when a value does not fit f16.
    pub fn f16(&mut self, name: &str, shape: &[usize], values: &[f32]) -> Result<()> {
        if let Some(i) = values.iter().position(|v| !f16::from_f32(*v).is_finite()) {
            bail!(
                "tensor `{name}`: element {i} ({}) does not fit f16, the dtype AWQ checkpoints keep floats in",
                values[i]
            );
        }
        let bytes = values.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()).collect();
        self.tensors.insert(name.to_string(), (Dtype::F16, shape.to_vec(), bytes));
        Ok(())
    }

    /// Adds the `base.qweight`, `base.qzeros` and `base.scales` of a quantized linear.
    pub fn awq(&mut self, base: &str, q: &AwqGemm) {
        let (n_in, n_out, groups) = (q.in_features, q.out_features, q.in_features / q.group_size);
        self.tensors.insert(format!("{base}.qweight"), (Dtype::I32, vec![n_in, n_out / 8], q.qweight_bytes()));
        self.tensors.insert(format!("{base}.qzeros"), (Dtype::I32, vec![groups, n_out / 8], q.qzeros_bytes()));
        self.tensors.insert(format!("{base}.scales"), (Dtype::F16, vec![groups, n_out], q.scales_bytes()));
    }

    /// Bytes of all tensors.
    pub fn bytes(&self) -> u64 {
        self.tensors.values().map(|(_, _, b)| b.len() as u64).sum()
    }

    /// Writes `model.safetensors` into `dir`.
    pub fn write(&self, dir: &Path) -> Result<()> {
        let views = self
            .tensors
            .iter()
            .map(|(n, (d, s, b))| Ok((n.as_str(), TensorView::new(*d, s.clone(), b)?)))
            .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        let path = dir.join("model.safetensors");
        safetensors::serialize_to_file(views, Some(meta), &path).with_context(|| format!("writing {}", path.display()))
    }
}

/// The input's `config.json` with AutoAWQ's `quantization_config` and f16 as the dtype.
pub fn awq_config(input: &Value, group_size: usize) -> Result<Value> {
    let mut config = input.clone();
    let Some(obj) = config.as_object_mut() else { bail!("config.json is not a JSON object") };
    obj.insert(
        "quantization_config".into(),
        json!({
            "quant_method": "awq",
            "bits": 4,
            "group_size": group_size,
            "zero_point": true,
            "version": "gemm",
            "modules_to_not_convert": null,
        }),
    );
    obj.insert("torch_dtype".into(), json!("float16"));
    if obj.contains_key("dtype") {
        obj.insert("dtype".into(), json!("float16"));
    }
    Ok(config)
}

/// Copies the tokenizer and generation files of `from` that exist into `to`; returns their names.
pub fn copy_tokenizer_files(from: &Path, to: &Path) -> Result<Vec<&'static str>> {
    let mut copied = Vec::new();
    for name in TOKENIZER_FILES {
        let src = from.join(name);
        if src.is_file() {
            std::fs::copy(&src, to.join(name)).with_context(|| format!("copying {}", src.display()))?;
            copied.push(name);
        }
    }
    Ok(copied)
}

/// Writes `config.json` into `dir`.
pub fn write_config(dir: &Path, config: &Value) -> Result<()> {
    let path = dir.join("config.json");
    std::fs::write(&path, serde_json::to_string_pretty(config)? + "\n")
        .with_context(|| format!("writing {}", path.display()))
}
