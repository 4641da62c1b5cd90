//! tm-core's `Ops` on a wgpu device.
//!
//! Each op is one compute dispatch in its own submission; the queue runs them in call order and
//! only `download` waits. Small per-step inputs (token ids, positions, slots, block tables) and
//! the kernel parameters go up in fresh buffers per call. Pipelines are compiled on first use and
//! cached by kernel name.

use crate::allocator::{padded, WgpuAllocator};
use crate::context::{Gpu, WgpuOptions};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tm_core::checks::{self, rows_of, same_numel};
use tm_core::ops::{to_f32, AttentionMeta};
use tm_core::quant::{QuantWeight, Weight};
use tm_core::rope::{RopeFreqs, RopeStyle};
use tm_core::{Allocator, DType, Device, Error, Ops, Result, Tensor, TensorDesc};
use wgpu::util::DeviceExt;

/// Threads per workgroup of the 1-D kernels.
const WG: u64 = 256;
/// Largest head dimension the attention kernel handles.
const MAX_HEAD_DIM: usize = 256;

/// tm-core's `Ops` on one wgpu adapter.
#[derive(Debug)]
pub struct WgpuBackend {
    gpu: Arc<Gpu>,
    wgpu_allocator: Arc<WgpuAllocator>,
    allocator: Arc<dyn Allocator>,
    pipelines: Mutex<HashMap<&'static str, wgpu::ComputePipeline>>,
    dummy: wgpu::Buffer,
}

fn f32_check(t: &Tensor, what: &str) -> Result<()> {
    t.expect_dtype(what, DType::F32)
}

fn u32_of(v: usize, what: &str) -> Result<u32> {
    u32::try_from(v).map_err(|_| Error::invalid(format!("{what} of {v} does not fit the wgpu kernels' u32 indices")))
}

