//! `tm-cli quantize --awq`: a Hugging Face checkpoint quantized with AWQ into an AutoAWQ "GEMM"
//! checkpoint (int4 weights, zero points, f16 scales) that tm, transformers and AutoAWQ load.
//!
//! 1. The float model is loaded on the CPU (f32) and run over the calibration text (the one
//!    shipped with tm unless `--calib` names another), cut into `--samples` blocks of
//!    `--seq-len` tokens; the inputs of every linear are gathered into statistics ([`calib`]).
//! 2. Layer by layer, [`tm_quant::awq_quantizer::quantize_layer`] searches the scales and clips,
//!    folds the scales into the norms and linears and quantizes the seven linears.
//! 3. The embeddings, norms and LM head stay floats (f16, as AutoAWQ writes them); everything
//!    goes into `OUT/model.safetensors` with `config.json` and the tokenizer files ([`output`]).
//!
//! # Memory
//! The f32 model (4 bytes per parameter), plus the statistics of the layers being quantized
//! (`2·hidden² + q_dim² + intermediate²` floats per layer: 0.9 GB for a Llama-3-8B layer; the
//! layers are done in passes of at most [`STATS_BUDGET`] bytes, each pass running the
//! calibration again), plus the output (about half a byte per quantized weight). The
//! calibration forward and the searches run on the CPU: practical for models up to a few
//! hundred million parameters (SmolLM2-135M: minutes); an 8B model needs about 40 GB of RAM
//! and hours.

mod calib;
mod output;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Instant;
use tm_cpu::CpuBackend;
use tm_model::config::{Arch, ModelConfig};
use tm_model::llama::LlamaModel;
use tm_model::tokenizer::Tokenizer;
use tm_model::weights::{Encoding, SafetensorsCheckpoint, TensorSource};
use tm_quant::awq_quantizer::{quantize_layer, AwqParams, DecoderLayer, Matrix, QuantizedLayer};

/// Most bytes of calibration statistics held at once (the layers are done in passes).
pub const STATS_BUDGET: u64 = 4 << 30;

/// Arguments of `quantize`.
#[derive(Args, Debug)]
pub struct QuantizeArgs {
    /// Quantize with AWQ (activation-aware scales and clipping searched on the calibration text).
    #[arg(long, required_unless_present = "rtn")]
    awq: bool,
    /// Plain round-to-nearest into the same format, without AWQ's searches (for comparison).
    #[arg(long, conflicts_with = "awq")]
    rtn: bool,
    /// The Hugging Face model directory to quantize (config.json, safetensors, tokenizer).
    #[arg(long)]
    model: PathBuf,
    /// The directory to write (must not exist, or be empty).
    #[arg(long)]
    out: PathBuf,
    /// Inputs per quantization group: a multiple of 32 dividing every linear's inputs.
    #[arg(long, default_value_t = 128)]
    group_size: usize,
    /// A UTF-8 calibration text (default: the one shipped with tm).
    #[arg(long)]
    calib: Option<PathBuf>,
    /// Most calibration blocks.
    #[arg(long, default_value_t = 128)]
    samples: usize,
    /// Tokens per calibration block.
    #[arg(long, default_value_t = 512)]
    seq_len: usize,
}

