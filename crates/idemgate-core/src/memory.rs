//! The memory store: records in sharded hash maps, bounded by a byte budget.
//!
//! Nothing survives a restart; use it for tests, benchmarks and single-replica gateways in front
//! of operations that are safe to repeat after a crash. When the budget is spent, new
//! reservations fail with [`StoreError::Full`]: a live record is never evicted to make room,
//! because evicting one would let its key execute twice.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use crate::notify::Notifier;
use crate::record::{LeaseToken, Millis, Record, StoredResponse, now_millis};
use crate::rules::{self, Begin, BeginRequest, Write};
use crate::store::{Store, StoreError};

const SHARDS: usize = 64;

type Shard = Mutex<HashMap<Box<str>, Record>>;

/// A sharded in-memory record store.
pub struct MemoryStore {
    hasher: RandomState,
    // std Mutex rather than tokio's: every critical section is a map operation that never awaits,
    // and 64 shards keep contention low without a global lock.
    shards: Box<[Shard]>,
    used: AtomicUsize,
    max_bytes: usize,
    notifier: Arc<Notifier>,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("used", &self.used.load(Ordering::Relaxed))
            .field("max_bytes", &self.max_bytes)
            .finish_non_exhaustive()
    }
}

impl MemoryStore {
    /// A store that refuses new reservations once about `max_bytes` are held.
    #[must_use]
    pub fn new(max_bytes: usize) -> Self {
        Self {
            hasher: RandomState::new(),
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            used: AtomicUsize::new(0),
            max_bytes,
            notifier: Arc::new(Notifier::default()),
        }
    }

    /// Approximate bytes held by records.
    #[must_use]
    pub fn used_bytes(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Number of records held (expired ones included until swept).
    #[must_use]
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).len()).sum()
    }

    /// Whether no record is held.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn shard(&self, key: &str) -> MutexGuard<'_, HashMap<Box<str>, Record>> {
        let i = usize::try_from(self.hasher.hash_one(key)).unwrap_or(0) % SHARDS;
        lock(&self.shards[i])
    }

    /// Removes records expired at `now`, one shard at a time so no request waits long.
    pub fn sweep(&self, now: Millis) -> usize {
        let mut removed = 0;
        for shard in &*self.shards {
            let mut map = lock(shard);
            map.retain(|key, rec| {
                let keep = rec.is_live(now);
                if !keep {
                    self.used.fetch_sub(rec.approx_bytes(key), Ordering::Relaxed);
                    removed += 1;
                }
                keep
            });
        }
        removed
    }

    /// Sweeps expired records every `every` until the store is dropped.
    pub fn spawn_sweeper(self: &Arc<Self>, every: Duration) -> tokio::task::JoinHandle<()> {
        let weak: Weak<Self> = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(store) = weak.upgrade() else { return };
                store.sweep(now_millis());
            }
        })
    }

    /// Applies a rule's write to a locked shard, keeping the byte count.
    fn apply(&self, map: &mut HashMap<Box<str>, Record>, key: &str, write: Write) {
        match write {
            Write::Keep => {}
            Write::Put(rec) => {
                let add = rec.approx_bytes(key);
                if let Some(old) = map.insert(key.into(), rec) {
                    self.used.fetch_sub(old.approx_bytes(key), Ordering::Relaxed);
                }
                self.used.fetch_add(add, Ordering::Relaxed);
            }
            Write::Delete => {
                if let Some(old) = map.remove(key) {
                    self.used.fetch_sub(old.approx_bytes(key), Ordering::Relaxed);
                }
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a shard cannot leave a record half-written (writes are single map
    // operations), so a poisoned lock is safe to keep using.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Store for MemoryStore {
    async fn begin(&self, key: &str, req: &BeginRequest<'_>) -> Result<Begin, StoreError> {
        let mut map = self.shard(key);
        let (answer, write) = rules::begin(map.get(key), req);
        if let Write::Put(rec) = &write {
            let is_new = map.get(key).is_none_or(|old| !old.is_live(req.now));
            if is_new && self.used.load(Ordering::Relaxed) + rec.approx_bytes(key) > self.max_bytes {
                return Err(StoreError::Full);
            }
        }
        self.apply(&mut map, key, write);
        Ok(answer)
    }

    async fn complete(
        &self,
        key: &str,
        token: LeaseToken,
        response: StoredResponse,
        retention_ms: u64,
        now: Millis,
    ) -> Result<(), StoreError> {
        {
            let mut map = self.shard(key);
            let write = rules::complete(map.get(key), token, response, retention_ms, now)?;
            self.apply(&mut map, key, write);
        }
        self.notifier.notify(key);
        Ok(())
    }

    async fn release(&self, key: &str, token: LeaseToken) -> Result<(), StoreError> {
        {
            let mut map = self.shard(key);
            let write = rules::release(map.get(key), token)?;
            self.apply(&mut map, key, write);
        }
        self.notifier.notify(key);
        Ok(())
    }

    async fn renew(&self, key: &str, token: LeaseToken, lease_until: Millis) -> Result<(), StoreError> {
        let mut map = self.shard(key);
        let write = rules::renew(map.get(key), token, lease_until)?;
        self.apply(&mut map, key, write);
        Ok(())
    }

    async fn get(&self, key: &str, now: Millis) -> Result<Option<Record>, StoreError> {
        Ok(self.shard(key).get(key).filter(|r| r.is_live(now)).cloned())
    }

    async fn purge(&self, key: &str) -> Result<bool, StoreError> {
        let existed = {
            let mut map = self.shard(key);
            let existed = map.contains_key(key);
            self.apply(&mut map, key, Write::Delete);
            existed
        };
        self.notifier.notify(key);
        Ok(existed)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }

    fn notifier(&self) -> &Arc<Notifier> {
        &self.notifier
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::Fingerprint;

    fn req(token: LeaseToken, now: Millis) -> BeginRequest<'static> {
        BeginRequest {
            fingerprint: Fingerprint([1; 32]),
            route: "r",
            token,
            operation_id: "op",
            lease_ms: 1_000,
            retention_ms: 10_000,
            takeover: true,
            now,
        }
    }

    #[tokio::test]
    async fn a_full_store_refuses_new_keys_but_never_evicts_live_ones() {
        let store = MemoryStore::new(1_000);
        let mut held = Vec::new();
        let mut i = 0;
        let refused = loop {
            let key = format!("k{i}");
            match store.begin(&key, &req(LeaseToken::random(), 0)).await {
                Ok(Begin::Acquired { .. }) => held.push(key),
                Err(StoreError::Full) => break key,
                other => panic!("{other:?}"),
            }
            i += 1;
        };
        assert!(!held.is_empty());
        // Every live record is still there, and the refused key left nothing behind.
        for key in &held {
            assert!(store.get(key, 0).await.unwrap().is_some(), "{key} was evicted");
        }
        assert!(store.get(&refused, 0).await.unwrap().is_none());
        // Once records expire and are swept, there is room again.
        assert_eq!(store.sweep(20_000), held.len());
        assert_eq!(store.used_bytes(), 0);
        assert!(matches!(
            store.begin(&refused, &req(LeaseToken::random(), 20_000)).await,
            Ok(Begin::Acquired { .. })
        ));
    }
}
