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
    fn complete(
        &self,
        key: &str,
        token: LeaseToken,
        response: StoredResponse,
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
        response: StoredResponse,
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
}
