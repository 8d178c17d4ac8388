//! An orders API with idempotent creates: the tower layer on one axum route, principals from an
//! authentication middleware, and procedure hooks that report the asynchronous status of the
//! created order on replays.
//!
//! Run with: cargo run -p tower-idemgate --example orders
//!
//! Then, in another terminal:
//!
//! ```sh
//! curl -si -X POST localhost:3000/orders -H 'Authorization: Bearer alice' \
//!      -H 'Idempotency-Key: order-1' -H 'Content-Type: application/json' -d '{"amount": 100}'
//! # the same again: the same order, with Idempotent-Replayed: true and Idempotency-Status
//! curl -si -X POST localhost:3000/orders -H 'Authorization: Bearer bob' \
//!      -H 'Idempotency-Key: order-1' -H 'Content-Type: application/json' -d '{"amount": 100}'
//! # Bob's order-1 is his own: a new order
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use idemgate_core::MemoryStore;
use tower_idemgate::procedure::{JsonPointer, ResourceStatus};
use tower_idemgate::{IdempotencyLayer, Principal};

/// The application state: an order counter standing in for a database.
#[derive(Clone, Default)]
pub struct Orders {
    pub created: Arc<AtomicU64>,
}

/// Creates an order. With the layer in front, this runs at most once per caller and key.
async fn create(State(orders): State<Orders>, Json(body): Json<serde_json::Value>) -> impl IntoResponse {
    let n = orders.created.fetch_add(1, Ordering::SeqCst) + 1;
    let order = serde_json::json!({"id": format!("ord_{n}"), "amount": body["amount"]});
    (StatusCode::CREATED, Json(order))
}

async fn count(State(orders): State<Orders>) -> String {
    orders.created.load(Ordering::SeqCst).to_string()
}

/// A stand-in for real authentication: `Authorization: Bearer {user}` becomes the principal.
async fn authenticate(mut req: Request, next: Next) -> Response {
    let user = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_owned);
    match user {
        Some(user) => {
            req.extensions_mut()
                .insert(Principal::new("acme", "shop", format!("user:{user}")));
            next.run(req).await
        }
        None => StatusCode::UNAUTHORIZED.into_response(),
    }
}

/// The service: `POST /orders` deduplicated per subject, `GET /orders/count` untouched.
pub fn app(store: Arc<MemoryStore>, orders: Orders) -> Router {
    // Orders become "completed" once their follow-up work is done; here, every order whose
    // number is odd. A real service would ask its outbox or workflow engine.
    let procedure = JsonPointer::new("/id", |id: String| async move {
        let n: u64 = id.trim_start_matches("ord_").parse()?;
        Ok(if n % 2 == 1 {
            ResourceStatus::Completed
        } else {
            ResourceStatus::Processing
        })
    });
    let idempotency = IdempotencyLayer::new(store)
        .required()
        .route_id("create-order")
        .retention(Duration::from_secs(48 * 3600))
        .procedure(procedure);
    Router::new()
        .route("/orders", post(create).route_layer(idempotency))
        .route("/orders/count", get(count))
        .layer(middleware::from_fn(authenticate))
        .with_state(orders)
}

#[tokio::main]
async fn main() {
    let store = Arc::new(MemoryStore::new(256 << 20));
    store.spawn_sweeper(Duration::from_secs(10));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await.unwrap();
    println!("orders API on http://{}", listener.local_addr().unwrap());
    axum::serve(listener, app(store, Orders::default()))
        .await
        .unwrap();
}
