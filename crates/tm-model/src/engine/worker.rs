//! The engine thread: take commands, schedule, run a step, hand tokens to each request's
//! output, finish requests. Every error is reported to the requests it concerns; a panic is
//! caught and reported to every request, and the engine stops.

use super::block_manager::BlockManager;
use super::config::{EngineConfig, EngineStats};
use super::emitter::Emitter;
use super::engine::Command;
use super::engine::ModelHandle;
use super::output::Output;
use super::request::{Event, FinishReason, Usage};
use super::runner::{ModelRunner, StepOutput, Target};
use super::scheduler::{Scheduler, SchedulerConfig};
use super::sequence::{SeqId, Sequence};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::loader::LoadedModel;
use crate::tp::TpGroup;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tm_core::Ops;

/// State shared by the engine handle and its thread.
#[derive(Debug)]
pub(crate) struct Shared {
    pub stats: Mutex<EngineStats>,
    /// Requests submitted and not yet started.
    pub queued: AtomicUsize,
    pub accepting: AtomicBool,
    /// Why the engine stopped for good (a tensor-parallel group failed), if it did.
    pub failure: Mutex<Option<String>>,
}

/// What runs the model.
pub(crate) enum Exec {
    /// The whole model on one backend.
    Local { model: Arc<LoadedModel>, ops: Arc<dyn Ops> },
    /// The model on tensor-parallel ranks.
    Tp(Box<TpGroup>),
}

/// Request limits derived from the config and the model.
#[derive(Clone, Debug)]
pub(crate) struct Limits {
    pub max_model_len: usize,
    pub why_max_len: String,
    pub max_queue: usize,
}

impl Limits {
    pub fn new(model: &ModelConfig, c: &EngineConfig) -> Result<Limits> {
        if c.block_size == 0 || c.num_blocks == 0 || c.max_batched_tokens == 0 || c.max_batch_size == 0 {
            return Err(ModelError::InvalidInput(format!(
                "block_size ({}), num_blocks ({}), max_batched_tokens ({}) and max_batch_size ({}) must be positive",
                c.block_size, c.num_blocks, c.max_batched_tokens, c.max_batch_size
            )));
        }
        let context = model.context_length().max(1);
        let cache = c.num_blocks * c.block_size;
        let asked = c.max_model_len.unwrap_or(context);
        let max_model_len = asked.min(context).min(cache);
        if max_model_len < 2 {
            return Err(ModelError::InvalidInput(format!(
                "requests could hold at most {max_model_len} tokens (max_model_len {asked}, context {context}, \
                 KV cache {cache}); at least 2 are needed"
            )));
        }
        let why_max_len = if max_model_len == cache && cache < asked.min(context) {
            format!("the KV cache holds {} blocks of {} tokens", c.num_blocks, c.block_size)
        } else if max_model_len == context {
            format!("the model's context length is {context}")
        } else {
            format!("max_model_len is {asked}")
        };
        Ok(Limits { max_model_len, why_max_len, max_queue: c.max_queue })
    }
}

/// A validated request on its way to the engine thread.
#[derive(Debug)]
pub(crate) struct NewRequest {
    pub seq: Sequence,
    pub tx: Sender<Event>,
    pub stop: Vec<String>,
    pub stop_ids: Vec<u32>,
    pub max_tokens: usize,
    pub skip_special: bool,
}

/// The engine loop's state.
pub(crate) struct Worker {
    model: ModelHandle,
    exec: Exec,
    scheduler: Scheduler,
    runner: ModelRunner,
    emitter: Emitter,
    commands: Receiver<Command>,
    shared: Arc<Shared>,
    limits: Limits,
    deadline: Option<Instant>,
    out: StepOutput,
    stats: EngineStats,
}

impl Worker {
    /// Allocates the cache and workspace (on the caller's thread, so failures surface at start).
    pub fn new(
        model: ModelHandle,
        exec: Exec,
        c: &EngineConfig,
        limits: Limits,
        shared: Arc<Shared>,
        commands: Receiver<Command>,
    ) -> Result<Worker> {
        let cfg = model.config();
        let max_seqs = c.max_batch_size.min(c.max_batched_tokens);
        let runner = match &exec {
            Exec::Local { ops, model } => ModelRunner::new(
                ops.as_ref(),
                cfg,
                c.num_blocks,
                c.block_size,
                c.max_batched_tokens,
                max_seqs,
                c.kv_cache_dtype,
            )?
            .with_int4_scratch(ops.as_ref(), model.model.has_int4())?,
            Exec::Tp(group) => {
                if group.block_size() != c.block_size || group.num_blocks() < c.num_blocks {
                    return Err(ModelError::InvalidInput(format!(
                        "the tensor-parallel ranks hold {} KV blocks of {} tokens; the engine wants {} of {}",
                        group.num_blocks(),
                        group.block_size(),
                        c.num_blocks,
                        c.block_size
                    )));
                }
                ModelRunner::for_tp(cfg, c.block_size, c.max_batched_tokens, max_seqs)
            }
        };
        let blocks = BlockManager::new(c.num_blocks, c.block_size, c.enable_prefix_caching);
        let sc = SchedulerConfig { max_batched_tokens: c.max_batched_tokens, max_batch_size: c.max_batch_size };
        let stats = EngineStats { kv_blocks_total: c.num_blocks, ..Default::default() };
        Ok(Worker {
            scheduler: Scheduler::new(sc, blocks),
            runner,
            model,
            exec,
            emitter: Emitter::default(),
            commands,
            shared,
            limits,
            deadline: None,
            out: StepOutput::default(),
            stats,
        })
    }

