//! What the commands share: model and backend options, model resolution and loading, sampling
//! flags.

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use tm_core::sampling::SamplingParams;
use tm_core::Ops;
use tm_cpu::CpuBackend;
use tm_model::config::ModelConfig;
use tm_model::engine::EngineConfig;
use tm_model::kv_cache::KvCache;
use tm_model::loader::{load, Checkpoint, LoadedModel};
use tm_model::plan::{human, plan, PlanRequest, PlanTarget};

/// Which backend runs the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendChoice {
    /// CUDA when a usable NVIDIA GPU is present, else the CPU.
    Auto,
    /// The CPU reference backend.
    Cpu,
    /// An NVIDIA GPU (`--device` picks which).
    Cuda,
}

/// The dtype activations, dense weights and the KV cache use on a GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DTypeChoice {
    /// bf16 on GPUs (the CPU always computes in f32).
    Auto,
    /// bfloat16.
    Bf16,
    /// float16.
    F16,
    /// float32.
    F32,
}

/// Options naming the model and where it runs.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// A Hugging Face model directory or a .gguf file (default: the built-in SmolLM2-135M-Instruct).
    #[arg(long, short)]
    pub model: Option<PathBuf>,
    /// Backend.
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// GPU ordinal for `--backend cuda`.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Compute dtype on GPUs.
    #[arg(long, value_enum, default_value_t = DTypeChoice::Auto)]
    pub dtype: DTypeChoice,
    /// Replay decode steps as CUDA graphs (experimental until checked on a GPU; see NOTES).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    pub cuda_graphs: bool,
    /// Longest sequence (prompt plus output) in tokens.
    #[arg(long, default_value_t = 4096)]
    pub max_len: usize,
    /// Tokens per KV-cache block.
    #[arg(long, default_value_t = 64)]
    pub block_size: usize,
}

/// Engine flags shared by the commands that run the serving engine (`bench`, `serve`).
#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    /// Most sequences per step.
    #[arg(long, default_value_t = 256)]
    pub max_batch_size: usize,
    /// Most tokens per step.
    #[arg(long, default_value_t = 8192)]
    pub max_batched_tokens: usize,
    /// KV blocks (default: the command's own default, or from --kv-cache-bytes).
    #[arg(long)]
    pub num_blocks: Option<usize>,
    /// KV-cache size in bytes (instead of --num-blocks).
    #[arg(long)]
    pub kv_cache_bytes: Option<u64>,
    /// Reuse the KV blocks of repeated prompt prefixes.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub enable_prefix_caching: bool,
}

impl EngineArgs {
    /// KV blocks: `--num-blocks`, else `--kv-cache-bytes` converted for `cfg` and `dtype`, else
    /// `default_blocks()`.
    pub fn num_blocks(
        &self,
        model: &ModelArgs,
        cfg: &ModelConfig,
        dtype: tm_core::DType,
        default_blocks: impl FnOnce() -> usize,
    ) -> usize {
        match (self.num_blocks, self.kv_cache_bytes) {
            (Some(n), _) => n,
            (None, Some(bytes)) => EngineConfig::blocks_for_bytes(cfg, dtype, model.block_size.max(1), bytes),
            (None, None) => default_blocks(),
        }
    }

    /// Plans memory before anything is loaded and returns the KV blocks to allocate: the blocks
    /// asked for (`--num-blocks`, `--kv-cache-bytes`, else `default_blocks`) must fit next to the
    /// weights and the workspace in the device's usable memory, or this fails with the numbers and
    /// the flag to lower.
    pub fn plan_blocks(
        &self,
        model: &ModelArgs,
        ops: &dyn Ops,
        default_blocks: impl FnOnce(&ModelConfig) -> usize,
    ) -> Result<usize> {
        let path = resolve_model(model)?;
        let ckpt = Checkpoint::open(&path).with_context(|| format!("opening {}", path.display()))?;
        let cfg = &ckpt.config;
        let dtype = ops.activation_dtype();
        let blocks = self.num_blocks(model, cfg, dtype, || default_blocks(cfg));
        let per_block = KvCache::bytes_per_block(cfg, dtype, model.block_size.max(1));
        let request = PlanRequest {
            max_len: model.max_len,
            max_batch_size: self.max_batch_size.min(self.max_batched_tokens),
            max_batched_tokens: self.max_batched_tokens,
            block_size: model.block_size,
            memory_fraction: 0.9,
            kv_cache_bytes: Some(blocks as u64 * per_block),
        };
        let plan = plan(&ckpt, &PlanTarget::for_backend(ops)?, &request)?;
        tracing::info!(
            "memory plan: weights {}, workspace {}, KV cache {} blocks ({}) of a {} budget",
            human(plan.weights_total),
            human(plan.workspace),
            plan.num_blocks,
            human(plan.kv_bytes),
            human(plan.budget)
        );
        Ok(plan.num_blocks)
    }

