//! tm-cpu: the CPU reference backend.
//!
//! Implements tm-core's `Device`, `Allocator` and `Ops` on the host: rayon for parallelism,
//! faer for f32 matrix products, dequantize-on-the-fly kernels for int4/int8 weights. Every
//! other backend is tested op by op against it. Activations are f32; dense weight matrices are
//! held as stored (f32, f16 or bf16: a bf16 checkpoint takes its own size in memory, not twice it)
//! and widened to f32 as the kernels read them ([`matmul_16bit`]); vectors (norm weights, biases)
//! are widened to f32 once at load ([`Ops::vector_dtype`]). The KV cache is f32 or FP8 E4M3
//! (`write_kv` encodes, `attention` decodes exactly).

pub mod allocator;
pub mod attention;
pub mod device;
pub mod fast_exp;
pub mod matmul;
pub mod matmul_16bit;
pub mod norm;
pub mod quant_matmul;
pub mod rope;

pub use allocator::CpuAllocator;
pub use device::CpuDevice;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tm_core::fp8::{self, E4M3};
use tm_core::ops::{deferred_norm_slot, sample_rows, AttentionMeta, DeferredNorm, SampleRequest, DEFERRED_NORM_ROWS};
use tm_core::quant::Weight;
use tm_core::rope::RopeFreqs;

use tm_core::checks::{self, rows_of, same_numel};
use tm_core::{Allocator, DType, Device, Error, Ops, Result, Tensor};

/// The CPU backend.
#[derive(Debug)]
pub struct CpuBackend {
    allocator: Arc<dyn Allocator>,
    step_in_pool: bool,
    /// Whether residual joins are deferred (`with_deferred_norms`), and how many were.
    defer_norms: bool,
    deferred_joins: AtomicUsize,
}

impl CpuBackend {
    /// A backend with an uncapped allocator.
    pub fn new() -> Self {
        CpuBackend::build(CpuAllocator::new(), true)
    }

    /// A backend whose allocator refuses to hold more than `cap` bytes.
    pub fn with_memory_cap(cap: u64) -> Self {
        CpuBackend::build(CpuAllocator::with_cap(Some(cap)), true)
    }

    /// A backend for one rank thread of a tensor-parallel group: `run_step` runs the step on
    /// the calling thread instead of inside the rayon pool (kernels still fan out over the pool).
    /// A step blocks in collectives while it waits for the other ranks; inside the shared pool
    /// that would hold a worker, and with more ranks than workers the last ranks' steps would
    /// never start.
    pub fn for_rank_thread() -> Self {
        CpuBackend::build(CpuAllocator::new(), false)
    }

    fn build(allocator: CpuAllocator, step_in_pool: bool) -> Self {
        CpuBackend {
            allocator: Arc::new(allocator),
            step_in_pool,
            defer_norms: false,
            deferred_joins: AtomicUsize::new(0),
        }
    }

    /// This backend deferring the models' residual joins the way the CUDA backend defers int4
    /// decode joins (`Ops::matmul_add_rms_norm_deferred`: the join's output left unscaled, the
    /// sums of squares in the step's slot, the next ops finishing the norm), for any weight: so
    /// that the models' deferred path runs, and is tested, without a GPU. Slower than the plain
    /// path (the scale is applied in a second pass); not for serving.
    pub fn with_deferred_norms(mut self) -> Self {
        self.defer_norms = true;
        self
    }

    /// How many joins this backend has deferred.
    pub fn deferred_joins(&self) -> usize {
        self.deferred_joins.load(Ordering::Relaxed)
    }
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

fn f32s<'a>(t: &'a Tensor, what: &str) -> Result<&'a [f32]> {
    t.expect_dtype(what, DType::F32)?;
    t.host::<f32>()
}

fn f32s_mut<'a>(t: &'a mut Tensor, what: &str) -> Result<&'a mut [f32]> {
    t.expect_dtype(what, DType::F32)?;
    t.host_mut::<f32>()
}

/// An FP8 E4M3 KV cache's codes (the cache's dtype checked).
fn e4m3s<'a>(t: &'a Tensor, what: &str) -> Result<&'a [E4M3]> {
    t.expect_dtype(what, DType::F8E4M3)?;
    t.host::<E4M3>()
}

