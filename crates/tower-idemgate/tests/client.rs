//! The retrying client: against the real gateway (in process, over loopback) in front of an
//! upstream that fails its first attempts, and against servers that answer every status the
//! retry rules distinguish.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use common::{Counter, Gate, serve, within};
use idemgate_core::MemoryStore;
use idemgate_core::engine::Concurrency;
use tower_idemgate::client::{IdempotentClient, RetryPolicy};
use tower_idemgate::{IdempotencyLayer, Scope};

fn fast_retries(max_attempts: u32) -> RetryPolicy {
    RetryPolicy {
        max_attempts,
        base_delay: Duration::from_millis(10),
        max_delay: Duration::from_millis(100),
    }
}

fn client(max_attempts: u32) -> IdempotentClient {
    IdempotentClient::new(common::http()).retry_policy(fast_retries(max_attempts))
}

/// An upstream that answers 503 to its first `fail` attempts, then 201; it records every
/// `Idempotency-Key` it receives.
#[derive(Clone, Default)]
struct Flaky {
    fail: u64,
    attempts: Arc<Counter>,
    executions: Arc<Counter>,
    keys: Arc<Mutex<Vec<String>>>,
}

async fn flaky(State(up): State<Flaky>, headers: HeaderMap) -> (StatusCode, String) {
    let key = headers
        .get("idempotency-key")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    up.keys.lock().unwrap().push(key);
    if up.attempts.bump() <= up.fail {
        return (StatusCode::SERVICE_UNAVAILABLE, "try again".into());
    }
    let n = up.executions.bump();
    (StatusCode::CREATED, format!(r#"{{"id":"ord_{n}"}}"#))
}

/// Starts the real gateway in this process in front of `upstream`.
async fn gateway(upstream: std::net::SocketAddr) -> String {
    let yaml = format!(
        "store:\n  kind: memory\nupstreams:\n  app:\n    url: http://{upstream}\n    timeout: 5s\nroutes:\n  - id: orders\n    method: POST\n    path: /orders\n    upstream: app\n    policy: required\n    scope: global\n"
    );
    let config = idemgate::config::Config::from_yaml(&yaml).unwrap();
    let store = idemgate::store::AnyStore::open(&config.store).unwrap();
    let gw = Arc::new(idemgate::proxy::Gateway::new(config, store));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(idemgate::server::serve(gw, listener, std::future::pending()));
    format!("http://{addr}/orders")
}

/// One logical intent through the gateway while the upstream fails twice: three attempts, one
/// key on the wire, one successful execution; resending the intent replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_intent_one_execution_one_key_through_the_gateway() {
    let up = Flaky {
        fail: 2,
        ..Flaky::default()
    };
    let upstream = serve(Router::new().route("/orders", post(flaky)).with_state(up.clone())).await;
    let url = gateway(upstream).await;
    let client = client(5);
    let key = tower_idemgate::client::new_key();
    let resp = within(
        "the intent",
        client.send_with_key(&key, client.inner().post(&url).body("{}")),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 201);
    assert_eq!(resp.text().await.unwrap(), r#"{"id":"ord_1"}"#);
    assert_eq!(up.attempts.get(), 3, "two released failures, then the execution");
    assert_eq!(up.executions.get(), 1);
    let keys = up.keys.lock().unwrap().clone();
    assert!(
        keys.iter().all(|k| k == &keys[0]),
        "one key on the wire: {keys:?}"
    );
    assert!(
        keys[0].ends_with(&key),
        "the gateway forwards the namespaced form of the client's key"
    );

    // The same intent again (a client restart with a persisted key): a replay.
    let again = client
        .send_with_key(&key, client.inner().post(&url).body("{}"))
        .await
        .unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(up.attempts.get(), 3);
}

/// A server that answers the status in `x-answer`, counting arrivals.
async fn answer(State(arrivals): State<Arc<Counter>>, headers: HeaderMap) -> axum::response::Response {
    arrivals.bump();
    let status: u16 = headers["x-answer"].to_str().unwrap().parse().unwrap();
    let mut builder = axum::response::Response::builder().status(status);
    if status == 409 {
        builder = builder.header("content-type", "application/problem+json");
    }
    if status == 429 {
        builder = builder.header("retry-after", "1");
    }
    let body = if status == 409 {
        r#"{"type":"https://idemgate.dev/problems/response-not-retained","status":409}"#
    } else {
        "{}"
    };
    builder.body(axum::body::Body::from(body)).unwrap()
}

/// 422, other 4xx and 409s other than request-in-flight are never retried; 429, 502, 503, 504
/// are, up to the attempt limit; a non-retried 409 comes back intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_only_what_a_retry_can_fix() {
    let arrivals = Arc::new(Counter::default());
    let addr = serve(
        Router::new()
            .route("/x", post(answer))
            .with_state(arrivals.clone()),
    )
    .await;
    let url = format!("http://{addr}/x");
    let client = client(3);
    let mut expected = 0;
    for (status, attempts) in [
        (422u16, 1u64),
        (400, 1),
        (404, 1),
        (409, 1),
        (500, 1),
        (429, 3),
        (502, 3),
        (503, 3),
        (504, 3),
    ] {
        let resp = within(
            "a send",
            client.send(
                client
                    .inner()
                    .post(&url)
                    .header("x-answer", status.to_string())
                    .body("{}"),
            ),
        )
        .await
        .unwrap();
        assert_eq!(resp.status(), status);
        expected += attempts;
        assert_eq!(arrivals.get(), expected, "status {status}");
        if status == 409 {
            assert!(
                resp.text().await.unwrap().contains("response-not-retained"),
                "body intact"
            );
        }
    }
}

/// A connection that breaks before the response is retried with the same key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_errors_are_retried() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let arrivals = Arc::new(Counter::default());
    let app = Router::new()
        .route("/x", post(answer))
        .with_state(arrivals.clone());
    tokio::spawn(async move {
        // The first connection is accepted and dropped unanswered.
        let (first, _) = listener.accept().await.unwrap();
        drop(first);
        axum::serve(listener, app).await.unwrap();
    });
    let client = client(3);
    let resp = within(
        "the intent",
        client.send(
            client
                .inner()
                .post(format!("http://{addr}/x"))
                .header("x-answer", "201")
                .body("{}"),
        ),
    )
    .await
    .unwrap();
    assert_eq!(resp.status(), 201);
    assert_eq!(arrivals.get(), 1);
}

