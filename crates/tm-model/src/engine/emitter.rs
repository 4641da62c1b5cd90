//! The requests' outputs, and the output work the engine thread defers so that it runs while the
//! device computes the next step.
//!
//! After a step the engine only *accepts* each sampled token ([`Emitter::accept`]: counting it,
//! stop tokens, `max_tokens` — no text), which is enough to schedule the next step. Detokenizing,
//! matching stop strings and sending events is queued and done by [`Emitter::flush`], which the
//! engine calls once the next step's forward pass is queued on the device (and whenever it goes
//! idle). Events of a request keep their order: its tokens, then its end.
//!
//! A request that a stop string (or a client that went away) ends during a flush is finished
//! there; its sequence has usually been scheduled once more by then, so the engine removes it
//! after that step ([`Emitter::take_ended`]) and drops its extra token.

use super::output::Output;
use super::request::{FinishReason, TokenLogprobs, Usage};
use super::sequence::SeqId;
use crate::tokenizer::Tokenizer;
use std::collections::HashMap;

/// Output work waiting for the next flush.
#[derive(Debug)]
enum Pending {
    /// Emit an accepted token.
    Token { id: SeqId, token: u32, logprobs: Option<TokenLogprobs> },
    /// Send the request's final event.
    Finish { id: SeqId, reason: FinishReason, usage: Usage, error: Option<String> },
}

/// The output side of every live request, and the work queued for them.
#[derive(Debug, Default)]
pub(crate) struct Emitter {
    outputs: HashMap<SeqId, Output>,
    queue: Vec<Pending>,
    /// Usage of requests, kept for those a flush ends (prompt and cached-prompt tokens).
    usage: HashMap<SeqId, Usage>,
    /// Requests a flush ended whose sequences the engine has yet to remove.
    ended: Vec<SeqId>,
}

impl Emitter {
    /// Starts the output of a request with `prompt_tokens` prompt tokens.
    pub fn insert(&mut self, id: SeqId, out: Output, prompt_tokens: usize) {
        self.outputs.insert(id, out);
        self.usage.insert(id, Usage { prompt_tokens, ..Default::default() });
    }

    /// Whether the request still has an output (it has not ended).
    pub fn is_live(&self, id: SeqId) -> bool {
        self.outputs.contains_key(&id)
    }

    /// Counts `token` for request `id` (whose prompt had `cached_prompt_tokens` found in the
    /// prefix cache) and queues its emission; returns why the request ends with it, or `None`
    /// when it goes on. A request that already ended (see the module docs) is skipped: `None`.
    pub fn accept(
        &mut self,
        id: SeqId,
        token: u32,
        logprobs: Option<TokenLogprobs>,
        cached_prompt_tokens: usize,
    ) -> Option<FinishReason> {
        let out = self.outputs.get_mut(&id)?;
        if let Some(u) = self.usage.get_mut(&id) {
            u.cached_prompt_tokens = cached_prompt_tokens;
        }
        let reason = out.accept(token);
        if reason != Some(FinishReason::Stop) {
            self.queue.push(Pending::Token { id, token, logprobs });
        }
        reason
    }

    /// Queues the end of request `id` (after its queued tokens).
    pub fn finish(&mut self, id: SeqId, reason: FinishReason, usage: Usage, error: Option<String>) {
        self.queue.push(Pending::Finish { id, reason, usage, error });
    }

    /// Does the queued work, in order.
    pub fn flush(&mut self, tok: &Tokenizer) {
        for p in std::mem::take(&mut self.queue) {
            match p {
                Pending::Token { id, token, logprobs } => {
                    let Some(out) = self.outputs.get_mut(&id) else { continue };
                    if let Some(reason) = out.emit(tok, token, logprobs) {
                        self.end(tok, id, reason, None);
                        self.ended.push(id);
                    }
                }
                Pending::Finish { id, reason, usage, error } => {
                    if let Some(out) = self.outputs.remove(&id) {
                        self.usage.remove(&id);
                        let usage = Usage { completion_tokens: out.generated(), ..usage };
                        out.finish(tok, reason, usage, error);
                    }
                }
            }
        }
    }

    /// Requests ended by a flush since the last call; the engine removes their sequences.
    pub fn take_ended(&mut self) -> Vec<SeqId> {
        std::mem::take(&mut self.ended)
    }

    /// Ends every request now with `reason` and `error`, dropping queued work (after a panic).
    pub fn end_all(&mut self, tok: &Tokenizer, reason: FinishReason, error: &str) {
        self.queue.clear();
        let ids: Vec<SeqId> = self.outputs.keys().copied().collect();
        for id in ids {
            self.end(tok, id, reason, Some(error.to_string()));
        }
    }

    /// Sends the final event of request `id` now.
    fn end(&mut self, tok: &Tokenizer, id: SeqId, reason: FinishReason, error: Option<String>) {
        if let Some(out) = self.outputs.remove(&id) {
            let usage = self.usage.remove(&id).unwrap_or_default();
            let usage = Usage { completion_tokens: out.generated(), ..usage };
            out.finish(tok, reason, usage, error);
        }
    }
}
