//! Lease renewal for every running [`Execution`](crate::engine::Execution) of an engine, by one
//! background task.
//!
//! An execution renews its lease at a third of the lease time, so two missed renewals still
//! leave it alive. Most executions finish long before their first renewal is due, so a task and
//! a timer per execution (spawned, then aborted a millisecond later) were pure overhead on every
//! miss. Here an execution is an entry in a map; one task sleeps until the earliest entry is due,
//! renews the due ones (each store call in its own task, so a slow store delays no other
//! renewal) and goes back to sleep.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::record::{LeaseToken, now_millis};
use crate::store::{Store, StoreError};

/// How long the renewal task sleeps when nothing is held.
const IDLE: Duration = Duration::from_secs(3600);

/// The leases of one engine's running executions.
pub(crate) struct Renewer<S> {
    store: Arc<S>,
    state: Mutex<State>,
    next_id: AtomicU64,
    started: AtomicBool,
    wake: Arc<Notify>,
}

#[derive(Default)]
struct State {
    held: HashMap<u64, Held>,
    /// When the task means to wake up next; an earlier entry wakes it sooner.
    wakes_at: Option<Instant>,
}

struct Held {
    key: Arc<str>,
    token: LeaseToken,
    lease: Duration,
    due: Instant,
    /// Until when the lease is surely held, by this process's monotonic clock: a lease
    /// measured from the moment its last successful write (the begin, or a renewal) was sent,
    /// so a process that was paused or starved past it knows on waking (see
    /// [`Renewer::valid_until`]).
    valid_until: Instant,
}

impl<S> std::fmt::Debug for Renewer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Renewer").finish_non_exhaustive()
    }
}

/// Renew at a third of the lease (at most every 10 ms).
fn period(lease: Duration) -> Duration {
    (lease / 3).max(Duration::from_millis(10))
}

