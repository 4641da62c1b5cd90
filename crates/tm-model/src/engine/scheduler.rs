//! Continuous batching: every step takes the running sequences (oldest first: decode tokens and
//! the next chunks of prefills) and then admits waiting ones (FCFS) under a token budget and a
//! batch size. When blocks run out, the newest running sequence is preempted: its blocks are
//! freed and it goes back to the queue to be recomputed (cheaply, from the prefix cache).
//! Host-only; the runner turns a [`Batch`] into model inputs.

use super::block_manager::{BlockId, BlockManager};
use super::sequence::{SeqId, Sequence};
use std::collections::VecDeque;

/// Limits of one step.
#[derive(Clone, Copy, Debug)]
pub struct SchedulerConfig {
    /// Most tokens in one step (prefill chunks plus decode tokens).
    pub max_batched_tokens: usize,
    /// Most sequences in one step.
    pub max_batch_size: usize,
}

/// One sequence's part of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScheduledSeq {
    /// Index into [`Scheduler::running`].
    pub index: usize,
    /// The sequence.
    pub id: SeqId,
    /// Tokens computed this step, starting at the sequence's `num_computed`.
    pub num_tokens: usize,
    /// Whether the step reaches the end of the sequence, so a token is sampled.
    pub sample: bool,
}

/// What one step computes.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    /// The sequences, ordered by index into [`Scheduler::running`].
    pub seqs: Vec<ScheduledSeq>,
    /// Block copies `(src, dst)` to make before the step (copy-on-write).
    pub copies: Vec<(BlockId, BlockId)>,
    /// Sequences that can never be scheduled, removed from the scheduler, with the reason.
    pub failed: Vec<(Sequence, String)>,
    /// Sequences preempted while building this batch.
    pub preempted: usize,
    /// Sequences started for the first time (they leave the admission queue).
    pub admitted_new: usize,
}

impl Batch {
    /// Tokens in the step.
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.num_tokens).sum()
    }
}

/// Counters kept by the scheduler.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedulerCounters {
    /// Prompt tokens looked up in the prefix cache (first admission of each sequence).
    pub prefix_queried_tokens: u64,
    /// Of those, tokens found in the cache.
    pub prefix_hit_tokens: u64,
    /// Preemptions so far.
    pub preemptions: u64,
}

/// Waiting and running sequences and the block manager they share.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    /// The KV blocks.
    pub blocks: BlockManager,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    counters: SchedulerCounters,
}

/// Result of trying to admit the first waiting sequence.
enum Admit {
    Yes(usize),
    NotNow,
    Never(String),
}

impl Scheduler {
    /// A scheduler over `blocks`.
    pub fn new(config: SchedulerConfig, blocks: BlockManager) -> Self {
        let config = SchedulerConfig {
            max_batched_tokens: config.max_batched_tokens.max(1),
            max_batch_size: config.max_batch_size.max(1),
        };
        Scheduler { config, blocks, waiting: VecDeque::new(), running: Vec::new(), counters: Default::default() }
    }

    /// Queues a new sequence (ids must increase with arrival).
    pub fn add(&mut self, seq: Sequence) {
        let at = self.waiting.partition_point(|s| s.id < seq.id);
        self.waiting.insert(at, seq);
    }
    /// Sequences waiting to be (re)admitted.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    /// Sequences holding blocks.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }
    /// Whether anything is left to do.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }
    /// Running sequences, oldest first (what [`ScheduledSeq::index`] points into).
    pub fn running(&self) -> &[Sequence] {
        &self.running
    }
    /// Running sequences, mutably (for the runner's sampling state).
    pub fn running_mut(&mut self) -> &mut [Sequence] {
        &mut self.running
    }
    /// Waiting sequences, oldest first.
    pub fn waiting(&self) -> impl Iterator<Item = &Sequence> {
        self.waiting.iter()
    }
    /// Counters so far.
    pub fn counters(&self) -> SchedulerCounters {
        self.counters
    }

    /// Removes a sequence (finished, cancelled or failed) and frees its blocks.
    pub fn remove(&mut self, id: SeqId) -> Option<Sequence> {
        let mut seq = if let Some(i) = self.running.iter().position(|s| s.id == id) {
            self.running.remove(i)
        } else {
            let i = self.waiting.iter().position(|s| s.id == id)?;
            self.waiting.remove(i)?
        };
        self.blocks.free(&mut seq.table);
        Some(seq)
    }

