//! Completed records lately read from redb, kept decoded in memory so that a key retried again
//! and again is looked up in its B-tree and decoded once, not on every retry.
//!
//! Why: a replay from redb walks the B-tree and decodes the record (about 3.7k instructions of a
//! replay's 41k on the benchmark rig); from here it is a hash lookup and a clone, as in the
//! memory store. Duplicate storms, webhook redeliveries and clients that retry on a timer replay
//! one key many times. A record enters only when a caller reads it from redb, so a miss pays
//! nothing; AWS Lambda Powertools' idempotency `use_local_cache` is the same idea.
//!
//! Why it never answers with a record redb no longer holds: only completed, live records enter,
//! and those change in redb only when they expire (each hit checks its own `expires_at`, and an
//! expired one is dropped and read again) or when an operator purges the key. A purge first
//! makes the deletion visible in the snapshot, then counts itself in `purges` and removes the key
//! here. A reader counts the purges before it reads the snapshot and takes its entry out again if
//! the count moved while it inserted: either the purge's removal came after its insert, or the
//! reader sees the count move (see [`Recent::offer`]).

use std::sync::atomic::{AtomicU64, Ordering};

use idemgate_core::record::{Millis, Record, RecordState};
use quick_cache::Weighter;
use quick_cache::sync::Cache;

/// The most bytes of records (by [`Record::approx_bytes`]) kept at once.
pub(super) const CAPACITY_BYTES: u64 = 16 << 20;
/// About how many records that is, for sizing the table (a small JSON response and its headers).
const ESTIMATED_RECORDS: usize = 16 << 10;

#[derive(Clone)]
struct Size;

impl Weighter<String, Record> for Size {
    fn weight(&self, key: &String, record: &Record) -> u64 {
        record.approx_bytes(key) as u64
    }
}

pub(super) struct Recent {
    records: Cache<String, Record, Size>,
    purges: AtomicU64,
}

impl Default for Recent {
    fn default() -> Self {
        Self {
            records: Cache::with_weighter(ESTIMATED_RECORDS, CAPACITY_BYTES, Size),
            purges: AtomicU64::new(0),
        }
    }
}

/// What a reader noted before it read the snapshot, to hand back to [`Recent::offer`].
#[derive(Clone, Copy)]
pub(super) struct Before(u64);

impl Recent {
    /// `key`'s record if it is here and live at `now`.
    pub(super) fn get(&self, key: &str, now: Millis) -> Option<Record> {
        let record = self.records.get(key)?;
        if record.is_live(now) {
            return Some(record);
        }
        // Expired: redb may hold a newer record by now (a takeover, completed again).
        self.records.remove_if(key, |r| !r.is_live(now));
        None
    }

    /// Called before reading the snapshot whose record goes to [`Recent::offer`].
    pub(super) fn before_read(&self) -> Before {
        Before(self.purges.load(Ordering::SeqCst))
    }

    /// Keeps `record`, read from a snapshot after `before`, if it is completed and live.
    pub(super) fn offer(&self, key: &str, record: &Record, now: Millis, before: Before) {
        if !matches!(record.state, RecordState::Completed { .. }) || !record.is_live(now) {
            return;
        }
        self.records.insert(key.to_owned(), record.clone());
        // A purge that removed the key before this insert counted itself first; seeing its count
        // here, the record may be the purged one.
        if self.purges.load(Ordering::SeqCst) != before.0 {
            self.records.remove(key);
        }
    }

    /// Called once a purge of `key` is visible in the snapshot.
    pub(super) fn purged(&self, key: &str) {
        self.purges.fetch_add(1, Ordering::SeqCst);
        self.records.remove(key);
    }

    #[cfg(test)]
    pub(super) fn holds(&self, key: &str) -> bool {
        self.records.get(key).is_some()
    }
}
