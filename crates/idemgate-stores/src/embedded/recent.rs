//! Completed records lately read from redb, kept decoded in memory so that a key retried again
//! and again is looked up in its B-tree and decoded once, not on every retry.
//!
//! Why: a replay from redb walks the B-tree and decodes the record (about 3.7k instructions of a
//! replay's 41k on the benchmark rig); from here it is a hash lookup and a clone, as in the
//! memory store. Duplicate storms, webhook redeliveries and clients that retry on a timer replay
//! one key many times. A record enters only when a caller reads it from redb, so a miss pays only
//! the lookup that finds nothing; AWS Lambda Powertools' idempotency `use_local_cache` is the
//! same idea.
//!
//! Why it never answers with a record redb no longer shows: only completed records enter, and a
//! completed record in redb changes only by going (a purge, a sweep) or by being replaced once
//! expired (a new owner's record). Every writer batch that does either counts `removals` up to
//! an odd number before its commit and back to even once its snapshot is published, and each
//! entry keeps the (even) count its reader saw before reading the snapshot. An entry answers only
//! while the count is what it was: a reader that might have read a snapshot from before such a
//! batch saw an older count, and while a batch is between its commit and its publish (odd) no
//! entry answers and none enters. The writer does this itself, before it answers the batch, so
//! nothing depends on the caller of a purge still waiting for its answer. Batches that only add
//! records or complete reservations (nearly all of them) leave the count alone; one that does
//! (a purge, a takeover of an expired outcome, a sweep deleting one) empties the cache in effect,
//! which costs each key one more read.

use std::sync::atomic::{AtomicU64, Ordering};

use idemgate_core::record::{Millis, Record, RecordState};
use quick_cache::sync::Cache;
use quick_cache::{OptionsBuilder, Weighter};

/// The most bytes of records (by [`Record::approx_bytes`]) kept at once.
pub(super) const CAPACITY_BYTES: u64 = 16 << 20;
/// About how many records that is, for sizing the table (a small JSON response and its headers).
const ESTIMATED_RECORDS: usize = 16 << 10;
/// quick_cache splits the bound evenly between its shards and keeps nothing heavier than one
/// shard's part: 8 shards keep records of up to about 2 MiB, more than `max_response_bytes`'s
/// default, whatever the machine's core count (its own default is 4 per core).
const SHARDS: usize = 8;

#[derive(Clone)]
struct Cached {
    /// The count of removals its reader saw before reading the snapshot.
    seen: u64,
    /// Kept, because quick_cache asks for the weight whenever it looks for something to evict.
    weight: u64,
    record: Record,
}

#[derive(Clone)]
struct Size;

impl Weighter<String, Cached> for Size {
    fn weight(&self, _key: &String, cached: &Cached) -> u64 {
        cached.weight
    }
}

pub(super) struct Recent {
    records: Cache<String, Cached, Size>,
    removals: AtomicU64,
}

impl Default for Recent {
    fn default() -> Self {
        let options = OptionsBuilder::new()
            .estimated_items_capacity(ESTIMATED_RECORDS)
            .weight_capacity(CAPACITY_BYTES)
            .shards(SHARDS)
            .build()
            .unwrap_or_else(|e| unreachable!("constant cache options: {e:?}"));
        Self {
            records: Cache::with_options(options, Size, Default::default(), Default::default()),
            removals: AtomicU64::new(0),
        }
    }
}

/// Whether `record` is of the kind kept here: the one rule for what enters, and for which
/// deletions and replacements the writer must count as removals.
pub(super) fn may_hold(record: &Record) -> bool {
    matches!(record.state, RecordState::Completed { .. })
}

/// The count a reader saw before reading the snapshot, to hand back to [`Recent::offer`].
#[derive(Clone, Copy)]
pub(super) struct Before(u64);

impl Recent {
    /// `key`'s record if it is here, no removal happened since it was read, and it is live at
    /// `now`.
    pub(super) fn get(&self, key: &str, now: Millis) -> Option<Record> {
        let removals = self.removals.load(Ordering::Acquire);
        let cached = self.records.get(key)?;
        (cached.seen == removals && cached.record.is_live(now)).then_some(cached.record)
    }

    /// Called before reading the snapshot whose record goes to [`Recent::offer`].
    pub(super) fn before_read(&self) -> Before {
        Before(self.removals.load(Ordering::Acquire))
    }

    /// Keeps `record`, read from a snapshot after `before`, if it is completed and live and no
    /// removal was under way.
    pub(super) fn offer(&self, key: &str, record: &Record, now: Millis, before: Before) {
        if before.0 % 2 == 1 || !may_hold(record) || !record.is_live(now) {
            return;
        }
        let cached = Cached {
            seen: before.0,
            weight: record.approx_bytes(key) as u64,
            record: record.clone(),
        };
        self.records.insert(key.to_owned(), cached);
    }

    /// The writer: a batch that removes or replaces a completed record is about to commit.
    pub(super) fn removing(&self) {
        // Odd until the next publish; a second removing batch before it changes nothing.
        let _ = self
            .removals
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n % 2 == 0).then_some(n + 1)
            });
    }

    /// The writer: a snapshot was published that shows every commit so far.
    pub(super) fn published(&self) {
        let _ = self
            .removals
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n % 2 == 1).then_some(n + 1)
            });
    }

    #[cfg(test)]
    pub(super) fn holds(&self, key: &str) -> bool {
        let removals = self.removals.load(Ordering::Acquire);
        self.records.get(key).is_some_and(|c| c.seen == removals)
    }
}
