//! The store the configuration chose, as one enum: static dispatch to each backend, no boxing
//! on the request path.
//!
//! Every call is bounded by `store.timeout`: the networked stores (redis, postgres) bound each
//! call themselves (connecting and retrying a lost connection included); the embedded store is
//! bounded here, so a stalled disk cannot hang a request either (the memory store never waits). A call past its bound is
//! [`StoreError::Timeout`], and the route's `on_store_error` decides what the client gets.
//!
//! Opening never waits for a server: a gateway starts while Redis or PostgreSQL is down,
//! answers by `on_store_error` meanwhile, and recovers without a restart when it comes back.

use std::future::Future;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use idemgate_core::MemoryStore;
use idemgate_core::notify::Notifier;
use idemgate_core::record::{LeaseToken, Millis, Record, StoredResponse};
use idemgate_core::rules::{Begin, BeginRequest};
use idemgate_core::store::{Store, StoreError};
use idemgate_stores::{EmbeddedStore, PostgresConfig, PostgresStore, RedisConfig, RedisStore};

use crate::config::{StoreConfig, StoreKind};

/// How often expired records are swept.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

#[derive(Debug)]
pub enum AnyStore {
    Memory(Arc<MemoryStore>),
    Embedded(Arc<EmbeddedStore>, Duration),
    Redis(Arc<RedisStore>),
    Postgres(Arc<PostgresStore>),
}

impl AnyStore {
    /// Opens the configured store and starts its background tasks (sweeper; for redis and
    /// postgres also the notification listener). Must run inside a Tokio runtime.
    ///
    /// # Errors
    /// The store cannot be opened (embedded: the file is locked or unwritable; redis and
    /// postgres: an unusable URL; their servers being down is not an error).
    pub fn open(config: &StoreConfig) -> Result<Self, StoreError> {
        let url = || {
            config
                .url
                .clone()
                .ok_or_else(|| StoreError::Backend("store.url is not set".into()))
        };
        Ok(match config.kind {
            StoreKind::Memory => {
                let store = Arc::new(MemoryStore::new(config.max_bytes));
                store.spawn_sweeper(SWEEP_EVERY);
                Self::Memory(store)
            }
            StoreKind::Embedded => {
                let store = Arc::new(EmbeddedStore::open(&config.path)?);
                store.spawn_sweeper(SWEEP_EVERY);
                store.spawn_answerer();
                keep_a_timer_ahead(&store, config.timeout);
                Self::Embedded(store, config.timeout)
            }
            StoreKind::Redis => {
                let redis = RedisConfig {
                    url: url()?,
                    prefix: config.prefix.clone(),
                    timeout: config.timeout,
                };
                // Redis expires keys itself: no sweeper.
                let store = Arc::new(RedisStore::new(&redis).map_err(StoreError::backend)?);
                connect_early("redis", &store);
                keep_a_timer_ahead(&store, config.timeout);
                Self::Redis(store)
            }
            StoreKind::Postgres => {
                let pg = PostgresConfig {
                    url: url()?,
                    timeout: config.timeout,
                    pool_size: config.pool_size,
                };
                let store = Arc::new(PostgresStore::new(&pg).map_err(StoreError::backend)?);
                store.spawn_sweeper(SWEEP_EVERY);
                // PostgreSQL also migrates on its first connection.
                connect_early("postgres", &store);
                keep_a_timer_ahead(&store, config.timeout);
                Self::Postgres(store)
            }
        })
    }
}

/// Connects a networked store in the background now rather than on the first request: that
/// request would otherwise wait for the handshake (and, on PostgreSQL, the migration), and in a
/// burst its connection's replies queue behind the whole burst (docs/benchmarks-journal.md, duplicate
/// storm). If the server is down, the first request after it comes back connects.
fn connect_early<S: Store + 'static>(kind: &'static str, store: &Arc<S>) {
    let store = Arc::downgrade(store);
    tokio::spawn(async move {
        if let Some(store) = store.upgrade()
            && let Err(e) = store.ping().await
        {
            tracing::warn!(error = %e, store = kind, "store not reachable yet; requests follow on_store_error until it is");
        }
    });
}

/// Keeps a timer pending that is always due before the bound of any store call being made, so
/// that registering a call's bound does not wake the runtime. Tokio wakes its I/O driver (an
/// eventfd write, then an extra `epoll_wait` turn) whenever a timer is registered earlier than
/// every timer that was pending when the driver last parked. Embedded calls are answered in
/// microseconds, so at each park few bounds were pending, and 0.28 eventfd writes per embedded
/// miss came from the gateway's own workers (`perf stat -e syscalls:sys_enter_write
/// --per-thread`; with this timer, 3 in 110k misses). Worth about 1% of an embedded miss's CPU
/// (docs/benchmarks-journal.md). Redis and PostgreSQL calls register the same kind of bound. This timer
/// costs two wake-ups per bound. It ends with the store.
fn keep_a_timer_ahead<S: Send + Sync + 'static>(store: &Arc<S>, bound: Duration) {
    let store = Arc::downgrade(store);
    let every = (bound / 2).max(Duration::from_millis(1));
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while store.strong_count() > 0 {
            tick.tick().await;
        }
    });
}

/// `fut` bounded by `limit` from its start; the timer is set only if its first poll does not
/// answer.
///
/// Most embedded calls (a replay, a fresh key's reservation) answer on their first poll; for
/// them the timer was set up and torn down for nothing, with a wrapper poll: 118-137 of a
/// 41.2k-instruction embedded replay (callgrind, docs/benchmarks-journal.md).
async fn bounded<T>(
    limit: Duration,
    fut: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    // Tokio's clock, which the timer runs on (the same as `Instant::now` unless a test paused
    // it). A first poll that reads redb counts against the bound too.
    let deadline = tokio::time::Instant::now().checked_add(limit);
    let mut fut = std::pin::pin!(fut);
    if let Poll::Ready(out) = std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await {
        return out;
    }
    match deadline {
        Some(deadline) => tokio::time::timeout_at(deadline, fut)
            .await
            .map_err(|_| StoreError::Timeout)?,
        None => fut.await,
    }
}

