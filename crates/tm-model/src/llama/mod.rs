//! The Llama-family decoder graph, written once against [`tm_core::Ops`] so it runs on every
//! backend. Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm) and InternLM2 (mapped at load)
//! all use it.
//!
//! One [`LlamaModel::forward`] call runs a flat batch of tokens from any number of sequences
//! (prefill chunks and decode tokens mixed) described by a [`StepInput`].
//!
//! # Tensor parallelism
//! [`LlamaModel::load_shard`] loads one rank's part of the model ([`shard`] says which part) and
//! [`LlamaModel::forward_tp`] runs that rank's share of a step, exchanging activations through a
//! [`Comm`]: an all-reduce after the embedding, after each o_proj and after each down_proj, and
//! an all-gather of the logits. Every rank runs the same steps in lockstep, each with its own
//! `Ops`, KV cache (its KV heads) and workspace; `crate::tp::TpGroup` runs the ranks as threads.

mod load;
pub mod quant_load;
pub mod shard;
mod workspace;

pub use load::{internlm2_name, tensor_to_weight};
pub use shard::{ShardLayout, ShardSpec};
pub use workspace::Workspace;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::kv_cache::KvCache;
use crate::weights::TensorSource;
use shard::Cut;
use std::time::Duration;
use tm_core::ops::{AttentionMeta, DeferredNorm, SeqAttention, DEFERRED_NORM_ROWS};
use tm_core::quant::Weight;
use tm_core::rope::RopeFreqs;
use tm_core::{Comm, Ops, SingleRank, Tensor};

/// Weights of one decoder layer.
#[derive(Debug)]
pub struct LayerWeights {
    /// RMSNorm before attention.
    pub attn_norm: Tensor,
    /// Query projection `[heads*head_dim, hidden]`.
    pub q: Weight,
    /// Key projection.
    pub k: Weight,
    /// Value projection.
    pub v: Weight,
    /// Optional q, k, v biases.
    pub qkv_bias: (Option<Tensor>, Option<Tensor>, Option<Tensor>),
    /// Optional per-head q and k RMSNorm weights (Qwen3).
    pub qk_norm: Option<(Tensor, Tensor)>,
    /// Output projection.
    pub o: Weight,
    /// RMSNorm before the MLP.
    pub mlp_norm: Tensor,
    /// MLP gate projection.
    pub gate: Weight,
    /// MLP up projection.
    pub up: Weight,
    /// MLP down projection.
    pub down: Weight,
}

/// One forward step's inputs: a flat batch of tokens.
#[derive(Debug)]
pub struct StepInput<'a> {
    /// Token ids, all sequences concatenated.
    pub tokens: &'a [u32],
    /// Position of each token in its sequence.
    pub positions: &'a [u32],
    /// KV slot each token's key and value are written to.
    pub slot_mapping: &'a [u32],
    /// The sequences, in batch order.
    pub seqs: &'a [SeqAttention<'a>],
    /// Indices of the tokens whose logits are wanted (usually each sequence's last).
    pub logit_rows: &'a [u32],
}

/// A loaded Llama-family model (or one tensor-parallel rank's part of it).
#[derive(Debug)]
pub struct LlamaModel {
    /// Hyper-parameters (of the whole model, also on a rank).
    pub config: ModelConfig,
    layout: ShardLayout,
    embed: Weight,
    layers: Vec<LayerWeights>,
    final_norm: Tensor,
    lm_head: Option<Weight>,
    /// Names of the collectives of each layer (after o_proj, after down_proj), for errors.
    step_names: Vec<[String; 2]>,
}

/// What one step's layers need besides the weights.
struct StepCtx<'a> {
    ops: &'a dyn Ops,
    comm: &'a dyn Comm,
    timeout: Duration,
    step: &'a StepInput<'a>,
    freqs: &'a RopeFreqs,
    meta: &'a AttentionMeta<'a>,
}