    /// The engine configuration for `num_blocks` blocks and at most `max_queue` waiting requests.
    pub fn config(&self, model: &ModelArgs, num_blocks: usize, max_queue: usize) -> EngineConfig {
        EngineConfig {
            block_size: model.block_size,
            num_blocks,
            max_batched_tokens: self.max_batched_tokens,
            max_batch_size: self.max_batch_size,
            max_queue: max_queue.max(1),
            max_model_len: Some(model.max_len),
            enable_prefix_caching: self.enable_prefix_caching,
        }
    }
}

/// Sampling flags.
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Most tokens to generate.
    #[arg(long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.7)]
    pub temperature: f32,
    /// Nucleus sampling threshold.
    #[arg(long, default_value_t = 0.9)]
    pub top_p: f32,
    /// Keep only the k most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Drop tokens less likely than min-p times the best (0: off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Repetition penalty (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Random seed; the same seed gives the same text.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl SamplingArgs {
    /// Validated sampling parameters.
    pub fn params(&self) -> Result<SamplingParams> {
        let p = SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
            ..SamplingParams::default()
        };
        p.validate()?;
        if self.max_tokens == 0 {
            bail!("--max-tokens must be at least 1");
        }
        Ok(p)
    }
}

/// The model path: `--model`, or the default model (downloaded on first use).
pub fn resolve_model(args: &ModelArgs) -> Result<PathBuf> {
    match &args.model {
        Some(p) => Ok(p.clone()),
        None => {
            let path = tm_model::default_model::default_model_path(&mut |msg| eprintln!("{msg}"))?;
            tracing::info!("using the default model {}", path.display());
            Ok(path)
        }
    }
}

/// The backend the flags ask for. `auto` takes the GPU when one is usable and says why not
/// otherwise; an explicit `cuda` that cannot start is an error.
pub fn backend(args: &ModelArgs) -> Result<Box<dyn Ops>> {
    let dtype = match args.dtype {
        DTypeChoice::Auto | DTypeChoice::Bf16 => tm_core::DType::BF16,
        DTypeChoice::F16 => tm_core::DType::F16,
        DTypeChoice::F32 => tm_core::DType::F32,
    };
    let open_cuda = || -> Result<Box<dyn Ops>> {
        tm_cuda::probe().map_err(|e| anyhow::anyhow!("no usable CUDA GPU: {e}"))?;
        let opts =
            tm_cuda::CudaOptions { ordinal: args.device, dtype, memory_cap: None, cuda_graphs: args.cuda_graphs };
        let b = tm_cuda::CudaBackend::open(opts).context("opening the CUDA backend")?;
        tracing::info!("backend: cuda device {} ({}), {dtype}", args.device, b.gpu().info().name);
        Ok(Box::new(b))
    };
    match args.backend {
        BackendChoice::Cpu => Ok(Box::new(CpuBackend::new())),
        BackendChoice::Cuda => open_cuda(),
        BackendChoice::Auto => match open_cuda() {
            Ok(b) => Ok(b),
            Err(e) => {
                tracing::info!("backend: cpu ({e:#})");
                Ok(Box::new(CpuBackend::new()))
            }
        },
    }
}

/// Loads the model with a progress bar on stderr.
pub fn load_model(args: &ModelArgs, ops: &dyn Ops) -> Result<LoadedModel> {
    let path = resolve_model(args)?;
    if args.block_size == 0 || args.max_len == 0 {
        bail!("--block-size and --max-len must be positive");
    }
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("loading {msg} [{bar:30}] {bytes}/{total_bytes}")
            .map(|s| s.progress_chars("=> "))
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default());
    let loaded = load(&path, ops, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })
    .with_context(|| format!("loading {}", path.display()))?;
    bar.finish_and_clear();
    tracing::info!(
        "loaded {} ({:?}, {} layers, {:.1} MB of weights on {})",
        loaded.name,
        loaded.model.config.arch,
        loaded.model.config.num_layers,
        loaded.model.weight_bytes() as f64 / 1e6,
        ops.device().name()
    );
    Ok(loaded)
}
