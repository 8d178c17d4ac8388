//! The store conformance suite: the behaviour every [`Store`] must show, run against each
//! backend by [`store_conformance!`](crate::store_conformance).
//!
//! Each check takes a fresh store and a unique key prefix, so backends shared between tests
//! (Redis, PostgreSQL) never see one test's keys in another. Times are passed explicitly where
//! the trait takes them, so lease and retention expiry are exact rather than slept for.

use std::sync::Arc;
use std::time::Duration;

use idemgate_core::Fingerprint;
use idemgate_core::engine::{Engine, Outcome, Policy, Started};
use idemgate_core::record::{LeaseToken, Millis, RecordState, StoredResponse, now_millis};
use idemgate_core::rules::{Begin, BeginRequest};
use idemgate_core::store::{Store, StoreError};

/// A key unique to this call.
#[must_use]
pub fn unique_key(name: &str) -> String {
    format!("t-*:*:*:conf-{name}-{}", LeaseToken::random().0)
}

fn fp(n: u8) -> Fingerprint {
    Fingerprint([n; 32])
}

fn req<'a>(token: LeaseToken, fingerprint: Fingerprint, now: Millis, takeover: bool) -> BeginRequest<'a> {
    BeginRequest {
        fingerprint,
        route: "route-a",
        token,
        operation_id: "op_conf",
        lease_ms: 1_000,
        retention_ms: 60_000,
        takeover,
        now,
    }
}

fn response(body: &[u8]) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body: Some(body.to_vec().into()),
    }
}

fn assert_acquired(b: &Begin) {
    assert!(
        matches!(b, Begin::Acquired { .. }),
        "expected Acquired, got {b:?}"
    );
}

/// 32 begins on `key` at once, each with a token of its own, all at `now`.
async fn begins_at_once<S: Store>(store: &Arc<S>, key: &str, now: Millis) -> Vec<Begin> {
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let (store, key) = (store.clone(), key.to_owned());
            tokio::spawn(async move {
                store
                    .begin(&key, &req(LeaseToken::random(), fp(1), now, true))
                    .await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.expect("task").expect("begin"));
    }
    answers
}

