//! Every example runs here: its service is served over loopback and driven like its docs say.

mod common;

#[path = "../examples/client.rs"]
#[allow(dead_code)]
mod client_example;
#[path = "../examples/handler_internal.rs"]
#[allow(dead_code)]
mod handler_internal;
#[path = "../examples/hyper.rs"]
#[allow(dead_code)]
mod hyper_example;
#[path = "../examples/orders.rs"]
#[allow(dead_code)]
mod orders;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use common::{http, serve, within};
use idemgate_core::MemoryStore;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_example() {
    let state = orders::Orders::default();
    let addr = serve(orders::app(Arc::new(MemoryStore::new(1 << 20)), state.clone())).await;
    let url = format!("http://{addr}/orders");
    let send = |user: &'static str, body: &'static str| {
        http()
            .post(&url)
            .header("authorization", format!("Bearer {user}"))
            .header("idempotency-key", "order-1")
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let first = send("alice", r#"{"amount": 100}"#).await.unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(first.headers()["idempotency-status"], "processing");
    assert_eq!(first.text().await.unwrap(), r#"{"amount":100,"id":"ord_1"}"#);
    let replay = send("alice", r#"{ "amount":100 }"#).await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(
        replay.headers()["idempotency-status"],
        "completed",
        "ord_1 is odd: completed"
    );
    let bob = send("bob", r#"{"amount": 100}"#).await.unwrap();
    assert!(!bob.headers().contains_key("idempotent-replayed"));
    assert_eq!(send("alice", r#"{"amount": 999}"#).await.unwrap().status(), 422);
    let no_key = http()
        .post(&url)
        .header("authorization", "Bearer alice")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(no_key.status(), 400);
    assert_eq!(state.created.load(Ordering::SeqCst), 2);
    let count = http()
        .get(format!("http://{addr}/orders/count"))
        .header("authorization", "Bearer x")
        .send()
        .await
        .unwrap();
    assert_eq!(count.text().await.unwrap(), "2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_internal_example() {
    let billing = handler_internal::Billing {
        store: Arc::new(MemoryStore::new(1 << 20)),
        charges: Arc::default(),
    };
    let addr = serve(handler_internal::app(billing.clone())).await;
    let tick = |tenant: &'static str, sub: &'static str, fired_at: &'static str| {
        http()
            .post(format!("http://{addr}/subscriptions/{sub}/charge"))
            .header("x-tenant-id", tenant)
            .header("content-type", "application/json")
            .body(format!(r#"{{"fired_at": "{fired_at}"}}"#))
            .send()
    };
    let first: handler_internal::Charge = tick("acme", "sub_9", "2026-11-22T00:00:05Z")
        .await
        .unwrap()
        .json_value()
        .await;
    let second: handler_internal::Charge = tick("acme", "sub_9", "2026-11-22T00:07:41Z")
        .await
        .unwrap()
        .json_value()
        .await;
    assert_eq!(first, second, "two ticks in one period are one charge");
    assert_eq!(billing.charges.load(Ordering::SeqCst), 1);
    let next_month: handler_internal::Charge = tick("acme", "sub_9", "2026-12-01T00:00:02Z")
        .await
        .unwrap()
        .json_value()
        .await;
    assert_ne!(next_month.charge_id, first.charge_id);
    let other_tenant: handler_internal::Charge = tick("globex", "sub_9", "2026-11-22T00:00:05Z")
        .await
        .unwrap()
        .json_value()
        .await;
    assert_ne!(
        other_tenant.charge_id, first.charge_id,
        "tenants never share a token"
    );
    assert_eq!(billing.charges.load(Ordering::SeqCst), 3);
    assert_eq!(tick("acme", "sub_9", "garbage").await.unwrap().status(), 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hyper_example() {
    let dir = tempfile::tempdir().unwrap();
    let store = hyper_example::open(dir.path());
    let jobs = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/jobs", listener.local_addr().unwrap());
    tokio::spawn(hyper_example::serve(listener, store, jobs.clone()));
    let send = || {
        http()
            .post(&url)
            .header("idempotency-key", "job-1")
            .body("resize photo 7")
            .send()
    };
    let first = send().await.unwrap();
    assert_eq!(first.status(), 202);
    let first_body = first.text().await.unwrap();
    assert_eq!(first_body, r#"{"job":"job_1","bytes":14}"#);
    let again = send().await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.headers()["content-type"], "application/json");
    assert_eq!(again.text().await.unwrap(), first_body);
    assert_eq!(jobs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_example() {
    let attempts = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let addr = serve(client_example::flaky_app(attempts.clone())).await;
    let (status, body, replayed) = within(
        "the order",
        client_example::place_order(&format!("http://{addr}/orders")),
    )
    .await;
    assert_eq!(
        (status, body.as_str(), replayed),
        (201, r#"{"id":"ord_1"}"#, false)
    );
    assert_eq!(attempts.load(Ordering::SeqCst), 3);
}

trait JsonValue {
    async fn json_value<T: serde::de::DeserializeOwned>(self) -> T;
}

impl JsonValue for reqwest::Response {
    async fn json_value<T: serde::de::DeserializeOwned>(self) -> T {
        assert_eq!(self.status(), 200);
        serde_json::from_slice(&self.bytes().await.unwrap()).unwrap()
    }
}
