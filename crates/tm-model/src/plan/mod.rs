//! The memory plan: weights, activation workspace, kernel scratch and KV-cache blocks, sized
//! from the checkpoint's headers and the device's *usable* memory before anything is allocated.
//!
//! This is tm's answer to the Jetson failure (a model that ran on an 8 GB discrete card ran out
//! of memory on a 16 GB Orin NX because the engine sized memory from `cudaMemGetInfo`, kept the
//! weights twice, and its cache knob acted after the failing step). Here:
//!
//! - the budget is [`MemoryInfo::usable`] (what the device really has free: on the CPU,
//!   `MemAvailable` capped by the cgroup) times `memory_fraction`, and the KV cache gets what is
//!   left after everything else, in whole blocks, or exactly `kv_cache_bytes`;
//! - weights are counted once, in the layout the *backend* holds them (the CPU backend holds
//!   f32, f16 and bf16 weights as stored and widens them as it multiplies);
//! - when it does not fit, [`plan`] fails before a byte is loaded, naming every component in
//!   bytes and the flag to lower; when the cache cannot hold one full `max_len` sequence,
//!   `max_len` is capped and the plan says so in numbers.
//!
//! # What is counted
//! `peak = weights + runtime reserve + host buffers + max(load staging, workspace + kernel scratch)
//! + KV cache`, which must not exceed the budget.
//!
//! - **weights**: every tensor the Llama loader reads, at its held size (see [`WeightGroup`]).
//! - **load staging**: the largest host buffer one tensor's conversion needs (widening to f32,
//!   importing a GGUF block tensor into tm's int4/int8 layout). It lives only while that tensor
//!   loads; staging and the workspace are never alive together (the workspace is allocated after
//!   loading), so the larger of the two is counted. Staging is host memory: it counts only on
//!   devices that share memory with the host (the CPU, Jetson); on a discrete GPU it is reported
//!   but not charged to the device.
//! - **workspace**: the activation buffers of `llama::Workspace` for the largest step:
//!   `max_batched_tokens` rows of every per-token buffer and `max_batch_size` rows of the final
//!   hidden states and logits, in the backend's activation dtype.
//! - **kernel scratch**: an allowance, not a measurement: the f32 copy of the logits the sampler
//!   reads (`max_batch_size × vocab × 4`), on the CPU the int8 activation buffer of the quantized
//!   matmuls, attention's token table and the per-thread panels of f16/bf16 weight rows widened
//!   for products of more than a few rows, on CUDA with f16/bf16 activations and quantized weights
//!   the int4 slab buffer ([`tm_core::q4_slab::SLAB_BYTES`], when `max_batched_tokens` reaches
//!   the slab path's batch size), plus [`SCRATCH_ALLOWANCE`] ([`CPU_SCRATCH_ALLOWANCE`] on the CPU) for matmul
//!   packing buffers, thread stacks and allocator slack.
//! - **runtime reserve**: [`PlanTarget::reserve_bytes`] (a CUDA context on a device profile; zero
//!   for a live device, whose usable memory is measured with the runtime already up).
//! - **host buffers**: [`PlanTarget::host_buffers`], buffers a GPU backend keeps in host memory
//!   for its whole life (the CUDA backend's pinned staging buffer). Like load staging they are
//!   charged only on devices that share memory with the host.
//! - **read in place** (a breakdown of the weights, not an extra term): on a target with
//!   [`PlanTarget::zero_copy`] (the CUDA unified variant: Jetson), dense tensors held exactly as
//!   stored are read by the GPU from the checkpoint's pinned file pages instead of a copy. They
//!   are charged once, as weights, and need no load staging.
//! - **KV cache**: `num_blocks × KvCache::bytes_per_block` in the activation dtype, or one byte
//!   per element with [`PlanRequest::kv_cache_dtype`] fp8.
//!
//! What is *not* counted, and why: on the CPU backend (and any device that shares memory with the
//! host) the memory-mapped checkpoint's pages are page cache. The CPU backend copies every tensor
//! into its own allocations and never computes from the mapping, so those pages are clean and
//! reclaimable, and `MemAvailable` already counts reclaimable page cache as available; charging
//! them would count the weights twice. The zero-copy path of the unified CUDA variant computes
//! from pinned file pages: those are charged *instead of* an allocation, once (the weights'
//! "read in place" share). The tokenizer and other small host structures fall under the scratch
//! allowance.
//!
//! The plan assumes the weights are loaded before the workspace is allocated; the KV cache may be
//! allocated before or after loading.
//!
//! # Tensor parallelism
//! With [`PlanRequest::tp`] ranks, every figure is *per rank*: each rank holds its shard of the
//! weights (`crate::llama::shard`: split matrices, replicated norms), its KV heads of every block
//! (replicated KV heads count on every rank that holds them) and a workspace of its widths plus
//! the gathered logits. Every rank gets the same plan, so the target is the smallest device
//! ([`PlanTarget::smallest`]). CPU ranks share the host's memory: their budget is the host's
//! divided by the number of ranks.
//!
//! Without `kv_cache_bytes`, the cache is never made larger than `max_batch_size` sequences of
//! `max_len` tokens (more blocks could not all be in use at once); the plan notes when that leaves
//! budget unused ([`MemoryPlan::kv_blocks_fit`] still says how many would fit).

mod manifest;
pub mod profiles;

pub use manifest::WeightGroup;
pub use profiles::{DeviceProfile, CUDA_HOST_BUFFERS, CUDA_RUNTIME_RESERVE, DEFAULT_HOST_RESERVE, DEVICE_PROFILES};

