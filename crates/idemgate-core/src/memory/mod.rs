//! The memory store: records in sharded hash tables, bounded by a byte budget.
//!
//! Nothing survives a restart; use it for tests, benchmarks and single-replica gateways in front
//! of operations that are safe to repeat after a crash. When the budget is spent, new
//! reservations fail with [`StoreError::Full`]: a live record is never evicted to make room,
//! because evicting one would let its key execute twice.
//!
//! # Layout
//!
//! A gateway filled with millions of keys is mostly this store, so a record is kept as small as
//! it can be: one heap allocation per key, a `Box<[u8]>` holding the key and an encoding of its
//! [`Record`], in a `hashbrown::HashTable` per shard (the box and the key's hash, 24 bytes, and a
//! control byte per slot). The hash is kept so that growing a table reads only the table: with
//! it recomputed from each key, every slot cost a pointer chase to a cold box and a SipHash, and
//! the 64 shards, filling at the same rate, grew within moments of each other: a stall of 30 to
//! 50 ms every time the store doubled, which put the p99 of a half-load run at 15 times nginx's.
//! Keeping `Record` itself (a 208-byte table slot with its key, plus separate allocations for
//! the key, route, operation id, header vector, each header name and value, and the body) held
//! a 24-byte response in 1.6 KB of RSS under glibc malloc and 740 B under mimalloc, measured as
//! RSS growth over a 1,000,000-key fill of the gateway; massif put 41% of the live heap in the
//! tables. This layout holds the same record in about 220 B (glibc) and 205 B (mimalloc).
//! Records are decoded into a `Record` on access (the [`rules`] work on `Option<&Record>`) and
//! encoded again when a rule writes one; both take well under a microsecond, against tens of
//! microseconds for the proxied request around them. `complete`, which every miss makes, does
//! neither: [`rules::completion`] decides on the fields at the entry's head, and the completed
//! entry is the in-flight one's bytes up to its route followed by the response (decoding the
//! record and encoding it again cost a miss about 1,300 instructions, by callgrind).
//!
//! An entry is, in order (varints are LEB128):
//!
//! ```text
//! varint key length, key bytes
//! u8     flags (COMPLETED, HAS_BODY, NEVER_EXPIRES, operation id form)
//! varint created_at
//! varint zigzag(expires_at - created_at)             absent when NEVER_EXPIRES
//! [32]   fingerprint
//! [16]   lease token (little endian)
//! varint generation
//! [16]   operation id as UUID bytes (op_<32 hex> or hyphenated form), else varint length + bytes
//! varint route: 0 = varint length + bytes follow, i + 1 = the store's interned route i
//! in flight: varint zigzag(lease_until - created_at)
//! completed: varint status, varint header count, per header: varint name code (an index into
//!            HEADER_NAMES, or HEADER_NAMES.len() + length followed by the name's bytes),
//!            varint value length + bytes; then the body, to the end of the entry (HAS_BODY)
//! ```
//!
//! The expiry comes right after the key so the sweeper and [`MemoryStore::get`] can test
//! liveness without decoding the rest. The encoding is hand-written rather than `postcard`
//! (serde derives on `Record`): postcard would write the random 128-bit token as a varint of up
//! to 19 bytes, the operation id as its 35-character string, the route name and each header
//! name in full in every record, both absolute times as 6-byte varints and a length before the
//! body: about 40 bytes more for the benchmark's record (192 against 150 with its key). The
//! facts postcard cannot know (operation ids are UUIDs, routes are few, header names come from
//! a short allow-list, times cluster around `created_at`) are what make an entry small. The
//! layout is private to this process, so it needs no version.

use std::collections::BTreeMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak};
use std::time::Duration;

use hashbrown::HashTable;
use hashbrown::hash_table::Entry as Slot;

use crate::notify::Notifier;
use crate::record::{LeaseToken, Millis, Record, StoredResponse, now_millis};
use crate::rules::{self, Begin, BeginRequest, Write};
use crate::store::{Store, StoreError};

mod entry;
use entry::{Acquired, Completion, Corrupt, Fresh, Head, OpId, entry_expires_at, entry_key, exact};

const SHARDS: usize = 64;
const _: () = assert!(SHARDS.is_power_of_two() && SHARDS <= 128);

/// Bits 51..57 of a key's hash pick its shard. hashbrown takes a bucket from the low bits and a
/// control byte from the top seven (57..64): a shard picked from either would leave every key in
/// a shard sharing those bits, which clusters buckets or makes control-byte matches useless. One
/// hash then serves both the shard and the table.
const SHARD_SHIFT: u32 = 51;

/// Bytes counted per entry on top of its own length: its table slot (a 16-byte box pointer and
/// length, the 8-byte hash, and a control byte, at a load factor between 7/16 and 7/8) and the
/// allocator's rounding to a size class. Measured RSS per record is the entry length plus about
/// this.
const ENTRY_OVERHEAD: usize = 56;