/// N concurrent begins on one key: exactly one acquires, the rest see it in flight.
pub async fn concurrent_begin_race<S: Store>(store: Arc<S>) {
    let key = unique_key("race");
    let mut acquired = 0;
    for answer in begins_at_once(&store, &key, now_millis()).await {
        match answer {
            Begin::Acquired { .. } => acquired += 1,
            Begin::InFlight { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(acquired, 1, "exactly one begin acquires");
}

/// 32 concurrent begins find the same dead owner (its lease over): exactly one takes the key
/// over, every other sees the new owner in flight, and the dead owner is fenced.
pub async fn concurrent_takeover_race<S: Store>(store: Arc<S>) {
    let key = unique_key("takeover-race");
    let now = now_millis();
    let dead = LeaseToken::random();
    assert_acquired(&store.begin(&key, &req(dead, fp(1), now, true)).await.unwrap());
    let later = now + 1_001;
    let mut took_over = 0;
    for answer in begins_at_once(&store, &key, later).await {
        match answer {
            Begin::Acquired {
                took_over: true,
                generation: 2,
                ..
            } => took_over += 1,
            Begin::InFlight { lease_until, .. } => assert_eq!(lease_until, later + 1_000),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(took_over, 1, "exactly one begin takes the key over");
    let err = store
        .complete(&key, dead, &response(b"late"), 60_000, later)
        .await;
    assert!(matches!(err, Err(StoreError::Fenced(_))), "dead owner: {err:?}");
}

/// Complete, then the same fingerprint replays and another one is a mismatch.
pub async fn replay_and_mismatch<S: Store>(store: Arc<S>) {
    let key = unique_key("replay");
    let now = now_millis();
    let owner = LeaseToken::random();
    assert_acquired(&store.begin(&key, &req(owner, fp(1), now, true)).await.unwrap());
    // In flight with another fingerprint: mismatch, not a wait.
    let other = store
        .begin(&key, &req(LeaseToken::random(), fp(2), now, true))
        .await
        .unwrap();
    assert!(matches!(other, Begin::Mismatch { .. }), "{other:?}");
    store
        .complete(&key, owner, &response(b"{\"id\":1}"), 60_000, now)
        .await
        .unwrap();
    match store
        .begin(&key, &req(LeaseToken::random(), fp(1), now + 1, true))
        .await
        .unwrap()
    {
        Begin::Replay(rec) => match rec.state {
            RecordState::Completed { response: r, .. } => assert_eq!(r, response(b"{\"id\":1}")),
            s @ RecordState::InFlight { .. } => panic!("replayed an in-flight record {s:?}"),
        },
        other => panic!("expected Replay, got {other:?}"),
    }
    let other = store
        .begin(&key, &req(LeaseToken::random(), fp(2), now + 1, true))
        .await
        .unwrap();
    assert!(matches!(other, Begin::Mismatch { .. }), "{other:?}");
    // Same fingerprint, other route: also a mismatch.
    let mut on_b = req(LeaseToken::random(), fp(1), now + 1, true);
    on_b.route = "route-b";
    assert!(matches!(
        store.begin(&key, &on_b).await.unwrap(),
        Begin::Mismatch { .. }
    ));
}

/// An expired lease is taken over (retry) or reported (fail); the stale owner is fenced out.
pub async fn lease_expiry_takeover_and_fencing<S: Store>(store: Arc<S>) {
    let key = unique_key("lease");
    let now = now_millis();
    let stale = LeaseToken::random();
    assert_acquired(&store.begin(&key, &req(stale, fp(1), now, true)).await.unwrap());
    let later = now + 1_001;
    let refused = store
        .begin(&key, &req(LeaseToken::random(), fp(1), later, false))
        .await
        .unwrap();
    assert!(matches!(refused, Begin::LeaseExpired { .. }), "{refused:?}");
    let fresh = LeaseToken::random();
    match store.begin(&key, &req(fresh, fp(1), later, true)).await.unwrap() {
        Begin::Acquired {
            took_over,
            generation,
            ..
        } => {
            assert!(took_over);
            assert_eq!(generation, 2);
        }
        other => panic!("expected takeover, got {other:?}"),
    }
    let err = store
        .complete(&key, stale, &response(b"late"), 60_000, later)
        .await;
    assert!(
        matches!(err, Err(StoreError::Fenced(_))),
        "stale complete: {err:?}"
    );
    let err = store.release(&key, stale).await;
    assert!(
        matches!(err, Err(StoreError::Fenced(_))),
        "stale release: {err:?}"
    );
    let err = store.renew(&key, stale, later + 5_000).await;
    assert!(matches!(err, Err(StoreError::Fenced(_))), "stale renew: {err:?}");
    store
        .complete(&key, fresh, &response(b"new"), 60_000, later)
        .await
        .unwrap();
    let rec = store.get(&key, later).await.unwrap().expect("record");
    assert_eq!(rec.token(), fresh);
}

/// Without takeover (`on_lease_expiry: fail`) a dead owner's record never lapses: the key stays
/// outcome-unknown until purged.
pub async fn no_takeover_records_never_expire<S: Store>(store: Arc<S>) {
    let key = unique_key("fail");
    let now = now_millis();
    assert_acquired(
        &store
            .begin(&key, &req(LeaseToken::random(), fp(1), now, false))
            .await
            .unwrap(),
    );
    let decade = now + 10 * 365 * 86_400_000;
    let b = store
        .begin(&key, &req(LeaseToken::random(), fp(1), decade, false))
        .await
        .unwrap();
    assert!(matches!(b, Begin::LeaseExpired { .. }), "{b:?}");
    assert!(store.get(&key, decade).await.unwrap().is_some());
    assert!(store.purge(&key).await.unwrap());
}

/// Renewal keeps a lease alive past its first end.
pub async fn renew_extends_lease<S: Store>(store: Arc<S>) {
    let key = unique_key("renew");
    let now = now_millis();
    let owner = LeaseToken::random();
    assert_acquired(&store.begin(&key, &req(owner, fp(1), now, true)).await.unwrap());
    store.renew(&key, owner, now + 5_000).await.unwrap();
    let b = store
        .begin(&key, &req(LeaseToken::random(), fp(1), now + 2_000, true))
        .await
        .unwrap();
    assert!(
        matches!(b, Begin::InFlight { .. }),
        "renewed lease still held: {b:?}"
    );
}

/// A renewal never shortens a lease: renewals may overlap or land late (a resent or delayed
/// call), and the owner counts on the latest one it saw succeed (`Execution::lease_held`).
pub async fn renew_never_shortens_lease<S: Store>(store: Arc<S>) {
    let key = unique_key("renew-late");
    let now = now_millis();
    let owner = LeaseToken::random();
    assert_acquired(&store.begin(&key, &req(owner, fp(1), now, true)).await.unwrap());
    store.renew(&key, owner, now + 5_000).await.unwrap();
    // An older renewal, landing after the newer one.
    store.renew(&key, owner, now + 2_000).await.unwrap();
    let b = store
        .begin(&key, &req(LeaseToken::random(), fp(1), now + 3_000, true))
        .await
        .unwrap();
    assert!(
        matches!(b, Begin::InFlight { .. }),
        "the later lease end holds: {b:?}"
    );
}

/// Release frees the key for the next attempt.
pub async fn release_frees_key<S: Store>(store: Arc<S>) {
    let key = unique_key("release");
    let now = now_millis();
    let owner = LeaseToken::random();
    assert_acquired(&store.begin(&key, &req(owner, fp(1), now, true)).await.unwrap());
    store.release(&key, owner).await.unwrap();
    assert!(store.get(&key, now).await.unwrap().is_none());
    assert_acquired(
        &store
            .begin(&key, &req(LeaseToken::random(), fp(1), now, true))
            .await
            .unwrap(),
    );
}

/// A completed record is gone after its retention.
pub async fn retention_expiry<S: Store>(store: Arc<S>) {
    let key = unique_key("retention");
    let now = now_millis();
    let owner = LeaseToken::random();
    assert_acquired(&store.begin(&key, &req(owner, fp(1), now, true)).await.unwrap());
    store
        .complete(&key, owner, &response(b"x"), 500, now)
        .await
        .unwrap();
    assert!(store.get(&key, now + 499).await.unwrap().is_some());
    assert!(store.get(&key, now + 500).await.unwrap().is_none());
    // Even another fingerprint may use the key once the record has expired.
    assert_acquired(
        &store
            .begin(&key, &req(LeaseToken::random(), fp(2), now + 501, true))
            .await
            .unwrap(),
    );
}

/// An owner whose record has expired (its retention ran out while it ran) no longer owns it: the
/// record is gone at its expiry to the millisecond, whether or not it is still stored.
pub async fn expired_records_cannot_be_completed<S: Store>(store: Arc<S>) {
    let key = unique_key("complete-expired");
    let now = now_millis();
    let owner = LeaseToken::random();
    assert_acquired(&store.begin(&key, &req(owner, fp(1), now, true)).await.unwrap());
    let expiry = store.get(&key, now).await.unwrap().expect("record").expires_at;
    let err = store
        .complete(&key, owner, &response(b"late"), 60_000, expiry)
        .await;
    assert!(
        matches!(err, Err(StoreError::Fenced(_))),
        "complete at expiry: {err:?}"
    );
    store
        .complete(&key, owner, &response(b"in time"), 500, expiry - 1)
        .await
        .unwrap();
    let rec = store.get(&key, expiry - 1).await.unwrap().expect("record");
    assert_eq!(rec.expires_at, expiry - 1 + 500);
    assert!(matches!(rec.state, RecordState::Completed { token, .. } if token == owner));
}

/// Operations retried after they took effect answer the same, never a false conflict.
pub async fn retried_operations_are_idempotent<S: Store>(store: Arc<S>) {
    let key = unique_key("retried");
    let now = now_millis();
    let owner = LeaseToken::random();
    assert_acquired(&store.begin(&key, &req(owner, fp(1), now, true)).await.unwrap());
    assert_acquired(&store.begin(&key, &req(owner, fp(1), now, true)).await.unwrap());
    store.renew(&key, owner, now + 2_000).await.unwrap();
    store.renew(&key, owner, now + 2_000).await.unwrap();
    store
        .complete(&key, owner, &response(b"once"), 60_000, now)
        .await
        .unwrap();
    store
        .complete(&key, owner, &response(b"once"), 60_000, now)
        .await
        .unwrap();

    let key = unique_key("retried-release");
    assert_acquired(&store.begin(&key, &req(owner, fp(1), now, true)).await.unwrap());
    store.release(&key, owner).await.unwrap();
    store.release(&key, owner).await.unwrap();
}

/// A 1 MiB body round-trips intact.
pub async fn large_values<S: Store>(store: Arc<S>) {
    let key = unique_key("large");
    let now = now_millis();
    let owner = LeaseToken::random();
    let body: Vec<u8> = (0..1024 * 1024).map(|i| (i % 251) as u8).collect();
    assert_acquired(&store.begin(&key, &req(owner, fp(1), now, true)).await.unwrap());
    store
        .complete(&key, owner, &response(&body), 60_000, now)
        .await
        .unwrap();
    let rec = store.get(&key, now).await.unwrap().expect("record");
    let RecordState::Completed { response: r, .. } = rec.state else {
        panic!("not completed")
    };
    assert_eq!(r.body.as_deref(), Some(body.as_slice()));
}

/// Purge removes a record whatever its state.
pub async fn purge<S: Store>(store: Arc<S>) {
    let key = unique_key("purge");
    let now = now_millis();
    assert_acquired(
        &store
            .begin(&key, &req(LeaseToken::random(), fp(1), now, false))
            .await
            .unwrap(),
    );
    assert!(store.purge(&key).await.unwrap());
    assert!(!store.purge(&key).await.unwrap());
    assert_acquired(
        &store
            .begin(&key, &req(LeaseToken::random(), fp(1), now, false))
            .await
            .unwrap(),
    );
}

/// Through the engine: waiters are woken when the owner completes (they replay) and when it
/// releases (one of them executes), well before their wait timeout.
pub async fn waiters_woken_on_complete_and_release<S: Store>(store: Arc<S>) {
    let engine = Engine::new(store);
    let policy = Policy {
        wait_timeout: Duration::from_secs(20),
        ..Policy::default()
    };
    for finish_with_release in [false, true] {
        let key = unique_key("waiters");
        let Started::Execute(owner) = engine.begin(&key, "r", fp(7), &policy).await.unwrap() else {
            panic!("first begin executes")
        };
        let waiters: Vec<_> = (0..8)
            .map(|_| {
                let (engine, key, policy) = (engine.clone(), key.clone(), policy.clone());
                tokio::spawn(async move {
                    let started = engine.begin(&key, "r", fp(7), &policy).await.unwrap();
                    match started {
                        Started::Execute(exec) => {
                            exec.finish(Outcome::Response(response(b"second"))).await.unwrap();
                            "executed"
                        }
                        Started::Replay { .. } => "replayed",
                        other => panic!("unexpected {other:?}"),
                    }
                })
            })
            .collect();
        // Let the waiters reach their wait (they are parked on the notifier, not polling).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while engine.store().notifier().watched_keys() == 0 {
            assert!(tokio::time::Instant::now() < deadline, "waiters never subscribed");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let started = tokio::time::Instant::now();
        let outcome = if finish_with_release {
            Outcome::NoResponse
        } else {
            Outcome::Response(response(b"first"))
        };
        owner.finish(outcome).await.unwrap();
        let mut results = Vec::new();
        for w in waiters {
            results.push(w.await.unwrap());
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "waiters woken by notification"
        );
        let executed = results.iter().filter(|r| **r == "executed").count();
        if finish_with_release {
            assert_eq!(
                executed, 1,
                "after a release exactly one waiter executes: {results:?}"
            );
        } else {
            assert_eq!(
                executed, 0,
                "after a completion every waiter replays: {results:?}"
            );
        }
    }
}

/// Runs the whole suite as `#[tokio::test]`s against the store built by `$make` (an async
/// expression returning `Option<Arc<S>>`; `None` skips, for backends whose server is absent).
#[macro_export]
macro_rules! store_conformance {
    ($make:expr) => {
        $crate::store_conformance!(@tests $make;
            concurrent_begin_race, concurrent_takeover_race, replay_and_mismatch, lease_expiry_takeover_and_fencing,
            no_takeover_records_never_expire, renew_extends_lease, renew_never_shortens_lease, release_frees_key, retention_expiry,
            retried_operations_are_idempotent, expired_records_cannot_be_completed, large_values, purge,
            waiters_woken_on_complete_and_release);
    };
    (@tests $make:expr; $($name:ident),*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let Some(store) = $make.await else { return };
                $crate::conformance::$name(store).await;
            }
        )*
    };
}
