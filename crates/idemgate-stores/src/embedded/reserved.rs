//! Reservations that may be taken over, kept in memory only.
//!
//! Such a reservation never needed the disk: if a crash loses it, the key is free at restart,
//! exactly as its lease expiry would have allowed (SPEC 4). Kept here instead of in redb, a miss
//! costs one redb write (its outcome) instead of two plus an expiry-index move, and its `begin`,
//! `renew` and `release` are decided on the caller's task under a shard lock, without a trip to
//! the writer thread.
//!
//! A key's current record is its entry here if it has one, else its record in redb. An entry
//! also stands in for a redb write the writer has decided but not yet committed: an outcome on
//! its way to redb (the entry reads as in flight, whatever its lease, until the commit makes the
//! outcome visible) and a reservation that may not be taken over (`on_lease_expiry: fail`,
//! written to redb and the journal). Every decision about a key takes the key's shard lock, so
//! nobody acts on a redb snapshot that an entry is about to replace.

use std::borrow::Cow;
use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Mutex, MutexGuard, PoisonError};

use idemgate_core::record::{LeaseToken, Millis, Record, RecordState};
use idemgate_core::rules::{self, Begin, BeginRequest, Write};

const SHARDS: usize = 64;

pub(super) type Shard = HashMap<Box<str>, Entry>;

/// In-memory records by key, in shards so callers rarely meet on a lock.
pub(super) struct Reserved {
    hasher: RandomState,
    shards: Box<[Mutex<Shard>]>,
}

/// An in-flight record held here, and why.
pub(super) struct Entry {
    pub record: Record,
    pub state: State,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum State {
    /// A reservation that may be taken over: it lives only here.
    Memory,
    /// Its owner's outcome is on its way to redb; gone once the writer has committed it.
    Completing,
    /// A reservation that may not be taken over, on its way to redb; gone once committed.
    Durable,
}

impl Entry {
    pub(super) fn token(&self) -> Option<LeaseToken> {
        match self.record.state {
            RecordState::InFlight { token, .. } => Some(token),
            RecordState::Completed { .. } => None,
        }
    }

    /// The record the rules see: an entry on its way to redb stays in flight whatever its lease,
    /// so nobody takes it over in the moment before the commit.
    pub(super) fn view(&self) -> Cow<'_, Record> {
        match (self.state, &self.record.state) {
            (State::Memory, _) | (_, RecordState::Completed { .. }) => Cow::Borrowed(&self.record),
            (_, RecordState::InFlight { token, .. }) => {
                let mut held = self.record.clone();
                held.state = RecordState::InFlight {
                    token: *token,
                    lease_until: Millis::MAX,
                };
                Cow::Owned(held)
            }
        }
    }
}

impl Entry {
    /// Decides `begin` on this entry (through [`Entry::view`]). An in-flight answer carries the
    /// owner's lease, not the view's; for an entry on its way to redb, at least a lease from
    /// now, since an owner may complete after its lease ran out and a waiter told of a lease
    /// in the past would ask again at once, in a loop, until the commit.
    pub(super) fn begin(&self, req: &BeginRequest<'_>) -> (Begin, Write) {
        let (mut answer, write) = rules::begin(Some(&self.view()), req);
        if let (
            Begin::InFlight { lease_until, .. },
            RecordState::InFlight {
                lease_until: real, ..
            },
        ) = (&mut answer, &self.record.state)
        {
            *lease_until = match self.state {
                State::Memory => *real,
                State::Completing | State::Durable => (*real).max(req.now.saturating_add(req.lease_ms)),
            };
        }
        (answer, write)
    }
}

impl Default for Reserved {
    fn default() -> Self {
        Self {
            hasher: RandomState::new(),
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
        }
    }
}

impl Reserved {
    /// The shard holding `key`. Never held across an await.
    pub(super) fn lock(&self, key: &str) -> MutexGuard<'_, Shard> {
        let i = usize::try_from(self.hasher.hash_one(key)).unwrap_or(0) % SHARDS;
        self.shards[i].lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Removes `key`'s entry if it is still `state` for `token`: a stand-in once its write is
    /// committed, or a reservation whose `begin` failed.
    pub(super) fn remove(&self, key: &str, token: LeaseToken, state: State) {
        let mut shard = self.lock(key);
        if shard
            .get(key)
            .is_some_and(|e| e.state == state && e.token() == Some(token))
        {
            shard.remove(key);
        }
    }

    /// Gives an outcome whose commit failed back to its owner: the reservation is as it was, so
    /// the owner can complete again (or release).
    pub(super) fn reopen(&self, key: &str, token: LeaseToken) {
        let mut shard = self.lock(key);
        if let Some(e) = shard.get_mut(key).filter(|e| e.token() == Some(token)) {
            e.state = State::Memory;
        }
    }

    /// Drops reservations that expired (an owner that never finished); returns how many.
    pub(super) fn sweep(&self, now: Millis) -> usize {
        let mut removed = 0;
        for shard in &*self.shards {
            let mut shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
            let before = shard.len();
            shard.retain(|_, e| e.state != State::Memory || e.record.is_live(now));
            removed += before - shard.len();
        }
        removed
    }

    /// Entries held (for tests).
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).len())
            .sum()
    }
}
