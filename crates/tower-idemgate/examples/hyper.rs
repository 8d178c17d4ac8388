//! The layer in front of a plain hyper service (no axum), over the durable embedded store.
//!
//! hyper hands services a `Request<Incoming>`; the layer rebuilds a deduplicated request's body
//! from the bytes it read, so the service takes `Request<RequestBody<Incoming>>` instead.
//!
//! Run with: cargo run -p tower-idemgate --example hyper
//!
//! ```sh
//! curl -si -X POST localhost:3002/jobs -H 'Idempotency-Key: job-1' -d 'resize photo 7'
//! curl -si -X POST localhost:3002/jobs -H 'Idempotency-Key: job-1' -d 'resize photo 7'   # replay
//! ```
//! Records survive a restart: they live in `./tower-idemgate-example-data`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use idemgate_stores::EmbeddedStore;
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_idemgate::{IdempotencyLayer, RequestBody, Scope};

/// The job service: reads the body, "enqueues" it, answers 202 with the job id.
async fn enqueue(
    jobs: Arc<AtomicU64>,
    req: Request<RequestBody<Incoming>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let n = jobs.fetch_add(1, Ordering::SeqCst) + 1;
    let answer = format!(r#"{{"job":"job_{n}","bytes":{}}}"#, body.len());
    Ok(Response::builder()
        .status(StatusCode::ACCEPTED)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(answer)))
        .unwrap())
}

/// Accepts connections on `listener` forever, every request through the layer.
pub async fn serve(listener: tokio::net::TcpListener, store: Arc<EmbeddedStore>, jobs: Arc<AtomicU64>) {
    let svc = ServiceBuilder::new()
        .map_request(|req: Request<Incoming>| req.map(RequestBody::new))
        .layer(IdempotencyLayer::new(store).required().scope(Scope::Global))
        .service_fn(move |req| enqueue(jobs.clone(), req));
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let svc = svc.clone();
        tokio::spawn(async move {
            let hyper_svc = hyper::service::service_fn(move |req| {
                let mut svc = svc.clone();
                async move { svc.ready().await?.call(req).await }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), hyper_svc)
                .await;
        });
    }
}

/// Opens the embedded store in `dir` and starts its sweeper and its answerer.
pub fn open(dir: &Path) -> Arc<EmbeddedStore> {
    let store = Arc::new(EmbeddedStore::open(dir).expect("the embedded store opens"));
    store.spawn_sweeper(std::time::Duration::from_secs(10));
    store.spawn_answerer();
    store
}

#[tokio::main]
async fn main() {
    let store = open(Path::new("./tower-idemgate-example-data"));
    let addr: SocketAddr = "127.0.0.1:3002".parse().unwrap();
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    println!("jobs API on http://{addr}");
    serve(listener, store, Arc::default()).await;
}
