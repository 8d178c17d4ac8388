//! The responses the layer writes itself: RFC 9457 `application/problem+json`, with the same
//! slugs, titles and body shape as the gateway (SPEC section 11), and the one place that maps a
//! refusal to its status code.
//!
//! A refusal is a response, never a service error: the inner service's error type passes
//! through the layer untouched, and a client sees the same body whether the gateway or the
//! layer refused it.

use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, Response, StatusCode};

use crate::idempotency::{OPERATION_ID, ResponseBody};

/// Which refusal: the table shared with the gateway (slug, title, status).
pub use idemgate_core::problem::ProblemKind;

/// One refusal, rendered by [`Problem::into_response`].
///
/// ```
/// use tower_idemgate::{Problem, ProblemKind};
///
/// let resp = Problem::new(ProblemKind::RequestInFlight, "still running")
///     .operation("op_1")
///     .retry_after(3)
///     .into_response::<String>();
/// assert_eq!(resp.status(), 409);
/// assert_eq!(resp.headers()["content-type"], "application/problem+json");
/// assert_eq!(resp.headers()["retry-after"], "3");
/// assert_eq!(resp.headers()["x-operation-id"], "op_1");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// Which refusal.
    pub kind: ProblemKind,
    /// Written for the client; never holds a key or internal error detail.
    pub detail: String,
    /// The record's operation id, when one exists.
    pub operation_id: Option<String>,
    /// Seconds, sent as `Retry-After`.
    pub retry_after: Option<u64>,
    /// The machine-readable reason (`invalid-idempotency-key`: `length`, `charset`, ...).
    pub reason: Option<&'static str>,
}

impl Problem {
    /// A problem of `kind` with a client-facing `detail`.
    pub fn new(kind: ProblemKind, detail: impl Into<String>) -> Self {
        Self {
            kind,
            detail: detail.into(),
            operation_id: None,
            retry_after: None,
            reason: None,
        }
    }

    /// Names the record's operation (body field and `x-operation-id`).
    #[must_use]
    pub fn operation(mut self, id: impl Into<String>) -> Self {
        self.operation_id = Some(id.into());
        self
    }

    /// Adds `Retry-After` (at least one second).
    #[must_use]
    pub fn retry_after(mut self, secs: u64) -> Self {
        self.retry_after = Some(secs.max(1));
        self
    }

    /// Adds the machine-readable `reason`.
    #[must_use]
    pub fn reason(mut self, reason: &'static str) -> Self {
        self.reason = Some(reason);
        self
    }

    /// The problem body as JSON bytes.
    #[must_use]
    pub fn to_json(&self) -> Bytes {
        Bytes::from(idemgate_core::problem::problem_json(
            self.kind,
            &self.detail,
            self.operation_id.as_deref(),
            self.reason,
        ))
    }

    /// Renders the response; `B` is the inner service's body type, which a problem never uses.
    #[must_use]
    pub fn into_response<B>(self) -> Response<ResponseBody<B>> {
        let mut resp = Response::new(ResponseBody::full(self.to_json()));
        *resp.status_mut() =
            StatusCode::from_u16(self.kind.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
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
            h.insert(OPERATION_ID, id);
        }
        resp
    }
}
