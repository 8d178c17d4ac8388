//! A store for the engine's tests: the memory store, with knobs that make it behave like the
//! other stores at the moments those tests are about.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idemgate_core::memory::MemoryStore;
use idemgate_core::notify::Notifier;
use idemgate_core::record::{LeaseToken, Millis, Record, StoredResponse};
use idemgate_core::rules::{Begin, BeginRequest};
use idemgate_core::store::{Store, StoreError};

pub struct TestStore {
    pub inner: MemoryStore,
    /// `begin` calls so far.
    pub begins: AtomicUsize,
    /// Poses as a networked store (`Store::remote`).
    pub remote: bool,
    /// Wakes the key's waiters on its own when an outcome is recorded, and lets them run before
    /// the owner hands the outcome over (as the embedded store's journal thread and a networked
    /// store's notifications can).
    pub early_wake: bool,
    /// `begin` takes effect at once and answers only this long after, like a networked store
    /// whose reply is still on the wire.
    pub reply_after: Duration,
}

impl TestStore {
    pub fn new() -> Self {
        Self {
            inner: MemoryStore::new(1 << 20),
            begins: AtomicUsize::new(0),
            remote: false,
            early_wake: false,
            reply_after: Duration::ZERO,
        }
    }
}

impl Store for TestStore {
    async fn begin(&self, key: &str, req: &BeginRequest<'_>) -> Result<Begin, StoreError> {
        self.begins.fetch_add(1, Ordering::SeqCst);
        let answer = self.inner.begin(key, req).await;
        if !self.reply_after.is_zero() {
            tokio::time::sleep(self.reply_after).await;
        }
        answer
    }
    async fn complete(
        &self,
        key: &str,
        token: LeaseToken,
        response: &StoredResponse,
        retention_ms: u64,
        now: Millis,
    ) -> Result<(), StoreError> {
        let done = self.inner.complete(key, token, response, retention_ms, now).await;
        if self.early_wake {
            self.inner.notifier().notify(key);
            for _ in 0..100 {
                tokio::task::yield_now().await;
            }
        }
        done
    }
    async fn release(&self, key: &str, token: LeaseToken) -> Result<(), StoreError> {
        self.inner.release(key, token).await
    }
    async fn renew(&self, key: &str, token: LeaseToken, until: Millis) -> Result<(), StoreError> {
        self.inner.renew(key, token, until).await
    }
    async fn get(&self, key: &str, now: Millis) -> Result<Option<Record>, StoreError> {
        self.inner.get(key, now).await
    }
    async fn purge(&self, key: &str) -> Result<bool, StoreError> {
        self.inner.purge(key).await
    }
    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }
    fn notifier(&self) -> &Arc<Notifier> {
        self.inner.notifier()
    }
    fn remote(&self) -> bool {
        self.remote
    }
}
