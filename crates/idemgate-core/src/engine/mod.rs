//! The idempotency engine: the one place that decides what a deduplicated request does.
//!
//! Both the gateway's proxy and the tower layer call it the same way:
//!
//! 1. [`Engine::begin`] with the namespaced key, the route and the fingerprint. It answers a
//!    [`Started`]: execute, replay, or one of the refusals. It waits on in-flight owners itself
//!    (by notification, bounded by `wait_timeout`) so callers never poll.
//! 2. On [`Started::Execute`], run the operation to its end (even if the client went away), then
//!    [`Execution::finish`] with the [`Outcome`]. The engine decides whether that outcome is final
//!    (stored and replayed) or transient (the key is released for a retry).
//!
//! While an [`Execution`] is alive its lease is renewed in the background (one task per engine,
//! see `renew.rs`), so a slow upstream keeps its key and a dead process loses it once the
//! lease runs out.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::task::TaskTracker;

use crate::begin_call::BeginCall;
use crate::fingerprint::Fingerprint;
use crate::lead::{Lead, Leads, Taken};
use crate::notify::{Handoff, Subscription};
use crate::record::{LeaseToken, Millis, RecordState, StoredResponse, now_millis};
use crate::renew::Renewer;
use crate::rules::{Begin, BeginRequest};
use crate::store::{Store, StoreError};

mod execution;
mod operation_id;
mod policy;

pub use execution::Execution;
pub(crate) use operation_id::OperationId;
pub use operation_id::new_operation_id;
pub use policy::{Concurrency, LeaseExpiry, Policy, is_final, is_storable_header};

/// The result of [`Engine::begin`].
pub enum Started<S: Store> {
    /// The caller owns the key: execute, then [`Execution::finish`].
    Execute(Execution<S>),
    /// A completed outcome for the same request: send it back.
    Replay {
        response: StoredResponse,
        operation_id: String,
        expires_at: Millis,
    },
    /// The operation completed but its body was over `max_response_bytes`.
    NotRetained {
        status: u16,
        operation_id: String,
        expires_at: Millis,
    },
    /// The key belongs to a different request (body, route or method).
    Mismatch { operation_id: String },
    /// Another owner is running (`reject`, or `wait` timed out).
    InFlight {
        operation_id: String,
        retry_after: Duration,
    },
    /// The owner died and the route refuses takeover.
    OutcomeUnknown { operation_id: String },
}

impl<S: Store> std::fmt::Debug for Started<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Execute(e) => f.debug_tuple("Execute").field(e).finish(),
            Self::Replay {
                response,
                operation_id,
                ..
            } => f
                .debug_struct("Replay")
                .field("status", &response.status)
                .field("operation_id", operation_id)
                .finish_non_exhaustive(),
            Self::NotRetained {
                status, operation_id, ..
            } => f
                .debug_struct("NotRetained")
                .field("status", status)
                .field("operation_id", operation_id)
                .finish_non_exhaustive(),
            Self::Mismatch { operation_id } => f
                .debug_struct("Mismatch")
                .field("operation_id", operation_id)
                .finish(),
            Self::InFlight {
                operation_id,
                retry_after,
            } => f
                .debug_struct("InFlight")
                .field("operation_id", operation_id)
                .field("retry_after", retry_after)
                .finish(),
            Self::OutcomeUnknown { operation_id } => f
                .debug_struct("OutcomeUnknown")
                .field("operation_id", operation_id)
                .finish(),
        }
    }
}

/// How an execution ended.
#[derive(Clone, Debug)]
pub enum Outcome {
    /// The upstream answered. `body: None` means it was over `max_response_bytes`.
    Response(StoredResponse),
    /// No answer (connect error, timeout, cancelled): always transient.
    NoResponse,
}

/// What [`Execution::finish`] did with the outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finished {
    /// Stored; replayed until `expires_at`.
    Completed { expires_at: Millis },
    /// Transient: the key was released, a retry executes again.
    Released,
}

/// The engine, cheap to clone.
#[derive(Debug)]
pub struct Engine<S> {
    store: Arc<S>,
    renewer: Arc<Renewer<S>>,
    /// Keys a request of this process is asking the store about or executing (`lead.rs`).
    leads: Arc<Leads>,
    /// Store calls that outlive the request that made them (`begin_call.rs`).
    background: TaskTracker,
}

