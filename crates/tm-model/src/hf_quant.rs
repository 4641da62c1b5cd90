//! AWQ and GPTQ int4 Hugging Face checkpoints: the quantization config, the tensors of each
//! quantized matrix, and their import into tm's int4 layout.
//!
//! # What is supported
//! - **AutoAWQ "GEMM"**: `quant_method: "awq"`, `bits: 4`, `zero_point: true`, `version: "gemm"`,
//!   any `group_size` that is a multiple of 32 (32, 64, 128, ...) or -1 (one group per output
//!   channel).
//! - **GPTQ** (AutoGPTQ, GPTQModel, optimum): `quant_method: "gptq"`, `bits: 4`, symmetric or
//!   not, the same group sizes, `checkpoint_format` (or GPTQModel's `format`) `"gptq"` (the
//!   default: zero points stored minus one) or `"gptq_v2"` (stored as they are). `desc_act: true`
//!   loads only when every `g_idx` is the trivial `i / group_size` (e.g. `static_groups: true`);
//!   a real act-order permutation is an error naming the `g_idx` tensor.
//!
//! Everything else is a clear error at open time: other bit widths, other methods (`bitsandbytes`,
//! `fp8`, ...), AWQ's GEMV/GEMV-fast/exllama/marlin/ipex versions and `llm-awq` backend, GPTQ's
//! `marlin`/`bitblas`/... formats or `is_marlin_format`, non-int32 `pack_dtype`, AWQ without zero
//! points, and group sizes that are not multiples of 32.
//!
//! The config is `quantization_config` in `config.json` (as transformers writes it), else
//! AutoGPTQ's `quantize_config.json` or AutoAWQ's `quant_config.json` (older checkpoints; `w_bit`
//! and `q_group_size` are read as `bits` and `group_size`).
//!
//! # Loading
//! A quantized matrix `X.weight` is stored as `X.qweight`, `X.qzeros`, `X.scales` (and GPTQ's
//! `X.g_idx`); [`crate::weights::SafetensorsCheckpoint`] presents it as one tensor `X.weight`
//! (shape `[out, in]`, encoding [`Encoding::Awq`]/[`Encoding::Gptq`]) after checking every
//! part's dtype and shape here, from the headers alone. Loading repacks one matrix at a time with
//! [`tm_quant::ZeroPointInt4::to_tm`] (nibbles moved, never expanded to floats; see
//! [`tm_quant::zero_point`] for the mapping `(q - z) · s` → `q · s + f16(-z·s)` and its error of at
//! most 1/128 of a quantization step) and uploads it. Tensors the checkpoint keeps in floats
//! (embeddings, norms, usually `lm_head`) load as before.

use crate::error::{ModelError, Result};
use crate::weights::{Encoding, QuantParts, TensorRef};
use serde_json::Value;
use std::path::{Path, PathBuf};
use tm_core::quant::Weight;
use tm_core::{DType, Ops};
use tm_quant::{ZeroPointFormat, ZeroPointInt4};

/// The quantization methods tm loads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HfQuantMethod {
    /// AutoAWQ "GEMM" packing.
    Awq,
    /// GPTQ packing.
    Gptq,
}

impl HfQuantMethod {
    /// `"AWQ"` or `"GPTQ"`.
    pub fn name(self) -> &'static str {
        match self {
            HfQuantMethod::Awq => "AWQ",
            HfQuantMethod::Gptq => "GPTQ",
        }
    }
}

/// A checkpoint's weight quantization, validated to be one tm loads (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct HfQuantConfig {
    /// AWQ or GPTQ.
    pub method: HfQuantMethod,
    /// Inputs per group; `None` for one group per output channel (`group_size: -1`).
    pub group_size: Option<usize>,
    /// The packing (with GPTQ's zero-point offset).
    pub format: ZeroPointFormat,
    /// GPTQ's `desc_act` (act-order): `g_idx` must then be present (and still trivial).
    pub desc_act: bool,
    /// The file the config was read from.
    pub path: PathBuf,
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| ModelError::format(path, format!("invalid JSON: {e}")))
}

