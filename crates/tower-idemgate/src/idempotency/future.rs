//! [`ResponseFuture`]: what [`Idempotency`](super::Idempotency) returns for each request.
//!
//! Three shapes, so the cheap paths stay cheap:
//!
//! - **passthrough** (no key on an `accepted` or `prohibited` route): the inner future itself,
//!   polled in place, nothing allocated;
//! - **ready** (a refusal decided from the head alone: missing, invalid or forbidden key, no
//!   principal): the problem response, nothing allocated beyond its bytes;
//! - **dedup**: reading the body, the store round trip and the replay or execution. This is one
//!   boxed future per deduplicated request, because the store's `async fn` futures cannot be
//!   named on stable Rust; the store calls inside it are statically dispatched.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;
use pin_project_lite::pin_project;

use super::ResponseBody;

/// The inner service's future, with its body and error types named (a helper so that
/// [`ResponseFuture`] needs one type parameter). Implemented for every fitting future.
pub trait InnerFuture: Future<Output = Result<Response<Self::Body>, Self::Error>> {
    /// The inner response body.
    type Body;
    /// The inner service error.
    type Error;
}

impl<F, B, E> InnerFuture for F
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Body = B;
    type Error = E;
}

type Output<F> = Result<Response<ResponseBody<<F as InnerFuture>::Body>>, <F as InnerFuture>::Error>;

pub(crate) type DedupFuture<F> = Pin<Box<dyn Future<Output = Output<F>> + Send>>;

pin_project! {
    /// The response future of [`Idempotency`](super::Idempotency).
    pub struct ResponseFuture<F>
    where
        F: InnerFuture,
    {
        #[pin]
        state: State<F>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F>
    where
        F: InnerFuture,
    {
        Passthrough { #[pin] future: F },
        Ready { response: Option<Response<ResponseBody<F::Body>>> },
        Dedup { future: DedupFuture<F> },
    }
}

impl<F: InnerFuture> ResponseFuture<F> {
    pub(crate) fn passthrough(future: F) -> Self {
        Self {
            state: State::Passthrough { future },
        }
    }

    pub(crate) fn ready(response: Response<ResponseBody<F::Body>>) -> Self {
        Self {
            state: State::Ready {
                response: Some(response),
            },
        }
    }

    pub(crate) fn dedup(future: DedupFuture<F>) -> Self {
        Self {
            state: State::Dedup { future },
        }
    }
}

impl<F: InnerFuture> std::fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            State::Passthrough { .. } => "passthrough",
            State::Ready { .. } => "ready",
            State::Dedup { .. } => "dedup",
        };
        f.debug_struct("ResponseFuture").field("state", &state).finish()
    }
}

impl<F: InnerFuture> Future for ResponseFuture<F> {
    type Output = Output<F>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Passthrough { future } => future
                .poll(cx)
                .map(|r| r.map(|resp| resp.map(ResponseBody::inner))),
            StateProj::Ready { response } => Poll::Ready(Ok(response
                .take()
                .expect("ResponseFuture polled after completion"))),
            StateProj::Dedup { future } => future.as_mut().poll(cx),
        }
    }
}
