//! The fingerprint marker: what lets idemgate refuse a Restate-bound key reused for another
//! request (SPEC 9), which Restate alone answers with the original response.
//!
//! For each namespaced key idemgate keeps one record in its own store, through the same engine
//! as case A: `begin` with the request's fingerprint, then at once `complete` with a bodiless
//! `204` (the *marker*). The marker holds no response: Restate keeps the outcome. Later
//! requests with the key find the marker completed and get:
//!
//! - same fingerprint: a "replay" of the marker, which here only means *go on to Restate*;
//! - other fingerprint (body, method, route): `422 idempotency-key-reused`.
//!
//! Why complete at once instead of holding the record while Restate runs: duplicates in flight
//! must still reach Restate, which latches them onto the running invocation (and, for an
//! invocation that outlives one HTTP request, is the only one that knows when it ends). A
//! record held in flight would make them wait on idemgate's lease instead. The only window in
//! which a duplicate waits is between `begin` and `complete`, two store calls; the engine's
//! waiters are woken by notification when the marker completes.
//!
//! The marker step runs in its own tracked task, so a client that disconnects cannot leave a
//! marker half-written (in flight until its lease ends). A process that dies between the two
//! calls leaves an in-flight marker; its lease expires and the next request takes it over
//! (`on_lease_expiry: retry`, whatever the route says: the marker guards no execution).
//!
//! The key stays bound to the first request's fingerprint even when that request never reached
//! Restate (ingress down): a concurrent duplicate may have, so releasing it could let a third,
//! different request attach to that invocation's result.
//!
//! The marker lives for the route's `retention` plus the upstream timeout, so it outlives
//! Restate's own entry (whose retention starts when the invocation ends) for every invocation
//! that ends within one request's time.

use bytes::Bytes;
use idemgate_core::engine::{Concurrency, LeaseExpiry, Outcome, Policy, Started};
use idemgate_core::fingerprint::Fingerprint;
use idemgate_core::record::StoredResponse;
use idemgate_core::store::StoreError;

use crate::access_log::AccessLog;
use crate::config::Route;
use crate::problem::{Kind, Problem};
use crate::proxy::Gateway;

/// The marker's status: completed, no content.
const MARKER_STATUS: u16 = 204;

impl Gateway {
    /// Binds `key` to `fingerprint` in the store, or refuses a reuse with another request.
    ///
    /// `Ok` means: forward to Restate. A store error follows the route's `on_store_error`
    /// (`fail_open` forwards unchecked: Restate still deduplicates, only the 422 is lost).
    pub(crate) async fn check_fingerprint(
        &self,
        route: &Route,
        key: &str,
        fingerprint: Fingerprint,
        log: &mut AccessLog,
    ) -> Result<(), Problem> {
        let policy = Policy {
            retention: route.engine.retention + route.upstream.timeout,
            lease: route.engine.lease,
            concurrent: Concurrency::Wait,
            wait_timeout: route.engine.wait_timeout,
            on_lease_expiry: LeaseExpiry::Retry,
            store_server_errors: false,
            max_response_bytes: route.engine.max_response_bytes,
        };
        let engine = self.engine().clone();
        let (key, route_id) = (key.to_owned(), route.id.clone());
        // Tracked and awaited: the marker is written even if this request is dropped meanwhile.
        let marked = self.tasks().spawn(async move {
            let mut waited = false;
            let started = engine
                .begin_traced(&key, &route_id, fingerprint, &policy, &mut waited)
                .await?;
            if let Started::Execute(exec) = started {
                let marker = StoredResponse {
                    status: MARKER_STATUS,
                    headers: Vec::new(),
                    body: Some(Bytes::new()),
                };
                if let Err(e) = exec.finish(Outcome::Response(marker)).await {
                    // The request goes on: the marker stays in flight until its lease ends.
                    tracing::warn!(error = %e, "could not complete the fingerprint marker");
                }
                return Ok::<_, StoreError>((None, waited));
            }
            Ok((Some(started), waited))
        });
        let started = match marked.await {
            Ok(Ok((started, waited))) => {
                log.waited |= waited;
                started
            }
            Ok(Err(e)) => return crate::proxy::store_failed(route, &e, log),
            Err(_) => {
                return Err(
                    Problem::new(Kind::StoreUnavailable, "the fingerprint check failed").retry_after(1),
                );
            }
        };
        match started {
            None | Some(Started::Replay { .. } | Started::NotRetained { .. }) => Ok(()),
            // The marker's own operation id means nothing to the client (Restate's invocation
            // id is the operation id here), so the problem names none.
            Some(Started::Mismatch { .. }) => Err(Problem::new(
                Kind::KeyReused,
                "this key was used for a request with a different body, method or endpoint",
            )),
            Some(Started::InFlight { retry_after, .. }) => Err(Problem::new(
                Kind::RequestInFlight,
                "a request with this key is being admitted",
            )
            .retry_after(retry_after.as_secs())),
            Some(Started::OutcomeUnknown { .. } | Started::Execute(_)) => Err(Problem::new(
                Kind::OutcomeUnknown,
                "the fingerprint record of this key is in an unexpected state",
            )),
        }
    }
}
