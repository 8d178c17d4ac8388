//! One store call per key per process while a key is being decided.
//!
//! In a duplicate storm every waiting request used to ask the store itself: one `begin` round
//! trip per caller on Redis or PostgreSQL (a storm of 1,000 on PostgreSQL waited over 400 ms for
//! the queries alone), two snapshot reads per caller on the embedded store. Now the first request
//! of this process for a key takes the key's *lead* and asks the store; the others wait on the
//! notifier for the lead's outcome, which an execution hands over when it records it. A lead is
//! held from the store call until the execution finishes (or, if the store did not grant
//! execution, until the answer is known), and dropping it wakes every waiter. A waiter woken
//! without a hand-off (a release, a refusal, a store error, a lead that gave up) asks the store
//! from then on, like every waiter did before leads: the waiters of a lead that ended without
//! an outcome ask in parallel, not one new lead at a time, and none hangs.
//!
//! Only the same request waits on a lead (same fingerprint and route): a different body or
//! route under a held key asks the store, which refuses it at once, as before.
//!
//! Leads are local: requests on other replicas still ask the store, and the store stays the one
//! arbiter of who executes. A lead only spares this process's duplicates the round trip.

use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use hashbrown::HashTable;

use crate::fingerprint::Fingerprint;
use crate::notify::Notifier;

/// Shards of the lead table: every keyed request takes a lead and gives it up, so one lock for
/// all keys would be taken twice per request by every worker thread.
const SHARDS: usize = 32;

/// The keys this process is asking the store about or executing, each with the request that
/// leads it.
#[derive(Debug)]
pub(crate) struct Leads {
    // SipHash with a random key, as the memory store: keys are chosen by clients. Hashed once
    // per lead; the hash picks the shard and stays with the lead for its removal.
    hasher: RandomState,
    shards: Box<[Mutex<HashTable<Held>>]>,
}

/// A held lead: the key (shared with its `Lead`), its hash, and the request leading it.
#[derive(Debug)]
struct Held {
    hash: u64,
    key: Arc<str>,
    leader: Leader,
}

/// The request leading a key: its fingerprint and route (shared with its `Lead`).
type Leader = (Fingerprint, Arc<str>);

/// Why [`Leads::try_lead`] gave no lead.
pub(crate) enum Taken {
    /// Held for the same request (fingerprint and route): wait for its outcome.
    Same,
    /// Held for a different request: ask the store, which refuses it at once.
    Other,
}

impl Default for Leads {
    fn default() -> Self {
        Self {
            hasher: RandomState::new(),
            shards: (0..SHARDS).map(|_| Mutex::new(HashTable::new())).collect(),
        }
    }
}

impl Leads {
    fn shard(&self, hash: u64) -> MutexGuard<'_, HashTable<Held>> {
        // Bits 52..57: hashbrown picks a bucket from the low bits and a control byte from the top
        // seven, and a shard taken from either would leave its keys sharing those bits (as the
        // memory store explains for its own shards).
        #[allow(clippy::cast_possible_truncation)] // masked to 0..SHARDS
        let i = (hash >> 52) as usize & (SHARDS - 1);
        self.shards[i].lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The lead of `key` for this request, unless another request of this process holds it.
    pub(crate) fn try_lead(
        self: &Arc<Self>,
        key: &str,
        request: (Fingerprint, &str),
        notifier: &Arc<Notifier>,
    ) -> Result<Lead, Taken> {
        let hash = self.hasher.hash_one(key);
        let mut shard = self.shard(hash);
        match shard.entry(hash, |h| *h.key == *key, |h| h.hash) {
            hashbrown::hash_table::Entry::Occupied(held) => Err(compare(&held.get().leader, request)),
            hashbrown::hash_table::Entry::Vacant(slot) => {
                // Copied here, once: the execution and its lease renewal share them
                // (`Lead::shared`).
                let (key, route): (Arc<str>, Arc<str>) = (key.into(), request.1.into());
                slot.insert(Held {
                    hash,
                    key: key.clone(),
                    leader: (request.0, route.clone()),
                });
                Ok(Lead {
                    leads: self.clone(),
                    notifier: notifier.clone(),
                    hash,
                    key,
                    route,
                })
            }
        }
    }

