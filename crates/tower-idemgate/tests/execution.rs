//! The execution path in detail: streaming with the last frame held until the record is
//! written, client disconnects, handler panics, principals and scopes, procedure hooks, store
//! failures.

mod common;

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, Response, StatusCode};
use axum::routing::post;
use bytes::Bytes;
use common::{Counter, DEADLINE, Gate, http, serve, within};
use http_body::Frame;
use idemgate_core::MemoryStore;
use idemgate_core::engine::{Engine, Lookup};
use idemgate_core::namespace::namespaced_key;
use idemgate_core::notify::Notifier;
use idemgate_core::record::{LeaseToken, Millis, Record, RecordState, StoredResponse};
use idemgate_core::rules::{Begin, BeginRequest};
use idemgate_core::store::{Store, StoreError};
use tokio::sync::mpsc;
use tower_idemgate::procedure::{JsonPointer, ResourceStatus};
use tower_idemgate::{IdempotencyLayer, OnStoreError, Principal, Scope};

fn global_key(raw: &str) -> String {
    namespaced_key(Scope::Global, None, raw).unwrap()
}

/// A response body whose frames the test sends one by one.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.0.poll_recv(cx).map(|c| c.map(|b| Ok(Frame::data(b))))
    }
}

/// The body streams while it is captured, and the last frame reaches the client only once the
/// record is completed: a client that has the whole response can always get the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_streams_and_the_record_is_written_before_the_last_frame() {
    let store = Arc::new(MemoryStore::new(1 << 20));
    let (tx, rx) = mpsc::channel::<Bytes>(8);
    let rx = Arc::new(std::sync::Mutex::new(Some(rx)));
    let handler = move || {
        let rx = rx.lock().unwrap().take().expect("called once");
        async move {
            Response::builder()
                .status(201)
                .body(Body::new(ChannelBody(rx)))
                .unwrap()
        }
    };
    let router = Router::new()
        .route("/stream", post(handler))
        .route_layer(IdempotencyLayer::new(store.clone()).scope(Scope::Global));
    let addr = serve(router).await;
    let raw = common::key("stream");

    let mut resp = http()
        .post(format!("http://{addr}/stream"))
        .header("idempotency-key", &raw)
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    tx.send(Bytes::from("one,")).await.unwrap();
    tx.send(Bytes::from("two,")).await.unwrap();
    // "one," arrives while the handler's body is still open: streamed, not buffered.
    assert_eq!(
        within("first chunk", resp.chunk()).await.unwrap().unwrap(),
        "one,"
    );
    let record = store
        .get(&global_key(&raw), idemgate_core::record::now_millis())
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(record.state, RecordState::InFlight { .. }));
    tx.send(Bytes::from("three")).await.unwrap();
    drop(tx);
    let mut rest = Vec::new();
    while let Some(chunk) = within("rest", resp.chunk()).await.unwrap() {
        rest.extend_from_slice(&chunk);
    }
    assert_eq!(rest, b"two,three");
    // The client has everything: the record must already be complete.
    let record = store
        .get(&global_key(&raw), idemgate_core::record::now_millis())
        .await
        .unwrap()
        .unwrap();
    let RecordState::Completed { response, .. } = record.state else {
        panic!(
            "the record is completed before the last frame: {:?}",
            record.state
        );
    };
    assert_eq!(response.body.as_deref(), Some(&b"one,two,three"[..]));
}

#[derive(Clone)]
struct App {
    executions: Arc<Counter>,
    finished: Arc<Counter>,
    dropped: Arc<Counter>,
    gate: Arc<Gate>,
}

async fn handler(State(app): State<App>, headers: HeaderMap) -> (StatusCode, String) {
    let n = app.executions.bump();
    if headers.contains_key("x-panic") {
        panic!("the handler panicked (on purpose)");
    }
    app.gate.pass().await;
    app.finished.bump();
    (
        StatusCode::CREATED,
        serde_json::json!({"id": format!("ord_{n}")}).to_string(),
    )
}

struct DropSignal(Arc<Counter>);
impl Drop for DropSignal {
    fn drop(&mut self) {
        self.0.bump();
    }
}

