//! The [`Store`] trait every record backend implements, and its error type.
//!
//! A store is small on purpose: five atomic operations over one record, a way to read and purge
//! a record, a readiness check, and the [`Notifier`] its waiters subscribe to. The rules of each
//! operation live in [`crate::rules`]; a store only makes them atomic and durable.
//!
//! Every mutating operation is idempotent for the owner of the lease: a call retried after it
//! already took effect (a lost reply) gives the same answer, never a false conflict.

use std::future::Future;
use std::sync::Arc;

use crate::notify::Notifier;
use crate::record::{LeaseToken, Millis, Record, StoredResponse};
use crate::rules::{Begin, BeginRequest};

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The token does not own the record (taken over, purged, or expired).
    #[error(transparent)]
    Fenced(#[from] crate::rules::Fenced),
    /// The store refuses new reservations (memory budget exhausted).
    #[error("store is full")]
    Full,
    /// The store did not answer within its bound.
    #[error("store operation timed out")]
    Timeout,
    /// The backend failed (I/O, connection, protocol).
    #[error("store backend failed")]
    Backend(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// A stored record could not be decoded.
    #[error("stored record is corrupt")]
    Corrupt(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl StoreError {
    /// Wraps a backend error, keeping it as the `source()`.
    pub fn backend(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::Backend(Box::new(e))
    }
}

/// A record backend. Implementations are `Send + Sync` and shared behind an `Arc`.
pub trait Store: Send + Sync + 'static {
    /// Atomically applies [`crate::rules::begin`] to the key's record.
    fn begin(
        &self,
        key: &str,
        req: &BeginRequest<'_>,
    ) -> impl Future<Output = Result<Begin, StoreError>> + Send;

    /// The owner stores its final outcome; durable before this returns (for durable stores).
    /// The response is borrowed: the caller keeps it to try again after a store error, and a
    /// store copies what it keeps. Its body may be a view into a larger buffer (the gateway
    /// hands over the body as read from the upstream), so a store never keeps the caller's
    /// `Bytes` beyond the call: the memory, Redis and PostgreSQL stores encode the response, and
    /// the embedded store, which holds it until its commit, holds
    /// [`StoredResponse::compacted`].
    fn complete(
        &self,
        key: &str,
        token: LeaseToken,
        response: &StoredResponse,
        retention_ms: u64,
        now: Millis,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The owner gives the key back (transient outcome).
    fn release(&self, key: &str, token: LeaseToken) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The owner extends its lease to `lease_until`.
    fn renew(
        &self,
        key: &str,
        token: LeaseToken,
        lease_until: Millis,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Reads a record (expired records read as `None`).
    fn get(&self, key: &str, now: Millis) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send;

    /// Removes a record whatever its state; `true` if one existed. The operator's escape hatch.
    fn purge(&self, key: &str) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Whether the store answers (readiness).
    fn ping(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The registry waiters subscribe to; the store notifies it after complete and release.
    fn notifier(&self) -> &Arc<Notifier>;

    /// Whether each call is a network round trip. A request that may wait then subscribes to
    /// notifications before its first `begin` (one round trip per waiter, not two: the second
    /// `begin` closes the race between a first answer and a late subscription). Local stores
    /// answer in microseconds and spare requests that never wait the subscription.
    fn remote(&self) -> bool {
        false
    }
}

impl<S: Store> Store for Arc<S> {
    fn begin(
        &self,
        key: &str,
        req: &BeginRequest<'_>,
    ) -> impl Future<Output = Result<Begin, StoreError>> + Send {
        (**self).begin(key, req)
    }
    fn complete(
        &self,
        key: &str,
        token: LeaseToken,
        response: &StoredResponse,
        retention_ms: u64,
        now: Millis,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        (**self).complete(key, token, response, retention_ms, now)
    }
    fn release(&self, key: &str, token: LeaseToken) -> impl Future<Output = Result<(), StoreError>> + Send {
        (**self).release(key, token)
    }
    fn renew(
        &self,
        key: &str,
        token: LeaseToken,
        lease_until: Millis,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        (**self).renew(key, token, lease_until)
    }
    fn get(&self, key: &str, now: Millis) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send {
        (**self).get(key, now)
    }
    fn purge(&self, key: &str) -> impl Future<Output = Result<bool, StoreError>> + Send {
        (**self).purge(key)
    }
    fn ping(&self) -> impl Future<Output = Result<(), StoreError>> + Send {
        (**self).ping()
    }
    fn notifier(&self) -> &Arc<Notifier> {
        (**self).notifier()
    }
    fn remote(&self) -> bool {
        (**self).remote()
    }
}

/// A boxed, sendable future: what [`DynStore`] returns so that it stays object-safe.
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The object-safe twin of [`Store`], for callers who pick a backend at run time and hold it as
/// `Arc<dyn DynStore>` (which is itself a [`Store`]).
///
/// Every [`Store`] is a `DynStore` through a blanket impl; nobody implements this by hand. The
/// price is one allocation per store call, which is why the engine and the tower layer stay
/// generic over `S: Store` and only box when the caller asked for `dyn`.
pub trait DynStore: Send + Sync + 'static {
    /// [`Store::begin`], boxed.
    fn begin_dyn<'a>(
        &'a self,
        key: &'a str,
        req: &'a BeginRequest<'a>,
    ) -> BoxFuture<'a, Result<Begin, StoreError>>;
    /// [`Store::complete`], boxed.
    fn complete_dyn<'a>(
        &'a self,
        key: &'a str,
        token: LeaseToken,
        response: &'a StoredResponse,
        retention_ms: u64,
        now: Millis,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
    /// [`Store::release`], boxed.
    fn release_dyn<'a>(&'a self, key: &'a str, token: LeaseToken) -> BoxFuture<'a, Result<(), StoreError>>;
    /// [`Store::renew`], boxed.
    fn renew_dyn<'a>(
        &'a self,
        key: &'a str,
        token: LeaseToken,
        lease_until: Millis,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
    /// [`Store::get`], boxed.
    fn get_dyn<'a>(&'a self, key: &'a str, now: Millis) -> BoxFuture<'a, Result<Option<Record>, StoreError>>;
    /// [`Store::purge`], boxed.
    fn purge_dyn<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool, StoreError>>;
    /// [`Store::ping`], boxed.
    fn ping_dyn(&self) -> BoxFuture<'_, Result<(), StoreError>>;
    /// [`Store::notifier`].
    fn notifier_dyn(&self) -> &Arc<Notifier>;
    /// [`Store::remote`].
    fn remote_dyn(&self) -> bool;
}

impl<S: Store> DynStore for S {
    fn begin_dyn<'a>(
        &'a self,
        key: &'a str,
        req: &'a BeginRequest<'a>,
    ) -> BoxFuture<'a, Result<Begin, StoreError>> {
        Box::pin(self.begin(key, req))
    }
    fn complete_dyn<'a>(
        &'a self,
        key: &'a str,
        token: LeaseToken,
        response: &'a StoredResponse,
        retention_ms: u64,
        now: Millis,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.complete(key, token, response, retention_ms, now))
    }
    fn release_dyn<'a>(&'a self, key: &'a str, token: LeaseToken) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.release(key, token))
    }
    fn renew_dyn<'a>(
        &'a self,
        key: &'a str,
        token: LeaseToken,
        lease_until: Millis,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.renew(key, token, lease_until))
    }
    fn get_dyn<'a>(&'a self, key: &'a str, now: Millis) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        Box::pin(self.get(key, now))
    }
    fn purge_dyn<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(self.purge(key))
    }
    fn ping_dyn(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(self.ping())
    }
    fn notifier_dyn(&self) -> &Arc<Notifier> {
        self.notifier()
    }
    fn remote_dyn(&self) -> bool {
        self.remote()
    }
}

