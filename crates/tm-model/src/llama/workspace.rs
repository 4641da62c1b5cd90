//! Reusable activation buffers for a forward step, sized for the largest step seen so far, so
//! steady-state decoding allocates nothing.

use crate::config::ModelConfig;
use crate::error::Result;
use tm_core::{Ops, Tensor, TensorDesc};

/// Activation buffers of the Llama graph.
#[derive(Debug)]
pub struct Workspace {
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
}

impl Workspace {
    /// Buffers for steps of up to `tokens` tokens and `logit_rows` logit rows.
    pub fn new(ops: &dyn Ops, cfg: &ModelConfig, tokens: usize, logit_rows: usize) -> Result<Workspace> {
        let tokens = tokens.max(1);
        let logit_rows = logit_rows.max(1);
        let dt = ops.activation_dtype();
        let t = |w: usize| ops.zeros(TensorDesc::new(dt, &[tokens, w]), "workspace");
        Ok(Workspace {
            capacity: tokens,
            logit_capacity: logit_rows,
            residual: t(cfg.hidden_size)?,
            normed: t(cfg.hidden_size)?,
            q: t(cfg.q_dim())?,
            k: t(cfg.kv_dim())?,
            v: t(cfg.kv_dim())?,
            scratch_q: t(cfg.q_dim())?,
            scratch_k: t(cfg.kv_dim())?,
            attn: t(cfg.q_dim())?,
            delta: t(cfg.hidden_size)?,
            gate: t(cfg.intermediate_size)?,
            up: t(cfg.intermediate_size)?,
            act: t(cfg.intermediate_size)?,
            last: ops.zeros(TensorDesc::new(dt, &[logit_rows, cfg.hidden_size]), "workspace")?,
            logits: ops.zeros(TensorDesc::new(dt, &[logit_rows, cfg.vocab_size]), "workspace")?,
        })
    }

    /// Shapes every buffer for a step of `tokens` tokens and `logit_rows` logit rows, growing
    /// (reallocating) only when the step is larger than any before.
    pub fn prepare(&mut self, ops: &dyn Ops, cfg: &ModelConfig, tokens: usize, logit_rows: usize) -> Result<()> {
        if tokens > self.capacity || logit_rows > self.logit_capacity {
            *self = Workspace::new(ops, cfg, tokens.max(self.capacity), logit_rows.max(self.logit_capacity))?;
        }
        let n = tokens;
        self.residual.reshape(&[n, cfg.hidden_size])?;
        self.normed.reshape(&[n, cfg.hidden_size])?;
        self.q.reshape(&[n, cfg.q_dim()])?;
        self.k.reshape(&[n, cfg.kv_dim()])?;
        self.v.reshape(&[n, cfg.kv_dim()])?;
        self.scratch_q.reshape(&[n, cfg.q_dim()])?;
        self.scratch_k.reshape(&[n, cfg.kv_dim()])?;
        self.attn.reshape(&[n, cfg.q_dim()])?;
        self.delta.reshape(&[n, cfg.hidden_size])?;
        self.gate.reshape(&[n, cfg.intermediate_size])?;
        self.up.reshape(&[n, cfg.intermediate_size])?;
        self.act.reshape(&[n, cfg.intermediate_size])?;
        self.last.reshape(&[logit_rows, cfg.hidden_size])?;
        self.logits.reshape(&[logit_rows, cfg.vocab_size])?;
        Ok(())
    }
}
