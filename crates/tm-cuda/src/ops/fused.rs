//! Decode-shaped products in one launch each: dense weights through `gemv.cu` instead of
//! cuBLASLt, int4 weights through `q4_gemv.cu` (tensor cores) instead of `quant.cu`'s CUDA-core
//! GEMV: a single product ([`CudaBackend::try_gemv`], [`CudaBackend::try_q4_gemv`]), q/k/v in one
//! launch ([`CudaBackend::fused_matmul_many`]) and gate/up/silu in one launch
//! ([`CudaBackend::fused_gate_up_silu`]). Each returns `Ok(false)` when the shapes, dtypes or
//! addresses do not fit the kernels, and the caller takes the general path. `TM_CUDA_GEMV=0`
//! turns the dense path off (to compare with cuBLASLt), `TM_Q4_GEMV=0` the int4 one.

use std::sync::OnceLock;

use tm_core::checks::rows_of;
use tm_core::quant::{Int4Layout, QuantWeight, Weight};
use tm_core::{Error, Result, Tensor};

use super::{int4_mins, ptr, CudaBackend};
use crate::kernels::elementwise as ew;
use crate::kernels::gemv::{self, GemvSlot};
use crate::kernels::q4_gemv::{self, NormArgs, Q4Slot, Unroll};

/// Whether the GEMV path is on (`TM_CUDA_GEMV` is not `0`).
fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("TM_CUDA_GEMV").map_or(true, |v| v.trim() != "0"))
}

/// The int4 matrix of `w`, if it is one.
fn int4(w: &Weight) -> Option<&QuantWeight> {
    match w {
        Weight::Int4(q) => Some(q),
        _ => None,
    }
}

/// The device addresses of an int4 weight (its output and bias left 0).
pub(super) fn q4_slot(q: &QuantWeight) -> Result<Q4Slot> {
    Ok(Q4Slot {
        packed: ptr(&q.packed),
        scales: ptr(&q.scales),
        mins: int4_mins(q)?,
        bias: 0,
        out: 0,
        rows: q.rows,
        layout: q.layout,
    })
}

/// The dense matrix of `w`, if it is one.
fn dense(w: &Weight) -> Option<&Tensor> {
    match w {
        Weight::Dense(t) => Some(t),
        _ => None,
    }
}

/// Whether tile-major int4 gate and up weights get tile-ordered scales and mins
/// ([`CudaBackend::tile_gate_up_scales`]; `TM_GATE_UP_TILED_SCALES=0` keeps them row-major, for
/// comparisons).
fn tiled_gate_up_scales() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("TM_GATE_UP_TILED_SCALES").map_or(true, |v| v.trim() != "0"))
}

/// Reorders an int4 weight's scales and mins into tile order (a download, a host reorder and an
/// upload into the same tensors) and marks it [`Int4Layout::TilesAndScales16x128`].
fn reorder_scales(be: &CudaBackend, q: &mut QuantWeight) -> Result<()> {
    use tm_core::Ops;
    let groups = q.cols / q.group_size;
    let QuantWeight { scales, mins, rows, .. } = q;
    let mins = mins.as_mut().ok_or_else(|| Error::invalid("int4 weight without mins"))?;
    for t in [scales, mins] {
        let mut host = vec![0u8; t.desc().bytes()];
        be.download(t, &mut host)?;
        let vals: Vec<[u8; 2]> = host.chunks_exact(2).map(|b| [b[0], b[1]]).collect();
        let tiled = tm_core::quant::tile_scales(&vals, *rows, groups)?;
        be.upload(t, tiled.as_flattened())?;
    }
    q.layout = Int4Layout::TilesAndScales16x128;
    Ok(())
}

impl CudaBackend {
    /// [`tm_core::Ops::prepare_gate_up`]: when both weights are tile-major int4 of the same shape
    /// in the lean kernels' shapes, reorders their scales and mins into tile order, which the
    /// gate/up/SiLU decode kernel `silu_lnts` reads with one 32-bit load per lane, tile and step
    /// instead of two 16-bit loads over eight rows' sectors: AWQ Llama-3-8B batch-1 replay on the
    /// H200 1942.7-1949.7 us against 1951.9-1962.2 (`TM_GATE_UP_TILED_SCALES=0`, five
    /// alternations). Every other int4 kernel reads the order too (`tmk::q4_scale_index`).
    pub(super) fn tile_gate_up_scales(&self, gate: &mut Weight, up: &mut Weight) -> Result<()> {
        let (Weight::Int4(g), Weight::Int4(u)) = (gate, up) else { return Ok(()) };
        if !tiled_gate_up_scales()
            || g.layout != Int4Layout::Tiles16x128
            || u.layout != Int4Layout::Tiles16x128
            || (g.rows, g.cols, g.group_size) != (u.rows, u.cols, u.group_size)
            || !q4_gemv::lean_fits(g.cols, g.group_size, &[q4_slot(g)?, q4_slot(u)?])
        {
            return Ok(());
        }
        reorder_scales(self, g)?;
        reorder_scales(self, u)
    }

