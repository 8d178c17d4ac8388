//! The layer's black-box behaviour suite, the gateway's where it applies (SPEC section 4): real
//! HTTP over loopback to an axum app with a counting handler, against every store.

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use common::{Counter, Gate, http, serve, within};
use idemgate_core::engine::Concurrency;
use idemgate_core::store::Store;
use tower_idemgate::{IdempotencyLayer, Scope};

#[derive(Clone)]
struct App {
    /// Requests that reached the layer (counted by an outer middleware).
    arrived: Arc<Counter>,
    executions: Arc<Counter>,
    finished: Arc<Counter>,
    gate: Arc<Gate>,
}

impl App {
    fn new(gate: Arc<Gate>) -> Self {
        Self {
            arrived: Arc::default(),
            executions: Arc::default(),
            finished: Arc::default(),
            gate,
        }
    }
}

/// `POST /orders`: counts, waits at the gate, answers `x-status` (default 201) with a JSON body
/// padded to `x-body-bytes`.
async fn create_order(State(app): State<App>, headers: HeaderMap, body: String) -> (StatusCode, String) {
    let n = app.executions.bump();
    app.gate.pass().await;
    let status = headers
        .get("x-status")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(201);
    let pad = headers
        .get("x-body-bytes")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(0usize);
    let mut out = serde_json::json!({"id": format!("ord_{n}"), "execution": n, "request": body}).to_string();
    if out.len() < pad {
        out.push_str(&" ".repeat(pad - out.len()));
    }
    app.finished.bump();
    (StatusCode::from_u16(status).unwrap(), out)
}

async fn start<St: Store>(
    store: Arc<St>,
    gate: Arc<Gate>,
    configure: impl FnOnce(IdempotencyLayer<St>) -> IdempotencyLayer<St>,
) -> (String, App) {
    let app = App::new(gate);
    let layer = configure(IdempotencyLayer::new(store).required().scope(Scope::Global));
    let arrived = app.arrived.clone();
    let router = Router::new()
        .route("/orders", post(create_order))
        .route_layer(layer)
        .layer(tower::util::MapRequestLayer::new(move |req| {
            arrived.bump();
            req
        }))
        .with_state(app.clone());
    let addr = serve(router).await;
    (format!("http://{addr}/orders"), app)
}

async fn post_json(url: &str, key: &str, body: &str) -> reqwest::Response {
    http()
        .post(url)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .unwrap()
}

async fn problem_type(resp: reqwest::Response) -> String {
    assert_eq!(resp.headers()["content-type"], "application/problem+json");
    let v: serde_json::Value = resp.json_body().await;
    v["type"].as_str().unwrap().rsplit('/').next().unwrap().to_owned()
}

trait JsonBody {
    async fn json_body(self) -> serde_json::Value;
}

impl JsonBody for reqwest::Response {
    async fn json_body(self) -> serde_json::Value {
        serde_json::from_slice(&self.bytes().await.unwrap()).unwrap()
    }
}

