//! In-process wake-ups for requests waiting on an in-flight key.
//!
//! A waiter subscribes to a key, re-checks the store, then sleeps until notified, its deadline,
//! or the owner's lease end, whichever comes first. Stores call [`Notifier::notify`] after a
//! complete or release; distributed stores feed it from their own channel (Redis pub/sub,
//! PostgreSQL `LISTEN`). Because the waiter always re-checks the store after waking, a lost
//! notification only delays a waiter until its next timer; it never hangs it.
//!
//! An execution on this process that recorded its outcome also hands it over
//! ([`Notifier::publish`]): its local waiters answer from the [`Handoff`] instead of each reading
//! the store again (a duplicate storm on a networked store was one store round trip per
//! waiter). Waiters on other replicas still read the store.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::Notify;

use crate::fingerprint::Fingerprint;
use crate::record::{Millis, StoredResponse};

const SHARDS: usize = 32;

type Shard = Mutex<HashMap<Box<str>, Entry>>;

/// Per-key notification registry. Keys with no subscriber cost nothing.
pub struct Notifier {
    hasher: RandomState,
    // A std Mutex: the critical sections are a hash-map lookup and never await.
    shards: Box<[Shard]>,
    /// Subscriptions alive on every key. Most keyed requests end with nobody waiting anywhere
    /// (a miss publishes its hand-off, its store's news and its lead's end: three shard lookups
    /// for no one), so a wake-up first reads this and stops at zero.
    ///
    /// No wake-up is lost by it. A subscriber counts itself before it checks again what it
    /// waits for (the store, the lead table), under their locks; a waker changes that state, under
    /// the same locks, before it reads the count. So either the subscriber's check sees the
    /// change, or the change's lock was taken after the subscriber's, which follows its count,
    /// and the waker sees the count. (And a missed wake-up would only delay a waiter to its next
    /// timer, as the module documentation says.)
    watching: AtomicUsize,
}

struct Entry {
    /// Store news (a complete or release seen by the store), hand-offs and ended leads.
    notify: Arc<Notify>,
    /// Hand-offs and ended leads only: what a request waiting on this process's lead needs.
    /// Store news that comes before the hand-off would only wake it to wait again.
    lead: Arc<Notify>,
    subscribers: usize,
    /// Counts publications, so a subscription takes only a handoff published after it began.
    published: u64,
    handoff: Option<Arc<Handoff>>,
}

/// A completed outcome, as recorded in the store by the execution that publishes it.
#[derive(Debug)]
pub struct Handoff {
    pub fingerprint: Fingerprint,
    pub route: String,
    pub operation_id: String,
    pub response: StoredResponse,
    pub expires_at: Millis,
}

impl Default for Notifier {
    fn default() -> Self {
        Self {
            hasher: RandomState::new(),
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            watching: AtomicUsize::new(0),
        }
    }
}

impl std::fmt::Debug for Notifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Notifier").finish_non_exhaustive()
    }
}

impl Notifier {
    /// Whether nobody is subscribed to any key (see `watching`).
    fn nobody_watches(&self) -> bool {
        self.watching.load(Ordering::SeqCst) == 0
    }

    /// The locked shard of `key` for a wake-up, or `None` when nobody watches any key.
    fn wake_shard(&self, key: &str) -> Option<MutexGuard<'_, HashMap<Box<str>, Entry>>> {
        if self.nobody_watches() {
            return None;
        }
        Some(self.shard(key).lock().unwrap_or_else(PoisonError::into_inner))
    }

    fn shard(&self, key: &str) -> &Shard {
        let i = usize::try_from(self.hasher.hash_one(key)).unwrap_or(0) % SHARDS;
        &self.shards[i]
    }

    /// Registers interest in `key`. Notifications sent after this call are not missed, even if
    /// the subscription is awaited later.
    #[must_use]
    pub fn subscribe(self: &Arc<Self>, key: &str) -> Subscription {
        self.subscribe_to(key, false)
    }

    /// Like [`Notifier::subscribe`], but woken only by a hand-off ([`Notifier::publish`]) or an
    /// ended lead ([`Notifier::lead_ended`]), not by the store's own news.
    #[must_use]
    pub fn subscribe_lead(self: &Arc<Self>, key: &str) -> Subscription {
        self.subscribe_to(key, true)
    }

    fn subscribe_to(self: &Arc<Self>, key: &str, lead: bool) -> Subscription {
        let notify = {
            let mut shard = self.shard(key).lock().unwrap_or_else(PoisonError::into_inner);
            let entry = shard.entry(key.into()).or_insert_with(|| Entry {
                notify: Arc::new(Notify::new()),
                lead: Arc::new(Notify::new()),
                subscribers: 0,
                published: 0,
                handoff: None,
            });
            entry.subscribers += 1;
            self.watching.fetch_add(1, Ordering::SeqCst);
            let notify = if lead { &entry.lead } else { &entry.notify };
            (notify.clone(), entry.published)
        };
        let (notify, seen) = notify;
        let mut notified = Box::pin(notify.notified_owned());
        // Enabled now, so a notify_waiters() between here and the first poll still counts.
        notified.as_mut().enable();
        Subscription {
            notifier: self.clone(),
            key: key.into(),
            notified,
            seen,
        }
    }

    /// Wakes the key's waiters with the outcome `handoff` builds (only built if someone waits).
    /// Call it only once the outcome is recorded in the store.
    pub fn publish(&self, key: &str, handoff: impl FnOnce() -> Handoff) {
        let Some(mut shard) = self.wake_shard(key) else {
            return;
        };
        if let Some(entry) = shard.get_mut(key) {
            entry.published += 1;
            entry.handoff = Some(Arc::new(handoff()));
            entry.notify.notify_waiters();
            entry.lead.notify_waiters();
        }
    }

    /// Wakes every subscriber of `key`, those waiting on a lead included: the lead ended.
    pub fn lead_ended(&self, key: &str) {
        let Some(shard) = self.wake_shard(key) else {
            return;
        };
        if let Some(entry) = shard.get(key) {
            entry.notify.notify_waiters();
            entry.lead.notify_waiters();
        }
    }

    /// Wakes the current subscribers of `key` (store news; not those waiting on a lead).
    pub fn notify(&self, key: &str) {
        let Some(shard) = self.wake_shard(key) else {
            return;
        };
        if let Some(entry) = shard.get(key) {
            entry.notify.notify_waiters();
        }
    }

    /// Wakes every subscriber of every key (used after a distributed store reconnects, when
    /// notifications may have been lost).
    pub fn notify_all(&self) {
        for shard in &*self.shards {
            let shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
            for entry in shard.values() {
                entry.notify.notify_waiters();
                entry.lead.notify_waiters();
            }
        }
    }

    /// How many subscriptions `key` has (for tests).
    #[must_use]
    pub fn subscribers(&self, key: &str) -> usize {
        let shard = self.shard(key).lock().unwrap_or_else(PoisonError::into_inner);
        shard.get(key).map_or(0, |e| e.subscribers)
    }

    /// How many keys have subscribers (for tests and metrics).
    #[must_use]
    pub fn watched_keys(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).len())
            .sum()
    }
}

