//! A store `begin` that runs to its end even if the request that asked for it is dropped.
//!
//! A client that disconnects while its `begin` is on its way to a networked store drops the
//! request's future mid-call, yet the call may still take effect: the script or statement
//! already reached the server, or the embedded store's writer already queued the durable
//! reservation. That would leave a reservation nobody executes, renews or releases. The client's
//! retry would wait out the whole lease, and on a route with `on_lease_expiry: fail` it would
//! find the outcome unknown once the lease ran out, though the upstream never ran. (A PostgreSQL
//! connection cut off mid-statement is also closed rather than returned to its pool.)
//!
//! So a [`BeginCall`] dropped unfinished moves the call to a task of its own, and an answer
//! nobody will read that acquired the key (or that failed, and so may have) releases its token.
//! Nothing was executed, so freeing the key is exactly right: the retry executes. Like
//! `detach.rs` in the gateway, the call is polled in place and costs a task only when its
//! caller goes away.
//!
//! A call that fails while its caller is still there is left alone: the caller may forward the
//! request without deduplication (`on_store_error: fail_open`), and a reservation the call may
//! have made then keeps duplicates off while that runs, until its lease ends.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio_util::task::TaskTracker;

use crate::record::LeaseToken;
use crate::rules::{Begin, BeginRequest};
use crate::store::{Store, StoreError};

type Call = Pin<Box<dyn Future<Output = Result<Begin, StoreError>> + Send>>;

/// `store.begin(key, req)`, released if it acquires the key after its caller went away.
///
/// The store and the tracker are borrowed from the engine: only a call whose caller went away
/// needs its own handles, and takes them in `drop`.
pub(crate) struct BeginCall<'a, S: Store> {
    running: Option<Call>,
    store: &'a Arc<S>,
    /// Where the call goes if its caller does (the engine's background tasks).
    tasks: &'a TaskTracker,
    /// Shared with the call, which needs it too.
    key: Arc<str>,
    token: LeaseToken,
}

impl<'a, S: Store> BeginCall<'a, S> {
    pub(crate) fn new(store: &'a Arc<S>, tasks: &'a TaskTracker, key: &str, req: &BeginRequest<'_>) -> Self {
        let key: Arc<str> = key.into();
        let (inner, call_key) = (store.clone(), key.clone());
        let (route, operation_id) = (req.route.to_owned(), req.operation_id.to_owned());
        let BeginRequest {
            fingerprint,
            token,
            lease_ms,
            retention_ms,
            takeover,
            now,
            ..
        } = *req;
        let call = async move {
            let req = BeginRequest {
                fingerprint,
                route: &route,
                token,
                operation_id: &operation_id,
                lease_ms,
                retention_ms,
                takeover,
                now,
            };
            inner.begin(&call_key, &req).await
        };
        Self {
            running: Some(Box::pin(call)),
            store,
            tasks,
            key,
            token,
        }
    }
}

impl<S: Store> Future for BeginCall<'_, S> {
    type Output = Result<Begin, StoreError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // Out while it is polled: a call that panics is then gone, not finished by `drop`.
        let Some(mut call) = self.running.take() else {
            panic!("BeginCall polled after it finished");
        };
        let answer = call.as_mut().poll(cx);
        if answer.is_pending() {
            self.running = Some(call);
        }
        answer
    }
}

impl<S: Store> Drop for BeginCall<'_, S> {
    fn drop(&mut self) {
        let Some(call) = self.running.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime left to finish it on (the process is ending): the lease runs out.
            return;
        };
        let (store, key, token) = (self.store.clone(), self.key.clone(), self.token);
        // Tracked, so that a shutdown waits for the release instead of cutting it off.
        runtime.spawn(self.tasks.track_future(async move {
            // Acquired for nobody, or failed and so perhaps acquired: nobody will execute or
            // forward this request, so its token goes (a no-op if nothing was reserved).
            if matches!(
                call.await,
                Ok(Begin::Acquired { .. }) | Err(StoreError::Timeout | StoreError::Backend(_))
            ) && let Err(e) = store.release(&key, token).await
            {
                // Not fatal: the lease runs out as if the owner had died.
                tracing::warn!(error = %e, "releasing an abandoned attempt's key failed");
            }
        }));
    }
}
