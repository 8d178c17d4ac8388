//! Test harness: axum apps served over loopback, a counting handler with a gate, the stores
//! every behaviour test runs against, and waiting on conditions with deadlines.

#![allow(dead_code)] // each test binary uses a different subset

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use idemgate_core::store::Store;
use idemgate_core::{DynStore, MemoryStore};
use tokio::sync::{Notify, watch};

/// Every await in a test is bounded by this.
pub const DEADLINE: Duration = Duration::from_secs(20);

/// Awaits `fut`, failing the test after [`DEADLINE`].
pub async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(DEADLINE, fut)
        .await
        .unwrap_or_else(|_| panic!("timed out: {what}"))
}

/// Serves `app` on 127.0.0.1:0 for the rest of the test.
pub async fn serve(app: axum::Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// A plain HTTP client for tests (no retries, no pooling surprises).
pub fn http() -> reqwest::Client {
    reqwest::Client::builder().timeout(DEADLINE).build().unwrap()
}

/// A monotonically increasing count that tests can wait on.
///
/// The count lives in the watch channel alone: bumped under its lock, so two concurrent bumps
/// cannot publish out of order (a separate atomic counter published with `send_replace` could
/// leave the channel at 39 after the 40th bump, and a waiter for 40 waiting forever).
#[derive(Debug)]
pub struct Counter {
    tx: watch::Sender<u64>,
}

impl Default for Counter {
    fn default() -> Self {
        Self {
            tx: watch::channel(0).0,
        }
    }
}

impl Counter {
    /// Adds one; returns the new count.
    pub fn bump(&self) -> u64 {
        let mut n = 0;
        self.tx.send_modify(|v| {
            *v += 1;
            n = *v;
        });
        n
    }

    pub fn get(&self) -> u64 {
        *self.tx.borrow()
    }

    /// Waits (by notification, bounded) until the count is at least `n`.
    pub async fn reaches(&self, n: u64) {
        let mut rx = self.tx.subscribe();
        within(&format!("counter to reach {n}"), rx.wait_for(|v| *v >= n))
            .await
            .unwrap();
    }
}

/// A gate handlers wait at until the test opens it.
#[derive(Debug, Default)]
pub struct Gate {
    open: watch::Sender<bool>,
    _notify: Notify,
}

impl Gate {
    pub fn closed() -> Arc<Self> {
        Arc::new(Self {
            open: watch::channel(false).0,
            _notify: Notify::new(),
        })
    }

    pub fn opened() -> Arc<Self> {
        let g = Self::closed();
        g.open();
        g
    }

    pub fn open(&self) {
        self.open.send_replace(true);
    }

    pub async fn pass(&self) {
        let mut rx = self.open.subscribe();
        within("the gate to open", rx.wait_for(|o| *o)).await.unwrap();
    }
}

/// The stores the behaviour suite runs against.
pub async fn memory() -> Option<Arc<MemoryStore>> {
    Some(Arc::new(MemoryStore::new(64 << 20)))
}

pub async fn embedded() -> Option<Arc<idemgate_stores::EmbeddedStore>> {
    // Leaked on purpose: the directory must outlive the store, which outlives the test body in
    // spawned executions; the OS temp dir is cleaned by the system.
    let dir = tempfile::tempdir().unwrap().keep();
    Some(Arc::new(idemgate_stores::EmbeddedStore::open(dir).unwrap()))
}

pub async fn dyn_memory() -> Option<Arc<Arc<dyn DynStore>>> {
    let store: Arc<dyn DynStore> = Arc::new(MemoryStore::new(64 << 20));
    Some(Arc::new(store))
}

pub async fn redis() -> Option<Arc<idemgate_stores::RedisStore>> {
    let Ok(url) = std::env::var("IDEMGATE_TEST_REDIS_URL") else {
        eprintln!("skipped: IDEMGATE_TEST_REDIS_URL is not set");
        return None;
    };
    let mut config = idemgate_stores::RedisConfig::new(url);
    config.prefix = format!("tower-test-{}", idemgate_core::LeaseToken::random().0);
    Some(Arc::new(idemgate_stores::RedisStore::new(&config).unwrap()))
}

pub async fn postgres() -> Option<Arc<idemgate_stores::PostgresStore>> {
    let Ok(url) = std::env::var("IDEMGATE_TEST_PG_URL") else {
        eprintln!("skipped: IDEMGATE_TEST_PG_URL is not set");
        return None;
    };
    let store = idemgate_stores::PostgresStore::new(&idemgate_stores::PostgresConfig::new(url)).unwrap();
    store.migrate().await.unwrap();
    Some(Arc::new(store))
}

/// A key unique to one test run (stores such as Redis are shared between runs).
pub fn key(name: &str) -> String {
    format!("{name}-{}", idemgate_core::LeaseToken::random().0)
}

/// Whether the store is usable at all (for the skip messages of shared stores).
pub async fn ping<S: Store>(store: &S) -> bool {
    store.ping().await.is_ok()
}
pub mod app;