/// Interned route ids per store. Route ids come from configuration and are few; past this many
/// distinct ones a record keeps its route inline, so a caller inventing routes costs bytes, not
/// unbounded interning.
const ROUTE_SLOTS: usize = 255;

/// One record: the key and its encoded record (see the module documentation).
type Entry = Box<[u8]>;
type Table = HashTable<Stored>;

/// A table slot: an entry and its key's hash.
struct Stored {
    hash: u64,
    entry: Entry,
}

impl Stored {
    fn is(&self, hash: u64, key: &str) -> bool {
        self.hash == hash && entry_key(&self.entry) == Some(key.as_bytes())
    }
}
type Shard = Mutex<Table>;
/// A shard's records by expiry: one-second buckets of record hashes. A sweep visits only the
/// due buckets instead of every record (a full scan of 10M records took about a second and held
/// the runtime's thread for it). Entries go stale when a record is rewritten with an expiry in
/// another second or removed; a stale hash simply finds nothing due.
type Expiries = Mutex<BTreeMap<u64, Vec<u64>>>;

/// A sharded in-memory record store.
pub struct MemoryStore {
    // SipHash rather than a faster hash (foldhash, ahash): keys are chosen by clients, and
    // SipHash with a random key is the one whose resistance to crafted collisions is argued.
    // Hashing a key of a few dozen bytes costs tens of nanoseconds, which no request notices.
    hasher: RandomState,
    // std Mutex rather than tokio's: every critical section is a table operation that never
    // awaits, and 64 shards keep contention low without a global lock.
    shards: Box<[Shard]>,
    expiries: Box<[Expiries]>,
    routes: Routes,
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
            shards: (0..SHARDS).map(|_| Mutex::new(HashTable::new())).collect(),
            expiries: (0..SHARDS).map(|_| Mutex::new(BTreeMap::new())).collect(),
            routes: Routes::new(),
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

    fn hash(&self, key: &[u8]) -> u64 {
        self.hasher.hash_one(key)
    }

    /// The key's hash and its locked shard.
    fn shard(&self, key: &str) -> (u64, MutexGuard<'_, Table>) {
        let hash = self.hash(key.as_bytes());
        (hash, lock(&self.shards[shard_of(hash)]))
    }

    /// Removes records expired at `now`, one shard at a time so no request waits long.
    pub fn sweep(&self, now: Millis) -> usize {
        (0..SHARDS).map(|i| self.sweep_shard(i, now)).sum()
    }

    /// Removes shard `i`'s records expired at `now`, visiting only its started expiry buckets.
    fn sweep_shard(&self, i: usize, now: Millis) -> usize {
        let started: Vec<(u64, Vec<u64>)> = {
            let mut index = lock(&self.expiries[i]);
            let mut started = Vec::new();
            while let Some(bucket) = index.first_entry() {
                if bucket.key().saturating_mul(1000) > now {
                    break;
                }
                started.push(bucket.remove_entry());
            }
            started
        };
        if started.is_empty() {
            return 0;
        }
        let mut removed = 0;
        let mut later = Vec::new();
        {
            let mut table = lock(&self.shards[i]);
            for (second, hashes) in started {
                // The bucket of the current second holds records not due yet: their hashes stay.
                let whole = second.saturating_add(1).saturating_mul(1000) <= now;
                for hash in hashes {
                    // Any expired entry the probe meets may go; an entry that does not parse
                    // cannot have come from `encode`, and keeping it is the side that never
                    // drops a live record.
                    let mut found = false;
                    while let Ok(slot) =
                        table.find_entry(hash, |s| entry_expires_at(&s.entry).is_some_and(|at| at <= now))
                    {
                        let (old, _) = slot.remove();
                        self.used.fetch_sub(cost(&old.entry), Ordering::Relaxed);
                        removed += 1;
                        found = true;
                    }
                    if !found && !whole {
                        later.push((second, hash));
                    }
                }
            }
        }
        if !later.is_empty() {
            let mut index = lock(&self.expiries[i]);
            for (second, hash) in later {
                index.entry(second).or_default().push(hash);
            }
        }
        removed
    }

