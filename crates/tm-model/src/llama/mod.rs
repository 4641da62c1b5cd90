//! The Llama-family decoder graph, written once against [`tm_core::Ops`] so it runs on every
//! backend. Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm) and InternLM2 (mapped at load)
//! all use it.
//!
//! One [`LlamaModel::forward`] call runs a flat batch of tokens from any number of sequences
//! (prefill chunks and decode tokens mixed) described by a [`StepInput`].

mod load;
pub mod quant_load;
mod workspace;

pub use load::{internlm2_name, tensor_to_weight};
pub use workspace::Workspace;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::kv_cache::KvCache;
use crate::weights::TensorSource;
use tm_core::ops::{AttentionMeta, SeqAttention};
use tm_core::quant::Weight;
use tm_core::{Ops, Tensor};

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

/// A loaded Llama-family model.
#[derive(Debug)]
pub struct LlamaModel {
    /// Hyper-parameters.
    pub config: ModelConfig,
    embed: Weight,
    layers: Vec<LayerWeights>,
    final_norm: Tensor,
    lm_head: Option<Weight>,
}

impl LlamaModel {
    /// Loads every weight from `src` onto the backend. `on_tensor` is called with the stored
    /// bytes of each tensor as it is loaded.
    pub fn load(
        ops: &dyn Ops,
        src: &dyn TensorSource,
        config: ModelConfig,
        on_tensor: &mut dyn FnMut(u64),
    ) -> Result<Self> {
        let c = config.clone();
        let mut l = load::Loader { ops, src, cfg: &c, on_tensor };
        let embed = l.matrix("model.embed_tokens.weight", c.vocab_size, c.hidden_size)?;
        let layers = (0..c.num_layers).map(|i| l.layer(i)).collect::<Result<Vec<_>>>()?;
        let final_norm = l.vector("model.norm.weight", c.hidden_size)?;
        let lm_head = if c.tie_word_embeddings && !l.has("lm_head.weight") {
            None
        } else {
            Some(l.matrix("lm_head.weight", c.vocab_size, c.hidden_size)?)
        };
        Ok(LlamaModel { config, embed, layers, final_norm, lm_head })
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
    pub fn forward<'w>(
        &self,
        ops: &dyn Ops,
        kv: &mut KvCache,
        step: &StepInput<'_>,
        ws: &'w mut Workspace,
    ) -> Result<&'w Tensor> {
        let c = &self.config;
        let n = step.tokens.len();
        if n == 0 || step.positions.len() != n || step.slot_mapping.len() != n {
            return Err(ModelError::InvalidInput(format!(
                "step with {n} tokens, {} positions and {} slots",
                step.positions.len(),
                step.slot_mapping.len()
            )));
        }
        ws.prepare(ops, c, n, step.logit_rows.len())?;
        let max_pos = step.positions.iter().copied().max().unwrap_or(0) as usize;
        let freqs = c.rope.freqs(max_pos);
        let meta = AttentionMeta {
            seqs: step.seqs,
            block_size: kv.block_size,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
            sliding_window: c.sliding_window,
        };
        ops.run_step(&mut || self.run_layers(ops, kv, step, ws, &freqs, &meta))?;
        Ok(&ws.logits)
    }

    /// The layers, final norm and LM head of one step (run inside the backend's step context).
    fn run_layers(
        &self,
        ops: &dyn Ops,
        kv: &mut KvCache,
        step: &StepInput<'_>,
        ws: &mut Workspace,
        freqs: &tm_core::rope::RopeFreqs,
        meta: &AttentionMeta<'_>,
    ) -> Result<(), tm_core::Error> {
        let c = &self.config;
        let eps = c.rms_norm_eps;
        ops.embedding(&self.embed, step.tokens, &mut ws.residual)?;
        for (i, layer) in self.layers.iter().enumerate() {
            if i == 0 {
                ops.rms_norm(&ws.residual, &layer.attn_norm, eps, &mut ws.normed)?;
            } else {
                ops.add_rms_norm(&ws.delta, &mut ws.residual, &layer.attn_norm, eps, &mut ws.normed)?;
            }
            let (bq, bk, bv) = &layer.qkv_bias;
            ops.matmul(&ws.normed, &layer.q, bq.as_ref(), &mut ws.q)?;
            ops.matmul(&ws.normed, &layer.k, bk.as_ref(), &mut ws.k)?;
            ops.matmul(&ws.normed, &layer.v, bv.as_ref(), &mut ws.v)?;
            if let Some((qn, kn)) = &layer.qk_norm {
                ops.rms_norm(&ws.q, qn, eps, &mut ws.scratch_q)?;
                ops.rms_norm(&ws.k, kn, eps, &mut ws.scratch_k)?;
                std::mem::swap(&mut ws.q, &mut ws.scratch_q);
                std::mem::swap(&mut ws.k, &mut ws.scratch_k);
            }
            ops.rope(&mut ws.q, step.positions, freqs)?;
            ops.rope(&mut ws.k, step.positions, freqs)?;
            let (k_cache, v_cache) = kv.layer_mut(i);
            ops.write_kv(&ws.k, &ws.v, k_cache, v_cache, step.slot_mapping)?;
            ops.attention(&ws.q, k_cache, v_cache, meta, &mut ws.attn)?;
            ops.matmul(&ws.attn, &layer.o, None, &mut ws.delta)?;
            ops.add_rms_norm(&ws.delta, &mut ws.residual, &layer.mlp_norm, eps, &mut ws.normed)?;
            ops.matmul(&ws.normed, &layer.gate, None, &mut ws.gate)?;
            ops.matmul(&ws.normed, &layer.up, None, &mut ws.up)?;
            ops.silu_mul(&ws.gate, &ws.up, &mut ws.act)?;
            ops.matmul(&ws.act, &layer.down, None, &mut ws.delta)?;
        }
        ops.add_rms_norm(&ws.delta, &mut ws.residual, &self.final_norm, eps, &mut ws.normed)?;
        ops.gather_rows(&ws.normed, step.logit_rows, &mut ws.last)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        ops.matmul(&ws.last, head, None, &mut ws.logits)
    }
}