/// `409 request-in-flight` is retried until the owner finishes; the retry gets the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_in_flight_is_retried_until_the_replay() {
    let gate = Gate::closed();
    let (executions, conflicts) = (Arc::new(Counter::default()), Arc::new(Counter::default()));
    let handler = {
        let (gate, executions) = (gate.clone(), executions.clone());
        move || async move {
            executions.bump();
            gate.pass().await;
            (StatusCode::CREATED, "done")
        }
    };
    let seen = conflicts.clone();
    let router = Router::new()
        .route("/slow", post(handler))
        .route_layer(
            IdempotencyLayer::new(Arc::new(MemoryStore::new(1 << 20)))
                .scope(Scope::Global)
                .concurrent(Concurrency::Reject),
        )
        .layer(tower::util::MapResponseLayer::new(
            move |resp: axum::response::Response| {
                if resp.status() == StatusCode::CONFLICT {
                    seen.bump();
                }
                resp
            },
        ));
    let url = format!("http://{}/slow", serve(router).await);
    let client = client(100);
    let key = tower_idemgate::client::new_key();
    let owner = {
        let (client, url, key) = (client.clone(), url.clone(), key.clone());
        tokio::spawn(async move {
            client
                .send_with_key(&key, client.inner().post(&url).body("{}"))
                .await
        })
    };
    executions.reaches(1).await;
    let duplicate = {
        let (client, url, key) = (client.clone(), url.clone(), key.clone());
        tokio::spawn(async move {
            client
                .send_with_key(&key, client.inner().post(&url).body("{}"))
                .await
        })
    };
    conflicts.reaches(1).await;
    gate.open();
    assert_eq!(within("owner", owner).await.unwrap().unwrap().status(), 201);
    let dup = within("duplicate", duplicate).await.unwrap().unwrap();
    assert_eq!(dup.status(), 201);
    assert_eq!(dup.headers()["idempotent-replayed"], "true");
    assert_eq!(executions.get(), 1);
}
