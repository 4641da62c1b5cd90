//! `tm-cli serve`: an OpenAI-compatible HTTP server (axum + tokio) over the serving engine.
//!
//! Endpoints: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`,
//! `GET /health`, `GET /metrics`. Errors use the OpenAI shape. The engine's blocking request
//! streams are bridged to async by [`bridge`]; a client that goes away cancels its requests.
//! SIGINT/SIGTERM stop accepting connections, let requests in flight finish (bounded by
//! `--shutdown-timeout`), then stop the engine.

mod bridge;
mod error;
mod handlers;
mod metrics;
mod sse;
mod types;

use crate::common::{start_engine, EngineArgs, ModelArgs};
use anyhow::{Context, Result};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use clap::Args;
use error::ApiError;
use metrics::Metrics;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;
use tm_model::engine::{Engine, EngineConfig};

/// Arguments of `serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port; the address is printed on stderr).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The model name clients use (default: the model's directory or file stem).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Require `Authorization: Bearer <KEY>` on /v1 endpoints.
    #[arg(long)]
    api_key: Option<String>,
    /// Most requests waiting for their first step; more are answered 429.
    #[arg(long, default_value_t = 1024)]
    max_queue: usize,
    /// Seconds to let requests in flight finish after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 30.0, value_parser = crate::common::parse_seconds)]
    shutdown_timeout: f64,
}

/// What every handler shares.
#[derive(Debug)]
pub struct AppState {
    /// The engine.
    pub engine: Arc<Engine>,
    /// Counters for `/metrics`.
    pub metrics: Arc<Metrics>,
    /// The name clients use for the model.
    pub model_name: String,
    /// The API key required on /v1 endpoints, if any.
    pub api_key: Option<String>,
    /// When the server started (Unix seconds).
    pub created: u64,
}

/// Largest request body accepted.
const MAX_BODY_BYTES: usize = 16 << 20;

/// Default KV-cache size when neither --num-blocks nor --kv-cache-bytes is given.
const DEFAULT_KV_BYTES: u64 = 1 << 30;

/// Runs `serve` until SIGINT or SIGTERM.
pub fn run(args: ServeArgs) -> Result<()> {
    let bs = args.model.block_size.max(1);
    let started = start_engine(&args.model, &args.engine, args.max_queue, |cfg, dtype| {
        EngineConfig::blocks_for_bytes(cfg, dtype, bs, DEFAULT_KV_BYTES).max(args.model.max_len.div_ceil(bs))
    })?;
    let engine = Arc::new(started.engine);
    let state = Arc::new(AppState {
        engine: Arc::clone(&engine),
        metrics: Arc::new(Metrics::default()),
        model_name: args.served_model_name.clone().unwrap_or_else(|| started.name.clone()),
        api_key: args.api_key.clone(),
        created: handlers::unix_now(),
    });
    let grace = Duration::try_from_secs_f64(args.shutdown_timeout)
        .with_context(|| format!("--shutdown-timeout {}", args.shutdown_timeout))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .max_blocking_threads(4096)
        .thread_name("tm-serve")
        .build()
        .context("starting the tokio runtime")?;
    let served = runtime.block_on(serve(state, &args.host, args.port, grace));
    runtime.shutdown_timeout(Duration::from_secs(2));
    served?;
    match Arc::try_unwrap(engine) {
        Ok(engine) => engine.shutdown(Duration::from_secs(1)).context("stopping the engine")?,
        Err(engine) => drop(engine),
    }
    eprintln!("tm-cli serve: stopped");
    Ok(())
}

/// The router with every endpoint, the auth check and request counting.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(handlers::chat_completions))
        .route("/v1/completions", post(handlers::completions))
        .route("/v1/models", get(handlers::models))
        .route("/v1/models/{id}", get(handlers::model))
        .route("/health", get(handlers::health))
        .route("/metrics", get(handlers::metrics))
        .fallback(|req: Request| async move { ApiError::not_found(req.uri().path()).into_response() })
        .layer(axum::middleware::from_fn_with_state(Arc::clone(&state), track))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// The endpoint label of a path (bounded, for the metrics).
fn endpoint(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" => "/v1/chat/completions",
        "/v1/completions" => "/v1/completions",
        "/health" => "/health",
        "/metrics" => "/metrics",
        p if p == "/v1/models" || p.starts_with("/v1/models/") => "/v1/models",
        _ => "other",
    }
}

/// Checks the API key on /v1 paths and counts the answer by endpoint and status.
async fn track(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let label = endpoint(&path);
    let response = if st.api_key.is_some() && path.starts_with("/v1/") && !authorized(&st, &req) {
        ApiError::unauthorized().into_response()
    } else {
        next.run(req).await
    };
    st.metrics.request(label, response.status().as_u16());
    response
}

/// Whether `req` carries the configured API key.
fn authorized(st: &AppState, req: &Request) -> bool {
    let Some(key) = &st.api_key else { return true };
    req.headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|given| given.trim() == key)
}

/// Binds, prints the address, serves until a signal, then waits up to `grace` for requests in
/// flight.
async fn serve(state: Arc<AppState>, host: &str, port: u16, grace: Duration) -> Result<()> {
    let listener =
        tokio::net::TcpListener::bind((host, port)).await.with_context(|| format!("binding {host}:{port}"))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    eprintln!("tm-cli serve: serving {} on http://{addr} (Ctrl-C to stop)", state.model_name);
    let _ = std::io::stderr().flush();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let app = router(state);
    let mut server = tokio::spawn(async move {
        let mut stop_rx = stop_rx;
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stop_rx.wait_for(|s| *s).await;
            })
            .await
    });
    tokio::select! {
        r = &mut server => return r.context("the server task failed")?.context("serving"),
        () = shutdown_signal() => {}
    }
    eprintln!("tm-cli serve: shutting down (waiting up to {:.0} s for requests in flight)", grace.as_secs_f64());
    let _ = stop_tx.send(true);
    match tokio::time::timeout(grace, &mut server).await {
        Ok(r) => r.context("the server task failed")?.context("serving")?,
        Err(_) => {
            eprintln!("tm-cli serve: requests still in flight after the timeout are dropped");
            server.abort();
        }
    }
    Ok(())
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}