    /// The loop; returns when shut down (or when every handle is gone).
    pub fn run(mut self) {
        loop {
            if !self.take_commands() {
                break;
            }
            self.publish();
            if let Some(deadline) = self.deadline {
                if !self.scheduler.has_work() || Instant::now() >= deadline {
                    break;
                }
            }
            if !self.scheduler.has_work() {
                continue;
            }
            if self.failed() {
                break;
            }
            if let Err(panic) = catch_unwind(AssertUnwindSafe(|| self.step())) {
                let msg = panic_message(panic.as_ref());
                tracing::error!("the engine loop panicked: {msg}");
                self.shared.accepting.store(false, Ordering::Release);
                let tok = self.model.tokenizer();
                self.emitter.end_all(tok, FinishReason::Error, &format!("internal error: {msg}"));
                break;
            }
            if !self.scheduler.has_work() {
                // Idle next: hand out what the last step produced now.
                self.flush();
            }
            self.publish();
        }
        self.shared.accepting.store(false, Ordering::Release);
        let ids: Vec<SeqId> = self.scheduler.running().iter().chain(self.scheduler.waiting()).map(|s| s.id).collect();
        for id in ids {
            if let Some(seq) = self.scheduler.remove(id) {
                self.finish(seq, FinishReason::Abort, None);
            }
        }
        self.flush();
        while let Ok(cmd) = self.commands.try_recv() {
            if let Command::Submit(new) = cmd {
                self.shared.queued.fetch_sub(1, Ordering::AcqRel);
                Output::new(new.tx, &[], Vec::new(), Vec::new(), 0, true).finish(
                    self.model.tokenizer(),
                    FinishReason::Abort,
                    Usage { prompt_tokens: new.seq.prompt_len, ..Default::default() },
                    None,
                );
            }
        }
        self.publish();
    }

