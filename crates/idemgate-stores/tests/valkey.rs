//! The Redis store on a server that takes `SET … IFEQ` (Valkey 8.1 and later, at
//! `IDEMGATE_TEST_VALKEY_URL`): `complete` replaces the value its own `begin` wrote without the
//! script, and leaves every changed record to the script. The whole conformance suite runs here
//! as well, so both paths give the answers the other stores give (`model.rs` holds the store on
//! Valkey to the reference model too).

mod support;

use std::sync::Arc;
use std::time::Duration;

use idemgate_core::record::{RecordState, now_millis};
use idemgate_core::{Begin, LeaseToken, Store, StoreError};
use idemgate_stores::RedisStore;

use support::{key, req, response};

async fn open() -> Option<Arc<RedisStore>> {
    support::redis_store("IDEMGATE_TEST_VALKEY_URL")
}

idemgate_stores::store_conformance!(open());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_handles_act_as_two_replicas() {
    let (Some(a), Some(b)) = (open().await, open().await) else {
        return;
    };
    support::two_handles_race_and_wake(a, b).await;
}

/// A miss is `SET NX GET` and one `SET … IFEQ`: two round trips, no script, and the record it
/// leaves is the one the script would have written (a retry replays it, a repeated `complete`
/// is acknowledged, another attempt's is fenced).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_miss_completes_without_the_script() {
    let Some(store) = open().await else { return };
    let (trips, swaps) = (store.round_trips(), store.completes_without_script());
    let k = key("ifeq-miss");
    let t = LeaseToken::random();
    let begun = store.begin(&k, &req(t, now_millis())).await.unwrap();
    assert!(matches!(begun, Begin::Acquired { .. }), "{begun:?}");
    store
        .complete(&k, t, response(), 60_000, now_millis())
        .await
        .unwrap();
    assert_eq!(store.completes_without_script() - swaps, 1);
    assert_eq!(store.round_trips() - trips, 2);

    let Begin::Replay(rec) = store
        .begin(&k, &req(LeaseToken::random(), now_millis()))
        .await
        .unwrap()
    else {
        panic!("a completed key replays")
    };
    assert!(
        matches!(&rec.state, RecordState::Completed { token, response: r } if *token == t && *r == response())
    );
    let expected = now_millis() + 60_000;
    assert!(
        rec.expires_at <= expected && rec.expires_at + 5_000 > expected,
        "{}",
        rec.expires_at
    );

    store
        .complete(&k, t, response(), 60_000, now_millis())
        .await
        .unwrap();
    let other = store
        .complete(&k, LeaseToken::random(), response(), 60_000, now_millis())
        .await;
    assert!(matches!(other, Err(StoreError::Fenced(_))), "{other:?}");
    assert_eq!(
        store.completes_without_script() - swaps,
        1,
        "the rest went to the script"
    );
}

/// A record changed after its `begin` (marked by a waiter, renewed, or taken over after its
/// lease ran out) is not the value this replica wrote: the `SET … IFEQ` does nothing and the
/// script decides, as on a server without `IFEQ`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_record_is_left_to_the_script() {
    let (Some(a), Some(b)) = (open().await, open().await) else {
        return;
    };
    let swaps = a.completes_without_script();

    // Marked by a waiter on another replica: completed by the script, which publishes.
    let k = key("ifeq-waited");
    let t = LeaseToken::random();
    a.begin(&k, &req(t, now_millis())).await.unwrap();
    let waiting = b
        .begin(&k, &req(LeaseToken::random(), now_millis()))
        .await
        .unwrap();
    assert!(matches!(waiting, Begin::InFlight { .. }), "{waiting:?}");
    a.complete(&k, t, response(), 60_000, now_millis()).await.unwrap();
    let replay = b
        .begin(&k, &req(LeaseToken::random(), now_millis()))
        .await
        .unwrap();
    assert!(matches!(replay, Begin::Replay(_)), "{replay:?}");

    // Renewed: completed by the script.
    let k = key("ifeq-renewed");
    let t = LeaseToken::random();
    a.begin(&k, &req(t, now_millis())).await.unwrap();
    a.renew(&k, t, now_millis() + 45_000).await.unwrap();
    a.complete(&k, t, response(), 60_000, now_millis()).await.unwrap();
    assert!(
        matches!(a.get(&k, now_millis()).await.unwrap(), Some(r) if matches!(r.state, RecordState::Completed { .. }))
    );

    // Taken over once the lease ran out: the first owner is fenced, the new one completes.
    let k = key("ifeq-taken");
    let (first, second) = (LeaseToken::random(), LeaseToken::random());
    let start = now_millis();
    a.begin(&k, &req(first, start)).await.unwrap();
    let later = start + 31_000;
    let taken = b.begin(&k, &req(second, later)).await.unwrap();
    assert!(
        matches!(taken, Begin::Acquired { took_over: true, .. }),
        "{taken:?}"
    );
    let fenced = a.complete(&k, first, response(), 60_000, later).await;
    assert!(matches!(fenced, Err(StoreError::Fenced(_))), "{fenced:?}");
    b.complete(&k, second, response(), 60_000, later).await.unwrap();

    assert_eq!(
        a.completes_without_script(),
        swaps,
        "every one went to the script"
    );
}

/// A record whose lease has run out is fenced even when nobody took it over: the `IFEQ` path
/// checks the expiry the script checks, against the caller's clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_record_is_fenced_without_a_write() {
    let Some(store) = open().await else { return };
    let k = key("ifeq-expired");
    let t = LeaseToken::random();
    let start = now_millis();
    store.begin(&k, &req(t, start)).await.unwrap();
    // The record lives max(lease, retention) = 60 s; past that, the owner is fenced.
    let late = store.complete(&k, t, response(), 60_000, start + 61_000).await;
    assert!(matches!(late, Err(StoreError::Fenced(_))), "{late:?}");
    // Nothing was written: at the owner's clock the record is still in flight.
    let rec = store.get(&k, now_millis()).await.unwrap().expect("still there");
    assert!(matches!(rec.state, RecordState::InFlight { .. }));
    tokio::time::timeout(Duration::from_secs(5), store.purge(&k))
        .await
        .unwrap()
        .unwrap();
}
