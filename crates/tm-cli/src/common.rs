//! What the commands share: model and backend options, model resolution and loading, sampling
//! flags.

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tm_core::sampling::SamplingParams;
use tm_core::{Comm, DType, LocalComm, Ops};
use tm_cpu::CpuBackend;
use tm_model::chat_template::ChatTemplate;
use tm_model::config::ModelConfig;
use tm_model::engine::{Engine, EngineConfig, TpModelInfo};
use tm_model::generate::Session;
use tm_model::kv_cache::{check_supported, KvCache, KvCacheDtype};
use tm_model::llama::{ShardLayout, ShardSpec};
use tm_model::loader::{load, load_tp, Checkpoint, LoadedModel, LoadedTp};
use tm_model::plan::{human, plan, PlanRequest, PlanTarget};
use tm_model::tokenizer::Tokenizer;
use tm_model::tp::{cpu_backend_factory, BackendFactory, TpOptions};

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

/// `--kv-cache-dtype`: what the KV cache stores keys and values as.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum KvCacheDtypeChoice {
    /// The activation dtype (bf16/f16 on GPUs, f32 on the CPU).
    Auto,
    /// FP8 E4M3, scale 1.0, saturating at ±448: half the bytes of a 16-bit cache (twice the
    /// tokens, half the decode-attention traffic). CPU and CUDA backends.
    Fp8,
}

impl From<KvCacheDtypeChoice> for KvCacheDtype {
    fn from(c: KvCacheDtypeChoice) -> Self {
        match c {
            KvCacheDtypeChoice::Auto => KvCacheDtype::Auto,
            KvCacheDtypeChoice::Fp8 => KvCacheDtype::Fp8,
        }
    }
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
    /// Replay repeated decode steps as CUDA graphs (`--cuda-graphs false` runs every step
    /// eagerly; under `--tp` only when the GPUs have peer access, so that the decode steps'
    /// collectives run as tm's one-shot kernels inside the graphs).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub cuda_graphs: bool,
    /// Longest sequence (prompt plus output) in tokens.
    #[arg(long, default_value_t = 4096)]
    pub max_len: usize,
    /// Tokens per KV-cache block.
    #[arg(long, default_value_t = 64)]
    pub block_size: usize,
    /// KV-cache element type: auto (the activation dtype) or fp8 (E4M3, one byte per element,
    /// scale 1.0: values beyond ±448 saturate).
    #[arg(long, value_enum, default_value_t = KvCacheDtypeChoice::Auto)]
    pub kv_cache_dtype: KvCacheDtypeChoice,
    /// Tensor-parallel ranks: the model is split over this many ranks, one thread each (CUDA:
    /// GPUs --device .. --device+N-1, exchanging activations through NCCL; CPU: in memory).
    #[arg(long, default_value_t = 1, value_parser = parse_tp)]
    pub tp: usize,
    /// Seconds any collective between tensor-parallel ranks may wait before the run fails with an
    /// error naming the rank and step that stalled.
    #[arg(long, default_value_t = 60.0)]
    pub comm_timeout: f64,
    /// CUDA memory variant: unified (GPU shares the host's DRAM, as on Jetson: budget from the
    /// system, weights read in place), discrete, or auto (unified on integrated GPUs;
    /// TM_CUDA_MEMORY_MODEL overrides auto).
    #[arg(long, value_enum, default_value_t = MemoryModelChoice::Auto)]
    pub memory_model: MemoryModelChoice,
    /// Host memory left to the OS and other processes with unified memory (and on integrated
    /// device profiles): bytes, or with a unit (1.5GiB, 512M).
    #[arg(long, default_value = "1.5GiB", value_parser = crate::plan::parse_bytes_or_zero)]
    pub host_reserve: u64,
}

/// `--memory-model`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum MemoryModelChoice {
    /// Unified on integrated GPUs, discrete otherwise (TM_CUDA_MEMORY_MODEL overrides).
    Auto,
    /// The GPU shares the host's memory.
    Unified,
    /// The GPU has its own memory.
    Discrete,
}

/// The most tensor-parallel ranks `--tp` accepts: far more than one host has GPUs, and few
/// enough that the ranks' bookkeeping, made before the model's heads are checked, stays small.
pub const MAX_TP: usize = 256;

