//! Single-sequence generation: prefill the prompt (in chunks), then decode token by token with
//! sampling, reading and writing the paged KV cache through a block table. The serving engine
//! batches many of these; this is the path `generate` and `chat` use.

use crate::error::{ModelError, Result};
use crate::kv_cache::{BlockPool, KvCache};
use crate::llama::{LlamaModel, StepInput, Workspace};
use std::ops::ControlFlow;
use std::time::{Duration, Instant};
use tm_core::ops::{SampleRequest, SeqAttention};
use tm_core::sampling::{Rng, SamplingParams};
use tm_core::{Ops, Tensor};

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was generated.
    Stop,
    /// `max_tokens` or the context length was reached.
    Length,
    /// The caller stopped it.
    Abort,
}

/// Options of one generation.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// Token ids that end generation (not included in the output).
    pub stop_ids: Vec<u32>,
}

/// Timing of one generation.
#[derive(Clone, Copy, Debug, Default)]
pub struct GenerationStats {
    /// Prompt tokens processed (excluding any reused from the previous turn).
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV was reused from earlier turns.
    pub reused_tokens: usize,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// Time spent in prefill.
    pub prefill_time: Duration,
    /// Time spent decoding.
    pub decode_time: Duration,
}

impl GenerationStats {
    /// Prompt tokens per second.
    pub fn prefill_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_time.as_secs_f64().max(1e-9)
    }
    /// Generated tokens per second (after the first).
    pub fn decode_tok_s(&self) -> f64 {
        self.generated_tokens.saturating_sub(1) as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

/// One sequence with its own KV cache. Consecutive calls reuse the cache for a shared prefix
/// (multi-turn chat re-sends the conversation; only the new part is computed).
pub struct Session<'m> {
    model: &'m LlamaModel,
    ops: &'m dyn Ops,
    kv: KvCache,
    pool: BlockPool,
    ws: Workspace,
    block_table: Vec<u32>,
    tokens: Vec<u32>,
    max_len: usize,
    prefill_chunk: usize,
    /// Per-step inputs, reused so decoding allocates nothing per token.
    positions: Vec<u32>,
    slots: Vec<u32>,
    rows: Vec<u32>,
}

impl<'m> Session<'m> {
    /// A session holding up to `max_len` tokens in blocks of `block_size`.
    pub fn new(model: &'m LlamaModel, ops: &'m dyn Ops, max_len: usize, block_size: usize) -> Result<Self> {
        let max_len = max_len.min(model.config.context_length().max(1)).max(1);
        let num_blocks = max_len.div_ceil(block_size);
        let prefill_chunk = 512.min(max_len);
        Ok(Session {
            model,
            ops,
            kv: KvCache::new(ops, &model.config, num_blocks, block_size)?,
            pool: BlockPool::new(num_blocks),
            ws: Workspace::new(ops, &model.config, 1, 1)?,
            block_table: Vec::new(),
            tokens: Vec::new(),
            max_len,
            prefill_chunk,
            positions: Vec::new(),
            slots: Vec::new(),
            rows: Vec::new(),
        })
    }

    /// Longest sequence (prompt plus output) this session holds.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Tokens currently in the cache.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Drops cached tokens beyond `len`, freeing whole blocks.
    pub fn truncate(&mut self, len: usize) {
        let len = len.min(self.tokens.len());
        self.tokens.truncate(len);
        let keep = len.div_ceil(self.kv.block_size);
        self.pool.give_back(self.block_table.drain(keep..));
    }