impl<S> Clone for Engine<S> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            renewer: self.renewer.clone(),
            leads: self.leads.clone(),
            background: self.background.clone(),
        }
    }
}

impl<S> Engine<S> {
    /// Store calls still running for requests that are gone: the `begin` of a client that
    /// disconnected mid-call, finishing so that a key it took for nobody is released
    /// (`begin_call.rs`). At shutdown, `close` it and `wait` (bounded) after the last request, so
    /// that such a release is not cut off and the client's retry does not wait out a lease.
    #[must_use]
    pub fn background(&self) -> &TaskTracker {
        &self.background
    }

    /// Tracks the background calls on `tracker` (the one a server already waits on at shutdown)
    /// instead of a tracker of the engine's own.
    #[must_use]
    pub fn with_background(mut self, tracker: TaskTracker) -> Self {
        self.background = tracker;
        self
    }
}

impl<S: Store> Engine<S> {
    #[must_use]
    pub fn new(store: Arc<S>) -> Self {
        Self {
            renewer: Renewer::new(store.clone()),
            store,
            leads: Arc::default(),
            background: TaskTracker::new(),
        }
    }

    #[must_use]
    pub fn store(&self) -> &Arc<S> {
        &self.store
    }

    /// Begins a deduplicated request.
    ///
    /// # Errors
    /// A store error; the caller applies its `on_store_error` policy.
    pub async fn begin(
        &self,
        key: &str,
        route: &str,
        fingerprint: Fingerprint,
        policy: &Policy,
    ) -> Result<Started<S>, StoreError> {
        self.begin_traced(key, route, fingerprint, policy, &mut false)
            .await
    }

