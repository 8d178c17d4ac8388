//! Procedure hooks, store failures and oversized requests.

mod common;

use std::sync::Arc;

use common::app::start;
use common::{Counter, Gate, http};
use idemgate_core::MemoryStore;
use idemgate_core::notify::Notifier;
use idemgate_core::record::{LeaseToken, Millis, Record, StoredResponse};
use idemgate_core::rules::{Begin, BeginRequest};
use idemgate_core::store::{Store, StoreError};
use tower_idemgate::procedure::{JsonPointer, ResourceStatus};
use tower_idemgate::{IdempotencyLayer, OnStoreError, Scope};

/// Procedure hooks: the first response says processing, replays resolve the resource's status;
/// a failing resolver falls back to processing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn procedure_hooks_give_idempotency_status_on_replays() {
    let store = Arc::new(MemoryStore::new(1 << 20));
    let resolved = Arc::new(Counter::default());
    let seen = resolved.clone();
    let procedure = JsonPointer::new("/id", move |id: String| {
        seen.bump();
        async move {
            match id.as_str() {
                "ord_1" => Ok(ResourceStatus::Completed),
                _ => Err("outbox unreachable".into()),
            }
        }
    });
    let layer = IdempotencyLayer::new(store)
        .scope(Scope::Global)
        .procedure(procedure);
    let (url, _app) = start(layer, Gate::opened()).await;
    let send = |key: String| http().post(&url).header("idempotency-key", key).body("{}").send();
    let (k1, k2) = (common::key("proc1"), common::key("proc2"));
    let first = send(k1.clone()).await.unwrap();
    assert_eq!(first.headers()["idempotency-status"], "processing");
    assert_eq!(
        send(k1).await.unwrap().headers()["idempotency-status"],
        "completed"
    );
    assert_eq!(
        send(k2.clone()).await.unwrap().headers()["idempotency-status"],
        "processing"
    );
    // ord_2's resolver fails: processing, with a logged warning.
    assert_eq!(
        send(k2).await.unwrap().headers()["idempotency-status"],
        "processing"
    );
    assert_eq!(resolved.get(), 2, "only replays resolve");
}

/// A store that always fails.
#[derive(Default)]
struct DownStore {
    notifier: Arc<Notifier>,
}

fn down() -> StoreError {
    StoreError::backend(std::io::Error::other("store down"))
}

impl Store for DownStore {
    async fn begin(&self, _: &str, _: &BeginRequest<'_>) -> Result<Begin, StoreError> {
        Err(down())
    }
    async fn complete(
        &self,
        _: &str,
        _: LeaseToken,
        _: &StoredResponse,
        _: u64,
        _: Millis,
    ) -> Result<(), StoreError> {
        Err(down())
    }
    async fn release(&self, _: &str, _: LeaseToken) -> Result<(), StoreError> {
        Err(down())
    }
    async fn renew(&self, _: &str, _: LeaseToken, _: Millis) -> Result<(), StoreError> {
        Err(down())
    }
    async fn get(&self, _: &str, _: Millis) -> Result<Option<Record>, StoreError> {
        Err(down())
    }
    async fn purge(&self, _: &str) -> Result<bool, StoreError> {
        Err(down())
    }
    async fn ping(&self) -> Result<(), StoreError> {
        Err(down())
    }
    fn notifier(&self) -> &Arc<Notifier> {
        &self.notifier
    }
}

/// `on_store_error`: required routes fail closed (503 with Retry-After), accepted routes fail
/// open (the handler runs without dedup); either can be chosen explicitly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_errors_fail_closed_or_open() {
    let store = Arc::new(DownStore::default());
    let base = IdempotencyLayer::new(store).scope(Scope::Global);
    let key = common::key("down");
    let post = |url: String| {
        let key = key.clone();
        async move {
            http()
                .post(url)
                .header("idempotency-key", key)
                .body("{}")
                .send()
                .await
                .unwrap()
        }
    };

    let (required, app) = start(base.clone().required(), Gate::opened()).await;
    let resp = post(required).await;
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.headers()["retry-after"], "1");
    assert!(resp.text().await.unwrap().contains("store-unavailable"));
    assert_eq!(app.executions.get(), 0);

    let (accepted, app) = start(base.clone().accepted(), Gate::opened()).await;
    let resp = post(accepted).await;
    assert_eq!(resp.status(), 201);
    assert!(!resp.headers().contains_key("x-operation-id"));
    assert_eq!(app.executions.get(), 1);

    let (closed, app) = start(
        base.accepted().on_store_error(OnStoreError::FailClosed),
        Gate::opened(),
    )
    .await;
    assert_eq!(post(closed).await.status(), 503);
    assert_eq!(app.executions.get(), 0);
}