pub mod rss;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::kv_cache::{KvCache, KvCacheDtype};
use crate::llama::{ShardLayout, ShardSpec};
use crate::loader::Checkpoint;
use serde::Serialize;
use std::fmt::Write as _;
use tm_core::{DType, DeviceKind, MemoryInfo, Ops};

/// Fixed allowance inside the kernel scratch for what the formula does not itemize (matmul
/// packing buffers, thread stacks, the tokenizer, allocator slack) on a GPU: 64 MiB.
pub const SCRATCH_ALLOWANCE: u64 = 64 << 20;

/// The same allowance on the CPU backend, where all of it is anonymous host memory of the
/// process and can be measured (`plan --measure` compares the plan with the peak `RssAnon`):
/// 16 MiB. SmolLM2-135M on 2 threads measured 20.5 MiB of anonymous memory outside the
/// allocator, 16.6 MiB of it the itemized scratch.
pub const CPU_SCRATCH_ALLOWANCE: u64 = 16 << 20;

/// Upper bound on the token and sequence counts of a [`PlanRequest`] (token positions are `u32`).
pub const MAX_COUNT: usize = u32::MAX as usize;

/// How a backend holds dense (float) weights, matrices or vectors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum WeightPolicy {
    /// In their stored dtype (GPU backends; the CPU's matrices).
    Stored,
    /// Every float dtype converted to this one (the CPU's and wgpu's vectors: f32).
    Widen(DType),
    /// Each stored float dtype mapped on its own.
    PerDtype {
        /// What f32 weights are held as.
        f32: DType,
        /// What f16 weights are held as.
        f16: DType,
        /// What bf16 weights are held as.
        bf16: DType,
    },
}

impl WeightPolicy {
    /// The policy of a live backend for matrices, read from [`Ops::weight_dtype`].
    pub fn of_backend(ops: &dyn Ops) -> WeightPolicy {
        Self::from_map(|d| ops.weight_dtype(d))
    }

    /// The policy of a live backend for 1-D tensors, read from [`Ops::vector_dtype`].
    pub fn of_backend_vectors(ops: &dyn Ops) -> WeightPolicy {
        Self::from_map(|d| ops.vector_dtype(d))
    }

    fn from_map(held_as: impl Fn(DType) -> DType) -> WeightPolicy {
        let floats = [DType::F32, DType::F16, DType::BF16];
        let held = floats.map(held_as);
        if held == floats {
            WeightPolicy::Stored
        } else if held.iter().all(|&d| d == held[0]) {
            WeightPolicy::Widen(held[0])
        } else {
            WeightPolicy::PerDtype { f32: held[0], f16: held[1], bf16: held[2] }
        }
    }

    /// The dtype a dense weight stored as `stored` is held in.
    pub fn dense(self, stored: DType) -> DType {
        manifest::dense_dtype(self, stored)
    }
}

/// The device and backend a plan is for: a live backend ([`PlanTarget::for_backend`]) or a
/// device that is not present ([`DeviceProfile::target`]).
#[derive(Clone, Debug, PartialEq)]
pub struct PlanTarget {
    /// Human-readable name of the device (and profile).
    pub name: String,
    /// The backend family.
    pub kind: DeviceKind,
    /// Memory facts; the budget is `usable × memory_fraction`.
    pub memory: MemoryInfo,
    /// How dense weights (matrices) are held.
    pub weights: WeightPolicy,
    /// How 1-D float tensors (norm weights, biases) are held.
    pub vectors: WeightPolicy,
    /// Dtype of activations and of the KV cache.
    pub activation_dtype: DType,
    /// Bytes the runtime holds outside tm's allocations, charged before anything else.
    pub reserve_bytes: u64,
    /// Host memory the backend keeps for its whole life (the CUDA pinned staging buffer); charged
    /// only when the device shares memory with the host.
    pub host_buffers: u64,
    /// Whether dense weights held as stored are read in place from the checkpoint's file pages
    /// (the CUDA unified variant) instead of being copied through staging.
    pub zero_copy: bool,
}

impl PlanTarget {
    /// The device with the least usable memory of several (the ranks of a tensor-parallel
    /// group, which all get the same plan); `None` for none.
    pub fn smallest(targets: impl IntoIterator<Item = PlanTarget>) -> Option<PlanTarget> {
        targets.into_iter().min_by_key(|t| t.memory.usable.saturating_sub(t.reserve_bytes))
    }

    /// The target of a live backend: its device's current memory facts and dtypes. No runtime
    /// reserve: a live device's usable memory is measured with the runtime already up (its
    /// staging buffer included, but on a shared-memory CUDA device the plan still names it). A
    /// CUDA device sharing memory with the host is the unified variant, which reads weights in
    /// place when the driver allows (the plan's figures are the same either way, except that
    /// copied weights need load staging).
    pub fn for_backend(ops: &dyn Ops) -> Result<PlanTarget> {
        let device = ops.device();
        let memory = device.memory_info()?;
        let cuda = device.kind() == DeviceKind::Cuda;
        Ok(PlanTarget {
            name: device.name(),
            kind: device.kind(),
            memory,
            weights: WeightPolicy::of_backend(ops),
            vectors: WeightPolicy::of_backend_vectors(ops),
            activation_dtype: ops.activation_dtype(),
            reserve_bytes: 0,
            host_buffers: if cuda { CUDA_HOST_BUFFERS } else { 0 },
            zero_copy: cuda && memory.shared_with_host,
        })
    }
}

