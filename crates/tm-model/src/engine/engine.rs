//! The engine handle: starts the loop thread, validates and submits requests, reports stats,
//! shuts down.

use super::config::{EngineConfig, EngineStats};
use super::request::{Prompt, Request, MAX_LOGPROBS};
use super::sequence::{SeqId, Sequence};
use super::stream::RequestStream;
use super::worker::{Exec, Limits, NewRequest, Shared, Worker};
use crate::chat_template::ChatTemplate;
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::loader::LoadedModel;
use crate::tokenizer::Tokenizer;
use crate::tp::TpGroup;
use std::path::PathBuf;
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

/// What an engine on tensor-parallel ranks knows of its model (the weights are on the ranks).
pub struct TpModelInfo {
    /// Where it came from.
    pub path: PathBuf,
    /// A short name (directory or file stem).
    pub name: String,
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template.
    pub template: ChatTemplate,
    /// The whole model's hyper-parameters.
    pub config: ModelConfig,
}

/// The model an engine serves.
#[derive(Clone)]
pub enum ModelHandle {
    /// Loaded whole on one backend.
    Local(Arc<LoadedModel>),
    /// Split over tensor-parallel ranks.
    Tp(Arc<TpModelInfo>),
}

impl ModelHandle {
    /// A short name (directory or file stem).
    pub fn name(&self) -> &str {
        match self {
            ModelHandle::Local(m) => &m.name,
            ModelHandle::Tp(m) => &m.name,
        }
    }
    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        match self {
            ModelHandle::Local(m) => &m.tokenizer,
            ModelHandle::Tp(m) => &m.tokenizer,
        }
    }
    /// The chat template.
    pub fn template(&self) -> &ChatTemplate {
        match self {
            ModelHandle::Local(m) => &m.template,
            ModelHandle::Tp(m) => &m.template,
        }
    }
    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        match self {
            ModelHandle::Local(m) => &m.model.config,
            ModelHandle::Tp(m) => &m.config,
        }
    }
}

/// A running engine: many requests at once, continuous batching on its own thread.
pub struct Engine {
    model: ModelHandle,
    commands: Sender<Command>,
    shared: Arc<Shared>,
    limits: Limits,
    next_id: AtomicU64,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("model", &self.model.name())
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// Allocates the KV cache and workspace on `ops` and starts the engine thread.
    pub fn start(model: Arc<LoadedModel>, ops: Arc<dyn Ops>, config: EngineConfig) -> Result<Engine> {
        let exec = Exec::Local { model: Arc::clone(&model), ops };
        Self::start_exec(ModelHandle::Local(model), exec, config)
    }

    /// Starts the engine thread over a model split on tensor-parallel ranks. The group's KV
    /// cache must have the engine's block size and at least `config.num_blocks` blocks. If the
    /// group fails (a rank stalls past its deadline or dies), every request in flight fails with
    /// the group's error, the engine stops taking requests, and [`Engine::failure`] says why.
    pub fn start_tp(info: Arc<TpModelInfo>, group: TpGroup, config: EngineConfig) -> Result<Engine> {
        Self::start_exec(ModelHandle::Tp(info), Exec::Tp(Box::new(group)), config)
    }

    fn start_exec(model: ModelHandle, exec: Exec, config: EngineConfig) -> Result<Engine> {
        let limits = Limits::new(model.config(), &config)?;
        let shared = Arc::new(Shared {
            stats: Mutex::new(EngineStats { kv_blocks_total: config.num_blocks, ..Default::default() }),
            queued: AtomicUsize::new(0),
            accepting: AtomicBool::new(true),
            failure: Mutex::new(None),
        });
        let (tx, rx) = channel();
        let worker = Worker::new(model.clone(), exec, &config, limits.clone(), Arc::clone(&shared), rx)?;
        let thread = std::thread::Builder::new()
            .name("tm-engine".into())
            .spawn(move || worker.run())
            .map_err(|e| ModelError::InvalidInput(format!("cannot start the engine thread: {e}")))?;
        Ok(Engine { model, commands: tx, shared, limits, next_id: AtomicU64::new(0), thread: Some(thread) })
    }

    /// The model served.
    pub fn model(&self) -> &ModelHandle {
        &self.model
    }

    /// Why the engine stopped for good (its tensor-parallel group failed), if it did; a server
    /// reports itself unhealthy then.
    pub fn failure(&self) -> Option<String> {
        self.shared.failure.lock().map_or_else(|_| Some("the engine state is poisoned".into()), |f| f.clone())
    }

    /// Longest sequence (prompt plus output) a request may reach.
    pub fn max_model_len(&self) -> usize {
        self.limits.max_model_len
    }

    /// The most requests that may wait for their first step at once (`max_queue`).
    pub fn max_queue(&self) -> usize {
        self.limits.max_queue
    }

    /// Validates `request` and queues it. Errors (bad parameters, a prompt that can never fit,
    /// a full queue, a stopped engine) concern this request only.
    pub fn submit(&self, request: Request) -> Result<RequestStream> {
        if !self.shared.accepting.load(Ordering::Acquire) {
            if let Some(why) = self.failure() {
                return Err(ModelError::Unavailable(format!("the engine has stopped: {why}")));
            }
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
        let tok = self.model.tokenizer();
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
            Prompt::Text(text) => self.model.tokenizer().encode(text, true)?,
            Prompt::Tokens(ids) => ids.clone(),
        };
        if prompt.is_empty() {
            return Err(ModelError::InvalidInput("the prompt is empty".into()));
        }
        let vocab = self.model.config().vocab_size;
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