/// An FP8 E4M3 KV cache's codes as bytes, for writing (the cache's dtype checked).
fn e4m3s_mut<'a>(t: &'a mut Tensor, what: &str) -> Result<&'a mut [u8]> {
    t.expect_dtype(what, DType::F8E4M3)?;
    t.host_mut::<u8>()
}

impl Ops for CpuBackend {
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
        // every float dtype as stored (f32, f16, bf16); the kernels widen as they read
        src
    }
    fn vector_dtype(&self, src: DType) -> DType {
        // norm weights and biases in f32, as the kernels take them (a few KiB per layer)
        if src.is_float() {
            DType::F32
        } else {
            src
        }
    }
    fn supports_kv_cache_dtype(&self, dtype: DType) -> bool {
        matches!(dtype, DType::F32 | DType::F8E4M3)
    }

    fn run_step(&self, step: &mut (dyn FnMut() -> Result<()> + Send)) -> Result<()> {
        if !self.step_in_pool {
            return step();
        }
        // Inside the pool, each kernel's parallel fan-out costs far less than from an outside
        // thread (about 7 µs per call otherwise, over 200 calls per token).
        rayon::scope(|_| step())
    }

    fn sample(&self, logits: &Tensor, requests: &mut [SampleRequest<'_>]) -> Result<Vec<u32>> {
        /// A logits row and the sampler's candidate list, reused across calls.
        type Scratch = (Vec<f32>, Vec<(f32, u32)>);
        thread_local! {
            static SCRATCH: std::cell::RefCell<Scratch> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
        }
        let shape = logits.shape();
        if shape.len() != 2 || shape[0] != requests.len() {
            return Err(Error::shape("sample", format!("[{}, vocab]", requests.len()), shape));
        }
        let all = f32s(logits, "logits")?;
        Ok(SCRATCH.with(|cell| {
            let (row, scratch) = &mut *cell.borrow_mut();
            sample_rows(all, shape[1], requests, row, scratch)
        }))
    }

    fn upload(&self, dst: &mut Tensor, src: &[u8]) -> Result<()> {
        let n = dst.desc().bytes();
        if src.len() != n {
            return Err(Error::shape("upload", format!("{n} bytes"), format!("{} bytes", src.len())));
        }
        let bytes = dst.buffer_mut().host_bytes_mut().ok_or_else(|| Error::Unsupported("cpu upload".into()))?;
        bytes[..n].copy_from_slice(src);
        Ok(())
    }

    fn download(&self, src: &Tensor, dst: &mut [u8]) -> Result<()> {
        let n = src.desc().bytes();
        let bytes = src.buffer().host_bytes().ok_or_else(|| Error::Unsupported("cpu download".into()))?;
        if dst.len() != n {
            return Err(Error::shape("download", format!("{n} bytes"), format!("{} bytes", dst.len())));
        }
        dst.copy_from_slice(&bytes[..n]);
        Ok(())
    }

    fn load_dense(&self, src_dtype: DType, shape: &[usize], src: &[u8], phase: &str) -> Result<Tensor> {
        let desc = tm_core::TensorDesc::new(src_dtype, shape);
        if src.len() != desc.bytes() {
            return Err(Error::shape(
                "load_dense",
                format!("{} bytes for {shape:?} {src_dtype}", desc.bytes()),
                src.len(),
            ));
        }
        let target = if shape.len() == 1 { self.vector_dtype(src_dtype) } else { self.weight_dtype(src_dtype) };
        if target != src_dtype {
            let widened = tm_core::ops::to_f32(src_dtype, src)?;
            let mut t = self.zeros(tm_core::TensorDesc::new(DType::F32, shape), phase)?;
            self.upload(&mut t, bytemuck::cast_slice(&widened))?;
            return Ok(t);
        }
        let mut t = self.zeros(desc, phase)?;
        self.upload(&mut t, src)?;
        Ok(t)
    }

    fn embedding(&self, table: &Weight, ids: &[u32], out: &mut Tensor) -> Result<()> {
        let hidden = checks::embedding(table, ids, out)?;
        let o = f32s_mut(out, "embedding output")?;
        for (row, &id) in o.chunks_mut(hidden).zip(ids) {
            matmul::weight_row(table, id as usize, row)?;
        }
        Ok(())
    }

    fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f32, out: &mut Tensor) -> Result<()> {
        same_numel("rms_norm", x, out)?;
        rows_of("rms_norm", x, weight.numel())?;
        norm::rms_norm(
            f32s(x, "rms_norm input")?,
            &matmul::vector_f32(weight, "rms_norm weight")?,
            eps,
            f32s_mut(out, "rms_norm output")?,
        );
        Ok(())
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
        rows_of("add_rms_norm", x, weight.numel())?;
        norm::add_rms_norm(
            f32s(x, "add_rms_norm input")?,
            f32s_mut(residual, "residual")?,
            &matmul::vector_f32(weight, "rms_norm weight")?,
            eps,
            f32s_mut(out, "add_rms_norm output")?,
        );
        Ok(())
    }

    fn fill_zero(&self, t: &mut Tensor) -> Result<()> {
        t.host_mut::<u8>()?.fill(0);
        Ok(())
    }

    fn defers_norm_joins(&self) -> bool {
        self.defer_norms
    }

    fn matmul_add_rms_norm_deferred(
        &self,
        x: &Tensor,
        w: &Weight,
        residual: &mut Tensor,
        norm: &Tensor,
        _eps: f32,
        out: &mut Tensor,
        sums: &mut Tensor,
        slot: usize,
    ) -> Result<bool> {
        let rows = w.dims().0;
        if !self.defer_norms || residual.numel() != out.numel() || norm.numel() != rows {
            return Ok(false);
        }
        let n = out.numel() / rows;
        if n > DEFERRED_NORM_ROWS {
            return Ok(false);
        }
        let range = deferred_norm_slot(sums, slot)?;
        // out = x W^T, then the join's elementwise part in place: residual += out, out = residual
        // * norm, and the rows' sums of squares of the new residual added into the slot.
        self.matmul(x, w, None, out)?;
        let g = matmul::vector_f32(norm, "norm weight")?;
        let (r, o) = (f32s_mut(residual, "residual")?, f32s_mut(out, "join output")?);
        let slot_sums = &mut sums.host_mut::<f64>()?[range];
        for ((rr, or), sum) in r.chunks_mut(rows).zip(o.chunks_mut(rows)).zip(slot_sums) {
            let mut ss = 0f64;
            for ((ri, oi), gi) in rr.iter_mut().zip(or.iter_mut()).zip(g.iter()) {
                *ri += *oi;
                *oi = *ri * gi;
                ss += f64::from(*ri) * f64::from(*ri);
            }
            *sum += ss;
        }
        self.deferred_joins.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }

    fn finish_deferred_norm(&self, x: &mut Tensor, norm: &DeferredNorm<'_>) -> Result<()> {
        let range = deferred_norm_slot(norm.sums, norm.slot)?;
        let shape = x.shape().to_vec();
        let [n, cols] = shape[..] else {
            return Err(Error::shape("deferred join output", "[n, cols]", &shape[..]));
        };
        if n > DEFERRED_NORM_ROWS {
            return Err(Error::invalid(format!("a deferred join of {n} rows (at most {DEFERRED_NORM_ROWS})")));
        }
        let slot_sums = &norm.sums.host::<f64>()?[range];
        for (row, &sum) in f32s_mut(x, "deferred join output")?.chunks_mut(cols).zip(slot_sums) {
            let scale = 1.0 / ((sum / cols as f64) as f32 + norm.eps).sqrt();
            row.iter_mut().for_each(|v| *v *= scale);
        }
        Ok(())
    }

    fn matmul(&self, x: &Tensor, w: &Weight, bias: Option<&Tensor>, out: &mut Tensor) -> Result<()> {
        let (rows, cols) = w.dims();
        let n = rows_of("matmul input", x, cols)?;
        if out.numel() != n * rows {
            return Err(Error::shape("matmul output", [n, rows], out.shape()));
        }
        let xs = f32s(x, "matmul input")?;
        let os = f32s_mut(out, "matmul output")?;
        matmul::matmul(xs, n, w, os)?;
        if let Some(b) = bias {
            let b = matmul::vector_f32(b, "bias")?;
            if b.len() != rows {
                return Err(Error::shape("bias", [rows], [b.len()]));
            }
            for row in os.chunks_mut(rows) {
                for (o, bi) in row.iter_mut().zip(b.iter()) {
                    *o += bi;
                }
            }
        }
        Ok(())
    }

    fn rope(&self, x: &mut Tensor, positions: &[u32], freqs: &RopeFreqs) -> Result<()> {
        let head_dim = 2 * freqs.inv_freq.len();
        let tokens = positions.len();
        if tokens == 0 || !x.numel().is_multiple_of(tokens * head_dim.max(1)) {
            return Err(Error::shape("rope", format!("[{tokens}, heads * {head_dim}]"), x.shape()));
        }
        rope::rope(f32s_mut(x, "rope input")?, head_dim, positions, freqs);
        Ok(())
    }

    fn silu_mul(&self, gate: &Tensor, up: &Tensor, out: &mut Tensor) -> Result<()> {
        same_numel("silu_mul", gate, up)?;
        same_numel("silu_mul", gate, out)?;
        let (g, u) = (f32s(gate, "gate")?, f32s(up, "up")?);
        use rayon::prelude::*;
        const PIECE: usize = 2048;
        f32s_mut(out, "silu_mul output")?
            .par_chunks_mut(PIECE)
            .zip(g.par_chunks(PIECE).zip(u.par_chunks(PIECE)))
            .for_each(|(o, (g, u))| fast_exp::silu_mul(g, u, o));
        Ok(())
    }

    fn add_in_place(&self, x: &mut Tensor, y: &Tensor) -> Result<()> {
        same_numel("add_in_place", x, y)?;
        let ys = f32s(y, "addend")?;
        for (a, b) in f32s_mut(x, "add_in_place")?.iter_mut().zip(ys) {
            *a += b;
        }
        Ok(())
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
        let (ks, vs) = (f32s(k, "k")?, f32s(v, "v")?);
        if k_cache.dtype() == DType::F8E4M3 {
            for (cache, src) in [(e4m3s_mut(k_cache, "k cache")?, ks), (e4m3s_mut(v_cache, "v cache")?, vs)] {
                for (t, &slot) in slot_mapping.iter().enumerate() {
                    let s = slot as usize * width;
                    fp8::encode_slice(&src[t * width..(t + 1) * width], &mut cache[s..s + width]);
                }
            }
            return Ok(());
        }
        for (cache, src) in [(f32s_mut(k_cache, "k cache")?, ks), (f32s_mut(v_cache, "v cache")?, vs)] {
            for (t, &slot) in slot_mapping.iter().enumerate() {
                let s = slot as usize * width;
                cache[s..s + width].copy_from_slice(&src[t * width..(t + 1) * width]);
            }
        }
        Ok(())
    }

    fn attention(
        &self,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        meta: &AttentionMeta<'_>,
        out: &mut Tensor,
    ) -> Result<()> {
        let checks::AttentionDims { heads, kv_heads, head_dim, .. } =
            checks::attention(q, k_cache, v_cache, meta, out)?;
        let dims = attention::AttnDims { heads, kv_heads, head_dim };
        let (qs, os) = (f32s(q, "q")?, f32s_mut(out, "attention output")?);
        if k_cache.dtype() == DType::F8E4M3 {
            let (kc, vc) = (e4m3s(k_cache, "k cache")?, e4m3s(v_cache, "v cache")?);
            attention::paged_attention(qs, kc, vc, meta, dims, os);
        } else {
            let (kc, vc) = (f32s(k_cache, "k cache")?, f32s(v_cache, "v cache")?);
            attention::paged_attention(qs, kc, vc, meta, dims, os);
        }
        Ok(())
    }

    fn gather_rows(&self, x: &Tensor, rows: &[u32], out: &mut Tensor) -> Result<()> {
        let width = checks::gather_rows(x, rows, out)?;
        let xs = f32s(x, "gather_rows input")?;
        let os = f32s_mut(out, "gather_rows output")?;
        for (o, &r) in os.chunks_mut(width).zip(rows) {
            o.copy_from_slice(&xs[r as usize * width..(r as usize + 1) * width]);
        }
        Ok(())
    }
}