/// What the engine will be asked to do (the serving flags).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PlanRequest {
    /// Longest sequence, prompt plus output, in tokens (`--max-len`).
    pub max_len: usize,
    /// Most sequences in one step (`--max-batch-size`): rows of logits.
    pub max_batch_size: usize,
    /// Most tokens in one step (`--max-batched-tokens`): rows of the workspace.
    pub max_batched_tokens: usize,
    /// Tokens per KV block (`--block-size`).
    pub block_size: usize,
    /// Share of the usable memory tm may take (`--memory-fraction`), in `(0, 1]`.
    pub memory_fraction: f64,
    /// Exact size of the KV cache (`--kv-cache-bytes`), instead of what is left of the budget.
    pub kv_cache_bytes: Option<u64>,
    /// Tensor-parallel ranks (`--tp`): the plan is per rank.
    pub tp: usize,
    /// What the KV cache stores (`--kv-cache-dtype`): the activation dtype or FP8 E4M3 (one byte
    /// per element, twice the blocks of a 16-bit cache in the same bytes).
    pub kv_cache_dtype: KvCacheDtype,
}

impl Default for PlanRequest {
    fn default() -> Self {
        PlanRequest {
            max_len: 4096,
            max_batch_size: 256,
            max_batched_tokens: 8192,
            block_size: 64,
            memory_fraction: 0.9,
            kv_cache_bytes: None,
            tp: 1,
            kv_cache_dtype: KvCacheDtype::Auto,
        }
    }
}

impl PlanRequest {
    /// Checks the flags, naming the one that is wrong.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(ModelError::InvalidInput(m));
        for (flag, v) in [
            ("--max-len", self.max_len),
            ("--max-batch-size", self.max_batch_size),
            ("--max-batched-tokens", self.max_batched_tokens),
            ("--block-size", self.block_size),
            ("--tp", self.tp),
        ] {
            if v == 0 {
                return bad(format!("{flag} must be at least 1"));
            }
            if v > MAX_COUNT {
                return bad(format!("{flag} {v} is more than {MAX_COUNT}"));
            }
        }
        if self.max_batched_tokens < self.max_batch_size {
            return bad(format!(
                "--max-batched-tokens ({}) must be at least --max-batch-size ({}): each sequence of a decode \
                 step takes one token",
                self.max_batched_tokens, self.max_batch_size
            ));
        }
        if !(self.memory_fraction > 0.0 && self.memory_fraction <= 1.0) {
            return bad(format!("--memory-fraction must be in (0, 1], got {}", self.memory_fraction));
        }
        Ok(())
    }
}

/// The itemized kernel scratch allowance.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ScratchPlan {
    /// The f32 logits the sampler reads: `max_batch_size × vocab × 4`.
    pub sampler: u64,
    /// CPU int4/int8 matmuls: activations quantized to int8 with two f32 per 32-block.
    pub activation_quant: u64,
    /// CPU attention: a (sequence, position) pair per token.
    pub attention: u64,
    /// CPU products with f16/bf16 dense weights of more rows than the fused kernel takes: a
    /// panel of widened weight rows per thread ([`tm_cpu::matmul_16bit::panel_scratch_bytes`]).
    pub dense_panels: u64,
    /// CUDA: the int4 slab buffer of large-batch int4 products ([`tm_core::q4_slab`]), reserved
    /// with the workspace of a model with int4 weights when its steps reach the slab path's
    /// batch size.
    pub q4_slab: u64,
    /// [`SCRATCH_ALLOWANCE`].
    pub allowance: u64,
    /// The sum.
    pub total: u64,
}