    /// Handles pending commands, waiting for one when idle; false when every handle is gone.
    fn take_commands(&mut self) -> bool {
        if !self.scheduler.has_work() && self.deadline.is_none() {
            self.flush();
            match self.commands.recv() {
                Ok(cmd) => self.handle(cmd),
                Err(_) => return false,
            }
        }
        while let Ok(cmd) = self.commands.try_recv() {
            self.handle(cmd);
        }
        true
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(new) => {
                let NewRequest { seq, tx, stop, stop_ids, max_tokens, skip_special } = *new;
                let out = Output::new(tx, seq.prompt(), stop, stop_ids, max_tokens, skip_special);
                self.emitter.insert(seq.id, out, seq.prompt_len);
                self.scheduler.add(seq);
            }
            Command::Cancel(id) => {
                if let Some(seq) = self.scheduler.remove(id) {
                    self.finish(seq, FinishReason::Abort, None);
                }
            }
            Command::Shutdown(deadline) => self.deadline = Some(deadline),
        }
    }

    /// Schedules and runs one step, then hands out the sampled tokens.
    fn step(&mut self) {
        let t0 = Instant::now();
        let mut batch = self.scheduler.schedule();
        self.stats.schedule_us += t0.elapsed().as_micros() as u64;
        self.stats.kv_blocks_peak = self.stats.kv_blocks_peak.max(self.scheduler.blocks.num_used());
        self.shared.queued.fetch_sub(batch.admitted_new, Ordering::AcqRel);
        for (seq, msg) in std::mem::take(&mut batch.failed) {
            self.finish(seq, FinishReason::Error, Some(msg));
        }
        if batch.seqs.is_empty() {
            self.flush();
            return;
        }
        let target = match &mut self.exec {
            Exec::Local { model, ops } => Target::Local { model: &model.model, ops: &**ops },
            Exec::Tp(group) => Target::Tp(group),
        };
        let t1 = Instant::now();
        // The last step's output work runs while the device computes this one.
        let (emitter, tok) = (&mut self.emitter, self.model.tokenizer());
        let mut while_running = || emitter.flush(tok);
        let result = self.runner.step(target, self.scheduler.running_mut(), &batch, &mut self.out, &mut while_running);
        let t2 = Instant::now();
        self.stats.model_us += (t2 - t1).as_micros() as u64;
        tracing::debug!(
            target: "tm::steps",
            "step {}: {} sequences, {} tokens; schedule {:.3} ms, model {:.3} ms",
            self.stats.steps,
            batch.seqs.len(),
            batch.num_tokens(),
            (t1 - t0).as_secs_f64() * 1e3,
            (t2 - t1).as_secs_f64() * 1e3
        );
        if let Err(e) = result {
            tracing::error!("a step of {} sequences failed: {e}", batch.seqs.len());
            let group_failure = match &self.exec {
                Exec::Tp(group) => group.failure().map(|why| format!("the tensor-parallel group failed: {why}")),
                Exec::Local { .. } => None,
            };
            if let Some(msg) = &group_failure {
                // The ranks are stopped: the engine stops (said before any request hears of it).
                tracing::error!("{msg}; the engine stops");
                self.shared.accepting.store(false, Ordering::Release);
                if let Ok(mut f) = self.shared.failure.lock() {
                    *f = Some(msg.clone());
                }
            }
            for s in &batch.seqs {
                if let Some(seq) = self.scheduler.remove(s.id) {
                    self.finish(seq, FinishReason::Error, Some(format!("the model step failed: {e}")));
                }
            }
            if let Some(msg) = group_failure {
                // Every request still here fails too.
                let ids: Vec<SeqId> =
                    self.scheduler.running().iter().chain(self.scheduler.waiting()).map(|s| s.id).collect();
                for id in ids {
                    if let Some(seq) = self.scheduler.remove(id) {
                        self.finish(seq, FinishReason::Error, Some(msg.clone()));
                    }
                }
            }
            self.flush();
            return;
        }
        self.stats.steps += 1;
        self.stats.tokens_computed += batch.num_tokens() as u64;
        self.scheduler.postprocess(&batch, &self.out.tokens);
        let mut done = Vec::new();
        for (k, s) in batch.seqs.iter().filter(|s| s.sample).enumerate() {
            let Some(&token) = self.out.tokens.get(k) else { continue };
            let logprobs = self.out.logprobs.get_mut(k).and_then(Option::take);
            let seq = &self.scheduler.running()[s.index];
            let cached = seq.cached_prompt_tokens.unwrap_or(0);
            let mut reason = self.emitter.accept(s.id, token, logprobs, cached);
            if reason.is_none() && self.emitter.is_live(s.id) && seq.len() >= self.limits.max_model_len {
                reason = Some(FinishReason::Length);
            }
            done.extend(reason.map(|r| (s.id, r)));
        }
        for (id, reason) in done {
            if let Some(seq) = self.scheduler.remove(id) {
                self.finish(seq, reason, None);
            }
        }
        // Requests that the last flush ended (stop strings, clients gone): their sequences go now.
        for id in self.emitter.take_ended() {
            if let Some(seq) = self.scheduler.remove(id) {
                self.retire(&seq);
            }
        }
        self.stats.output_us += t2.elapsed().as_micros() as u64;
    }

    /// Ends a removed sequence: counts it and queues its final event.
    fn finish(&mut self, seq: Sequence, reason: FinishReason, error: Option<String>) {
        self.retire(&seq);
        let usage = Usage {
            prompt_tokens: seq.prompt_len,
            completion_tokens: 0, // counted by the output
            cached_prompt_tokens: seq.cached_prompt_tokens.unwrap_or(0),
        };
        self.emitter.finish(seq.id, reason, usage, error);
    }

    /// Counts a sequence removed from the scheduler as finished.
    fn retire(&mut self, seq: &Sequence) {
        if seq.cached_prompt_tokens.is_none() {
            self.shared.queued.fetch_sub(1, Ordering::AcqRel);
        }
        self.stats.requests_finished += 1;
    }

    /// Does the queued output work now.
    fn flush(&mut self) {
        self.emitter.flush(self.model.tokenizer());
    }

    /// Whether the engine stopped for good (see [`Shared::failure`]).
    fn failed(&self) -> bool {
        self.shared.failure.lock().map_or(true, |f| f.is_some())
    }

    /// Copies the counters to the shared snapshot.
    fn publish(&mut self) {
        let (s, b) = (&mut self.stats, &self.scheduler.blocks);
        s.running = self.scheduler.num_running();
        s.waiting = self.scheduler.num_waiting();
        s.kv_blocks_used = b.num_used();
        s.kv_blocks_cached = b.num_cached();
        s.kv_blocks_peak = s.kv_blocks_peak.max(s.kv_blocks_used);
        s.kv_blocks_allocated = b.num_allocations();
        let c = self.scheduler.counters();
        s.prefix_cache_queried_tokens = c.prefix_queried_tokens;
        s.prefix_cache_hit_tokens = c.prefix_hit_tokens;
        s.preemptions = c.preemptions;
        if let Ok(mut shared) = self.shared.stats.lock() {
            *shared = *s;
        }
    }
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_default()
}
