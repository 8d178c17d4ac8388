//! Restate upstreams against a scripted stand-in for Restate's ingress, so the mapping of SPEC 9
//! is checked on every machine (the real server runs in `tests/restate.rs` when installed), and
//! so are answers Restate 1.7 does not give (410 for a purged output).
//!
//! The stand-in keeps one response per `idempotency-key` like Restate: the first request runs
//! (answering with `x-restate-id` and another `x-restate-*` header), later ones get the stored
//! response with `idempotency-expires`. Its recovery endpoints answer by key shape: `running`
//! keys are 470 on `/output` and never finish on `/attach`, `purged` keys are 410, unknown keys
//! are an ingress 404.

mod common;

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;

#[derive(Default)]
struct Ingress {
    /// Namespaced key -> (invocation id, stored body).
    done: Mutex<HashMap<String, (String, Bytes)>>,
    /// The `idempotency-key` values of every invocation request, in order.
    keys: Mutex<Vec<Vec<String>>>,
    /// Executions (first requests of a key, or keyless requests).
    runs: Mutex<u32>,
}

fn reply(status: u16, headers: &[(&str, &str)], body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = StatusCode::from_u16(status).unwrap();
    for (n, v) in headers {
        let name = http::HeaderName::from_bytes(n.as_bytes()).unwrap();
        r.headers_mut().insert(name, v.parse().unwrap());
    }
    r
}

async fn answer(ingress: Arc<Ingress>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let path = req.uri().path().to_owned();
    let keys: Vec<String> = req
        .headers()
        .get_all("idempotency-key")
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect();
    let tenant = req
        .headers()
        .get("x-tenant-id")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = req.into_body().collect().await.unwrap().to_bytes();
    let ingress_error = |status: u16| {
        reply(
            status,
            &[
                ("x-restate-error-source", "ingress"),
                ("content-type", "application/json"),
            ],
            format!("{{\"code\":{status},\"source\":\"ingress\"}}"),
        )
    };
    if let Some(rest) = path.strip_prefix("/restate/invocation/Checkout/create/") {
        let (key, what) = rest.rsplit_once('/').unwrap();
        if key.contains("running") {
            if what == "attach" {
                std::future::pending::<()>().await;
            }
            return ingress_error(470);
        }
        if key.contains("purged") {
            return ingress_error(410);
        }
        return match ingress.done.lock().unwrap().get(key) {
            Some((inv, stored)) => reply(
                200,
                &[
                    ("x-restate-id", inv),
                    ("idempotency-expires", "2026-11-23T00:00:00.000+00:00"),
                ],
                stored.clone(),
            ),
            None => ingress_error(404),
        };
    }
    assert_eq!(path, "/Checkout/create", "the target path");
    ingress.keys.lock().unwrap().push(keys.clone());
    let Some(key) = keys.first().cloned() else {
        *ingress.runs.lock().unwrap() += 1;
        return reply(200, &[("x-restate-id", "inv_keyless")], body);
    };
    let mut done = ingress.done.lock().unwrap();
    if let Some((inv, stored)) = done.get(&key) {
        return reply(
            200,
            &[
                ("x-restate-id", inv),
                ("idempotency-expires", "2026-11-23T00:00:00.000+00:00"),
                ("x-restate-internal", "1"),
            ],
            stored.clone(),
        );
    }
    *ingress.runs.lock().unwrap() += 1;
    let inv = format!("inv_{}", done.len() + 1);
    let stored = Bytes::from(format!(
        "{{\"tenant\":{:?},\"body\":{}}}",
        tenant.unwrap_or_default(),
        String::from_utf8_lossy(&body)
    ));
    done.insert(key, (inv.clone(), stored.clone()));
    reply(
        200,
        &[
            ("x-restate-id", &inv),
            ("x-restate-internal", "1"),
            ("content-type", "application/json"),
        ],
        stored,
    )
}