/// Checks what can be checked before loading anything: the model directory, its architecture,
/// the group size against every linear's inputs and outputs, and the output directory.
fn check_inputs(args: &QuantizeArgs) -> Result<ModelConfig> {
    if args.samples == 0 || args.seq_len == 0 {
        bail!("--samples and --seq-len must be at least 1");
    }
    let g = args.group_size;
    if g == 0 || !g.is_multiple_of(32) {
        bail!("--group-size {g}: must be a positive multiple of 32 (32, 64, 128, ...)");
    }
    if let Err(e) = std::fs::metadata(&args.model) {
        bail!("--model {}: {e}", args.model.display());
    }
    if !args.model.is_dir() {
        bail!(
            "--model {}: not a directory; quantize reads Hugging Face safetensors model directories (not GGUF)",
            args.model.display()
        );
    }
    let config = ModelConfig::from_dir(&args.model)?;
    if !matches!(config.arch, Arch::Llama | Arch::Mistral | Arch::Qwen2 | Arch::Qwen3) {
        bail!(
            "{}: quantize supports LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM, \
             not {:?}",
            args.model.display(),
            config.arch
        );
    }
    let dims = [
        ("hidden_size", config.hidden_size),
        ("attention width (heads * head_dim)", config.q_dim()),
        ("intermediate_size", config.intermediate_size),
    ];
    for (what, n) in dims {
        if !n.is_multiple_of(g) {
            bail!(
                "--group-size {g} does not divide the {what} of {n}: every linear's inputs must hold whole groups \
                 (try {})",
                [128, 64, 32]
                    .iter()
                    .find(|c| dims.iter().all(|(_, d)| d % **c == 0))
                    .map_or("none fits".into(), |c| format!("--group-size {c}"))
            );
        }
    }
    for (what, n) in [
        ("attention width", config.q_dim()),
        ("kv width", config.kv_dim()),
        ("hidden_size", config.hidden_size),
        ("intermediate_size", config.intermediate_size),
    ] {
        if !n.is_multiple_of(8) {
            bail!("the {what} of {n} is not a multiple of 8, which AutoAWQ's packing needs");
        }
    }
    if args.out.exists() && !args.out.is_dir() {
        bail!("--out {}: exists and is not a directory", args.out.display());
    }
    if args.out.exists() && std::fs::read_dir(&args.out).map(|mut d| d.next().is_some()).unwrap_or(true) {
        bail!("--out {}: exists and is not empty (nothing is overwritten)", args.out.display());
    }
    // The folder is made only once the quantized weights are ready; fail now, not after the
    // work, where it cannot be made under its nearest existing ancestor.
    if let Some(a) = args.out.ancestors().skip(1).find(|a| !a.as_os_str().is_empty() && a.exists()) {
        if !a.is_dir() {
            bail!("--out {}: cannot be created, {} is not a directory", args.out.display(), a.display());
        }
    }
    Ok(config)
}

/// A float tensor of the checkpoint as f32, checked against `shape`.
fn read_f32(src: &SafetensorsCheckpoint, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
    let t = src.tensor(name)?;
    if t.shape != shape {
        bail!("tensor `{name}` has shape {:?}, expected {shape:?}", t.shape);
    }
    match t.encoding {
        Encoding::Plain(d) if d.is_float() => Ok(tm_core::ops::to_f32(d, t.bytes)?),
        other => bail!("tensor `{name}` is {other:?}, expected floats (is the model already quantized?)"),
    }
}

