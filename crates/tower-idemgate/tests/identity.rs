//! Principals and scopes, and recovery routes that answer from the caller's namespace.

mod common;

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::http::StatusCode;
use axum::routing::post;
use common::app::{App, handler, start};
use common::{Gate, http, serve, within};
use idemgate_core::MemoryStore;
use tower_idemgate::{IdempotencyLayer, Principal};

/// Subject scope: Alice and Bob may pick the same key and never share an outcome; a caller
/// without a principal is 401. Principals from a closure and from request extensions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_private_to_their_principal() {
    let store = Arc::new(MemoryStore::new(1 << 20));
    let from_header = |parts: &http::request::Parts| {
        let user = parts.headers.get("x-user")?.to_str().ok()?;
        Some(Principal::new("acme", "shop", format!("user:{user}")))
    };
    let (url, app) = start(
        IdempotencyLayer::new(store).principal(from_header),
        Gate::opened(),
    )
    .await;
    let key = common::key("shared");
    let send = |user: Option<&'static str>| {
        let mut req = http().post(&url).header("idempotency-key", &key).body("{}");
        if let Some(u) = user {
            req = req.header("x-user", u);
        }
        req.send()
    };
    let alice = send(Some("alice")).await.unwrap();
    let bob = send(Some("bob")).await.unwrap();
    assert_eq!(
        (alice.status(), bob.status()),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert!(
        !bob.headers().contains_key("idempotent-replayed"),
        "Bob never gets Alice's outcome"
    );
    assert_ne!(alice.bytes().await.unwrap(), bob.bytes().await.unwrap());
    assert_eq!(
        send(Some("alice")).await.unwrap().headers()["idempotent-replayed"],
        "true"
    );
    let anonymous = send(None).await.unwrap();
    assert_eq!(anonymous.status(), 401);
    let body: serde_json::Value = serde_json::from_slice(&anonymous.bytes().await.unwrap()).unwrap();
    assert_eq!(body["type"], "https://idemgate.dev/problems/unauthenticated");
    assert_eq!(app.executions.get(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_principal_comes_from_request_extensions() {
    let store = Arc::new(MemoryStore::new(1 << 20));
    let app = App {
        executions: Arc::default(),
        finished: Arc::default(),
        dropped: Arc::default(),
        gate: Gate::opened(),
    };
    let router = Router::new()
        .route("/orders", post(handler))
        .route_layer(IdempotencyLayer::new(store).required())
        // An "authentication" middleware in front of the layer states the caller.
        .layer(tower::util::MapRequestLayer::new(
            |mut req: http::Request<Body>| {
                if let Some(user) = req
                    .headers()
                    .get("x-user")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned)
                {
                    req.extensions_mut()
                        .insert(Principal::new("acme", "_tenant", format!("user:{user}")));
                }
                req
            },
        ))
        .with_state(app.clone());
    let url = format!("http://{}/orders", serve(router).await);
    let key = common::key("ext");
    for user in ["alice", "bob"] {
        let resp = http()
            .post(&url)
            .header("idempotency-key", &key)
            .header("x-user", user)
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 201);
    }
    let anonymous = http()
        .post(&url)
        .header("idempotency-key", &key)
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 401);
    assert_eq!(app.executions.get(), 2);
}

/// Recovery routes (SPEC 5): the outcome by key from the caller's own namespace; in flight is
/// 202 processing (the `output` form never waits); unknown or someone else's is 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_routes_answer_from_the_callers_namespace() {
    let store = Arc::new(MemoryStore::new(1 << 20));
    let from_header = |parts: &http::request::Parts| {
        let user = parts.headers.get("x-user")?.to_str().ok()?;
        Some(Principal::new("acme", "shop", format!("user:{user}")))
    };
    let layer = IdempotencyLayer::new(store).principal(from_header);
    let gate = Gate::closed();
    let app = App {
        executions: Arc::default(),
        finished: Arc::default(),
        dropped: Arc::default(),
        gate: gate.clone(),
    };
    let router = Router::new()
        .route("/orders", post(handler).route_layer(layer.clone()))
        .route(
            "/orders/by-idempotency-key/{key}",
            axum::routing::get_service(layer.recovery()),
        )
        .route(
            "/orders/by-idempotency-key/{key}/output",
            axum::routing::get_service(layer.recovery()),
        )
        .with_state(app.clone());
    let base = format!("http://{}", serve(router).await);
    let key = common::key("recover");
    let get =
        |path: String, user: &'static str| http().get(format!("{base}{path}")).header("x-user", user).send();

    assert_eq!(
        get(format!("/orders/by-idempotency-key/{key}"), "alice")
            .await
            .unwrap()
            .status(),
        404
    );
    let owner = {
        let (base, key) = (base.clone(), key.clone());
        tokio::spawn(async move {
            http()
                .post(format!("{base}/orders"))
                .header("x-user", "alice")
                .header("idempotency-key", key)
                .body("{}")
                .send()
                .await
        })
    };
    app.executions.reaches(1).await;
    let processing = get(format!("/orders/by-idempotency-key/{key}/output"), "alice")
        .await
        .unwrap();
    assert_eq!(processing.status(), 202);
    assert_eq!(processing.headers()["idempotency-status"], "processing");
    assert_eq!(processing.headers()["retry-after"], "1");
    gate.open();
    let original = within("the owner", owner)
        .await
        .unwrap()
        .unwrap()
        .text()
        .await
        .unwrap();
    let recovered = get(format!("/orders/by-idempotency-key/{key}"), "alice")
        .await
        .unwrap();
    assert_eq!(recovered.status(), 201);
    assert_eq!(recovered.headers()["idempotent-replayed"], "true");
    assert_eq!(recovered.text().await.unwrap(), original);
    assert_eq!(
        get(format!("/orders/by-idempotency-key/{key}"), "bob")
            .await
            .unwrap()
            .status(),
        404,
        "Bob never reads Alice's outcome"
    );
    let with_header = http()
        .get(format!("{base}/orders/by-idempotency-key/{key}"))
        .header("x-user", "alice")
        .header("idempotency-key", &key)
        .send()
        .await
        .unwrap();
    assert_eq!(with_header.status(), 400);
    assert_eq!(app.executions.get(), 1);
}