impl LlamaModel {
    /// Whether any weight is stored as int4 (the backend then reserves its large-batch int4
    /// scratch, [`Ops::reserve_matmul_scratch`]).
    pub fn has_int4(&self) -> bool {
        let int4 = |w: &Weight| matches!(w, Weight::Int4(_));
        int4(&self.embed)
            || self.lm_head.as_ref().is_some_and(int4)
            || self.layers.iter().any(|l| [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down].into_iter().any(int4))
    }
    /// Loads every weight from `src` onto the backend. `on_tensor` is called with the stored
    /// bytes of each tensor as it is loaded.
    pub fn load(
        ops: &dyn Ops,
        src: &dyn TensorSource,
        config: ModelConfig,
        on_tensor: &mut dyn FnMut(u64),
    ) -> Result<Self> {
        Self::load_shard(ops, src, config, ShardSpec::SINGLE, on_tensor)
    }

    /// Loads rank `shard.rank`'s part of the model (of `shard.world` ranks) onto the backend,
    /// reading only that part of each tensor from `src`. Fails, saying why, when the model cannot
    /// be split that way (see [`shard`]).
    pub fn load_shard(
        ops: &dyn Ops,
        src: &dyn TensorSource,
        config: ModelConfig,
        shard: ShardSpec,
        on_tensor: &mut dyn FnMut(u64),
    ) -> Result<Self> {
        let c = config.clone();
        let layout = ShardLayout::new(&c, shard)?;
        let mut l = load::Loader { ops, src, cfg: &c, layout: &layout, on_tensor };
        let (vocab, h) = (c.vocab_size, c.hidden_size);
        let vocab_cut = Cut::rows(layout.vocab.clone(), vocab);
        let embed = l.matrix("model.embed_tokens.weight", vocab, h, vocab_cut.clone())?;
        let layers = (0..c.num_layers).map(|i| l.layer(i)).collect::<Result<Vec<_>>>()?;
        let final_norm = l.vector("model.norm.weight", h)?;
        let lm_head = if c.tie_word_embeddings && !l.has("lm_head.weight") {
            None
        } else {
            Some(l.matrix("lm_head.weight", vocab, h, vocab_cut)?)
        };
        let step_names =
            (0..c.num_layers).map(|i| [format!("layer {i} o_proj"), format!("layer {i} down_proj")]).collect();
        Ok(LlamaModel { config, layout, embed, layers, final_norm, lm_head, step_names })
    }

    /// The part of the model this instance holds.
    pub fn layout(&self) -> &ShardLayout {
        &self.layout
    }