impl<S: Store> Renewer<S> {
    pub(crate) fn new(store: Arc<S>) -> Arc<Self> {
        Arc::new(Self {
            store,
            state: Mutex::new(State::default()),
            next_id: AtomicU64::new(0),
            started: AtomicBool::new(false),
            wake: Arc::new(Notify::new()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every critical section is a map operation; a panic cannot leave it half done.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts renewing `key` for `token`, whose lease was written by a call sent at `sent`; the
    /// id stops it again. The key is the execution's own, shared.
    pub(crate) fn hold(
        self: &Arc<Self>,
        key: Arc<str>,
        token: LeaseToken,
        lease: Duration,
        sent: Instant,
    ) -> u64 {
        if !self.started.swap(true, Ordering::AcqRel) {
            tokio::spawn(run(Arc::downgrade(self), self.wake.clone()));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let due = Instant::now() + period(lease);
        let mut state = self.lock();
        state.held.insert(
            id,
            Held {
                key,
                token,
                lease,
                due,
                valid_until: sent + lease,
            },
        );
        if state.wakes_at.is_none_or(|at| due < at) {
            state.wakes_at = Some(due);
            drop(state);
            self.wake.notify_one();
        }
        id
    }

    /// Stops renewing (the outcome is recorded, the lease is lost, or the execution is gone).
    pub(crate) fn release(&self, id: u64) {
        self.lock().held.remove(&id);
    }

    /// Until when the lease of `id` is surely held; `None` once it is lost (a renewal was
    /// fenced) or released.
    pub(crate) fn valid_until(&self, id: u64) -> Option<Instant> {
        self.lock().held.get(&id).map(|h| h.valid_until)
    }

    /// Renews the due leases; returns when the next one is due.
    fn renew_due(self: &Arc<Self>) -> Instant {
        let now = Instant::now();
        let mut due = Vec::new();
        let mut state = self.lock();
        let mut next = now + IDLE;
        for (id, held) in &mut state.held {
            if held.due <= now {
                held.due = now + period(held.lease);
                due.push((*id, held.key.clone(), held.token, held.lease));
            }
            next = next.min(held.due);
        }
        state.wakes_at = Some(next);
        drop(state);
        for (id, key, token, lease) in due {
            let this = self.clone();
            tokio::spawn(async move {
                let sent = Instant::now();
                let until = now_millis() + u64::try_from(lease.as_millis()).unwrap_or(u64::MAX);
                match this.store.renew(&key, token, until).await {
                    Ok(()) => {
                        if let Some(held) = this.lock().held.get_mut(&id) {
                            held.valid_until = held.valid_until.max(sent + lease);
                        }
                    }
                    Err(StoreError::Fenced(_)) => {
                        tracing::warn!(
                            "lease lost while the upstream was running; another attempt owns the key"
                        );
                        this.release(id);
                    }
                    Err(e) => tracing::warn!(error = %e, "lease renewal failed; will retry"),
                }
            });
        }
        next
    }
}

/// The renewal task. It holds the renewer only while renewing, so dropping the engine (which
/// wakes it) ends it.
async fn run<S: Store>(renewer: Weak<Renewer<S>>, wake: Arc<Notify>) {
    loop {
        let next = match renewer.upgrade() {
            Some(this) => this.renew_due(),
            None => return,
        };
        tokio::select! {
            () = tokio::time::sleep_until(next) => {}
            () = wake.notified() => {}
        }
    }
}

impl<S> Drop for Renewer<S> {
    fn drop(&mut self) {
        self.wake.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use crate::engine::{Engine, LeaseExpiry, Policy, Started};
    use crate::fingerprint::Fingerprint;
    use crate::memory::MemoryStore;
    use crate::record::{Millis, RecordState, now_millis};
    use crate::store::Store;

    async fn lease_until(store: &MemoryStore, key: &str) -> Millis {
        match store.get(key, now_millis()).await.unwrap().unwrap().state {
            RecordState::InFlight { lease_until, .. } => lease_until,
            RecordState::Completed { .. } => panic!("completed"),
        }
    }

    /// Waits until `f` holds, for at most `within`.
    async fn eventually(within: Duration, mut f: impl AsyncFnMut() -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        while tokio::time::Instant::now() < deadline {
            if f().await {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        false
    }

    fn policy(lease_ms: u64) -> Policy {
        Policy {
            lease: Duration::from_millis(lease_ms),
            ..Policy::default()
        }
    }

    #[tokio::test]
    async fn running_executions_keep_their_leases_and_stop_renewing_when_dropped() {
        let store = Arc::new(MemoryStore::new(1 << 20));
        let engine = Engine::new(store.clone());
        let fp = Fingerprint([7; 32]);
        let mut held = Vec::new();
        // Two executions with different leases share the one renewal task.
        for (key, lease) in [("short", 60), ("long", 150)] {
            let Started::Execute(exec) = engine.begin(key, "r", fp, &policy(lease)).await.unwrap() else {
                panic!("expected to execute");
            };
            held.push((key, lease_until(&store, key).await, exec));
        }
        for (key, first, _) in &held {
            // Renewed twice: the lease moves past its first end, then again.
            let mut seen = *first;
            for _ in 0..2 {
                assert!(
                    eventually(Duration::from_secs(3), async || {
                        let now = lease_until(&store, key).await;
                        if now > seen {
                            seen = now;
                            true
                        } else {
                            false
                        }
                    })
                    .await,
                    "{key}: lease not renewed"
                );
            }
        }
        // Dropped without an outcome: the renewal stops and the lease runs out.
        let (key, _, exec) = held.remove(0);
        drop(exec);
        let last = lease_until(&store, key).await;
        assert!(
            eventually(Duration::from_secs(3), async || now_millis() > last + 100).await,
            "clock"
        );
        assert_eq!(lease_until(&store, key).await, last, "renewed after the drop");
        // The other one is still renewed.
        let (key, _, _exec) = &held[0];
        let before = lease_until(&store, key).await;
        assert!(
            eventually(Duration::from_secs(3), async || lease_until(&store, key).await
                > before)
            .await,
            "{key}: renewal stopped with the other execution"
        );
    }

    /// A process stopped between acquiring a key and running the operation, past its lease,
    /// knows on waking that the key may be another's (`Execution::lease_held`): the checker's
    /// gateway that was `SIGSTOP`ped right after its `begin` executed again after a replica had
    /// taken the key over and executed. Blocking the only runtime thread stops this process
    /// as `SIGSTOP` would: no renewal runs.
    #[tokio::test]
    async fn an_execution_paused_past_its_lease_no_longer_holds_it() {
        let store = Arc::new(MemoryStore::new(1 << 20));
        let (engine, replica) = (Engine::new(store.clone()), Engine::new(store.clone()));
        let fp = Fingerprint([9; 32]);
        let Started::Execute(exec) = engine.begin("k", "r", fp, &policy(100)).await.unwrap() else {
            panic!("expected to execute");
        };
        assert!(exec.lease_held(), "held right after begin");
        std::thread::sleep(Duration::from_millis(150));
        assert!(!exec.lease_held(), "the pause outlived the lease");
        // What the check is for: meanwhile a replica may take the key over and execute.
        assert!(matches!(
            replica.begin("k", "r", fp, &policy(100)).await.unwrap(),
            Started::Execute(_)
        ));
        // With `on_lease_expiry: fail` nobody takes a key over, so nothing is refused.
        let fail = Policy {
            on_lease_expiry: LeaseExpiry::Fail,
            ..policy(100)
        };
        let Started::Execute(exec) = engine.begin("f", "r", fp, &fail).await.unwrap() else {
            panic!("expected to execute");
        };
        std::thread::sleep(Duration::from_millis(150));
        assert!(exec.lease_held(), "no takeover on a fail route");
    }

    /// Renewals keep an execution's lease held for as long as it runs.
    #[tokio::test]
    async fn renewals_keep_a_running_execution_holding_its_lease() {
        let store = Arc::new(MemoryStore::new(1 << 20));
        let engine = Engine::new(store);
        let Started::Execute(exec) = engine
            .begin("k", "r", Fingerprint([3; 32]), &policy(300))
            .await
            .unwrap()
        else {
            panic!("expected to execute");
        };
        // Twice the lease, renewed every 100 ms.
        for _ in 0..6 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert!(exec.lease_held(), "renewed, so still held");
        }
    }
}
