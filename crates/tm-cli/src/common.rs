//! What the commands share: model and backend options, model resolution and loading, sampling
//! flags.

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use tm_core::sampling::SamplingParams;
use tm_core::Ops;
use tm_core::{Comm, LocalComm};
use tm_cpu::CpuBackend;
use tm_model::chat_template::ChatTemplate;
use tm_model::config::ModelConfig;
use tm_model::engine::EngineConfig;
use tm_model::generate::Session;
use tm_model::kv_cache::KvCache;
use tm_model::loader::{load, load_tp, Checkpoint, LoadedModel, LoadedTp};
use tm_model::plan::{human, plan, PlanRequest, PlanTarget};
use tm_model::tokenizer::Tokenizer;
use tm_model::tp::{cpu_backend_factory, TpOptions};

/// Which backend runs the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendChoice {
    /// CUDA when a usable NVIDIA GPU is present, else a real GPU through wgpu, else the CPU.
    Auto,
    /// The CPU reference backend.
    Cpu,
    /// An NVIDIA GPU (`--device` picks which).
    Cuda,
    /// Any GPU through wgpu (Vulkan, Metal, DX12; `TM_WGPU_ADAPTER` picks one,
    /// `TM_WGPU_ALLOW_CPU=1` allows a software adapter such as Mesa lavapipe).
    Wgpu,
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
    /// Tensor-parallel ranks: the model is split over this many ranks (CPU backend: one thread
    /// per rank; `generate`, `chat` and `plan`).
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Seconds any collective between tensor-parallel ranks may wait before the run fails with an
    /// error naming the rank and step that stalled.
    #[arg(long, default_value_t = 60.0)]
    pub comm_timeout: f64,
}

impl ModelArgs {
    /// `--comm-timeout` as a duration, checked.
    pub fn comm_timeout(&self) -> Result<std::time::Duration> {
        match std::time::Duration::try_from_secs_f64(self.comm_timeout) {
            Ok(d) if !d.is_zero() => Ok(d),
            _ => bail!("--comm-timeout must be a positive number of seconds, got {}", self.comm_timeout),
        }
    }

    /// Fails for `--tp` above 1 in commands that run the serving engine, which has no
    /// tensor-parallel path yet.
    pub fn single_rank_only(&self, command: &str) -> Result<()> {
        if self.tp > 1 {
            bail!("`{command}` does not support --tp yet (the serving engine runs one rank); use generate or chat");
        }
        Ok(())
    }
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
            tp: 1,
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
    let open_wgpu = |allow_cpu: bool| -> Result<Box<dyn Ops>> {
        let mut opts = tm_wgpu::WgpuOptions::from_env();
        opts.allow_cpu_adapter &= allow_cpu;
        let b = tm_wgpu::WgpuBackend::open(opts).context("opening the wgpu backend")?;
        tracing::info!("backend: wgpu ({})", b.device().name());
        Ok(Box::new(b))
    };
    match args.backend {
        BackendChoice::Cpu => Ok(Box::new(CpuBackend::new())),
        BackendChoice::Cuda => open_cuda(),
        BackendChoice::Wgpu => open_wgpu(true),
        BackendChoice::Auto => match open_cuda() {
            Ok(b) => Ok(b),
            Err(cuda) if !may_have_gpu_adapter() => {
                tracing::info!("backend: cpu ({cuda:#}; no GPU device nodes for wgpu)");
                Ok(Box::new(CpuBackend::new()))
            }
            Err(cuda) => match open_wgpu(false) {
                Ok(b) => Ok(b),
                Err(wgpu) => {
                    tracing::info!("backend: cpu ({cuda:#}; {wgpu:#})");
                    Ok(Box::new(CpuBackend::new()))
                }
            },
        },
    }
}

/// Whether a real GPU adapter can exist for wgpu. On Linux a GPU shows up as a DRM render node
/// or an NVIDIA device node; without one, `auto` does not start a Vulkan instance (whose loader
/// prints warnings on headless machines) just to find the software adapter it would refuse.
fn may_have_gpu_adapter() -> bool {
    if !cfg!(target_os = "linux") {
        return true;
    }
    let render_node = std::fs::read_dir("/dev/dri")
        .map(|d| d.flatten().any(|e| e.file_name().to_string_lossy().starts_with("renderD")))
        .unwrap_or(false);
    render_node || std::path::Path::new("/dev/nvidia0").exists()
}

/// A model loaded for `generate` and `chat`: on one backend, or split over `--tp` CPU ranks.
pub enum Runnable {
    /// The whole model on one backend.
    Single {
        /// The backend.
        ops: Box<dyn Ops>,
        /// The model.
        model: Box<LoadedModel>,
    },
    /// The model split over tensor-parallel ranks.
    Tp(Box<LoadedTp>),
}

impl Runnable {
    /// The tokenizer, chat template and name, and a session of up to `max_len` tokens.
    pub fn session(
        &mut self,
        max_len: usize,
        block_size: usize,
    ) -> Result<(&Tokenizer, &ChatTemplate, &str, Session<'_>)> {
        match self {
            Runnable::Single { ops, model } => {
                let model: &LoadedModel = model;
                let ops: &dyn Ops = &**ops;
                let s = Session::new(&model.model, ops, max_len, block_size)?;
                Ok((&model.tokenizer, &model.template, &model.name, s))
            }
            Runnable::Tp(tp) => {
                let LoadedTp { group, tokenizer, template, name, .. } = &mut **tp;
                let s = Session::tensor_parallel(group, max_len)?;
                Ok((tokenizer, template, name, s))
            }
        }
    }
}

/// Loads the model for `generate` and `chat`: on the chosen backend, or with `--tp N` on N CPU
/// ranks (threads exchanging activations in memory, every exchange with `--comm-timeout`).
pub fn load_runnable(args: &ModelArgs) -> Result<Runnable> {
    if args.tp == 0 {
        bail!("--tp must be at least 1");
    }
    let timeout = args.comm_timeout()?;
    if args.tp == 1 {
        let ops = backend(args)?;
        let model = load_model(args, ops.as_ref())?;
        return Ok(Runnable::Single { ops, model: Box::new(model) });
    }
    match args.backend {
        BackendChoice::Cuda | BackendChoice::Wgpu => bail!(
            "--tp {} runs on the CPU backend for now (tensor parallelism over GPUs is not available yet); use \
             --backend cpu or --tp 1",
            args.tp
        ),
        BackendChoice::Auto => tracing::info!("--tp {}: running {} CPU ranks", args.tp, args.tp),
        BackendChoice::Cpu => {}
    }
    if args.block_size == 0 || args.max_len == 0 {
        bail!("--block-size and --max-len must be positive");
    }
    let path = resolve_model(args)?;
    let opts = TpOptions {
        comm_timeout: timeout,
        num_blocks: args.max_len.div_ceil(args.block_size),
        block_size: args.block_size,
        max_tokens: 1,
        max_logit_rows: 1,
    };
    let comms = LocalComm::group(args.tp).into_iter().map(|c| Box::new(c) as Box<dyn Comm>).collect();
    let loaded = load_tp(&path, comms, cpu_backend_factory(), opts)
        .with_context(|| format!("loading {} on {} tensor-parallel ranks", path.display(), args.tp))?;
    let bytes: Vec<String> = loaded.group.weight_bytes().iter().map(|&b| human(b)).collect();
    tracing::info!(
        "loaded {} on {} CPU ranks ({:?}, weights per rank: {})",
        loaded.name,
        args.tp,
        loaded.group.config().arch,
        bytes.join(", ")
    );
    Ok(Runnable::Tp(Box::new(loaded)))
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
