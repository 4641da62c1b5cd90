//! From the engine's blocking streams to async: each request is submitted and pumped on a
//! blocking thread that forwards its events to a tokio channel. When the receiver is gone (the
//! client disconnected, the handler was dropped) the pump drops the engine stream, which
//! cancels the request and frees its KV blocks.

use super::error::ApiError;
use super::metrics::Metrics;
use std::sync::mpsc::RecvTimeoutError;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tm_model::engine::{Engine, Event, Request, RequestStream};
use tokio::sync::{mpsc, oneshot};

/// How often a pump waiting for the engine checks whether its receiver is still there.
const POLL: Duration = Duration::from_millis(50);

/// Events of several engine requests, tagged with the request's index.
pub type Events = mpsc::UnboundedReceiver<(usize, Event)>;

/// Submits every request; once all are accepted, returns their events (tagged with their index
/// in `requests`). If one is refused, the others are cancelled and its error is returned.
pub async fn submit_all(
    engine: &Arc<Engine>,
    metrics: &Arc<Metrics>,
    requests: Vec<Request>,
    prompt_param: &'static str,
) -> Result<Events, ApiError> {
    let (tx, rx) = mpsc::unbounded_channel();
    let mut accepted = Vec::with_capacity(requests.len());
    for (index, request) in requests.into_iter().enumerate() {
        let (ready_tx, ready_rx) = oneshot::channel();
        let engine = Arc::clone(engine);
        let metrics = Arc::clone(metrics);
        let tx = tx.clone();
        tokio::task::spawn_blocking(move || {
            let t0 = Instant::now();
            let submitted = engine.submit(request);
            drop(engine);
            match submitted {
                Ok(stream) => {
                    if ready_tx.send(Ok(())).is_ok() {
                        pump(stream, index, &tx, &metrics, t0);
                    }
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            }
        });
        accepted.push(ready_rx);
    }
    drop(tx);
    for ready in accepted {
        match ready.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(ApiError::from_engine(e, prompt_param)),
            Err(_) => return Err(ApiError::internal("the request could not be submitted")),
        }
    }
    Ok(rx)
}

/// Forwards `stream`'s events to `tx` until the end, or until `tx`'s receiver is gone (then
/// the stream is dropped: the request is cancelled).
fn pump(
    mut stream: RequestStream,
    index: usize,
    tx: &mpsc::UnboundedSender<(usize, Event)>,
    metrics: &Metrics,
    t0: Instant,
) {
    let mut last: Option<Instant> = None;
    loop {
        let event = match stream.recv_timeout(POLL) {
            Ok(Some(event)) => event,
            Ok(None) | Err(RecvTimeoutError::Disconnected) => return,
            Err(RecvTimeoutError::Timeout) => {
                if tx.is_closed() {
                    metrics.cancelled();
                    return;
                }
                continue;
            }
        };
        let finished = match &event {
            Event::Token(_) => {
                let now = Instant::now();
                match last {
                    None => metrics.ttft.observe(now - t0),
                    Some(prev) => metrics.tpot.observe(now - prev),
                }
                last = Some(now);
                false
            }
            Event::Finished(f) => {
                metrics.tokens(f.usage.prompt_tokens, f.usage.completion_tokens);
                true
            }
        };
        if tx.send((index, event)).is_err() {
            metrics.cancelled();
            return;
        }
        if finished {
            return;
        }
    }
}