impl HfQuantConfig {
    /// Reads the quantization config of a model directory: `quantization_config` in
    /// `config.json`, else `quantize_config.json` (GPTQ) or `quant_config.json` (AWQ). `None` when
    /// there is none; an error when there is one tm cannot load.
    pub fn from_dir(dir: &Path) -> Result<Option<HfQuantConfig>> {
        let config = dir.join("config.json");
        if config.is_file() {
            if let Some(q) = read_json(&config)?.get("quantization_config").filter(|v| !v.is_null()) {
                return Self::from_json(q, &config, "quantization_config.", None).map(Some);
            }
        }
        for (file, method) in [("quantize_config.json", HfQuantMethod::Gptq), ("quant_config.json", HfQuantMethod::Awq)]
        {
            let path = dir.join(file);
            if path.is_file() {
                return Self::from_json(&read_json(&path)?, &path, "", Some(method)).map(Some);
            }
        }
        Ok(None)
    }

    /// Parses a quantization config object read from `path`. `prefix` goes before field names in
    /// errors; `default` is the method when the object does not name one.
    pub fn from_json(q: &Value, path: &Path, prefix: &str, default: Option<HfQuantMethod>) -> Result<HfQuantConfig> {
        let err = |field: &str, message: String| ModelError::Config {
            path: path.to_path_buf(),
            field: format!("{prefix}{field}"),
            message,
        };
        let get = |names: &[&str]| names.iter().find_map(|n| q.get(*n).filter(|v| !v.is_null()));
        let text = |names: &[&str]| get(names).and_then(Value::as_str).map(str::to_ascii_lowercase);
        let flag = |name: &str, default: bool| -> Result<bool> {
            match q.get(name) {
                None | Some(Value::Null) => Ok(default),
                Some(v) => v.as_bool().ok_or_else(|| err(name, format!("{v} is not true or false"))),
            }
        };
        let method = match text(&["quant_method", "method"]).as_deref() {
            Some("awq") => HfQuantMethod::Awq,
            Some("gptq") => HfQuantMethod::Gptq,
            Some(other) => {
                return Err(err(
                    "quant_method",
                    format!("`{other}` is not supported: tm loads 4-bit AWQ (GEMM) and GPTQ checkpoints"),
                ))
            }
            None => default.ok_or_else(|| err("quant_method", "missing".into()))?,
        };
        let bits = get(&["bits", "w_bit"]).ok_or_else(|| err("bits", "missing".into()))?;
        if bits.as_i64() != Some(4) {
            return Err(err(
                "bits",
                format!("{bits}-bit weights are not supported: tm loads 4-bit {} checkpoints only", method.name()),
            ));
        }
        let gs = get(&["group_size", "q_group_size"]).ok_or_else(|| err("group_size", "missing".into()))?;
        let group_size = match gs.as_i64() {
            Some(-1) => None,
            Some(g) if g > 0 && g % 32 == 0 => Some(g as usize),
            _ => {
                return Err(err(
                    "group_size",
                    format!("{gs}: tm's int4 layout needs groups of a multiple of 32 inputs (32, 64, 128, ...) or -1"),
                ))
            }
        };
        let (format, desc_act) = match method {
            HfQuantMethod::Awq => {
                if !flag("zero_point", true)? {
                    return Err(err("zero_point", "false: AWQ without zero points is not supported".into()));
                }
                let version = text(&["version"]).unwrap_or_else(|| "gemm".into());
                if version != "gemm" {
                    return Err(err(
                        "version",
                        format!(
                            "`{version}`: only AutoAWQ's GEMM packing is supported (GEMV, GEMV-fast, exllama, marlin \
                             and ipex checkpoints are not read); re-save the model with version \"gemm\""
                        ),
                    ));
                }
                if let Some(backend) = text(&["backend"]).filter(|b| b == "llm-awq") {
                    return Err(err(
                        "backend",
                        format!("`{backend}` checkpoints use llm-awq's packing, not AutoAWQ's"),
                    ));
                }
                (ZeroPointFormat::Awq, false)
            }
            HfQuantMethod::Gptq => {
                if flag("is_marlin_format", false)? {
                    return Err(err("is_marlin_format", "Marlin-packed GPTQ checkpoints are not supported".into()));
                }
                let zero_offset = match text(&["checkpoint_format", "format"]).as_deref().unwrap_or("gptq") {
                    "gptq" => 1,
                    "gptq_v2" => 0,
                    other => {
                        return Err(err(
                            "checkpoint_format",
                            format!("`{other}` is not supported (gptq and gptq_v2 are)"),
                        ))
                    }
                };
                if let Some(p) = text(&["pack_dtype"]).filter(|p| p.trim_start_matches("torch.") != "int32") {
                    return Err(err("pack_dtype", format!("`{p}`: only int32 packing is supported")));
                }
                (ZeroPointFormat::Gptq { zero_offset }, flag("desc_act", false)?)
            }
        };
        Ok(HfQuantConfig { method, group_size, format, desc_act, path: path.to_path_buf() })
    }
}

