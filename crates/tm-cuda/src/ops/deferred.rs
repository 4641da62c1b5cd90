//! Deferred RMSNorm (tm-core's `DeferredNorm`; q4_gemv.cu, "Deferred RMSNorm"): an int4 decode
//! product (o, down) that ends with the residual join's elementwise part and leaves the norm's row
//! scale to the next products (gate/up, q/k/v), which fold it into their epilogues. The batch-1
//! chain of a Llama-3-8B-shaped int4 model loses its two `add_rms_norm` kernels per layer
//! (scripts/gpu/q4_decode_chain.cu: -30..-38 us per step). `TM_DEFER_NORM=0` turns it off.

use std::sync::OnceLock;

use tm_core::checks::rows_of;
use tm_core::ops::{deferred_norm_slot, DeferredNorm, DEFERRED_NORM_ROWS};
use tm_core::quant::Weight;
use tm_core::{Error, Result, Tensor};

use super::{fused, ptr, CudaBackend};
use crate::kernels::elementwise as ew;
use crate::kernels::q4_gemv::{self, NormArgs, Q4Slot};

/// Whether joins may be deferred (`TM_DEFER_NORM` is not `0`).
pub(super) fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("TM_DEFER_NORM").map_or(true, |v| v.trim() != "0"))
}

/// The device address of slot `slot` of `sums` (tm-core's `deferred_norm_slot`).
fn slot_addr(sums: &Tensor, slot: usize) -> Result<u64> {
    let range = deferred_norm_slot(sums, slot)?;
    Ok(ptr(sums) + (range.start * 8) as u64)
}

impl CudaBackend {
    /// The kernels' form of `norm`.
    pub(super) fn norm_args(&self, norm: &DeferredNorm<'_>) -> Result<NormArgs> {
        Ok(NormArgs { sums: slot_addr(norm.sums, norm.slot)?, eps: norm.eps })
    }

    /// `Ops::matmul_add_rms_norm_deferred`: one `q4_gemv_*_join` launch when `w` is int4, `x` a
    /// decode batch of at most `DEFERRED_NORM_ROWS` rows and `w`'s rows the residual's width.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn join_deferred(
        &self,
        x: &Tensor,
        w: &Weight,
        residual: &mut Tensor,
        norm: &Tensor,
        _eps: f32, // the consumers' (`DeferredNorm::eps`)
        out: &mut Tensor,
        sums: &mut Tensor,
        slot: usize,
    ) -> Result<bool> {
        let Weight::Int4(q) = w else { return Ok(false) };
        if !enabled() || !q4_gemv::enabled() {
            return Ok(false);
        }
        let (rows, cols, group) = (q.rows, q.cols, q.group_size);
        let n = rows_of("matmul input", x, cols)?;
        if n > DEFERRED_NORM_ROWS || residual.numel() != n * rows || norm.numel() != rows {
            return Ok(false);
        }
        if out.numel() != n * rows {
            return Err(Error::shape("deferred join output", [n, rows], out.shape()));
        }
        let weight = Q4Slot { out: ptr(out), ..fused::q4_slot(q)? };
        if !q4_gemv::fits(self.dtype, n, cols, group, ptr(x), &[weight]) {
            return Ok(false);
        }
        for (t, what) in [(x, "matmul input"), (&*residual, "residual"), (norm, "norm weight"), (&*out, "join output")]
        {
            self.check(t, what)?;
        }
        let sums = slot_addr(sums, slot)?;
        q4_gemv::q4_gemv_join(&self.gpu, self.dtype, ptr(x), n, cols, group, &weight, ptr(residual), ptr(norm), sums)?;
        Ok(true)
    }

    /// `Ops::finish_deferred_norm`: `x` (`[n, cols]`) scaled in place by its rows' scales.
    pub(super) fn finish_norm(&self, x: &mut Tensor, norm: &DeferredNorm<'_>) -> Result<()> {
        let shape = x.shape().to_vec();
        let (n, cols) = match shape[..] {
            [n, cols] => (n, cols),
            _ => return Err(Error::shape("deferred join output", "[n, cols]", &shape[..])),
        };
        if n > DEFERRED_NORM_ROWS {
            return Err(Error::invalid(format!("a deferred join of {n} rows (at most {DEFERRED_NORM_ROWS})")));
        }
        self.check(x, "deferred join output")?;
        let sums = slot_addr(norm.sums, norm.slot)?;
        ew::norm_finish(&self.gpu, self.dtype, ptr(x), sums, n, cols, norm.eps)
    }
}