    /// Bytes of weights held on the device.
    pub fn weight_bytes(&self) -> u64 {
        let norms = |l: &LayerWeights| {
            let mut b = l.attn_norm.desc().bytes() + l.mlp_norm.desc().bytes();
            for t in [&l.qkv_bias.0, &l.qkv_bias.1, &l.qkv_bias.2].into_iter().flatten() {
                b += t.desc().bytes();
            }
            if let Some((q, k)) = &l.qk_norm {
                b += q.desc().bytes() + k.desc().bytes();
            }
            b
        };
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down].iter().map(|w| w.bytes()).sum::<usize>() + norms(l)
            })
            .sum();
        (self.embed.bytes() + layers + self.final_norm.desc().bytes() + self.lm_head.as_ref().map_or(0, Weight::bytes))
            as u64
    }

    /// Runs one step and returns the logits `[logit_rows.len(), vocab]` (a view into `ws`).
    /// The model must be whole (not a tensor-parallel shard; see [`LlamaModel::forward_tp`]).
    pub fn forward<'w>(
        &self,
        ops: &dyn Ops,
        kv: &mut KvCache,
        step: &StepInput<'_>,
        ws: &'w mut Workspace,
    ) -> Result<&'w Tensor> {
        self.forward_tp(ops, &SingleRank, Duration::MAX, kv, step, ws)
    }

    /// Runs this rank's share of one step; every rank of `comm` must call it with the same
    /// `step`. Each collective waits at most `timeout` for the other ranks (then fails with
    /// [`tm_core::Error::Timeout`] naming the rank and the collective). Returns the full logits
    /// `[logit_rows.len(), vocab]` (a view into `ws`) on every rank.
    pub fn forward_tp<'w>(
        &self,
        ops: &dyn Ops,
        comm: &dyn Comm,
        timeout: Duration,
        kv: &mut KvCache,
        step: &StepInput<'_>,
        ws: &'w mut Workspace,
    ) -> Result<&'w Tensor> {
        let c = &self.config;
        let spec = self.layout.spec;
        if comm.rank() != spec.rank || comm.world_size() != spec.world {
            return Err(ModelError::InvalidInput(format!(
                "the model holds rank {} of {} but the communicator is rank {} of {}",
                spec.rank,
                spec.world,
                comm.rank(),
                comm.world_size()
            )));
        }
        let n = step.tokens.len();
        if n == 0 || step.positions.len() != n || step.slot_mapping.len() != n {
            return Err(ModelError::InvalidInput(format!(
                "step with {n} tokens, {} positions and {} slots",
                step.positions.len(),
                step.slot_mapping.len()
            )));
        }
        if ws.layout() != &self.layout {
            return Err(ModelError::InvalidInput("the workspace was made for another shard layout".into()));
        }
        ws.prepare(ops, n, step.logit_rows.len())?;
        if self.defers_joins(ops, n) {
            ws.ensure_norm_sums(ops, 2 * self.layers.len())?;
        }
        let max_pos = step.positions.iter().copied().max().unwrap_or(0) as usize;
        let freqs = c.rope.freqs(max_pos);
        let meta = AttentionMeta {
            seqs: step.seqs,
            block_size: kv.block_size,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
            sliding_window: c.sliding_window,
        };
        let cx = StepCtx { ops, comm, timeout, step, freqs: &freqs, meta: &meta };
        ops.run_step(&mut || self.run_layers(&cx, kv, ws))?;
        Ok(&ws.logits)
    }

    /// Whether a step of `n` tokens asks the backend to defer its residual joins
    /// ([`Ops::matmul_add_rms_norm_deferred`]): int4 models, not sharded, decode-sized steps, on a
    /// backend that defers ([`Ops::defers_norm_joins`]). The backend still decides each join (the
    /// CUDA backend takes int4 decode products).
    fn defers_joins(&self, ops: &dyn Ops, n: usize) -> bool {
        self.has_int4() && !self.layout.is_sharded() && n <= DEFERRED_NORM_ROWS && ops.defers_norm_joins()
    }

    /// The layers, final norm and LM head of one step (run inside the backend's step context).
    ///
    /// With deferred joins (see [`LlamaModel::defers_joins`]) each o and down product may end with
    /// its residual join, leaving the RMSNorm's row scale to the next products: o's join is slot
    /// 2i of the step's sums, down's (into layer i + 1) slot 2i + 1; `pending` is the slot of a
    /// deferred join whose output is `ws.normed`. The last layer's down and the joins into layers
    /// with q/k norms are never deferred (their readers are not the folding ops).
    fn run_layers(&self, cx: &StepCtx<'_>, kv: &mut KvCache, ws: &mut Workspace) -> Result<(), tm_core::Error> {
        let (ops, step, freqs, meta) = (cx.ops, cx.step, cx.freqs, cx.meta);
        let sharded = self.layout.is_sharded();
        let eps = self.config.rms_norm_eps;
        let defer = self.defers_joins(ops, step.tokens.len()) && ws.norm_sums.is_some();
        if let (true, Some(sums)) = (defer, ws.norm_sums.as_mut()) {
            ops.fill_zero(sums)?;
        }
        let mut pending: Option<usize> = None;
        if sharded && self.layout.vocab_parallel {
            ops.embedding_slice(&self.embed, step.tokens, self.layout.vocab.start as u32, &mut ws.residual)?;
            cx.comm.all_reduce_sum(&mut ws.residual, "embedding", cx.timeout)?;
        } else {
            ops.embedding(&self.embed, step.tokens, &mut ws.residual)?;
        }
        for (i, layer) in self.layers.iter().enumerate() {
            if i == 0 {
                ops.rms_norm(&ws.residual, &layer.attn_norm, eps, &mut ws.normed)?;
            } else if pending.is_none() {
                // The previous layer's down_proj output joins the residual stream.
                self.join_residual(cx, ws, &layer.attn_norm, &self.step_names[i - 1][1])?;
            }
            let (bq, bk, bv) = &layer.qkv_bias;
            let weights = [&layer.q, &layer.k, &layer.v];
            let biases = [bq.as_ref(), bk.as_ref(), bv.as_ref()];
            let (k_cache, v_cache) = kv.layer_mut(i);
            if let Some((qn, kn)) = &layer.qk_norm {
                ops.matmul_many(&ws.normed, &weights, &biases, &mut [&mut ws.q, &mut ws.k, &mut ws.v])?;
                ops.rms_norm(&ws.q, qn, eps, &mut ws.scratch_q)?;
                ops.rms_norm(&ws.k, kn, eps, &mut ws.scratch_k)?;
                std::mem::swap(&mut ws.q, &mut ws.scratch_q);
                std::mem::swap(&mut ws.k, &mut ws.scratch_k);
                // RoPE on q and k and the rotated k and v into the cache (one launch on CUDA).
                let (q, k) = (&mut ws.q, &mut ws.k);
                ops.rope_write_kv(q, k, &ws.v, k_cache, v_cache, step.positions, freqs, step.slot_mapping)?;
            } else {
                // The products, RoPE and the cache write (one launch for int4 decode on CUDA).
                let Workspace { normed, q, k, v, norm_sums, .. } = &mut *ws;
                let (pos, slots) = (step.positions, step.slot_mapping);
                match (pending.take(), norm_sums.as_ref()) {
                    (Some(slot), Some(sums)) => {
                        let d = DeferredNorm { sums, slot, eps };
                        let qkv = [q, k, v];
                        ops.qkv_rope_write_kv_deferred(
                            normed, &d, weights, biases, qkv, k_cache, v_cache, pos, freqs, slots,
                        )?
                    }
                    _ => {
                        ops.qkv_rope_write_kv(normed, weights, biases, [q, k, v], k_cache, v_cache, pos, freqs, slots)?
                    }
                }
            }
            ops.attention(&ws.q, k_cache, v_cache, meta, &mut ws.attn)?;
            if i == 0 {
                // Every per-step input is uploaded by now (the later layers upload the same).
                ops.step_inputs_ready(step.logit_rows)?;
            }
            // o_proj and the join into the MLP (slot 2i when deferred), then gate/up.
            let Workspace { attn, residual, normed, norm_sums, gate, up, act, .. } = &mut *ws;
            let o_slot = 2 * i;
            let deferred = match norm_sums.as_mut().filter(|_| defer) {
                Some(sums) => ops.matmul_add_rms_norm_deferred(
                    attn,
                    &layer.o,
                    residual,
                    &layer.mlp_norm,
                    eps,
                    normed,
                    sums,
                    o_slot,
                )?,
                None => false,
            };
            match norm_sums.as_ref().filter(|_| deferred) {
                Some(sums) => {
                    let d = DeferredNorm { sums, slot: o_slot, eps };
                    ops.gate_up_silu_deferred(normed, &d, &layer.gate, &layer.up, gate, up, act)?;
                }
                None => {
                    ops.matmul(&ws.attn, &layer.o, None, &mut ws.delta)?;
                    self.join_residual(cx, ws, &layer.mlp_norm, &self.step_names[i][0])?;
                    ops.gate_up_silu(&ws.normed, &layer.gate, &layer.up, &mut ws.gate, &mut ws.up, &mut ws.act)?;
                }
            }
            // down_proj, and the join into the next layer (slot 2i + 1) when deferred.
            let next = self.layers.get(i + 1).filter(|l| defer && l.qk_norm.is_none());
            let Workspace { act, residual, normed, norm_sums, .. } = &mut *ws;
            let down_slot = o_slot + 1;
            let deferred = match (next, norm_sums.as_mut()) {
                (Some(l), Some(sums)) => ops.matmul_add_rms_norm_deferred(
                    act,
                    &layer.down,
                    residual,
                    &l.attn_norm,
                    eps,
                    normed,
                    sums,
                    down_slot,
                )?,
                _ => false,
            };
            pending = deferred.then_some(down_slot);
            if !deferred {
                ops.matmul(&ws.act, &layer.down, None, &mut ws.delta)?;
            }
        }
        match self.step_names.last() {
            Some(names) => self.join_residual(cx, ws, &self.final_norm, &names[1])?,
            None => ops.rms_norm(&ws.residual, &self.final_norm, eps, &mut ws.normed)?,
        }
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        if !self.layout.gathers_logits() {
            let Workspace { normed, last, logits, .. } = ws;
            return ops.matmul(head_input(ops, step.logit_rows, normed, last)?, head, None, logits);
        }
        self.gather_logits(cx, head, ws)
    }

    /// A row-parallel projection's output (`ws.delta`, this rank's partial sum when sharded)
    /// joins the residual stream: `residual += delta` (summed over the ranks first when sharded),
    /// then `normed = rms_norm(residual) * norm`. Sharded, it is one [`Comm::all_reduce_add_rms_norm`]
    /// (a single fused kernel on GPUs with the one-shot peer path); `step` names the collective.
    fn join_residual(
        &self,
        cx: &StepCtx<'_>,
        ws: &mut Workspace,
        norm: &Tensor,
        step: &str,
    ) -> Result<(), tm_core::Error> {
        let eps = self.config.rms_norm_eps;
        if self.layout.is_sharded() {
            let Workspace { delta, residual, normed, .. } = ws;
            cx.comm.all_reduce_add_rms_norm(cx.ops, delta, residual, norm, eps, normed, step, cx.timeout)
        } else {
            cx.ops.add_rms_norm(&ws.delta, &mut ws.residual, norm, eps, &mut ws.normed)
        }
    }

    /// The vocab-parallel LM head: this rank's slice of the logits, then an all-gather. The
    /// gather stacks the ranks' `[rows, slice]` blocks; with more than one row they are put back
    /// in `[rows, vocab]` order by one `gather_rows` (row `r` of rank `w` is the `w`-th slice of
    /// logits row `r`).
    fn gather_logits(&self, cx: &StepCtx<'_>, head: &Weight, ws: &mut Workspace) -> Result<(), tm_core::Error> {
        let (ops, world) = (cx.ops, self.layout.spec.world);
        let rows = cx.step.logit_rows.len();
        let slice = self.layout.vocab_rows();
        let Workspace { normed, last, logits, logits_local, gathered, perm, .. } = ws;
        let (Some(local), Some(gathered)) = (logits_local.as_mut(), gathered.as_mut()) else {
            return Err(tm_core::Error::invalid("the workspace has no tensor-parallel logits buffers"));
        };
        ops.matmul(head_input(ops, cx.step.logit_rows, normed, last)?, head, None, local)?;
        if rows == 1 {
            logits.reshape(&[world, slice])?;
            cx.comm.all_gather(local, logits, "lm_head", cx.timeout)?;
        } else {
            cx.comm.all_gather(local, gathered, "lm_head", cx.timeout)?;
            perm.clear();
            perm.extend((0..rows).flat_map(|r| (0..world).map(move |w| (w * rows + r) as u32)));
            logits.reshape(&[rows * world, slice])?;
            ops.gather_rows(gathered, perm, logits)?;
        }
        logits.reshape(&[rows, self.config.vocab_size])
    }
}