/// The [`Encoding`] of a quantized matrix of this format.
fn encoding(format: ZeroPointFormat) -> Encoding {
    match format {
        ZeroPointFormat::Awq => Encoding::Awq,
        ZeroPointFormat::Gptq { .. } => Encoding::Gptq,
    }
}

fn method_name(format: ZeroPointFormat) -> &'static str {
    match format {
        ZeroPointFormat::Awq => HfQuantMethod::Awq.name(),
        ZeroPointFormat::Gptq { .. } => HfQuantMethod::Gptq.name(),
    }
}

fn encoding_name(e: Encoding) -> String {
    match e {
        Encoding::Plain(d) => d.to_string(),
        other => format!("{other:?}"),
    }
}

/// Checks one part's dtype and shape; `what` says what it holds, `ctx` the format and group size.
fn check_part(t: &TensorRef<'_>, dtypes: &[DType], shape: &[usize], what: &str, ctx: &str) -> Result<()> {
    if !matches!(t.encoding, Encoding::Plain(d) if dtypes.contains(&d)) {
        let want: Vec<String> = dtypes.iter().map(|d| d.to_string()).collect();
        return Err(ModelError::format(
            t.file,
            format!(
                "tensor `{}` ({what}, {ctx}) is {}, expected {}",
                t.name,
                encoding_name(t.encoding),
                want.join(" or ")
            ),
        ));
    }
    if t.shape != shape {
        return Err(ModelError::format(
            t.file,
            format!("tensor `{}` ({what}, {ctx}) has shape {:?}, expected {shape:?}", t.name, t.shape),
        ));
    }
    Ok(())
}