    /// `outs[i] = x W_iᵀ (+ biases[i])` as one GEMV launch when every weight is dense (or every
    /// one int4 with the same group size) with the same `cols`, there are at most three, and `x`
    /// is a decode batch. Shapes are checked.
    pub(super) fn fused_matmul_many(
        &self,
        x: &Tensor,
        weights: &[&Weight],
        biases: &[Option<&Tensor>],
        outs: &mut [&mut Tensor],
    ) -> Result<bool> {
        if weights.is_empty() || weights.len() > 3 || weights.len() != outs.len() || biases.len() != outs.len() {
            return Ok(false);
        }
        if weights.iter().all(|w| int4(w).is_some()) {
            return self.fused_q4_many(x, weights, biases, outs);
        }
        if !enabled() {
            return Ok(false);
        }
        let Some(ts) = weights.iter().map(|w| dense(w)).collect::<Option<Vec<_>>>() else { return Ok(false) };
        let cols = weights[0].dims().1;
        if weights.iter().any(|w| w.dims().1 != cols) {
            return Ok(false);
        }
        let n = rows_of("matmul input", x, cols)?;
        let mut slots = Vec::with_capacity(3);
        let mut addrs = vec![ptr(x)];
        for ((w, b), out) in ts.iter().zip(biases).zip(outs.iter()) {
            let rows = w.shape()[0];
            if out.numel() != n * rows {
                return Err(Error::shape("matmul output", [n, rows], out.shape()));
            }
            if let Some(b) = b {
                if b.numel() != rows {
                    return Err(Error::shape("bias", [rows], b.shape()));
                }
                self.check(b, "bias")?;
            }
            self.check(w, "matmul weight")?;
            self.check(out, "matmul output")?;
            addrs.push(ptr(w));
            slots.push(GemvSlot { w: ptr(w), bias: b.map_or(0, ptr), out: ptr(out), rows });
        }
        if !gemv::fits(self.dtype, n, cols, &addrs) {
            return Ok(false);
        }
        self.check(x, "matmul input")?;
        gemv::gemv(&self.gpu, self.dtype, ptr(x), n, cols, &slots)?;
        Ok(true)
    }

    /// [`CudaBackend::fused_matmul_many`] for int4 weights: one `q4_gemv` launch when they share
    /// `cols` and the group size and `x` is a decode batch.
    fn fused_q4_many(
        &self,
        x: &Tensor,
        weights: &[&Weight],
        biases: &[Option<&Tensor>],
        outs: &mut [&mut Tensor],
    ) -> Result<bool> {
        let Some(qs) = weights.iter().map(|w| int4(w)).collect::<Option<Vec<_>>>() else { return Ok(false) };
        let (cols, group) = (qs[0].cols, qs[0].group_size);
        if !q4_gemv::enabled() || qs.iter().any(|q| q.cols != cols || q.group_size != group) {
            return Ok(false);
        }
        let n = rows_of("matmul input", x, cols)?;
        let slots = self.q4_slots(n, &qs, biases, outs)?;
        if !q4_gemv::fits(self.dtype, n, cols, group, ptr(x), &slots) {
            // Decode batches above the GEMV's: one prefill-GEMM launch for them all, then the
            // biases.
            if !self.q4_grouped(x, &qs, outs)? {
                return Ok(false);
            }
            for (b, out) in biases.iter().zip(outs.iter_mut()) {
                if let Some(b) = b {
                    ew::add_bias(&self.gpu, self.dtype, ptr(out), ptr(b), n, out.numel() / n)?;
                }
            }
            return Ok(true);
        }
        self.check(x, "matmul input")?;
        q4_gemv::q4_gemv(&self.gpu, self.dtype, ptr(x), n, cols, group, &slots, Unroll::Auto)?;
        Ok(true)
    }

    /// The launch slots of int4 weights `qs` with their `biases` and outputs for `n` activation
    /// rows, after checking the outputs' and biases' shapes and dtypes.
    pub(super) fn q4_slots(
        &self,
        n: usize,
        qs: &[&QuantWeight],
        biases: &[Option<&Tensor>],
        outs: &[&mut Tensor],
    ) -> Result<Vec<Q4Slot>> {
        let mut slots = Vec::with_capacity(qs.len());
        for ((q, b), out) in qs.iter().zip(biases).zip(outs) {
            if out.numel() != n * q.rows {
                return Err(Error::shape("matmul output", [n, q.rows], out.shape()));
            }
            if let Some(b) = b {
                if b.numel() != q.rows {
                    return Err(Error::shape("bias", [q.rows], b.shape()));
                }
                self.check(b, "bias")?;
            }
            self.check(out, "matmul output")?;
            slots.push(Q4Slot { bias: b.map_or(0, ptr), out: ptr(out), ..q4_slot(q)? });
        }
        Ok(slots)
    }

