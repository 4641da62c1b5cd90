//! tm-core's `Ops` on a wgpu device.
//!
//! Each op records one or a few compute dispatches into the device's pending command encoder
//! (see [`crate::context`]); only a download waits for the device. Small per-step inputs (token
//! ids, positions, slots, block tables) are staged, not uploaded in fresh buffers. Weights, the
//! KV cache and embedding tables larger than one storage binding are bound in windows of whole
//! rows (or KV blocks) with one dispatch per window; attention over a windowed cache merges the
//! windows' partial softmax states. Pipelines are compiled on first use and cached by name.

use crate::allocator::{padded, WgpuAllocator};
use crate::context::{Gpu, WgpuOptions};
use crate::launch::{grid, windows, Bind, PipelineCache};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tm_core::checks::{self, rows_of, same_numel};
use tm_core::ops::{to_f32, AttentionMeta};
use tm_core::quant::Weight;
use tm_core::rope::{RopeFreqs, RopeStyle};
use tm_core::{Allocator, DType, Device, Error, Ops, Result, Tensor, TensorDesc};

/// Largest head dimension the attention kernel handles.
const MAX_HEAD_DIM: usize = 256;
/// Ids of the backend's own buffers (scratch) in bind-group cache keys start here.
const OWN_IDS: u64 = 1 << 62;

/// tm-core's `Ops` on one wgpu adapter.
#[derive(Debug)]
pub struct WgpuBackend {
    pub(crate) gpu: Arc<Gpu>,
    wgpu_allocator: Arc<WgpuAllocator>,
    allocator: Arc<dyn Allocator>,
    pub(crate) pipelines: Mutex<PipelineCache>,
    pub(crate) dummy: wgpu::Buffer,
    f16_weights: bool,
    dynamic_gemv_tokens: bool,
    /// Weight rows and invocations per workgroup of the matrix-vector kernels.
    pub(crate) gemv_shape: (u32, u32),
    /// Readback buffer, grown as needed.
    staging: Mutex<Option<wgpu::Buffer>>,
    /// Attention's partial states over a windowed cache: (buffer, cache id), grown as needed.
    scratch: Mutex<Option<(wgpu::Buffer, u64)>>,
    next_own_id: AtomicU64,
}

fn f32_check(t: &Tensor, what: &str) -> Result<()> {
    t.expect_dtype(what, DType::F32)
}

fn u32_of(v: usize, what: &str) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::invalid(format!("{what} of {v} does not fit the wgpu kernels' u32 indices")))
}

fn backend_err(message: String) -> Error {
    Error::Backend { backend: "wgpu".into(), message }
}

/// A weight's tensors (dense; or packed, scales and, for int4, mins), its kernel suffix and its
/// group size.
struct WeightParts<'a> {
    tensors: Vec<&'a Tensor>,
    suffix: &'static str,
    group_size: usize,
}

fn weight_parts(w: &Weight) -> Result<WeightParts<'_>> {
    Ok(match w {
        Weight::Dense(t) => {
            let suffix = match t.dtype() {
                DType::F32 => "f32",
                DType::F16 => "f16",
                other => {
                    return Err(Error::DType {
                        op: "wgpu weight".into(),
                        expected: "f32 or f16".into(),
                        got: other.to_string(),
                    })
                }
            };
            WeightParts { tensors: vec![t], suffix, group_size: 0 }
        }
        Weight::Int4(q) => {
            q.validate(true)?;
            if q.layout != tm_core::quant::Int4Layout::RowMajor {
                return Err(Error::Unsupported(format!("int4 weights in {:?} order on the wgpu backend", q.layout)));
            }
            let mins = q.mins.as_ref().ok_or_else(|| Error::invalid("int4 weight without mins"))?;
            WeightParts { tensors: vec![&q.packed, &q.scales, mins], suffix: "q4", group_size: q.group_size }
        }
        Weight::Int8(q) => {
            q.validate(false)?;
            WeightParts { tensors: vec![&q.packed, &q.scales], suffix: "q8", group_size: q.group_size }
        }
    })
}

/// Bytes per row of each of a weight's tensors (`rows` rows).
fn row_bytes(parts: &WeightParts<'_>, rows: usize) -> Vec<u64> {
    parts.tensors.iter().map(|t| (t.desc().bytes() / rows.max(1)) as u64).collect()
}