/// The matrix `name` (= `base.weight`) of a checkpoint that stores it as `base.qweight`,
/// `base.qzeros`, `base.scales` (and `base.g_idx`), with every part checked against `quant`;
/// `stored` looks up a tensor as stored. Reads nothing but the headers and `g_idx`.
pub(crate) fn quantized_matrix<'a>(
    quant: Option<&HfQuantConfig>,
    dir: &Path,
    name: &str,
    base: &str,
    stored: &dyn Fn(&str) -> Option<TensorRef<'a>>,
) -> Result<TensorRef<'a>> {
    let Some(q) = quant else {
        return Err(ModelError::format(
            dir,
            format!(
                "tensor `{name}` is stored quantized (`{base}.qweight`), but config.json has no \
                 `quantization_config` saying how (tm loads AWQ and GPTQ int4)"
            ),
        ));
    };
    let part = |p: &str| {
        let n = format!("{base}.{p}");
        stored(&n).ok_or_else(|| ModelError::MissingTensor { name: n, path: dir.to_path_buf() })
    };
    let qweight = part("qweight")?;
    let &[r, c] = qweight.shape.as_slice() else {
        return Err(ModelError::format(
            qweight.file,
            format!("tensor `{}` has shape {:?}, expected 2 dimensions", qweight.name, qweight.shape),
        ));
    };
    let (n_in, n_out) = match q.format {
        ZeroPointFormat::Awq => (r, c * 8),
        ZeroPointFormat::Gptq { .. } => (r * 8, c),
    };
    let group_size = q.group_size.unwrap_or(n_in);
    let ctx = format!("{} int4, {group_size} inputs per group, from {}", q.method.name(), q.path.display());
    check_part(&qweight, &[DType::I32], &[r, c], "packed weights", &ctx)?;
    if n_in == 0 || !n_in.is_multiple_of(group_size) {
        return Err(ModelError::format(
            qweight.file,
            format!(
                "`{base}`: {n_in} inputs (from `{}`) is not a multiple of the group size {group_size}",
                qweight.name
            ),
        ));
    }
    let groups = n_in / group_size;
    let qzeros = part("qzeros")?;
    check_part(&qzeros, &[DType::I32], &[groups, n_out / 8], "packed zero points", &ctx)?;
    let scales = part("scales")?;
    check_part(&scales, &[DType::F16, DType::BF16, DType::F32], &[groups, n_out], "scales", &ctx)?;
    let g_idx = match q.format {
        ZeroPointFormat::Awq => None,
        ZeroPointFormat::Gptq { .. } => match stored(&format!("{base}.g_idx")) {
            Some(g) => {
                check_part(&g, &[DType::I32], &[n_in], "group index", &ctx)?;
                tm_quant::gptq::check_g_idx(g.bytes, n_in, group_size)
                    .map_err(|e| ModelError::format(g.file, format!("tensor `{}`: {e}", g.name)))?;
                Some(g)
            }
            None if q.desc_act => {
                return Err(ModelError::MissingTensor { name: format!("{base}.g_idx"), path: dir.to_path_buf() })
            }
            None => None,
        },
    };
    let parts = QuantParts { format: q.format, group_size, qweight, qzeros, scales, g_idx };
    view(&parts, n_out, n_in)?
        .validate()
        .map_err(|e| ModelError::format(parts.qweight.file, format!("`{base}` ({}): {e}", method_name(q.format))))?;
    Ok(TensorRef {
        name: name.to_string(),
        encoding: encoding(q.format),
        shape: vec![n_out, n_in],
        bytes: parts.qweight.bytes,
        file: parts.qweight.file,
        parts: Some(Box::new(parts)),
    })
}

/// The parts as the [`ZeroPointInt4`] tm-quant repacks.
fn view<'a>(p: &QuantParts<'a>, rows: usize, cols: usize) -> Result<ZeroPointInt4<'a>> {
    let Encoding::Plain(scales_dtype) = p.scales.encoding else {
        return Err(ModelError::format(p.scales.file, format!("tensor `{}` is not a float tensor", p.scales.name)));
    };
    Ok(ZeroPointInt4 {
        format: p.format,
        in_features: cols,
        out_features: rows,
        group_size: p.group_size,
        qweight: p.qweight.bytes,
        qzeros: p.qzeros.bytes,
        scales: p.scales.bytes,
        scales_dtype,
    })
}

/// Bytes tm's int4 layout holds for a `[rows, cols]` matrix with groups of `group_size`: the
/// nibbles plus an f16 scale and min per group.
pub fn int4_bytes(rows: usize, cols: usize, group_size: usize) -> u64 {
    (rows * cols / 2 + 4 * rows * cols.checked_div(group_size).unwrap_or(0)) as u64
}