/// Parses `--tp`: a whole number from 1 to [`MAX_TP`].
pub fn parse_tp(s: &str) -> std::result::Result<usize, String> {
    let n: usize = s.trim().parse().map_err(|_| format!("`{s}` is not a whole number of ranks"))?;
    match n {
        0 => Err("--tp must be at least 1".into()),
        n if n > MAX_TP => Err(format!("--tp {n} is more ranks than tm runs (at most {MAX_TP})")),
        n => Ok(n),
    }
}

/// The longest wait, in seconds, a timeout flag accepts (a day).
pub const MAX_TIMEOUT_S: f64 = 86_400.0;

/// Parses a timeout in seconds that may be zero (`serve --shutdown-timeout`): finite, from 0 to
/// [`MAX_TIMEOUT_S`].
pub fn parse_seconds(s: &str) -> std::result::Result<f64, String> {
    let v: f64 = s.trim().parse().map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if !(0.0..=MAX_TIMEOUT_S).contains(&v) {
        return Err(format!("{s} seconds is out of range (0 to {MAX_TIMEOUT_S})"));
    }
    Ok(v)
}

/// The CUDA backend options the flags ask for.
pub fn cuda_options(args: &ModelArgs) -> tm_cuda::CudaOptions {
    let dtype = match args.dtype {
        DTypeChoice::Auto | DTypeChoice::Bf16 => tm_core::DType::BF16,
        DTypeChoice::F16 => tm_core::DType::F16,
        DTypeChoice::F32 => tm_core::DType::F32,
    };
    let model = match args.memory_model {
        MemoryModelChoice::Auto => tm_cuda::MemoryModel::Auto,
        MemoryModelChoice::Unified => tm_cuda::MemoryModel::Unified,
        MemoryModelChoice::Discrete => tm_cuda::MemoryModel::Discrete,
    };
    tm_cuda::CudaOptions {
        ordinal: args.device,
        dtype,
        memory_cap: None,
        cuda_graphs: args.cuda_graphs,
        memory_model: tm_cuda::MemoryConfig { model, host_reserve: args.host_reserve },
    }
}

impl ModelArgs {
    /// `--comm-timeout` as a duration, checked.
    pub fn comm_timeout(&self) -> Result<std::time::Duration> {
        let secs = self.comm_timeout;
        if secs.is_finite() && secs > MAX_TIMEOUT_S {
            bail!("--comm-timeout {secs} is too long: at most {MAX_TIMEOUT_S} seconds");
        }
        match std::time::Duration::try_from_secs_f64(secs) {
            Ok(d) if !d.is_zero() => Ok(d),
            _ => bail!("--comm-timeout must be a positive number of seconds, got {secs}"),
        }
    }

    /// Fails for `--tp` above 1 in commands that run one rank only.
    pub fn single_rank_only(&self, command: &str) -> Result<()> {
        if self.tp > 1 {
            bail!("`{command}` runs one rank; --tp {} is for generate, chat, bench, serve and plan", self.tp);
        }
        Ok(())
    }

    /// `--kv-cache-dtype` as the engine's setting.
    pub fn kv_dtype(&self) -> KvCacheDtype {
        self.kv_cache_dtype.into()
    }