/// Host bytes of float dtype `from` as `to` (f32 or f16), converted on all cores in chunks (an
/// 8B model's weights are billions of values).
fn convert(from: DType, to: DType, src: &[u8]) -> Result<Vec<u8>> {
    let (in_size, out_size) = (from.bits() / 8, to.bits() / 8);
    let n = src.len() / in_size;
    let mut out = vec![0u8; n * out_size];
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get()).min(16);
    let per = n.div_ceil(threads).max(1 << 16);
    std::thread::scope(|scope| {
        let jobs: Vec<_> = src
            .chunks(per * in_size)
            .zip(out.chunks_mut(per * out_size))
            .map(|(i, o)| {
                scope.spawn(move || -> Result<()> {
                    let v = to_f32(from, i)?;
                    if to == DType::F16 {
                        for (d, x) in o.chunks_exact_mut(2).zip(v) {
                            d.copy_from_slice(&half::f16::from_f32(x).to_le_bytes());
                        }
                    } else {
                        o.copy_from_slice(bytemuck::cast_slice(&v));
                    }
                    Ok(())
                })
            })
            .collect();
        jobs.into_iter().try_for_each(|j| j.join().map_err(|_| Error::invalid("weight conversion panicked"))?)
    })?;
    Ok(out)
}

/// The RoPE kernels' pair-layout code (0: halves, 1: interleaved) and host inputs: the positions,
/// then the inverse frequencies' bits, with room for `extra` more words.
fn rope_inputs(positions: &[u32], freqs: &RopeFreqs, extra: usize) -> (u32, Vec<u32>) {
    let style = match freqs.style {
        RopeStyle::Half => 0,
        RopeStyle::Interleaved => 1,
    };
    let mut inputs = Vec::with_capacity(positions.len() + freqs.inv_freq.len() + extra);
    inputs.extend_from_slice(positions);
    inputs.extend(freqs.inv_freq.iter().map(|f| f.to_bits()));
    (style, inputs)
}

/// Positions of one (token, head) that one attention workgroup takes at least.
const PART_POSITIONS: usize = 256;
/// Workgroups the attention aims for when it splits positions.
const PART_TARGET: usize = 1024;

/// How the attention splits each token's positions: `(parts, chunk)`, `chunk` positions (a
/// multiple of 64) per workgroup. One part when `groups` (tokens x heads) already fill the GPU or
/// the contexts are short; otherwise runs of at least [`PART_POSITIONS`], up to about
/// [`PART_TARGET`] workgroups in all (decoding at long contexts).
fn position_parts(meta: &AttentionMeta<'_>, groups: usize) -> (usize, usize) {
    let span = meta.seqs.iter().map(|s| meta.sliding_window.map_or(s.context_len, |w| w.min(s.context_len))).max();
    let span = span.unwrap_or(0);
    if groups == 0 || groups >= PART_TARGET || span <= PART_POSITIONS {
        return (1, 0);
    }
    let parts = span.div_ceil(PART_POSITIONS).min(PART_TARGET / groups).max(1);
    let chunk = span.div_ceil(parts).div_ceil(64) * 64;
    (span.div_ceil(chunk), chunk)
}

impl WgpuBackend {
    /// Chooses and opens an adapter (see [`WgpuOptions`]).
    pub fn open(opts: WgpuOptions) -> Result<WgpuBackend> {
        let gpu = Arc::new(Gpu::open(&opts)?);
        let shared = gpu.summary.is_cpu || gpu.summary.device_type == "IntegratedGpu";
        let default_cap = if shared { tm_core::host_memory::host_memory().available } else { 8 << 30 };
        let cap = opts.memory_cap.unwrap_or(default_cap);
        let wgpu_allocator = WgpuAllocator::new(Arc::clone(&gpu), cap);
        let allocator: Arc<dyn Allocator> = wgpu_allocator.clone();
        let dummy = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("dummy"),
            size: 16,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        tracing::debug!(
            "wgpu: {}; binding limit {} bytes, subgroups {}, f16 weights {}",
            gpu.summary,
            gpu.max_binding(),
            gpu.subgroups,
            opts.f16_weights
        );
        Ok(WgpuBackend {
            gpu,
            wgpu_allocator,
            allocator,
            pipelines: Mutex::new(PipelineCache::new()),
            dummy,
            f16_weights: opts.f16_weights,
            dynamic_gemv_tokens: opts.dynamic_gemv_tokens,
            gemv_shape: (opts.gemv_rows.unwrap_or(4), opts.gemv_workgroup.unwrap_or(64)),
            staging: Mutex::new(None),
            scratch: Mutex::new(None),
            next_own_id: AtomicU64::new(OWN_IDS),
        })
    }

