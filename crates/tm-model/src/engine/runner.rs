//! The one boundary between scheduling and the model: a [`Batch`] of sequences becomes a flat
//! [`StepInput`] (tokens, positions, slot mapping, per-sequence attention metadata, logit rows),
//! the model runs it against the paged KV cache, and one `Ops::sample` call draws a token for
//! every sequence that reached its end.
//!
//! The model is whole on one backend ([`Target::Local`]: the runner holds its KV cache and
//! workspace) or split over tensor-parallel ranks ([`Target::Tp`]: each rank holds its own, and
//! rank 0 samples on its device).

use super::request::TokenLogprobs;
use super::scheduler::Batch;
use super::sequence::Sequence;
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::kv_cache::{KvCache, KvCacheDtype};
use crate::llama::{LlamaModel, ShardLayout, StepInput, Workspace};
use crate::tp::{OwnedSample, TpGroup};
use tm_core::ops::{SampleRequest, SeqAttention};
use tm_core::Ops;

/// Where a step runs.
pub enum Target<'a> {
    /// The whole model on one backend.
    Local {
        /// The weights.
        model: &'a LlamaModel,
        /// The backend.
        ops: &'a dyn Ops,
    },
    /// The model split over tensor-parallel ranks.
    Tp(&'a mut TpGroup),
}

/// Tokens drawn in one step, in batch order (one per sampled sequence).
#[derive(Clone, Debug, Default)]
pub struct StepOutput {
    /// The sampled tokens.
    pub tokens: Vec<u32>,
    /// Log-probabilities, for sequences that asked for them.
    pub logprobs: Vec<Option<TokenLogprobs>>,
}

/// The KV cache and the activation workspace (for [`Target::Local`]; tensor-parallel ranks
/// hold their own), and reusable step buffers.
#[derive(Debug)]
pub struct ModelRunner {
    local: Option<(KvCache, Workspace)>,
    block_size: usize,
    vocab: usize,
    tokens: Vec<u32>,
    positions: Vec<u32>,
    slots: Vec<u32>,
    rows: Vec<u32>,
    logits: Vec<f32>,
    scratch: Vec<(f32, u32)>,
}

impl ModelRunner {
    /// Allocates `num_blocks` KV blocks of `block_size` tokens stored as `kv_dtype` and a
    /// workspace for steps of up to `max_tokens` tokens and `max_seqs` sequences.
    pub fn new(
        ops: &dyn Ops,
        cfg: &ModelConfig,
        num_blocks: usize,
        block_size: usize,
        max_tokens: usize,
        max_seqs: usize,
        kv_dtype: KvCacheDtype,
    ) -> Result<Self> {
        let kv = KvCache::for_shard(ops, cfg, &ShardLayout::single(cfg), num_blocks, block_size, kv_dtype)?;
        let ws = Workspace::new(ops, cfg, max_tokens, max_seqs)?;
        let mut runner = Self::for_tp(cfg, block_size, max_tokens, max_seqs);
        runner.local = Some((kv, ws));
        Ok(runner)
    }

    /// For a model with int4 weights (`int4`): reserves the backend's int4 matmul scratch for the
    /// workspace's step size ([`Workspace::with_int4_scratch`]); dense models reserve nothing.
    pub fn with_int4_scratch(mut self, ops: &dyn Ops, int4: bool) -> Result<Self> {
        if let Some((kv, ws)) = self.local.take() {
            self.local = Some((kv, ws.with_int4_scratch(ops, int4)?));
        }
        Ok(self)
    }

