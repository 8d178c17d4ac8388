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
//! microseconds for the proxied request around them.
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

use bytes::Bytes;
use hashbrown::HashTable;
use hashbrown::hash_table::Entry as Slot;

use crate::engine::OperationId;
use crate::fingerprint::Fingerprint;
use crate::notify::Notifier;
use crate::record::{LeaseToken, Millis, Record, RecordState, StoredResponse, now_millis};
use crate::rules::{self, Begin, BeginRequest, Write};
use crate::store::{Store, StoreError};

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

/// A compression dictionary for stored header names: the storable response headers of
/// [`crate::engine::is_storable_header`] (kept in upstream order there, not here). A name not in
/// it is stored inline, so this list falling behind the allow-list only costs bytes.
const HEADER_NAMES: &[&str] = &[
    "content-type",
    "location",
    "etag",
    "cache-control",
    "content-disposition",
    "content-encoding",
    "content-language",
    "content-location",
    "expires",
    "last-modified",
    "link",
    "retry-after",
    "vary",
    "x-request-id",
];

const COMPLETED: u8 = 1;
const HAS_BODY: u8 = 1 << 1;
const NEVER_EXPIRES: u8 = 1 << 2;
const OP_SHIFT: u8 = 3;
const OP_MASK: u8 = 0b11 << OP_SHIFT;
const OP_RAW: u8 = 0;
const OP_PREFIXED_UUID: u8 = 1;
const OP_HYPHENATED_UUID: u8 = 2;

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
            .map_err(|e| StoreError::Corrupt(Box::new(e)))
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
        let add = cost(&entry);
        let bucket = |e: &[u8]| {
            entry_expires_at(e)
                .filter(|at| *at != Millis::MAX)
                .map(|at| at / 1000)
        };
        let new_bucket = bucket(&entry);
        let old_bucket = match table.entry(hash, |s| s.is(hash, key), |s| s.hash) {
            Slot::Occupied(mut slot) => {
                let old = std::mem::replace(&mut slot.get_mut().entry, entry);
                self.used.fetch_sub(cost(&old), Ordering::Relaxed);
                bucket(&old)
            }
            Slot::Vacant(slot) => {
                slot.insert(Stored { hash, entry });
                None
            }
        };
        self.used.fetch_add(add, Ordering::Relaxed);
        // Indexed once per expiry second: a rewrite within the same second (begin, then complete
        // a moment later; renewals) is already there.
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

    /// Encodes `key` and `rec` into one exactly sized allocation: the fields are written twice,
    /// once to count and once to fill, because a `Vec` grown and then shrunk with
    /// `into_boxed_slice` may keep a larger block than it needs under allocators that shrink
    /// in place.
    fn encode(&self, key: &str, rec: &Record) -> Entry {
        let route = self.routes.intern(&rec.route);
        let op = OpId::of(&rec.operation_id);
        let mut count = Count(0);
        write_entry(&mut count, key, rec, route, &op);
        let mut out = Vec::with_capacity(count.0);
        write_entry(&mut out, key, rec, route, &op);
        debug_assert_eq!(out.len(), count.0);
        out.into_boxed_slice()
    }

    fn decode(&self, entry: &[u8]) -> Result<Record, Corrupt> {
        let mut r = Reader(entry);
        let key_len = r.len()?;
        r.take(key_len)?;
        let flags = r.byte()?;
        let created_at = r.varint()?;
        let expires_at = if flags & NEVER_EXPIRES == 0 {
            from_delta(created_at, r.varint()?)
        } else {
            Millis::MAX
        };
        let fingerprint = Fingerprint(r.array()?);
        let token = LeaseToken(u128::from_le_bytes(r.array()?));
        let generation = r.varint()?;
        let operation_id = match (flags & OP_MASK) >> OP_SHIFT {
            OP_RAW => r.string()?,
            OP_PREFIXED_UUID => OperationId::of(uuid::Uuid::from_bytes(r.array()?))
                .as_str()
                .to_owned(),
            OP_HYPHENATED_UUID => uuid::Uuid::from_bytes(r.array()?).hyphenated().to_string(),
            _ => return Err(Corrupt("operation id form")),
        };
        let route = match r.varint()? {
            0 => r.string()?,
            i => self
                .routes
                .name(usize::try_from(i - 1).map_err(|_| Corrupt("route index"))?)
                .ok_or(Corrupt("route index"))?
                .to_owned(),
        };
        let state = if flags & COMPLETED == 0 {
            RecordState::InFlight {
                token,
                lease_until: from_delta(created_at, r.varint()?),
            }
        } else {
            let status = u16::try_from(r.varint()?).map_err(|_| Corrupt("status"))?;
            let count = r.len()?;
            // Each header takes at least two bytes, so a corrupt count cannot reserve much.
            let mut headers = Vec::with_capacity(count.min(r.0.len() / 2));
            for _ in 0..count {
                let code = r.len()?;
                let name = match HEADER_NAMES.get(code) {
                    Some(name) => (*name).to_owned(),
                    None => utf8(r.take(code - HEADER_NAMES.len())?)?,
                };
                let value_len = r.len()?;
                headers.push((name, Bytes::copy_from_slice(r.take(value_len)?)));
            }
            let body = (flags & HAS_BODY != 0).then(|| Bytes::copy_from_slice(r.rest()));
            RecordState::Completed {
                token,
                response: StoredResponse {
                    status,
                    headers,
                    body,
                },
            }
        };
        if !r.0.is_empty() {
            return Err(Corrupt("trailing bytes"));
        }
        Ok(Record {
            state,
            fingerprint,
            route,
            operation_id,
            created_at,
            expires_at,
            generation,
        })
    }
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

