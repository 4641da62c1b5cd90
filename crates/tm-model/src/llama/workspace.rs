//! Reusable activation buffers for a forward step, sized for the largest step seen so far, so
//! steady-state decoding allocates nothing.

use super::shard::ShardLayout;
use crate::config::ModelConfig;
use crate::error::Result;
use tm_core::{DType, Ops, Tensor, TensorDesc};

/// Activation buffers of the Llama graph (of one tensor-parallel rank: q/k/v and MLP buffers are
/// this rank's width).
#[derive(Debug)]
pub struct Workspace {
    layout: ShardLayout,
    capacity: usize,
    logit_capacity: usize,
    pub(super) residual: Tensor,
    pub(super) normed: Tensor,
    pub(super) q: Tensor,
    pub(super) k: Tensor,
    pub(super) v: Tensor,
    pub(super) scratch_q: Tensor,
    pub(super) scratch_k: Tensor,
    pub(super) attn: Tensor,
    pub(super) delta: Tensor,
    pub(super) gate: Tensor,
    pub(super) up: Tensor,
    pub(super) act: Tensor,
    pub(super) last: Tensor,
    pub(super) logits: Tensor,
    /// This rank's slice of the logits `[rows, vocab / world]` (vocab-parallel LM head only).
    pub(super) logits_local: Option<Tensor>,
    /// Every rank's slice, stacked: `[world × rows, vocab / world]` (vocab-parallel LM head only).
    pub(super) gathered: Option<Tensor>,
    /// The row order that puts `gathered` back into `[rows, vocab]`.
    pub(super) perm: Vec<u32>,
    /// The sums of the deferred residual joins (`tm_core::ops::DeferredNorm`): f32 `[2 × layers,
    /// 2 × DEFERRED_NORM_ROWS]`, one slot per join of a step; made by the model's first step
    /// ([`Workspace::ensure_norm_sums`]) when it defers joins.
    pub(super) norm_sums: Option<Tensor>,
    /// Whether the model has int4 weights: the backend's matmul scratch is reserved for the
    /// workspace's step size, and again when it grows ([`Ops::reserve_matmul_scratch`]).
    int4_scratch: bool,
}

impl Workspace {
    /// Buffers for steps of up to `tokens` tokens and `logit_rows` logit rows of the whole model.
    pub fn new(ops: &dyn Ops, cfg: &ModelConfig, tokens: usize, logit_rows: usize) -> Result<Workspace> {
        Self::for_shard(ops, &ShardLayout::single(cfg), tokens, logit_rows)
    }

    /// Buffers of the rank `layout` describes, for steps of up to `tokens` tokens and
    /// `logit_rows` logit rows. A model with int4 weights also asks for the backend's matmul
    /// scratch ([`Workspace::with_int4_scratch`]).
    pub fn for_shard(ops: &dyn Ops, layout: &ShardLayout, tokens: usize, logit_rows: usize) -> Result<Workspace> {
        let tokens = tokens.max(1);
        let logit_rows = logit_rows.max(1);
        let dt = ops.activation_dtype();
        let t = |w: usize| ops.zeros(TensorDesc::new(dt, &[tokens, w]), "workspace");
        let l = layout;
        let (hidden, q, kv, inter) = (l.hidden, l.q_dim(), l.kv_dim(), l.intermediate_size());
        let (logits_local, gathered) = if l.gathers_logits() {
            let slice = l.vocab_rows();
            (
                Some(ops.zeros(TensorDesc::new(dt, &[logit_rows, slice]), "workspace")?),
                Some(ops.zeros(TensorDesc::new(dt, &[l.spec.world * logit_rows, slice]), "workspace")?),
            )
        } else {
            (None, None)
        };
        Ok(Workspace {
            layout: layout.clone(),
            capacity: tokens,
            logit_capacity: logit_rows,
            residual: t(hidden)?,
            normed: t(hidden)?,
            q: t(q)?,
            k: t(kv)?,
            v: t(kv)?,
            scratch_q: t(q)?,
            scratch_k: t(kv)?,
            attn: t(q)?,
            delta: t(hidden)?,
            gate: t(inter)?,
            up: t(inter)?,
            act: t(inter)?,
            last: ops.zeros(TensorDesc::new(dt, &[logit_rows, hidden]), "workspace")?,
            logits: ops.zeros(TensorDesc::new(dt, &[logit_rows, l.vocab_size]), "workspace")?,
            logits_local,
            gathered,
            perm: Vec::with_capacity(l.spec.world * logit_rows),
            norm_sums: None,
            int4_scratch: false,
        })
    }

    /// The shard these buffers are shaped for.
    pub fn layout(&self) -> &ShardLayout {
        &self.layout
    }

    /// For a model with int4 weights (`int4`): reserves the backend's matmul scratch for steps of
    /// the workspace's size (the CUDA int4 slab buffer; [`Ops::reserve_matmul_scratch`]) now and
    /// whenever the workspace grows. Dense models reserve nothing.
    pub fn with_int4_scratch(mut self, ops: &dyn Ops, int4: bool) -> Result<Workspace> {
        self.int4_scratch = int4;
        if int4 {
            ops.reserve_matmul_scratch(self.capacity)?;
        }
        Ok(self)
    }

    /// Makes the deferred joins' sums for `joins` joins per step, once (a few KiB; zeroed by each
    /// step that uses them).
    pub(super) fn ensure_norm_sums(&mut self, ops: &dyn Ops, joins: usize) -> Result<()> {
        if self.norm_sums.as_ref().is_none_or(|t| t.shape()[0] < joins) {
            let desc = TensorDesc::new(DType::F32, &[joins, 2 * tm_core::ops::DEFERRED_NORM_ROWS]);
            self.norm_sums = Some(ops.zeros(desc, "workspace")?);
        }
        Ok(())
    }

    /// Shapes every buffer for a step of `tokens` tokens and `logit_rows` logit rows, growing
    /// (reallocating) only when the step is larger than any before.
    pub fn prepare(&mut self, ops: &dyn Ops, tokens: usize, logit_rows: usize) -> Result<()> {
        if tokens > self.capacity || logit_rows > self.logit_capacity {
            let layout = self.layout.clone();
            let int4 = self.int4_scratch;
            *self = Workspace::for_shard(ops, &layout, tokens.max(self.capacity), logit_rows.max(self.logit_capacity))?
                .with_int4_scratch(ops, int4)?;
        }
        let l = &self.layout;
        let (n, hidden, q, kv, inter) = (tokens, l.hidden, l.q_dim(), l.kv_dim(), l.intermediate_size());
        self.residual.reshape(&[n, hidden])?;
        self.normed.reshape(&[n, hidden])?;
        self.q.reshape(&[n, q])?;
        self.k.reshape(&[n, kv])?;
        self.v.reshape(&[n, kv])?;
        self.scratch_q.reshape(&[n, q])?;
        self.scratch_k.reshape(&[n, kv])?;
        self.attn.reshape(&[n, q])?;
        self.delta.reshape(&[n, hidden])?;
        self.gate.reshape(&[n, inter])?;
        self.up.reshape(&[n, inter])?;
        self.act.reshape(&[n, inter])?;
        self.last.reshape(&[logit_rows, hidden])?;
        self.logits.reshape(&[logit_rows, l.vocab_size])?;
        let slice = l.vocab_rows();
        if let Some(t) = self.logits_local.as_mut() {
            t.reshape(&[logit_rows, slice])?;
        }
        if let Some(t) = self.gathered.as_mut() {
            t.reshape(&[l.spec.world * logit_rows, slice])?;
        }
        Ok(())
    }
}