/// The float weights of layer `i`.
fn read_layer(src: &SafetensorsCheckpoint, c: &ModelConfig, i: usize) -> Result<DecoderLayer> {
    let p = format!("model.layers.{i}");
    let (h, q, kv, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    let m = |name: &str, rows: usize, cols: usize| -> Result<Matrix> {
        Ok(Matrix::new(rows, cols, read_f32(src, &format!("{p}.{name}.weight"), &[rows, cols])?)?)
    };
    let bias = |name: &str, len: usize| -> Result<Option<Vec<f32>>> {
        let n = format!("{p}.self_attn.{name}.bias");
        if c.qkv_bias {
            Ok(Some(read_f32(src, &n, &[len])?))
        } else {
            Ok(None)
        }
    };
    Ok(DecoderLayer {
        attn_norm: read_f32(src, &format!("{p}.input_layernorm.weight"), &[h])?,
        q: m("self_attn.q_proj", q, h)?,
        k: m("self_attn.k_proj", kv, h)?,
        v: m("self_attn.v_proj", kv, h)?,
        q_bias: bias("q_proj", q)?,
        k_bias: bias("k_proj", kv)?,
        v_bias: bias("v_proj", kv)?,
        o: m("self_attn.o_proj", h, q)?,
        mlp_norm: read_f32(src, &format!("{p}.post_attention_layernorm.weight"), &[h])?,
        gate: m("mlp.gate_proj", inter, h)?,
        up: m("mlp.up_proj", inter, h)?,
        down: m("mlp.down_proj", h, inter)?,
    })
}

/// One line per layer on stderr: the chosen exponents, losses against RTN, clipped groups.
fn report(i: usize, layers: usize, q: &QuantizedLayer) {
    let groups: Vec<String> = q
        .groups
        .iter()
        .map(|g| {
            let alpha = g.alpha.map_or("rtn".into(), |a| format!("a={a:.2}"));
            format!("{} {alpha} mse {:.3e} (rtn {:.3e})", g.name, g.loss, g.rtn_loss)
        })
        .collect();
    if groups.is_empty() {
        eprintln!("layer {}/{layers}: round-to-nearest", i + 1);
    } else {
        eprintln!("layer {}/{layers}: {}; {} groups clipped", i + 1, groups.join(", "), q.clipped_groups);
    }
}

/// Runs `quantize`.
pub fn run(args: QuantizeArgs) -> Result<()> {
    let start = Instant::now();
    let config = check_inputs(&args)?;
    let text = match &args.calib {
        Some(p) => std::fs::read_to_string(p)
            .with_context(|| format!("reading the calibration text --calib {}", p.display()))?,
        None => calib::DEFAULT_CALIB.to_string(),
    };
    let src = SafetensorsCheckpoint::open(&args.model)?;
    if let Some(q) = src.quantization() {
        bail!(
            "{}: the model is already quantized ({}); quantize needs float weights",
            args.model.display(),
            q.method.name()
        );
    }
    let tokenizer = Tokenizer::from_dir(&args.model)?;
    let seq_len = args.seq_len.min(config.context_length().max(1));
    if seq_len < args.seq_len {
        eprintln!("calibration blocks of {seq_len} tokens: the model's context (asked for {})", args.seq_len);
    }
    let chunks = calib::chunks(&tokenizer, &text, args.samples, seq_len)?;
    let tokens: usize = chunks.iter().map(Vec::len).sum();
    eprintln!("calibration: {} blocks, {tokens} tokens", chunks.len());

    let cpu = CpuBackend::new();
    let model = LlamaModel::load(&cpu, &src, config.clone(), &mut |_| {})?;
    let params = if args.rtn { AwqParams::rtn(args.group_size) } else { AwqParams::awq(args.group_size) };
    let n = config.num_layers;
    let per_pass = (STATS_BUDGET / calib::layer_stats_bytes(&config).max(1)).clamp(1, n.max(1) as u64) as usize;
    let mut out = output::Output::default();
    let mut first = 0;
    while first < n {
        let layers = first..(first + per_pass).min(n);
        let stats = calib::collect(&cpu, &model, &chunks, layers.clone())?;
        for (i, st) in layers.clone().zip(&stats) {
            let prefix = format!("model.layers.{i}");
            let q = quantize_layer(read_layer(&src, &config, i)?, st, &params, &prefix)?;
            report(i, n, &q);
            out.f16(&format!("{prefix}.input_layernorm.weight"), &[config.hidden_size], &q.attn_norm)?;
            out.f16(&format!("{prefix}.post_attention_layernorm.weight"), &[config.hidden_size], &q.mlp_norm)?;
            for (name, b) in [("q_proj", &q.q_bias), ("k_proj", &q.k_bias), ("v_proj", &q.v_bias)] {
                if let Some(b) = b {
                    out.f16(&format!("{prefix}.self_attn.{name}.bias"), &[b.len()], b)?;
                }
            }
            if config.qk_norm {
                for name in ["q_norm", "k_norm"] {
                    let n = format!("{prefix}.self_attn.{name}.weight");
                    out.f16(&n, &[config.head_dim], &read_f32(&src, &n, &[config.head_dim])?)?;
                }
            }
            for (l, w) in &q.linears {
                out.awq(&format!("{prefix}.{}", l.hf_name()), w);
            }
        }
        first = layers.end;
    }
    drop(model);
    let (vocab, h) = (config.vocab_size, config.hidden_size);
    for (name, shape) in [("model.embed_tokens.weight", vec![vocab, h]), ("model.norm.weight", vec![h])] {
        out.f16(name, &shape, &read_f32(&src, name, &shape)?)?;
    }
    if src.contains("lm_head.weight") {
        out.f16("lm_head.weight", &[vocab, h], &read_f32(&src, "lm_head.weight", &[vocab, h])?)?;
    }
    write(&args, &out)?;
    eprintln!(
        "wrote {} ({:.1} MB of weights, group size {}) in {:.1}s",
        args.out.display(),
        out.bytes() as f64 / 1e6,
        args.group_size,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Writes the output directory: weights, config, tokenizer files.
fn write(args: &QuantizeArgs, out: &output::Output) -> Result<()> {
    let dir: &Path = &args.out;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let cfg_path = args.model.join("config.json");
    let input: Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path)?)
        .with_context(|| format!("reading {}", cfg_path.display()))?;
    output::write_config(dir, &output::awq_config(&input, args.group_size)?)?;
    output::copy_tokenizer_files(&args.model, dir)?;
    out.write(dir)
}
