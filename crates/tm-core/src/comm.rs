//! Collective communication between tensor-parallel ranks.
//!
//! Every call takes a deadline: a collective that cannot complete in time returns
//! [`Error::Timeout`] naming the rank and the step instead of waiting forever.
//!
//! - [`SingleRank`]: the communicator of a world of one (every collective is the identity).
//! - [`LocalComm`]: ranks that are threads of one process exchanging host memory (the CPU
//!   backend's tensor parallelism, and the test bed for the sharded model).
//!
//! GPU ranks use NCCL (`tm_cuda::nccl::NcclComm`), whose collectives are queued on the device:
//! there the deadline is kept by a watchdog thread and [`Comm::synchronize`] is where a rank
//! waits for its queued collectives.

mod local;

pub use local::LocalComm;

use crate::{Error, Ops, Result, Tensor};
use std::fmt::Debug;
use std::time::Duration;

/// A communicator among `world_size` ranks.
pub trait Comm: Send + Sync + Debug {
    /// This rank's index.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// Sums `tensor` element-wise over all ranks, in place. `step` names the caller's step for
    /// error messages.
    fn all_reduce_sum(&self, tensor: &mut Tensor, step: &str, deadline: Duration) -> Result<()>;
    /// An all-reduce followed by the residual add and RMSNorm that consume it (a row-parallel
    /// projection's output joining the residual stream): sums `x` over all ranks in place as
    /// [`Comm::all_reduce_sum`] does, then `residual += x` and `out = rms_norm(residual) * weight`
    /// as [`Ops::add_rms_norm`] does on this rank's backend `ops`. The default does exactly those
    /// two calls; a communicator that can do both in one device pass (tm-cuda's one-shot peer
    /// kernels) overrides it with a result identical to theirs.
    #[allow(clippy::too_many_arguments)]
    fn all_reduce_add_rms_norm(
        &self,
        ops: &dyn Ops,
        x: &mut Tensor,
        residual: &mut Tensor,
        weight: &Tensor,
        eps: f32,
        out: &mut Tensor,
        step: &str,
        deadline: Duration,
    ) -> Result<()> {
        self.all_reduce_sum(x, step, deadline)?;
        ops.add_rms_norm(x, residual, weight, eps, out)
    }
    /// Concatenates every rank's `input` along the outermost dimension into `output`.
    fn all_gather(&self, input: &Tensor, output: &mut Tensor, step: &str, deadline: Duration) -> Result<()>;
    /// Copies `tensor` from rank `root` to all ranks.
    fn broadcast(&self, tensor: &mut Tensor, root: usize, step: &str, deadline: Duration) -> Result<()>;
    /// Waits until every rank reaches this point.
    fn barrier(&self, step: &str, deadline: Duration) -> Result<()>;
    /// Waits (at most `deadline`) until this rank's collectives so far have completed, and
    /// reports the communicator's failure if it was aborted meanwhile. Communicators whose
    /// collectives complete before they return (this crate's) only report the failure; those that
    /// queue collectives on a device (NCCL) wait for the device here. A rank calls this at the end
    /// of every step, so a failure that happened on the device surfaces in that step.
    fn synchronize(&self, step: &str, deadline: Duration) -> Result<()> {
        let _ = (step, deadline);
        Ok(())
    }
    /// Aborts the communicator: collectives in flight on any rank, and every later one, fail at
    /// once instead of waiting. A rank that fails (or gives up waiting) calls this so the others
    /// do not wait out their deadlines for it. `reason` is put in the other ranks' errors. The
    /// default does nothing (a world of one has nobody to tell).
    fn abort(&self, reason: &str) {
        let _ = reason;
    }
}

/// The communicator of a single rank: every collective is the identity.
#[derive(Debug, Default, Clone, Copy)]
pub struct SingleRank;

impl Comm for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, _tensor: &mut Tensor, _step: &str, _deadline: Duration) -> Result<()> {
        Ok(())
    }
    fn all_gather(&self, input: &Tensor, output: &mut Tensor, step: &str, _deadline: Duration) -> Result<()> {
        if input.desc() != output.desc() {
            return Err(Error::shape(format!("all_gather in {step}"), input.desc(), output.desc()));
        }
        let src = input
            .buffer()
            .host_bytes()
            .ok_or_else(|| Error::Unsupported("single-rank all_gather of device memory".into()))?;
        let n = input.desc().bytes();
        let src = src[..n].to_vec();
        let dst = output
            .buffer_mut()
            .host_bytes_mut()
            .ok_or_else(|| Error::Unsupported("single-rank all_gather of device memory".into()))?;
        dst[..n].copy_from_slice(&src);
        Ok(())
    }
    fn broadcast(&self, _tensor: &mut Tensor, root: usize, step: &str, _deadline: Duration) -> Result<()> {
        if root != 0 {
            return Err(Error::invalid(format!("broadcast in {step}: root {root} but the world has one rank")));
        }
        Ok(())
    }
    fn barrier(&self, _step: &str, _deadline: Duration) -> Result<()> {
        Ok(())
    }
}
