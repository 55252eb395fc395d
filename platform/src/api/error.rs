//! The one table from errors to HTTP statuses and stable codes, with OpenAI's error body:
//! `{"error": {"message", "type", "param", "code"}}` (LoRAX's routes answer the same errors in
//! LoRAX's shape, `{"error", "error_type"}`).

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};

use crate::request::SeqError;
use crate::runtime::{RuntimeError, SubmitError};
use crate::store::StoreError;

/// Everything a handler can answer with besides success. Messages are for the caller.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("missing or malformed Authorization header: send `Authorization: Bearer KEY`")]
    MissingKey,
    #[error("invalid or revoked API key")]
    BadKey,
    #[error("this key does not have the {0:?} scope")]
    Forbidden(&'static str),
    #[error("{0} not found")]
    NotFound(String),
    #[error("{0}")]
    Invalid(String),
    /// One field of the request is wrong: OpenAI's `param` names it.
    #[error("{message}")]
    InvalidParam { param: String, message: String },
    /// A file of requests with invalid lines: the problem of each (the first ones).
    #[error("{message}")]
    InvalidLines { message: String, lines: Vec<LineError> },
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    TooLarge(String),
    /// A per-tenant limit, or the tenant holds more than its share of a full server; retry
    /// after this many seconds.
    #[error("{message}")]
    RateLimited { message: String, retry_after: u64 },
    /// A tenant's quota (adapters, adapter bytes) is used up.
    #[error("{0}")]
    Quota(String),
    /// The server is full (queued and running work, the blocking pool); retry after this many
    /// seconds.
    #[error("{message}")]
    Overloaded { message: String, retry_after: u64 },
    /// The server cannot take the request now (shutting down, workers rebuilding, the
    /// database busy).
    #[error("{0}")]
    Unavailable(String),
    /// The request body stalled.
    #[error("{0}")]
    Timeout(String),
    /// The request was cancelled (its client went away); nobody reads the answer.
    #[error("the request was cancelled")]
    Cancelled,
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    /// The stable machine-readable code and OpenAI's error type.
    pub fn code(&self) -> (&'static str, &'static str) {
        match self {
            ApiError::MissingKey => ("missing_api_key", "authentication_error"),
            ApiError::BadKey => ("invalid_api_key", "authentication_error"),
            ApiError::Forbidden(_) => ("insufficient_scope", "permission_error"),
            ApiError::NotFound(_) => ("not_found", "not_found_error"),
            ApiError::Invalid(_) | ApiError::InvalidParam { .. } => ("invalid_request", "invalid_request_error"),
            ApiError::InvalidLines { .. } => ("invalid_lines", "invalid_request_error"),
            ApiError::Conflict(_) => ("conflict", "invalid_request_error"),
            ApiError::TooLarge(_) => ("payload_too_large", "invalid_request_error"),
            ApiError::RateLimited { .. } => ("rate_limit_exceeded", "rate_limit_error"),
            ApiError::Quota(_) => ("quota_exceeded", "rate_limit_error"),
            ApiError::Overloaded { .. } => ("server_overloaded", "server_error"),
            ApiError::Unavailable(_) => ("unavailable", "server_error"),
            ApiError::Timeout(_) => ("request_timeout", "invalid_request_error"),
            ApiError::Cancelled => ("cancelled", "invalid_request_error"),
            ApiError::Internal(_) => ("internal_error", "server_error"),
        }
    }

    /// The field of the request an error is about (OpenAI's `param`), where one is.
    pub fn param(&self) -> Option<&str> {
        match self {
            ApiError::InvalidParam { param, .. } => Some(param),
            _ => None,
        }
    }

    /// The body, also sent inside event streams.
    pub fn body(&self) -> serde_json::Value {
        let (code, kind) = self.code();
        let mut body = serde_json::json!({"error": {"message": self.to_string(), "type": kind, "param": self.param(), "code": code}});
        if let ApiError::InvalidLines { lines, .. } = self {
            body["error"]["lines"] = serde_json::to_value(lines).unwrap_or_default();
        }
        body
    }
}

/// LoRAX's (and TGI's) `error_type` of each error, for the LoRAX routes: `validation`,
/// `generation` and `overloaded` are LoRAX's own; LoRAX has no keys, so what is about them is
/// `authentication`, and a missing resource is `not_found`.
pub const LORAX_ERROR_TYPES: &[&str] = &["validation", "authentication", "not_found", "overloaded", "generation"];

