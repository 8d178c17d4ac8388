//! Case C: a handler that deduplicates by itself, with a token derived from trusted signals.
//!
//! A billing scheduler calls `POST /subscriptions/{id}/charge` at least once per period; it
//! may fire twice (a retried tick, two scheduler replicas, a redeploy). No client key is
//! involved: the handler knows what "the same charge" means and says so in its token.
//!
//! Run with: cargo run -p tower-idemgate --example handler_internal
//!
//! ```sh
//! curl -s -X POST localhost:3001/subscriptions/sub_9/charge -H 'X-Tenant-Id: acme' \
//!      -H 'Content-Type: application/json' -d '{"fired_at": "2026-11-22T00:00:05Z"}'
//! # a second tick in the same month: the same charge, not a new one
//! curl -s -X POST localhost:3001/subscriptions/sub_9/charge -H 'X-Tenant-Id: acme' \
//!      -H 'Content-Type: application/json' -d '{"fired_at": "2026-11-22T00:07:41Z"}'
//! ```
//!
//! Which signals are trusted, and why:
//!
//! - the tenant comes from `X-Tenant-Id`, which the authenticating proxy in front of this
//!   service sets (and strips from client requests), never from the body;
//! - the subscription id is the path the route matched;
//! - the billing *period* is computed here from the fire time, truncated to the month. The
//!   fire time itself is not the token: two ticks of the same period have different fire times
//!   and must still be one charge. The amount is not in the token either; it is in the
//!   fingerprint, so a second tick that would charge a different amount is refused instead of
//!   silently answered with the first charge.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idemgate_core::MemoryStore;
use tower_idemgate::once::{Namespace, OnceError, fingerprint, once};
use tower_idemgate::{Principal, Scope};

/// The payment provider, standing in: counts real charges.
#[derive(Clone)]
pub struct Billing {
    pub charges: Arc<AtomicU64>,
    pub store: Arc<MemoryStore>,
}

#[derive(serde::Deserialize)]
pub struct Tick {
    /// RFC 3339, as the scheduler fired.
    fired_at: String,
}

#[derive(serde::Serialize, serde::Deserialize, Clone, Debug, PartialEq)]
pub struct Charge {
    pub charge_id: String,
    pub subscription: String,
    pub period: String,
    pub cents: u64,
}

async fn charge(
    State(billing): State<Billing>,
    Path(subscription): Path<String>,
    headers: HeaderMap,
    Json(tick): Json<Tick>,
) -> Response {
    let Some(tenant) = headers.get("x-tenant-id").and_then(|v| v.to_str().ok()) else {
        return StatusCode::UNAUTHORIZED.into_response();
    };
    // "2026-11-22T00:00:05Z" -> "2026-11": the period, not the instant, is what dedups.
    let Some(period) = tick
        .fired_at
        .get(..7)
        .filter(|p| p.as_bytes().get(4) == Some(&b'-'))
    else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let cents = 1_250; // from the subscription's plan
    let ns = Namespace::scoped(
        "charge-subscription",
        Scope::Tenant,
        Principal::new(tenant, "_tenant", "service:billing"),
    );
    let token = format!("{subscription}:{period}");
    let fp = fingerprint(&(&subscription, period, cents));
    let (charges, sub, period_owned) = (billing.charges.clone(), subscription.clone(), period.to_owned());
    let result = once(&billing.store, &ns, &token, fp, async move {
        let n = charges.fetch_add(1, Ordering::SeqCst) + 1;
        Ok::<_, std::io::Error>(Charge {
            charge_id: format!("ch_{n}"),
            subscription: sub,
            period: period_owned,
            cents,
        })
    })
    .await;
    match result {
        Ok(charge) => (StatusCode::OK, Json(charge)).into_response(),
        Err(OnceError::Mismatch { .. }) => StatusCode::UNPROCESSABLE_ENTITY.into_response(),
        Err(OnceError::InFlight { .. }) => StatusCode::CONFLICT.into_response(),
        Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

pub fn app(billing: Billing) -> Router {
    Router::new()
        .route("/subscriptions/{id}/charge", post(charge))
        .with_state(billing)
}

#[tokio::main]
async fn main() {
    let billing = Billing {
        store: Arc::new(MemoryStore::new(64 << 20)),
        charges: Arc::default(),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3001").await.unwrap();
    println!("billing on http://{}", listener.local_addr().unwrap());
    axum::serve(listener, app(billing)).await.unwrap();
}
