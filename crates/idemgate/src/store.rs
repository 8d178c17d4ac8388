//! The store the configuration chose, as one enum: static dispatch to each backend, no boxing
//! on the request path.

use std::sync::Arc;
use std::time::Duration;

use idemgate_core::MemoryStore;
use idemgate_core::notify::Notifier;
use idemgate_core::record::{LeaseToken, Millis, Record, StoredResponse};
use idemgate_core::rules::{Begin, BeginRequest};
use idemgate_core::store::{Store, StoreError};
use idemgate_stores::EmbeddedStore;

use crate::config::{StoreConfig, StoreKind};

/// How often expired records are swept.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

#[derive(Debug)]
pub enum AnyStore {
    Memory(Arc<MemoryStore>),
    Embedded(Arc<EmbeddedStore>),
}

impl AnyStore {
    /// Opens the configured store and starts its background sweeper.
    ///
    /// # Errors
    /// The store cannot be opened.
    pub fn open(config: &StoreConfig) -> Result<Self, StoreError> {
        Ok(match config.kind {
            StoreKind::Memory => {
                let store = Arc::new(MemoryStore::new(config.max_bytes));
                store.spawn_sweeper(SWEEP_EVERY);
                Self::Memory(store)
            }
            StoreKind::Embedded => {
                let store = Arc::new(EmbeddedStore::open(&config.path)?);
                store.spawn_sweeper(SWEEP_EVERY);
                Self::Embedded(store)
            }
            StoreKind::Redis | StoreKind::Postgres => {
                return Err(StoreError::Backend("store kind not supported yet".into()));
            }
        })
    }
}

macro_rules! each {
    ($self:ident, $s:ident => $e:expr) => {
        match $self {
            AnyStore::Memory($s) => $e,
            AnyStore::Embedded($s) => $e,
        }
    };
}

impl Store for AnyStore {
    async fn begin(&self, key: &str, req: &BeginRequest<'_>) -> Result<Begin, StoreError> {
        each!(self, s => s.begin(key, req).await)
    }
    async fn complete(
        &self,
        key: &str,
        token: LeaseToken,
        response: StoredResponse,
        retention_ms: u64,
        now: Millis,
    ) -> Result<(), StoreError> {
        each!(self, s => s.complete(key, token, response, retention_ms, now).await)
    }
    async fn release(&self, key: &str, token: LeaseToken) -> Result<(), StoreError> {
        each!(self, s => s.release(key, token).await)
    }
    async fn renew(&self, key: &str, token: LeaseToken, lease_until: Millis) -> Result<(), StoreError> {
        each!(self, s => s.renew(key, token, lease_until).await)
    }
    async fn get(&self, key: &str, now: Millis) -> Result<Option<Record>, StoreError> {
        each!(self, s => s.get(key, now).await)
    }
    async fn purge(&self, key: &str) -> Result<bool, StoreError> {
        each!(self, s => s.purge(key).await)
    }
    async fn ping(&self) -> Result<(), StoreError> {
        each!(self, s => s.ping().await)
    }
    fn notifier(&self) -> &Arc<Notifier> {
        each!(self, s => s.notifier())
    }
}