async fn start<St: Store, P: tower_idemgate::PrincipalSource + Clone>(
    layer: IdempotencyLayer<St, P>,
    gate: Arc<Gate>,
) -> (String, App) {
    let app = App {
        executions: Arc::default(),
        finished: Arc::default(),
        dropped: Arc::default(),
        gate,
    };
    let dropped = app.dropped.clone();
    let router = Router::new()
        .route("/orders", post(handler))
        .route_layer(layer)
        // Outermost: signals when the server drops a request's future (the client went away).
        .layer(axum::middleware::from_fn(
            move |req, next: axum::middleware::Next| {
                let signal = DropSignal(dropped.clone());
                async move {
                    let resp = next.run(req).await;
                    std::mem::forget(signal); // completed normally: no signal
                    resp
                }
            },
        ))
        .with_state(app.clone());
    let addr = serve(router).await;
    (format!("http://{addr}/orders"), app)
}

/// The client disconnects while the handler runs: the handler still runs to its end, its
/// outcome is recorded, and the retry replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnected_client_does_not_cancel_the_execution() {
    let store = Arc::new(MemoryStore::new(1 << 20));
    let gate = Gate::closed();
    let (url, app) = start(
        IdempotencyLayer::new(store.clone()).scope(Scope::Global),
        gate.clone(),
    )
    .await;
    let raw = common::key("disconnect");
    let client = {
        let (url, raw) = (url.clone(), raw.clone());
        tokio::spawn(async move {
            http()
                .post(&url)
                .header("idempotency-key", raw)
                .body("{}")
                .send()
                .await
        })
    };
    app.executions.reaches(1).await;
    client.abort();
    // The server noticed the disconnect and dropped the request future...
    app.dropped.reaches(1).await;
    // ...but the execution goes on and completes the record.
    gate.open();
    app.finished.reaches(1).await;
    let engine = Engine::new(store);
    let found = within("the record", engine.lookup(&global_key(&raw), Some(DEADLINE)))
        .await
        .unwrap();
    assert!(matches!(found, Lookup::Completed(_)), "{found:?}");
    let retry = http()
        .post(&url)
        .header("idempotency-key", &raw)
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(retry.status(), 201);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(app.executions.get(), 1);
}

/// A panicking handler releases the key: the outcome is unknown, a retry runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_releases_the_key() {
    let store = Arc::new(MemoryStore::new(1 << 20));
    let (url, app) = start(
        IdempotencyLayer::new(store.clone()).scope(Scope::Global),
        Gate::opened(),
    )
    .await;
    let raw = common::key("panic");
    let first = http()
        .post(&url)
        .header("idempotency-key", &raw)
        .header("x-panic", "1")
        .body("{}")
        .send()
        .await;
    assert!(
        first.is_err(),
        "the connection breaks like it would without the layer"
    );
    let engine = Engine::new(store);
    assert!(matches!(
        engine.lookup(&global_key(&raw), None).await.unwrap(),
        Lookup::Unknown
    ));
    let retry = http()
        .post(&url)
        .header("idempotency-key", &raw)
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(retry.status(), 201);
    assert!(!retry.headers().contains_key("idempotent-replayed"));
    assert_eq!(app.executions.get(), 2);
}

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

/// With a task tracker, a graceful shutdown waits for running executions, which complete their
/// records even though their clients are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_tracker_lets_shutdown_wait_for_executions() {
    let store = Arc::new(MemoryStore::new(1 << 20));
    let tracker = tokio_util::task::TaskTracker::new();
    let gate = Gate::closed();
    let layer = IdempotencyLayer::new(store.clone())
        .scope(Scope::Global)
        .task_tracker(tracker.clone());
    let (url, app) = start(layer, gate.clone()).await;
    let raw = common::key("shutdown");
    let client = {
        let (url, raw) = (url.clone(), raw.clone());
        tokio::spawn(async move {
            http()
                .post(&url)
                .header("idempotency-key", raw)
                .body("{}")
                .send()
                .await
        })
    };
    app.executions.reaches(1).await;
    client.abort();
    tracker.close();
    let mut waiting = std::pin::pin!(tracker.wait());
    assert!(
        tokio::time::timeout(std::time::Duration::from_millis(50), &mut waiting)
            .await
            .is_err(),
        "the execution is still running"
    );
    gate.open();
    within("the tracker", waiting).await;
    let record = store
        .get(&global_key(&raw), idemgate_core::record::now_millis())
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(record.state, RecordState::Completed { .. }));
}
