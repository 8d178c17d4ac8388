//! The idempotency middleware: [`IdempotencyLayer`], [`Idempotency`], [`ResponseFuture`].
//!
//! Each request goes through named phases (the gateway's, SPEC section 4):
//!
//! 1. **policy + key** (in `call`, from the head alone): [`KeyPolicy::Required`] without a key
//!    is `400 missing-idempotency-key`; [`KeyPolicy::Accepted`] without a key and
//!    [`KeyPolicy::Prohibited`] without a key pass straight through (the inner future is polled
//!    in place); a key on a prohibited route is `400 idempotency-key-not-allowed`; a key that
//!    breaks the [`KeyRules`](idemgate_core::key::KeyRules) is `400 invalid-idempotency-key`.
//! 2. **namespace**: the [`PrincipalSource`](crate::PrincipalSource) names the caller and the
//!    key becomes `t-{tenant}:{project}:{subject}:{raw}` for the route's scope; a scoped route
//!    without a principal is `401 unauthenticated`.
//! 3. **dedup**: the body is read (up to `max_request_bytes`, else `413`), fingerprinted, and
//!    [`Engine::begin`](idemgate_core::Engine::begin) decides:
//!    - *execute*: the inner service runs in its own task (it finishes even if the client goes
//!      away) and its response streams to the client while it is captured up to
//!      `max_response_bytes`. A final outcome (2xx, 3xx, 4xx but 408/425/429; 5xx only with
//!      `store_server_errors`) is completed, a transient one released, **before** the last
//!      frame reaches the client. The response carries `x-operation-id`, and
//!      `Idempotency-Expires` when stored.
//!    - *replay*: the stored status, allow-listed headers and body, plus
//!      `Idempotent-Replayed: true`, `x-operation-id`, `Idempotency-Expires` (and
//!      `Idempotency-Status` with a [`Procedure`](crate::procedure::Procedure)).
//!    - *refusals*, as problem+json responses: `422 idempotency-key-reused`,
//!      `409 request-in-flight` with `Retry-After`, `409 response-not-retained`,
//!      `409 outcome-unknown`; a store error is `503 store-unavailable` or, failing open, a
//!      plain call of the inner service.
//!
//! [`IdempotencyLayer::recovery`] gives the route's recovery service (SPEC section 5), see
//! [`Recovery`].
//!
//! Works with `axum::Router::layer` and `route_layer` (axum's `Body` is `From<Bytes>`), with
//! `tower::ServiceBuilder`, and with plain hyper services through [`RequestBody`].

mod body;
mod config;
mod dedup;
mod downstream;
mod execute;
mod future;
mod info;
mod layer;
mod recovery;
mod service;

pub use body::{BoxError, RequestBody, ResponseBody};
pub use config::{DEFAULT_MAX_REQUEST_BYTES, DEFAULT_ROUTE_ID, KeyPolicy, OnStoreError};
pub use future::{InnerFuture, ResponseFuture};
pub use info::IdempotencyInfo;
pub use layer::IdempotencyLayer;
pub use recovery::{Recovery, RecoveryResponse};
pub use service::Idempotency;

use http::HeaderName;

/// `Idempotency-Key`, the default key header.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// `Idempotent-Replayed`, the default replay marker.
pub const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
pub use idemgate_core::headers::{IDEMPOTENCY_EXPIRES, IDEMPOTENCY_STATUS, OPERATION_ID};