    /// Sweeps expired records every `every` until the store is dropped, yielding between
    /// shards so requests on the same thread go on between them.
    pub fn spawn_sweeper(self: &Arc<Self>, every: Duration) -> tokio::task::JoinHandle<()> {
        let weak: Weak<Self> = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                for i in 0..SHARDS {
                    let Some(store) = weak.upgrade() else { return };
                    store.sweep_shard(i, now_millis());
                    drop(store);
                    tokio::task::yield_now().await;
                }
            }
        })
    }

    /// The key's record, decoded, from a locked shard.
    fn find(&self, table: &Table, hash: u64, key: &str) -> Result<Option<Record>, StoreError> {
        table
            .find(hash, |s| s.is(hash, key))
            .map(|s| self.decode(&s.entry))
            .transpose()
            .map_err(corrupt)
    }

    /// Applies a rule's write to a locked shard, keeping the byte count.
    fn apply(&self, table: &mut Table, hash: u64, key: &str, write: Write) {
        match write {
            Write::Keep => {}
            Write::Put(rec) => {
                let entry = self.encode(key, &rec);
                self.put(table, hash, key, entry);
            }
            Write::Delete => {
                self.delete(table, hash, key);
            }
        }
    }

    fn put(&self, table: &mut Table, hash: u64, key: &str, entry: Entry) {
        match table.entry(hash, |s| s.is(hash, key), |s| s.hash) {
            Slot::Occupied(mut slot) => self.replace(slot.get_mut(), entry),
            Slot::Vacant(slot) => {
                let (add, new_bucket) = (cost(&entry), expiry_bucket(&entry));
                slot.insert(Stored { hash, entry });
                self.used.fetch_add(add, Ordering::Relaxed);
                self.index(hash, new_bucket, None);
            }
        }
    }

    /// Puts a `begin`'s entry, refusing it when it would take a new key over the byte budget.
    /// A live record's rewrite (`is_new` false) always goes in: a full store refuses new keys
    /// but never a key it already holds.
    fn put_within_budget(
        &self,
        table: &mut Table,
        (hash, key): (u64, &str),
        entry: Entry,
        is_new: bool,
    ) -> Result<(), StoreError> {
        if is_new && self.used.load(Ordering::Relaxed) + cost(&entry) > self.max_bytes {
            return Err(StoreError::Full);
        }
        self.put(table, hash, key, entry);
        Ok(())
    }

    /// Puts `entry` in place of a slot's entry, keeping the byte count and the expiry index.
    fn replace(&self, slot: &mut Stored, entry: Entry) {
        let (add, new_bucket) = (cost(&entry), expiry_bucket(&entry));
        let old = std::mem::replace(&mut slot.entry, entry);
        self.used.fetch_sub(cost(&old), Ordering::Relaxed);
        self.used.fetch_add(add, Ordering::Relaxed);
        self.index(slot.hash, new_bucket, expiry_bucket(&old));
    }

    /// Indexes a record's hash under its new expiry second. Once per second: a rewrite within
    /// the same second (begin, then complete a moment later; renewals) is already there.
    fn index(&self, hash: u64, new_bucket: Option<u64>, old_bucket: Option<u64>) {
        if let Some(b) = new_bucket.filter(|b| old_bucket != Some(*b)) {
            lock(&self.expiries[shard_of(hash)])
                .entry(b)
                .or_default()
                .push(hash);
        }
    }

    fn delete(&self, table: &mut Table, hash: u64, key: &str) -> bool {
        match table.find_entry(hash, |s| s.is(hash, key)) {
            Ok(slot) => {
                let (old, _) = slot.remove();
                self.used.fetch_sub(cost(&old.entry), Ordering::Relaxed);
                true
            }
            Err(_) => false,
        }
    }

    /// Encodes `key` and `rec` into one exactly sized allocation.
    fn encode(&self, key: &str, rec: &Record) -> Entry {
        exact(&Fresh {
            key,
            rec,
            route: self.routes.intern(&rec.route),
            op: OpId::of(&rec.operation_id),
        })
    }

    fn decode(&self, entry: &[u8]) -> Result<Record, Corrupt> {
        entry::decode(entry, &self.routes)
    }
}

/// The expiry second an entry is indexed under; `None` for one that never expires.
fn expiry_bucket(entry: &[u8]) -> Option<u64> {
    entry_expires_at(entry)
        .filter(|at| *at != Millis::MAX)
        .map(|at| at / 1000)
}

