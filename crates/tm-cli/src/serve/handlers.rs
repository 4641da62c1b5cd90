//! The endpoints: chat completions, completions, models, health, metrics.

use super::bridge::{submit_all, Events};
use super::error::ApiError;
use super::sse::{sse_response, Format, StreamSetup};
use super::types::{ChatRequest, CommonFields, CompletionRequest, Content, PromptField};
use super::AppState;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tm_core::sampling::SamplingParams;
use tm_model::chat_template::ChatMessage;
use tm_model::engine::{Event, FinishReason, Prompt, Request, TokenLogprobs, Usage, MAX_LOGPROBS};
use tm_model::tokenizer::Tokenizer;

/// Most choices (`n`) one request may ask for.
const MAX_N: i64 = 128;

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// A random 64-bit number (std's per-process random hasher keys, mixed with the clock).
fn random_u64() -> u64 {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    RandomState::new().hash_one(nanos)
}

/// A response id such as `chatcmpl-5f3a...`.
fn new_id(prefix: &str) -> String {
    format!("{prefix}-{:016x}", random_u64())
}

/// Parses a JSON body into `T`, with OpenAI-shaped errors for bad JSON and bad fields.
fn parse<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let body = body.map_err(|e| ApiError { status: e.status(), ..ApiError::bad_request(e.body_text()) })?;
    let value: Value =
        serde_json::from_slice(&body).map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    }
    // The error names the field it is about (OpenAI's `param`), e.g. `messages[0].content`. The
    // shared fields are flattened into both requests, which hides their path; read alone, they
    // give it back.
    let named = |path: String, inner: &serde_json::Error| {
        ApiError::bad_param(&path, format!("invalid request: `{path}`: {inner}"))
    };
    serde_path_to_error::deserialize::<_, T>(&value).map_err(|e| {
        let path = e.path().to_string();
        if path != "." {
            return named(path, e.inner());
        }
        if let Err(c) = serde_path_to_error::deserialize::<_, CommonFields>(&value) {
            let path = c.path().to_string();
            if path != "." {
                return named(path, c.inner());
            }
        }
        ApiError::bad_request(format!("invalid request: {}", e.inner()))
    })
}

/// What the shared fields ask for, checked.
struct Plan {
    sampling: SamplingParams,
    max_tokens: usize,
    stop: Vec<String>,
    n: usize,
    stream: bool,
    include_usage: bool,
    ignore_eos: bool,
}

/// Checks the shared fields (ranges as in the OpenAI reference) and the model name.
fn plan(st: &AppState, c: CommonFields, max_tokens: Option<i64>) -> Result<Plan, ApiError> {
    if let Some(model) = &c.model {
        if model != &st.model_name {
            return Err(ApiError {
                code: Some("model_not_found"),
                ..ApiError::bad_param(
                    "model",
                    format!("the model `{model}` does not exist; this server serves `{}`", st.model_name),
                )
            });
        }
    }
    let in_range = |name: &str, v: Option<f32>, lo: f32, hi: f32, default: f32| -> Result<f32, ApiError> {
        match v {
            None => Ok(default),
            Some(x) if x.is_finite() && x >= lo && x <= hi => Ok(x),
            Some(x) => {
                Err(ApiError::bad_param(name, format!("{name} = {x} is out of range (must be in [{lo}, {hi}])")))
            }
        }
    };
    let temperature = in_range("temperature", c.temperature, 0.0, 2.0, 1.0)?;
    let top_p = in_range("top_p", c.top_p, 0.0, 1.0, 1.0)?;
    if top_p <= 0.0 {
        return Err(ApiError::bad_param("top_p", "top_p must be greater than 0"));
    }
    let presence_penalty = in_range("presence_penalty", c.presence_penalty, -2.0, 2.0, 0.0)?;
    let frequency_penalty = in_range("frequency_penalty", c.frequency_penalty, -2.0, 2.0, 0.0)?;
    let min_p = in_range("min_p", c.min_p, 0.0, 1.0, 0.0)?;
    let repetition_penalty = in_range("repetition_penalty", c.repetition_penalty, 0.0, 100.0, 1.0)?;
    if repetition_penalty <= 0.0 {
        return Err(ApiError::bad_param("repetition_penalty", "repetition_penalty must be greater than 0"));
    }
    let top_k = match c.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
        Some(k) => {
            return Err(ApiError::bad_param("top_k", format!("top_k = {k} is out of range (-1, 0 or positive)")))
        }
    };
    let n = match c.n {
        None => 1,
        Some(n) if (1..=MAX_N).contains(&n) => n as usize,
        Some(n) => return Err(ApiError::bad_param("n", format!("n = {n} is out of range (must be in [1, {MAX_N}])"))),
    };
    let max_tokens = match max_tokens {
        None => st.engine.max_model_len(),
        Some(m) if m >= 1 => usize::try_from(m).unwrap_or(usize::MAX),
        Some(m) => return Err(ApiError::bad_param("max_tokens", format!("max_tokens = {m} must be at least 1"))),
    };
    let stop: Vec<String> = c.stop.map(|s| s.into_vec()).unwrap_or_default();
    if stop.len() > 16 {
        return Err(ApiError::bad_param("stop", format!("{} stop strings given; at most 16", stop.len())));
    }
    let sampling = SamplingParams {
        temperature,
        top_k,
        top_p,
        min_p,
        repetition_penalty,
        presence_penalty,
        frequency_penalty,
        seed: c.seed.map(|s| s as u64).unwrap_or_else(random_u64),
    };
    sampling.validate().map_err(|e| ApiError::bad_request(e.to_string()))?;
    let stream = c.stream.unwrap_or(false);
    let include_usage = stream && c.stream_options.and_then(|o| o.include_usage).unwrap_or(false);
    let _ = c.user;
    Ok(Plan { sampling, max_tokens, stop, n, stream, include_usage, ignore_eos: c.ignore_eos.unwrap_or(false) })
}

