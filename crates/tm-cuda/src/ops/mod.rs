//! tm-core's `Ops` on one CUDA GPU.
//!
//! Every kernel runs on the GPU's one stream, in call order; only `download`, `sample` and
//! `download_f32` wait for it. Activations, dense weights and the KV cache are in the backend's
//! dtype (bf16, f16 or f32); int4/int8 weights stay packed and are dequantized inside the matrix
//! kernels, or, for large batches, a slab of rows at a time into a fixed scratch buffer that
//! cuBLASLt then multiplies ([`q4_slab`]). Dense products go through cuBLASLt.

mod deferred;
mod fused;
mod graphs;
mod meta;
mod q4_slab;
mod rope_kv;

pub use q4_slab::{set_slab_policy, slab_products};

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use tm_core::checks::{self, rows_of, same_numel};
use tm_core::ops::{AttentionMeta, DeferredNorm, SampleRequest};
use tm_core::quant::{QuantWeight, Weight};
use tm_core::rope::{RopeFreqs, RopeStyle};
use tm_core::{Allocator, Buffer, DType, Device, Error, Ops, Result, Tensor, TensorDesc};

use crate::allocator::CudaAllocator;
use crate::blas::Blas;
use crate::kernels::{attention as attn, elementwise as ew, q4_gemm, quant, sampling};
use crate::runtime::{Gpu, LaunchMode};
use crate::staging::Staging;
use crate::CudaDevice;
use meta::{MetaBuffers, Slot};

/// How to open a [`CudaBackend`].
#[derive(Clone, Debug)]
pub struct CudaOptions {
    /// Device ordinal.
    pub ordinal: usize,
    /// Activation (and dense weight, KV cache) dtype: `BF16`, `F16` or `F32`.
    pub dtype: DType,
    /// Hard cap on device memory tm may take, in bytes (`None`: the device's usable memory).
    pub memory_cap: Option<u64>,
    /// Replay repeated steps (decoding) as CUDA graphs.
    pub cuda_graphs: bool,
    /// Discrete or unified memory variant and the unified variant's host reserve
    /// ([`crate::memory_model`]); the default is `auto`.
    pub memory_model: crate::MemoryConfig,
}

/// Bytes of the pinned staging buffer for host↔device copies.
const STAGING_BYTES: usize = 32 << 20;

/// Host-side scratch reused between calls, and the device buffers it feeds.
#[derive(Debug, Default)]
struct StepState {
    meta: MetaBuffers,
    attn_host: Vec<u32>,
    sample_inputs: sampling::SampleInputs,
    scratch: Option<Buffer>,
    /// The split counters of the fused decode-attention combine: zero-filled when allocated (and
    /// when grown); every attention call leaves them zero. Nothing else may use them.
    attn_counters: Option<Buffer>,
    tokens: Option<Buffer>,
    tokens_host: Vec<u32>,
}

/// tm-core's `Ops` on one CUDA GPU.
#[derive(Debug)]
pub struct CudaBackend {
    gpu: Arc<Gpu>,
    device: Arc<CudaDevice>,
    allocator: Arc<dyn Allocator>,
    cuda_allocator: Arc<CudaAllocator>,
    staging: Staging,
    blas: Blas,
    dtype: DType,
    state: Mutex<StepState>,
    graphs: Option<Mutex<graphs::GraphCache>>,
    /// The early-replay state of the step being recorded ([`graphs::Early`]).
    early: Mutex<graphs::Early>,
    /// The int4 slab buffer of large-batch int4 products, once reserved ([`q4_slab`]).
    slab: OnceLock<Buffer>,
}

fn ptr(t: &Tensor) -> u64 {
    t.buffer().addr()
}

/// The device address of an int4 weight's mins (an error for an int4 weight without them).
fn int4_mins(q: &QuantWeight) -> Result<u64> {
    q.mins.as_ref().map(ptr).ok_or_else(|| Error::invalid("int4 weight without mins"))
}

fn as_bytes<T: bytemuck::Pod>(v: &[T]) -> &[u8] {
    bytemuck::cast_slice(v)
}

impl CudaBackend {
    /// Opens the GPU, loads the kernels and reserves the staging and cuBLASLt workspaces.
    pub fn open(opts: CudaOptions) -> Result<CudaBackend> {
        if !matches!(opts.dtype, DType::BF16 | DType::F16 | DType::F32) {
            return Err(Error::invalid(format!("the CUDA backend computes in bf16, f16 or f32, not {}", opts.dtype)));
        }
        Self::open_on(Gpu::open(opts.ordinal)?, opts)
    }