    /// The device, queue and adapter facts.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Whether the matrix-vector kernels use subgroup reductions on this device.
    pub fn uses_subgroups(&self) -> bool {
        self.gpu.subgroups
    }

    /// Compiles every kernel this device can run now (they are otherwise compiled on first
    /// use), so a shader the adapter rejects shows up at start-up.
    pub fn warm_up(&self) -> Result<()> {
        for k in tm_kernels::wgsl::KERNELS {
            if !k.subgroups || self.gpu.subgroups {
                self.compiled(k.name, 0)?;
            }
        }
        Ok(())
    }

    /// The wgpu buffer of a tensor made by this backend's allocator.
    pub(crate) fn buf(&self, t: &Tensor) -> Result<wgpu::Buffer> {
        if t.buffer().allocator().id() != self.allocator.id() {
            return Err(Error::invalid("tensor does not belong to this wgpu backend"));
        }
        self.wgpu_allocator.buffer(t.buffer().addr())
    }

    /// A scratch binding of at least `bytes` bytes (attention's partial states).
    fn scratch(&self, bytes: u64) -> Result<Bind> {
        let mut s = self.scratch.lock().map_err(|_| Error::invalid("wgpu scratch poisoned"))?;
        let size = padded(bytes as usize);
        if s.as_ref().is_none_or(|(b, _)| b.size() < size) {
            let buffer = self.gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("attention partials"),
                size: size.next_power_of_two(),
                usage: wgpu::BufferUsages::STORAGE,
                mapped_at_creation: false,
            });
            *s = Some((buffer, self.next_own_id.fetch_add(1, Ordering::Relaxed)));
        }
        let (buffer, id) = s.as_ref().ok_or_else(|| Error::invalid("wgpu scratch missing"))?;
        Ok(Bind { buffer: buffer.clone(), id: *id, offset: 0, size })
    }

    /// The matrix product over windows of tokens (x, out) and of weight rows.
    fn matmul_windows(
        &self,
        x: &Tensor,
        w: &Weight,
        bias: Option<&Tensor>,
        out: &Tensor,
        (n, rows, cols): (usize, usize, usize),
    ) -> Result<()> {
        let parts = weight_parts(w)?;
        let max = self.gpu.max_binding();
        let align = self.gpu.storage_align();
        let mut per_row = row_bytes(&parts, rows);
        if bias.is_some() {
            per_row.push(4);
        }
        let row_windows = windows(rows, &per_row, max, align, "matmul weight")?;
        let token_windows = windows(n, &[cols as u64 * 4, rows as u64 * 4], max, align, "matmul activations")?;
        for &(t0, tn) in &token_windows {
            let xb = self.window(x, (t0 * cols * 4) as u64, (tn * cols * 4) as u64)?;
            let ob = self.window(out, (t0 * rows * 4) as u64, (tn * rows * 4) as u64)?;
            // Up to GEMV_MAX_TOKENS tokens per matrix-vector dispatch.
            let gemv = tn <= tm_kernels::wgsl::GEMV_MAX_TOKENS;
            for &(r0, rn) in &row_windows {
                let mut b = vec![xb.clone()];
                b.push(match bias {
                    Some(t) => self.window(t, (r0 * 4) as u64, (rn * 4) as u64)?,
                    None => Bind { buffer: self.dummy.clone(), id: crate::launch::DUMMY_ID, offset: 0, size: 16 },
                });
                b.push(ob.clone());
                for (t, &pb) in parts.tensors.iter().zip(&row_bytes(&parts, rows)) {
                    b.push(self.window(t, r0 as u64 * pb, rn as u64 * pb)?);
                }
                // Dense rows of a multiple of 8 columns: 16-byte loads; quantized rows: whole
                // 32-column blocks (groups are multiples of 32 columns), gemv_shape.0 rows per
                // workgroup (one for the others).
                let quant = matches!(parts.suffix, "q4" | "q8");
                let vec = quant || cols.is_multiple_of(8);
                let (name, groups) = if gemv {
                    let per_group = if quant { self.gemv_shape.0 as usize } else { 1 };
                    let name = self.kernel_name(if vec { "gemv_vec" } else { "gemv" }, parts.suffix)?;
                    (name, grid(rn.div_ceil(per_group) as u64))
                } else {
                    (
                        self.kernel_name("matmul", parts.suffix)?,
                        ((rn as u64).div_ceil(64) as u32, (tn as u64).div_ceil(64) as u32),
                    )
                };
                let params = [
                    tn as u32,
                    rn as u32,
                    cols as u32,
                    u32::from(bias.is_some()),
                    parts.group_size as u32,
                    groups.0,
                    r0 as u32,
                    rows as u32,
                ];
                let fixed = if gemv && !self.dynamic_gemv_tokens { tn as u32 } else { 0 };
                self.dispatch_fixed(name, fixed, &params, &[], &b, groups)?;
            }
        }
        Ok(())
    }

    /// The kernel name for `kind` (`gemv`, `gemv_vec`, `matmul`) and a weight suffix.
    fn kernel_name(&self, kind: &str, suffix: &str) -> Result<&'static str> {
        let sg = kind.starts_with("gemv") && self.gpu.subgroups;
        let name = format!("{kind}_{suffix}{}", if sg { "_sg" } else { "" });
        tm_kernels::wgsl::kernel(&name)
            .map(|k| k.name)
            .ok_or_else(|| Error::Unsupported(format!("wgpu kernel {name} does not exist")))
    }
}