fn corrupt(e: Corrupt) -> StoreError {
    StoreError::Corrupt(Box::new(e))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a shard cannot leave a record half-written (writes are single table
    // operations), so a poisoned lock is safe to keep using.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Bytes an entry counts against the budget.
fn cost(entry: &[u8]) -> usize {
    entry.len() + ENTRY_OVERHEAD
}

/// The interned route ids of one store: lock-free to read (decoding a record must not take a
/// store-wide lock), a mutex only to add a new id, which happens once per route.
struct Routes {
    names: Box<[OnceLock<Box<str>>]>,
    len: AtomicUsize,
    adding: Mutex<()>,
}

impl Routes {
    fn new() -> Self {
        Self {
            names: (0..ROUTE_SLOTS).map(|_| OnceLock::new()).collect(),
            len: AtomicUsize::new(0),
            adding: Mutex::new(()),
        }
    }

    fn find(&self, route: &str) -> Option<usize> {
        let len = self.len.load(Ordering::Acquire);
        self.names[..len]
            .iter()
            .position(|n| n.get().is_some_and(|n| &**n == route))
    }

    /// The route's index, interning it if there is room.
    fn intern(&self, route: &str) -> Option<usize> {
        if let Some(i) = self.find(route) {
            return Some(i);
        }
        let _adding = lock(&self.adding);
        if let Some(i) = self.find(route) {
            return Some(i);
        }
        let len = self.len.load(Ordering::Acquire);
        let slot = self.names.get(len)?;
        slot.set(route.into()).ok()?;
        self.len.store(len + 1, Ordering::Release);
        Some(len)
    }

    fn name(&self, i: usize) -> Option<&str> {
        self.names.get(i)?.get().map(|n| &**n)
    }
}

/// The shard a record hash belongs to (bits the table's own slot choice does not lean on).
fn shard_of(hash: u64) -> usize {
    #[allow(clippy::cast_possible_truncation)] // masked to 0..SHARDS
    let i = (hash >> SHARD_SHIFT) as usize & (SHARDS - 1);
    i
}

impl Store for MemoryStore {
    async fn begin(&self, key: &str, req: &BeginRequest<'_>) -> Result<Begin, StoreError> {
        let (hash, mut table) = self.shard(key);
        let mut existing = self.find(&table, hash, key)?;
        if existing.is_none() {
            // A key with no entry (never seen, or released, purged or swept; an expired entry
            // not yet swept takes the general path below): the in-flight entry is written
            // straight from the request and the rule's terms.
            let (answer, terms) = rules::begin_absent(req);
            let entry = exact(&Acquired {
                key,
                req,
                terms: &terms,
                route: self.routes.intern(req.route),
                op: OpId::of(req.operation_id),
            });
            self.put_within_budget(&mut table, (hash, key), entry, true)?;
            return Ok(answer);
        }
        let (answer, write) = rules::begin_taking(&mut existing, req);
        if let Write::Put(rec) = write {
            let entry = self.encode(key, &rec);
            let is_new = existing.is_none_or(|old| !old.is_live(req.now));
            self.put_within_budget(&mut table, (hash, key), entry, is_new)?;
        } else {
            self.apply(&mut table, hash, key, write);
        }
        Ok(answer)
    }

    async fn complete(
        &self,
        key: &str,
        token: LeaseToken,
        response: &StoredResponse,
        retention_ms: u64,
        now: Millis,
    ) -> Result<(), StoreError> {
        {
            let (hash, mut table) = self.shard(key);
            // No record: nothing of this owner's is left (released, purged or swept).
            let slot = table.find_mut(hash, |s| s.is(hash, key)).ok_or(rules::Fenced)?;
            // Decided on the entry's head and written from it: the record is never decoded, so
            // its operation id and route are neither allocated nor parsed again.
            let head = Head::read(&slot.entry).map_err(corrupt)?;
            if let Some(expires_at) = rules::completion(head.standing, token, retention_ms, now)? {
                let entry = exact(&Completion {
                    head: &head,
                    response,
                    expires_at,
                });
                self.replace(slot, entry);
            }
        }
        self.notifier.notify(key);
        Ok(())
    }

    async fn release(&self, key: &str, token: LeaseToken) -> Result<(), StoreError> {
        {
            let (hash, mut table) = self.shard(key);
            let existing = self.find(&table, hash, key)?;
            let write = rules::release(existing.as_ref(), token)?;
            self.apply(&mut table, hash, key, write);
        }
        self.notifier.notify(key);
        Ok(())
    }

    async fn renew(&self, key: &str, token: LeaseToken, lease_until: Millis) -> Result<(), StoreError> {
        let (hash, mut table) = self.shard(key);
        let existing = self.find(&table, hash, key)?;
        let write = rules::renew(existing.as_ref(), token, lease_until)?;
        self.apply(&mut table, hash, key, write);
        Ok(())
    }

    async fn get(&self, key: &str, now: Millis) -> Result<Option<Record>, StoreError> {
        let (hash, table) = self.shard(key);
        let Some(Stored { entry, .. }) = table.find(hash, |s| s.is(hash, key)) else {
            return Ok(None);
        };
        // An expired record reads as absent; skip decoding it.
        if entry_expires_at(entry).is_some_and(|at| now >= at) {
            return Ok(None);
        }
        let rec = self.decode(entry).map_err(corrupt)?;
        Ok(rec.is_live(now).then_some(rec))
    }

    async fn purge(&self, key: &str) -> Result<bool, StoreError> {
        let existed = {
            let (hash, mut table) = self.shard(key);
            self.delete(&mut table, hash, key)
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
mod tests;