    /// Like [`CudaBackend::open`], on a GPU already opened (`opts.ordinal` is ignored): tensor
    /// parallelism opens every rank's [`Gpu`] first, creates the NCCL communicators on their
    /// streams, then each rank's thread opens its backend on its GPU, so collectives and kernels
    /// share one stream.
    pub fn open_on(gpu: Arc<Gpu>, opts: CudaOptions) -> Result<CudaBackend> {
        if !matches!(opts.dtype, DType::BF16 | DType::F16 | DType::F32) {
            return Err(Error::invalid(format!("the CUDA backend computes in bf16, f16 or f32, not {}", opts.dtype)));
        }
        let opts = CudaOptions { ordinal: gpu.info().ordinal, ..opts };
        gpu.bind()?;
        let device = Arc::new(CudaDevice::with_memory(opts.ordinal, opts.memory_model)?);
        let usable = device.memory_info()?.usable;
        let cap = opts.memory_cap.map_or(usable, |c| c.min(usable));
        let dev = device.clone() as Arc<dyn Device>;
        let cuda_allocator = if device.memory_model() == crate::MemoryModel::Unified {
            tracing::info!("cuda device {}: unified memory, {}", opts.ordinal, device.system_memory().describe());
            CudaAllocator::new_unified(Arc::clone(&gpu), dev, cap, crate::memory_model::UNIFIED_CACHE_LIMIT)
        } else {
            CudaAllocator::new(Arc::clone(&gpu), dev, cap)
        };
        let allocator: Arc<dyn Allocator> = cuda_allocator.clone();
        let staging = Staging::new(Arc::clone(&gpu), STAGING_BYTES)?;
        let blas = Blas::new(Arc::clone(&gpu), &allocator)?;
        Ok(CudaBackend {
            gpu,
            device,
            allocator,
            cuda_allocator,
            staging,
            blas,
            dtype: opts.dtype,
            state: Mutex::new(StepState::default()),
            graphs: opts.cuda_graphs.then(|| Mutex::new(graphs::GraphCache::default())),
            early: Mutex::new(graphs::Early::default()),
            slab: OnceLock::new(),
        })
    }

    /// The GPU's driver state.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// CUDA graph use so far: (steps replayed from a graph, steps run eagerly, graphs captured);
    /// `None` when graphs are off.
    pub fn graph_stats(&self) -> Option<(u64, u64, u64)> {
        let cache = self.graphs.as_ref()?.lock().ok()?;
        Some((cache.counts[0], cache.counts[1], cache.counts[2]))
    }

    /// Early replays so far (`graphs`: a predicted graph launched before its step finished
    /// recording): (those that matched their step, those that did not, after which the step ran
    /// again eagerly); `None` when graphs are off.
    pub fn early_replay_stats(&self) -> Option<(u64, u64)> {
        let cache = self.graphs.as_ref()?.lock().ok()?;
        Some(cache.early)
    }

    /// The capped caching allocator.
    pub fn cuda_allocator(&self) -> &Arc<CudaAllocator> {
        &self.cuda_allocator
    }

