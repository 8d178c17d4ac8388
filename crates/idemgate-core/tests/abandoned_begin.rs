//! A client that goes away while its `begin` is on its way to the store leaves no reservation
//! behind: the call runs to its end, and the key it acquired for nobody is released
//! (`begin_call.rs`). Without that, the retry of a client that disconnected mid-begin waited
//! out the whole lease, and on an `on_lease_expiry: fail` route found the outcome unknown.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idemgate_core::engine::{Concurrency, Engine, LeaseExpiry, Policy, Started};
use idemgate_core::fingerprint::Fingerprint;
use idemgate_core::memory::MemoryStore;
use idemgate_core::notify::Notifier;
use idemgate_core::record::{LeaseToken, Millis, Record, RecordState, StoredResponse, now_millis};
use idemgate_core::rules::{Begin, BeginRequest};
use idemgate_core::store::{Store, StoreError};

/// The memory store, whose `begin` takes effect at once and answers only after `reply_after`,
/// like a networked store whose reply is still on the wire. `remote` makes it pose as one.
struct SlowReply {
    inner: MemoryStore,
    reply_after: Duration,
    remote: bool,
}

impl Store for SlowReply {
    async fn begin(&self, key: &str, req: &BeginRequest<'_>) -> Result<Begin, StoreError> {
        let answer = self.inner.begin(key, req).await;
        tokio::time::sleep(self.reply_after).await;
        answer
    }
    async fn complete(
        &self,
        key: &str,
        token: LeaseToken,
        response: StoredResponse,
        retention_ms: u64,
        now: Millis,
    ) -> Result<(), StoreError> {
        self.inner.complete(key, token, response, retention_ms, now).await
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

#[tokio::test]
async fn a_networked_begin_dropped_mid_call_frees_the_key() {
    freed_after_a_dropped_begin(true, LeaseExpiry::Retry).await;
}

#[tokio::test]
async fn a_reservation_that_may_not_be_taken_over_is_freed_too() {
    freed_after_a_dropped_begin(false, LeaseExpiry::Fail).await;
}

async fn freed_after_a_dropped_begin(remote: bool, on_lease_expiry: LeaseExpiry) {
    let store = Arc::new(SlowReply {
        inner: MemoryStore::new(1 << 20),
        reply_after: Duration::from_millis(300),
        remote,
    });
    let engine = Engine::new(store.clone());
    let policy = Policy {
        // Far longer than the test: only a release frees the key in time.
        lease: Duration::from_secs(60),
        concurrent: Concurrency::Reject,
        on_lease_expiry,
        ..Policy::default()
    };
    let fp = Fingerprint([7; 32]);
    // The client goes away while the store's answer is still on its way.
    let first = tokio::time::timeout(Duration::from_millis(50), engine.begin("k", "r", fp, &policy)).await;
    assert!(first.is_err(), "the first request was dropped mid-begin");
    assert!(
        matches!(
            store.inner.get("k", now_millis()).await.unwrap().map(|r| r.state),
            Some(RecordState::InFlight { .. })
        ),
        "its begin took effect in the store"
    );
    // Its retry executes once the abandoned call has answered and released, long before the
    // 60 s lease would have run out.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match engine.begin("k", "r", fp, &policy).await.unwrap() {
            Started::Execute(_) => break,
            Started::InFlight { .. } => {
                assert!(Instant::now() < deadline, "the key stayed reserved for nobody");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            _ => panic!("the retry neither executed nor saw the key in flight"),
        }
    }
}
