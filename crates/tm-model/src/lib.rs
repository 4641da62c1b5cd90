//! tm-model: everything between a checkpoint on disk and generated text.
//!
//! - [`config`]: model hyper-parameters from `config.json` (or GGUF metadata).
//! - [`weights`]: memory-mapped safetensors (single or sharded) with tensor lookup by name.
//! - [`hf_quant`]: AWQ and GPTQ int4 checkpoints (quantization config, repacking at load).
//! - [`gguf`]: the GGUF reader (spec versions 2 and 3).
//! - [`tokenizer`]: tokenizers-crate tokenizer, stop tokens and incremental detokenization.
//! - [`chat_template`]: Hugging Face chat templates rendered with minijinja.
//! - [`llama`]: the Llama-family graph (Llama, Mistral, Qwen2/3, InternLM2) over `tm_core::Ops`.
//! - [`kv_cache`]: paged KV-cache storage and block tables.
//! - [`generate`]: prefill/decode loop with sampling for one sequence.
//! - [`default_model`]: fetching and caching the built-in default model.
//! - [`loader`]: opens a model directory or `.gguf` file into a ready model.
//! - [`plan`]: the memory plan: weights, workspace and KV blocks sized before anything is allocated.
//! - [`engine`]: the serving engine: paged KV blocks with prefix caching, continuous batching, streams.
//! - [`tp`]: tensor parallelism: one thread per rank, each with its own backend and shard, in lockstep.

pub mod chat_template;
pub mod config;
pub mod default_model;
pub mod engine;
pub mod error;
pub mod generate;
pub mod gguf;
pub mod hf_quant;
pub mod kv_cache;
pub mod llama;
pub mod loader;
pub mod plan;
pub mod tokenizer;
pub mod tp;
pub mod weights;

pub use error::{ModelError, Result};
