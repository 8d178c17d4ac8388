//! Waiters on the process that ran the operation answer from the owner's handed-over outcome,
//! not by reading the store again.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use idemgate_core::engine::{Engine, Outcome, Policy, Started};
use idemgate_core::fingerprint::Fingerprint;
use idemgate_core::memory::MemoryStore;
use idemgate_core::notify::Notifier;
use idemgate_core::record::{LeaseToken, Millis, Record, StoredResponse};
use idemgate_core::rules::{Begin, BeginRequest};
use idemgate_core::store::{Store, StoreError};

/// The memory store, counting `begin` calls; `remote` makes it pose as a networked store.
struct Counting {
    inner: MemoryStore,
    begins: AtomicUsize,
    remote: bool,
}

impl Store for Counting {
    async fn begin(&self, key: &str, req: &BeginRequest<'_>) -> Result<Begin, StoreError> {
        self.begins.fetch_add(1, Ordering::SeqCst);
        self.inner.begin(key, req).await
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

fn response(body: &'static str) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), Bytes::from_static(b"application/json"))],
        body: Some(Bytes::from_static(body.as_bytes())),
    }
}

#[tokio::test]
async fn local_waiters_take_the_outcome_without_reading_the_store() {
    storm(false).await;
}

/// On a networked store a waiter subscribes before its first `begin`, so it asks once, not twice.
#[tokio::test]
async fn waiters_on_a_remote_store_ask_once() {
    storm(true).await;
}

async fn storm(remote: bool) {
    const WAITERS: usize = 50;
    let store = Arc::new(Counting {
        inner: MemoryStore::new(1 << 20),
        begins: AtomicUsize::new(0),
        remote,
    });
    let engine = Engine::new(store.clone());
    let (same, other) = (Fingerprint([1; 32]), Fingerprint([2; 32]));
    let policy = Policy::default();
    let Started::Execute(exec) = engine.begin("k", "r", same, &policy).await.unwrap() else {
        panic!("the first request executes");
    };
    let operation_id = exec.operation_id().to_owned();
    // Waiters for the same request; a request with another body or for another route is refused
    // at once (it never waits).
    let mut waiters = Vec::new();
    for i in 0..WAITERS + 2 {
        let (engine, policy) = (engine.clone(), policy.clone());
        let (fp, route) = match i {
            0 => (other, "r"),
            1 => (same, "other-route"),
            _ => (same, "r"),
        };
        waiters.push(tokio::spawn(async move {
            engine.begin("k", route, fp, &policy).await
        }));
    }
    // Each waiter asks twice before it sleeps (once, then again after subscribing), or once
    // when it subscribed first.
    let asked = 1 + if remote { WAITERS } else { 2 * WAITERS } + 2;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while store.begins.load(Ordering::SeqCst) < asked {
        assert!(
            tokio::time::Instant::now() < deadline,
            "waiters never went to sleep"
        );
        tokio::task::yield_now().await;
    }
    exec.finish(Outcome::Response(response(r#"{"id":"ord_1"}"#)))
        .await
        .unwrap();
    for (i, w) in waiters.into_iter().enumerate() {
        match (i, w.await.unwrap().unwrap()) {
            (0 | 1, Started::Mismatch { operation_id: op }) => assert_eq!(op, operation_id),
            (
                2..,
                Started::Replay {
                    response: r,
                    operation_id: op,
                    ..
                },
            ) => {
                assert_eq!(op, operation_id);
                assert_eq!(r, response(r#"{"id":"ord_1"}"#));
            }
            (i, other) => panic!("waiter {i}: {other:?}"),
        }
    }
    assert_eq!(
        store.begins.load(Ordering::SeqCst),
        asked,
        "a woken waiter read the store"
    );
    // A later request reads the store as usual and gets the same answer.
    let Started::Replay { operation_id: op, .. } = engine.begin("k", "r", same, &policy).await.unwrap()
    else {
        panic!("replay");
    };
    assert_eq!(op, operation_id);
}
