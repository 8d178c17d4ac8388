//! An [`Execution`]: the key while its operation runs, renewed in the background, and the
//! outcome recorded or the key released when it ends.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{Finished, LeaseExpiry, Outcome, Policy, is_final, millis};
use crate::fingerprint::Fingerprint;
use crate::lead::Lead;
use crate::notify::Handoff;
use crate::record::{LeaseToken, now_millis};
use crate::renew::Renewer;
use crate::store::{Store, StoreError};

/// Ownership of a key while the operation runs. Renews the lease in the background.
///
/// Dropping it without [`Execution::finish`] stops the renewal and leaves the record in flight:
/// the outcome is unknown, so the key is neither completed nor released, and the lease expiry
/// rule decides later (exactly as if the process had died).
pub struct Execution<S: Store> {
    store: Arc<S>,
    /// Shared with the lease renewal and the key's lead (one copy per execution).
    key: Arc<str>,
    token: LeaseToken,
    operation_id: String,
    retention: Duration,
    store_server_errors: bool,
    /// What the record was begun for, handed with the outcome to local waiters.
    fingerprint: Fingerprint,
    route: Arc<str>,
    renewer: Arc<Renewer<S>>,
    /// The lease renewal's id while it runs.
    renewal: Option<u64>,
    lease: Duration,
    /// `on_lease_expiry: retry`: another attempt may take the key over once the lease ends.
    takeover: bool,
    /// The key's lead on this process (`lead.rs`): dropped with the execution, after the
    /// outcome was handed over, it wakes any waiter that still needs the store.
    pub(super) lead: Option<Lead>,
}

impl<S: Store> Execution<S> {
    pub(super) fn start(
        store: Arc<S>,
        renewer: &Arc<Renewer<S>>,
        (fingerprint, route): (Fingerprint, Arc<str>),
        key: Arc<str>,
        // The lease's token, and an instant no later than the wall-clock time its end was
        // computed from.
        (token, sent): (LeaseToken, Instant),
        operation_id: String,
        policy: &Policy,
    ) -> Self {
        let renewal = Some(renewer.hold(key.clone(), token, policy.lease, sent));
        Self {
            store,
            key,
            token,
            operation_id,
            retention: policy.retention,
            store_server_errors: policy.store_server_errors,
            fingerprint,
            route,
            renewer: renewer.clone(),
            renewal,
            lease: policy.lease,
            takeover: policy.on_lease_expiry == LeaseExpiry::Retry,
            lead: None,
        }
    }

    fn stop_renewal(&mut self) {
        if let Some(id) = self.renewal.take() {
            self.renewer.release(id);
        }
    }

    /// The record's operation id.
    #[must_use]
    pub fn operation_id(&self) -> &str {
        &self.operation_id
    }

    /// Whether the lease is still surely this execution's, with a tenth of the lease to spare:
    /// ask right before the operation starts, and do not start it when this is false.
    ///
    /// Why: a process stopped or starved between acquiring the key and calling the operation
    /// (a `SIGSTOP`, a long stall), or a store answer slower than the lease, may resume after
    /// the lease ran out and another attempt, with `on_lease_expiry: retry`, took the key over
    /// and ran the operation. The fencing token keeps the late owner from recording over the
    /// new one, but not from running the operation a second time. The checker caught exactly
    /// that: a gateway stopped for 1.8 s right after its `begin`, a retry on the other replica
    /// executed at the lease's end, and the stopped one, resumed, executed again. The
    /// lease is counted on the monotonic clock from an instant no later than the wall-clock
    /// time the store computed its end from (the `begin`, then each successful renewal; stores
    /// never shorten a lease), so a stop of this process shows. The tenth covers the wall
    /// clocks of replicas (each judges expiry by its own; they must agree within it) and the
    /// moment between this check and the request leaving. A suspended or frozen machine whose
    /// monotonic clock stops is not seen. False also once a renewal was fenced. Always true
    /// with `on_lease_expiry: fail`: nobody takes such a key over.
    #[must_use]
    pub fn lease_held(&self) -> bool {
        if !self.takeover {
            return true;
        }
        self.renewal
            .and_then(|id| self.renewer.valid_until(id))
            .is_some_and(|until| Instant::now() + self.lease / 10 < until)
    }

    /// Gives the key back without running the operation, because [`Execution::lease_held`]
    /// said no: released if it is still ours. When another attempt took the key over, the
    /// release is fenced, which is the case the check is for and not an error; any other store
    /// error leaves the key to its lease's end (nothing ran). Logs both.
    pub async fn withdraw(self) {
        tracing::warn!("the lease ran out before the operation was called; not called");
        match self.finish(Outcome::NoResponse).await {
            Ok(_) | Err(StoreError::Fenced(_)) => {}
            Err(e) => tracing::warn!(error = %e, "could not release a key whose lease ran out"),
        }
    }

    /// Stores a final outcome or releases the key for a transient one.
    ///
    /// # Errors
    /// A store error, or [`StoreError::Fenced`] when the lease was lost meanwhile.
    pub async fn finish(mut self, outcome: Outcome) -> Result<Finished, StoreError> {
        self.stop_renewal();
        self.try_finish(&outcome).await
    }

    /// One attempt at [`Execution::finish`] that keeps the execution (and its lease renewal)
    /// when the store fails, so the caller can try again once the store is back: an outcome
    /// that reached the client must still be recorded, or a retry would run the operation again.
    /// The renewal stops once the outcome is recorded or the lease is lost.
    ///
    /// # Errors
    /// A store error (try again), or [`StoreError::Fenced`] (the lease is lost; give up).
    pub async fn try_finish(&mut self, outcome: &Outcome) -> Result<Finished, StoreError> {
        let result = match outcome {
            Outcome::Response(response) if is_final(response.status, self.store_server_errors) => {
                let now = now_millis();
                let retention = millis(self.retention);
                let done = self
                    .store
                    .complete(&self.key, self.token, response, retention, now)
                    .await;
                if done.is_ok() {
                    // Kept while the key has subscribers, which a hot key may always have:
                    // bytes of its own (made only when someone is subscribed).
                    self.store.notifier().publish(&self.key, || Handoff {
                        fingerprint: self.fingerprint,
                        route: self.route.to_string(),
                        operation_id: self.operation_id.clone(),
                        response: response.compacted(),
                        expires_at: now + retention,
                    });
                }
                done.map(|()| Finished::Completed {
                    expires_at: now + retention,
                })
            }
            _ => self
                .store
                .release(&self.key, self.token)
                .await
                .map(|()| Finished::Released),
        };
        if matches!(result, Ok(_) | Err(StoreError::Fenced(_))) {
            self.stop_renewal();
        }
        result
    }
}

impl<S: Store> std::fmt::Debug for Execution<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Execution")
            .field("operation_id", &self.operation_id)
            .finish_non_exhaustive()
    }
}

impl<S: Store> Drop for Execution<S> {
    fn drop(&mut self) {
        self.stop_renewal();
    }
}
