//! Phase **execute**: the key's owner runs the inner service in its own task, streams the
//! response to the client while capturing it, and records the outcome.
//!
//! Why a task: the operation must run to its end even when the client disconnects, or its
//! outcome would be unknown (the record would sit in flight until the lease ran out and a retry
//! ran it again). The request future only waits for the response head; if it is dropped, the
//! task carries on, captures the whole body and completes or releases the key.
//!
//! Why the last frame is held back: the record must be durable before the client has the
//! complete response, so a client that saw the whole response and retries always gets the
//! replay. Every frame is forwarded as soon as the next one arrives; the last one goes out only
//! after [`Execution::finish`] returned. A slow client does not hold the record up while the
//! body is within the capture limit (see [`super::downstream`]).

use std::any::Any;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::HeaderValue;
use http::{Request, Response};
use http_body::Frame;
use http_body_util::BodyExt;
use idemgate_core::engine::{Execution, Outcome, is_final};
use idemgate_core::headers::{rfc3339, storable as storable_headers, value as header_value};
use idemgate_core::record::{StoredResponse, now_millis};
use idemgate_core::store::Store;
use tokio::sync::{mpsc, oneshot};
use tower_service::Service;

use super::config::Config;
use super::downstream::Downstream;
use super::{BoxError, IDEMPOTENCY_EXPIRES, IDEMPOTENCY_STATUS, IdempotencyInfo, OPERATION_ID, ResponseBody};
use crate::problem::{Problem, ProblemKind};

/// Frames in the channel between the execution task and the client; more wait in the
/// [`Downstream`] backlog while they are being captured anyway.
const FRAME_BUFFER: usize = 4;

type Head<B, E> = Result<Result<Response<ResponseBody<B>>, E>, Box<dyn Any + Send>>;

/// Calls `inner` as the key's owner and returns the response head with a streamed body.
pub(crate) async fn spawn<S, St, P, ReqBody, ResBody>(
    mut inner: S,
    mut req: Request<ReqBody>,
    exec: Execution<St>,
    key: String,
    config: Arc<Config<P>>,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
    St: Store,
    P: Send + Sync + 'static,
{
    let operation_id = exec.operation_id().to_owned();
    // Paused past the lease since `begin`: another request may have taken the key over and run
    // the handler (`Execution::lease_held`). The key is released if it is still ours.
    if !exec.lease_held() {
        exec.withdraw().await;
        return Ok(Problem::new(
            ProblemKind::RequestInFlight,
            "the lease on this key ran out before the request reached the handler; another attempt may hold it",
        )
        .operation(operation_id)
        .retry_after(1)
        .into_response());
    }
    req.extensions_mut().insert(IdempotencyInfo {
        key,
        operation_id: operation_id.clone(),
    });
    let future = inner.call(req);
    let (tx, rx) = oneshot::channel();
    let task = drive(future, exec, config.clone(), tx);
    match &config.tasks {
        Some(tracker) => drop(tracker.spawn(task)),
        None => drop(tokio::spawn(task)),
    }
    match rx.await {
        Ok(Ok(result)) => result,
        // The handler panicked: the key is already released; unwind into the caller as if
        // there were no layer.
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        // The runtime is shutting down under the task.
        Err(_) => Ok(
            Problem::new(ProblemKind::UpstreamUnavailable, "the execution failed")
                .operation(operation_id)
                .into_response(),
        ),
    }
}

async fn drive<F, B, E, St, P>(
    future: F,
    exec: Execution<St>,
    config: Arc<Config<P>>,
    head_tx: oneshot::Sender<Head<B, E>>,
) where
    F: Future<Output = Result<Response<B>, E>> + Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    E: Send + 'static,
    St: Store,
{
    // The handler runs in a task of its own so that a panic in it arrives here as a JoinError
    // (and the key is released) instead of unwinding through this bookkeeping.
    let resp = match tokio::spawn(future).await {
        Ok(Ok(resp)) => resp,
        Ok(Err(e)) => {
            finish(exec, Outcome::NoResponse).await;
            let _ = head_tx.send(Ok(Err(e)));
            return;
        }
        Err(join) => {
            finish(exec, Outcome::NoResponse).await;
            if let Ok(panic) = join.try_into_panic() {
                let _ = head_tx.send(Err(panic));
            }
            return;
        }
    };
    let (mut head, body) = resp.into_parts();
    let status = head.status.as_u16();
    let stored_headers = storable_headers(&head.headers);
    let engine = &config.engine;
    let is_stored = is_final(status, engine.store_server_errors);
    head.headers
        .insert(OPERATION_ID, header_value(exec.operation_id()));
    if is_stored {
        // The head leaves before the record is written, so this is when the record would end if
        // it were completed now; the real end is later by the time the body takes to stream,
        // never earlier.
        head.headers.insert(
            IDEMPOTENCY_EXPIRES,
            rfc3339(now_millis() + millis(engine.retention)),
        );
    }
    if config.procedure.is_some() && head.status.is_success() {
        head.headers
            .insert(IDEMPOTENCY_STATUS, HeaderValue::from_static("processing"));
    }
    let (tx, rx) = mpsc::channel(FRAME_BUFFER);
    let hint = body.size_hint();
    let streamed = Response::from_parts(head, ResponseBody::streamed(rx, hint));
    // A client that went away is not an error: the body is still read and recorded.
    let mut client = Downstream::new(head_tx.send(Ok(Ok(streamed))).is_ok().then_some(tx));

    let mut body = std::pin::pin!(body);
    // `None` once the body is over the limit (or when the outcome will not be stored).
    let mut captured = is_stored.then(BytesMut::new);
    let mut held: Option<Frame<Bytes>> = None;
    // Errors are converted at once: the inner error type need not be `Send`.
    while let Some(frame) = body.frame().await.map(|f| f.map_err(Into::<BoxError>::into)) {
        let frame = match frame {
            Ok(frame) => frame,
            Err(e) => {
                // The outcome is unknown to the client: release, so that a retry runs again,
                // and break the client's response so it knows to retry.
                tracing::warn!(error = %e, "the response body broke off; the key is released");
                finish(exec, Outcome::NoResponse).await;
                if let Some(prev) = held {
                    client.send(Ok(prev)).await;
                }
                client.send(Err(e)).await;
                return;
            }
        };
        if let (Some(buf), Some(data)) = (captured.as_mut(), frame.data_ref()) {
            if buf.len() + data.len() > engine.max_response_bytes {
                captured = None;
            } else {
                buf.extend_from_slice(data);
            }
        }
        if let Some(prev) = held.replace(frame) {
            if captured.is_some() {
                client.offer(Ok(prev));
            } else {
                client.send(Ok(prev)).await;
            }
        }
    }
    let stored = StoredResponse {
        status,
        headers: stored_headers,
        // Its own allocation (`freeze` of a buffer we filled), never a view into the frames.
        body: captured.map(BytesMut::freeze),
    };
    finish(exec, Outcome::Response(stored)).await;
    if let Some(last) = held {
        client.send(Ok(last)).await;
    }
    // Dropping `client` ends the stream.
}

async fn finish<St: Store>(exec: Execution<St>, outcome: Outcome) {
    if let Err(e) = exec.finish(outcome).await {
        // The client still gets the response: the operation ran. The record stays in flight
        // and the lease rule decides what a retry gets (the gateway's rule too).
        tracing::error!(error = %e, "could not record the outcome");
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
