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
//! in `ready`, where the next caller (or one already waiting for its own opening) takes it.
//!
//! Bounds: at most `pool_size` openings at a time (the permits) and `pool_size` connections
//! waiting in `ready`, where [`Opener::prune`] drops those nobody took for a sweep interval; an
//! opening that never ends (a server that accepted the socket and went silent: `connect_timeout`
//! covers only the socket) is given up after [`open_bound`].

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use deadpool_postgres::{ConfigConnectImpl, Connect};
use futures_util::future::BoxFuture;
use tokio::sync::{Notify, Semaphore, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_postgres::{Client, Config, Error, NoTls};

type Opened = (Client, JoinHandle<()>);

/// How long an opening may take before it is given up: three store timeouts, and at least
/// 2 s, long enough for a server that is slow rather than gone.
pub(super) fn open_bound(timeout: Duration) -> Duration {
    (timeout * 3).max(Duration::from_secs(2))
}

/// Opens the pool's connections on tasks of their own (see the module's text); shared by the
/// pool's [`Connector`] and the store, whose sweeper prunes `ready`.
pub(super) struct Opener {
    /// Connections that finished opening after their caller had gone, with when they landed.
    ready: Mutex<Vec<(Instant, Opened)>>,
    /// Told when a connection lands in `ready`.
    landed: Notify,
    /// One permit per connection being opened.
    opening: Arc<Semaphore>,
    most_ready: usize,
    bound: Duration,
}

impl Opener {
    pub(super) fn new(pool_size: usize, timeout: Duration) -> Arc<Self> {
        let pool_size = pool_size.max(1);
        Arc::new(Self {
            ready: Mutex::new(Vec::new()),
            landed: Notify::new(),
            opening: Arc::new(Semaphore::new(pool_size)),
            most_ready: pool_size,
            bound: open_bound(timeout),
        })
    }

    fn ready(&self) -> std::sync::MutexGuard<'_, Vec<(Instant, Opened)>> {
        self.ready.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn take_ready(&self) -> Option<Opened> {
        let mut ready = self.ready();
        while let Some((_, (client, task))) = ready.pop() {
            // One that closed while it waited (the server went away) is of no use.
            if !client.is_closed() {
                return Some((client, task));
            }
        }
        None
    }

    fn keep(&self, opened: Opened) {
        {
            let mut ready = self.ready();
            if ready.len() >= self.most_ready {
                // Dropped: the client's end closes the connection and its task.
                return;
            }
            ready.push((Instant::now(), opened));
        }
        self.landed.notify_waiters();
    }

    /// Drops the connections that have waited in `ready` for `older_than` or longer: the pool
    /// did without them, and each holds a PostgreSQL backend.
    pub(super) fn prune(&self, older_than: Duration) {
        let now = Instant::now();
        self.ready()
            .retain(|(landed, _)| now.duration_since(*landed) < older_than);
    }

    async fn connect(self: Arc<Self>, pg: Config) -> Result<Opened, Error> {
        let landed = self.landed.notified();
        tokio::pin!(landed);
        // Registered before looking, so a connection that lands after the look still wakes us.
        landed.as_mut().enable();
        if let Some(opened) = self.take_ready() {
            return Ok(opened);
        }
        let Ok(permit) = self.opening.clone().acquire_owned().await else {
            unreachable!("the semaphore is never closed")
        };
        // Waiting for the permit may have been waiting for an opening that has now landed.
        if let Some(opened) = self.take_ready() {
            return Ok(opened);
        }
        let (tx, rx) = oneshot::channel();
        let opener = self.clone();
        tokio::spawn(async move {
            let _permit = permit;
            // Deadpool's own connector, on this task: it opens and spawns the connection's driver.
            let opening = ConfigConnectImpl { tls: NoTls };
            let Ok(result) = tokio::time::timeout(opener.bound, opening.connect(&pg)).await else {
                tracing::warn!(after = ?opener.bound, "opening a postgres connection did not finish; given up");
                return;
            };
            match tx.send(result) {
                Ok(()) => {}
                Err(Ok(opened)) => opener.keep(opened),
                Err(Err(e)) => {
                    tracing::debug!(error = %e, "opening a postgres connection failed after its caller had gone")
                }
            }
        });
        let mut mine = Waiting {
            rx,
            opener: self.clone(),
        };
        loop {
            tokio::select! {
                result = &mut mine.rx => {
                    return match result {
                        Ok(result) => result,
                        // Given up after the bound: the caller's deadline (the pool's create
                        // timeout, always shorter) has ended the wait long before.
                        Err(_) => std::future::pending().await,
                    };
                }
                () = &mut landed => {
                    // Another caller's opening landed first: take it; ours lands in `ready`.
                    if let Some(opened) = self.take_ready() {
                        return Ok(opened);
                    }
                    landed.set(self.landed.notified());
                    landed.as_mut().enable();
                }
            }
        }
    }
}

/// A caller's wait for its opening. Dropped before the opening was received (the caller gave
/// up), it keeps a connection that was already sent, which would otherwise go with the channel.
struct Waiting {
    rx: oneshot::Receiver<Result<Opened, Error>>,
    opener: Arc<Opener>,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        // Closed first: from here on the opening task keeps what it has, so nothing is lost
        // between the two.
        self.rx.close();
        if let Ok(Ok(opened)) = self.rx.try_recv() {
            self.opener.keep(opened);
        }
    }
}

/// The pool's side of [`Opener`].
pub(super) struct Connector(pub(super) Arc<Opener>);

impl Connect for Connector {
    fn connect(&self, pg: &Config) -> BoxFuture<'_, Result<Opened, Error>> {
        Box::pin(self.0.clone().connect(pg.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pg_config() -> Option<Config> {
        let Ok(url) = std::env::var("IDEMGATE_TEST_PG_URL") else {
            println!("skipped: IDEMGATE_TEST_PG_URL is not set");
            return None;
        };
        Some(url.parse().expect("a PostgreSQL URL"))
    }

    /// A caller that gives up while its connection opens leaves it to the next caller, who gets
    /// it without opening another; one nobody takes is pruned.
    #[tokio::test]
    async fn an_opening_outlives_its_caller_and_serves_the_next() {
        let Some(pg) = pg_config() else { return };
        let opener = Opener::new(2, Duration::from_millis(500));
        // Gone long before a connection could open.
        let gave_up =
            tokio::time::timeout(Duration::from_micros(1), opener.clone().connect(pg.clone())).await;
        assert!(gave_up.is_err(), "the caller gave up");
        let deadline = Instant::now() + Duration::from_secs(10);
        while opener.ready().is_empty() {
            assert!(Instant::now() < deadline, "the abandoned opening never landed");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let (client, _task) = opener
            .clone()
            .connect(pg.clone())
            .await
            .expect("the kept connection");
        assert!(
            opener.ready().is_empty(),
            "the next caller took the kept connection"
        );
        assert_eq!(opener.opening.available_permits(), 2, "no opening runs");
        let one: i32 = client.query_one("SELECT 1", &[]).await.unwrap().get(0);
        assert_eq!(one, 1);

        let gave_up = tokio::time::timeout(Duration::from_micros(1), opener.clone().connect(pg)).await;
        assert!(gave_up.is_err());
        while opener.ready().is_empty() {
            assert!(Instant::now() < deadline, "the abandoned opening never landed");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        opener.prune(Duration::from_secs(60));
        assert_eq!(opener.ready().len(), 1, "a fresh one stays");
        opener.prune(Duration::ZERO);
        assert!(opener.ready().is_empty(), "pruned");
    }
}
