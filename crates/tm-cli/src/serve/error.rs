//! Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use tm_model::error::ModelError;

/// An error answered to the client with its HTTP status.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable message.
    pub message: String,
    /// OpenAI error type (`invalid_request_error`, ...).
    pub kind: &'static str,
    /// The request field at fault, if any.
    pub param: Option<String>,
    /// A machine-readable code, if any.
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 `invalid_request_error`.
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    /// A 400 naming the field at fault.
    pub fn bad_param(param: &str, message: impl Into<String>) -> Self {
        ApiError { param: Some(param.to_string()), ..ApiError::bad_request(message) }
    }

    /// A 401 for a missing or wrong API key.
    pub fn unauthorized() -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "invalid or missing API key (send `Authorization: Bearer <key>`)".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    /// A 404 for an unknown path.
    pub fn not_found(path: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("no route for {path}"),
            kind: "invalid_request_error",
            param: None,
            code: Some("not_found"),
        }
    }

    /// A 500 `server_error`.
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// The error for a request the engine refused.
    pub fn from_engine(e: ModelError, prompt_param: &str) -> Self {
        match e {
            ModelError::Overloaded(msg) => ApiError {
                status: StatusCode::TOO_MANY_REQUESTS,
                message: msg,
                kind: "rate_limit_error",
                param: None,
                code: Some("queue_full"),
            },
            ModelError::Unavailable(msg) => ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message: msg,
                kind: "server_error",
                param: None,
                code: Some("unavailable"),
            },
            ModelError::ContextLength(msg) => {
                ApiError { code: Some("context_length_exceeded"), ..ApiError::bad_param(prompt_param, msg) }
            }
            ModelError::InvalidInput(msg) => ApiError::bad_request(msg),
            e @ (ModelError::Core(_) | ModelError::Tokenizer(_) | ModelError::Template(_)) => {
                ApiError::bad_request(e.to_string())
            }
            e => ApiError::internal(e.to_string()),
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, [(header::CONTENT_TYPE, "application/json")], self.body().to_string()).into_response()
    }
}