/// How an operation id is stored: the gateway's own ids (`op_` and a UUIDv7 in lowercase hex)
/// and hyphenated UUIDs as their 16 bytes, anything else as it is.
enum OpId<'a> {
    Raw(&'a str),
    Uuid(u8, [u8; 16]),
}

impl<'a> OpId<'a> {
    fn of(s: &'a str) -> Self {
        // Only a form that encodes back to exactly `s` is packed, so every id round-trips.
        let mut buf = uuid::Uuid::encode_buffer();
        if let Some(hex) = s.strip_prefix("op_").filter(|h| h.len() == 32)
            && let Ok(id) = uuid::Uuid::try_parse(hex)
            && id.simple().encode_lower(&mut buf) == hex
        {
            return Self::Uuid(OP_PREFIXED_UUID, id.into_bytes());
        }
        if s.len() == 36
            && let Ok(id) = uuid::Uuid::try_parse(s)
            && id.hyphenated().encode_lower(&mut buf) == s
        {
            return Self::Uuid(OP_HYPHENATED_UUID, id.into_bytes());
        }
        Self::Raw(s)
    }

    fn form(&self) -> u8 {
        match self {
            Self::Raw(_) => OP_RAW,
            Self::Uuid(form, _) => *form,
        }
    }
}

/// Where an entry is written: [`Count`] to size it, then a `Vec` to fill it.
trait Sink {
    fn put(&mut self, bytes: &[u8]);

    fn varint(&mut self, mut v: u64) {
        let mut buf = [0u8; 10];
        let mut n = 0;
        while v >= 0x80 {
            #[allow(clippy::cast_possible_truncation)] // the low seven bits
            let low = (v as u8) | 0x80;
            buf[n] = low;
            v >>= 7;
            n += 1;
        }
        #[allow(clippy::cast_possible_truncation)] // below 0x80
        let last = v as u8;
        buf[n] = last;
        self.put(&buf[..=n]);
    }

    fn len(&mut self, n: usize) {
        self.varint(n as u64);
    }

    fn bytes(&mut self, b: &[u8]) {
        self.len(b.len());
        self.put(b);
    }
}

struct Count(usize);