async fn start_ingress() -> (SocketAddr, Arc<Ingress>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let ingress = Arc::new(Ingress::default());
    let state = ingress.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let state = state.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req| {
                    let state = state.clone();
                    async move { Ok::<_, Infallible>(answer(state, req).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    (addr, ingress)
}

const CONFIG: &str = r"server:
  listen: {listen}
store:
  kind: memory
upstreams:
  checkout:
    kind: restate
    url: http://{ingress}
    timeout: 5s
idempotency:
  wait_timeout: 300ms
routes:
  - id: create
    method: POST
    path: /api/v1/checkout
    upstream: checkout
    target: Checkout/create
    policy: accepted
    scope: global
    recovery: true
";

fn no_restate(r: &reqwest::Response) {
    for (name, value) in r.headers() {
        let v = String::from_utf8_lossy(value.as_bytes()).to_lowercase();
        assert!(
            !name.as_str().contains("restate") && !v.contains("restate"),
            "{name}: {v}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restate_mapping_against_a_stand_in_ingress() {
    let (addr, ingress) = start_ingress().await;
    let demo = common::Upstream::start().await;
    let yaml = CONFIG.replace("{ingress}", &addr.to_string());
    let gw = common::Gateway::start_full(&demo, &yaml, &[], &[]).await;
    let url = gw.url("/api/v1/checkout");

    // First execution: the namespaced key, once; the invocation id as x-operation-id.
    let k = common::key("k");
    let first = common::post(&url, Some(&k), r#"{"a":1,"b":2}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 200);
    no_restate(&first);
    assert_eq!(common::header(&first, "x-operation-id"), Some("inv_1"));
    assert_eq!(common::header(&first, "idempotent-replayed"), None);
    let body = first.bytes().await.unwrap();
    assert_eq!(
        ingress.keys.lock().unwrap().last().unwrap(),
        &vec![format!("t-*:*:*:{k}")],
        "exactly one idempotency-key, the namespaced one"
    );

    // A retry (same JSON, keys in another order): Restate's stored answer, marked a replay.
    let again = common::post(&url, Some(&k), r#"{"b":2,"a":1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 200);
    no_restate(&again);
    assert_eq!(common::header(&again, "x-operation-id"), Some("inv_1"));
    assert_eq!(common::header(&again, "idempotent-replayed"), Some("true"));
    assert_eq!(
        common::header(&again, "idempotency-expires"),
        Some("2026-11-23T00:00:00.000+00:00")
    );
    assert_eq!(again.bytes().await.unwrap(), body);

    // The same key for another body: refused before Restate hears of it.
    let sent = ingress.keys.lock().unwrap().len();
    let reused = common::post(&url, Some(&k), r#"{"a":999}"#).send().await.unwrap();
    assert_eq!(reused.status(), 422);
    assert_eq!(common::slug(reused).await, "idempotency-key-reused");
    assert_eq!(ingress.keys.lock().unwrap().len(), sent);

    // No key on an `accepted` route: forwarded without one.
    let keyless = common::post(&url, None, "{}").send().await.unwrap();
    assert_eq!(keyless.status(), 200);
    assert_eq!(
        ingress.keys.lock().unwrap().last().unwrap(),
        &Vec::<String>::new()
    );
    assert_eq!(*ingress.runs.lock().unwrap(), 2);

    // Recovery.
    let recover = |key: &str, suffix: &str| {
        common::client()
            .get(gw.url(&format!("/api/v1/checkout/by-idempotency-key/{key}{suffix}")))
            .send()
    };
    let r = recover(&k, "").await.unwrap();
    assert_eq!(r.status(), 200);
    no_restate(&r);
    assert_eq!(common::header(&r, "idempotent-replayed"), Some("true"));
    assert_eq!(common::header(&r, "x-operation-id"), Some("inv_1"));
    assert_eq!(r.bytes().await.unwrap(), body);
    for suffix in ["/output", ""] {
        // `/output` answers at once; a plain recovery attaches for `wait_timeout` first.
        let r = recover("running-1", suffix).await.unwrap();
        assert_eq!(r.status(), 202, "{suffix}");
        no_restate(&r);
        assert_eq!(common::header(&r, "idempotency-status"), Some("processing"));
        assert_eq!(common::header(&r, "retry-after"), Some("1"));
    }
    let r = recover("purged-1", "/output").await.unwrap();
    assert_eq!(r.status(), 410);
    assert_eq!(common::slug(r).await, "outcome-purged");
    let r = recover("never-sent", "").await.unwrap();
    assert_eq!(r.status(), 404);
    no_restate(&r);
    assert_eq!(common::slug(r).await, "not-found");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_ingress_is_502() {
    let closed = common::free_addr();
    let demo = common::Upstream::start().await;
    let yaml = CONFIG.replace("{ingress}", &closed.to_string());
    let gw = common::Gateway::start_full(&demo, &yaml, &[], &[]).await;
    let r = common::post(&gw.url("/api/v1/checkout"), Some("k1"), "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502);
    assert_eq!(common::slug(r).await, "upstream-unavailable");
    // The key stays bound to its first body (a duplicate may have reached Restate meanwhile).
    let r = common::post(&gw.url("/api/v1/checkout"), Some("k1"), r#"{"x":1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 422);
}
