//! A small demo upstream: an "orders" API that counts its executions, used by the README's
//! first command, the black-box tests and the benchmarks.
//!
//! Every POST/PATCH creates an order and answers `201 {"id":"ord_N","execution":N,...}`.
//! Request headers let a tour or a test shape the answer (the demo is not a product surface):
//! `x-demo-status` (answer this status), `x-demo-delay-ms` (sleep first), `x-demo-body-bytes`
//! (pad the body to this size), `x-demo-set-cookie` (send a Set-Cookie), `x-demo-echo-headers`
//! (the request headers it received, as a `headers` object).
//! `GET /outbox/{id}` answers `{"status":"completed"}` (a status probe; `/outbox-down/{id}`
//! fails). `GET /executions` answers the execution count; `GET /executions/{key}` the count for one
//! `Idempotency-Key` value as received.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

/// Execution counters, shared with whoever started the upstream.
#[derive(Debug, Default)]
pub struct Counts {
    total: AtomicU64,
    per_key: Mutex<HashMap<String, u64>>,
}

impl Counts {
    #[must_use]
    pub fn total(&self) -> u64 {
        self.total.load(Ordering::SeqCst)
    }

    #[must_use]
    pub fn for_key(&self, key: &str) -> u64 {
        self.per_key
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(key)
            .copied()
            .unwrap_or(0)
    }
}

/// Serves the demo upstream on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, counts: Arc<Counts>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let counts = counts.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| handle(req, counts.clone()));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

fn header<'a>(req: &'a Request<Incoming>, name: &str) -> Option<&'a str> {
    req.headers().get(name).and_then(|v| v.to_str().ok())
}

async fn handle(req: Request<Incoming>, counts: Arc<Counts>) -> Result<Response<Full<Bytes>>, Infallible> {
    if req.method() == Method::GET {
        let path = req.uri().path();
        // A status probe (SPEC 8) for the tour and the tests: `/outbox/{id}` says completed,
        // `/outbox-down/{id}` fails.
        if path.starts_with("/outbox/") {
            return Ok(reply(
                StatusCode::OK,
                Bytes::from_static(b"{\"status\":\"completed\"}"),
            ));
        }
        if path.starts_with("/outbox-down/") {
            return Ok(reply(StatusCode::SERVICE_UNAVAILABLE, Bytes::from_static(b"{}")));
        }
        let n = match path.strip_prefix("/executions/") {
            Some(key) => counts.for_key(key),
            None if path == "/executions" => counts.total(),
            None => return Ok(reply(StatusCode::NOT_FOUND, Bytes::from_static(b"{}"))),
        };
        return Ok(reply(
            StatusCode::OK,
            Bytes::from(format!("{{\"executions\":{n}}}")),
        ));
    }
    let status = header(&req, "x-demo-status")
        .and_then(|s| s.parse().ok())
        .unwrap_or(201);
    let delay: u64 = header(&req, "x-demo-delay-ms")
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let pad: usize = header(&req, "x-demo-body-bytes")
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let cookie = header(&req, "x-demo-set-cookie").is_some();
    let echo = header(&req, "x-demo-echo-headers").is_some().then(|| {
        let pairs: serde_json::Map<String, serde_json::Value> = req
            .headers()
            .iter()
            .map(|(k, v)| (k.to_string(), String::from_utf8_lossy(v.as_bytes()).into()))
            .collect();
        serde_json::Value::Object(pairs).to_string()
    });
    let key = header(&req, "idempotency-key").map(str::to_owned);
    let n = counts.total.fetch_add(1, Ordering::SeqCst) + 1;
    if let Some(key) = key {
        *counts
            .per_key
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(key)
            .or_default() += 1;
    }
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    let mut json = format!(
        "{{\"id\":\"ord_{n}\",\"execution\":{n},\"request_bytes\":{}",
        body.len()
    );
    if let Some(headers) = echo {
        json.push_str(",\"headers\":");
        json.push_str(&headers);
    }
    if pad > json.len() + 12 {
        json.push_str(",\"pad\":\"");
        json.push_str(&"x".repeat(pad - json.len() - 2));
        json.push('"');
    }
    json.push('}');
    let mut resp = reply(
        StatusCode::from_u16(status).unwrap_or(StatusCode::OK),
        Bytes::from(json),
    );
    if cookie {
        resp.headers_mut().insert(
            http::header::SET_COOKIE,
            http::HeaderValue::from_static("session=secret; HttpOnly"),
        );
    }
    Ok(resp)
}

fn reply(status: StatusCode, body: Bytes) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    resp
}