/// The memory plan. Every size is in bytes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemoryPlan {
    /// The checkpoint (its file or directory name).
    pub model: String,
    /// The device (and profile) planned for.
    pub target: String,
    /// The request as given (before any capping).
    pub request: PlanRequest,
    /// Device memory, total.
    pub total_memory: u64,
    /// Device memory tm may use now.
    pub usable_memory: u64,
    /// Tensor-parallel ranks; every figure below is per rank.
    pub tp: usize,
    /// Ranks that share the device's memory (all of them on the CPU, else 1): the budget is
    /// divided among them.
    pub ranks_per_memory: usize,
    /// Whether the device shares memory with the host (host-side buffers then count).
    pub shared_with_host: bool,
    /// `usable_memory × memory_fraction / ranks_per_memory`: one rank's budget.
    pub budget: u64,
    /// Weights per (stored, held) encoding.
    pub weights_by_dtype: Vec<WeightGroup>,
    /// Bytes the backend holds for the weights (of one rank).
    pub weights_total: u64,
    /// Of `weights_total`, the bytes read in place from the checkpoint's pinned file pages
    /// (zero-copy targets; 0 elsewhere).
    pub weights_in_place: u64,
    /// Bytes those tensors (the rank's parts of them) take in the checkpoint.
    pub weights_stored: u64,
    /// Bytes of every tensor in the checkpoint, loaded or not.
    pub checkpoint_bytes: u64,
    /// Largest host conversion buffer while loading (transient).
    pub load_staging: u64,
    /// Whether `load_staging` is charged to the budget (devices sharing memory with the host).
    pub staging_counted: bool,
    /// Activation workspace for the largest step.
    pub workspace: u64,
    /// Rows of the per-token workspace buffers (`max_batched_tokens`).
    pub workspace_tokens: usize,
    /// Rows of the logits (`max_batch_size`).
    pub workspace_logit_rows: usize,
    /// Workspace bytes per token row (every per-token buffer).
    pub workspace_per_token: u64,
    /// Workspace bytes per logit row (final hidden state and logits).
    pub workspace_per_logit_row: u64,
    /// Kernel scratch allowance.
    pub kernel_scratch: ScratchPlan,
    /// Runtime reserve of the target.
    pub runtime_reserve: u64,
    /// Host buffers the backend keeps for its life (pinned staging).
    pub host_buffers: u64,
    /// Whether `host_buffers` is charged to the budget (devices sharing memory with the host).
    pub host_buffers_counted: bool,
    /// Dtype of activations (and of the KV cache with `--kv-cache-dtype auto`).
    pub activation_dtype: DType,
    /// The dtype KV-cache elements are stored in (the activation dtype, or f8e4m3).
    pub kv_dtype: DType,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Bytes of one KV block over all layers (keys and values).
    pub kv_bytes_per_block: u64,
    /// Blocks that fit in what the budget leaves (or in `kv_cache_bytes`).
    pub kv_blocks_fit: u64,
    /// Blocks to allocate.
    pub num_blocks: usize,
    /// `num_blocks × kv_bytes_per_block`.
    pub kv_bytes: u64,
    /// `num_blocks × block_size`.
    pub kv_tokens: usize,
    /// `weights + reserve + host buffers + max(staging, workspace + scratch) + kv` (host buffers
    /// and staging only where memory is shared with the host).
    pub peak: u64,
    /// The session length to use: the request's, capped by the model's context and the cache.
    pub max_len: usize,
    /// Whether the plan fits the budget with at least one KV block.
    pub fits: bool,
    /// Non-fatal findings (capped values), in numbers.
    pub warnings: Vec<String>,
    /// Informational notes (e.g. why the cache is smaller than the budget allows).
    pub notes: Vec<String>,
    /// When it does not fit: what is short, and which flags would make it fit.
    pub problems: Vec<String>,
}

/// Plans memory for serving `ckpt` on `target`, and fails (before anything is loaded or
/// allocated) when it does not fit, with the numbers and the flag to lower.
pub fn plan(ckpt: &Checkpoint, target: &PlanTarget, req: &PlanRequest) -> Result<MemoryPlan> {
    let p = estimate(ckpt, target, req)?;
    p.check()?;
    Ok(p)
}

/// Like [`plan`], but returns the plan even when it does not fit (`fits` is false and
/// `problems` says why); errors only for a bad request or checkpoint.
pub fn estimate(ckpt: &Checkpoint, target: &PlanTarget, req: &PlanRequest) -> Result<MemoryPlan> {
    req.validate()?;
    let cfg = &ckpt.config;
    // Every rank holds as much as rank 0 (even splits; replicated KV heads count on each).
    let layout = ShardLayout::new(cfg, ShardSpec { rank: 0, world: req.tp })?;
    let weights = manifest::summarize(ckpt.source.as_ref(), cfg, (target.weights, target.vectors), &layout)?;
    let sizer = Sizer {
        cfg,
        layout: &layout,
        target,
        kinds: WeightKinds { quantized: weights.any_quantized, half_matrix_cols: weights.half_matrix_cols },
        weights: weights.held,
        staging: if target.zero_copy { weights.staging_copied } else { weights.staging },
    };
    let ranks_per_memory = if target.kind == DeviceKind::Cpu { req.tp } else { 1 };
    let mut warnings = Vec::new();
    let mut notes = Vec::new();

    let mut max_len = req.max_len;
    let context = cfg.context_length().max(1);
    if max_len > context {
        warnings.push(format!(
            "--max-len {max_len} is longer than the model's context of {context} tokens; planning for {context}"
        ));
        max_len = context;
    }

    let (tokens, rows) = (req.max_batched_tokens, req.max_batch_size);
    let fixed = sizer.fixed(tokens, rows);
    let budget = (target.memory.usable as f64 * req.memory_fraction / ranks_per_memory as f64).floor() as u64;
    let kv_dtype = req.kv_cache_dtype.resolve(target.activation_dtype);
    let bpb = KvCache::bytes_per_block_shard(cfg, &layout, kv_dtype, req.block_size);
    if bpb == 0 {
        return Err(ModelError::InvalidInput(format!("{}: the model has no KV cache to plan", ckpt.path.display())));
    }
    let blocks_per_seq = max_len.div_ceil(req.block_size) as u64;
    let kv_room = match req.kv_cache_bytes {
        Some(n) => n,
        None => budget.saturating_sub(fixed.total),
    };
    let kv_blocks_fit = kv_room / bpb;
    let mut num_blocks = kv_blocks_fit;
    if req.kv_cache_bytes.is_none() {
        let useful = (rows as u64).saturating_mul(blocks_per_seq);
        if num_blocks > useful {
            notes.push(format!(
                "KV cache limited to --max-batch-size {rows} × {blocks_per_seq} blocks per {max_len}-token sequence \
                 = {useful} blocks ({}); the budget would hold {kv_blocks_fit}",
                human(useful * bpb)
            ));
            num_blocks = useful;
        }
    }
    let num_blocks = usize::try_from(num_blocks).unwrap_or(usize::MAX);
    let kv_bytes = num_blocks as u64 * bpb;
    let peak = fixed.total.saturating_add(kv_bytes);
    let fits = num_blocks >= 1 && peak <= budget;
    let kv_tokens = num_blocks.saturating_mul(req.block_size);

    if fits && kv_tokens < max_len {
        let need = blocks_per_seq.saturating_mul(bpb);
        let remedy = match req.kv_cache_bytes {
            Some(_) => format!("raise --kv-cache-bytes to at least {need}"),
            None => format!(
                "find {} more: lower --max-batched-tokens or --max-batch-size, raise --memory-fraction, or use a \
                 smaller model",
                human(need - kv_bytes)
            ),
        };
        warnings.push(format!(
            "the KV cache holds {num_blocks} blocks × {} tokens = {kv_tokens} tokens ({}), less than one --max-len \
             {max_len} sequence ({blocks_per_seq} blocks, {}); max_len capped to {kv_tokens}. To keep {max_len}, \
             {remedy}",
            req.block_size,
            human(kv_bytes),
            human(need),
        ));
        max_len = kv_tokens;
    }

    let mut plan = MemoryPlan {
        model: ckpt
            .path
            .file_name()
            .map_or_else(|| ckpt.path.display().to_string(), |n| n.to_string_lossy().into_owned()),
        target: target.name.clone(),
        request: req.clone(),
        total_memory: target.memory.total,
        usable_memory: target.memory.usable,
        tp: req.tp,
        ranks_per_memory,
        shared_with_host: target.memory.shared_with_host,
        budget,
        weights_by_dtype: weights.groups.clone(),
        weights_total: weights.held,
        weights_in_place: if target.zero_copy { weights.as_stored } else { 0 },
        weights_stored: weights.stored,
        checkpoint_bytes: ckpt.source.total_bytes(),
        load_staging: sizer.staging,
        staging_counted: target.memory.shared_with_host,
        workspace: fixed.workspace,
        workspace_tokens: tokens,
        workspace_logit_rows: rows,
        workspace_per_token: workspace_parts(&layout, target.activation_dtype, 1, 0).0,
        workspace_per_logit_row: workspace_parts(&layout, target.activation_dtype, 0, 1).1,
        kernel_scratch: fixed.scratch,
        runtime_reserve: target.reserve_bytes,
        host_buffers: target.host_buffers,
        host_buffers_counted: target.memory.shared_with_host,
        activation_dtype: target.activation_dtype,
        kv_dtype,
        block_size: req.block_size,
        kv_bytes_per_block: bpb,
        kv_blocks_fit,
        num_blocks,
        kv_bytes,
        kv_tokens,
        peak,
        max_len,
        fits,
        warnings,
        notes,
        problems: Vec::new(),
    };
    if !fits {
        plan.problems = sizer.explain(&plan, req, blocks_per_seq);
    }
    Ok(plan)
}