/// A 2-D grid of `count` workgroups: `(x, y)` with `x <= 65535`.
fn grid(count: u64) -> (u32, u32) {
    let x = count.clamp(1, 65535);
    (x as u32, count.div_ceil(x).max(1) as u32)
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
        Ok(WgpuBackend { gpu, wgpu_allocator, allocator, pipelines: Mutex::new(HashMap::new()), dummy })
    }

    /// The device, queue and adapter facts.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Compiles every kernel now (they are otherwise compiled on first use), so a shader the
    /// adapter rejects shows up at start-up.
    pub fn warm_up(&self) -> Result<()> {
        for k in tm_kernels::wgsl::KERNELS {
            self.pipeline(k.name)?;
        }
        Ok(())
    }

    /// The wgpu buffer of a tensor made by this backend's allocator.
    fn buf(&self, t: &Tensor) -> Result<wgpu::Buffer> {
        if t.buffer().allocator().id() != self.allocator.id() {
            return Err(Error::invalid("tensor does not belong to this wgpu backend"));
        }
        self.wgpu_allocator.buffer(t.buffer().addr())
    }

    /// A read-only storage buffer holding `data` (padded to 4 bytes).
    fn temp(&self, label: &str, data: &[u8]) -> wgpu::Buffer {
        let mut bytes = data.to_vec();
        bytes.resize(padded(data.len()) as usize, 0);
        self.gpu.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some(label),
            contents: &bytes,
            usage: wgpu::BufferUsages::STORAGE,
        })
    }

    fn pipeline(&self, name: &'static str) -> Result<wgpu::ComputePipeline> {
        let mut cache = self.pipelines.lock().map_err(|_| Error::invalid("wgpu pipeline cache poisoned"))?;
        if let Some(p) = cache.get(name) {
            return Ok(p.clone());
        }
        let kernel = tm_kernels::wgsl::kernel(name)
            .ok_or_else(|| Error::Unsupported(format!("wgpu kernel {name} does not exist")))?;
        let source = kernel.source();
        let device = &self.gpu.device;
        let pipeline = self.gpu.scoped(wgpu::ErrorFilter::Validation, &format!("compiling kernel {name}"), || {
            let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(name),
                source: wgpu::ShaderSource::Wgsl(source.into()),
            });
            device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(name),
                layout: None,
                module: &module,
                entry_point: Some(kernel.entry),
                compilation_options: Default::default(),
                cache: None,
            })
        })?;
        cache.insert(name, pipeline.clone());
        Ok(pipeline)
    }

    /// Runs kernel `name` over `groups` workgroups with `params` at binding 0 and `bindings` at
    /// 1, 2, ...
    fn launch(&self, name: &'static str, params: &[u32], bindings: &[&wgpu::Buffer], groups: (u32, u32)) -> Result<()> {
        let max = self.gpu.limits.max_compute_workgroups_per_dimension;
        if groups.0 > max || groups.1 > max {
            return Err(Error::Unsupported(format!(
                "kernel {name} needs {groups:?} workgroups; the adapter allows {max} per dimension"
            )));
        }
        let pipeline = self.pipeline(name)?;
        if params.len() > 16 {
            return Err(Error::invalid(format!("kernel {name} got {} parameters; at most 16 fit", params.len())));
        }
        let mut words = [0u32; 16];
        for (w, p) in words.iter_mut().zip(params) {
            *w = *p;
        }
        let uniform = self.gpu.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("params"),
            contents: bytemuck::cast_slice(&words),
            usage: wgpu::BufferUsages::UNIFORM,
        });
        let mut entries = vec![wgpu::BindGroupEntry { binding: 0, resource: uniform.as_entire_binding() }];
        for (i, b) in bindings.iter().enumerate() {
            entries.push(wgpu::BindGroupEntry { binding: i as u32 + 1, resource: b.as_entire_binding() });
        }
        let layout = pipeline.get_bind_group_layout(0);
        let group = self.gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(name),
            layout: &layout,
            entries: &entries,
        });
        let mut enc = self.gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some(name) });
        {
            let mut pass =
                enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some(name), timestamp_writes: None });
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &group, &[]);
            pass.dispatch_workgroups(groups.0, groups.1, 1);
        }
        self.gpu.queue.submit([enc.finish()]);
        self.gpu.take_error()
    }

    /// Runs a 1-D kernel over `n` invocations.
    fn launch_1d(&self, name: &'static str, params: &[u32], bindings: &[&wgpu::Buffer], n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.launch(name, params, bindings, grid((n as u64).div_ceil(WG)))
    }

    fn quant_parts(&self, q: &QuantWeight, int4: bool) -> Result<Vec<wgpu::Buffer>> {
        q.validate(int4)?;
        let mut parts = vec![self.buf(&q.packed)?, self.buf(&q.scales)?];
        if int4 {
            let mins = q.mins.as_ref().ok_or_else(|| Error::invalid("int4 weight without mins"))?;
            parts.push(self.buf(mins)?);
        }
        Ok(parts)
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
        if n.is_multiple_of(4) {
            self.gpu.queue.write_buffer(&buffer, 0, src);
        } else {
            let mut bytes = src.to_vec();
            bytes.resize(padded(n) as usize, 0);
            self.gpu.queue.write_buffer(&buffer, 0, &bytes);
        }
        self.gpu.take_error()
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
        let staging = self.gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("download"),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut enc =
            self.gpu.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("download") });
        enc.copy_buffer_to_buffer(&buffer, 0, &staging, 0, size);
        self.gpu.queue.submit([enc.finish()]);
        let (tx, rx) = std::sync::mpsc::channel();
        staging.slice(..).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.gpu.wait()?;
        rx.recv()
            .map_err(|_| Error::Backend { backend: "wgpu".into(), message: "readback never completed".into() })?
            .map_err(|e| Error::Backend { backend: "wgpu".into(), message: format!("mapping readback: {e}") })?;
        {
            let view = staging.slice(..).get_mapped_range().map_err(|e| Error::Backend {
                backend: "wgpu".into(),
                message: format!("reading the mapped readback: {e}"),
            })?;
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
        let target = self.weight_dtype(src_dtype);
        let mut t = self.zeros(TensorDesc::new(target, shape), phase)?;
        if target == src_dtype {
            self.upload(&mut t, src)?;
        } else {
            let v = to_f32(src_dtype, src)?;
            self.upload(&mut t, bytemuck::cast_slice(&v))?;
        }
        Ok(t)
    }

    fn embedding(&self, table: &Weight, ids: &[u32], out: &mut Tensor) -> Result<()> {
        let hidden = checks::embedding(table, ids, out)?;
        f32_check(out, "embedding output")?;
        if ids.is_empty() {
            return Ok(());
        }
        let o = self.buf(out)?;
        let idb = self.temp("ids", bytemuck::cast_slice(ids));
        let n = ids.len() * hidden;
        let hidden32 = u32_of(hidden, "hidden size")?;
        let tokens = u32_of(ids.len(), "tokens")?;
        u32_of(table.dims().0 * hidden, "embedding table size")?;
        match table {
            Weight::Dense(t) => {
                f32_check(t, "embedding table")?;
                let tb = self.buf(t)?;
                self.launch_1d("embedding_f32", &[hidden32, tokens], &[&idb, &tb, &o], n)
            }
            Weight::Int4(q) | Weight::Int8(q) => {
                let int4 = matches!(table, Weight::Int4(_));
                let parts = self.quant_parts(q, int4)?;
                let mut b: Vec<&wgpu::Buffer> = vec![&idb];
                b.extend(parts.iter());
                b.push(&o);
                let name = if int4 { "embedding_q4" } else { "embedding_q8" };
                self.launch_1d(name, &[hidden32, tokens, u32_of(q.group_size, "group size")?], &b, n)
            }
        }
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
        let (xb, wb, ob) = (self.buf(x)?, self.buf(weight)?, self.buf(out)?);
        self.launch("rms_norm", &params, &[&xb, &wb, &ob], g)
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
        let (xb, rb, wb, ob) = (self.buf(x)?, self.buf(residual)?, self.buf(weight)?, self.buf(out)?);
        self.launch("add_rms_norm", &params, &[&xb, &wb, &ob, &rb], g)
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
        let (xb, ob) = (self.buf(x)?, self.buf(out)?);
        let bb = match bias {
            Some(b) => self.buf(b)?,
            None => self.dummy.clone(),
        };
        let gemv = n <= tm_kernels::wgsl::GEMV_MAX_TOKENS;
        let groups = if gemv {
            grid((rows as u64).div_ceil(64))
        } else {
            ((rows as u64).div_ceil(16) as u32, (n as u64).div_ceil(16) as u32)
        };
        let group_size = match w {
            Weight::Dense(_) => 0,
            Weight::Int4(q) | Weight::Int8(q) => q.group_size as u32,
        };
        let params = [n as u32, rows as u32, cols as u32, u32::from(bias.is_some()), group_size, groups.0];
        let mut b: Vec<&wgpu::Buffer> = vec![&xb, &bb, &ob];
        let parts;
        let name = match (w, gemv) {
            (Weight::Dense(t), _) => {
                f32_check(t, "dense weight")?;
                parts = vec![self.buf(t)?];
                if gemv {
                    "gemv_f32"
                } else {
                    "matmul_f32"
                }
            }
            (Weight::Int4(q), _) => {
                parts = self.quant_parts(q, true)?;
                if gemv {
                    "gemv_q4"
                } else {
                    "matmul_q4"
                }
            }
            (Weight::Int8(q), _) => {
                parts = self.quant_parts(q, false)?;
                if gemv {
                    "gemv_q8"
                } else {
                    "matmul_q8"
                }
            }
        };
        b.extend(parts.iter());
        self.launch(name, &params, &b, groups)
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
        let style = match freqs.style {
            RopeStyle::Half => 0,
            RopeStyle::Interleaved => 1,
        };
        let params = [
            u32_of(tokens, "tokens")?,
            u32_of(heads, "heads")?,
            u32_of(half, "rope pairs")?,
            style,
            freqs.attention_factor.to_bits(),
        ];
        let fb = self.temp("inv_freq", bytemuck::cast_slice(&freqs.inv_freq));
        let pb = self.temp("positions", bytemuck::cast_slice(positions));
        let xb = self.buf(x)?;
        self.launch_1d("rope", &params, &[&fb, &pb, &xb], tokens * heads * half)
    }

    fn silu_mul(&self, gate: &Tensor, up: &Tensor, out: &mut Tensor) -> Result<()> {
        same_numel("silu_mul", gate, up)?;
        same_numel("silu_mul", gate, out)?;
        f32_check(gate, "gate")?;
        f32_check(up, "up")?;
        f32_check(out, "silu_mul output")?;
        let n = gate.numel();
        let (gb, ub, ob) = (self.buf(gate)?, self.buf(up)?, self.buf(out)?);
        self.launch_1d("silu_mul", &[u32_of(n, "elements")?], &[&gb, &ub, &ob], n)
    }

    fn add_in_place(&self, x: &mut Tensor, y: &Tensor) -> Result<()> {
        same_numel("add_in_place", x, y)?;
        f32_check(x, "add_in_place")?;
        f32_check(y, "addend")?;
        let n = x.numel();
        let (yb, xb) = (self.buf(y)?, self.buf(x)?);
        self.launch_1d("add", &[u32_of(n, "elements")?], &[&yb, &xb], n)
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
        u32_of(k_cache.numel(), "kv cache size")?;
        let sb = self.temp("slots", bytemuck::cast_slice(slot_mapping));
        let (kb, vb, kcb, vcb) = (self.buf(k)?, self.buf(v)?, self.buf(k_cache)?, self.buf(v_cache)?);
        let params = [width as u32, u32_of(slot_mapping.len(), "tokens")?];
        self.launch_1d("write_kv", &params, &[&sb, &kb, &vb, &kcb, &vcb], k.numel())
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
        if head_dim > MAX_HEAD_DIM {
            return Err(Error::Unsupported(format!(
                "wgpu attention handles head_dim up to {MAX_HEAD_DIM}, not {head_dim}"
            )));
        }
        for (t, what) in [(q, "q"), (k_cache, "k cache"), (v_cache, "v cache"), (&*out, "attention output")] {
            f32_check(t, what)?;
        }
        u32_of(k_cache.numel(), "kv cache size")?;
        let mut info = vec![0u32; 2 * tokens];
        let mut tables: Vec<u32> = Vec::new();
        for s in meta.seqs {
            let blocks_needed = s.context_len.div_ceil(meta.block_size);
            let offset = u32_of(tables.len(), "block table offset")?;
            tables.extend_from_slice(&s.block_table[..blocks_needed]);
            let first_pos = s.context_len - s.query_len;
            for i in 0..s.query_len {
                let t = s.query_start + i;
                info[2 * t] = offset;
                info[2 * t + 1] = u32_of(first_pos + i, "position")?;
            }
        }
        let window = match meta.sliding_window {
            Some(0) => return Err(Error::invalid("a sliding window of 0 positions")),
            Some(w) => u32_of(w, "sliding window")?,
            None => 0,
        };
        let g = grid((tokens * heads) as u64);
        let params = [
            tokens as u32,
            heads as u32,
            kv_heads as u32,
            head_dim as u32,
            u32_of(meta.block_size, "block size")?,
            meta.scale.to_bits(),
            window,
            g.0,
        ];
        let ib = self.temp("token_info", bytemuck::cast_slice(&info));
        let tb = self.temp("block_tables", bytemuck::cast_slice(&tables));
        let (qb, kb, vb, ob) = (self.buf(q)?, self.buf(k_cache)?, self.buf(v_cache)?, self.buf(out)?);
        self.launch("attention", &params, &[&qb, &kb, &vb, &ib, &tb, &ob], g)
    }

    fn gather_rows(&self, x: &Tensor, rows: &[u32], out: &mut Tensor) -> Result<()> {
        let width = checks::gather_rows(x, rows, out)?;
        f32_check(x, "gather_rows input")?;
        f32_check(out, "gather_rows output")?;
        if out.numel() == 0 {
            return Ok(());
        }
        let rb = self.temp("rows", bytemuck::cast_slice(rows));
        let (xb, ob) = (self.buf(x)?, self.buf(out)?);
        let params = [u32_of(width, "row width")?, u32_of(rows.len(), "rows")?];
        self.launch_1d("gather_rows", &params, &[&rb, &xb, &ob], out.numel())
    }
}