macro_rules! each {
    ($self:ident, $s:ident => $e:expr) => {
        match $self {
            // Never bounded: the memory store answers on its first poll (a std mutex, no await).
            AnyStore::Memory($s) => $e.await,
            // Boxed, like the networked stores below: bounded by its timer, the embedded
            // store's `complete` future is 1.4 KB, and unboxed it set the size of every future
            // that awaits a store, whatever the store (a memory store's `complete` is 128
            // bytes): `begin_traced` 1584 -> 688 bytes, `finish` 2240 -> 944, moved at each
            // level of a miss. The embedded miss did not measurably change (callgrind); its
            // call hands off to the writer thread anyway.
            AnyStore::Embedded($s, limit) => Box::pin(bounded(*limit, $e)).await,
            // Boxed: a networked store's futures (the clients' own) are 4-5 KB, and unboxed they
            // set the size of every future that awaits a store, for every store kind: a miss
            // moved about 14 KB of them (the execution and `dedup`, `memmove` 4% of a Redis
            // miss). One allocation beside a network round trip costs nothing.
            AnyStore::Redis($s) => Box::pin($e).await,
            AnyStore::Postgres($s) => Box::pin($e).await,
        }
    };
}

impl Store for AnyStore {
    async fn begin(&self, key: &str, req: &BeginRequest<'_>) -> Result<Begin, StoreError> {
        each!(self, s => s.begin(key, req))
    }
    async fn complete(
        &self,
        key: &str,
        token: LeaseToken,
        response: &StoredResponse,
        retention_ms: u64,
        now: Millis,
    ) -> Result<(), StoreError> {
        each!(self, s => s.complete(key, token, response, retention_ms, now))
    }
    async fn release(&self, key: &str, token: LeaseToken) -> Result<(), StoreError> {
        each!(self, s => s.release(key, token))
    }
    async fn renew(&self, key: &str, token: LeaseToken, lease_until: Millis) -> Result<(), StoreError> {
        each!(self, s => s.renew(key, token, lease_until))
    }
    async fn get(&self, key: &str, now: Millis) -> Result<Option<Record>, StoreError> {
        each!(self, s => s.get(key, now))
    }
    async fn purge(&self, key: &str) -> Result<bool, StoreError> {
        each!(self, s => s.purge(key))
    }
    async fn ping(&self) -> Result<(), StoreError> {
        each!(self, s => s.ping())
    }
    fn remote(&self) -> bool {
        matches!(self, Self::Redis(_) | Self::Postgres(_))
    }
    fn notifier(&self) -> &Arc<Notifier> {
        match self {
            Self::Memory(s) => s.notifier(),
            Self::Embedded(s, _) => s.notifier(),
            Self::Redis(s) => s.notifier(),
            Self::Postgres(s) => s.notifier(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    /// A networked store opens its command connection as the gateway starts, not on the first
    /// request. The listener is not a Redis or PostgreSQL server: it only counts the connections
    /// that arrive before any request is made, which a shared server could not tell apart from
    /// the other tests'. Two are expected: the notification connection, which each store opens
    /// at construction, and the command connection. Nothing answers them, and the store's
    /// timeout is longer than the wait, so neither is retried within it.
    #[tokio::test]
    async fn networked_stores_connect_at_start() {
        for (kind, scheme, db) in [
            (StoreKind::Redis, "redis", "0"),
            (StoreKind::Postgres, "postgres", "test"),
        ] {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = listener.local_addr().unwrap().port();
            let config = StoreConfig {
                kind,
                path: PathBuf::new(),
                max_bytes: 0,
                url: Some(format!("{scheme}://idemgate@127.0.0.1:{port}/{db}")),
                timeout: Duration::from_secs(60),
                prefix: "connect-at-start".into(),
                pool_size: 1,
            };
            let _store = AnyStore::open(&config).expect("a store opens while its server is unreachable");
            // Held open: a closed connection would be retried and counted twice.
            let mut open = Vec::new();
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            while open.len() < 2 {
                match tokio::time::timeout_at(deadline, listener.accept()).await {
                    Ok(Ok((conn, _))) => open.push(conn),
                    _ => break,
                }
            }
            assert_eq!(
                open.len(),
                2,
                "the {scheme} store opened {} connection(s) within 5 s of opening, not its notification and command connections",
                open.len()
            );
        }
    }

    /// The bound holds for a call that waits, and costs nothing to one that answers at once.
    #[tokio::test(start_paused = true)]
    async fn a_store_call_is_bounded_only_once_it_waits() {
        let limit = Duration::from_secs(2);
        let at_once = bounded(limit, async { Ok::<_, StoreError>(7) }).await;
        assert_eq!(at_once.unwrap(), 7);

        let started = tokio::time::Instant::now();
        let stalled = tokio::time::timeout(
            limit * 10,
            bounded(limit, std::future::pending::<Result<(), StoreError>>()),
        )
        .await
        .expect("the bound ends a stalled call");
        assert!(matches!(stalled, Err(StoreError::Timeout)), "{stalled:?}");
        assert_eq!(started.elapsed(), limit, "a stalled call ends at its bound");

        let waits_a_little = bounded(limit, async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            Ok::<_, StoreError>(8)
        })
        .await;
        assert_eq!(waits_a_little.unwrap(), 8);
    }
}