    fn state(&self) -> Result<MutexGuard<'_, StepState>> {
        self.state.lock().map_err(|_| Error::invalid("cuda backend state poisoned by an earlier panic"))
    }

    fn check(&self, t: &Tensor, what: &str) -> Result<()> {
        t.expect_dtype(what, self.dtype)
    }

    /// The KV caches' dtype: both the activation dtype, or both FP8 E4M3.
    fn check_kv(&self, k_cache: &Tensor, v_cache: &Tensor) -> Result<DType> {
        let kv = k_cache.dtype();
        if !self.supports_kv_cache_dtype(kv) {
            return Err(Error::DType {
                op: "k cache".into(),
                expected: format!("{} or f8e4m3", self.dtype),
                got: kv.to_string(),
            });
        }
        v_cache.expect_dtype("v cache", kv)?;
        Ok(kv)
    }

    /// Uploads a small input into its per-kind device buffer. While a graph is being captured
    /// the buffers must already hold the step's inputs (the eager run just uploaded them).
    fn put(&self, st: &mut StepState, slot: Slot, bytes: &[u8]) -> Result<u64> {
        let capturing = self.gpu.mode() == LaunchMode::Capture;
        st.meta.put(slot, bytes, &self.allocator, &self.staging, !capturing)
    }

    /// A device scratch buffer of at least `bytes` (grown, never shrunk).
    fn scratch(&self, st: &mut StepState, bytes: usize) -> Result<u64> {
        self.grown(&mut st.scratch, bytes, "scratch buffer")
    }

    /// `buf` grown to at least `bytes` (never shrunk; new bytes are zero-filled, as the allocator
    /// zero-fills and growth copies the old contents), and its address. Refused while a CUDA graph
    /// is being captured.
    fn grown(&self, buf: &mut Option<Buffer>, bytes: usize, what: &str) -> Result<u64> {
        if self.gpu.mode() == LaunchMode::Capture && buf.as_ref().is_none_or(|b| b.len() < bytes.max(1)) {
            return Err(Error::Backend {
                backend: "cuda".into(),
                message: format!("the {what} grew while a CUDA graph was being captured"),
            });
        }
        match buf.as_mut() {
            Some(b) => b.grow(bytes.max(1), "workspace")?,
            None => *buf = Some(Buffer::new(&self.allocator, bytes.max(1), "workspace")?),
        }
        Ok(buf.as_ref().map_or(0, Buffer::addr))
    }

    /// Up to three int4 products of one `x` (`qs[i]` into `outs[i]`, no biases) in one launch of
    /// the prefill GEMM ([`quant::matmul_q4_grouped`]: decode batches of 9 to 64 tokens on sm_90a),
    /// queued under the state lock as a split product is. `Ok(false)`, nothing queued, when that
    /// launch does not take them.
    fn q4_grouped(&self, x: &Tensor, qs: &[&QuantWeight], outs: &mut [&mut Tensor]) -> Result<bool> {
        let Some(first) = qs.first() else { return Ok(false) };
        let (cols, group) = (first.cols, first.group_size);
        if qs.len() != outs.len() || qs.iter().any(|q| q.cols != cols || q.group_size != group) {
            return Ok(false);
        }
        let n = rows_of("matmul input", x, cols)?;
        if !q4_gemm::groups(n) {
            return Ok(false);
        }
        self.check(x, "matmul input")?;
        let mut parts = Vec::with_capacity(qs.len());
        for (q, out) in qs.iter().zip(outs.iter()) {
            if out.numel() != n * q.rows {
                return Err(Error::shape("matmul output", [n, q.rows], out.shape()));
            }
            self.check(out, "matmul output")?;
            let mins = int4_mins(q)?;
            parts.push(q4_gemm::Part {
                out: ptr(out),
                packed: ptr(&q.packed),
                scales: ptr(&q.scales),
                mins,
                rows: q.rows,
                layout: q.layout,
            });
        }
        let partials = self.slab.get().map(|b| (b.addr(), b.len()));
        let _serial = partials.map(|_| self.state()).transpose()?;
        quant::matmul_q4_grouped(&self.gpu, partials, self.dtype, ptr(x), n, cols, group, &parts)
    }

    fn quant_matmul(&self, x: &Tensor, q: &QuantWeight, int4: bool, n: usize, out: &mut Tensor) -> Result<()> {
        if int4 {
            if self.try_q4_gemv(x, q, n, out)? || self.try_q4_slab(x, q, n, out)? {
                return Ok(());
            }
            let mins = int4_mins(q)?;
            // Below the slab path's batch size the slab buffer is free for the prefill GEMM's
            // split-K partial sums; a split product queues its GEMM and its sum under the state
            // lock, as a slab product does, so that threads sharing the backend cannot interleave
            // theirs in the buffer.
            let partials = self.slab.get().map(|b| (b.addr(), b.len()));
            let _serial = partials.map(|_| self.state()).transpose()?;
            quant::matmul_q4(
                &self.gpu,
                partials,
                self.dtype,
                ptr(out),
                ptr(x),
                ptr(&q.packed),
                ptr(&q.scales),
                mins,
                n,
                q.rows,
                q.cols,
                q.group_size,
                q.layout,
            )
        } else {
            quant::matmul_q8(
                &self.gpu,
                self.dtype,
                ptr(out),
                ptr(x),
                ptr(&q.packed),
                ptr(&q.scales),
                n,
                q.rows,
                q.cols,
                q.group_size,
            )
        }
    }
}

impl Ops for CudaBackend {
    fn device(&self) -> Arc<dyn Device> {
        self.device.clone()
    }
    fn allocator(&self) -> &Arc<dyn Allocator> {
        &self.allocator
    }
    fn activation_dtype(&self) -> DType {
        self.dtype
    }
    fn weight_dtype(&self, src: DType) -> DType {
        if src.is_float() {
            self.dtype
        } else {
            src
        }
    }
    fn supports_kv_cache_dtype(&self, dtype: DType) -> bool {
        dtype == self.dtype || dtype == DType::F8E4M3
    }

    fn reserve_matmul_scratch(&self, max_tokens: usize) -> Result<()> {
        self.gpu.bind()?;
        self.reserve_slab(max_tokens)
    }

    fn run_step(&self, step: &mut (dyn FnMut() -> Result<()> + Send)) -> Result<()> {
        self.gpu.bind()?;
        match &self.graphs {
            None => step(),
            Some(cache) => {
                let mut cache = cache.lock().map_err(|_| Error::invalid("cuda graph cache poisoned"))?;
                graphs::run_step(&self.gpu, &self.staging, &mut cache, &self.early, step)
            }
        }
    }

    fn step_inputs_ready(&self, logit_rows: &[u32]) -> Result<()> {
        if self.graphs.is_none() || self.gpu.mode() != LaunchMode::Record {
            return Ok(());
        }
        {
            // `gather_rows` puts the same bytes at the end of the step (a no-op then).
            let mut st = self.state()?;
            self.put(&mut st, Slot::Rows, as_bytes(logit_rows))?;
        }
        graphs::inputs_ready(&self.gpu, &self.staging, &self.early)
    }