    /// Runs `new` tokens through the model after those already cached; returns logits for the
    /// rows selected by `all_logits` (every new token) or just the last.
    fn feed(&mut self, new: &[u32], all_logits: bool) -> Result<&Tensor> {
        let start = self.tokens.len();
        let end = start + new.len();
        if end > self.max_len {
            return Err(ModelError::InvalidInput(format!(
                "the sequence would be {end} tokens but the context holds {} (raise --max-len, up to the model's {})",
                self.max_len,
                self.model.config.context_length()
            )));
        }
        let bs = self.kv.block_size;
        while self.block_table.len() < end.div_ceil(bs) {
            let b = self.pool.take().ok_or_else(|| ModelError::InvalidInput("the KV cache is full".into()))?;
            self.block_table.push(b);
        }
        self.positions.clear();
        self.positions.extend(start as u32..end as u32);
        self.slots.clear();
        self.slots.extend((start..end).map(|p| self.block_table[p / bs] * bs as u32 + (p % bs) as u32));
        self.rows.clear();
        if all_logits {
            self.rows.extend(0..new.len() as u32);
        } else {
            self.rows.push(new.len() as u32 - 1);
        }
        let seqs =
            [SeqAttention { query_start: 0, query_len: new.len(), context_len: end, block_table: &self.block_table }];
        let step = StepInput {
            tokens: new,
            positions: &self.positions,
            slot_mapping: &self.slots,
            seqs: &seqs,
            logit_rows: &self.rows,
        };
        self.tokens.extend_from_slice(new);
        match self.model.forward(self.ops, &mut self.kv, &step, &mut self.ws) {
            Ok(logits) => Ok(logits),
            Err(e) => {
                self.tokens.truncate(start);
                Err(e)
            }
        }
    }

    /// Appends `tokens` to the cached sequence and returns the logits after the last one.
    pub fn append(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(ModelError::InvalidInput("nothing to append".into()));
        }
        let ops = self.ops;
        let logits = self.feed(tokens, false)?;
        Ok(ops.download_f32(logits)?)
    }

    /// Logits `[prompt.len(), vocab]` for every position of `prompt`, from an empty cache.
    pub fn prompt_logits(&mut self, prompt: &[u32]) -> Result<Vec<f32>> {
        self.truncate(0);
        if prompt.is_empty() {
            return Err(ModelError::InvalidInput("empty prompt".into()));
        }
        let ops = self.ops;
        let logits = self.feed(prompt, true)?;
        Ok(ops.download_f32(logits)?)
    }

    /// Generates after `prompt`, calling `on_token` with each new token; it may return
    /// `ControlFlow::Break` to stop. Reuses the cached KV of the longest common prefix with the
    /// previous call.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_token: &mut dyn FnMut(u32) -> ControlFlow<()>,
    ) -> Result<(Vec<u32>, FinishReason, GenerationStats)> {
        opts.sampling.validate()?;
        if prompt.is_empty() {
            return Err(ModelError::InvalidInput("empty prompt".into()));
        }
        if prompt.len() >= self.max_len {
            return Err(ModelError::InvalidInput(format!(
                "the prompt has {} tokens but the context holds {} (raise --max-len or shorten the prompt)",
                prompt.len(),
                self.max_len
            )));
        }
        let mut stats = GenerationStats::default();
        // Reuse the common prefix, but always recompute at least the last prompt token.
        let common = self.tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count().min(prompt.len() - 1);
        self.truncate(common);
        stats.reused_tokens = common;
        stats.prompt_tokens = prompt.len() - common;
        let t0 = Instant::now();
        let mut rest = &prompt[common..];
        while rest.len() > self.prefill_chunk {
            self.feed(&rest[..self.prefill_chunk], false)?;
            rest = &rest[self.prefill_chunk..];
        }
        let ops = self.ops;
        let mut rng = Rng::new(opts.sampling.seed);
        let mut output = Vec::new();
        let mut next = {
            let logits = self.feed(rest, false)?;
            let mut req = [SampleRequest { params: &opts.sampling, prompt, output: &output, rng: &mut rng }];
            ops.sample(logits, &mut req)?[0]
        };
        stats.prefill_time = t0.elapsed();
        let t1 = Instant::now();
        let finish = loop {
            if opts.stop_ids.contains(&next) {
                break FinishReason::Stop;
            }
            output.push(next);
            stats.generated_tokens += 1;
            if on_token(next).is_break() {
                break FinishReason::Abort;
            }
            if output.len() >= opts.max_tokens || self.tokens.len() + 1 >= self.max_len {
                break FinishReason::Length;
            }
            let logits = self.feed(&[next], false)?;
            let mut req = [SampleRequest { params: &opts.sampling, prompt, output: &output, rng: &mut rng }];
            next = ops.sample(logits, &mut req)?[0];
        };
        stats.decode_time = t1.elapsed();
        Ok((output, finish, stats))
    }
}