/// Everything but the KV cache, for one request shape.
#[derive(Clone, Copy, Debug)]
struct Fixed {
    workspace: u64,
    scratch: ScratchPlan,
    /// `weights + reserve + host buffers + max(staging, workspace + scratch)`.
    total: u64,
}

struct Sizer<'a> {
    cfg: &'a ModelConfig,
    layout: &'a ShardLayout,
    target: &'a PlanTarget,
    kinds: WeightKinds,
    weights: u64,
    staging: u64,
}

impl Sizer<'_> {
    fn staging_counted(&self) -> u64 {
        if self.target.memory.shared_with_host {
            self.staging
        } else {
            0
        }
    }

    fn host_buffers_counted(&self) -> u64 {
        if self.target.memory.shared_with_host {
            self.target.host_buffers
        } else {
            0
        }
    }

    fn fixed(&self, tokens: usize, rows: usize) -> Fixed {
        let workspace = workspace_bytes_shard(self.layout, self.target.activation_dtype, tokens, rows);
        let scratch = scratch_bytes(self.cfg, self.target.kind, self.target.activation_dtype, tokens, rows, self.kinds);
        let total = self.weights
            + self.target.reserve_bytes
            + self.host_buffers_counted()
            + self.staging_counted().max(workspace + scratch.total);
        Fixed { workspace, scratch, total }
    }

    /// Why `plan` does not fit, and what would make it fit.
    fn explain(&self, plan: &MemoryPlan, req: &PlanRequest, blocks_per_seq: u64) -> Vec<String> {
        let bpb = plan.kv_bytes_per_block;
        let budget = plan.budget;
        let need = (plan.peak - plan.kv_bytes).saturating_add(plan.kv_bytes.max(bpb));
        let too_small = req.kv_cache_bytes.filter(|&n| n < bpb);
        let mut out = vec![if let (Some(n), true) = (too_small, need <= budget) {
            // Memory is not the problem: the cache asked for holds no block.
            format!(
                "{} on {}: a KV cache of {n} bytes holds no block (one is {} bytes); the rest fits in the budget of {}",
                plan.model,
                plan.target,
                bpb,
                human(budget)
            )
        } else {
            format!(
                "{} does not fit on {}: it needs {}{} but the budget is {} ({} × {} usable{}): short by {} ({} bytes)",
                plan.model,
                plan.target,
                human(need),
                if plan.tp > 1 { format!(" per rank of {}", plan.tp) } else { String::new() },
                human(budget),
                req.memory_fraction,
                human(plan.usable_memory),
                if plan.ranks_per_memory > 1 { format!(" / {} ranks", plan.ranks_per_memory) } else { String::new() },
                human(need.saturating_sub(budget)),
                need.saturating_sub(budget),
            )
        }];
        let mut parts = vec![
            format!("weights {}", human(plan.weights_total)),
            format!(
                "workspace {} ({} tokens, {} logit rows)",
                human(plan.workspace),
                plan.workspace_tokens,
                plan.workspace_logit_rows
            ),
            format!("kernel scratch {}", human(plan.kernel_scratch.total)),
        ];
        if plan.staging_counted && plan.load_staging > plan.workspace + plan.kernel_scratch.total {
            parts.push(format!("load staging {}", human(plan.load_staging)));
        }
        if plan.runtime_reserve > 0 {
            parts.push(format!("runtime reserve {}", human(plan.runtime_reserve)));
        }
        if plan.host_buffers_counted && plan.host_buffers > 0 {
            parts.push(format!("host buffers {}", human(plan.host_buffers)));
        }
        match req.kv_cache_bytes {
            Some(n) => parts.push(format!("KV cache {} (--kv-cache-bytes {n})", human(plan.kv_bytes))),
            None => parts.push(format!("KV cache at least one block of {}", human(bpb))),
        }
        out.push(format!("needed: {}", parts.join(", ")));

        let weights_alone =
            self.weights + self.target.reserve_bytes + self.host_buffers_counted() + self.staging_counted();
        if req.kv_cache_bytes.is_some_and(|n| n < bpb) {
            out.push(format!(
                "--kv-cache-bytes {} is less than one KV block ({} bytes = {} tokens over {} layers): raise it",
                req.kv_cache_bytes.unwrap_or(0),
                bpb,
                req.block_size,
                self.cfg.num_layers
            ));
            return out;
        }
        if weights_alone >= budget {
            let mut m = format!(
                "the weights alone need {} (plus {} staging and reserve), more than the budget of {}: use a smaller \
                 or more quantized model",
                human(self.weights),
                human(weights_alone - self.weights),
                human(budget)
            );
            if plan.weights_total > plan.weights_stored {
                let _ = write!(
                    m,
                    " (this backend holds them as {}: {} in the file)",
                    plan.weights_by_dtype.iter().map(|g| g.held.as_str()).collect::<Vec<_>>().join("/"),
                    human(plan.weights_stored)
                );
            }
            out.push(m);
        }
        // The cache the suggestions aim for: the requested bytes, or one full sequence.
        let kv_need = match req.kv_cache_bytes {
            Some(n) => n / bpb * bpb,
            None => blocks_per_seq.saturating_mul(bpb),
        };
        let fits_with = |tokens: usize, rows: usize| self.fixed(tokens, rows).total.saturating_add(kv_need) <= budget;
        let mut fixes = Vec::new();
        if let Some(t) = largest(1, req.max_batched_tokens, |t| fits_with(t, req.max_batch_size.min(t))) {
            if t < req.max_batch_size {
                fixes.push(format!("--max-batched-tokens {t} --max-batch-size {t}"));
            } else {
                fixes.push(format!("--max-batched-tokens {t}"));
            }
        }
        if let Some(b) = largest(1, req.max_batch_size, |b| fits_with(req.max_batched_tokens, b)) {
            fixes.push(format!("--max-batch-size {b}"));
        }
        let fixed_now = self.fixed(req.max_batched_tokens, req.max_batch_size).total;
        if let Some(n) = req.kv_cache_bytes {
            let room = budget.saturating_sub(fixed_now) / bpb * bpb;
            if room >= bpb && room < n {
                fixes.push(format!("--kv-cache-bytes {room}"));
            }
        }
        let needed = fixed_now.saturating_add(kv_need);
        let fraction = needed as f64 * plan.ranks_per_memory as f64 / plan.usable_memory.max(1) as f64;
        if fraction <= 1.0 && fraction > req.memory_fraction {
            fixes.push(format!("--memory-fraction {:.2}", (fraction * 100.0).ceil() / 100.0));
        }
        if fixes.is_empty() {
            if weights_alone < budget {
                out.push(
                    "no setting of --max-batched-tokens or --max-batch-size makes it fit: use a smaller or \
                          more quantized model"
                        .into(),
                );
            }
        } else {
            let what = match req.kv_cache_bytes {
                Some(_) => "the requested KV cache".to_string(),
                None => format!("a cache for one {}-token sequence", plan.max_len),
            };
            out.push(format!("to fit with {what}, lower a flag: {}", fixes.join(", or ")));
        }
        out
    }
}