    /// [`Engine::begin`], also telling whether the request had to wait for another owner
    /// (`waited` is set before the first wait, for metrics).
    ///
    /// # Errors
    /// A store error; the caller applies its `on_store_error` policy.
    pub async fn begin_traced(
        &self,
        key: &str,
        route: &str,
        fingerprint: Fingerprint,
        policy: &Policy,
        waited: &mut bool,
    ) -> Result<Started<S>, StoreError> {
        let token = LeaseToken::random();
        // One clock read serves the id's timestamp, the deadline and the first round (each
        // read is a measurable share of a replay). The monotonic clock is read first: a lease
        // the store computes from the wall-clock time ends no earlier than this instant plus
        // the lease (`Execution::lease_held`).
        let start_at = tokio::time::Instant::now();
        let start = now_millis();
        let operation_id = OperationId::fresh(start);
        let wait_until = start + millis(policy.wait_timeout);
        let waits = policy.concurrent == Concurrency::Wait;
        // A remote store subscribes first, so a key found in flight is waited on without asking
        // again (see `Store::remote`).
        let mut subscription = (self.store.remote() && waits).then(|| self.store.notifier().subscribe(key));
        let mut lead: Option<Lead> = None;
        let mut lead_sub: Option<Subscription> = None;
        let mut gate = waits;
        let mut first_round = true;
        loop {
            let (at, now) = if std::mem::take(&mut first_round) {
                (start_at, start)
            } else {
                (tokio::time::Instant::now(), now_millis())
            };
            // One store call per key on this process (`lead.rs`): if another request here holds
            // the key's lead, wait for its hand-off instead of asking the store. Past the
            // deadline, ask the store for the real answer.
            if gate && lead.is_none() && now < wait_until {
                let notifier = self.store.notifier();
                match self.leads.try_lead(key, (fingerprint, route), notifier) {
                    Ok(l) => {
                        lead = Some(l);
                        lead_sub = None;
                    }
                    Err(Taken::Other) => {}
                    Err(Taken::Same) => {
                        // Woken by the lead's hand-off or its end only, not by the store's own
                        // news, which can come first (the embedded store's journal thread, a
                        // networked store's notification) and would only make it wait again.
                        let sub = lead_sub.get_or_insert_with(|| notifier.subscribe_lead(key));
                        // Subscribed, then checked again: a lead given up before the
                        // subscription is seen here, one given up after it wakes it.
                        match self.leads.holder(key, (fingerprint, route)) {
                            None => continue,
                            // Another request took the key meanwhile: ask the store.
                            Some(Taken::Other) => lead_sub = None,
                            Some(Taken::Same) => {
                                *waited = true;
                                let nap = Duration::from_millis(wait_until.saturating_sub(now));
                                if let Ok(Some(handoff)) = tokio::time::timeout(nap, sub.notified()).await {
                                    return Ok(replay_handoff(&handoff, fingerprint, route));
                                }
                                // Woken without a hand-off (a release, a refusal, a store error,
                                // a lead that gave up) or at the deadline: from here on ask the
                                // store like any waiter, so the waiters of a lead that ended
                                // without an outcome are not served one new lead at a time.
                                lead_sub = None;
                                gate = false;
                                subscription = Some(notifier.subscribe(key));
                                continue;
                            }
                        }
                    }
                }
            }
            let req = BeginRequest {
                fingerprint,
                route,
                token,
                operation_id: operation_id.as_str(),
                lease_ms: millis(policy.lease),
                retention_ms: millis(policy.retention),
                takeover: policy.on_lease_expiry == LeaseExpiry::Retry,
                now,
            };
            // A call that can be cut off mid-way (a networked store, or a reservation that
            // must reach the disk) runs to its end even if this request is dropped
            // (`begin_call.rs`). The memory store and the embedded store's takeover routes
            // decide on this task; the embedded store waits on its writer there only to replace
            // a dead record, which this does not cover.
            let answer = if self.store.remote() || !req.takeover {
                BeginCall::new(&self.store, &self.background, key, &req).await
            } else {
                self.store.begin(key, &req).await
            };
            let lease_until = match answer? {
                Begin::Acquired { operation_id, .. } => {
                    // The key and route are copied once: the lead's copies, shared, or new ones
                    // when there is no lead (`reject`, or past the wait).
                    let (k, r) = lead
                        .as_ref()
                        .map_or_else(|| (key.into(), route.into()), Lead::shared);
                    let mut exec = Execution::start(
                        self.store.clone(),
                        &self.renewer,
                        (fingerprint, r),
                        k,
                        (token, at),
                        operation_id,
                        policy,
                    );
                    // Held until the outcome is recorded and handed over.
                    exec.lead = lead;
                    return Ok(Started::Execute(exec));
                }
                Begin::Replay(record) => {
                    let RecordState::Completed { response, .. } = record.state else {
                        unreachable!("rules::begin replays only completed records")
                    };
                    if lead.is_some() {
                        // This process's waiters take the stored outcome from the lead.
                        self.store.notifier().publish(key, || Handoff {
                            fingerprint: record.fingerprint,
                            route: record.route.clone(),
                            operation_id: record.operation_id.clone(),
                            response: response.clone(),
                            expires_at: record.expires_at,
                        });
                    }
                    return Ok(Started::completed(
                        response,
                        record.operation_id,
                        record.expires_at,
                    ));
                }
                Begin::Mismatch { operation_id } => return Ok(Started::Mismatch { operation_id }),
                Begin::LeaseExpired { operation_id } => {
                    return Ok(Started::OutcomeUnknown { operation_id });
                }
                Begin::InFlight {
                    operation_id,
                    lease_until,
                } => {
                    if policy.concurrent == Concurrency::Reject || now >= wait_until {
                        let left = lease_until.saturating_sub(now).div_ceil(1000).max(1);
                        return Ok(Started::InFlight {
                            operation_id,
                            retry_after: Duration::from_secs(left),
                        });
                    }
                    lease_until
                }
            };
            // Subscribe, then ask again before sleeping: a completion between the two calls is
            // then either seen by the second begin or delivered to the subscription.
            let Some(sub) = subscription.as_mut() else {
                subscription = Some(self.store.notifier().subscribe(key));
                continue;
            };
            // Wake at a notification, at the deadline, or when the lease ends (the owner may
            // have died; the next begin then takes over or reports the outcome unknown).
            let wake_at = wait_until.min(lease_until.saturating_add(1));
            let nap = Duration::from_millis(wake_at.saturating_sub(now_millis()));
            *waited = true;
            if let Ok(Some(handoff)) = tokio::time::timeout(nap, sub.notified()).await {
                // The owner ran on this process and handed its recorded outcome over: answer
                // as `begin` on that record would, without reading it back.
                return Ok(replay_handoff(&handoff, fingerprint, route));
            }
            // A fresh subscription for the next round: the old one has fired.
            subscription = Some(self.store.notifier().subscribe(key));
        }
    }
}