    /// One int4 product through the tensor-core GEMV, when it fits (shapes already checked; a
    /// bias is added by the caller).
    pub(super) fn try_q4_gemv(&self, x: &Tensor, q: &QuantWeight, n: usize, out: &mut Tensor) -> Result<bool> {
        let slot = Q4Slot { out: ptr(out), ..q4_slot(q)? };
        if !q4_gemv::enabled() || !q4_gemv::fits(self.dtype, n, q.cols, q.group_size, ptr(x), &[slot]) {
            return Ok(false);
        }
        q4_gemv::q4_gemv(&self.gpu, self.dtype, ptr(x), n, q.cols, q.group_size, &[slot], Unroll::Auto)?;
        Ok(true)
    }

    /// One dense product through the GEMV kernel, when it fits (shapes already checked).
    pub(super) fn try_gemv(&self, x: &Tensor, w: &Tensor, n: usize, out: &mut Tensor) -> Result<bool> {
        let (rows, cols) = (w.shape()[0], w.shape()[1]);
        if !enabled() || !gemv::fits(self.dtype, n, cols, &[ptr(x), ptr(w)]) {
            return Ok(false);
        }
        gemv::gemv(&self.gpu, self.dtype, ptr(x), n, cols, &[GemvSlot { w: ptr(w), bias: 0, out: ptr(out), rows }])?;
        Ok(true)
    }

    /// `out = silu(x Gᵀ) * (x Uᵀ)` as one launch when both weights are dense `[rows, cols]` (or
    /// both int4 with the same group size) and `x` is a decode batch. Shapes are checked.
    pub(super) fn fused_gate_up_silu(&self, x: &Tensor, gate: &Weight, up: &Weight, out: &mut Tensor) -> Result<bool> {
        if let (Some(g), Some(u)) = (int4(gate), int4(up)) {
            return self.fused_q4_gate_up_silu(x, g, u, out, None);
        }
        let (Some(g), Some(u)) = (dense(gate), dense(up)) else { return Ok(false) };
        if !enabled() || gate.dims() != up.dims() {
            return Ok(false);
        }
        let (rows, cols) = gate.dims();
        let n = rows_of("matmul input", x, cols)?;
        if out.numel() != n * rows {
            return Err(Error::shape("gate_up_silu output", [n, rows], out.shape()));
        }
        if !gemv::fits(self.dtype, n, cols, &[ptr(x), ptr(g), ptr(u)]) {
            return Ok(false);
        }
        for (t, what) in [(x, "matmul input"), (g, "gate weight"), (u, "up weight"), (&*out, "gate_up_silu output")] {
            self.check(t, what)?;
        }
        gemv::gemv_silu(&self.gpu, self.dtype, ptr(out), ptr(g), ptr(u), ptr(x), n, rows, cols)?;
        Ok(true)
    }

    /// [`CudaBackend::fused_gate_up_silu`] for int4 weights of the same shape and group size; with
    /// `norm`, `x` is a deferred join's output whose row scale the kernel applies.
    pub(super) fn fused_q4_gate_up_silu(
        &self,
        x: &Tensor,
        gate: &QuantWeight,
        up: &QuantWeight,
        out: &mut Tensor,
        norm: Option<&NormArgs>,
    ) -> Result<bool> {
        let (rows, cols, group) = (gate.rows, gate.cols, gate.group_size);
        if !q4_gemv::enabled() || (up.rows, up.cols, up.group_size) != (rows, cols, group) {
            return Ok(false);
        }
        let n = rows_of("matmul input", x, cols)?;
        if out.numel() != n * rows {
            return Err(Error::shape("gate_up_silu output", [n, rows], out.shape()));
        }
        let (g, u) = (q4_slot(gate)?, q4_slot(up)?);
        if !q4_gemv::fits_silu(self.dtype, n, cols, group, ptr(x), &g, &u) {
            return Ok(false);
        }
        self.check(x, "matmul input")?;
        self.check(out, "gate_up_silu output")?;
        q4_gemv::q4_gemv_silu(&self.gpu, self.dtype, ptr(out), &g, &u, ptr(x), n, cols, group, Unroll::Auto, norm)?;
        Ok(true)
    }
}
