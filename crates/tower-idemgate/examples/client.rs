//! The retrying client: one logical intent, one key, however many attempts it takes.
//!
//! Starts a flaky orders API in-process (the layer in front of a handler whose first two
//! attempts answer 503), then sends one order with [`IdempotentClient`].
//!
//! Run with: cargo run -p tower-idemgate --example client --features client
//!
//! [`IdempotentClient`]: tower_idemgate::client::IdempotentClient

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use idemgate_core::MemoryStore;
use tower_idemgate::client::{IdempotentClient, RetryPolicy};
use tower_idemgate::{IdempotencyLayer, Scope};

/// The flaky service: attempts 1 and 2 fail with 503 (released: the key stays usable).
pub fn flaky_app(attempts: Arc<AtomicU64>) -> Router {
    let handler = move || {
        let n = attempts.fetch_add(1, Ordering::SeqCst) + 1;
        async move {
            if n <= 2 {
                (StatusCode::SERVICE_UNAVAILABLE, "warming up".to_owned())
            } else {
                (StatusCode::CREATED, r#"{"id":"ord_1"}"#.to_owned())
            }
        }
    };
    let store = Arc::new(MemoryStore::new(16 << 20));
    Router::new()
        .route("/orders", post(handler))
        .route_layer(IdempotencyLayer::new(store).required().scope(Scope::Global))
}

/// Sends one order to `url`; returns the status, the body and whether it was a replay.
pub async fn place_order(url: &str) -> (u16, String, bool) {
    let client = IdempotentClient::new(reqwest::Client::new()).retry_policy(RetryPolicy {
        max_attempts: 5,
        base_delay: Duration::from_millis(50),
        max_delay: Duration::from_secs(2),
    });
    let resp = client
        .send(
            client
                .inner()
                .post(url)
                .header("content-type", "application/json")
                .body(r#"{"amount":100}"#),
        )
        .await
        .expect("an answer");
    let replayed = resp.headers().contains_key("idempotent-replayed");
    (
        resp.status().as_u16(),
        resp.text().await.unwrap_or_default(),
        replayed,
    )
}

#[tokio::main]
async fn main() {
    let attempts = Arc::new(AtomicU64::new(0));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/orders", listener.local_addr().unwrap());
    let app = flaky_app(attempts.clone());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let (status, body, _) = place_order(&url).await;
    println!(
        "{status} {body} after {} attempts, all with one Idempotency-Key",
        attempts.load(Ordering::SeqCst)
    );
}