impl Sink for Count {
    fn put(&mut self, bytes: &[u8]) {
        self.0 += bytes.len();
    }
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

fn write_entry(out: &mut impl Sink, key: &str, rec: &Record, route: Option<usize>, op: &OpId<'_>) {
    out.bytes(key.as_bytes());
    let (completed, body) = match &rec.state {
        RecordState::InFlight { .. } => (false, None),
        RecordState::Completed { response, .. } => (true, response.body.as_ref()),
    };
    let mut flags = op.form() << OP_SHIFT;
    if completed {
        flags |= COMPLETED;
    }
    if body.is_some() {
        flags |= HAS_BODY;
    }
    if rec.expires_at == Millis::MAX {
        flags |= NEVER_EXPIRES;
    }
    out.put(&[flags]);
    out.varint(rec.created_at);
    if rec.expires_at != Millis::MAX {
        out.varint(to_delta(rec.created_at, rec.expires_at));
    }
    out.put(&rec.fingerprint.0);
    out.put(&rec.token().0.to_le_bytes());
    out.varint(rec.generation);
    match op {
        OpId::Raw(s) => out.bytes(s.as_bytes()),
        OpId::Uuid(_, b) => out.put(b),
    }
    match route {
        Some(i) => out.len(i + 1),
        None => {
            out.varint(0);
            out.bytes(rec.route.as_bytes());
        }
    }
    match &rec.state {
        RecordState::InFlight { lease_until, .. } => out.varint(to_delta(rec.created_at, *lease_until)),
        RecordState::Completed { response, .. } => {
            out.varint(u64::from(response.status));
            out.len(response.headers.len());
            for (name, value) in &response.headers {
                match HEADER_NAMES.iter().position(|n| n == name) {
                    Some(i) => out.len(i),
                    None => {
                        out.len(HEADER_NAMES.len() + name.len());
                        out.put(name.as_bytes());
                    }
                }
                out.bytes(value);
            }
            if let Some(body) = body {
                out.put(body);
            }
        }
    }
}

/// A time relative to `base`, zigzag-encoded: the times of a record lie a little after its
/// creation, so this is a short varint; wrapping arithmetic keeps every value exact.
#[allow(clippy::cast_possible_wrap, clippy::cast_sign_loss)]
fn to_delta(base: Millis, t: Millis) -> u64 {
    let d = t.wrapping_sub(base) as i64;
    ((d << 1) ^ (d >> 63)) as u64
}

#[allow(clippy::cast_possible_wrap, clippy::cast_sign_loss)]
fn from_delta(base: Millis, z: u64) -> Millis {
    let d = ((z >> 1) as i64) ^ -((z & 1) as i64);
    base.wrapping_add(d as u64)
}

/// A stored entry that does not decode: a bug in this file, reported as [`StoreError::Corrupt`].
#[derive(Debug, thiserror::Error)]
#[error("memory store entry does not decode: {0}")]
struct Corrupt(&'static str);

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Corrupt> {
        if n > self.0.len() {
            return Err(Corrupt("truncated"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], Corrupt> {
        self.take(N)?.try_into().map_err(|_| Corrupt("truncated"))
    }

    fn byte(&mut self) -> Result<u8, Corrupt> {
        Ok(self.take(1)?[0])
    }

    fn varint(&mut self) -> Result<u64, Corrupt> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            let bits = u64::from(b & 0x7f);
            if shift == 63 && bits > 1 {
                return Err(Corrupt("varint overflow"));
            }
            v |= bits << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(Corrupt("varint too long"))
    }

    fn len(&mut self) -> Result<usize, Corrupt> {
        usize::try_from(self.varint()?).map_err(|_| Corrupt("length"))
    }

    fn string(&mut self) -> Result<String, Corrupt> {
        let n = self.len()?;
        utf8(self.take(n)?)
    }

    fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.0)
    }
}

fn utf8(b: &[u8]) -> Result<String, Corrupt> {
    String::from_utf8(b.to_vec()).map_err(|_| Corrupt("utf-8"))
}

/// The key an entry starts with; `None` only for an entry `encode` did not write.
fn entry_key(entry: &[u8]) -> Option<&[u8]> {
    let mut r = Reader(entry);
    let n = r.len().ok()?;
    r.take(n).ok()
}

/// When an entry's record expires, read without decoding the rest.
/// The shard a record hash belongs to (bits the table's own slot choice does not lean on).
fn shard_of(hash: u64) -> usize {
    #[allow(clippy::cast_possible_truncation)] // masked to 0..SHARDS
    let i = (hash >> SHARD_SHIFT) as usize & (SHARDS - 1);
    i
}

fn entry_expires_at(entry: &[u8]) -> Option<Millis> {
    let mut r = Reader(entry);
    let n = r.len().ok()?;
    r.take(n).ok()?;
    let flags = r.byte().ok()?;
    let created_at = r.varint().ok()?;
    if flags & NEVER_EXPIRES != 0 {
        return Some(Millis::MAX);
    }
    Some(from_delta(created_at, r.varint().ok()?))
}

impl Store for MemoryStore {
    async fn begin(&self, key: &str, req: &BeginRequest<'_>) -> Result<Begin, StoreError> {
        let (hash, mut table) = self.shard(key);
        let mut existing = self.find(&table, hash, key)?;
        let (answer, write) = rules::begin_taking(&mut existing, req);
        if let Write::Put(rec) = write {
            let entry = self.encode(key, &rec);
            let is_new = existing.is_none_or(|old| !old.is_live(req.now));
            if is_new && self.used.load(Ordering::Relaxed) + cost(&entry) > self.max_bytes {
                return Err(StoreError::Full);
            }
            self.put(&mut table, hash, key, entry);
        } else {
            self.apply(&mut table, hash, key, write);
        }
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
            let (hash, mut table) = self.shard(key);
            let existing = self.find(&table, hash, key)?;
            let write = rules::complete(existing.as_ref(), token, response, retention_ms, now)?;
            self.apply(&mut table, hash, key, write);
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
        let rec = self.decode(entry).map_err(|e| StoreError::Corrupt(Box::new(e)))?;
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
mod tests {
    use super::*;
    use proptest::prelude::*;

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
    async fn a_sweep_removes_exactly_the_records_due() {
        let store = MemoryStore::new(1 << 30);
        // Records expiring every 250 ms over 50 s (retention 10 s from their begin).
        let keys: Vec<(String, Millis)> = (0..200u64)
            .map(|i| (format!("k{i}"), 1_000_000 + i * 250))
            .collect();
        for (key, now) in &keys {
            store.begin(key, &req(LeaseToken::random(), *now)).await.unwrap();
        }
        // One record moves its expiry later (completed 30 s after its begin): its old bucket
        // entry goes stale and must not remove it.
        let (moved, begun) = (&keys[0].0, keys[0].1);
        let token = match store.get(moved, begun).await.unwrap().unwrap().state {
            RecordState::InFlight { token, .. } => token,
            RecordState::Completed { .. } => unreachable!(),
        };
        let ok = StoredResponse {
            status: 200,
            headers: vec![],
            body: Some(Bytes::from_static(b"{}")),
        };
        store
            .complete(moved, token, ok, 10_000, begun + 5_000)
            .await
            .unwrap();
        let moved_expiry = begun + 15_000;
        for sweep_at in [1_005_000, 1_010_000, 1_010_001, 1_022_222, 1_035_000, 1_060_000] {
            store.sweep(sweep_at);
            for (key, begun) in &keys {
                let expiry = if key == moved {
                    moved_expiry
                } else {
                    begun + 10_000
                };
                let present = lock(&store.shards[shard_of(store.hash(key.as_bytes()))])
                    .find(store.hash(key.as_bytes()), |s| {
                        entry_key(&s.entry) == Some(key.as_bytes())
                    })
                    .is_some();
                assert_eq!(
                    present,
                    sweep_at < expiry,
                    "{key} (expires {expiry}) after a sweep at {sweep_at}"
                );
            }
        }
        assert!(store.is_empty());
        assert_eq!(store.used_bytes(), 0);
        let indexed: usize = store
            .expiries
            .iter()
            .map(|e| lock(e).values().map(Vec::len).sum::<usize>())
            .sum();
        assert_eq!(indexed, 0, "the index keeps nothing once every record is gone");
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

    /// A completed record as the gateway stores one: a namespaced key, a UUIDv7 operation id,
    /// a JSON body and its content type.
    fn typical(body: &[u8]) -> (String, Record) {
        let key = "t-*:*:*:order-2f6c1a9e-7b41-4c3e-9d0a-5e8f3b2c1d7a".to_owned();
        let now = 1_767_225_600_000;
        let rec = Record {
            state: RecordState::Completed {
                token: LeaseToken(u128::MAX / 3),
                response: StoredResponse {
                    status: 201,
                    headers: vec![("content-type".into(), Bytes::from_static(b"application/json"))],
                    body: Some(Bytes::copy_from_slice(body)),
                },
            },
            fingerprint: Fingerprint([0xab; 32]),
            route: "orders".into(),
            operation_id: crate::engine::new_operation_id(),
            created_at: now,
            expires_at: now + 86_400_000,
            generation: 1,
        };
        (key, rec)
    }

    fn round_trip(store: &MemoryStore, key: &str, rec: &Record) -> Result<(), TestCaseError> {
        let entry = store.encode(key, rec);
        prop_assert_eq!(entry_key(&entry), Some(key.as_bytes()));
        prop_assert_eq!(entry_expires_at(&entry), Some(rec.expires_at));
        prop_assert_eq!(&store.decode(&entry).unwrap(), rec);
        // A damaged entry is an error (or, cut inside the body, a shorter body), never a panic.
        for cut in (0..entry.len()).filter(|c| *c < 200 || c % 61 == 0) {
            let _ = store.decode(&entry[..cut]);
            let _ = entry_expires_at(&entry[..cut]);
        }
        Ok(())
    }

    fn uuid_bytes() -> impl Strategy<Value = uuid::Uuid> {
        any::<[u8; 16]>().prop_map(uuid::Uuid::from_bytes)
    }

    fn operation_id() -> impl Strategy<Value = String> {
        prop_oneof![
            uuid_bytes().prop_map(|u| format!("op_{}", u.simple())),
            uuid_bytes().prop_map(|u| u.hyphenated().to_string()),
            // Near misses that must stay as they are: other case, other forms, other lengths.
            uuid_bytes().prop_map(|u| format!("op_{}", u.simple()).to_uppercase()),
            uuid_bytes().prop_map(|u| format!("op_{}", u.hyphenated())),
            uuid_bytes().prop_map(|u| u.urn().to_string()),
            uuid_bytes().prop_map(|u| u.braced().to_string()),
            uuid_bytes().prop_map(|u| u.hyphenated().to_string().to_uppercase()),
            "op_[0-9a-fA-F]{30,34}",
            "op",
            ".{0,40}",
        ]
    }

    fn millis() -> impl Strategy<Value = Millis> {
        prop_oneof![
            any::<u64>(),
            Just(0),
            Just(Millis::MAX),
            1_700_000_000_000..1_900_000_000_000u64,
        ]
    }

    fn response() -> impl Strategy<Value = StoredResponse> {
        let name = prop_oneof![
            proptest::sample::select(HEADER_NAMES).prop_map(str::to_owned),
            "[a-z-]{0,24}",
            ".{0,8}",
        ];
        let value = proptest::collection::vec(any::<u8>(), 0..80).prop_map(Bytes::from);
        let body =
            proptest::option::of(proptest::collection::vec(any::<u8>(), 0..3000).prop_map(Bytes::from));
        (
            any::<u16>(),
            proptest::collection::vec((name, value), 0..40),
            body,
        )
            .prop_map(|(status, headers, body)| StoredResponse {
                status,
                headers,
                body,
            })
    }

    fn record() -> impl Strategy<Value = Record> {
        let state = prop_oneof![
            (any::<u128>(), millis()).prop_map(|(t, lease_until)| RecordState::InFlight {
                token: LeaseToken(t),
                lease_until
            }),
            (any::<u128>(), response()).prop_map(|(t, response)| RecordState::Completed {
                token: LeaseToken(t),
                response
            }),
        ];
        let route = prop_oneof!["[a-z]{1,6}", ".{0,20}"];
        (
            state,
            any::<[u8; 32]>(),
            route,
            operation_id(),
            (millis(), millis(), any::<u64>()),
        )
            .prop_map(
                |(state, fp, route, operation_id, (created_at, expires_at, generation))| Record {
                    state,
                    fingerprint: Fingerprint(fp),
                    route,
                    operation_id,
                    created_at,
                    expires_at,
                    generation,
                },
            )
    }

    proptest! {
        #[test]
        fn every_record_round_trips_through_its_entry(key in ".{0,300}", rec in record()) {
            let store = MemoryStore::new(usize::MAX);
            round_trip(&store, &key, &rec)?;
        }

        #[test]
        fn records_share_one_store_s_route_table(recs in proptest::collection::vec((".{0,20}", record()), 1..20)) {
            let store = MemoryStore::new(usize::MAX);
            let entries: Vec<_> = recs.iter().map(|(k, r)| store.encode(k, r)).collect();
            for ((key, rec), entry) in recs.iter().zip(&entries) {
                prop_assert_eq!(entry_key(entry), Some(key.as_bytes()));
                prop_assert_eq!(&store.decode(entry).unwrap(), rec);
            }
        }
    }

    #[test]
    fn gateway_operation_ids_are_packed_and_others_kept_verbatim() {
        let id = crate::engine::new_operation_id();
        assert!(matches!(OpId::of(&id), OpId::Uuid(OP_PREFIXED_UUID, _)));
        let hyphenated = uuid::Uuid::now_v7().hyphenated().to_string();
        assert!(matches!(OpId::of(&hyphenated), OpId::Uuid(OP_HYPHENATED_UUID, _)));
        for other in [
            id.to_uppercase(),
            format!("{id}0"),
            id[..34].to_owned(),
            hyphenated.to_uppercase(),
            String::new(),
        ] {
            assert!(matches!(OpId::of(&other), OpId::Raw(_)), "{other}");
        }
    }

    #[test]
    fn routes_past_the_interned_table_are_stored_inline() {
        let store = MemoryStore::new(usize::MAX);
        let (key, mut rec) = typical(b"{}");
        let mut entries = Vec::new();
        for i in 0..ROUTE_SLOTS + 10 {
            rec.route = format!("route-{i}");
            entries.push((store.encode(&key, &rec), rec.clone()));
        }
        assert_eq!(store.routes.len.load(Ordering::Relaxed), ROUTE_SLOTS);
        for (entry, rec) in &entries {
            assert_eq!(&store.decode(entry).unwrap(), rec);
        }
        // An interned route costs one byte; an inline one its name.
        let interned = store.encode(&key, &entries[0].1).len();
        let inline = store.encode(&key, &entries[ROUTE_SLOTS + 9].1).len();
        assert_eq!(inline, interned + 1 + "route-264".len());
    }

    #[test]
    fn a_typical_completed_record_fits_its_body_plus_256_bytes() {
        let store = MemoryStore::new(usize::MAX);
        let body = br#"{"ok":true,"id":"ord_1"}"#;
        let (key, rec) = typical(body);
        let entry = store.encode(&key, &rec);
        // 51 key bytes, 32 fingerprint, 16 token, 16 operation id, 16 content type, the body,
        // and about twenty bytes of lengths, flags, times, status and indexes.
        assert!(
            entry.len() <= key.len() + body.len() + 32 + 16 + 16 + 16 + 24,
            "{}",
            entry.len()
        );
        assert!(cost(&entry) <= body.len() + 256, "{}", cost(&entry));
    }

    #[tokio::test]
    async fn used_bytes_follow_every_write() {
        let store = MemoryStore::new(usize::MAX);
        let (key, done) = typical(br#"{"ok":true}"#);
        let RecordState::Completed { token, response } = &done.state else {
            unreachable!()
        };
        let now = done.created_at;
        let begin = BeginRequest {
            fingerprint: done.fingerprint,
            route: "orders",
            token: *token,
            operation_id: &done.operation_id,
            lease_ms: 30_000,
            retention_ms: 86_400_000,
            takeover: true,
            now,
        };
        let entry_cost = |store: &MemoryStore, key: &str, now| {
            let (hash, table) = store.shard(key);
            let rec = store.find(&table, hash, key).unwrap().unwrap();
            assert!(rec.is_live(now));
            cost(&table.find(hash, |s| s.is(hash, key)).unwrap().entry)
        };

        assert!(matches!(
            store.begin(&key, &begin).await,
            Ok(Begin::Acquired { .. })
        ));
        let in_flight = entry_cost(&store, &key, now);
        assert_eq!(store.used_bytes(), in_flight);
        // A retried begin and a renewal rewrite the record in place: still one record's bytes.
        assert!(matches!(
            store.begin(&key, &begin).await,
            Ok(Begin::Acquired { .. })
        ));
        store.renew(&key, *token, now + 60_000).await.unwrap();
        assert_eq!(store.used_bytes(), entry_cost(&store, &key, now));

        store
            .complete(&key, *token, response.clone(), 86_400_000, now)
            .await
            .unwrap();
        let completed = entry_cost(&store, &key, now);
        assert_eq!(store.used_bytes(), completed);
        assert!(completed > in_flight);
        assert!(completed <= response.body.as_ref().unwrap().len() + 256);

        // A second key adds its own bytes; purging and releasing take them back exactly.
        let other = LeaseToken(7);
        let req2 = BeginRequest {
            token: other,
            ..begin.clone()
        };
        store.begin("second", &req2).await.unwrap();
        assert_eq!(store.used_bytes(), completed + entry_cost(&store, "second", now));
        store.release("second", other).await.unwrap();
        assert_eq!(store.used_bytes(), completed);
        assert!(store.purge(&key).await.unwrap());
        assert!(!store.purge(&key).await.unwrap());
        assert_eq!(store.used_bytes(), 0);
        assert!(store.is_empty());

        // Many records: the count is the sum of their costs, and sweeping them returns it to 0.
        for i in 0..1_000 {
            let req = BeginRequest {
                token: LeaseToken(i),
                ..begin.clone()
            };
            store.begin(&format!("bulk-{i}"), &req).await.unwrap();
        }
        assert_eq!(store.len(), 1_000);
        let per_record = store.used_bytes() / 1_000;
        assert!((100..200).contains(&per_record), "{per_record}");
        assert_eq!(store.sweep(now + 86_400_000), 1_000);
        assert_eq!(store.used_bytes(), 0);
    }
}