/// One waiter's interest in one key; unregisters on drop.
pub struct Subscription {
    notifier: Arc<Notifier>,
    key: Box<str>,
    notified: std::pin::Pin<Box<tokio::sync::futures::OwnedNotified>>,
    /// Publications before this subscription, whose handoffs it must not take.
    seen: u64,
}

impl Subscription {
    /// Resolves at the next notification for the key, with the outcome when it came with one
    /// published after this subscription began (see [`Notifier::publish`]).
    pub async fn notified(&mut self) -> Option<Arc<Handoff>> {
        self.notified.as_mut().await;
        let shard = self
            .notifier
            .shard(&self.key)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let entry = shard.get(&*self.key)?;
        (entry.published > self.seen)
            .then(|| entry.handoff.clone())
            .flatten()
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut shard = self
            .notifier
            .shard(&self.key)
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(entry) = shard.get_mut(&*self.key) {
            self.notifier.watching.fetch_sub(1, Ordering::SeqCst);
            entry.subscribers -= 1;
            if entry.subscribers == 0 {
                shard.remove(&*self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A request waiting on a lead sleeps through store news and wakes at the hand-off or when
    /// the lead ends; a store waiter wakes at all three.
    #[tokio::test]
    async fn lead_waiters_wake_only_for_the_lead() {
        let n = Arc::new(Notifier::default());
        let (mut lead, mut store) = (n.subscribe_lead("k"), n.subscribe("k"));
        n.notify("k");
        let short = Duration::from_millis(50);
        assert!(
            tokio::time::timeout(short, lead.notified()).await.is_err(),
            "store news"
        );
        assert!(tokio::time::timeout(short, store.notified()).await.is_ok());
        let (mut lead, mut store) = (n.subscribe_lead("k"), n.subscribe("k"));
        n.lead_ended("k");
        assert!(matches!(
            tokio::time::timeout(short, lead.notified()).await,
            Ok(None)
        ));
        assert!(tokio::time::timeout(short, store.notified()).await.is_ok());
        let mut lead = n.subscribe_lead("k");
        n.publish("k", || Handoff {
            fingerprint: Fingerprint([1; 32]),
            route: "r".into(),
            operation_id: "op".into(),
            response: StoredResponse {
                status: 200,
                headers: vec![],
                body: None,
            },
            expires_at: 1,
        });
        let handoff = tokio::time::timeout(short, lead.notified()).await.unwrap();
        assert_eq!(handoff.unwrap().operation_id, "op");
    }

    #[tokio::test]
    async fn notification_before_await_is_not_lost() {
        let n = Arc::new(Notifier::default());
        let mut sub = n.subscribe("k");
        n.notify("k");
        tokio::time::timeout(Duration::from_secs(1), sub.notified())
            .await
            .expect("woken");
    }

    #[tokio::test]
    async fn other_keys_do_not_wake_and_entries_are_dropped() {
        let n = Arc::new(Notifier::default());
        let mut sub = n.subscribe("a");
        n.notify("b");
        assert!(
            tokio::time::timeout(Duration::from_millis(50), sub.notified())
                .await
                .is_err()
        );
        assert_eq!(n.watched_keys(), 1);
        drop(sub);
        assert_eq!(n.watched_keys(), 0);
    }

    /// Wake-ups are skipped only while no subscription is alive anywhere: the count rises with
    /// each subscription of either kind and falls back to zero when they are dropped.
    #[tokio::test]
    async fn the_subscription_count_follows_the_subscriptions() {
        let n = Arc::new(Notifier::default());
        assert!(n.nobody_watches());
        let (a, b, c) = (n.subscribe("k"), n.subscribe_lead("k"), n.subscribe("other"));
        assert_eq!(n.watching.load(Ordering::SeqCst), 3);
        drop((a, b));
        assert!(!n.nobody_watches());
        let mut d = n.subscribe("k");
        n.notify("k");
        tokio::time::timeout(Duration::from_secs(1), d.notified())
            .await
            .expect("a subscriber is woken while another key is watched");
        drop((c, d));
        assert!(n.nobody_watches());
        assert_eq!(n.watched_keys(), 0);
    }
}
