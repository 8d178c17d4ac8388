//! How the pool opens connections: each on a task of its own, so that one still being set up
//! when its caller gives up is kept for the next caller instead of being thrown away.
//!
//! Why: a store call's deadline covers waiting for a pooled connection, and opening one used to
//! run inside that wait. When opening took longer than the deadline (a PostgreSQL busy forking
//! backends as a partition heals and every replica reconnects at once, a slow network), each
//! attempt was cut off half-open, so the pool never refilled and every call failed until the
//! load fell. The checker saw 0.5-1.1 s of `503 store-unavailable` after a blackhole lifted,
//! and `postgres_recovers_when_opening_a_connection_outlasts_the_store_timeout` in
//! `tests/checker.rs` saw no call succeed at all while opening took longer than the timeout.
//! Now the caller still gives up at its deadline, but the connection finishes opening and waits
//! in `ready` for the next caller.
//!
//! Bounds: no more connections open at once than the pool holds (the permits), at most that
//! many wait in `ready`, and an opening that never ends (a server that accepted the socket and
//! went silent: `connect_timeout` covers only the socket) is given up after [`open_bound`].

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use deadpool_postgres::Connect;
use futures_util::future::BoxFuture;
use tokio::sync::{Semaphore, oneshot};
use tokio::task::JoinHandle;
use tokio_postgres::{Client, Config, Error, NoTls};

type Opened = (Client, JoinHandle<()>);

/// Opens the pool's connections on tasks of their own (see the module's text).
pub(super) struct Connector {
    shared: Arc<Shared>,
}

struct Shared {
    /// Connections that finished opening after their caller had gone.
    ready: Mutex<Vec<Opened>>,
    /// One permit per connection being opened.
    opening: Arc<Semaphore>,
    most_ready: usize,
    bound: Duration,
}

/// How long an opening may take before it is given up: ten store timeouts, and at least 5 s,
/// long enough for a server that is slow rather than gone.
pub(super) fn open_bound(timeout: Duration) -> Duration {
    (timeout * 10).max(Duration::from_secs(5))
}

impl Connector {
    pub(super) fn new(pool_size: usize, timeout: Duration) -> Self {
        let pool_size = pool_size.max(1);
        Self {
            shared: Arc::new(Shared {
                ready: Mutex::new(Vec::new()),
                opening: Arc::new(Semaphore::new(pool_size)),
                most_ready: pool_size,
                bound: open_bound(timeout),
            }),
        }
    }
}

impl Shared {
    fn take_ready(&self) -> Option<Opened> {
        let mut ready = self.ready.lock().unwrap_or_else(PoisonError::into_inner);
        while let Some((client, task)) = ready.pop() {
            // One that closed while it waited (the server went away) is of no use.
            if !client.is_closed() {
                return Some((client, task));
            }
        }
        None
    }

    fn keep(&self, opened: Opened) {
        let mut ready = self.ready.lock().unwrap_or_else(PoisonError::into_inner);
        if ready.len() < self.most_ready {
            ready.push(opened);
        }
        // Else dropped: the client's end closes the connection and its task.
    }
}

impl Connect for Connector {
    fn connect(&self, pg: &Config) -> BoxFuture<'_, Result<Opened, Error>> {
        let shared = self.shared.clone();
        let pg = pg.clone();
        Box::pin(async move {
            // Closed never: the semaphore lives as long as `shared`.
            let Ok(permit) = shared.opening.clone().acquire_owned().await else {
                return std::future::pending().await;
            };
            // Waiting for the permit may have been waiting for an opening that has now landed.
            if let Some(opened) = shared.take_ready() {
                return Ok(opened);
            }
            let (tx, rx) = oneshot::channel();
            let keeper = shared.clone();
            tokio::spawn(async move {
                let _permit = permit;
                let Ok(result) = tokio::time::timeout(keeper.bound, open(&pg)).await else {
                    tracing::warn!(
                        after = ?keeper.bound,
                        "opening a postgres connection did not finish; given up"
                    );
                    return;
                };
                if let Err(Ok(opened)) = tx.send(result) {
                    keeper.keep(opened);
                }
            });
            match rx.await {
                Ok(result) => result,
                // Given up after the bound: the caller's own deadline (the pool's create
                // timeout, always shorter) has ended the wait long before.
                Err(_) => std::future::pending().await,
            }
        })
    }
}

/// Opens one connection and spawns the task that drives it, as deadpool's own connector does.
async fn open(pg: &Config) -> Result<Opened, Error> {
    let (client, connection) = pg.connect(NoTls).await?;
    let task = tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "postgres connection ended");
        }
    });
    Ok((client, task))
}