    /// Tile-major for the lean decode kernels' shapes at f16/bf16
    /// ([`crate::kernels::q4_gemv::preferred_layout`]).
    fn int4_layout(&self, rows: usize, cols: usize, group_size: usize) -> tm_core::quant::Int4Layout {
        crate::kernels::q4_gemv::preferred_layout(self.dtype, rows, cols, group_size)
    }

    /// Tile-ordered scales and mins for tile-major int4 gate and up weights that the lean
    /// gate/up/SiLU kernel takes (`CudaBackend::tile_gate_up_scales`).
    fn prepare_gate_up(&self, gate: &mut Weight, up: &mut Weight) -> Result<()> {
        self.tile_gate_up_scales(gate, up)
    }

    fn upload(&self, dst: &mut Tensor, src: &[u8]) -> Result<()> {
        let n = dst.desc().bytes();
        if src.len() != n {
            return Err(Error::shape("upload", format!("{n} bytes"), format!("{} bytes", src.len())));
        }
        self.staging.upload(ptr(dst), src)
    }

    fn download(&self, src: &Tensor, dst: &mut [u8]) -> Result<()> {
        let n = src.desc().bytes();
        if dst.len() != n {
            return Err(Error::shape("download", format!("{n} bytes"), format!("{} bytes", dst.len())));
        }
        self.staging.download(ptr(src), dst)
    }

    fn load_dense(&self, src_dtype: DType, shape: &[usize], src: &[u8], phase: &str) -> Result<Tensor> {
        let desc = TensorDesc::new(src_dtype, shape);
        if src.len() != desc.bytes() {
            return Err(Error::shape(
                "load_dense",
                format!("{} bytes for {shape:?} {src_dtype}", desc.bytes()),
                src.len(),
            ));
        }
        let target = self.weight_dtype(src_dtype);
        // Unified memory: read a tensor already in the kernels' layout in place (zero-copy).
        if target == src_dtype && self.cuda_allocator.is_unified() {
            if let Some(t) = self.cuda_allocator.zero_copy_tensor(src, desc.clone())? {
                return Ok(t);
            }
        }
        let t = self.zeros(TensorDesc::new(target, shape), phase)?;
        if target == src_dtype {
            self.staging.upload(ptr(&t), src)?;
            return Ok(t);
        }
        // Convert a bounded chunk at a time: the host never holds a second copy of the tensor.
        let (in_size, out_size) = (src_dtype.storage_bytes(1), target.storage_bytes(1));
        let per_chunk = (4 << 20) / in_size.max(1);
        let mut converted = Vec::with_capacity(per_chunk * out_size);
        for (i, chunk) in src.chunks(per_chunk * in_size).enumerate() {
            let values = tm_core::ops::to_f32(src_dtype, chunk)?;
            converted.clear();
            match target {
                DType::F32 => converted.extend_from_slice(as_bytes(&values)),
                DType::F16 => {
                    values.iter().for_each(|v| converted.extend_from_slice(&half::f16::from_f32(*v).to_le_bytes()))
                }
                DType::BF16 => {
                    values.iter().for_each(|v| converted.extend_from_slice(&half::bf16::from_f32(*v).to_le_bytes()))
                }
                other => return Err(Error::invalid(format!("cannot convert weights to {other}"))),
            }
            self.staging.upload(ptr(&t) + (i * per_chunk * out_size) as u64, &converted)?;
        }
        Ok(t)
    }

    fn embedding(&self, table: &Weight, ids: &[u32], out: &mut Tensor) -> Result<()> {
        let hidden = checks::embedding(table, ids, out)?;
        self.check(out, "embedding output")?;
        let mut st = self.state()?;
        let ids_dev = self.put(&mut st, Slot::Ids, as_bytes(ids))?;
        let (g, dt, n) = (&self.gpu, self.dtype, ids.len());
        match table {
            Weight::Dense(t) => {
                self.check(t, "embedding table")?;
                ew::embedding(g, dt, ptr(out), ptr(t), ids_dev, n, hidden)
            }
            Weight::Int8(q) => {
                ew::embedding_q8(g, dt, ptr(out), ptr(&q.packed), ptr(&q.scales), ids_dev, n, hidden, q.group_size)
            }
            Weight::Int4(q) => {
                let mins = int4_mins(q)?;
                ew::embedding_q4(
                    g,
                    dt,
                    ptr(out),
                    ptr(&q.packed),
                    ptr(&q.scales),
                    mins,
                    ids_dev,
                    n,
                    hidden,
                    q.group_size,
                    (q.layout, q.rows),
                )
            }
        }
    }

