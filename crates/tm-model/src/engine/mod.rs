//! The serving engine: many requests at once over one model, in the design of nano-vllm.
//!
//! - [`block_manager`]: reference-counted KV blocks, copy-on-write, and the prefix cache (full
//!   blocks keyed by a hash chained over everything before them, evicted least recently used).
//! - [`sequence`]: one request's tokens, progress and blocks.
//! - [`scheduler`]: continuous batching: decode tokens and prefill chunks under a token budget,
//!   FCFS admission, preemption of the newest sequence when blocks run out.
//! - [`runner`]: the single boundary to the model: a [`scheduler::Batch`] becomes a flat
//!   [`crate::llama::StepInput`], and one `Ops::sample` call samples every sequence.
//! - [`Engine`]: the loop on its own thread; [`Engine::submit`] returns a [`RequestStream`] of
//!   [`Event`]s (token ids, UTF-8-safe text deltas, logprobs, then the finish reason and usage).
//!
//! The first four are plain host code, tested without a model.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use tm_model::engine::{Engine, EngineConfig, Request};
//! # fn demo(model: Arc<tm_model::loader::LoadedModel>, ops: Arc<dyn tm_core::Ops>) -> tm_model::Result<()> {
//! let engine = Engine::start(model, ops, EngineConfig { num_blocks: 512, ..Default::default() })?;
//! let done = engine.submit(Request::text("The capital of France is").with_max_tokens(16))?.wait();
//! println!("{} ({:?})", done.text, done.finish_reason);
//! # Ok(()) }
//! ```

pub mod block_manager;
mod config;
mod emitter;
#[allow(clippy::module_inception)]
mod engine;
mod output;
mod request;
pub mod runner;
pub mod scheduler;
pub mod sequence;
mod stream;
mod worker;

pub use config::{EngineConfig, EngineStats};
pub use engine::{Engine, ModelHandle, TpModelInfo};
pub use request::{Event, FinishReason, Finished, Prompt, Request, TokenEvent, TokenLogprobs, Usage, MAX_LOGPROBS};
pub use stream::{Completion, RequestStream};