/// The `n` engine requests of one prompt (seeds `seed`, `seed + 1`, ...).
fn requests_for(plan: &Plan, prompt: Prompt, logprobs: Option<usize>) -> Vec<Request> {
    (0..plan.n)
        .map(|i| Request {
            prompt: prompt.clone(),
            sampling: SamplingParams { seed: plan.sampling.seed.wrapping_add(i as u64), ..plan.sampling.clone() },
            max_tokens: plan.max_tokens,
            stop: plan.stop.clone(),
            stop_token_ids: Vec::new(),
            ignore_eos: plan.ignore_eos,
            logprobs,
            skip_special_tokens: true,
        })
        .collect()
}

/// One choice's whole output.
#[derive(Clone, Debug, Default)]
struct Collected {
    text: String,
    logprobs: Vec<TokenLogprobs>,
    finish: Option<FinishReason>,
    usage: Usage,
}

/// Waits for all `n` requests; a failed one fails the whole response.
async fn collect(mut rx: Events, n: usize) -> Result<Vec<Collected>, ApiError> {
    let mut out = vec![Collected::default(); n];
    let mut done = 0;
    while done < n {
        let Some((i, event)) = rx.recv().await else {
            return Err(ApiError::internal("the engine stopped before the request finished"));
        };
        let Some(c) = out.get_mut(i) else { continue };
        match event {
            Event::Token(t) => {
                c.text.push_str(&t.text);
                c.logprobs.extend(t.logprobs);
            }
            Event::Finished(f) => {
                if f.reason == FinishReason::Error {
                    return Err(ApiError::internal(f.error.unwrap_or_else(|| "generation failed".into())));
                }
                c.text.push_str(&f.text);
                c.finish = Some(f.reason);
                c.usage = f.usage;
                done += 1;
            }
        }
    }
    Ok(out)
}

/// The text of one token (special tokens included).
pub fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.decode(&[id], false).unwrap_or_default()
}

/// Chat-format log-probabilities of some tokens: `{"content": [...]}`.
pub fn chat_logprobs(tok: &Tokenizer, lps: &[TokenLogprobs]) -> Value {
    let entry = |id: u32, lp: f32| {
        let t = token_text(tok, id);
        json!({"token": t, "logprob": lp, "bytes": t.as_bytes()})
    };
    let content: Vec<Value> = lps
        .iter()
        .map(|l| {
            let mut e = entry(l.token, l.logprob);
            e["top_logprobs"] = Value::Array(l.top.iter().map(|&(id, lp)| entry(id, lp)).collect());
            e
        })
        .collect();
    json!({ "content": content })
}

