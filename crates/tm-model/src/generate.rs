//! Single-sequence generation: prefill the prompt (in chunks), then decode token by token with
//! sampling, reading and writing the paged KV cache through a block table. The serving engine
//! batches many of these; this is the path `generate` and `chat` use, on one backend or on a
//! tensor-parallel group.

use crate::error::{ModelError, Result};
use crate::kv_cache::{BlockPool, KvCache, KvCacheDtype};
use crate::llama::{LlamaModel, ShardLayout, StepInput, Workspace};
use crate::tp::TpGroup;
use std::ops::ControlFlow;
use std::time::{Duration, Instant};
use tm_core::ops::{sample_rows, SampleRequest, SeqAttention};
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

/// What runs a session's steps: one model on one backend, or a tensor-parallel group.
enum Exec<'m> {
    Local { model: &'m LlamaModel, ops: &'m dyn Ops, kv: KvCache, ws: Box<Workspace> },
    Tp(&'m mut TpGroup),
}

/// A step's logits: on the backend (sampled there), or rank 0's on the host.
enum Logits<'a> {
    Device(&'a dyn Ops, &'a Tensor),
    Host(&'a [f32]),
}

impl Logits<'_> {
    fn to_vec(&self) -> Result<Vec<f32>> {
        match self {
            Logits::Device(ops, t) => Ok(ops.download_f32(t)?),
            Logits::Host(v) => Ok(v.to_vec()),
        }
    }

    fn sample(&self, vocab: usize, requests: &mut [SampleRequest<'_>], scratch: &mut Scratch) -> Result<u32> {
        let tokens = match self {
            Logits::Device(ops, t) => ops.sample(t, requests)?,
            Logits::Host(v) => sample_rows(v, vocab, requests, &mut scratch.0, &mut scratch.1),
        };
        tokens.first().copied().ok_or_else(|| ModelError::InvalidInput("the sampler returned no token".into()))
    }
}

/// Host sampling buffers (tensor-parallel sessions sample rank 0's logits on the host).
type Scratch = (Vec<f32>, Vec<(f32, u32)>);

/// One sequence with its own KV cache. Consecutive calls reuse the cache for a shared prefix
/// (multi-turn chat re-sends the conversation; only the new part is computed).
///
/// A session runs on one backend ([`Session::new`]) or on a tensor-parallel group
/// ([`Session::tensor_parallel`]), with the same results.
pub struct Session<'m> {
    exec: Exec<'m>,
    vocab: usize,
    context_length: usize,
    block_size: usize,
    pool: BlockPool,
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
    /// A session holding up to `max_len` tokens in blocks of `block_size`, the KV cache in the
    /// activation dtype.
    pub fn new(model: &'m LlamaModel, ops: &'m dyn Ops, max_len: usize, block_size: usize) -> Result<Self> {
        Self::with_kv_dtype(model, ops, max_len, block_size, KvCacheDtype::Auto)
    }

    /// [`Session::new`] with the KV cache stored as `kv_dtype`.
    pub fn with_kv_dtype(
        model: &'m LlamaModel,
        ops: &'m dyn Ops,
        max_len: usize,
        block_size: usize,
        kv_dtype: KvCacheDtype,
    ) -> Result<Self> {
        let context_length = model.config.context_length();
        let max_len = max_len.min(context_length.max(1)).max(1);
        let num_blocks = max_len.div_ceil(block_size.max(1));
        let exec = Exec::Local {
            model,
            ops,
            kv: KvCache::for_shard(
                ops,
                &model.config,
                &ShardLayout::single(&model.config),
                num_blocks,
                block_size,
                kv_dtype,
            )?,
            ws: Box::new(Workspace::new(ops, &model.config, 1, 1)?.with_int4_scratch(ops, model.has_int4())?),
        };
        Ok(Self::with_exec(exec, model.config.vocab_size, context_length, max_len, block_size, num_blocks))
    }

    /// A session on a tensor-parallel group, holding up to `max_len` tokens (at most what the
    /// group's KV cache holds). Every step runs on every rank; rank 0's logits are sampled on
    /// the host.
    pub fn tensor_parallel(group: &'m mut TpGroup, max_len: usize) -> Result<Self> {
        let context_length = group.config().context_length();
        let (block_size, num_blocks) = (group.block_size(), group.num_blocks());
        let max_len = max_len.min(context_length.max(1)).min(num_blocks * block_size).max(1);
        let vocab = group.config().vocab_size;
        Ok(Self::with_exec(Exec::Tp(group), vocab, context_length, max_len, block_size, num_blocks))
    }

    fn with_exec(
        exec: Exec<'m>,
        vocab: usize,
        context_length: usize,
        max_len: usize,
        block_size: usize,
        num_blocks: usize,
    ) -> Self {
        Session {
            exec,
            vocab,
            context_length,
            block_size,
            pool: BlockPool::new(num_blocks),
            block_table: Vec::new(),
            tokens: Vec::new(),
            max_len,
            prefill_chunk: 512.min(max_len),
            positions: Vec::new(),
            slots: Vec::new(),
            rows: Vec::new(),
        }
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
        let keep = len.div_ceil(self.block_size);
        self.pool.give_back(self.block_table.drain(keep..));
    }

    /// Runs `new` tokens through the model after those already cached; returns logits for the
    /// rows selected by `all_logits` (every new token) or just the last.
    fn feed(&mut self, new: &[u32], all_logits: bool) -> Result<Logits<'_>> {
        let start = self.tokens.len();
        let end = start + new.len();
        if end > self.max_len {
            return Err(ModelError::InvalidInput(format!(
                "the sequence would be {end} tokens but the context holds {} (raise --max-len, up to the model's {})",
                self.max_len, self.context_length
            )));
        }
        let bs = self.block_size;
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
        let result = match &mut self.exec {
            Exec::Local { model, ops, kv, ws } => model.forward(*ops, kv, &step, ws).map(|t| Logits::Device(*ops, t)),
            Exec::Tp(group) => group.forward(&step).map(Logits::Host),
        };
        if result.is_err() {
            self.tokens.truncate(start);
        }
        result
    }

    /// Appends `tokens` to the cached sequence and returns the logits after the last one.
    pub fn append(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(ModelError::InvalidInput("nothing to append".into()));
        }
        self.feed(tokens, false)?.to_vec()
    }

    /// Logits `[prompt.len(), vocab]` for every position of `prompt`, from an empty cache.
    pub fn prompt_logits(&mut self, prompt: &[u32]) -> Result<Vec<f32>> {
        self.truncate(0);
        if prompt.is_empty() {
            return Err(ModelError::InvalidInput("empty prompt".into()));
        }
        self.feed(prompt, true)?.to_vec()
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
            let cure = if self.max_len < self.context_length {
                format!("raise --max-len, up to the model's {}, or shorten the prompt", self.context_length)
            } else {
                format!("the model's context length is {}: shorten the prompt", self.context_length)
            };
            return Err(ModelError::InvalidInput(format!(
                "the prompt has {} tokens but the context holds {} ({cure})",
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
        let mut rng = Rng::new(opts.sampling.seed);
        let mut output = Vec::new();
        let mut scratch: Scratch = (Vec::new(), Vec::new());
        let vocab = self.vocab;
        let mut next = {
            let logits = self.feed(rest, false)?;
            let mut req = [SampleRequest { params: &opts.sampling, prompt, output: &output, rng: &mut rng }];
            logits.sample(vocab, &mut req, &mut scratch)?
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
            next = logits.sample(vocab, &mut req, &mut scratch)?;
        };
        stats.decode_time = t1.elapsed();
        Ok((output, finish, stats))
    }
}
