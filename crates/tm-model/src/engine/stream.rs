//! The caller's end of a request: a stream of [`Event`]s. Dropping it cancels the request.

use super::engine::Command;
use super::request::{Event, FinishReason, Finished, TokenLogprobs, Usage};
use super::sequence::SeqId;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::time::Duration;

/// Events of one request, ending with [`Event::Finished`]. Blocking; iterate it, or call
/// [`RequestStream::recv`]. Dropping it before the end cancels the request and frees its blocks.
#[derive(Debug)]
pub struct RequestStream {
    id: SeqId,
    rx: Receiver<Event>,
    commands: Sender<Command>,
    done: bool,
}

/// A whole request's output, collected by [`RequestStream::wait`].
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    /// Generated token ids (stop tokens excluded).
    pub token_ids: Vec<u32>,
    /// The text (stop string excluded).
    pub text: String,
    /// Log-probabilities per token, when asked for.
    pub logprobs: Vec<TokenLogprobs>,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Token counts.
    pub usage: Usage,
    /// The error, for [`FinishReason::Error`].
    pub error: Option<String>,
}

impl RequestStream {
    pub(crate) fn new(id: SeqId, rx: Receiver<Event>, commands: Sender<Command>) -> Self {
        RequestStream { id, rx, commands, done: false }
    }

    /// The request's id (also its arrival order).
    pub fn id(&self) -> SeqId {
        self.id
    }

    /// The next event, waiting for it; `None` after [`Event::Finished`].
    pub fn recv(&mut self) -> Option<Event> {
        if self.done {
            return None;
        }
        let event = self.rx.recv().unwrap_or_else(|_| stopped());
        self.done = matches!(event, Event::Finished(_));
        Some(event)
    }

    /// Like [`RequestStream::recv`], giving up after `timeout` with
    /// [`RecvTimeoutError::Timeout`].
    pub fn recv_timeout(&mut self, timeout: Duration) -> Result<Option<Event>, RecvTimeoutError> {
        if self.done {
            return Ok(None);
        }
        let event = match self.rx.recv_timeout(timeout) {
            Ok(e) => e,
            Err(RecvTimeoutError::Timeout) => return Err(RecvTimeoutError::Timeout),
            Err(RecvTimeoutError::Disconnected) => stopped(),
        };
        self.done = matches!(event, Event::Finished(_));
        Ok(Some(event))
    }

    /// Waits for the end and returns everything generated.
    pub fn wait(mut self) -> Completion {
        let mut c = Completion {
            token_ids: Vec::new(),
            text: String::new(),
            logprobs: Vec::new(),
            finish_reason: FinishReason::Error,
            usage: Usage::default(),
            error: None,
        };
        while let Some(event) = self.recv() {
            match event {
                Event::Token(t) => {
                    c.token_ids.push(t.id);
                    c.text.push_str(&t.text);
                    c.logprobs.extend(t.logprobs);
                }
                Event::Finished(f) => {
                    c.text.push_str(&f.text);
                    c.finish_reason = f.reason;
                    c.usage = f.usage;
                    c.error = f.error;
                }
            }
        }
        c
    }
}

/// The final event of a stream whose engine went away without finishing it.
fn stopped() -> Event {
    Event::Finished(Finished {
        reason: FinishReason::Error,
        text: String::new(),
        usage: Usage::default(),
        error: Some("the engine stopped before the request finished".into()),
    })
}

impl Iterator for RequestStream {
    type Item = Event;
    fn next(&mut self) -> Option<Event> {
        self.recv()
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.commands.send(Command::Cancel(self.id));
        }
    }
}
