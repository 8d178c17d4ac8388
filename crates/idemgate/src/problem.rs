//! Every response idemgate writes itself: RFC 9457 `application/problem+json`, one type per
//! refusal, and the one place that maps a refusal to its status code.

use bytes::Bytes;
use http::header::{CONNECTION, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, Response, StatusCode};

use crate::body::{Body, full};

/// Which problem: the shared table in the core.
pub use idemgate_core::problem::ProblemKind as Kind;

/// A refusal, rendered as problem+json.
#[derive(Debug)]
pub struct Problem {
    pub kind: Kind,
    pub detail: String,
    pub operation_id: Option<String>,
    /// Seconds, sent as `Retry-After`.
    pub retry_after: Option<u64>,
    /// The machine-readable reason (`invalid-idempotency-key`: length, charset, ...).
    pub reason: Option<&'static str>,
    /// Close the connection after answering (framing errors: the rest of the stream is suspect).
    pub close: bool,
}

impl Problem {
    pub fn new(kind: Kind, detail: impl Into<String>) -> Self {
        Self {
            kind,
            detail: detail.into(),
            operation_id: None,
            retry_after: None,
            reason: None,
            close: false,
        }
    }

    #[must_use]
    pub fn operation(mut self, id: impl Into<String>) -> Self {
        self.operation_id = Some(id.into());
        self
    }

    #[must_use]
    pub fn retry_after(mut self, secs: u64) -> Self {
        self.retry_after = Some(secs.max(1));
        self
    }

    #[must_use]
    pub fn reason(mut self, reason: &'static str) -> Self {
        self.reason = Some(reason);
        self
    }

    #[must_use]
    pub fn close(mut self) -> Self {
        self.close = true;
        self
    }

    /// Renders the response.
    #[must_use]
    pub fn into_response(self) -> Response<Body> {
        let status = StatusCode::from_u16(self.kind.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let json = idemgate_core::problem::problem_json(
            self.kind,
            &self.detail,
            self.operation_id.as_deref(),
            self.reason,
        );
        let mut resp = Response::new(full(Bytes::from(json)));
        *resp.status_mut() = status;
        let h = resp.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        if let Some(secs) = self.retry_after {
            h.insert(RETRY_AFTER, HeaderValue::from(secs));
        }
        if let Some(id) = self
            .operation_id
            .as_deref()
            .and_then(|id| HeaderValue::from_str(id).ok())
        {
            h.insert(crate::proxy::OPERATION_ID, id);
        }
        if self.close {
            h.insert(CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }
}
