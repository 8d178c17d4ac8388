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
use serde::Serialize;

use crate::idempotency::{OPERATION_ID, ResponseBody};

/// Which refusal: the slug of `https://idemgate.dev/problems/<slug>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemKind {
    /// `missing-idempotency-key`, 400: a `required` route without a key.
    MissingKey,
    /// `invalid-idempotency-key`, 400: the key broke a key rule (`reason` says which).
    InvalidKey,
    /// `idempotency-key-not-allowed`, 400: a key on a `prohibited` route.
    KeyNotAllowed,
    /// `unauthenticated`, 401: the scope needs a principal and there is none.
    Unauthenticated,
    /// `request-in-flight`, 409: the key is in flight (`reject`, or the wait timed out).
    RequestInFlight,
    /// `response-not-retained`, 409: the outcome was stored without its (too large) body.
    ResponseNotRetained,
    /// `outcome-unknown`, 409: the owner died and the route refuses takeover.
    OutcomeUnknown,
    /// `idempotency-key-reused`, 422: the key belongs to a different request.
    KeyReused,
    /// `payload-too-large`, 413: the request body is over the layer's limit.
    PayloadTooLarge,
    /// `store-unavailable`, 503: the store failed and the route fails closed.
    StoreUnavailable,
    /// `bad-request`, 400: the request body could not be read (as the gateway names it).
    BadRequest,
    /// `not-found`, 404: a recovery request for a key with no outcome on this route.
    NotFound,
    /// `upstream-unavailable`, 502: the execution task ended without an answer (runtime
    /// shutdown).
    UpstreamUnavailable,
}

impl ProblemKind {
    /// The slug, the last segment of the problem `type`.
    #[must_use]
    pub fn slug(self) -> &'static str {
        match self {
            Self::MissingKey => "missing-idempotency-key",
            Self::InvalidKey => "invalid-idempotency-key",
            Self::KeyNotAllowed => "idempotency-key-not-allowed",
            Self::Unauthenticated => "unauthenticated",
            Self::RequestInFlight => "request-in-flight",
            Self::ResponseNotRetained => "response-not-retained",
            Self::OutcomeUnknown => "outcome-unknown",
            Self::KeyReused => "idempotency-key-reused",
            Self::PayloadTooLarge => "payload-too-large",
            Self::StoreUnavailable => "store-unavailable",
            Self::BadRequest => "bad-request",
            Self::UpstreamUnavailable => "upstream-unavailable",
            Self::NotFound => "not-found",
        }
    }

    /// The HTTP status.
    #[must_use]
    pub fn status(self) -> StatusCode {
        match self {
            Self::MissingKey | Self::InvalidKey | Self::KeyNotAllowed | Self::BadRequest => {
                StatusCode::BAD_REQUEST
            }
            Self::Unauthenticated => StatusCode::UNAUTHORIZED,
            Self::RequestInFlight | Self::ResponseNotRetained | Self::OutcomeUnknown => StatusCode::CONFLICT,
            Self::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Self::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            Self::UpstreamUnavailable => StatusCode::BAD_GATEWAY,
            Self::NotFound => StatusCode::NOT_FOUND,
        }
    }

    /// The human-readable title (the same for every instance of a kind).
    #[must_use]
    pub fn title(self) -> &'static str {
        match self {
            Self::MissingKey => "Idempotency-Key header is required",
            Self::InvalidKey => "Idempotency-Key is invalid",
            Self::KeyNotAllowed => "Idempotency-Key is not allowed on this endpoint",
            Self::Unauthenticated => "Authentication is required",
            Self::RequestInFlight => "A request with this key is in progress",
            Self::ResponseNotRetained => "The original response was too large to keep",
            Self::OutcomeUnknown => "The outcome of the original request is unknown",
            Self::KeyReused => "Idempotency-Key was used for a different request",
            Self::PayloadTooLarge => "Request body is too large",
            Self::StoreUnavailable => "Idempotency store is unavailable",
            Self::BadRequest => "Malformed request",
            Self::UpstreamUnavailable => "Upstream is unavailable",
            Self::NotFound => "No such endpoint",
        }
    }
}

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

#[derive(Serialize)]
struct Wire<'a> {
    #[serde(rename = "type")]
    kind: String,
    title: &'static str,
    status: u16,
    detail: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    operation_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<&'static str>,
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
        let wire = Wire {
            kind: format!("https://idemgate.dev/problems/{}", self.kind.slug()),
            title: self.kind.title(),
            status: self.kind.status().as_u16(),
            detail: &self.detail,
            operation_id: self.operation_id.as_deref(),
            reason: self.reason,
        };
        Bytes::from(serde_json::to_vec(&wire).unwrap_or_default())
    }

    /// Renders the response; `B` is the inner service's body type, which a problem never uses.
    #[must_use]
    pub fn into_response<B>(self) -> Response<ResponseBody<B>> {
        let mut resp = Response::new(ResponseBody::full(self.to_json()));
        *resp.status_mut() = self.kind.status();
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