impl Ops for WgpuBackend {
    fn device(&self) -> Arc<dyn Device> {
        self.allocator.device()
    }
    fn allocator(&self) -> &Arc<dyn Allocator> {
        &self.allocator
    }
    fn activation_dtype(&self) -> DType {
        DType::F32
    }
    fn weight_dtype(&self, src: DType) -> DType {
        match (src.is_float(), self.f16_weights) {
            (true, true) => DType::F16,
            (true, false) => DType::F32,
            (false, _) => src,
        }
    }
    fn vector_dtype(&self, src: DType) -> DType {
        // norm weights and biases in the activation dtype
        if src.is_float() {
            DType::F32
        } else {
            src
        }
    }

    fn upload(&self, dst: &mut Tensor, src: &[u8]) -> Result<()> {
        let n = dst.desc().bytes();
        if src.len() != n {
            return Err(Error::shape("upload", format!("{n} bytes"), format!("{} bytes", src.len())));
        }
        if n == 0 {
            return Ok(());
        }
        let buffer = self.buf(dst)?;
        // Recorded work that touches `dst` must run before the new contents land.
        self.gpu.flush()?;
        if n.is_multiple_of(4) {
            self.gpu.write(&buffer, 0, src)
        } else {
            let mut bytes = src.to_vec();
            bytes.resize(padded(n) as usize, 0);
            self.gpu.write(&buffer, 0, &bytes)
        }
    }

