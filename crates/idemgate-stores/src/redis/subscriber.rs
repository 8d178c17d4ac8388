//! The notification subscriber: one dedicated pub/sub connection per store that turns messages
//! on `{prefix}:done` into local wake-ups.
//!
//! A pub/sub connection cannot carry commands, so it is separate from the command connection.
//! When it drops (Redis restarted, network cut) or stops answering its periodic PING (a
//! half-open connection), it is re-established with a bounded backoff,
//! and after every (re)subscription all local waiters are woken: messages published while it
//! was down are lost, and a woken waiter re-checks the store, so a lost message only delays.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use idemgate_core::notify::Notifier;

/// The longest pause between two connection attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// How often the subscription is checked with a PING.
const PING_EVERY: Duration = Duration::from_secs(5);

/// Runs until the store is dropped (the task is aborted then).
pub(super) async fn run(client: redis::Client, channel: String, notifier: Arc<Notifier>, timeout: Duration) {
    let mut backoff = Duration::from_millis(50);
    loop {
        match subscribe(&client, &channel, timeout).await {
            Ok(pubsub) => {
                backoff = Duration::from_millis(50);
                tracing::debug!(%channel, "redis notifications subscribed");
                // Anything published while we were not listening is lost: wake everyone.
                notifier.notify_all();
                listen(pubsub, &notifier, timeout).await;
                tracing::warn!(%channel, "redis notification connection lost; reconnecting");
                notifier.notify_all();
            }
            Err(e) => {
                tracing::debug!(error = %e, "redis notification subscribe failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

/// Wakes waiters for every message until the connection ends or stops answering pings (a
/// half-open connection delivers nothing and never closes by itself).
async fn listen(pubsub: redis::aio::PubSub, notifier: &Notifier, timeout: Duration) {
    let (mut sink, mut messages) = pubsub.split();
    let mut ping = tokio::time::interval_at(tokio::time::Instant::now() + PING_EVERY, PING_EVERY);
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            msg = messages.next() => match msg {
                Some(msg) => {
                    if let Ok(key) = msg.get_payload::<String>() {
                        notifier.notify(&key);
                    }
                }
                None => return,
            },
            _ = ping.tick() => {
                let alive = tokio::time::timeout(timeout, sink.ping::<redis::Value>()).await;
                if !matches!(alive, Ok(Ok(v)) if !matches!(v, redis::Value::ServerError(_))) {
                    return;
                }
            }
        }
    }
}

async fn subscribe(
    client: &redis::Client,
    channel: &str,
    timeout: Duration,
) -> Result<redis::aio::PubSub, Box<dyn std::error::Error + Send + Sync>> {
    let connect = async {
        let mut pubsub = client.get_async_pubsub().await?;
        pubsub.subscribe(channel).await?;
        // redis-rs hands an error reply to SUBSCRIBE (NOAUTH, say) back as a value rather than
        // an error, so make sure the connection answers before trusting it.
        pubsub.ping::<redis::Value>().await?.extract_error()?;
        Ok::<_, redis::RedisError>(pubsub)
    };
    Ok(tokio::time::timeout(timeout, connect).await??)
}