/// The LM head's input: `normed` itself when the step wants the logits of all its tokens in order
/// (every decode step: a gather would copy every row, a kernel per step), else the step's logit
/// rows of it gathered into `last`.
fn head_input<'w>(
    ops: &dyn Ops,
    logit_rows: &[u32],
    normed: &'w Tensor,
    last: &'w mut Tensor,
) -> Result<&'w Tensor, tm_core::Error> {
    if every_row_in_order(logit_rows, normed.shape().first().copied().unwrap_or(0)) {
        return Ok(normed);
    }
    ops.gather_rows(normed, logit_rows, last)?;
    Ok(last)
}

/// Whether `logit_rows` is `0, 1, .., tokens - 1`: the step wants the logits of every token in
/// order, so the head can read the normed hidden states without gathering them.
fn every_row_in_order(logit_rows: &[u32], tokens: usize) -> bool {
    logit_rows.len() == tokens && logit_rows.iter().enumerate().all(|(i, &r)| r as usize == i)
}

#[cfg(test)]
mod tests {
    use super::every_row_in_order;

    #[test]
    fn only_every_token_in_order_skips_the_gather() {
        assert!(every_row_in_order(&[0], 1));
        assert!(every_row_in_order(&[0, 1, 2], 3));
        assert!(!every_row_in_order(&[0, 1], 3), "a prefill chunk samples some of its tokens");
        assert!(!every_row_in_order(&[2], 3));
        assert!(!every_row_in_order(&[1, 0], 2), "rows out of order");
        assert!(!every_row_in_order(&[0, 0], 2));
        assert!(every_row_in_order(&[], 0));
    }
}