    /// Who holds the lead of `key`, compared with this request; `None` when nobody does.
    pub(crate) fn holder(&self, key: &str, request: (Fingerprint, &str)) -> Option<Taken> {
        let hash = self.hasher.hash_one(key);
        let shard = self.shard(hash);
        shard
            .find(hash, |h| *h.key == *key)
            .map(|held| compare(&held.leader, request))
    }
}

fn compare((fp, route): &Leader, (fingerprint, r): (Fingerprint, &str)) -> Taken {
    if fp.ct_eq(&fingerprint) && **route == *r {
        Taken::Same
    } else {
        Taken::Other
    }
}

/// The lead of one key; dropping it gives the key up and wakes the key's waiters.
#[derive(Debug)]
pub(crate) struct Lead {
    leads: Arc<Leads>,
    notifier: Arc<Notifier>,
    hash: u64,
    key: Arc<str>,
    route: Arc<str>,
}

impl Lead {
    /// The key and route as this lead holds them, for the execution that follows it to share.
    pub(crate) fn shared(&self) -> (Arc<str>, Arc<str>) {
        (self.key.clone(), self.route.clone())
    }
}

impl Drop for Lead {
    fn drop(&mut self) {
        // Removed first: a waiter woken here then finds the key free and takes the lead.
        let mut shard = self.leads.shard(self.hash);
        let held = shard
            .find_entry(self.hash, |h| Arc::ptr_eq(&h.key, &self.key))
            .ok()
            .map(|entry| entry.remove().0);
        drop(shard);
        drop(held);
        self.notifier.lead_ended(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_lead_per_key_and_dropping_it_wakes_waiters() {
        let leads = Arc::new(Leads::default());
        let notifier = Arc::new(Notifier::default());
        let req = (Fingerprint([1; 32]), "r");
        let first = leads.try_lead("k", req, &notifier).ok().expect("free");
        assert!(matches!(leads.try_lead("k", req, &notifier), Err(Taken::Same)));
        let body = (Fingerprint([2; 32]), "r");
        assert!(matches!(leads.try_lead("k", body, &notifier), Err(Taken::Other)));
        let route = (Fingerprint([1; 32]), "r2");
        assert!(matches!(leads.try_lead("k", route, &notifier), Err(Taken::Other)));
        let other = leads
            .try_lead("other", req, &notifier)
            .ok()
            .expect("another key is free");
        let mut sub = notifier.subscribe("k");
        assert!(matches!(leads.holder("k", req), Some(Taken::Same)));
        assert!(matches!(leads.holder("k", body), Some(Taken::Other)));
        drop(first);
        assert!(leads.holder("k", req).is_none());
        let woke = tokio::time::timeout(std::time::Duration::from_secs(5), sub.notified()).await;
        assert!(matches!(woke, Ok(None)), "a bare wake-up, no hand-off");
        assert!(leads.try_lead("k", req, &notifier).is_ok(), "free again");
        drop(other);
    }

    /// The engine's waiting protocol (subscribe, then check the lead table, then sleep) against
    /// a lead given up at the same moment on another thread: the waiter either sees the key free
    /// or is woken, never sleeps to its deadline. The notifier skips wake-ups when nobody is
    /// subscribed, so this is the race that skip must not lose.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lead_given_up_while_a_request_subscribes_wakes_it() {
        let req = (Fingerprint([1; 32]), "r");
        for round in 0..2000 {
            let leads = Arc::new(Leads::default());
            let notifier = Arc::new(Notifier::default());
            let lead = leads.try_lead("k", req, &notifier).ok().expect("free");
            let waiter = tokio::spawn({
                let (leads, notifier) = (leads.clone(), notifier.clone());
                async move {
                    let mut sub = notifier.subscribe_lead("k");
                    if leads.holder("k", req).is_none() {
                        return true;
                    }
                    let deadline = std::time::Duration::from_secs(5);
                    tokio::time::timeout(deadline, sub.notified()).await.is_ok()
                }
            });
            tokio::spawn(async move { drop(lead) }).await.expect("dropped");
            assert!(
                waiter.await.expect("waiter"),
                "round {round}: the waiter slept to its deadline"
            );
        }
    }
}
