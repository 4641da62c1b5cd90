//! The engine handle: starts the loop thread, validates and submits requests, reports stats,
//! shuts down.

use super::config::{EngineConfig, EngineStats};
use super::request::{Prompt, Request, MAX_LOGPROBS};
use super::sequence::{SeqId, Sequence};
use super::stream::RequestStream;
use super::worker::{Limits, NewRequest, Shared, Worker};
use crate::error::{ModelError, Result};
use crate::loader::LoadedModel;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tm_core::Ops;

/// Messages to the engine thread.
#[derive(Debug)]
pub(crate) enum Command {
    /// A validated request.
    Submit(Box<NewRequest>),
    /// Cancel a request (its stream was dropped).
    Cancel(SeqId),
    /// Stop taking requests; finish those in flight until the deadline, then abort the rest.
    Shutdown(Instant),
}

/// A running engine: many requests at once, continuous batching on its own thread.
pub struct Engine {
    model: Arc<LoadedModel>,
    commands: Sender<Command>,
    shared: Arc<Shared>,
    limits: Limits,
    next_id: AtomicU64,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("model", &self.model.name).field("limits", &self.limits).finish_non_exhaustive()
    }
}

impl Engine {
    /// Allocates the KV cache and workspace on `ops` and starts the engine thread.
    pub fn start(model: Arc<LoadedModel>, ops: Arc<dyn Ops>, config: EngineConfig) -> Result<Engine> {
        let limits = Limits::new(&model.model.config, &config)?;
        let shared = Arc::new(Shared {
            stats: Mutex::new(EngineStats { kv_blocks_total: config.num_blocks, ..Default::default() }),
            queued: AtomicUsize::new(0),
            accepting: AtomicBool::new(true),
        });
        let (tx, rx) = channel();
        let worker = Worker::new(Arc::clone(&model), ops, &config, limits.clone(), Arc::clone(&shared), rx)?;
        let thread = std::thread::Builder::new()
            .name("tm-engine".into())
            .spawn(move || worker.run())
            .map_err(|e| ModelError::InvalidInput(format!("cannot start the engine thread: {e}")))?;
        Ok(Engine { model, commands: tx, shared, limits, next_id: AtomicU64::new(0), thread: Some(thread) })
    }

    /// The model served.
    pub fn model(&self) -> &Arc<LoadedModel> {
        &self.model
    }

    /// Longest sequence (prompt plus output) a request may reach.
    pub fn max_model_len(&self) -> usize {
        self.limits.max_model_len
    }

    /// Validates `request` and queues it. Errors (bad parameters, a prompt that can never fit,
    /// a full queue, a stopped engine) concern this request only.
    pub fn submit(&self, request: Request) -> Result<RequestStream> {
        if !self.shared.accepting.load(Ordering::Acquire) {
            return Err(ModelError::Unavailable("the engine is shutting down and takes no new requests".into()));
        }
        let prompt = self.validate(&request)?;
        let max_queue = self.limits.max_queue;
        let queued = &self.shared.queued;
        if queued.fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| (q < max_queue).then_some(q + 1)).is_err() {
            return Err(ModelError::Overloaded(format!(
                "the engine is overloaded: {max_queue} requests are already waiting (max_queue); try again later"
            )));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = channel();
        let tok = &self.model.tokenizer;
        let mut stop_ids = request.stop_token_ids.clone();
        if !request.ignore_eos {
            stop_ids.extend_from_slice(tok.eos_ids());
        }
        let seq = Sequence::new(id, prompt, request.sampling.clone(), request.logprobs);
        let new = NewRequest {
            seq,
            tx,
            stop: request.stop,
            stop_ids,
            max_tokens: request.max_tokens,
            skip_special: request.skip_special_tokens,
        };
        if self.commands.send(Command::Submit(Box::new(new))).is_err() {
            queued.fetch_sub(1, Ordering::AcqRel);
            return Err(ModelError::Unavailable("the engine has stopped".into()));
        }
        Ok(RequestStream::new(id, rx, self.commands.clone()))
    }

    /// The prompt's tokens, once every field of `request` is checked.
    fn validate(&self, request: &Request) -> Result<Vec<u32>> {
        request.sampling.validate()?;
        if request.max_tokens == 0 {
            return Err(ModelError::InvalidInput("max_tokens must be at least 1".into()));
        }
        if let Some(n) = request.logprobs.filter(|&n| n > MAX_LOGPROBS) {
            return Err(ModelError::InvalidInput(format!("logprobs = {n} is out of range (at most {MAX_LOGPROBS})")));
        }
        let prompt = match &request.prompt {
            Prompt::Text(text) => self.model.tokenizer.encode(text, true)?,
            Prompt::Tokens(ids) => ids.clone(),
        };
        if prompt.is_empty() {
            return Err(ModelError::InvalidInput("the prompt is empty".into()));
        }
        let vocab = self.model.model.config.vocab_size;
        if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(ModelError::InvalidInput(format!(
                "prompt token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        let max = self.limits.max_model_len;
        if prompt.len() >= max {
            return Err(ModelError::ContextLength(format!(
                "the prompt has {} tokens but a request may hold at most {max} (prompt plus at least one output \
                 token; {}); shorten the prompt",
                prompt.len(),
                self.limits.why_max_len
            )));
        }
        Ok(prompt)
    }

    /// Counters for monitoring (updated after every step).
    pub fn stats(&self) -> EngineStats {
        let mut s = self.shared.stats.lock().map(|s| *s).unwrap_or_default();
        s.queued = self.shared.queued.load(Ordering::Acquire);
        s
    }

    /// Stops taking requests, lets those in flight finish for up to `timeout`, aborts the rest
    /// (their streams end with [`super::FinishReason::Abort`]) and joins the thread.
    pub fn shutdown(mut self, timeout: Duration) -> Result<()> {
        self.stop(timeout)
    }

    fn stop(&mut self, timeout: Duration) -> Result<()> {
        self.shared.accepting.store(false, Ordering::Release);
        let _ = self.commands.send(Command::Shutdown(Instant::now() + timeout));
        match self.thread.take().map(JoinHandle::join) {
            Some(Err(_)) => Err(ModelError::InvalidInput("the engine thread panicked".into())),
            _ => Ok(()),
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.stop(Duration::ZERO);
    }
}
