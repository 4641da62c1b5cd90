//! One request as the scheduler sees it: its tokens, how many of them have keys and values in
//! the cache, its blocks, and its sampling state. Host-only.

use super::block_manager::BlockTable;
use tm_core::sampling::{Rng, SamplingParams};

/// Identifies a sequence; larger ids arrived later.
pub type SeqId = u64;

/// A prompt and what has been generated after it.
#[derive(Clone, Debug)]
pub struct Sequence {
    /// Arrival order (FCFS; the newest is preempted first).
    pub id: SeqId,
    /// Prompt tokens followed by generated tokens.
    pub tokens: Vec<u32>,
    /// Length of the prompt within `tokens`.
    pub prompt_len: usize,
    /// Leading tokens whose keys and values are in the cache.
    pub num_computed: usize,
    /// The sequence's KV blocks.
    pub table: BlockTable,
    /// Sampling parameters.
    pub params: SamplingParams,
    /// The sequence's random stream (seeded from `params.seed`).
    pub rng: Rng,
    /// Top log-probabilities to report per token, if any.
    pub logprobs: Option<usize>,
    /// Prompt tokens found in the prefix cache when first scheduled (`None` until then).
    pub cached_prompt_tokens: Option<usize>,
    /// Times this sequence was preempted (its cache dropped, to be recomputed).
    pub preemptions: u32,
}

impl Sequence {
    /// A new sequence for `prompt`.
    pub fn new(id: SeqId, prompt: Vec<u32>, params: SamplingParams, logprobs: Option<usize>) -> Self {
        let rng = Rng::new(params.seed);
        Sequence {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            num_computed: 0,
            table: BlockTable::default(),
            params,
            rng,
            logprobs,
            cached_prompt_tokens: None,
            preemptions: 0,
        }
    }

    /// Total tokens (prompt and output).
    pub fn len(&self) -> usize {
        self.tokens.len()
    }
    /// Whether there are no tokens at all.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
    /// The prompt.
    pub fn prompt(&self) -> &[u32] {
        &self.tokens[..self.prompt_len]
    }
    /// The generated tokens.
    pub fn output(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }
    /// Tokens still to run through the model before the next token can be sampled.
    pub fn remaining(&self) -> usize {
        self.tokens.len() - self.num_computed
    }
    /// Whether the sequence is prefilling (more than one token to compute).
    pub fn is_prefill(&self) -> bool {
        self.remaining() > 1
    }
    /// Whether the sequence holds no blocks and nothing is computed (waiting state).
    pub fn is_reset(&self) -> bool {
        self.table.blocks.is_empty() && self.num_computed == 0
    }
}