/// 40 concurrent duplicates: one execution, every caller gets its outcome.
async fn one_execution_under_40_concurrent_duplicates<St: Store>(store: Arc<St>) {
    let gate = Gate::closed();
    let (url, app) = start(store, gate.clone(), |l| l).await;
    let key = common::key("storm");
    let requests: Vec<_> = (0..40)
        .map(|_| {
            let (url, key) = (url.clone(), key.clone());
            tokio::spawn(async move { post_json(&url, &key, r#"{"amount":100}"#).await })
        })
        .collect();
    // The owner is inside the handler and every duplicate reached the layer: release the owner.
    // (A duplicate that begins only after the completion replays too; the counts below hold
    // either way.)
    app.executions.reaches(1).await;
    app.arrived.reaches(40).await;
    gate.open();
    let mut bodies = Vec::new();
    let mut replays = 0;
    for r in requests {
        let resp = within("a duplicate", r).await.unwrap();
        assert_eq!(resp.status(), 201);
        replays += usize::from(resp.headers().contains_key("idempotent-replayed"));
        bodies.push(resp.bytes().await.unwrap());
    }
    assert_eq!(app.executions.get(), 1, "one execution under 40 duplicates");
    assert_eq!(replays, 39);
    assert!(
        bodies.iter().all(|b| b == &bodies[0]),
        "every duplicate got the original body"
    );
}

/// A retry replays: same status, body and operation id, marked, with expiry; JSON key order and
/// whitespace do not matter.
async fn replay<St: Store>(store: Arc<St>) {
    let (url, app) = start(store, Gate::opened(), |l| l).await;
    let key = common::key("replay");
    let first = post_json(&url, &key, r#"{"amount": 100, "currency": "eur"}"#).await;
    assert_eq!(first.status(), 201);
    assert!(!first.headers().contains_key("idempotent-replayed"));
    let op = first.headers()["x-operation-id"].clone();
    assert!(op.to_str().unwrap().starts_with("op_"));
    assert!(first.headers().contains_key("idempotency-expires"));
    let first_body = first.bytes().await.unwrap();

    let again = post_json(&url, &key, r#"{"currency":"eur","amount":100}"#).await;
    assert_eq!(again.status(), 201);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.headers()["x-operation-id"], op);
    assert!(again.headers().contains_key("idempotency-expires"));
    assert_eq!(again.headers()["content-type"], "text/plain; charset=utf-8");
    assert_eq!(again.bytes().await.unwrap(), first_body);
    assert_eq!(app.executions.get(), 1);
}

/// The same key for another body is 422, never the stored response.
async fn mismatch_is_422<St: Store>(store: Arc<St>) {
    let (url, app) = start(store, Gate::opened(), |l| l).await;
    let key = common::key("mismatch");
    assert_eq!(post_json(&url, &key, r#"{"amount":100}"#).await.status(), 201);
    let other = post_json(&url, &key, r#"{"amount":999}"#).await;
    assert_eq!(other.status(), 422);
    assert!(other.headers().contains_key("x-operation-id"));
    assert_eq!(problem_type(other).await, "idempotency-key-reused");
    assert_eq!(app.executions.get(), 1);
}

/// `concurrent: reject`: a duplicate of an in-flight request gets 409 with Retry-After at once.
async fn reject_is_409_in_flight<St: Store>(store: Arc<St>) {
    let gate = Gate::closed();
    let (url, app) = start(store, gate.clone(), |l| l.concurrent(Concurrency::Reject)).await;
    let key = common::key("reject");
    let owner = {
        let (url, key) = (url.clone(), key.clone());
        tokio::spawn(async move { post_json(&url, &key, "{}").await })
    };
    app.executions.reaches(1).await;
    let dup = post_json(&url, &key, "{}").await;
    assert_eq!(dup.status(), 409);
    assert!(
        dup.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
            >= 1
    );
    assert_eq!(problem_type(dup).await, "request-in-flight");
    gate.open();
    assert_eq!(within("the owner", owner).await.unwrap().status(), 201);
    assert_eq!(app.executions.get(), 1);
}

/// `concurrent: wait` with a short timeout: the duplicate gets 409 when the owner outlasts it.
async fn wait_timeout_is_409<St: Store>(store: Arc<St>) {
    let gate = Gate::closed();
    let (url, app) = start(store, gate.clone(), |l| {
        l.wait_timeout(Duration::from_millis(200))
    })
    .await;
    let key = common::key("wait-timeout");
    let owner = {
        let (url, key) = (url.clone(), key.clone());
        tokio::spawn(async move { post_json(&url, &key, "{}").await })
    };
    app.executions.reaches(1).await;
    let dup = post_json(&url, &key, "{}").await;
    assert_eq!(dup.status(), 409);
    assert_eq!(problem_type(dup).await, "request-in-flight");
    gate.open();
    assert_eq!(within("the owner", owner).await.unwrap().status(), 201);
}

/// Transient outcomes (5xx, 429) release the key: the retry executes again.
async fn transient_outcomes_release<St: Store>(store: Arc<St>) {
    let (url, app) = start(store, Gate::opened(), |l| l).await;
    let key = common::key("released");
    for (status, n) in [(503, 1), (429, 2), (500, 3)] {
        let resp = http()
            .post(&url)
            .header("idempotency-key", &key)
            .header("x-status", status.to_string())
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), status);
        assert!(resp.headers().contains_key("x-operation-id"));
        assert!(!resp.headers().contains_key("idempotency-expires"), "not stored");
        let _ = resp.bytes().await;
        assert_eq!(app.executions.get(), n);
    }
    assert_eq!(post_json(&url, &key, "{}").await.status(), 201);
    let replay = post_json(&url, &key, "{}").await;
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(app.executions.get(), 4);
}

/// `store_server_errors`: a 5xx is final and replayed; a 4xx is always final.
async fn stored_server_errors_and_4xx_replay<St: Store>(store: Arc<St>) {
    let (url, app) = start(store, Gate::opened(), |l| l.store_server_errors(true)).await;
    for status in [500u16, 404] {
        let key = common::key("stored");
        let send = || {
            http()
                .post(&url)
                .header("idempotency-key", &key)
                .header("x-status", status.to_string())
                .body("{}")
                .send()
        };
        assert_eq!(send().await.unwrap().status(), status);
        let again = send().await.unwrap();
        assert_eq!(again.status(), status);
        assert_eq!(again.headers()["idempotent-replayed"], "true");
    }
    assert_eq!(app.executions.get(), 2);
}

/// Over `max_response_bytes`: the first caller gets the whole body; replays are 409
/// response-not-retained naming the status; the handler ran once.
async fn large_responses_are_not_retained<St: Store>(store: Arc<St>) {
    let (url, app) = start(store, Gate::opened(), |l| l.max_response_bytes(1024)).await;
    let key = common::key("large");
    let send = || {
        http()
            .post(&url)
            .header("idempotency-key", &key)
            .header("x-body-bytes", "4096")
            .body("{}")
            .send()
    };
    let first = send().await.unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(first.bytes().await.unwrap().len(), 4096);
    let again = send().await.unwrap();
    assert_eq!(again.status(), 409);
    let body = again.json_body().await;
    assert!(body["type"].as_str().unwrap().ends_with("/response-not-retained"));
    assert!(body["detail"].as_str().unwrap().contains("201"));
    assert_eq!(app.executions.get(), 1);
}

/// Policy refusals are problem+json responses with the gateway's slugs.
async fn key_policy_refusals<St: Store>(store: Arc<St>) {
    let (url, app) = start(store.clone(), Gate::opened(), |l| l).await;
    let missing = http().post(&url).body("{}").send().await.unwrap();
    assert_eq!(missing.status(), 400);
    assert_eq!(problem_type(missing).await, "missing-idempotency-key");
    let invalid = post_json(&url, "t-forged", "{}").await;
    assert_eq!(invalid.status(), 400);
    let body = invalid.json_body().await;
    assert_eq!(body["reason"], "reserved_prefix");
    let two = http()
        .post(&url)
        .header("idempotency-key", "a")
        .header("idempotency-key", "b")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(two.json_body().await["reason"], "syntax");
    assert_eq!(app.executions.get(), 0);

    let (prohibited, app) = start(store.clone(), Gate::opened(), |l| l.prohibited()).await;
    let with_key = post_json(&prohibited, &common::key("p"), "{}").await;
    assert_eq!(problem_type(with_key).await, "idempotency-key-not-allowed");
    assert_eq!(
        http().post(&prohibited).body("{}").send().await.unwrap().status(),
        201
    );
    assert_eq!(app.executions.get(), 1);

    let (accepted, app) = start(store, Gate::opened(), |l| l.accepted()).await;
    for _ in 0..2 {
        let resp = http().post(&accepted).body("{}").send().await.unwrap();
        assert_eq!(resp.status(), 201);
        assert!(!resp.headers().contains_key("x-operation-id"), "no key, no dedup");
    }
    assert_eq!(app.executions.get(), 2);
}

macro_rules! suite {
    ($($store:ident),*) => {$(
        mod $store {
            suite!(@cases $store: one_execution_under_40_concurrent_duplicates, replay, mismatch_is_422,
                reject_is_409_in_flight, wait_timeout_is_409, transient_outcomes_release,
                stored_server_errors_and_4xx_replay, large_responses_are_not_retained, key_policy_refusals);
        }
    )*};
    (@cases $store:ident: $($case:ident),*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $case() {
            let Some(store) = crate::common::$store().await else { return };
            crate::common::within(stringify!($case), crate::$case(store)).await;
        }
    )*};
}

suite!(memory, embedded, dyn_memory, redis, postgres);