    /// On the device: the embedding of the local ids (0 for tokens another rank holds), then
    /// `zero_rows` with a per-row mask, both always launched. The default's host round trip (a
    /// synchronous download, zeroing, an upload) would stall the stream, and it is not a kernel,
    /// so a CUDA graph recorded on a step whose tokens were all local would replay without it.
    fn embedding_slice(&self, table: &Weight, ids: &[u32], first_id: u32, out: &mut Tensor) -> Result<()> {
        let (rows, _) = table.dims();
        let inside = |id: u32| id.checked_sub(first_id).filter(|&l| (l as usize) < rows);
        let local: Vec<u32> = ids.iter().map(|&id| inside(id).unwrap_or(0)).collect();
        let keep: Vec<u32> = ids.iter().map(|&id| u32::from(inside(id).is_some())).collect();
        self.embedding(table, &local, out)?;
        let hidden = out.numel() / ids.len().max(1);
        let mut st = self.state()?;
        let keep_dev = self.put(&mut st, Slot::Keep, as_bytes(&keep))?;
        ew::zero_rows(&self.gpu, self.dtype, ptr(out), keep_dev, ids.len(), hidden)
    }

    fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f32, out: &mut Tensor) -> Result<()> {
        same_numel("rms_norm", x, out)?;
        let cols = weight.numel();
        let rows = rows_of("rms_norm", x, cols)?;
        for (t, what) in [(x, "rms_norm input"), (weight, "rms_norm weight"), (&*out, "rms_norm output")] {
            self.check(t, what)?;
        }
        ew::rms_norm(&self.gpu, self.dtype, ptr(out), ptr(x), ptr(weight), eps, rows, cols)
    }

    fn add_rms_norm(
        &self,
        x: &Tensor,
        residual: &mut Tensor,
        weight: &Tensor,
        eps: f32,
        out: &mut Tensor,
    ) -> Result<()> {
        same_numel("add_rms_norm", x, out)?;
        same_numel("add_rms_norm", x, residual)?;
        let cols = weight.numel();
        let rows = rows_of("add_rms_norm", x, cols)?;
        for (t, what) in [(x, "add_rms_norm input"), (&*residual, "residual"), (weight, "weight"), (&*out, "output")] {
            self.check(t, what)?;
        }
        ew::add_rms_norm(&self.gpu, self.dtype, ptr(out), ptr(residual), ptr(x), ptr(weight), eps, rows, cols)
    }

    fn matmul(&self, x: &Tensor, w: &Weight, bias: Option<&Tensor>, out: &mut Tensor) -> Result<()> {
        let (rows, cols) = w.dims();
        let n = rows_of("matmul input", x, cols)?;
        if out.numel() != n * rows {
            return Err(Error::shape("matmul output", [n, rows], out.shape()));
        }
        self.check(x, "matmul input")?;
        self.check(out, "matmul output")?;
        match w {
            Weight::Dense(t) => {
                self.check(t, "matmul weight")?;
                if !self.try_gemv(x, t, n, out)? {
                    self.blas.gemm(self.dtype, n, rows, cols, ptr(x), ptr(t), ptr(out))?;
                }
            }
            Weight::Int4(q) => self.quant_matmul(x, q, true, n, out)?,
            Weight::Int8(q) => self.quant_matmul(x, q, false, n, out)?,
        }
        if let Some(b) = bias {
            self.check(b, "bias")?;
            if b.numel() != rows {
                return Err(Error::shape("bias", [rows], b.shape()));
            }
            ew::add_bias(&self.gpu, self.dtype, ptr(out), ptr(b), n, rows)?;
        }
        Ok(())
    }

    fn rope(&self, x: &mut Tensor, positions: &[u32], freqs: &RopeFreqs) -> Result<()> {
        let head_dim = 2 * freqs.inv_freq.len();
        let tokens = positions.len();
        if tokens == 0 || head_dim == 0 || !x.numel().is_multiple_of(tokens * head_dim) {
            return Err(Error::shape("rope", format!("[{tokens}, heads * {head_dim}]"), x.shape()));
        }
        self.check(x, "rope input")?;
        let heads = x.numel() / (tokens * head_dim);
        let mut st = self.state()?;
        let pos = self.put(&mut st, Slot::Positions, as_bytes(positions))?;
        let inv = self.put(&mut st, Slot::InvFreq, as_bytes(&freqs.inv_freq))?;
        let interleaved = freqs.style == RopeStyle::Interleaved;
        ew::rope(&self.gpu, self.dtype, ptr(x), pos, inv, freqs.attention_factor, tokens, heads, head_dim, interleaved)
    }

    fn matmul_many(
        &self,
        x: &Tensor,
        weights: &[&Weight],
        biases: &[Option<&Tensor>],
        outs: &mut [&mut Tensor],
    ) -> Result<()> {
        if self.fused_matmul_many(x, weights, biases, outs)? {
            return Ok(());
        }
        tm_core::ops::matmul_each(self, x, weights, biases, outs)
    }

    fn gate_up_silu(
        &self,
        x: &Tensor,
        gate: &Weight,
        up: &Weight,
        gate_out: &mut Tensor,
        up_out: &mut Tensor,
        out: &mut Tensor,
    ) -> Result<()> {
        if self.fused_gate_up_silu(x, gate, up, out)? {
            return Ok(());
        }
        if let (Weight::Int4(g), Weight::Int4(u)) = (gate, up) {
            if self.q4_grouped(x, &[g, u], &mut [&mut *gate_out, &mut *up_out])? {
                return self.silu_mul(gate_out, up_out, out);
            }
        }
        tm_core::ops::gate_up_silu_unfused(self, x, gate, up, gate_out, up_out, out)
    }

    fn fill_zero(&self, t: &mut Tensor) -> Result<()> {
        // A kernel (not a memset) so that CUDA graphs record and replay it like the others.
        let words = t.desc().bytes() / 4;
        if words * 4 != t.desc().bytes() {
            return Err(Error::invalid(format!("fill_zero: {} bytes is not whole f32 words", t.desc().bytes())));
        }
        ew::fill_zero(&self.gpu, DType::F32, ptr(t), words)
    }

    fn defers_norm_joins(&self) -> bool {
        deferred::enabled()
    }

    fn matmul_add_rms_norm_deferred(
        &self,
        x: &Tensor,
        w: &Weight,
        residual: &mut Tensor,
        norm: &Tensor,
        eps: f32,
        out: &mut Tensor,
        sums: &mut Tensor,
        slot: usize,
    ) -> Result<bool> {
        self.join_deferred(x, w, residual, norm, eps, out, sums, slot)
    }

    fn finish_deferred_norm(&self, x: &mut Tensor, norm: &DeferredNorm<'_>) -> Result<()> {
        self.finish_norm(x, norm)
    }

    fn gate_up_silu_deferred(
        &self,
        x: &mut Tensor,
        norm: &DeferredNorm<'_>,
        gate: &Weight,
        up: &Weight,
        gate_out: &mut Tensor,
        up_out: &mut Tensor,
        out: &mut Tensor,
    ) -> Result<()> {
        if let (Weight::Int4(g), Weight::Int4(u)) = (gate, up) {
            let args = self.norm_args(norm)?;
            if self.fused_q4_gate_up_silu(x, g, u, out, Some(&args))? {
                return Ok(());
            }
        }
        self.finish_norm(x, norm)?;
        self.gate_up_silu(x, gate, up, gate_out, up_out, out)
    }

    fn qkv_rope_write_kv_deferred(
        &self,
        x: &mut Tensor,
        norm: &DeferredNorm<'_>,
        weights: [&Weight; 3],
        biases: [Option<&Tensor>; 3],
        mut qkv: [&mut Tensor; 3],
        k_cache: &mut Tensor,
        v_cache: &mut Tensor,
        positions: &[u32],
        freqs: &RopeFreqs,
        slot_mapping: &[u32],
    ) -> Result<()> {
        let (p, f, s) = (positions, freqs, slot_mapping);
        if self.fused_q4_qkv_rope(x, weights, biases, &mut qkv, k_cache, v_cache, p, f, s, Some(norm))? {
            return Ok(());
        }
        self.finish_norm(x, norm)?;
        self.qkv_rope_write_kv(x, weights, biases, qkv, k_cache, v_cache, positions, freqs, slot_mapping)
    }

    fn silu_mul(&self, gate: &Tensor, up: &Tensor, out: &mut Tensor) -> Result<()> {
        same_numel("silu_mul", gate, up)?;
        same_numel("silu_mul", gate, out)?;
        for (t, what) in [(gate, "gate"), (up, "up"), (&*out, "silu_mul output")] {
            self.check(t, what)?;
        }
        ew::silu_mul(&self.gpu, self.dtype, ptr(out), ptr(gate), ptr(up), out.numel())
    }

    fn add_in_place(&self, x: &mut Tensor, y: &Tensor) -> Result<()> {
        same_numel("add_in_place", x, y)?;
        self.check(x, "add_in_place")?;
        self.check(y, "addend")?;
        ew::add(&self.gpu, self.dtype, ptr(x), ptr(y), x.numel())
    }

    fn write_kv(
        &self,
        k: &Tensor,
        v: &Tensor,
        k_cache: &mut Tensor,
        v_cache: &mut Tensor,
        slot_mapping: &[u32],
    ) -> Result<()> {
        let width = checks::write_kv(k, v, k_cache, v_cache, slot_mapping)?;
        for (t, what) in [(k, "k"), (v, "v")] {
            self.check(t, what)?;
        }
        let kv = self.check_kv(k_cache, v_cache)?;
        let mut st = self.state()?;
        let s = self.put(&mut st, Slot::Slots, as_bytes(slot_mapping))?;
        let (kc, vc, n) = (ptr(k_cache), ptr(v_cache), slot_mapping.len());
        if kv == DType::F8E4M3 {
            return attn::write_kv_e4m3(&self.gpu, self.dtype, kc, vc, ptr(k), ptr(v), s, n, width);
        }
        ew::write_kv(&self.gpu, self.dtype, kc, vc, ptr(k), ptr(v), s, n, width)
    }

    fn rope_write_kv(
        &self,
        q: &mut Tensor,
        k: &mut Tensor,
        v: &Tensor,
        k_cache: &mut Tensor,
        v_cache: &mut Tensor,
        positions: &[u32],
        freqs: &RopeFreqs,
        slot_mapping: &[u32],
    ) -> Result<()> {
        if self.fused_rope_write_kv(q, k, v, k_cache, v_cache, positions, freqs, slot_mapping)? {
            return Ok(());
        }
        tm_core::ops::rope_write_kv_unfused(self, q, k, v, k_cache, v_cache, positions, freqs, slot_mapping)
    }

    fn qkv_rope_write_kv(
        &self,
        x: &Tensor,
        weights: [&Weight; 3],
        biases: [Option<&Tensor>; 3],
        mut qkv: [&mut Tensor; 3],
        k_cache: &mut Tensor,
        v_cache: &mut Tensor,
        positions: &[u32],
        freqs: &RopeFreqs,
        slot_mapping: &[u32],
    ) -> Result<()> {
        if self.fused_q4_qkv_rope(
            x,
            weights,
            biases,
            &mut qkv,
            k_cache,
            v_cache,
            positions,
            freqs,
            slot_mapping,
            None,
        )? {
            return Ok(());
        }
        tm_core::ops::qkv_rope_write_kv_unfused(
            self,
            x,
            weights,
            biases,
            qkv,
            k_cache,
            v_cache,
            positions,
            freqs,
            slot_mapping,
        )
    }

    fn attention(
        &self,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        meta: &AttentionMeta<'_>,
        out: &mut Tensor,
    ) -> Result<()> {
        let checks::AttentionDims { tokens, heads, kv_heads, head_dim, .. } =
            checks::attention(q, k_cache, v_cache, meta, out)?;
        for (t, what) in [(q, "q"), (&*out, "attention output")] {
            self.check(t, what)?;
        }
        let kv = self.check_kv(k_cache, v_cache)?;
        let ns = meta.seqs.len();
        let mut st = self.state()?;
        // One upload: q_start, q_len, ctx_len, bt_start (i32 each, `ns` of them), then the tables.
        let mut host = std::mem::take(&mut st.attn_host);
        host.clear();
        host.resize(4 * ns, 0);
        let (mut max_q, mut max_ctx) = (0usize, 0usize);
        for (i, s) in meta.seqs.iter().enumerate() {
            let needed = s.context_len.div_ceil(meta.block_size);
            let bt_start = host.len() - 4 * ns;
            host[i] = s.query_start as u32;
            host[ns + i] = s.query_len as u32;
            host[2 * ns + i] = s.context_len as u32;
            host[3 * ns + i] = bt_start as u32;
            host.extend_from_slice(&s.block_table[..needed]);
            max_q = max_q.max(s.query_len);
            max_ctx = max_ctx.max(s.context_len);
        }
        let base = self.put(&mut st, Slot::Attention, as_bytes(&host));
        st.attn_host = host;
        let base = base?;
        let batch = attn::AttentionBatch {
            num_seqs: ns,
            total_q: tokens,
            max_q_len: max_q,
            max_ctx_len: max_ctx,
            all_decode: max_q == 1,
            q_start: base,
            q_len: base + 4 * ns as u64,
            ctx_len: base + 8 * ns as u64,
            bt_start: base + 12 * ns as u64,
            block_tables: base + 16 * ns as u64,
        };
        let shape = attn::AttentionShape {
            heads,
            kv_heads,
            head_dim,
            block_size: meta.block_size,
            scale: meta.scale,
            window: meta.sliding_window.unwrap_or(0),
        };
        let scratch = self.scratch(&mut st, attn::scratch_bytes(&shape, &batch))?;
        let counters = self.grown(&mut st.attn_counters, attn::counter_bytes(&shape, &batch), "attention counters")?;
        let work = attn::AttentionScratch {
            scratch,
            scratch_len: st.scratch.as_ref().map_or(0, Buffer::len),
            counters,
            counters_len: st.attn_counters.as_ref().map_or(0, Buffer::len),
        };
        attn::attention(&self.gpu, self.dtype, kv, ptr(q), ptr(k_cache), ptr(v_cache), ptr(out), &shape, &batch, &work)
    }

    fn gather_rows(&self, x: &Tensor, rows: &[u32], out: &mut Tensor) -> Result<()> {
        let width = checks::gather_rows(x, rows, out)?;
        self.check(x, "gather_rows input")?;
        self.check(out, "gather_rows output")?;
        let mut st = self.state()?;
        let r = self.put(&mut st, Slot::Rows, as_bytes(rows))?;
        ew::gather_rows(&self.gpu, self.dtype, ptr(out), ptr(x), r, rows.len(), width)
    }

    fn copy_chunks(&self, t: &mut Tensor, chunk_bytes: usize, pairs: &[(u32, u32)]) -> Result<()> {
        let total = t.desc().bytes();
        if let Some(&(s, d)) = pairs.iter().find(|&&(s, d)| (s.max(d) as usize + 1) * chunk_bytes > total) {
            return Err(Error::invalid(format!(
                "chunk copy {s} -> {d} of {chunk_bytes} bytes is outside {total} bytes"
            )));
        }
        self.gpu.bind()?;
        let base = ptr(t);
        for &(s, d) in pairs {
            let (src, dst) = (base + s as u64 * chunk_bytes as u64, base + d as u64 * chunk_bytes as u64);
            // SAFETY: both ranges lie inside `t`'s allocation (checked above); the copy is ordered
            // on the stream with every kernel that reads or writes the cache.
            unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, chunk_bytes, self.gpu.stream().cu_stream()) }
                .map_err(crate::runtime::driver_err("cuMemcpyDtoDAsync"))?;
        }
        Ok(())
    }

    fn sample(&self, logits: &Tensor, requests: &mut [SampleRequest<'_>]) -> Result<Vec<u32>> {
        let shape = logits.shape();
        if shape.len() != 2 || shape[0] != requests.len() {
            return Err(Error::shape("sample", format!("[{}, vocab]", requests.len()), shape));
        }
        self.check(logits, "logits")?;
        let (n, vocab) = (shape[0], shape[1]);
        if n == 0 {
            return Ok(Vec::new());
        }
        let mut guard = self.state()?;
        let st = &mut *guard;
        let out_bytes = n * 4;
        match &mut st.tokens {
            Some(b) => b.grow(out_bytes, "workspace")?,
            none => *none = Some(Buffer::new(&self.allocator, out_bytes.max(1024), "workspace")?),
        }
        let out = st.tokens.as_ref().map_or(0, Buffer::addr);
        // Greedy rows without penalties (every decode step of a greedy benchmark or chat): the
        // argmax kernel reads the logits directly, with no inputs to upload and no f32 copy of the
        // row (128k f16 logits at batch 1, ncu on the H200: 10.5 us against 28.2 us for `sample_T`).
        // Above one block's worth of logits the split form spreads each row over several blocks
        // (128k vocab: 16 blocks and a one-warp merge per row instead of one block per row; ncu on
        // the H200, AWQ 8B b1 greedy: 4.1-4.9 + 2.8 us against 10.6-11.6 us).
        if requests.iter().all(|r| r.params.is_plain_argmax()) {
            if vocab > sampling::ARGMAX_CHUNK && split_argmax_enabled() {
                let need = sampling::argmax_split_bytes(n, vocab);
                let scratch = self.scratch(st, need)?;
                let scratch_len = st.scratch.as_ref().map_or(0, Buffer::len);
                sampling::argmax_split(&self.gpu, self.dtype, ptr(logits), n, vocab, out, scratch, scratch_len)?;
            } else {
                sampling::argmax(&self.gpu, self.dtype, ptr(logits), n, vocab, out)?;
            }
        } else {
            self.sample_on_device(st, logits, requests, out)?;
        }
        st.tokens_host.resize(n, 0);
        self.staging.download(out, bytemuck::cast_slice_mut(&mut st.tokens_host[..]))?;
        Ok(st.tokens_host.clone())
    }
}