/// What a waiter answers from a handed-over outcome: what `rules::begin` answers on the same
/// completed record (replay for the same request, mismatch for another).
fn replay_handoff<S: Store>(h: &Handoff, fingerprint: Fingerprint, route: &str) -> Started<S> {
    if !(h.fingerprint.ct_eq(&fingerprint) && h.route == route) {
        return Started::Mismatch {
            operation_id: h.operation_id.clone(),
        };
    }
    Started::completed(h.response.clone(), h.operation_id.clone(), h.expires_at)
}

impl<S: Store> Started<S> {
    /// A completed outcome's answer: replayed, or not retained when its body was too large.
    fn completed(response: StoredResponse, operation_id: String, expires_at: Millis) -> Self {
        match response.body {
            Some(_) => Self::Replay {
                response,
                operation_id,
                expires_at,
            },
            None => Self::NotRetained {
                status: response.status,
                operation_id,
                expires_at,
            },
        }
    }
}

/// What [`Engine::lookup`] found for a key (recovery routes, SPEC 5).
#[derive(Debug)]
pub enum Lookup {
    /// A completed record (its response may lack a body: not retained).
    Completed(Box<crate::record::Record>),
    /// An owner is (or was, if its lease ran out and nobody retried) running.
    InFlight { operation_id: String, route: String },
    /// No record.
    Unknown,
}

impl<S: Store> Engine<S> {
    /// Reads a key's outcome without taking it. With `wait`, an in-flight key is waited on (by
    /// notification) for up to that long before answering `InFlight`.
    ///
    /// # Errors
    /// A store error.
    pub async fn lookup(&self, key: &str, wait: Option<Duration>) -> Result<Lookup, StoreError> {
        let wait_until = now_millis() + wait.map_or(0, millis);
        let mut subscription = None;
        loop {
            let now = now_millis();
            let Some(record) = self.store.get(key, now).await? else {
                return Ok(Lookup::Unknown);
            };
            let RecordState::InFlight { lease_until, .. } = record.state else {
                return Ok(Lookup::Completed(Box::new(record)));
            };
            if now >= wait_until {
                return Ok(Lookup::InFlight {
                    operation_id: record.operation_id,
                    route: record.route,
                });
            }
            let Some(sub) = subscription.as_mut() else {
                subscription = Some(self.store.notifier().subscribe(key));
                continue;
            };
            let wake_at = if lease_until > now {
                wait_until.min(lease_until + 1)
            } else {
                wait_until
            };
            let nap = Duration::from_millis(wake_at.saturating_sub(now_millis()));
            let _ = tokio::time::timeout(nap, sub.notified()).await;
            subscription = Some(self.store.notifier().subscribe(key));
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operation_ids_are_unique_uuid_v7_in_time_order() {
        let before = now_millis();
        let ids: Vec<String> = (0..10_000).map(|_| new_operation_id()).collect();
        let after = now_millis();
        let mut seen = std::collections::HashSet::new();
        let mut last_ms = 0;
        for id in &ids {
            let hex = id.strip_prefix("op_").expect("op_ prefix");
            let uuid = uuid::Uuid::parse_str(hex).expect("a UUID");
            assert_eq!(uuid.get_version_num(), 7);
            let (secs, nanos) = uuid.get_timestamp().expect("v7 has a timestamp").to_unix();
            let ms = secs * 1000 + u64::from(nanos) / 1_000_000;
            assert!((before..=after).contains(&ms), "{ms} outside {before}..={after}");
            assert!(ms >= last_ms, "ids sort by creation time");
            last_ms = ms;
            assert!(seen.insert(uuid), "duplicate id {id}");
        }
    }
}
