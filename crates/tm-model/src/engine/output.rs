//! Per-request output: detokenization, stop tokens, stop strings (never leaking a partial
//! match), `max_tokens`, and the events sent to the request's stream.

use super::request::{Event, FinishReason, Finished, TokenEvent, TokenLogprobs, Usage};
use crate::tokenizer::{IncrementalDecoder, Tokenizer};
use std::sync::mpsc::Sender;

/// The output side of one request, owned by the engine thread.
#[derive(Debug)]
pub(crate) struct Output {
    tx: Sender<Event>,
    decoder: IncrementalDecoder,
    stops: Vec<String>,
    stop_ids: Vec<u32>,
    max_tokens: usize,
    /// Decoded text not yet sent (it may begin a stop string).
    held: String,
    generated: usize,
    /// Set once a stop string matched: the rest of the text is dropped.
    stopped_by_string: bool,
    /// A failure found while handling output.
    error: Option<String>,
}

impl Output {
    /// Output for a request whose text follows `prompt`: events go to `tx`; `stop_ids` already
    /// include the end-of-sequence ids unless the request ignores them.
    pub fn new(
        tx: Sender<Event>,
        prompt: &[u32],
        stops: Vec<String>,
        stop_ids: Vec<u32>,
        max_tokens: usize,
        skip_special: bool,
    ) -> Self {
        let stops = stops.into_iter().filter(|s| !s.is_empty()).collect();
        Output {
            tx,
            decoder: IncrementalDecoder::with_prompt(prompt, skip_special),
            stops,
            stop_ids,
            max_tokens,
            held: String::new(),
            generated: 0,
            stopped_by_string: false,
            error: None,
        }
    }

    /// Tokens generated so far (stop tokens included).
    pub fn generated(&self) -> usize {
        self.generated
    }

    /// Counts a sampled token and returns why the request ends with it, from what needs no
    /// text: a stop token (which is not emitted) or `max_tokens` (reached with this token, which
    /// is still emitted). Stop strings are found by [`Output::emit`].
    pub fn accept(&mut self, id: u32) -> Option<FinishReason> {
        self.generated += 1;
        if self.stop_ids.contains(&id) {
            Some(FinishReason::Stop)
        } else if self.generated >= self.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        }
    }

    /// Detokenizes an accepted token (not a stop token) and sends its text, holding back what
    /// may begin a stop string; returns why the request ends, if it does: a stop string, a
    /// client that went away, or a token that cannot be detokenized.
    pub fn emit(&mut self, tok: &Tokenizer, id: u32, logprobs: Option<TokenLogprobs>) -> Option<FinishReason> {
        let piece = match self.decoder.push(tok, id) {
            Ok(p) => p,
            Err(e) => {
                self.error = Some(format!("detokenizing token {id}: {e}"));
                return Some(FinishReason::Error);
            }
        };
        let mut finish = None;
        let text = if self.stops.is_empty() {
            piece
        } else {
            self.held.push_str(&piece);
            if let Some(at) = find_stop(&self.held, &self.stops) {
                self.held.truncate(at);
                self.stopped_by_string = true;
                finish = Some(FinishReason::Stop);
                std::mem::take(&mut self.held)
            } else {
                let keep = held_back(&self.held, &self.stops);
                let rest = self.held.split_off(self.held.len() - keep);
                std::mem::replace(&mut self.held, rest)
            }
        };
        if self.tx.send(Event::Token(TokenEvent { id, text, logprobs })).is_err() {
            return Some(FinishReason::Abort);
        }
        finish
    }

    /// Sends the final event, with any held-back text unless a stop string ended the request.
    pub fn finish(mut self, tok: &Tokenizer, reason: FinishReason, usage: Usage, error: Option<String>) {
        let error = error.or(self.error.take());
        let mut text = String::new();
        if !self.stopped_by_string && reason != FinishReason::Error {
            text = std::mem::take(&mut self.held);
            if let Ok(rest) = self.decoder.finish(tok) {
                text.push_str(&rest);
            }
            if let Some(at) = find_stop(&text, &self.stops) {
                text.truncate(at);
            }
        }
        let _ = self.tx.send(Event::Finished(Finished { reason, text, usage, error }));
    }
}

/// Byte offset of the earliest stop-string match in `text`.
pub(crate) fn find_stop(text: &str, stops: &[String]) -> Option<usize> {
    stops.iter().filter_map(|s| text.find(s.as_str())).min()
}

/// How many bytes at the end of `text` could be the beginning of a stop string (and so must
/// not be released yet).
pub(crate) fn held_back(text: &str, stops: &[String]) -> usize {
    let mut keep = 0;
    for s in stops {
        for k in (keep + 1..s.len().min(text.len() + 1)).rev() {
            let start = text.len() - k;
            if text.is_char_boundary(start) && s.is_char_boundary(k) && text[start..] == s[..k] {
                keep = k;
                break;
            }
        }
    }
    keep
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn holds_back_possible_stop_prefixes() {
        let s = stops(&["</end>", "STOP"]);
        assert_eq!(held_back("hello </e", &s), 3);
        assert_eq!(held_back("hello ST", &s), 2);
        assert_eq!(held_back("hello", &s), 0);
        assert_eq!(held_back("<", &s), 1);
        assert_eq!(find_stop("a STOP b </end>", &s), Some(2));
        assert_eq!(held_back("é", &stops(&["éa"])), 2);
    }
}