/// Completions-format log-probabilities, text offsets counted from `offset`.
pub fn completion_logprobs(tok: &Tokenizer, lps: &[TokenLogprobs], mut offset: usize) -> Value {
    let (mut tokens, mut token_lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    for l in lps {
        let t = token_text(tok, l.token);
        offsets.push(offset);
        offset += t.len();
        tokens.push(t);
        token_lps.push(l.logprob);
        let top: serde_json::Map<String, Value> =
            l.top.iter().map(|&(id, lp)| (token_text(tok, id), json!(lp))).collect();
        tops.push(Value::Object(top));
    }
    json!({"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets})
}

/// Token counts as OpenAI reports them.
pub fn usage_json(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

/// A JSON response with status 200.
fn ok_json(v: Value) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    chat_inner(st, body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn chat_inner(st: Arc<AppState>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let req: ChatRequest = parse(body)?;
    let max_tokens = req.max_completion_tokens.or(req.common.max_tokens);
    let plan = plan(&st, req.common, max_tokens)?;
    let logprobs = match (req.logprobs.unwrap_or(false), req.top_logprobs) {
        (false, None) => None,
        (false, Some(_)) => return Err(ApiError::bad_param("top_logprobs", "top_logprobs needs logprobs: true")),
        (true, None) => Some(0),
        (true, Some(k)) if (0..=MAX_LOGPROBS as i64).contains(&k) => Some(k as usize),
        (true, Some(k)) => {
            return Err(ApiError::bad_param(
                "top_logprobs",
                format!("top_logprobs = {k} is out of range (must be in [0, {MAX_LOGPROBS}])"),
            ))
        }
    };
    if req.messages.is_empty() {
        return Err(ApiError::bad_param("messages", "messages must hold at least one message"));
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.into_iter().enumerate() {
        let role = match m.role.as_str() {
            "developer" | "system" => "system",
            r @ ("user" | "assistant" | "tool") => r,
            other => {
                return Err(ApiError::bad_param(
                    "messages",
                    format!("messages[{i}].role `{other}` is not one of system, developer, user, assistant, tool"),
                ))
            }
        };
        let content = match m.content {
            None => String::new(),
            Some(Content::Text(s)) => s,
            Some(Content::Parts(parts)) => {
                let mut texts = Vec::with_capacity(parts.len());
                for p in parts {
                    match (p.kind.as_str(), p.text) {
                        ("text", Some(t)) => texts.push(t),
                        (kind, _) => {
                            return Err(ApiError::bad_param(
                                "messages",
                                format!("messages[{i}]: content parts of type `{kind}` are not supported (only text)"),
                            ))
                        }
                    }
                }
                texts.join("\n")
            }
        };
        messages.push(ChatMessage::new(role, content));
    }
    let engine = Arc::clone(&st.engine);
    let ids = tokio::task::spawn_blocking(move || -> Result<Vec<u32>, ApiError> {
        let m = engine.model();
        let tok = m.tokenizer();
        let text = m
            .template()
            .render(&messages, true, tok.bos_token().unwrap_or(""), tok.eos_token().unwrap_or(""))
            .map_err(|e| ApiError::bad_param("messages", e.to_string()))?;
        tok.encode(&text, false).map_err(|e| ApiError::bad_param("messages", e.to_string()))
    })
    .await
    .map_err(|_| ApiError::internal("applying the chat template failed"))??;
    let requests = requests_for(&plan, Prompt::Tokens(ids), logprobs);
    let rx = submit_all(&st.engine, &st.metrics, requests, "messages").await?;
    let id = new_id("chatcmpl");
    let created = unix_now();
    if plan.stream {
        let setup = StreamSetup {
            format: Format::Chat,
            id,
            created,
            model: st.model_name.clone(),
            n: plan.n,
            per_prompt: plan.n,
            include_usage: plan.include_usage,
            echo: vec![],
        };
        return Ok(sse_response(Arc::clone(&st.engine), rx, setup));
    }
    let out = collect(rx, plan.n).await?;
    let tok = st.engine.model().tokenizer();
    let choices: Vec<Value> = out
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": logprobs.map(|_| chat_logprobs(tok, &c.logprobs)),
                "finish_reason": c.finish.map(FinishReason::as_str),
            })
        })
        .collect();
    let prompt_tokens = out.first().map(|c| c.usage.prompt_tokens).unwrap_or(0);
    let completion_tokens = out.iter().map(|c| c.usage.completion_tokens).sum();
    Ok(ok_json(json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": st.model_name,
        "choices": choices,
        "usage": usage_json(prompt_tokens, completion_tokens),
    })))
}

