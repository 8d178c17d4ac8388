//! The `LISTEN` connection: one per store, outside the pool, turning notifications on
//! [`super::CHANNEL`] into local wake-ups.
//!
//! When it drops (a terminated backend, a restarted server) or stops answering its periodic
//! ping, it reconnects with a bounded backoff, and after every (re)`LISTEN` all local waiters
//! are woken: notifications sent while it was away are lost, and a woken waiter re-checks the
//! store, so a lost one only delays.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use idemgate_core::notify::Notifier;
use tokio_postgres::{AsyncMessage, NoTls};

const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// How often the connection is checked with a query, and the query (named, so operators can
/// tell the listener in `pg_stat_activity`).
const PING_EVERY: Duration = Duration::from_secs(5);
const PING: &str = "SELECT 'idemgate-listen'";

/// Runs until the store is dropped (the task is aborted then).
pub(super) async fn run(config: tokio_postgres::Config, notifier: Arc<Notifier>, timeout: Duration) {
    let mut backoff = Duration::from_millis(50);
    loop {
        // Bounded like the pool's openings, not by the store's timeout: an opening slower
        // than a call (a server busy forking backends) must still get through.
        match tokio::time::timeout(super::connect::open_bound(timeout), config.connect(NoTls)).await {
            Ok(Ok((client, mut connection))) => {
                // The connection object must be polled for notifications to arrive; the client
                // is used once, to LISTEN, and kept alive as long as the connection runs.
                let wake = notifier.clone();
                let mut driver = tokio::spawn(async move {
                    let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
                    while let Some(message) = messages.next().await {
                        match message {
                            Ok(AsyncMessage::Notification(n)) => wake.notify(n.payload()),
                            Ok(_) => {}
                            Err(e) => {
                                tracing::warn!(error = %e, "postgres notification connection failed");
                                break;
                            }
                        }
                    }
                });
                let listen = format!("LISTEN {}", super::CHANNEL);
                match tokio::time::timeout(timeout, client.batch_execute(&listen)).await {
                    Ok(Ok(())) => {
                        backoff = Duration::from_millis(50);
                        tracing::debug!("postgres notifications listening");
                        // Anything sent while we were not listening is lost: wake everyone.
                        notifier.notify_all();
                        // Until the connection ends or stops answering (a half-open
                        // connection delivers nothing and never closes by itself).
                        let mut ping =
                            tokio::time::interval_at(tokio::time::Instant::now() + PING_EVERY, PING_EVERY);
                        ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                        loop {
                            tokio::select! {
                                _ = &mut driver => break,
                                _ = ping.tick() => {
                                    let alive = tokio::time::timeout(timeout, client.simple_query(PING)).await;
                                    if !matches!(alive, Ok(Ok(_))) {
                                        driver.abort();
                                        break;
                                    }
                                }
                            }
                        }
                        tracing::warn!("postgres notification connection lost; reconnecting");
                        notifier.notify_all();
                    }
                    _ => driver.abort(),
                }
                drop(client);
            }
            Ok(Err(e)) => tracing::debug!(error = %e, "postgres notification connect failed; retrying"),
            Err(_) => tracing::debug!("postgres notification connect timed out; retrying"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}