/// Whether greedy rows of large vocabularies take [`sampling::argmax_split`] (`TM_SPLIT_ARGMAX=0`
/// keeps the one-block-per-row kernel).
fn split_argmax_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("TM_SPLIT_ARGMAX").map_or(true, |v| v.trim() != "0"))
}

impl CudaBackend {
    /// `sample_T` over `logits` (`[n, vocab]`) for `requests`, tokens into `out` (u32 `[n]`).
    fn sample_on_device(
        &self,
        st: &mut StepState,
        logits: &Tensor,
        requests: &mut [SampleRequest<'_>],
        out: u64,
    ) -> Result<()> {
        let (n, vocab) = (logits.shape()[0], logits.shape()[1]);
        sampling::build_inputs(requests, &mut st.sample_inputs);
        let inputs = &st.sample_inputs;
        let params = st.meta.put(Slot::SampleParams, inputs.params_bytes(), &self.allocator, &self.staging, true)?;
        let toks = st.meta.put(Slot::PenaltyTokens, inputs.tokens_bytes(), &self.allocator, &self.staging, true)?;
        let counts = st.meta.put(Slot::PenaltyCounts, inputs.counts_bytes(), &self.allocator, &self.staging, true)?;
        let need = sampling::scratch_bytes(n, vocab);
        let scratch = self.scratch(st, need)?;
        let scratch_len = st.scratch.as_ref().map_or(0, Buffer::len);
        sampling::sample(&self.gpu, self.dtype, ptr(logits), n, vocab, params, toks, counts, out, scratch, scratch_len)
    }
}