/// `POST /v1/completions`.
pub async fn completions(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    completions_inner(st, body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn completions_inner(st: Arc<AppState>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse(body)?;
    let max_tokens = req.common.max_tokens;
    let plan = plan(&st, req.common, max_tokens)?;
    let logprobs = match req.logprobs {
        None => None,
        Some(k) if (0..=MAX_LOGPROBS as i64).contains(&k) => Some(k as usize),
        Some(k) => {
            return Err(ApiError::bad_param(
                "logprobs",
                format!("logprobs = {k} is out of range (must be in [0, {MAX_LOGPROBS}])"),
            ))
        }
    };
    let prompts: Vec<Prompt> = match req.prompt {
        PromptField::Text(s) => vec![Prompt::Text(s)],
        PromptField::Texts(v) => v.into_iter().map(Prompt::Text).collect(),
        PromptField::Tokens(ids) => vec![Prompt::Tokens(ids)],
        PromptField::TokenLists(v) => v.into_iter().map(Prompt::Tokens).collect(),
    };
    if prompts.is_empty() {
        return Err(ApiError::bad_param("prompt", "prompt must not be an empty list"));
    }
    let echo = req.echo.unwrap_or(false);
    let tok = st.engine.model().tokenizer();
    let echoes: Vec<String> = if echo {
        prompts
            .iter()
            .map(|p| match p {
                Prompt::Text(s) => s.clone(),
                Prompt::Tokens(ids) => tok.decode(ids, true).unwrap_or_default(),
            })
            .collect()
    } else {
        vec![String::new(); prompts.len()]
    };
    // Every prompt's n choices are engine requests that queue together: more than the queue holds
    // could never be accepted (the engine would answer 429 as if others were waiting).
    let wanted = prompts.len().saturating_mul(plan.n);
    if wanted > st.engine.max_queue() {
        return Err(ApiError::bad_param(
            "prompt",
            format!(
                "the request asks for {wanted} completions ({} prompts, n = {}), more than the server queues at once \
                 ({}, --max-queue)",
                prompts.len(),
                plan.n,
                st.engine.max_queue()
            ),
        ));
    }
    let requests: Vec<Request> = prompts.into_iter().flat_map(|p| requests_for(&plan, p, logprobs)).collect();
    let total = requests.len();
    let rx = submit_all(&st.engine, &st.metrics, requests, "prompt").await?;
    let id = new_id("cmpl");
    let created = unix_now();
    if plan.stream {
        let setup = StreamSetup {
            format: Format::Completion,
            id,
            created,
            model: st.model_name.clone(),
            n: total,
            per_prompt: plan.n,
            include_usage: plan.include_usage,
            echo: if echo { echoes } else { vec![] },
        };
        return Ok(sse_response(Arc::clone(&st.engine), rx, setup));
    }
    let out = collect(rx, total).await?;
    let choices: Vec<Value> = out
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let prefix = &echoes[i / plan.n];
            json!({
                "index": i,
                "text": format!("{prefix}{}", c.text),
                "logprobs": logprobs.map(|_| completion_logprobs(tok, &c.logprobs, prefix.len())),
                "finish_reason": c.finish.map(FinishReason::as_str),
            })
        })
        .collect();
    let prompt_tokens = out.iter().step_by(plan.n).map(|c| c.usage.prompt_tokens).sum();
    let completion_tokens = out.iter().map(|c| c.usage.completion_tokens).sum();
    Ok(ok_json(json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": st.model_name,
        "choices": choices,
        "usage": usage_json(prompt_tokens, completion_tokens),
    })))
}

/// The model card of the served model.
fn model_card(st: &AppState) -> Value {
    json!({
        "id": st.model_name,
        "object": "model",
        "created": st.created,
        "owned_by": "tm",
        "max_model_len": st.engine.max_model_len(),
    })
}

/// `GET /v1/models`.
pub async fn models(State(st): State<Arc<AppState>>) -> Response {
    ok_json(json!({"object": "list", "data": [model_card(&st)]}))
}

/// `GET /v1/models/{id}`.
pub async fn model(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    if id == st.model_name {
        ok_json(model_card(&st))
    } else {
        ApiError {
            status: StatusCode::NOT_FOUND,
            code: Some("model_not_found"),
            ..ApiError::bad_param("model", format!("the model `{id}` does not exist"))
        }
        .into_response()
    }
}

/// `GET /health`: 200 while the engine runs; 503 with the reason once it stopped for good (its
/// tensor-parallel group failed: a rank stalled past `--comm-timeout` or died).
pub async fn health(State(st): State<Arc<AppState>>) -> Response {
    match st.engine.failure() {
        None => ok_json(json!({"status": "ok"})),
        Some(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::CONTENT_TYPE, "application/json")],
            json!({"status": "unhealthy", "reason": why}).to_string(),
        )
            .into_response(),
    }
}

/// `GET /metrics`.
pub async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let text = st.metrics.render(&st.engine.stats());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}