/// Repacks an AWQ/GPTQ matrix (a [`TensorRef`] with `parts`) into tm's int4 layout and uploads
/// it. The host buffer is the repacked matrix ([`int4_bytes`]); nothing is dequantized.
pub fn import_matrix(ops: &dyn Ops, t: &TensorRef<'_>) -> Result<Weight> {
    crate::llama::quant_load::upload_quant(ops, &import_host(t)?)
}

/// The host-side repacking of [`import_matrix`] (tensor-parallel loading cuts it before upload).
pub(crate) fn import_host(t: &TensorRef<'_>) -> Result<tm_quant::HostQuant> {
    let Some(p) = t.parts.as_deref() else {
        return Err(ModelError::format(
            t.file,
            format!("tensor `{}` ({:?}) comes without its quantized parts", t.name, t.encoding),
        ));
    };
    let &[rows, cols] = t.shape.as_slice() else {
        return Err(ModelError::format(t.file, format!("`{}`: quantized tensor of shape {:?}", t.name, t.shape)));
    };
    let base = t.name.strip_suffix(".weight").unwrap_or(&t.name);
    view(p, rows, cols)?
        .to_tm()
        .map_err(|e| ModelError::format(p.qweight.file, format!("`{base}` ({}): {e}", method_name(p.format))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<HfQuantConfig> {
        HfQuantConfig::from_json(&v, Path::new("m/config.json"), "quantization_config.", None)
    }

    #[test]
    fn reads_awq_and_gptq_configs() {
        let awq = parse(json!({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true,
                               "version": "GEMM", "backend": "autoawq", "modules_to_not_convert": null}))
        .unwrap();
        assert_eq!((awq.method, awq.group_size, awq.format), (HfQuantMethod::Awq, Some(128), ZeroPointFormat::Awq));
        let gptq = parse(json!({"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": false, "sym": true}))
            .unwrap();
        assert_eq!(gptq.group_size, None);
        assert_eq!(gptq.format, ZeroPointFormat::Gptq { zero_offset: 1 });
        let v2 =
            parse(json!({"method": "gptq", "bits": 4, "group_size": 32, "format": "gptq_v2", "pack_dtype": "int32"}))
                .unwrap();
        assert_eq!(v2.format, ZeroPointFormat::Gptq { zero_offset: 0 });
        // AutoAWQ's own quant_config.json names.
        let old = HfQuantConfig::from_json(
            &json!({"w_bit": 4, "q_group_size": 64, "zero_point": true, "version": "GEMM"}),
            Path::new("quant_config.json"),
            "",
            Some(HfQuantMethod::Awq),
        )
        .unwrap();
        assert_eq!((old.method, old.group_size), (HfQuantMethod::Awq, Some(64)));
    }

    #[test]
    fn unsupported_configs_name_the_field() {
        let cases = [
            (json!({"quant_method": "gptq", "bits": 8, "group_size": 128}), "quantization_config.bits", "8-bit"),
            (json!({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}), ".version", "gemv"),
            (json!({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": false}), ".zero_point", "false"),
            (json!({"quant_method": "gptq", "bits": 4, "group_size": 16}), ".group_size", "multiple of 32"),
            (
                json!({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}),
                "checkpoint_format",
                "marlin",
            ),
            (
                json!({"quant_method": "gptq", "bits": 4, "group_size": 128, "is_marlin_format": true}),
                "is_marlin_format",
                "Marlin",
            ),
            (json!({"quant_method": "gptq", "bits": 4, "group_size": 128, "pack_dtype": "int8"}), "pack_dtype", "int8"),
            (json!({"quant_method": "bitsandbytes", "load_in_4bit": true}), "quant_method", "bitsandbytes"),
            (json!({"quant_method": "fp8"}), "quant_method", "fp8"),
            (json!({"quant_method": "awq", "bits": 4}), "group_size", "missing"),
        ];
        for (v, field, needle) in cases {
            let e = parse(v.clone()).unwrap_err().to_string();
            assert!(e.contains(field) && e.contains(needle) && e.contains("m/config.json"), "{v}: {e}");
        }
    }
}
