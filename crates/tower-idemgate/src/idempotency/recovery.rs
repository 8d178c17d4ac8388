//! [`Recovery`]: the recovery route of SPEC section 5, `GET {path}/by-idempotency-key/{key}`.
//!
//! A client that lost a response (crash, timeout) and no longer has the request body can still
//! fetch the outcome by its key, under the same identity, so from the same namespace: Alice can
//! never read Bob's outcome, even with Bob's key. Only records of this layer's route id answer.
//!
//! - completed: the stored response, as a replay (`Idempotent-Replayed: true`);
//! - completed without its body: `409 response-not-retained`;
//! - in flight: waits up to `wait_timeout`, then `202` with `Retry-After` and
//!   `Idempotency-Status: processing`; the `.../output` form never waits;
//! - unknown (or another route's key): `404 not-found`.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use http::{Request, Response, StatusCode};
use idemgate_core::engine::{Engine, Lookup};
use idemgate_core::headers::value as header_value;
use idemgate_core::record::RecordState;
use idemgate_core::store::Store;
use tower_service::Service;

use super::config::Config;
use super::dedup::{not_retained, replay};
use super::{IDEMPOTENCY_STATUS, OPERATION_ID, ResponseBody};
use crate::principal::PrincipalSource;
use crate::problem::{Problem, ProblemKind};

/// The response of [`Recovery`]: always a complete body.
pub type RecoveryResponse = Response<ResponseBody<http_body_util::Empty<Bytes>>>;

/// Answers `GET .../by-idempotency-key/{key}` and `.../by-idempotency-key/{key}/output` for the
/// route of the [`IdempotencyLayer`](super::IdempotencyLayer) it came from
/// ([`IdempotencyLayer::recovery`](super::IdempotencyLayer::recovery)). Mount it on both paths;
/// it reads the key from the request path.
pub struct Recovery<St, P> {
    pub(crate) engine: Engine<St>,
    pub(crate) config: Arc<Config<P>>,
}

impl<St, P> Clone for Recovery<St, P> {
    fn clone(&self) -> Self {
        Self {
            engine: self.engine.clone(),
            config: self.config.clone(),
        }
    }
}

impl<St, P> std::fmt::Debug for Recovery<St, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recovery")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<St: Store, P: PrincipalSource, B> Service<Request<B>> for Recovery<St, P> {
    type Response = RecoveryResponse;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<RecoveryResponse, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let (parts, _) = req.into_parts();
        let this = self.clone();
        Box::pin(async move { Ok(this.recover(&parts).await.unwrap_or_else(Problem::into_response)) })
    }
}

impl<St: Store, P: PrincipalSource> Recovery<St, P> {
    async fn recover(&self, parts: &http::request::Parts) -> Result<RecoveryResponse, Problem> {
        let config = &self.config;
        if parts.headers.contains_key(&config.header) {
            return Err(Problem::new(
                ProblemKind::KeyNotAllowed,
                "recovery requests name the key in the path",
            ));
        }
        let not_found = || Problem::new(ProblemKind::NotFound, "no outcome is recorded for this key");
        let (raw, output) = key_from_path(parts.uri.path()).ok_or_else(not_found)?;
        config
            .keys
            .validate(&raw)
            .map_err(|e| Problem::new(ProblemKind::InvalidKey, e.to_string()).reason(e.reason.as_str()))?;
        let key = config.namespace(parts, &raw)?;
        let wait = (!output).then_some(config.engine.wait_timeout);
        let found = self.engine.lookup(&key, wait).await.map_err(|e| {
            tracing::warn!(error = %e, route = %config.route, "idempotency store error");
            Problem::new(
                ProblemKind::StoreUnavailable,
                "the idempotency store is unavailable",
            )
            .retry_after(1)
        })?;
        match found {
            Lookup::Completed(record) if record.route == config.route => {
                let RecordState::Completed { response, .. } = record.state else {
                    return Err(not_found());
                };
                if response.body.is_none() {
                    return Err(not_retained(response.status, record.operation_id));
                }
                Ok(replay(config, response, &record.operation_id, record.expires_at).await)
            }
            Lookup::InFlight { operation_id, route } if route == config.route => {
                let body = serde_json::json!({"status": "processing", "operation_id": operation_id});
                let mut resp = Response::new(ResponseBody::full(Bytes::from(body.to_string())));
                *resp.status_mut() = StatusCode::ACCEPTED;
                let h = resp.headers_mut();
                h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
                h.insert(RETRY_AFTER, HeaderValue::from_static("1"));
                h.insert(IDEMPOTENCY_STATUS, HeaderValue::from_static("processing"));
                h.insert(OPERATION_ID, header_value(&operation_id));
                Ok(resp)
            }
            _ => Err(not_found()),
        }
    }
}

/// `.../by-idempotency-key/{key}[/output]`: the percent-decoded key, and whether it is the
/// `output` form.
fn key_from_path(path: &str) -> Option<(String, bool)> {
    let (_, rest) = path.rsplit_once("/by-idempotency-key/")?;
    let (raw, output) = rest.strip_suffix("/output").map_or((rest, false), |k| (k, true));
    if raw.is_empty() || raw.contains('/') {
        return None;
    }
    let raw = percent_encoding::percent_decode_str(raw).decode_utf8().ok()?;
    Some((raw.into_owned(), output))
}

#[cfg(test)]
mod tests {
    use super::key_from_path;

    #[test]
    fn keys_come_from_the_path() {
        assert_eq!(
            key_from_path("/orders/by-idempotency-key/k1"),
            Some(("k1".into(), false))
        );
        assert_eq!(
            key_from_path("/orders/by-idempotency-key/k%2E1/output"),
            Some(("k.1".into(), true))
        );
        assert_eq!(key_from_path("/orders/by-idempotency-key/"), None);
        assert_eq!(key_from_path("/orders/k1"), None);
    }
}
