//! A client that goes away while its `begin` is on its way to the store leaves no reservation
//! behind: the call runs to its end, and the key it acquired for nobody is released
//! (`begin_call.rs`). Without that, the retry of a client that disconnected mid-begin waited
//! out the whole lease, and on an `on_lease_expiry: fail` route found the outcome unknown.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::TestStore;
use idemgate_core::engine::{Concurrency, Engine, LeaseExpiry, Policy, Started};
use idemgate_core::fingerprint::Fingerprint;
use idemgate_core::record::{RecordState, now_millis};
use idemgate_core::store::Store;

#[tokio::test]
async fn a_networked_begin_dropped_mid_call_frees_the_key() {
    freed_after_a_dropped_begin(true, LeaseExpiry::Retry).await;
}

#[tokio::test]
async fn a_reservation_that_may_not_be_taken_over_is_freed_too() {
    freed_after_a_dropped_begin(false, LeaseExpiry::Fail).await;
}

/// A shutdown that waits on the engine's background tasks does not cut the release off: once
/// the wait returns, the key is free, without any request asking for it again.
#[tokio::test]
async fn a_shutdown_waits_for_the_release_of_an_abandoned_begin() {
    let store = Arc::new(TestStore {
        reply_after: Duration::from_millis(300),
        remote: true,
        ..TestStore::new()
    });
    let engine = Engine::new(store.clone());
    let policy = long_lease(LeaseExpiry::Fail);
    let first = tokio::time::timeout(
        Duration::from_millis(50),
        engine.begin("k", "r", Fingerprint([7; 32]), &policy),
    )
    .await;
    assert!(first.is_err(), "the request was dropped mid-begin");
    // What the gateway does after its last request: close, then wait (bounded).
    engine.background().close();
    tokio::time::timeout(Duration::from_secs(10), engine.background().wait())
        .await
        .expect("the background release finished");
    assert!(
        store.inner.get("k", now_millis()).await.unwrap().is_none(),
        "the key is free once the wait returns"
    );
}

fn long_lease(on_lease_expiry: LeaseExpiry) -> Policy {
    Policy {
        // Far longer than the test: only a release frees the key in time.
        lease: Duration::from_secs(60),
        concurrent: Concurrency::Reject,
        on_lease_expiry,
        ..Policy::default()
    }
}

async fn freed_after_a_dropped_begin(remote: bool, on_lease_expiry: LeaseExpiry) {
    let store = Arc::new(TestStore {
        reply_after: Duration::from_millis(300),
        remote,
        ..TestStore::new()
    });
    let engine = Engine::new(store.clone());
    let policy = long_lease(on_lease_expiry);
    let fp = Fingerprint([7; 32]);
    // The client goes away while the store's answer is still on its way.
    let first = tokio::time::timeout(Duration::from_millis(50), engine.begin("k", "r", fp, &policy)).await;
    assert!(first.is_err(), "the first request was dropped mid-begin");
    assert!(
        matches!(
            store.inner.get("k", now_millis()).await.unwrap().map(|r| r.state),
            Some(RecordState::InFlight { .. })
        ),
        "its begin took effect in the store"
    );
    // Its retry executes once the abandoned call has answered and released, long before the
    // 60 s lease would have run out.
    retry_executes(&engine, fp, &policy).await;
}

async fn retry_executes<S: Store>(engine: &Engine<S>, fp: Fingerprint, policy: &Policy) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match engine.begin("k", "r", fp, policy).await.unwrap() {
            Started::Execute(_) => break,
            Started::InFlight { .. } => {
                assert!(Instant::now() < deadline, "the key stayed reserved for nobody");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            _ => panic!("the retry neither executed nor saw the key in flight"),
        }
    }
}
