//! Large-batch int4 products by dequantized slabs ([`tm_core::q4_slab`]): for `n` tokens at or
//! above the policy's threshold, each slab of weight rows `[r0, r0 + R)` is dequantized into the
//! backend's fixed slab buffer and multiplied by cuBLASLt straight into `out[:, r0..r0 + R]`
//! ([`crate::kernels::q4_slab`]); slabs run one after the other on the stream, so one buffer
//! serves them all, and a product queues all its slabs under the backend's state lock, so threads
//! sharing the backend cannot interleave theirs in it. The buffer is reserved once with the
//! workspace ([`CudaBackend::reserve_slab`]); without it the fused int4 kernels run instead, so
//! nothing is ever allocated here.
//!
//! Everything is ordinary stream work on fixed addresses, so it records and captures into CUDA
//! graphs like the rest of a step, and under tensor parallelism each rank slabs its own shard.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;

use tm_core::q4_slab::{SlabPolicy, SLAB_BYTES};
use tm_core::quant::QuantWeight;
use tm_core::{Buffer, DType, Error, Result, Tensor};

use super::{ptr, CudaBackend};
use crate::kernels::q4_gemm;
use crate::kernels::q4_slab::{self, Int4Matrix};

/// Test and benchmark override of the policy and the slab budget (`None`: the environment's
/// policy and [`SLAB_BYTES`]).
static OVERRIDE: RwLock<Option<(SlabPolicy, usize)>> = RwLock::new(None);

/// Int4 products that took the slab path in this process (all backends).
static PRODUCTS: AtomicU64 = AtomicU64::new(0);

/// How many int4 products have taken the slab path in this process, on any backend: tests and
/// benchmarks read it to confirm which path ran.
pub fn slab_products() -> u64 {
    PRODUCTS.load(Ordering::Relaxed)
}

/// A forced slab policy for tests and benchmarks: `policy`, and slabs of at most `budget_bytes`
/// (clamped to the reserved buffer; a smaller budget makes more, shorter slabs so tests can
/// exercise several on small matrices). `None` returns to the environment's policy.
pub fn set_slab_policy(over: Option<(SlabPolicy, usize)>) {
    *OVERRIDE.write().unwrap_or_else(|p| p.into_inner()) = over;
}

/// The forced policy and budget, if any.
fn forced() -> Option<(SlabPolicy, usize)> {
    *OVERRIDE.read().unwrap_or_else(|p| p.into_inner())
}

/// The policy and slab budget in force.
fn slab_policy() -> (SlabPolicy, usize) {
    forced().unwrap_or((SlabPolicy::from_env(), SLAB_BYTES))
}

/// Whether [`set_slab_policy`] has forced a policy.
fn overridden() -> bool {
    forced().is_some()
}

impl CudaBackend {
    /// Reserves the slab buffer ([`SLAB_BYTES`], phase "workspace") when steps of
    /// `max_tokens` tokens can take the slab path: f16/bf16 activations and the policy on with a
    /// threshold at most `max_tokens`. Once reserved it stays.
    pub(super) fn reserve_slab(&self, max_tokens: usize) -> Result<()> {
        let (policy, _) = slab_policy();
        if !matches!(self.dtype, DType::F16 | DType::BF16) || !policy.wants_scratch(max_tokens) {
            return Ok(());
        }
        if self.slab.get().is_some() {
            return Ok(());
        }
        // Recording a step may grow the workspace (the step then runs eagerly); a capture must not.
        if self.gpu.mode() == crate::runtime::LaunchMode::Capture {
            return Err(Error::Backend {
                backend: "cuda".into(),
                message: "the int4 slab buffer would be reserved while a CUDA graph is being captured".into(),
            });
        }
        let buf = Buffer::new(&self.allocator, SLAB_BYTES, "workspace")?;
        // Another thread may have won the race; its buffer is kept and this one freed.
        let _ = self.slab.set(buf);
        Ok(())
    }

    /// `out = x · Wᵀ` by slabs when the policy takes `n` tokens, the buffer is reserved and the
    /// weight fits the kernels; `Ok(false)` sends the caller to the fused kernels. A fused
    /// kernel forced with `TM_Q4_GEMM` (a tile, or `off`) keeps every product on it unless
    /// [`set_slab_policy`] forces the slab path. Shapes were checked by the caller.
    pub(super) fn try_q4_slab(&self, x: &Tensor, q: &QuantWeight, n: usize, out: &mut Tensor) -> Result<bool> {
        let (policy, budget) = slab_policy();
        if !policy.takes(n) || !matches!(self.dtype, DType::F16 | DType::BF16) {
            return Ok(false);
        }
        if !overridden() && q4_gemm::policy() != q4_gemm::Policy::Auto {
            return Ok(false);
        }
        let Some(slab) = self.slab.get() else { return Ok(false) };
        let Some(mins) = q.mins.as_ref() else { return Ok(false) };
        let w = Int4Matrix {
            packed: ptr(&q.packed),
            scales: ptr(&q.scales),
            mins: ptr(mins),
            rows: q.rows,
            cols: q.cols,
            group: q.group_size,
            layout: q.layout,
        };
        let budget = budget.min(slab.len());
        if q4_slab::rows_per_slab(self.dtype, &w, budget).is_none() || !w.cols.is_multiple_of(32) {
            return Ok(false);
        }
        // One product's slabs at a time: two threads sharing this backend would otherwise queue
        // their dequantizations and products into the one buffer interleaved on the stream.
        let _serial = self.state()?;
        q4_slab::matmul_q4_slabs(&self.gpu, &self.blas, self.dtype, ptr(out), ptr(x), &w, n, slab.addr(), budget)?;
        PRODUCTS.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn override_round_trips() {
        let p = SlabPolicy { enabled: true, min_tokens: 300 };
        set_slab_policy(Some((p, 1 << 20)));
        assert_eq!(slab_policy(), (p, 1 << 20));
        let off = SlabPolicy { enabled: false, min_tokens: 1 };
        set_slab_policy(Some((off, SLAB_BYTES)));
        assert_eq!(slab_policy(), (off, SLAB_BYTES));
        set_slab_policy(None);
        assert_eq!(slab_policy(), (SlabPolicy::from_env(), SLAB_BYTES));
    }
}
