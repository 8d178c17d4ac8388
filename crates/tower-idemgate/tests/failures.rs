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
        _: StoredResponse,
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
