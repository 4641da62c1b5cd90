//! Decode-shaped dense products through `gemv.cu` instead of cuBLASLt: a single product
//! ([`CudaBackend::try_gemv`]), q/k/v in one launch ([`CudaBackend::fused_matmul_many`]) and
//! gate/up/silu in one launch ([`CudaBackend::fused_gate_up_silu`]). Each returns `Ok(false)`
//! when the shapes, dtypes or addresses do not fit the kernels, and the caller takes the general
//! path. `TM_CUDA_GEMV=0` turns the path off (to compare with cuBLASLt).

use std::sync::OnceLock;

use tm_core::checks::rows_of;
use tm_core::quant::Weight;
use tm_core::{Error, Result, Tensor};

use super::{ptr, CudaBackend};
use crate::kernels::gemv::{self, GemvSlot};

/// Whether the GEMV path is on (`TM_CUDA_GEMV` is not `0`).
fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("TM_CUDA_GEMV").map_or(true, |v| v.trim() != "0"))
}

/// The dense matrix of `w`, if it is one.
fn dense(w: &Weight) -> Option<&Tensor> {
    match w {
        Weight::Dense(t) => Some(t),
        _ => None,
    }
}

impl CudaBackend {
    /// `outs[i] = x W_iᵀ (+ biases[i])` as one GEMV launch when every weight is dense with the
    /// same `cols`, there are at most three, and `x` is a decode batch. Shapes are checked.
    pub(super) fn fused_matmul_many(
        &self,
        x: &Tensor,
        weights: &[&Weight],
        biases: &[Option<&Tensor>],
        outs: &mut [&mut Tensor],
    ) -> Result<bool> {
        if !enabled()
            || weights.is_empty()
            || weights.len() > 3
            || weights.len() != outs.len()
            || biases.len() != outs.len()
        {
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

    /// One dense product through the GEMV kernel, when it fits (shapes already checked).
    pub(super) fn try_gemv(&self, x: &Tensor, w: &Tensor, n: usize, out: &mut Tensor) -> Result<bool> {
        let (rows, cols) = (w.shape()[0], w.shape()[1]);
        if !enabled() || !gemv::fits(self.dtype, n, cols, &[ptr(x), ptr(w)]) {
            return Ok(false);
        }
        gemv::gemv(&self.gpu, self.dtype, ptr(x), n, cols, &[GemvSlot { w: ptr(w), bias: 0, out: ptr(out), rows }])?;
        Ok(true)
    }

    /// `out = silu(x Gᵀ) * (x Uᵀ)` as one launch when both weights are dense `[rows, cols]` and
    /// `x` is a decode batch. Shapes are checked.
    pub(super) fn fused_gate_up_silu(&self, x: &Tensor, gate: &Weight, up: &Weight, out: &mut Tensor) -> Result<bool> {
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
}
