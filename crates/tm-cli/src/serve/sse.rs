//! Server-sent events for `stream: true`: one `data: {chunk}` per piece of text, a chunk with
//! each choice's finish reason, the usage chunk when asked for, then `data: [DONE]`.

use super::bridge::Events;
use super::error::ApiError;
use super::handlers::{chat_logprobs, completion_logprobs, usage_json};
use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use tm_model::engine::{Engine, Event, FinishReason, TokenLogprobs};

/// Which endpoint's chunk format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `chat.completion.chunk`.
    Chat,
    /// `text_completion`.
    Completion,
}

/// What a stream needs to know.
#[derive(Debug)]
pub struct StreamSetup {
    /// The chunk format.
    pub format: Format,
    /// The response id.
    pub id: String,
    /// Creation time (Unix seconds).
    pub created: u64,
    /// The served model name.
    pub model: String,
    /// Choices in all.
    pub n: usize,
    /// Choices per prompt (prompt tokens are counted once per prompt).
    pub per_prompt: usize,
    /// Send a usage chunk at the end.
    pub include_usage: bool,
    /// Completions with `echo`: each prompt's text, sent first.
    pub echo: Vec<String>,
}

/// The state of one event stream.
struct SseState {
    engine: Arc<Engine>,
    rx: Events,
    setup: StreamSetup,
    pending: VecDeque<Bytes>,
    finished: usize,
    prompt_tokens: usize,
    completion_tokens: usize,
    /// Bytes of text sent per choice (completions' `text_offset`).
    offsets: Vec<usize>,
    ended: bool,
}

impl SseState {
    fn push(&mut self, v: &Value) {
        self.pending.push_back(Bytes::from(format!("data: {v}\n\n")));
    }

    /// A chunk for choice `i`.
    fn chunk(&mut self, i: usize, text: Option<&str>, lps: Option<&TokenLogprobs>, finish: Option<&str>) {
        let tok = self.engine.model().tokenizer();
        let s = &self.setup;
        let choice = match s.format {
            Format::Chat => {
                let delta = match text {
                    Some(t) => json!({"content": t}),
                    None => json!({}),
                };
                json!({
                    "index": i,
                    "delta": delta,
                    "logprobs": lps.map(|l| chat_logprobs(tok, std::slice::from_ref(l))),
                    "finish_reason": finish,
                })
            }
            Format::Completion => {
                let offset = self.offsets.get(i).copied().unwrap_or(0);
                let v = json!({
                    "index": i,
                    "text": text.unwrap_or(""),
                    "logprobs": lps.map(|l| completion_logprobs(tok, std::slice::from_ref(l), offset)),
                    "finish_reason": finish,
                });
                if let Some(o) = self.offsets.get_mut(i) {
                    *o += text.map_or(0, str::len);
                }
                v
            }
        };
        let object = if s.format == Format::Chat { "chat.completion.chunk" } else { "text_completion" };
        let mut v = json!({"id": s.id, "object": object, "created": s.created, "model": s.model, "choices": [choice]});
        if s.include_usage {
            v["usage"] = Value::Null;
        }
        self.push(&v);
    }

    /// The first chunks: the assistant role (chat) or the echoed prompts (completions).
    fn start(&mut self) {
        for i in 0..self.setup.n {
            match self.setup.format {
                Format::Chat => {
                    let s = &self.setup;
                    let mut v = json!({
                        "id": s.id, "object": "chat.completion.chunk", "created": s.created, "model": s.model,
                        "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null,
                                     "finish_reason": null}],
                    });
                    if s.include_usage {
                        v["usage"] = Value::Null;
                    }
                    self.push(&v);
                }
                Format::Completion => {
                    if let Some(echo) = self.setup.echo.get(i / self.setup.per_prompt.max(1)).cloned() {
                        if !echo.is_empty() {
                            self.chunk(i, Some(&echo), None, None);
                        }
                    }
                }
            }
        }
    }

    fn on_event(&mut self, i: usize, event: Event) {
        match event {
            Event::Token(t) => {
                if !t.text.is_empty() || t.logprobs.is_some() {
                    self.chunk(i, Some(&t.text), t.logprobs.as_ref(), None);
                }
            }
            Event::Finished(f) => {
                if !f.text.is_empty() {
                    self.chunk(i, Some(&f.text), None, None);
                }
                if f.reason == FinishReason::Error {
                    let e = ApiError::internal(f.error.unwrap_or_else(|| "generation failed".into()));
                    self.push(&e.body());
                }
                self.chunk(i, None, None, Some(f.reason.as_str()));
                if i.is_multiple_of(self.setup.per_prompt.max(1)) {
                    self.prompt_tokens += f.usage.prompt_tokens;
                }
                self.completion_tokens += f.usage.completion_tokens;
                self.finished += 1;
                if self.finished >= self.setup.n {
                    self.end();
                }
            }
        }
    }

    fn end(&mut self) {
        if self.ended {
            return;
        }
        self.ended = true;
        if self.setup.include_usage {
            let s = &self.setup;
            let object = if s.format == Format::Chat { "chat.completion.chunk" } else { "text_completion" };
            let v = json!({
                "id": s.id, "object": object, "created": s.created, "model": s.model, "choices": [],
                "usage": usage_json(self.prompt_tokens, self.completion_tokens),
            });
            self.push(&v);
        }
        self.pending.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
    }
}

/// The streaming response for the events in `rx`. Dropping the body (the client went away)
/// drops `rx`, which cancels the engine requests.
pub fn sse_response(engine: Arc<Engine>, rx: Events, setup: StreamSetup) -> Response {
    let offsets = vec![0; setup.n];
    let mut state = SseState {
        engine,
        rx,
        setup,
        pending: VecDeque::new(),
        finished: 0,
        prompt_tokens: 0,
        completion_tokens: 0,
        offsets,
        ended: false,
    };
    state.start();
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(b) = s.pending.pop_front() {
                return Some((Ok::<Bytes, Infallible>(b), s));
            }
            if s.ended {
                return None;
            }
            match s.rx.recv().await {
                Some((i, event)) => s.on_event(i, event),
                None => {
                    let e = ApiError::internal("the engine stopped before the request finished");
                    s.push(&e.body());
                    s.end();
                }
            }
        }
    });
    ([(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")], Body::from_stream(stream))
        .into_response()
}