/// The largest `v` in `lo..hi` (hi exclusive) with `ok(v)`, for `ok` true up to some point and
/// false after.
fn largest(lo: usize, hi: usize, ok: impl Fn(usize) -> bool) -> Option<usize> {
    if hi <= lo || !ok(lo) {
        return None;
    }
    let (mut good, mut bad) = (lo, hi);
    while bad - good > 1 {
        let mid = good + (bad - good) / 2;
        if ok(mid) {
            good = mid;
        } else {
            bad = mid;
        }
    }
    Some(good)
}

/// Bytes of `llama::Workspace::new(ops, cfg, tokens, logit_rows)` in dtype `dt` (mirrors its
/// buffers one for one; both counts are at least 1, as there).
pub fn workspace_bytes(cfg: &ModelConfig, dt: DType, tokens: usize, logit_rows: usize) -> u64 {
    workspace_bytes_shard(&ShardLayout::single(cfg), dt, tokens, logit_rows)
}

/// Bytes of `llama::Workspace::for_shard(ops, layout, tokens, logit_rows)` in dtype `dt`: one
/// tensor-parallel rank's workspace.
pub fn workspace_bytes_shard(layout: &ShardLayout, dt: DType, tokens: usize, logit_rows: usize) -> u64 {
    let (per_token, per_row) = workspace_parts(layout, dt, tokens.max(1), logit_rows.max(1));
    per_token + per_row
}

