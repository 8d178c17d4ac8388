//! Phase **dedup**: read the body, fingerprint, [`Engine::begin`], then execute, replay or
//! refuse. Everything here runs inside the one boxed future of a deduplicated request.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use idemgate_core::engine::{Engine, Started};
use idemgate_core::fingerprint::Fingerprint;
use idemgate_core::headers;
use idemgate_core::record::{Millis, StoredResponse};
use idemgate_core::store::Store;
use tower_service::Service;

use super::config::{Config, OnStoreError};
use super::{BoxError, IDEMPOTENCY_STATUS, ResponseBody, execute};
use crate::problem::{Problem, ProblemKind};
use crate::procedure::replay_status;

/// Runs a request that carries a valid key; `key` is already namespaced.
pub(crate) async fn run<S, St, P, ReqBody, ResBody>(
    mut inner: S,
    engine: Engine<St>,
    config: Arc<Config<P>>,
    parts: http::request::Parts,
    body: ReqBody,
    key: String,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: http_body::Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
    St: Store,
    P: Send + Sync + 'static,
{
    let body = match Limited::new(body, config.max_request_bytes).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.is::<LengthLimitError>() => {
            return Ok(Problem::new(
                ProblemKind::PayloadTooLarge,
                format!("the body is over {} bytes", config.max_request_bytes),
            )
            .into_response());
        }
        Err(_) => {
            return Ok(
                Problem::new(ProblemKind::BadRequest, "the request body could not be read").into_response(),
            );
        }
    };
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let pq = parts
        .uri
        .path_and_query()
        .map_or("/", http::uri::PathAndQuery::as_str);
    let fingerprint = Fingerprint::compute(&config.route, parts.method.as_str(), pq, content_type, &body);
    let started = match engine
        .begin(&key, &config.route, fingerprint, &config.engine)
        .await
    {
        Ok(started) => started,
        Err(e) => {
            tracing::warn!(error = %e, route = %config.route, "idempotency store error");
            return match config.on_store_error() {
                OnStoreError::FailClosed => Ok(Problem::new(
                    ProblemKind::StoreUnavailable,
                    "the idempotency store is unavailable",
                )
                .retry_after(1)
                .into_response()),
                OnStoreError::FailOpen => {
                    let req = Request::from_parts(parts, ReqBody::from(body));
                    Ok(inner.call(req).await?.map(ResponseBody::inner))
                }
            };
        }
    };
    let response = match started {
        Started::Execute(exec) => {
            let req = Request::from_parts(parts, ReqBody::from(body));
            return execute::spawn(inner, req, exec, key, config).await;
        }
        Started::Replay {
            response,
            operation_id,
            expires_at,
        } => replay(&config, response, &operation_id, expires_at).await,
        Started::NotRetained {
            status,
            operation_id,
            ..
        } => not_retained(status, operation_id).into_response(),
        Started::Mismatch { operation_id } => Problem::new(
            ProblemKind::KeyReused,
            "this key was used for a request with a different body, method or endpoint",
        )
        .operation(operation_id)
        .into_response(),
        Started::InFlight {
            operation_id,
            retry_after,
        } => Problem::new(
            ProblemKind::RequestInFlight,
            "a request with this key is still being processed",
        )
        .operation(operation_id)
        .retry_after(retry_after.as_secs())
        .into_response(),
        Started::OutcomeUnknown { operation_id } => Problem::new(
            ProblemKind::OutcomeUnknown,
            "the request with this key was interrupted; an operator must resolve it before the key can be used again",
        )
        .operation(operation_id)
        .into_response(),
    };
    Ok(response)
}

/// `409 response-not-retained`, naming the original status.
pub(crate) fn not_retained(status: u16, operation_id: String) -> Problem {
    Problem::new(
        ProblemKind::ResponseNotRetained,
        format!("the original request completed with status {status}, but its body was too large to keep"),
    )
    .operation(operation_id)
}

/// The stored response, marked as a replay.
pub(crate) async fn replay<P, B>(
    config: &Config<P>,
    stored: StoredResponse,
    operation_id: &str,
    expires_at: Millis,
) -> Response<ResponseBody<B>> {
    let status = match &config.procedure {
        Some(p) if (200..300).contains(&stored.status) => Some(replay_status(&**p, &stored).await),
        _ => None,
    };
    let mut resp = Response::new(ResponseBody::full(stored.body.unwrap_or_default()));
    *resp.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    let h = resp.headers_mut();
    headers::write_replay(
        h,
        stored.headers,
        &config.replayed_header,
        operation_id,
        expires_at,
    );
    if let Some(status) = status {
        h.insert(IDEMPOTENCY_STATUS, HeaderValue::from_static(status.as_str()));
    }
    resp
}