/// A request body over `max_request_bytes` is 413 before the store is asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_request_bodies_are_413() {
    let store = Arc::new(MemoryStore::new(1 << 20));
    let (url, app) = start(
        IdempotencyLayer::new(store.clone())
            .scope(Scope::Global)
            .max_request_bytes(16),
        Gate::opened(),
    )
    .await;
    let resp = http()
        .post(&url)
        .header("idempotency-key", "big")
        .body("x".repeat(17))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 413);
    assert!(resp.text().await.unwrap().contains("payload-too-large"));
    assert_eq!(app.executions.get(), 0);
    assert!(store.is_empty());
}

/// A memory store whose `begin` answers only after `delay` while `slow` is set: a store answer
/// slower than the lease, as a paused process sees one.
struct SlowBegin {
    inner: MemoryStore,
    slow: std::sync::atomic::AtomicBool,
    delay: std::time::Duration,
}

impl SlowBegin {
    fn new(delay: std::time::Duration) -> Arc<Self> {
        Arc::new(Self {
            inner: MemoryStore::new(1 << 20),
            slow: true.into(),
            delay,
        })
    }

    fn fast(&self) {
        self.slow.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Store for SlowBegin {
    async fn begin(&self, key: &str, req: &BeginRequest<'_>) -> Result<Begin, StoreError> {
        let answer = self.inner.begin(key, req).await;
        if self.slow.load(std::sync::atomic::Ordering::SeqCst) {
            tokio::time::sleep(self.delay).await;
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
        self.inner.ping().await
    }
    fn notifier(&self) -> &Arc<Notifier> {
        self.inner.notifier()
    }
}

/// A `begin` answered after its lease ran out does not run the handler: another request may
/// have taken the key over meanwhile (docs/lifecycle.md). The layer answers 409 and releases the
/// key; the retry runs the handler once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_begin_answered_after_its_lease_ran_out_does_not_run_the_handler() {
    let store = SlowBegin::new(std::time::Duration::from_millis(150));
    let layer = IdempotencyLayer::new(store.clone())
        .scope(Scope::Global)
        .lease(std::time::Duration::from_millis(100));
    let (url, app) = start(layer, Gate::opened()).await;
    let key = common::key("late");
    let send = || {
        http()
            .post(&url)
            .header("idempotency-key", &key)
            .body("{}")
            .send()
    };
    let late = send().await.unwrap();
    assert_eq!(late.status(), 409);
    assert_eq!(late.headers()["retry-after"], "1");
    assert_eq!(app.executions.get(), 0, "the handler did not run");
    store.fast();
    assert_eq!(send().await.unwrap().status(), 201, "released: the retry runs");
    assert_eq!(app.executions.get(), 1);
}

/// The same for `once`: the closure does not run on a lease that ran out before it started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_does_not_run_on_a_lease_that_ran_out() {
    use tower_idemgate::once::{Namespace, Once, OnceError, fingerprint};
    let store = SlowBegin::new(std::time::Duration::from_millis(150));
    let once = Once::new(store.clone()).lease(std::time::Duration::from_millis(100));
    let (ns, token) = (Namespace::global("late"), common::key("late-once"));
    let runs = Arc::new(Counter::default());
    let run = |runs: Arc<Counter>| async move { Ok::<_, String>(runs.bump()) };
    let late = once.run(&ns, &token, fingerprint(&1), run(runs.clone())).await;
    assert!(matches!(late, Err(OnceError::InFlight { .. })), "{late:?}");
    assert_eq!(runs.get(), 0, "the closure did not run");
    store.fast();
    let done = once.run(&ns, &token, fingerprint(&1), run(runs.clone())).await;
    assert_eq!(done.unwrap(), 1, "released: the next call runs it");
}
