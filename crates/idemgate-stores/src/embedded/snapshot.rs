//! The read snapshot callers decide on: one redb read transaction, with its records table open,
//! shared by every caller until the writer's next commit replaces it.
//!
//! Why: a `begin` for a fresh key, and every replay, read one record from redb on the caller's
//! task, and opening a read transaction and its table for each of them (redb registers every
//! read transaction with its tracker and finds the table in its table tree) cost about as much
//! as the lookup. Shared, a replay on the benchmark rig went from 18.2-20.2 to 16.9-17.2 µs of
//! CPU (48.9-54.6k to 56.3-58.5k req/s; docs/benchmarks-journal.md, notes of 2026-11-25, noon).
//!
//! Why it is never stale where it matters: every write reaches redb through the writer, which
//! publishes a new snapshot after each commit and before it drops the entries standing in for
//! that commit's writes ([`super::reserved`]) or answers anyone. A caller looks for the key's
//! entry under the shard lock and reads the snapshot only when there is none, so it reads a
//! snapshot at least as new as the key's last acknowledged write. (A purge also drops a key's
//! entry, from the caller's task; a read that then misses a write the purge is about to delete
//! is ordered after the purge.)
//!
//! One mutex guards the current snapshot; it is held only to clone an `Arc`. On a machine with
//! many cores a per-thread copy checked against a generation number would avoid even that.

use std::sync::{Arc, Mutex, PoisonError};

use idemgate_core::record::Record;
use idemgate_core::store::StoreError;
use redb::{Database, ReadOnlyTable, ReadableDatabase};

use super::{RECORDS, decode};

type Table = ReadOnlyTable<&'static str, &'static [u8]>;

/// The current snapshot, if the writer could open one.
#[derive(Default)]
pub(super) struct Snapshot {
    current: Mutex<Option<Arc<Table>>>,
}

impl Snapshot {
    /// Replaces the snapshot with one of `db` as it is now. If none can be opened, callers open
    /// their own until the next commit, so nobody reads one older than the last write.
    pub(super) fn publish(&self, db: &Database) {
        let fresh = open(db).ok().map(Arc::new);
        // The old snapshot is dropped outside the lock; readers still using it keep it alive.
        let _old = std::mem::replace(&mut *self.lock(), fresh);
    }

    /// Lets go of the snapshot, so nothing holds the database once the writer is done.
    pub(super) fn clear(&self) {
        let _old = self.lock().take();
    }

    /// `key`'s record in the current snapshot.
    pub(super) fn read(&self, db: &Database, key: &str) -> Result<Option<Record>, StoreError> {
        let shared = self.lock().clone();
        let table = match shared {
            Some(table) => table,
            None => Arc::new(open(db)?),
        };
        let value = table.get(key).map_err(StoreError::backend)?;
        value.map(|v| decode(v.value())).transpose()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Arc<Table>>> {
        self.current.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn open(db: &Database) -> Result<Table, StoreError> {
    let txn = db.begin_read().map_err(StoreError::backend)?;
    txn.open_table(RECORDS).map_err(StoreError::backend)
}
