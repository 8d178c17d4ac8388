//! [`Idempotency`]: the service the layer wraps around an inner service.
//!
//! Its `call` runs the phases that need only the request head (policy, key, principal,
//! namespace) synchronously, then hands the rest to [`super::dedup`].

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use idemgate_core::engine::Engine;
use idemgate_core::store::Store;
use tower_service::Service;

use super::config::Config;
use super::future::ResponseFuture;
use super::{BoxError, ResponseBody, dedup};
use crate::principal::{FromExtensions, PrincipalSource};

/// Deduplicates requests by their `Idempotency-Key` before they reach `S`.
///
/// Built by [`IdempotencyLayer`](super::IdempotencyLayer); see the [module docs](super) for
/// what each request goes through.
pub struct Idempotency<S, St, P = FromExtensions> {
    pub(crate) inner: S,
    pub(crate) engine: Engine<St>,
    pub(crate) config: Arc<Config<P>>,
}

impl<S: Clone, St, P> Clone for Idempotency<S, St, P> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            engine: self.engine.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S: std::fmt::Debug, St, P> std::fmt::Debug for Idempotency<S, St, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<S, St, P> Idempotency<S, St, P> {
    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The engine this service calls (and its store).
    pub fn engine(&self) -> &Engine<St> {
        &self.engine
    }
}

impl<S, St, P, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S, St, P>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: http_body::Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
    St: Store,
    P: PrincipalSource,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let (parts, body) = req.into_parts();
        let raw = match self.config.read_key(&parts) {
            Ok(Some(raw)) => raw,
            Ok(None) => {
                return ResponseFuture::passthrough(self.inner.call(Request::from_parts(parts, body)));
            }
            Err(problem) => return ResponseFuture::ready(problem.into_response()),
        };
        let key = match self.config.namespace(&parts, &raw) {
            Ok(key) => key,
            Err(problem) => return ResponseFuture::ready(problem.into_response()),
        };
        // The service that `poll_ready` prepared goes with this request; a fresh clone stays
        // behind for the next one (the usual tower pattern for services called later).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::dedup(Box::pin(dedup::run(
            inner,
            self.engine.clone(),
            self.config.clone(),
            parts,
            body,
            key,
        )))
    }
}