    /// Step buffers only, for a model on tensor-parallel ranks (which hold the KV cache and the
    /// workspaces; [`Target::Tp`]).
    pub fn for_tp(cfg: &ModelConfig, block_size: usize, max_tokens: usize, max_seqs: usize) -> Self {
        ModelRunner {
            local: None,
            block_size,
            vocab: cfg.vocab_size,
            tokens: Vec::with_capacity(max_tokens),
            positions: Vec::with_capacity(max_tokens),
            slots: Vec::with_capacity(max_tokens),
            rows: Vec::with_capacity(max_seqs),
            logits: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// Runs `batch` over `seqs` (the scheduler's running sequences) and samples.
    /// `while_running` is called once, while the device computes the step (after the forward
    /// pass is queued, before its results are waited for), for host work that can overlap it.
    pub fn step(
        &mut self,
        target: Target<'_>,
        seqs: &mut [Sequence],
        batch: &Batch,
        out: &mut StepOutput,
        while_running: &mut dyn FnMut(),
    ) -> Result<()> {
        out.tokens.clear();
        out.logprobs.clear();
        if batch.seqs.is_empty() {
            while_running();
            return Ok(());
        }
        let bs = self.block_size;
        let (tokens, positions, slots, rows) = (&mut self.tokens, &mut self.positions, &mut self.slots, &mut self.rows);
        tokens.clear();
        positions.clear();
        slots.clear();
        rows.clear();
        let mut attn = Vec::with_capacity(batch.seqs.len());
        for s in &batch.seqs {
            let seq = seqs.get(s.index).filter(|q| q.id == s.id).ok_or_else(|| bad_batch("unknown sequence"))?;
            let (start, end) = (seq.num_computed, seq.num_computed + s.num_tokens);
            if s.num_tokens == 0 || end > seq.len() || seq.table.blocks.len() < end.div_ceil(bs) {
                return Err(bad_batch("a sequence's tokens or blocks do not cover the step"));
            }
            let query_start = tokens.len();
            tokens.extend_from_slice(&seq.tokens[start..end]);
            for p in start..end {
                positions.push(p as u32);
                slots.push(seq.table.blocks[p / bs] * bs as u32 + (p % bs) as u32);
            }
            let block_table = seq.table.blocks.as_slice();
            attn.push(SeqAttention { query_start, query_len: s.num_tokens, context_len: end, block_table });
            if s.sample {
                rows.push(tokens.len() as u32 - 1);
            }
        }
        let sampled = rows.len();
        if sampled == 0 {
            rows.push(tokens.len() as u32 - 1); // the model wants one row; nothing is sampled
        }
        let step = StepInput { tokens, positions, slot_mapping: slots, seqs: &attn, logit_rows: rows };
        let sampled_seqs = || batch.seqs.iter().filter(|s| s.sample);
        let want_logprobs = sampled > 0 && sampled_seqs().any(|s| seqs[s.index].logprobs.is_some());
        match target {
            Target::Local { model, ops } => {
                let Some((kv, ws)) = self.local.as_mut() else {
                    return Err(bad_batch("a local step on a runner made for tensor-parallel ranks"));
                };
                kv.copy_blocks(ops, &batch.copies)?;
                let logits = model.forward(ops, kv, &step, ws);
                while_running();
                let logits = logits?;
                if sampled == 0 {
                    return Ok(());
                }
                if want_logprobs {
                    self.logits = ops.download_f32(logits)?;
                }
                let mut requests = Vec::with_capacity(sampled);
                let mut next = sampled_seqs().map(|s| s.index).peekable();
                for (i, seq) in seqs.iter_mut().enumerate() {
                    if next.peek() != Some(&i) {
                        continue;
                    }
                    next.next();
                    let Sequence { params, tokens, prompt_len, rng, .. } = seq;
                    let (prompt, output) = tokens.split_at(*prompt_len);
                    requests.push(SampleRequest { params, prompt, output, rng });
                }
                out.tokens = ops.sample(logits, &mut requests)?;
            }
            Target::Tp(group) => {
                group.copy_blocks(&batch.copies)?;
                let requests: Vec<OwnedSample> = if sampled == 0 {
                    // The model wants one logit row; its token is drawn and thrown away.
                    vec![OwnedSample {
                        params: Default::default(),
                        prompt: Vec::new(),
                        output: Vec::new(),
                        rng: tm_core::sampling::Rng::new(0),
                    }]
                } else {
                    sampled_seqs()
                        .map(|s| {
                            let seq = &seqs[s.index];
                            let history = OwnedSample::needs_history(&seq.params);
                            OwnedSample {
                                params: seq.params.clone(),
                                prompt: if history { seq.prompt().to_vec() } else { Vec::new() },
                                output: if history { seq.output().to_vec() } else { Vec::new() },
                                rng: seq.rng.clone(),
                            }
                        })
                        .collect()
                };
                let result = group.forward_sample(&step, requests, want_logprobs, while_running)?;
                if sampled == 0 {
                    return Ok(());
                }
                if result.rngs.len() != sampled {
                    return Err(bad_batch("rank 0 returned the wrong number of random streams"));
                }
                let indices: Vec<usize> = sampled_seqs().map(|s| s.index).collect();
                for (i, rng) in indices.into_iter().zip(result.rngs) {
                    seqs[i].rng = rng;
                }
                if let Some(l) = result.logits {
                    self.logits = l;
                }
                out.tokens = result.tokens;
            }
        }
        if out.tokens.len() != sampled {
            return Err(bad_batch("the sampler returned the wrong number of tokens"));
        }
        let vocab = self.vocab;
        for (row, s) in sampled_seqs().enumerate() {
            let lp = match seqs[s.index].logprobs {
                Some(n) if want_logprobs => {
                    let logits = self.logits.get(row * vocab..(row + 1) * vocab).unwrap_or(&[]);
                    Some(logprobs(logits, out.tokens[row], n, &mut self.scratch))
                }
                _ => None,
            };
            out.logprobs.push(lp);
        }
        Ok(())
    }
}

fn bad_batch(what: &str) -> ModelError {
    ModelError::InvalidInput(format!("internal error: bad batch: {what}"))
}

/// Log-softmax of `logits` at `chosen`, and the `n` most likely tokens.
fn logprobs(logits: &[f32], chosen: u32, n: usize, scratch: &mut Vec<(f32, u32)>) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&x| f64::from(x - max).exp()).sum();
    let lse = max + sum.ln() as f32;
    let logprob = logits.get(chosen as usize).map_or(f32::NEG_INFINITY, |&x| x - lse);
    scratch.clear();
    scratch.extend(logits.iter().enumerate().map(|(i, &x)| (x, i as u32)));
    let desc = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    let n = n.min(scratch.len());
    if n > 0 && n < scratch.len() {
        scratch.select_nth_unstable_by(n - 1, desc);
    }
    scratch.truncate(n);
    scratch.sort_unstable_by(desc);
    TokenLogprobs { token: chosen, logprob, top: scratch.iter().map(|&(x, i)| (i, x - lse)).collect() }
}
