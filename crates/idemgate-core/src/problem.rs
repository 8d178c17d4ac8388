//! The refusals idemgate writes itself (SPEC 11): one table of slugs, titles and status codes,
//! and the RFC 9457 `application/problem+json` body, shared by the gateway and the tower layer
//! so that a client sees the same bytes from either.

use serde::Serialize;

/// Which problem: the slug of `https://idemgate.dev/problems/<slug>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemKind {
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

impl ProblemKind {
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
    pub fn status(self) -> u16 {
        match self {
            Self::MissingKey | Self::InvalidKey | Self::KeyNotAllowed | Self::BadRequest => 400,
            Self::Unauthenticated | Self::InvalidSignature => 401,
            Self::NotFound | Self::UnknownWebhook => 404,
            Self::TranslationFailed => 400,
            Self::RequestInFlight | Self::ResponseNotRetained | Self::OutcomeUnknown => 409,
            Self::KeyReused => 422,
            Self::PayloadTooLarge => 413,
            Self::StoreUnavailable => 503,
            Self::UpstreamUnavailable => 502,
            Self::UpstreamTimeout => 504,
            Self::OutcomePurged => 410,
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

/// The problem+json body of a refusal.
#[must_use]
pub fn problem_json(
    kind: ProblemKind,
    detail: &str,
    operation_id: Option<&str>,
    reason: Option<&'static str>,
) -> Vec<u8> {
    let wire = Wire {
        kind: format!("https://idemgate.dev/problems/{}", kind.slug()),
        title: kind.title(),
        status: kind.status(),
        detail,
        operation_id,
        reason,
    };
    // Serializing strings and numbers cannot fail.
    serde_json::to_vec(&wire).unwrap_or_default()
}