    /// The compute dtype the flags ask for on GPUs.
    pub fn gpu_dtype(&self) -> DType {
        match self.dtype {
            DTypeChoice::Auto | DTypeChoice::Bf16 => DType::BF16,
            DTypeChoice::F16 => DType::F16,
            DTypeChoice::F32 => DType::F32,
        }
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
    /// KV blocks: `--num-blocks`, else `--kv-cache-bytes` converted for `cfg` and `dtype` (the
    /// KV cache's storage dtype), else
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

    /// Fails, naming the flag, for a zero `--max-batch-size`, `--max-batched-tokens` or
    /// `--num-blocks` (before they are combined into the plan's request, whose own checks would
    /// name another flag).
    pub fn check(&self) -> Result<()> {
        for (flag, v) in [
            ("--max-batch-size", self.max_batch_size),
            ("--max-batched-tokens", self.max_batched_tokens),
            ("--num-blocks", self.num_blocks.unwrap_or(1)),
        ] {
            if v == 0 {
                bail!("{flag} must be at least 1");
            }
        }
        Ok(())
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
        self.plan_blocks_for(model, &PlanTarget::for_backend(ops)?, 1, default_blocks)
    }

    /// [`EngineArgs::plan_blocks`] for `target` (one rank's device) and `tp` ranks: the KV blocks
    /// every rank allocates (each holding its KV heads of every block).
    pub fn plan_blocks_for(
        &self,
        model: &ModelArgs,
        target: &PlanTarget,
        tp: usize,
        default_blocks: impl FnOnce(&ModelConfig) -> usize,
    ) -> Result<usize> {
        self.check()?;
        let path = resolve_model(model)?;
        let ckpt = Checkpoint::open(&path).with_context(|| format!("opening {}", path.display()))?;
        let cfg = &ckpt.config;
        let dtype = model.kv_dtype().resolve(target.activation_dtype);
        let blocks = self.num_blocks(model, cfg, dtype, || default_blocks(cfg));
        let layout = ShardLayout::new(cfg, ShardSpec { rank: 0, world: tp.max(1) })?;
        let per_block = KvCache::bytes_per_block_shard(cfg, &layout, dtype, model.block_size.max(1));
        let request = PlanRequest {
            max_len: model.max_len,
            max_batch_size: self.max_batch_size.min(self.max_batched_tokens),
            max_batched_tokens: self.max_batched_tokens,
            block_size: model.block_size,
            memory_fraction: 0.9,
            // One rank's bytes of every block (its KV heads).
            kv_cache_bytes: Some(blocks as u64 * per_block),
            tp,
            kv_cache_dtype: model.kv_dtype(),
        };
        let plan = plan(&ckpt, target, &request)?;
        tracing::info!(
            "memory plan{}: weights {}, workspace {}, KV cache {} blocks ({}) of a {} budget",
            if tp > 1 { format!(" per rank of {tp}") } else { String::new() },
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
            kv_cache_dtype: model.kv_dtype(),
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
    let dtype = args.gpu_dtype();
    let open_cuda = || -> Result<Box<dyn Ops>> {
        tm_cuda::probe().map_err(|e| anyhow::anyhow!("no usable CUDA GPU: {e}"))?;
        let opts = cuda_options(args);
        let b = tm_cuda::CudaBackend::open(opts).context("opening the CUDA backend")?;
        tracing::info!("backend: cuda device {} ({}), {dtype}", args.device, b.gpu().info().name);
        Ok(Box::new(b))
    };
    let open_wgpu = |allow_cpu: bool| -> Result<Box<dyn Ops>> {
        let mut opts = tm_wgpu::WgpuOptions::from_env();
        opts.allow_cpu_adapter &= allow_cpu;
        opts.f16_weights |= dtype != tm_core::DType::F32;
        let f16 = opts.f16_weights;
        let b = tm_wgpu::WgpuBackend::open(opts).context("opening the wgpu backend")?;
        tracing::info!("backend: wgpu ({}), {} weights", b.device().name(), if f16 { "f16" } else { "f32" });
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
        kv_dtype: KvCacheDtype,
    ) -> Result<(&Tokenizer, &ChatTemplate, &str, Session<'_>)> {
        match self {
            Runnable::Single { ops, model } => {
                let model: &LoadedModel = model;
                let ops: &dyn Ops = &**ops;
                let s = Session::with_kv_dtype(&model.model, ops, max_len, block_size, kv_dtype)?;
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

/// The ranks of a tensor-parallel group before the model is loaded: one communicator and one
/// backend factory per rank, and the device every rank's memory plan is made for.
pub struct Ranks {
    /// `comms[r]` is rank `r`'s communicator.
    pub comms: Vec<Box<dyn Comm>>,
    /// Makes rank `r`'s backend on its thread.
    pub factory: BackendFactory,
    /// The smallest rank's device (every rank gets the same plan).
    pub target: PlanTarget,
    /// What the ranks run on, for logs and reports.
    pub device: String,
    /// Whether the ranks are GPUs (workspaces are then sized at start: nothing is allocated
    /// while collectives are in flight).
    pub gpu: bool,
}

/// `TM_TP_STALL=RANK:N`, a test hook: rank RANK stops answering at its N-th collective after
/// start-up (the start-up self-test's all-reduce is collective 0), as a hung rank would. The
/// other ranks then fail with the deadline error of `--comm-timeout`.
fn stall_hook(world: usize) -> Result<Option<(usize, u64)>> {
    let Ok(v) = std::env::var("TM_TP_STALL") else { return Ok(None) };
    let parsed = v.split_once(':').and_then(|(r, n)| Some((r.trim().parse().ok()?, n.trim().parse().ok()?)));
    match parsed {
        Some((r, n)) if r < world => {
            tracing::warn!("TM_TP_STALL: rank {r} will stall at its collective #{n} (test hook)");
            Ok(Some((r, n)))
        }
        _ => bail!("TM_TP_STALL must be RANK:N with RANK below --tp {world}, got `{v}`"),
    }
}

/// Sets up `args.tp` ranks: CPU ranks exchanging activations in memory, or one GPU each
/// (devices `--device` .. `--device + tp - 1`) with NCCL. For GPUs this checks the peer links,
/// logs the transport NCCL is expected to use, creates the communicators and runs an all-reduce
/// self-test, each with a deadline (the smaller of `--comm-timeout` and 20 s for start-up), and
/// fails with what was tried and what to try rather than hang.
pub fn tp_ranks(args: &ModelArgs) -> Result<Ranks> {
    let world = args.tp;
    if world < 2 {
        bail!("tensor parallelism needs --tp 2 or more");
    }
    let stall = stall_hook(world)?;
    let use_cuda = match args.backend {
        BackendChoice::Cuda => true,
        BackendChoice::Cpu => false,
        BackendChoice::Wgpu => {
            bail!("--tp {world} runs on CUDA GPUs or CPU ranks, not on wgpu; use --backend cuda or cpu")
        }
        BackendChoice::Auto => match tm_cuda::probe() {
            Ok(d) if d.len() >= args.device + world => true,
            Ok(d) => {
                tracing::info!(
                    "--tp {world}: {} CUDA GPU(s) from --device {} is not enough; running {world} CPU ranks",
                    d.len().saturating_sub(args.device),
                    args.device
                );
                false
            }
            Err(e) => {
                tracing::info!("--tp {world}: no CUDA ({e}); running {world} CPU ranks");
                false
            }
        },
    };
    if !use_cuda {
        let comms = LocalComm::group(world)
            .into_iter()
            .map(|c| match stall {
                Some((r, n)) if c.rank() == r => Box::new(c.stall_after(n)) as Box<dyn Comm>,
                _ => Box::new(c) as Box<dyn Comm>,
            })
            .collect();
        let target = PlanTarget::for_backend(&CpuBackend::new())?;
        return Ok(Ranks {
            comms,
            factory: cpu_backend_factory(),
            target,
            device: format!("{world} CPU ranks"),
            gpu: false,
        });
    }
    cuda_ranks(args, stall)
}

fn cuda_ranks(args: &ModelArgs, stall: Option<(usize, u64)>) -> Result<Ranks> {
    use tm_cuda::nccl;
    let world = args.tp;
    let devices =
        tm_cuda::probe().map_err(|e| anyhow::anyhow!("--tp {world} --backend cuda: no usable CUDA GPU: {e}"))?;
    let ordinals: Vec<usize> = (args.device..args.device + world).collect();
    if ordinals.iter().any(|&o| o >= devices.len()) {
        bail!(
            "--tp {world} from --device {} needs GPUs {:?}, but this machine shows {} (CUDA_VISIBLE_DEVICES picks \
             them); use fewer ranks",
            args.device,
            ordinals,
            devices.len()
        );
    }
    let timeout = args.comm_timeout()?;
    let startup = timeout.min(Duration::from_secs(20));
    let links = nccl::peer_links(&ordinals).context("reading the peer links between the GPUs")?;
    let mut matrix = String::new();
    for (i, row) in links.iter().enumerate() {
        let cells: Vec<String> = row
            .iter()
            .map(|l| match l {
                None => "-".into(),
                Some(l) if !l.access => "no".into(),
                Some(l) if l.native_atomics => "nvlink".into(),
                Some(_) => "pcie".into(),
            })
            .collect();
        matrix += &format!(" GPU{}[{}]", ordinals[i], cells.join(" "));
    }
    tracing::info!("peer access:{matrix}");
    let transport = nccl::expected_transport(&links);
    tracing::info!("NCCL transport (expected): {transport}");
    let gpus = ordinals
        .iter()
        .map(|&o| tm_cuda::runtime::Gpu::open(o).with_context(|| format!("opening GPU {o}")))
        .collect::<Result<Vec<_>>>()?;
    let comms = nccl::NcclComm::group(&gpus, startup)
        .with_context(|| format!("starting NCCL on GPUs {ordinals:?} (transport expected: {transport})"))?;
    let test = nccl::self_test(&comms, startup, 32 << 20)
        .with_context(|| format!("the NCCL self-test on GPUs {ordinals:?} (transport expected: {transport})"))?;
    tracing::info!("NCCL self-test: {}", test.summary());
    // Graphs need the one-shot peer collectives (NCCL's stay out of graphs, so without them
    // every step would be recorded only to run eagerly).
    let peer = comms.first().map_or_else(|| Err("no ranks".to_string()), |c| c.peer_path());
    let graphs = args.cuda_graphs && peer.is_ok();
    if args.cuda_graphs {
        match &peer {
            Ok(max) => tracing::info!(
                "CUDA graphs under --tp: decode steps are replayed from graphs on every rank; collectives of up to {} KiB \
                 per rank run as one-shot peer kernels inside them, steps with larger ones run eagerly through NCCL",
                max >> 10
            ),
            Err(why) => tracing::info!(
                "CUDA graphs are not used under --tp: every collective goes through NCCL, which tm keeps out of graphs \
                 (one-shot peer collectives: {why})"
            ),
        }
    }
    let comms: Vec<Box<dyn Comm>> = comms
        .into_iter()
        .map(|c| match stall {
            Some((r, n)) if c.rank() == r => {
                let at = c.collectives_started() + n;
                Box::new(c.stall_after(at)) as Box<dyn Comm>
            }
            _ => Box::new(c) as Box<dyn Comm>,
        })
        .collect();
    let opts = tm_cuda::CudaOptions { cuda_graphs: graphs, ..cuda_options(args) };
    // The plan's target: rank 0's backend, with the smallest GPU's usable memory.
    let target = {
        let b =
            tm_cuda::CudaBackend::open_on(Arc::clone(&gpus[0]), opts.clone()).context("opening the CUDA backend")?;
        let mut t = PlanTarget::for_backend(&b)?;
        for &o in &ordinals[1..] {
            let usable = tm_core::Device::memory_info(&tm_cuda::CudaDevice::new(o)?)?.usable;
            t.memory.usable = t.memory.usable.min(usable);
        }
        t
    };
    let names: Vec<String> = gpus.iter().map(|g| format!("{} {}", g.info().ordinal, g.info().name)).collect();
    let factory: BackendFactory = Arc::new(move |r| {
        let gpu = gpus.get(r).cloned().ok_or_else(|| tm_core::Error::invalid(format!("no GPU for rank {r}")))?;
        Ok(Box::new(tm_cuda::CudaBackend::open_on(gpu, opts.clone())?) as Box<dyn Ops>)
    });
    Ok(Ranks { comms, factory, target, device: format!("GPUs {} ({transport})", names.join(", ")), gpu: true })
}

/// Loads the model for `generate` and `chat`: on the chosen backend, or with `--tp N` on N ranks
/// ([`tp_ranks`]), every exchange between them with `--comm-timeout`.
pub fn load_runnable(args: &ModelArgs) -> Result<Runnable> {
    let timeout = args.comm_timeout()?;
    if args.tp == 1 {
        let ops = backend(args)?;
        check_supported(ops.as_ref(), args.kv_dtype())?; // before the model loads
        let model = load_model(args, ops.as_ref())?;
        return Ok(Runnable::Single { ops, model: Box::new(model) });
    }
    if args.block_size == 0 || args.max_len == 0 {
        bail!("--block-size and --max-len must be positive");
    }
    let path = resolve_model(args)?;
    let ranks = tp_ranks(args)?;
    let opts = TpOptions {
        comm_timeout: timeout,
        num_blocks: args.max_len.div_ceil(args.block_size),
        block_size: args.block_size,
        // GPUs: the workspace for a whole prompt up front (no allocation between collectives).
        max_tokens: if ranks.gpu { args.max_len.min(8192) } else { 1 },
        max_logit_rows: 1,
        kv_cache_dtype: args.kv_dtype(),
        spin: if ranks.gpu { tm_model::tp::GPU_SPIN } else { Duration::ZERO },
    };
    let loaded = load_tp(&path, ranks.comms, ranks.factory, opts)
        .with_context(|| format!("loading {} on {} tensor-parallel ranks", path.display(), args.tp))?;
    let bytes: Vec<String> = loaded.group.weight_bytes().iter().map(|&b| human(b)).collect();
    tracing::info!(
        "loaded {} on {} ({:?}, weights per rank: {})",
        loaded.name,
        ranks.device,
        loaded.group.config().arch,
        bytes.join(", ")
    );
    Ok(Runnable::Tp(Box::new(loaded)))
}

/// The serving engine of `bench` and `serve`, with what they report.
pub struct StartedEngine {
    /// The engine.
    pub engine: Engine,
    /// The model's name.
    pub name: String,
    /// The model's hyper-parameters.
    pub config: ModelConfig,
    /// What it runs on.
    pub device: String,
    /// KV blocks (per rank, under tensor parallelism).
    pub num_blocks: usize,
}

/// Plans memory, loads the model and starts the engine: on one backend, or with `--tp N` over N
/// ranks ([`tp_ranks`]; every rank's KV cache and workspace allocated at start from the plan of
/// the smallest device). `default_blocks(config, dtype)` is the KV-cache size when no flag sets it
/// (`dtype`: the KV cache's storage dtype).
pub fn start_engine(
    model: &ModelArgs,
    engine: &EngineArgs,
    max_queue: usize,
    default_blocks: impl FnOnce(&ModelConfig, DType) -> usize,
) -> Result<StartedEngine> {
    if model.tp <= 1 {
        let ops: Arc<dyn Ops> = Arc::from(backend(model)?);
        // Refuse a cache the backend cannot keep before the model loads.
        let dtype = check_supported(ops.as_ref(), model.kv_dtype())?;
        let num_blocks = engine.plan_blocks(model, ops.as_ref(), |cfg| default_blocks(cfg, dtype))?;
        let m = Arc::new(load_model(model, ops.as_ref())?);
        let config = engine.config(model, num_blocks, max_queue);
        let started = Engine::start(Arc::clone(&m), Arc::clone(&ops), config).context("starting the engine")?;
        return Ok(StartedEngine {
            engine: started,
            name: m.name.clone(),
            config: m.model.config.clone(),
            device: ops.device().name(),
            num_blocks,
        });
    }
    if model.block_size == 0 || model.max_len == 0 {
        bail!("--block-size and --max-len must be positive");
    }
    let path = resolve_model(model)?;
    let ranks = tp_ranks(model)?;
    let dtype = model.kv_dtype().resolve(ranks.target.activation_dtype);
    let num_blocks = engine.plan_blocks_for(model, &ranks.target, model.tp, |cfg| default_blocks(cfg, dtype))?;
    let opts = TpOptions {
        comm_timeout: model.comm_timeout()?,
        num_blocks,
        block_size: model.block_size,
        max_tokens: engine.max_batched_tokens,
        max_logit_rows: engine.max_batch_size.min(engine.max_batched_tokens),
        kv_cache_dtype: model.kv_dtype(),
        spin: if ranks.gpu { tm_model::tp::GPU_SPIN } else { Duration::ZERO },
    };
    let loaded = load_tp(&path, ranks.comms, ranks.factory, opts)
        .with_context(|| format!("loading {} on {} tensor-parallel ranks", path.display(), model.tp))?;
    let LoadedTp { path, name, group, tokenizer, template } = loaded;
    let config = group.config().clone();
    tracing::info!(
        "loaded {name} on {} ({:?}, weights per rank: {})",
        ranks.device,
        config.arch,
        group.weight_bytes().iter().map(|&b| human(b)).collect::<Vec<_>>().join(", ")
    );
    let info = Arc::new(TpModelInfo { path, name: name.clone(), tokenizer, template, config: config.clone() });
    let cfg = engine.config(model, num_blocks, max_queue);
    let started = Engine::start_tp(info, group, cfg).context("starting the engine")?;
    Ok(StartedEngine { engine: started, name, config, device: ranks.device, num_blocks })
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
