//! The execution path in detail: streaming with the last frame held until the record is
//! written, client disconnects, handler panics, graceful shutdown.

mod common;

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::Router;
use axum::body::Body;
use axum::http::Response;
use axum::routing::post;
use bytes::Bytes;
use common::app::start;
use common::{DEADLINE, Gate, http, serve, within};
use http_body::Frame;
use idemgate_core::MemoryStore;
use idemgate_core::engine::{Engine, Lookup};
use idemgate_core::namespace::namespaced_key;
use idemgate_core::record::RecordState;
use idemgate_core::store::Store;
use tokio::sync::mpsc;
use tower_idemgate::{IdempotencyLayer, Scope};

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

/// A body that yields one chunk, then fails.
struct BrokenBody(u8);

impl http_body::Body for BrokenBody {
    type Data = Bytes;
    type Error = std::io::Error;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.0 += 1;
        Poll::Ready(Some(match self.0 {
            1 => Ok(Frame::data(Bytes::from("partial"))),
            _ => Err(std::io::Error::other("the handler's body broke off")),
        }))
    }
}

/// A response body that breaks off mid-way: the client's response breaks too, the key is
/// released, and a retry runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_body_releases_the_key() {
    let store = Arc::new(MemoryStore::new(1 << 20));
    let calls = Arc::new(common::Counter::default());
    let seen = calls.clone();
    let handler = move || {
        let n = seen.bump();
        async move {
            let body = if n == 1 {
                Body::new(BrokenBody(0))
            } else {
                Body::from("whole")
            };
            Response::builder().status(201).body(body).unwrap()
        }
    };
    let router = Router::new()
        .route("/orders", post(handler))
        .route_layer(IdempotencyLayer::new(store.clone()).scope(Scope::Global));
    let url = format!("http://{}/orders", serve(router).await);
    let raw = common::key("broken");
    // The break reaches the client while it reads the body or, when hyper had not flushed the
    // head yet, as an incomplete message; either way after the key was released.
    let broke = match http()
        .post(&url)
        .header("idempotency-key", &raw)
        .body("{}")
        .send()
        .await
    {
        Err(_) => true,
        Ok(resp) => resp.bytes().await.is_err(),
    };
    assert!(broke, "the client sees the break");
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
    assert!(!retry.headers().contains_key("idempotent-replayed"));
    assert_eq!(retry.text().await.unwrap(), "whole");
    assert_eq!(calls.get(), 2);
}

/// A body of ready frames.
struct Frames(std::collections::VecDeque<Bytes>);

impl http_body::Body for Frames {
    type Data = Bytes;
    type Error = std::convert::Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Poll::Ready(self.0.pop_front().map(|b| Ok(Frame::data(b))))
    }
}

/// A client that does not read its response does not hold the record up: within the capture
/// limit, the record completes when the handler's body ends (far more than socket buffers
/// hold), and the client still gets every byte later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_client_does_not_hold_the_record_up() {
    const MIB: usize = 1 << 20;
    let store = Arc::new(MemoryStore::new(64 * MIB));
    let handler = || async {
        let frames = (0..16u8).map(|i| Bytes::from(vec![b'a' + i; MIB])).collect();
        Response::builder()
            .status(201)
            .body(Body::new(Frames(frames)))
            .unwrap()
    };
    let router = Router::new().route("/big", post(handler)).route_layer(
        IdempotencyLayer::new(store.clone())
            .scope(Scope::Global)
            .max_response_bytes(32 * MIB),
    );
    let url = format!("http://{}/big", serve(router).await);
    let raw = common::key("slow");
    let resp = http()
        .post(&url)
        .header("idempotency-key", &raw)
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    // Not reading the body yet: the record completes anyway.
    let engine = Engine::new(store);
    let found = within("the record", engine.lookup(&global_key(&raw), Some(DEADLINE)))
        .await
        .unwrap();
    let Lookup::Completed(record) = found else {
        panic!("completed while the client has not read: {found:?}");
    };
    let RecordState::Completed { response, .. } = record.state else {
        unreachable!()
    };
    assert_eq!(response.body.map(|b| b.len()), Some(16 * MIB));
    let body = within("the body", resp.bytes()).await.unwrap();
    assert_eq!(body.len(), 16 * MIB);
    assert_eq!(body[15 * MIB], b'a' + 15);
}