    /// Plans the next step.
    pub fn schedule(&mut self) -> Batch {
        let mut batch = Batch::default();
        let mut picked: Vec<(SeqId, usize)> = Vec::new();
        let mut budget = self.config.max_batched_tokens;
        let mut i = 0;
        while i < self.running.len() && budget > 0 && picked.len() < self.config.max_batch_size {
            let n = self.running[i].remaining().min(budget);
            if n == 0 {
                i += 1;
                continue;
            }
            if self.reserve(i, n, &mut batch.copies) {
                picked.push((self.running[i].id, n));
                budget -= n;
                i += 1;
                continue;
            }
            // Out of blocks: preempt the newest running sequence (possibly this one).
            let newest = self.running.len() - 1;
            if newest == 0 {
                let seq = self.running.remove(0);
                self.fail(seq, &mut batch, "its keys and values no longer fit in the KV cache");
                break;
            }
            self.preempt(newest, &mut batch.copies);
            batch.preempted += 1;
        }
        // New work only when nothing had to make room this step.
        while batch.preempted == 0 && budget > 0 && picked.len() < self.config.max_batch_size {
            let Some(seq) = self.waiting.pop_front() else { break };
            let (id, first) = (seq.id, seq.cached_prompt_tokens.is_none());
            match self.admit(seq, budget, &mut batch.copies) {
                (Admit::Yes(n), seq) => {
                    batch.admitted_new += usize::from(first);
                    let at = self.running.partition_point(|s| s.id < id);
                    self.running.insert(at, seq);
                    picked.push((id, n));
                    budget -= n;
                }
                (Admit::NotNow, seq) => {
                    self.waiting.push_front(seq);
                    break;
                }
                (Admit::Never(msg), seq) => self.fail(seq, &mut batch, &msg),
            }
        }
        for (id, n) in picked {
            let index = self.running.partition_point(|s| s.id < id);
            let seq = &self.running[index];
            let sample = seq.num_computed + n == seq.len();
            batch.seqs.push(ScheduledSeq { index, id, num_tokens: n, sample });
        }
        batch.seqs.sort_by_key(|s| s.index);
        batch
    }

    /// Records a finished step: the scheduled tokens are computed, full blocks are registered
    /// in the prefix cache, and each sampled token (one per `sample` entry, in batch order) is
    /// appended.
    pub fn postprocess(&mut self, batch: &Batch, sampled: &[u32]) {
        let mut sampled = sampled.iter();
        for s in &batch.seqs {
            let seq = &mut self.running[s.index];
            seq.num_computed += s.num_tokens;
            self.blocks.register_full_blocks(&mut seq.table, &seq.tokens, seq.num_computed);
            if s.sample {
                if let Some(&t) = sampled.next() {
                    seq.tokens.push(t);
                }
            }
        }
    }

    /// Makes room for `n` more tokens of running sequence `i`.
    fn reserve(&mut self, i: usize, n: usize, copies: &mut Vec<(BlockId, BlockId)>) -> bool {
        let seq = &mut self.running[i];
        let (start, end) = (seq.num_computed, seq.num_computed + n);
        self.blocks.ensure_capacity(&mut seq.table, end)
            && self.blocks.prepare_write(&mut seq.table, start, end, copies)
    }

    /// Moves running sequence `i` back to the queue, freeing its blocks.
    fn preempt(&mut self, i: usize, copies: &mut Vec<(BlockId, BlockId)>) {
        let mut seq = self.running.remove(i);
        copies.retain(|(_, dst)| !seq.table.blocks.contains(dst));
        self.blocks.free(&mut seq.table);
        seq.num_computed = 0;
        seq.preemptions += 1;
        self.counters.preemptions += 1;
        self.add(seq);
    }

    fn fail(&mut self, mut seq: Sequence, batch: &mut Batch, why: &str) {
        batch.copies.retain(|(_, dst)| !seq.table.blocks.contains(dst));
        self.blocks.free(&mut seq.table);
        let msg = format!(
            "request needs {} KV blocks of {} tokens for {} tokens but the cache has {}: {why}",
            self.blocks.blocks_for(seq.len()),
            self.blocks.block_size(),
            seq.len(),
            self.blocks.num_blocks()
        );
        batch.failed.push((seq, msg));
    }

    /// Tries to give a waiting sequence all the blocks its tokens need (reusing cached
    /// prefix blocks) and its first chunk of at most `budget` tokens.
    fn admit(&mut self, mut seq: Sequence, budget: usize, copies: &mut Vec<(BlockId, BlockId)>) -> (Admit, Sequence) {
        let bs = self.blocks.block_size();
        let hit_blocks = self.blocks.match_prefix(&mut seq.table, &seq.tokens);
        // The last token is always recomputed (its logits are needed); when it lies in a
        // cached block, that block is copied on write.
        let computed = (hit_blocks * bs).min(seq.len() - 1);
        let cow = usize::from(computed < hit_blocks * bs);
        let need = self.blocks.blocks_for(seq.len()) - hit_blocks + cow;
        if need > self.blocks.num_free() {
            self.blocks.free(&mut seq.table);
            if self.running.is_empty() || self.blocks.blocks_for(seq.len()) + cow > self.blocks.num_blocks() {
                let why = "it can never be scheduled".to_string();
                return (Admit::Never(why), seq);
            }
            return (Admit::NotNow, seq);
        }
        let n = (seq.len() - computed).min(budget);
        seq.num_computed = computed;
        let len = seq.len();
        let ok = self.blocks.ensure_capacity(&mut seq.table, len)
            && self.blocks.prepare_write(&mut seq.table, computed, computed + n, copies);
        if !ok {
            // Not expected (the free blocks were counted above); try again next step.
            self.blocks.free(&mut seq.table);
            seq.num_computed = 0;
            return (Admit::NotNow, seq);
        }
        if seq.cached_prompt_tokens.is_none() {
            seq.cached_prompt_tokens = Some(computed.min(seq.prompt_len));
            self.counters.prefix_queried_tokens += seq.prompt_len as u64;
            self.counters.prefix_hit_tokens += computed.min(seq.prompt_len) as u64;
        }
        (Admit::Yes(n), seq)
    }
}
