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

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use crate::fingerprint::Fingerprint;
use crate::notify::Notifier;

/// The keys this process is asking the store about or executing, each with the request that
/// leads it.
#[derive(Debug, Default)]
pub(crate) struct Leads {
    // The key is shared with its `Lead`: one allocation per lead, not two.
    keys: Mutex<HashMap<Arc<str>, Leader>>,
}

/// The request leading a key: its fingerprint and route.
type Leader = (Fingerprint, Box<str>);

/// Why [`Leads::try_lead`] gave no lead.
pub(crate) enum Taken {
    /// Held for the same request (fingerprint and route): wait for its outcome.
    Same,
    /// Held for a different request: ask the store, which refuses it at once.
    Other,
}

impl Leads {
    /// The lead of `key` for this request, unless another request of this process holds it.
    pub(crate) fn try_lead(
        self: &Arc<Self>,
        key: &str,
        request: (Fingerprint, &str),
        notifier: &Arc<Notifier>,
    ) -> Result<Lead, Taken> {
        let mut keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(leader) = keys.get(key) {
            return Err(compare(leader, request));
        }
        let key: Arc<str> = key.into();
        keys.insert(key.clone(), (request.0, request.1.into()));
        Ok(Lead {
            leads: self.clone(),
            notifier: notifier.clone(),
            key,
        })
    }

    /// Who holds the lead of `key`, compared with this request; `None` when nobody does.
    pub(crate) fn holder(&self, key: &str, request: (Fingerprint, &str)) -> Option<Taken> {
        let keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        keys.get(key).map(|leader| compare(leader, request))
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
    key: Arc<str>,
}

impl Drop for Lead {
    fn drop(&mut self) {
        // Removed first: a waiter woken here then finds the key free and takes the lead.
        self.leads
            .keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&*self.key);
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
}