impl Store for Arc<dyn DynStore> {
    // `async fn` rather than returning the boxed future itself: the box borrows several
    // lifetimes at once, which an `impl Future` return type cannot name.
    async fn begin(&self, key: &str, req: &BeginRequest<'_>) -> Result<Begin, StoreError> {
        (**self).begin_dyn(key, req).await
    }
    async fn complete(
        &self,
        key: &str,
        token: LeaseToken,
        response: &StoredResponse,
        retention_ms: u64,
        now: Millis,
    ) -> Result<(), StoreError> {
        (**self)
            .complete_dyn(key, token, response, retention_ms, now)
            .await
    }
    async fn release(&self, key: &str, token: LeaseToken) -> Result<(), StoreError> {
        (**self).release_dyn(key, token).await
    }
    async fn renew(&self, key: &str, token: LeaseToken, lease_until: Millis) -> Result<(), StoreError> {
        (**self).renew_dyn(key, token, lease_until).await
    }
    async fn get(&self, key: &str, now: Millis) -> Result<Option<Record>, StoreError> {
        (**self).get_dyn(key, now).await
    }
    async fn purge(&self, key: &str) -> Result<bool, StoreError> {
        (**self).purge_dyn(key).await
    }
    async fn ping(&self) -> Result<(), StoreError> {
        (**self).ping_dyn().await
    }
    fn notifier(&self) -> &Arc<Notifier> {
        (**self).notifier_dyn()
    }
    fn remote(&self) -> bool {
        (**self).remote_dyn()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Engine, Outcome, Policy, Started};
    use crate::fingerprint::Fingerprint;
    use crate::memory::MemoryStore;

    #[tokio::test]
    async fn a_dyn_store_runs_the_engine() {
        let store: Arc<dyn DynStore> = Arc::new(MemoryStore::new(1 << 20));
        let engine = Engine::new(Arc::new(store));
        let policy = Policy::default();
        let fp = Fingerprint([7; 32]);
        let Started::Execute(exec) = engine.begin("k", "r", fp, &policy).await.unwrap() else {
            panic!("first begin executes");
        };
        let response = StoredResponse {
            status: 201,
            headers: vec![],
            body: Some("done".into()),
        };
        exec.finish(Outcome::Response(response)).await.unwrap();
        let again = engine.begin("k", "r", fp, &policy).await.unwrap();
        assert!(
            matches!(again, Started::Replay { response, .. } if response.body.as_deref() == Some(&b"done"[..]))
        );
    }
}
