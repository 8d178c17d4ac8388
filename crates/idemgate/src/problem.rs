//! Every response idemgate writes itself: RFC 9457 `application/problem+json`, one type per
//! refusal, and the one place that maps a refusal to its status code.

use bytes::Bytes;
use http::header::{CONNECTION, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, Response, StatusCode};
use serde::Serialize;

use crate::body::{Body, full};

/// Which problem: the slug of `https://idemgate.dev/problems/<slug>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    MissingKey,
    InvalidKey,
    KeyNotAllowed,
    Unauthenticated,
    NotFound,
    RequestInFlight,
    ResponseNotRetained,
    OutcomeUnknown,
    KeyReused,
    PayloadTooLarge,
    InvalidSignature,
    TranslationFailed,
    UnknownWebhook,
    StoreUnavailable,
    UpstreamUnavailable,
    UpstreamTimeout,
    /// A recovery request for a Restate invocation whose output was purged (410). Not in SPEC
    /// 11's list: Restate tells "purged" apart from "unknown", and so does the client.
    OutcomePurged,
    /// Malformed or ambiguous HTTP framing (request smuggling shapes). Not in SPEC 11's list:
    /// the contract is silent on framing errors, and a client needs a slug to match on.
    BadRequest,
}

impl Kind {
    #[must_use]
    pub fn slug(self) -> &'static str {
        match self {
            Self::MissingKey => "missing-idempotency-key",
            Self::InvalidKey => "invalid-idempotency-key",
            Self::KeyNotAllowed => "idempotency-key-not-allowed",
            Self::Unauthenticated => "unauthenticated",
            Self::NotFound => "not-found",
            Self::RequestInFlight => "request-in-flight",
            Self::ResponseNotRetained => "response-not-retained",
            Self::OutcomeUnknown => "outcome-unknown",
            Self::KeyReused => "idempotency-key-reused",
            Self::PayloadTooLarge => "payload-too-large",
            Self::InvalidSignature => "invalid-signature",
            Self::TranslationFailed => "translation-failed",
            Self::UnknownWebhook => "unknown-webhook",
            Self::StoreUnavailable => "store-unavailable",
            Self::UpstreamUnavailable => "upstream-unavailable",
            Self::UpstreamTimeout => "upstream-timeout",
            Self::OutcomePurged => "outcome-purged",
            Self::BadRequest => "bad-request",
        }
    }

    #[must_use]
    pub fn status(self) -> StatusCode {
        match self {
            Self::MissingKey | Self::InvalidKey | Self::KeyNotAllowed | Self::BadRequest => {
                StatusCode::BAD_REQUEST
            }
            Self::Unauthenticated | Self::InvalidSignature => StatusCode::UNAUTHORIZED,
            Self::NotFound | Self::UnknownWebhook => StatusCode::NOT_FOUND,
            Self::TranslationFailed => StatusCode::BAD_REQUEST,
            Self::RequestInFlight | Self::ResponseNotRetained | Self::OutcomeUnknown => StatusCode::CONFLICT,
            Self::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Self::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            Self::UpstreamUnavailable => StatusCode::BAD_GATEWAY,
            Self::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            Self::OutcomePurged => StatusCode::GONE,
        }
    }

    #[must_use]
    pub fn title(self) -> &'static str {
        match self {
            Self::MissingKey => "Idempotency-Key header is required",
            Self::InvalidKey => "Idempotency-Key is invalid",
            Self::KeyNotAllowed => "Idempotency-Key is not allowed on this endpoint",
            Self::Unauthenticated => "Authentication is required",
            Self::NotFound => "No such endpoint",
            Self::RequestInFlight => "A request with this key is in progress",
            Self::ResponseNotRetained => "The original response was too large to keep",
            Self::OutcomeUnknown => "The outcome of the original request is unknown",
            Self::KeyReused => "Idempotency-Key was used for a different request",
            Self::PayloadTooLarge => "Request body is too large",
            Self::InvalidSignature => "The webhook signature is invalid",
            Self::TranslationFailed => "The delivery's identifier could not be found",
            Self::UnknownWebhook => "No such webhook",
            Self::StoreUnavailable => "Idempotency store is unavailable",
            Self::UpstreamUnavailable => "Upstream is unavailable",
            Self::UpstreamTimeout => "Upstream timed out",
            Self::OutcomePurged => "The outcome for this key was purged",
            Self::BadRequest => "Malformed request",
        }
    }
}

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
        let status = self.kind.status();
        let wire = Wire {
            kind: format!("https://idemgate.dev/problems/{}", self.kind.slug()),
            title: self.kind.title(),
            status: status.as_u16(),
            detail: &self.detail,
            operation_id: self.operation_id.as_deref(),
            reason: self.reason,
        };
        let json = serde_json::to_vec(&wire).unwrap_or_default();
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