/// `(per-token buffers, logit-row buffers)` of the workspace for `tokens` and `rows`: residual,
/// normed, delta (hidden); q, scratch_q, attn (q_dim); k, v, scratch_k (kv_dim); gate, up, act
/// (intermediate), at the rank's widths; and last (hidden) and logits (vocab) per logit row, plus
/// the rank's slice of the logits and every rank's slices when the LM head is vocab-parallel.
fn workspace_parts(layout: &ShardLayout, dt: DType, tokens: usize, rows: usize) -> (u64, u64) {
    let widths = [layout.hidden, layout.q_dim(), layout.kv_dim(), layout.intermediate_size()];
    let per_token: usize = widths.iter().map(|&w| 3 * dt.storage_bytes(tokens * w)).sum();
    let mut per_row = dt.storage_bytes(rows * layout.hidden) + dt.storage_bytes(rows * layout.vocab_size);
    if layout.gathers_logits() {
        per_row += (1 + layout.spec.world) * dt.storage_bytes(rows * layout.vocab_rows());
    }
    (per_token as u64, per_row as u64)
}

/// What of the weights the kernel scratch depends on.
#[derive(Clone, Copy, Debug)]
struct WeightKinds {
    /// Any matrix is int4/int8.
    quantized: bool,
    /// The most columns of a dense matrix held as f16/bf16 (zero: none).
    half_matrix_cols: usize,
}

/// The kernel scratch allowance (see the module docs).
fn scratch_bytes(
    cfg: &ModelConfig,
    kind: DeviceKind,
    dt: DType,
    tokens: usize,
    rows: usize,
    weights: WeightKinds,
) -> ScratchPlan {
    let sampler = (rows * cfg.vocab_size * 4) as u64;
    let quantized = weights.quantized;
    let (activation_quant, attention, dense_panels) = if kind == DeviceKind::Cpu {
        let cols = cfg.hidden_size.max(cfg.intermediate_size).max(cfg.q_dim());
        // int8 values, plus two f32 per 32-block with the block count rounded up to 8.
        let quant = if quantized { (tokens * (cols + 8 * cols.div_ceil(32).div_ceil(8) * 8)) as u64 } else { 0 };
        let panels = if weights.half_matrix_cols > 0 && tokens > tm_cpu::matmul_16bit::FUSED_MAX_ROWS {
            tm_cpu::matmul_16bit::panel_scratch_bytes(weights.half_matrix_cols)
        } else {
            0
        };
        (quant, (tokens * 16) as u64, panels)
    } else {
        (0, 0, 0)
    };
    // The CUDA backend reserves it for f16/bf16 models with int4 weights (charged here for any
    // quantized model: the manifest does not tell int4 from int8; int8 models are rare).
    let slab_policy = tm_core::q4_slab::SlabPolicy::from_env();
    let q4_slab = if kind == DeviceKind::Cuda
        && quantized
        && matches!(dt, DType::F16 | DType::BF16)
        && slab_policy.wants_scratch(tokens.max(1))
    {
        tm_core::q4_slab::SLAB_BYTES as u64
    } else {
        0
    };
    let allowance = if kind == DeviceKind::Cpu { CPU_SCRATCH_ALLOWANCE } else { SCRATCH_ALLOWANCE };
    ScratchPlan {
        sampler,
        activation_quant,
        attention,
        dense_panels,
        q4_slab,
        allowance,
        total: sampler + activation_quant + attention + dense_panels + q4_slab + allowance,
    }
}

/// `1.23 GiB`-style sizes.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.2} {}", UNITS[unit])
}

impl MemoryPlan {
    /// `Ok` when the plan fits; otherwise an error with every component in bytes and the flags
    /// that would make it fit.
    pub fn check(&self) -> Result<()> {
        if self.fits {
            Ok(())
        } else {
            Err(ModelError::InvalidInput(self.problems.join("\n")))
        }
    }

