//! The listener: accepts connections, serves HTTP/1.1, and shuts down gracefully.
//!
//! On the shutdown signal it stops accepting, lets open connections finish their current
//! request, then waits for executions still running upstream so that each one completes or
//! releases its record, and for store calls finishing for clients that went away (a key such a
//! call took for nobody is released). Both waits are bounded by `server.shutdown_timeout`.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;

use crate::framing::Sniffer;
use crate::head_timer::HeadTimer;
use crate::proxy::Gateway;

/// The largest request head accepted; larger ones get 431 from hyper.
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// Serves until `shutdown` resolves, then drains.
pub async fn serve(gateway: Arc<Gateway>, listener: TcpListener, shutdown: impl Future<Output = ()>) {
    let graceful = GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.header_read_timeout(gateway.config().header_read_timeout)
        .max_header_size(MAX_HEAD_BYTES)
        // `writev(false)` (one flat buffer per response) read 2% fewer instructions per
        // passthrough, but hyper copies each body chunk whole into that buffer and keeps its
        // capacity for the connection's life: a 1 MiB replay would pin 1 MiB per connection.
        .keep_alive(true);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let gw = gateway.clone();
        let (stream, verdicts) = Sniffer::new(stream);
        // `handle`'s own future, not one wrapped in a block: hyper moves the service's future
        // into place for every request, and a wrapper would hold the request's state twice
        // over (its captures, then the inner future), a move of several KiB more.
        let svc = service_fn(move |req| gw.clone().handle(req, peer, verdicts.next()));
        // A timer of its own per connection: see `head_timer`. (The builder keeps the last
        // one until the next accept; an armed clock there costs one timer entry.)
        http.timer(HeadTimer::default());
        let conn = graceful.watch(http.serve_connection(TokioIo::new(stream), svc));
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    let grace = gateway.config().shutdown_timeout;
    tracing::info!("shutting down: finishing in-flight requests");
    if tokio::time::timeout(grace, graceful.shutdown()).await.is_err() {
        tracing::warn!("connections still open after the shutdown timeout");
    }
    gateway.tasks().close();
    if tokio::time::timeout(grace, gateway.tasks().wait()).await.is_err() {
        tracing::warn!("executions still running after the shutdown timeout; their leases will expire");
    }
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        () = term => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