impl ApiError {
    /// LoRAX's `error_type` of this error (one of [`LORAX_ERROR_TYPES`]).
    pub fn lorax_type(&self) -> &'static str {
        match self {
            ApiError::MissingKey | ApiError::BadKey | ApiError::Forbidden(_) => "authentication",
            ApiError::NotFound(_) => "not_found",
            ApiError::Invalid(_)
            | ApiError::InvalidParam { .. }
            | ApiError::InvalidLines { .. }
            | ApiError::Conflict(_)
            | ApiError::TooLarge(_)
            | ApiError::Timeout(_) => "validation",
            ApiError::RateLimited { .. } | ApiError::Quota(_) | ApiError::Overloaded { .. } | ApiError::Unavailable(_) => "overloaded",
            ApiError::Cancelled | ApiError::Internal(_) => "generation",
        }
    }

    /// The body in LoRAX's shape, `{"error": message, "error_type": type}`, also sent inside
    /// its event streams.
    pub fn lorax_body(&self) -> serde_json::Value {
        serde_json::json!({"error": self.to_string(), "error_type": self.lorax_type()})
    }

    /// [`ResponseError::error_response`] (its status and headers) with the LoRAX body.
    pub fn lorax_response(&self) -> HttpResponse {
        self.error_response().set_body(actix_web::body::BoxBody::new(self.lorax_body().to_string()))
    }
}

/// What is wrong with one line of a file of requests.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LineError {
    /// From 1, as an editor counts.
    pub line: u64,
    /// The line's `custom_id`, where it could be read.
    pub custom_id: Option<String>,
    pub message: String,
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        match self {
            ApiError::MissingKey | ApiError::BadKey => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Invalid(_) | ApiError::InvalidParam { .. } | ApiError::InvalidLines { .. } => StatusCode::BAD_REQUEST,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::RateLimited { .. } | ApiError::Quota(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Overloaded { .. } | ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Timeout(_) => StatusCode::REQUEST_TIMEOUT,
            // nginx's "client closed request": only ever seen in logs, the client has gone.
            ApiError::Cancelled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn error_response(&self) -> HttpResponse {
        let mut res = HttpResponse::build(self.status_code());
        match self {
            ApiError::RateLimited { retry_after, .. } | ApiError::Overloaded { retry_after, .. } => {
                res.insert_header(("retry-after", retry_after.to_string()));
            }
            ApiError::Quota(_) => {
                res.insert_header(("retry-after", "3600"));
            }
            ApiError::Unavailable(_) => {
                res.insert_header(("retry-after", "1"));
            }
            ApiError::Timeout(_) => {
                res.insert_header(("connection", "close"));
            }
            ApiError::MissingKey
            | ApiError::BadKey
            | ApiError::Forbidden(_)
            | ApiError::NotFound(_)
            | ApiError::Invalid(_)
            | ApiError::InvalidParam { .. }
            | ApiError::InvalidLines { .. }
            | ApiError::Conflict(_)
            | ApiError::TooLarge(_)
            | ApiError::Cancelled
            | ApiError::Internal(_) => {}
        }
        res.json(self.body())
    }
}

impl From<RuntimeError> for ApiError {
    fn from(e: RuntimeError) -> Self {
        match e {
            RuntimeError::Rejected(why) => ApiError::Invalid(why.to_string()),
            // The request's own grammar went past a limit while generating.
            RuntimeError::Sequence(SeqError::Grammar(_)) => ApiError::Invalid(e.to_string()),
            RuntimeError::Sequence(SeqError::PoolExhausted { .. }) => ApiError::Overloaded { message: e.to_string(), retry_after: 1 },
            // Adapters are validated at upload: failing to load one later is the server's fault.
            RuntimeError::Sequence(SeqError::AdapterFailed(_) | SeqError::Failed(_)) => ApiError::Internal(e.to_string()),
            RuntimeError::Cancelled => ApiError::Cancelled,
            RuntimeError::WorkerFailed(_) | RuntimeError::Unavailable(_) => ApiError::Unavailable(e.to_string()),
        }
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::Invalid(e) => ApiError::Invalid(e.to_string()),
            // The adapter was resolved from the database but its files are gone: a server fault.
            SubmitError::UnknownAdapter { .. } => ApiError::Internal(e.to_string()),
            SubmitError::Runtime(e) => e.into(),
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Conflict { .. } => ApiError::Conflict(e.to_string()),
            StoreError::InUse(why) => ApiError::Conflict(why),
            StoreError::NotFound(what) => ApiError::NotFound(what.to_string()),
            StoreError::Invalid { .. } => ApiError::Invalid(e.to_string()),
            StoreError::Quota(why) => ApiError::Quota(why),
            StoreError::Unavailable(_) => ApiError::Unavailable(e.to_string()),
            // Every connection busy, or the pool closing: capacity, not a fault.
            StoreError::Database(sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed) => ApiError::Unavailable(e.to_string()),
            StoreError::Database(_) | StoreError::Migrate(_) | StoreError::Url(_) | StoreError::Inconsistent(_) => ApiError::Internal(e.to_string()),
        }
    }
}