    /// The plan as pretty-printed JSON.
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string_pretty(self).map_err(|e| ModelError::InvalidInput(format!("plan as JSON: {e}")))
    }

    /// The plan as an aligned, human-readable table.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "memory plan for {} on {}", self.model, self.target);
        if self.tp > 1 {
            let _ = writeln!(
                s,
                "tensor parallelism: {} ranks; every figure is per rank{}",
                self.tp,
                if self.ranks_per_memory > 1 {
                    format!(
                        " (the {} ranks share this memory: each gets 1/{} of it)",
                        self.ranks_per_memory, self.ranks_per_memory
                    )
                } else {
                    String::new()
                }
            );
        }
        let _ = writeln!(
            s,
            "device memory: {} total, {} usable{}",
            human(self.total_memory),
            human(self.usable_memory),
            if self.shared_with_host { ", shared with the host" } else { "" }
        );
        let _ = writeln!(
            s,
            "budget: {} = {} × usable{}{}",
            human(self.budget),
            self.request.memory_fraction,
            if self.ranks_per_memory > 1 { format!(" / {} ranks", self.ranks_per_memory) } else { String::new() },
            self.request
                .kv_cache_bytes
                .map_or(String::new(), |n| format!(" (KV cache fixed at {}: --kv-cache-bytes {n})", human(n)))
        );
        let _ = writeln!(s);
        let mut rows: Vec<(String, String, String)> = Vec::new();
        let mut row = |a: String, b: u64, c: String| rows.push((a, human(b), c));
        let tensors: usize = self.weights_by_dtype.iter().map(|g| g.tensors).sum();
        let mut detail = if self.tp > 1 {
            format!("this rank's share of {tensors} tensors: {} of the file", human(self.weights_stored))
        } else {
            format!("{tensors} tensors, {} in the file", human(self.weights_stored))
        };
        if self.tp == 1 && self.checkpoint_bytes > self.weights_stored {
            let _ = write!(
                detail,
                " (+{} in tensors tm does not load)",
                human(self.checkpoint_bytes - self.weights_stored)
            );
        }
        row("weights".into(), self.weights_total, detail);
        if self.weights_in_place > 0 {
            row(
                "  read in place".into(),
                self.weights_in_place,
                "zero-copy: the GPU reads the checkpoint's pinned file pages (no copy, no staging)".into(),
            );
        }
        for g in &self.weights_by_dtype {
            row(
                format!("  {} -> {}", g.stored, g.held),
                g.held_bytes,
                format!(
                    "{} tensor{}, {} stored",
                    g.tensors,
                    if g.tensors == 1 { "" } else { "s" },
                    human(g.stored_bytes)
                ),
            );
        }
        row(
            "load staging".into(),
            self.load_staging,
            if self.staging_counted {
                "largest conversion buffer while loading; freed before serving".into()
            } else {
                "host memory while loading; not on the device".into()
            },
        );
        let (per_token, per_row) = (self.workspace_per_token, self.workspace_per_logit_row);
        row(
            "workspace".into(),
            self.workspace,
            format!(
                "{} tokens × {} + {} logit rows × {} ({})",
                self.workspace_tokens,
                human(per_token),
                self.workspace_logit_rows,
                human(per_row),
                self.activation_dtype
            ),
        );
        let k = &self.kernel_scratch;
        let mut detail = format!("sampler logits {}", human(k.sampler));
        if k.activation_quant > 0 {
            let _ = write!(detail, ", int8 activations {}", human(k.activation_quant));
        }
        if k.attention > 0 {
            let _ = write!(detail, ", attention {}", human(k.attention));
        }
        if k.dense_panels > 0 {
            let _ = write!(detail, ", 16-bit weight panels {}", human(k.dense_panels));
        }
        if k.q4_slab > 0 {
            let _ = write!(detail, ", int4 slab {}", human(k.q4_slab));
        }
        let _ = write!(detail, ", allowance {}", human(k.allowance));
        row("kernel scratch".into(), k.total, detail);
        row("runtime reserve".into(), self.runtime_reserve, String::new());
        if self.host_buffers > 0 {
            row(
                "host buffers".into(),
                self.host_buffers,
                if self.host_buffers_counted {
                    "pinned staging buffer, for the backend's life".into()
                } else {
                    "pinned staging buffer in host memory; not on the device".into()
                },
            );
        }
        row(
            "KV cache".into(),
            self.kv_bytes,
            format!(
                "{} blocks × {} ({} tokens, {}) = {} tokens",
                self.num_blocks,
                human(self.kv_bytes_per_block),
                self.block_size,
                self.kv_dtype,
                self.kv_tokens
            ),
        );
        row(
            "peak".into(),
            self.peak,
            if self.host_buffers_counted && self.host_buffers > 0 {
                "weights + reserve + host buffers + max(staging, workspace + scratch) + KV cache".into()
            } else {
                "weights + reserve + max(staging, workspace + scratch) + KV cache".into()
            },
        );
        let headroom = if self.peak <= self.budget {
            ("headroom".to_string(), human(self.budget - self.peak), "budget − peak".to_string())
        } else {
            ("SHORT BY".to_string(), human(self.peak - self.budget), "peak − budget".to_string())
        };
        rows.push(headroom);
        let w0 = rows.iter().map(|r| r.0.chars().count()).max().unwrap_or(0);
        let w1 = rows.iter().map(|r| r.1.chars().count()).max().unwrap_or(0);
        let _ = writeln!(s, "{:<w0$}  {:>w1$}  detail", "component", "bytes");
        for (a, b, c) in &rows {
            if a == "peak" {
                let _ = writeln!(s, "{}", "-".repeat(w0 + w1 + 4));
            }
            let _ = writeln!(s, "{}", format!("{a:<w0$}  {b:>w1$}  {c}").trim_end());
        }
        let _ = writeln!(s);
        let per_seq = self.max_len.div_ceil(self.block_size.max(1));
        let _ = writeln!(
            s,
            "max_len {}: one sequence takes {per_seq} blocks ({}); the cache holds {} such sequences at once \
             (--max-batch-size {}, --max-batched-tokens {})",
            self.max_len,
            human(per_seq as u64 * self.kv_bytes_per_block),
            self.num_blocks / per_seq.max(1),
            self.request.max_batch_size,
            self.request.max_batched_tokens,
        );
        for n in &self.notes {
            let _ = writeln!(s, "note: {n}");
        }
        for w in &self.warnings {
            let _ = writeln!(s, "warning: {w}");
        }
        if self.fits {
            let _ = writeln!(s, "fits: peak {} of a {} budget", human(self.peak), human(self.budget));
        } else {
            let _ = writeln!(s, "DOES NOT FIT: {}", self.problems.first().map_or("", String::as_str));
        }
        s
    }
}