    fn download(&self, src: &Tensor, dst: &mut [u8]) -> Result<()> {
        let n = src.desc().bytes();
        if dst.len() != n {
            return Err(Error::shape("download", format!("{n} bytes"), format!("{} bytes", dst.len())));
        }
        if n == 0 {
            return Ok(());
        }
        let buffer = self.buf(src)?;
        let size = padded(n);
        let mut slot = self.staging.lock().map_err(|_| Error::invalid("wgpu readback buffer poisoned"))?;
        if slot.as_ref().is_none_or(|b| b.size() < size) {
            *slot = Some(self.gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("download"),
                size: size.next_power_of_two(),
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }));
        }
        let staging = slot.as_ref().ok_or_else(|| Error::invalid("wgpu readback buffer missing"))?;
        self.gpu.record(|enc| enc.copy_buffer_to_buffer(&buffer, 0, staging, 0, size))?;
        self.gpu.flush()?;
        let (tx, rx) = std::sync::mpsc::channel();
        staging.slice(..size).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.gpu.wait()?;
        rx.recv()
            .map_err(|_| backend_err("readback never completed".into()))?
            .map_err(|e| backend_err(format!("mapping readback: {e}")))?;
        {
            let view = staging
                .slice(..size)
                .get_mapped_range()
                .map_err(|e| backend_err(format!("reading the mapped readback: {e}")))?;
            dst.copy_from_slice(&view[..n]);
        }
        staging.unmap();
        Ok(())
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
        let target = if shape.len() == 1 { self.vector_dtype(src_dtype) } else { self.weight_dtype(src_dtype) };
        let mut t = self.zeros(TensorDesc::new(target, shape), phase)?;
        if target == src_dtype {
            self.upload(&mut t, src)?;
        } else {
            let converted = convert(src_dtype, target, src)?;
            self.upload(&mut t, &converted)?;
        }
        Ok(t)
    }

    fn embedding(&self, table: &Weight, ids: &[u32], out: &mut Tensor) -> Result<()> {
        let hidden = checks::embedding(table, ids, out)?;
        f32_check(out, "embedding output")?;
        if ids.is_empty() {
            return Ok(());
        }
        let (vocab, _) = table.dims();
        let parts = weight_parts(table)?;
        let ob = self.whole(out, "embedding output")?;
        let n = ids.len() * hidden;
        let hidden32 = u32_of(hidden, "hidden size")?;
        let tokens = u32_of(ids.len(), "tokens")?;
        u32_of(vocab * hidden, "embedding table size")?;
        let per_row = row_bytes(&parts, vocab);
        let name = match parts.suffix {
            "f32" => "embedding_f32",
            "f16" => "embedding_f16",
            "q4" => "embedding_q4",
            _ => "embedding_q8",
        };
        for (r0, rn) in windows(vocab, &per_row, self.gpu.max_binding(), self.gpu.storage_align(), "embedding table")? {
            let mut b = Vec::new();
            for (t, &pb) in parts.tensors.iter().zip(&per_row) {
                b.push(self.window(t, r0 as u64 * pb, rn as u64 * pb)?);
            }
            b.push(ob.clone());
            let params = [hidden32, tokens, parts.group_size as u32, r0 as u32, rn as u32];
            self.dispatch_1d(name, &params, bytemuck::cast_slice(ids), &b, n)?;
        }
        Ok(())
    }

    fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f32, out: &mut Tensor) -> Result<()> {
        same_numel("rms_norm", x, out)?;
        let rows = rows_of("rms_norm", x, weight.numel())?;
        f32_check(x, "rms_norm input")?;
        f32_check(weight, "rms_norm weight")?;
        f32_check(out, "rms_norm output")?;
        if rows == 0 {
            return Ok(());
        }
        let g = grid(rows as u64);
        let params = [u32_of(weight.numel(), "features")?, u32_of(rows, "rows")?, eps.to_bits(), g.0];
        let b = [
            self.whole(x, "rms_norm input")?,
            self.whole(weight, "rms_norm weight")?,
            self.whole(out, "rms_norm output")?,
        ];
        self.dispatch("rms_norm", &params, &[], &b, g)
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
        let rows = rows_of("add_rms_norm", x, weight.numel())?;
        f32_check(x, "add_rms_norm input")?;
        f32_check(residual, "residual")?;
        f32_check(weight, "rms_norm weight")?;
        f32_check(out, "add_rms_norm output")?;
        if rows == 0 {
            return Ok(());
        }
        let g = grid(rows as u64);
        let params = [u32_of(weight.numel(), "features")?, u32_of(rows, "rows")?, eps.to_bits(), g.0];
        let b = [
            self.whole(x, "add_rms_norm input")?,
            self.whole(weight, "rms_norm weight")?,
            self.whole(out, "add_rms_norm output")?,
            self.whole(residual, "residual")?,
        ];
        self.dispatch("add_rms_norm", &params, &[], &b, g)
    }

    fn matmul(&self, x: &Tensor, w: &Weight, bias: Option<&Tensor>, out: &mut Tensor) -> Result<()> {
        let (rows, cols) = w.dims();
        let n = rows_of("matmul input", x, cols)?;
        if out.numel() != n * rows {
            return Err(Error::shape("matmul output", [n, rows], out.shape()));
        }
        f32_check(x, "matmul input")?;
        f32_check(out, "matmul output")?;
        if let Some(b) = bias {
            f32_check(b, "bias")?;
            if b.numel() != rows {
                return Err(Error::shape("bias", [rows], b.shape()));
            }
        }
        if n == 0 || rows == 0 {
            return Ok(());
        }
        u32_of(rows * cols, "weight size")?;
        u32_of(n * cols.max(rows), "activation size")?;
        self.matmul_windows(x, w, bias, out, (n, rows, cols))
    }

    fn rope(&self, x: &mut Tensor, positions: &[u32], freqs: &RopeFreqs) -> Result<()> {
        let half = freqs.inv_freq.len();
        let head_dim = 2 * half;
        let tokens = positions.len();
        if tokens == 0 || head_dim == 0 || !x.numel().is_multiple_of(tokens * head_dim) {
            return Err(Error::shape("rope", format!("[{tokens}, heads * {head_dim}]"), x.shape()));
        }
        f32_check(x, "rope input")?;
        let heads = x.numel() / (tokens * head_dim);
        let (style, inputs) = rope_inputs(positions, freqs, 0);
        let params = [
            u32_of(tokens, "tokens")?,
            u32_of(heads, "heads")?,
            u32_of(half, "rope pairs")?,
            style,
            freqs.attention_factor.to_bits(),
        ];
        let xb = self.whole(x, "rope input")?;
        self.dispatch_1d("rope", &params, bytemuck::cast_slice(&inputs), &[xb], tokens * heads * half)
    }

    fn silu_mul(&self, gate: &Tensor, up: &Tensor, out: &mut Tensor) -> Result<()> {
        same_numel("silu_mul", gate, up)?;
        same_numel("silu_mul", gate, out)?;
        f32_check(gate, "gate")?;
        f32_check(up, "up")?;
        f32_check(out, "silu_mul output")?;
        let n = gate.numel();
        if n == 0 {
            return Ok(());
        }
        let b = [self.whole(gate, "gate")?, self.whole(up, "up")?, self.whole(out, "silu_mul output")?];
        self.dispatch_1d("silu_mul", &[u32_of(n, "elements")?], &[], &b, n)
    }

    fn add_in_place(&self, x: &mut Tensor, y: &Tensor) -> Result<()> {
        same_numel("add_in_place", x, y)?;
        f32_check(x, "add_in_place")?;
        f32_check(y, "addend")?;
        let n = x.numel();
        if n == 0 {
            return Ok(());
        }
        let b = [self.whole(y, "addend")?, self.whole(x, "add_in_place")?];
        self.dispatch_1d("add", &[u32_of(n, "elements")?], &[], &b, n)
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
        for (t, what) in [(k, "k"), (v, "v"), (&*k_cache, "k cache"), (&*v_cache, "v cache")] {
            f32_check(t, what)?;
        }
        if slot_mapping.is_empty() {
            return Ok(());
        }
        let shape = k_cache.shape().to_vec();
        let (blocks, bs) = (shape[0], shape[1]);
        u32_of(blocks * bs, "kv cache slots")?;
        let (kb, vb) = (self.whole(k, "k")?, self.whole(v, "v")?);
        let block_bytes = (bs * width * 4) as u64;
        let tokens = u32_of(slot_mapping.len(), "tokens")?;
        for (b0, nb) in windows(blocks, &[block_bytes], self.gpu.max_binding(), self.gpu.storage_align(), "kv cache")? {
            let lo = (b0 * bs) as u32;
            let hi = lo + (nb * bs) as u32;
            if !slot_mapping.iter().any(|&s| s >= lo && s < hi) {
                continue;
            }
            let (off, len) = (b0 as u64 * block_bytes, nb as u64 * block_bytes);
            let b = [kb.clone(), vb.clone(), self.window(k_cache, off, len)?, self.window(v_cache, off, len)?];
            let params = [width as u32, tokens, lo, hi - lo];
            self.dispatch_1d("write_kv", &params, bytemuck::cast_slice(slot_mapping), &b, k.numel())?;
        }
        Ok(())
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
        let unfused = |q: &mut Tensor, k: &mut Tensor, kc: &mut Tensor, vc: &mut Tensor| {
            tm_core::ops::rope_write_kv_unfused(self, q, k, v, kc, vc, positions, freqs, slot_mapping)
        };
        let width = checks::write_kv(k, v, k_cache, v_cache, slot_mapping)?;
        let half = freqs.inv_freq.len();
        let tokens = positions.len();
        let cache_bytes = k_cache.desc().bytes() as u64;
        // The fused kernel binds the caches whole; rope's own checks report bad shapes.
        if tokens == 0
            || half == 0
            || tokens != slot_mapping.len()
            || !width.is_multiple_of(2 * half)
            || !q.numel().is_multiple_of(tokens * 2 * half)
            || cache_bytes > self.gpu.max_binding()
            || [&*q, &*k, v, &*k_cache, &*v_cache].iter().any(|t| t.dtype() != DType::F32)
        {
            return unfused(q, k, k_cache, v_cache);
        }
        let heads = q.numel() / (tokens * 2 * half);
        let kv_heads = width / (2 * half);
        let (style, mut inputs) = rope_inputs(positions, freqs, tokens);
        inputs.extend_from_slice(slot_mapping);
        let params = [
            u32_of(tokens, "tokens")?,
            u32_of(heads, "heads")?,
            u32_of(kv_heads, "kv heads")?,
            u32_of(half, "rope pairs")?,
            style,
            freqs.attention_factor.to_bits(),
        ];
        let b = [
            self.whole(q, "q")?,
            self.whole(k, "k")?,
            self.whole(v, "v")?,
            self.whole(k_cache, "k cache")?,
            self.whole(v_cache, "v cache")?,
        ];
        self.dispatch_1d(
            "rope_write_kv",
            &params,
            bytemuck::cast_slice(&inputs),
            &b,
            tokens * (heads + kv_heads) * half,
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
        let checks::AttentionDims { tokens, heads, kv_heads, head_dim, blocks } =
            checks::attention(q, k_cache, v_cache, meta, out)?;
        if head_dim > MAX_HEAD_DIM {
            return Err(Error::Unsupported(format!(
                "wgpu attention handles head_dim up to {MAX_HEAD_DIM}, not {head_dim}"
            )));
        }
        for (t, what) in [(q, "q"), (k_cache, "k cache"), (v_cache, "v cache"), (&*out, "attention output")] {
            f32_check(t, what)?;
        }
        if tokens == 0 {
            return Ok(());
        }
        u32_of(k_cache.numel(), "kv cache size")?;
        // Inputs: (table offset, position) per token, then the block tables.
        let mut inputs = vec![0u32; 2 * tokens];
        for s in meta.seqs {
            let blocks_needed = s.context_len.div_ceil(meta.block_size);
            let offset = u32_of(inputs.len() - 2 * tokens, "block table offset")?;
            inputs.extend_from_slice(&s.block_table[..blocks_needed]);
            let first_pos = s.context_len - s.query_len;
            for i in 0..s.query_len {
                let t = s.query_start + i;
                inputs[2 * t] = offset;
                inputs[2 * t + 1] = u32_of(first_pos + i, "position")?;
            }
        }
        let window = match meta.sliding_window {
            Some(0) => return Err(Error::invalid("a sliding window of 0 positions")),
            Some(w) => u32_of(w, "sliding window")?,
            None => 0,
        };
        let bs = meta.block_size;
        let block_bytes = (bs * kv_heads * head_dim * 4) as u64;
        let kv_windows = windows(blocks, &[block_bytes], self.gpu.max_binding(), self.gpu.storage_align(), "kv cache")?;
        let (mut parts, mut chunk) = position_parts(meta, tokens * heads);
        let state_bytes = (kv_windows.len() * tokens * heads * (head_dim + 2) * 4) as u64;
        let fit = (self.gpu.max_binding() / state_bytes.max(1)).max(1) as usize;
        if parts > fit {
            // Fewer parts, so that their partial states fit one binding.
            let covered = chunk * parts;
            (parts, chunk) = if fit > 1 {
                let chunk = covered.div_ceil(fit).div_ceil(64) * 64;
                (covered.div_ceil(chunk), chunk)
            } else {
                (1, 0)
            };
        }
        let g = grid((tokens * heads * parts) as u64);
        let (qb, ob) = (self.whole(q, "q")?, self.whole(out, "attention output")?);
        let states = kv_windows.len() * parts;
        let partial = states > 1;
        let scratch = if partial {
            let bytes = (states * tokens * heads * (head_dim + 2) * 4) as u64;
            if bytes > self.gpu.max_binding() {
                return Err(Error::Unsupported(format!(
                    "attention over {} kv-cache windows in {parts} part(s) needs {bytes} bytes of partial states, \
                     over the binding limit of {} bytes (lower the batch)",
                    kv_windows.len(),
                    self.gpu.max_binding()
                )));
            }
            Some(self.scratch(bytes)?)
        } else {
            None
        };
        for (i, &(b0, nb)) in kv_windows.iter().enumerate() {
            let (off, len) = (b0 as u64 * block_bytes, nb as u64 * block_bytes);
            let target = scratch.clone().unwrap_or_else(|| ob.clone());
            let b = [qb.clone(), self.window(k_cache, off, len)?, self.window(v_cache, off, len)?, target];
            let params = [
                tokens as u32,
                heads as u32,
                kv_heads as u32,
                head_dim as u32,
                u32_of(bs, "block size")?,
                meta.scale.to_bits(),
                window,
                g.0,
                u32::from(partial),
                b0 as u32,
                nb as u32,
                i as u32,
                2 * tokens as u32,
                parts as u32,
                chunk as u32,
            ];
            self.dispatch("attention", &params, bytemuck::cast_slice(&inputs), &b, g)?;
        }
        if let Some(sb) = scratch {
            let count = tokens * heads;
            let cg = grid(count as u64);
            let params = [count as u32, head_dim as u32, states as u32, cg.0];
            self.dispatch("attention_combine", &params, &[], &[sb, ob], cg)?;
        }
        Ok(())
    }

    fn gather_rows(&self, x: &Tensor, rows: &[u32], out: &mut Tensor) -> Result<()> {
        let width = checks::gather_rows(x, rows, out)?;
        f32_check(x, "gather_rows input")?;
        f32_check(out, "gather_rows output")?;
        if out.numel() == 0 {
            return Ok(());
        }
        let b = [self.whole(x, "gather_rows input")?, self.whole(out, "gather_rows output")?];
        let params = [u32_of(width, "row width")?, u32_of(rows.len(), "rows")?];
        self.dispatch_1d("gather_rows", &params, bytemuck::cast_slice(rows), &b, out.numel())
    }

    fn copy_chunks(&self, t: &mut Tensor, chunk_bytes: usize, pairs: &[(u32, u32)]) -> Result<()> {
        let total = t.desc().bytes();
        if let Some(&(s, d)) = pairs.iter().find(|&&(s, d)| (s.max(d) as usize + 1) * chunk_bytes > total) {
            return Err(Error::invalid(format!(
                "chunk copy {s} -> {d} of {chunk_bytes} bytes is outside {total} bytes"
            )));
        }
        if pairs.is_empty() || chunk_bytes == 0 {
            return Ok(());
        }
        if !chunk_bytes.is_multiple_of(4) {
            // Not word-aligned: through the host.
            let mut host = vec![0u8; total];
            self.download(t, &mut host)?;
            for &(s, d) in pairs {
                let (s, d) = (s as usize * chunk_bytes, d as usize * chunk_bytes);
                host.copy_within(s..s + chunk_bytes, d);
            }
            return self.upload(t, &host);
        }
        // A buffer cannot be copied onto itself: each chunk goes through a bounce buffer, in
        // order, so a chunk copied earlier in `pairs` may be the source of a later pair.
        let buffer = self.buf(t)?;
        let c = chunk_bytes as u64;
        let bounce = self.gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("copy_chunks"),
            size: c * pairs.len() as u64,
            usage: wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.gpu.record(|enc| {
            for (i, &(s, d)) in pairs.iter().enumerate() {
                let at = i as u64 * c;
                enc.copy_buffer_to_buffer(&buffer, u64::from(s) * c, &bounce, at, c);
                enc.copy_buffer_to_buffer(&bounce, at, &buffer, u64::from(d) * c, c);
            }
        })?;
        self.gpu.take_error()
    }
}
