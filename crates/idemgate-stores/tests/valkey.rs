//! The Redis store on a server that takes `SET … IFEQ` (Valkey 8.1 and later, at
//! `IDEMGATE_TEST_VALKEY_URL`): `complete` and `renew` replace the value this replica last wrote
//! (its `begin` or its last renewal) without the scripts, and leave every changed record to the
//! scripts. The whole conformance suite runs here
//! as well, so both paths give the answers the other stores give (`model.rs` holds the store on
//! Valkey to the reference model too).

mod support;

use std::sync::Arc;
use std::time::Duration;

use idemgate_core::record::{Millis, RecordState, now_millis};
use idemgate_core::{Begin, BeginRequest, LeaseToken, Store, StoreError};
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
        .complete(&k, t, &response(), 60_000, now_millis())
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
        .complete(&k, t, &response(), 60_000, now_millis())
        .await
        .unwrap();
    let other = store
        .complete(&k, LeaseToken::random(), &response(), 60_000, now_millis())
        .await;
    assert!(matches!(other, Err(StoreError::Fenced(_))), "{other:?}");
    assert_eq!(
        store.completes_without_script() - swaps,
        1,
        "the rest went to the script"
    );
}

/// A record changed after this replica wrote it (marked by a waiter, or taken over after its
/// lease ran out) is not the value kept: the `SET … IFEQ` does nothing and the script decides,
/// as on a server without `IFEQ`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_record_is_left_to_the_script() {
    let (Some(a), Some(b)) = (open().await, open().await) else {
        return;
    };
    let swaps = a.completes_without_script();

    // Marked by a waiter on another replica: completed by the script, which publishes.
    let (k, t) = waited_on(&a, &b, "ifeq-waited").await;
    let trips = a.round_trips();
    a.complete(&k, t, &response(), 60_000, now_millis())
        .await
        .unwrap();
    assert_eq!(
        a.round_trips() - trips,
        2,
        "the SET found it changed, then the script"
    );
    let replay = b
        .begin(&k, &req(LeaseToken::random(), now_millis()))
        .await
        .unwrap();
    assert!(matches!(replay, Begin::Replay(_)), "{replay:?}");

    // Marked by a waiter, then renewed: the renewal's SET finds it changed and the script renews
    // it, keeping the mark; the complete then has nothing kept and goes to the script alone.
    let (k, t) = waited_on(&a, &b, "ifeq-waited-renewed").await;
    let (trips, renewals) = (a.round_trips(), a.renewals_without_script());
    a.renew(&k, t, now_millis() + 45_000).await.unwrap();
    assert_eq!(
        a.round_trips() - trips,
        2,
        "the SET found it changed, then the script"
    );
    assert_eq!(a.renewals_without_script(), renewals);
    let (raw, _) = left_by(&a, "IDEMGATE_TEST_VALKEY_URL", &k).await;
    assert_eq!(raw[2], b'1', "the waiter's mark stays through the renewal");
    let trips = a.round_trips();
    a.complete(&k, t, &response(), 60_000, now_millis())
        .await
        .unwrap();
    assert_eq!(a.round_trips() - trips, 1, "nothing kept: the script alone");
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
    let trips = a.round_trips();
    let fenced = a.complete(&k, first, &response(), 60_000, later).await;
    assert!(matches!(fenced, Err(StoreError::Fenced(_))), "{fenced:?}");
    assert_eq!(
        a.round_trips() - trips,
        2,
        "the SET found another owner, then the script"
    );
    let trips = b.round_trips();
    b.complete(&k, second, &response(), 60_000, later).await.unwrap();
    assert_eq!(b.round_trips() - trips, 1, "a takeover's own value is not kept");

    assert_eq!(
        a.completes_without_script(),
        swaps,
        "every one went to the script"
    );
}

/// A renewal of the value this replica wrote is one `SET … IFEQ` too, and keeps the renewed
/// value: renewals within the record's expiry and past it, then the `complete`, send no script.
/// A renewal that would not lengthen the lease asks the script (only it knows whether the lease
/// is lost) and leaves the kept value as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_keep_the_path() {
    let Some(store) = open().await else { return };
    let k = key("ifeq-renew");
    let t = LeaseToken::random();
    let start = now_millis();
    store.begin(&k, &req(t, start)).await.unwrap();
    let (swaps, renewals) = (store.completes_without_script(), store.renewals_without_script());
    let trips = store.round_trips();
    // The in-flight record lives 60 s (its retention); 45 s stays inside, 70 s goes past it.
    store.renew(&k, t, start + 45_000).await.unwrap();
    store.renew(&k, t, start + 70_000).await.unwrap();
    assert_eq!(store.round_trips() - trips, 2, "one SET per renewal");
    assert_eq!(store.renewals_without_script() - renewals, 2);
    let trips = store.round_trips();
    store.renew(&k, t, start + 50_000).await.unwrap();
    assert_eq!(
        store.round_trips() - trips,
        1,
        "a shorter lease goes to the script"
    );
    assert_eq!(store.renewals_without_script() - renewals, 2);
    let rec = store.get(&k, now_millis()).await.unwrap().expect("in flight");
    assert!(
        matches!(rec.state, RecordState::InFlight { token, lease_until } if token == t && lease_until == start + 70_000),
        "{rec:?}"
    );
    assert_eq!(rec.expires_at, start + 70_000, "the record outlives its lease");
    let trips = store.round_trips();
    store
        .complete(&k, t, &response(), 60_000, now_millis())
        .await
        .unwrap();
    assert_eq!(store.round_trips() - trips, 1);
    assert_eq!(
        store.completes_without_script() - swaps,
        1,
        "completed by SET IFEQ"
    );
    // Another attempt's renewal of the completed record is fenced (by the script).
    let other = store.renew(&k, LeaseToken::random(), now_millis() + 30_000).await;
    assert!(matches!(other, Err(StoreError::Fenced(_))), "{other:?}");
    store.purge(&k).await.unwrap();

    // `on_lease_expiry: fail`: the record never expires, but its lease does (the owner renews
    // it). A renewal that lengthens the lease is one `SET … KEEPTTL`, which leaves the record
    // without a physical expiry; one that does not goes to the script, as above. (Before: this
    // case renewed to "now + 30 s" from a later clock reading than the `begin`'s, so whether it
    // lengthened the lease depended on the millisecond, and the test failed one run in four.)
    let k = key("ifeq-renew-forever");
    let t = LeaseToken::random();
    let start = now_millis();
    let forever = BeginRequest {
        takeover: false,
        ..req(t, start)
    };
    store.begin(&k, &forever).await.unwrap();
    let (swaps, renewals) = (store.completes_without_script(), store.renewals_without_script());
    store.renew(&k, t, start + 45_000).await.unwrap();
    assert_eq!(store.renewals_without_script() - renewals, 1);
    store.renew(&k, t, start + 30_000).await.unwrap();
    assert_eq!(
        store.renewals_without_script() - renewals,
        1,
        "a shorter lease goes to the script"
    );
    let rec = store.get(&k, now_millis()).await.unwrap().expect("in flight");
    assert!(
        matches!(rec.state, RecordState::InFlight { lease_until, .. } if lease_until == start + 45_000),
        "{rec:?}"
    );
    assert_eq!(rec.expires_at, Millis::MAX, "still never expires");
    let (_, expiry) = left_by(&store, "IDEMGATE_TEST_VALKEY_URL", &k).await;
    assert_eq!(expiry, -1, "no physical expiry either");
    store
        .complete(&k, t, &response(), 60_000, now_millis())
        .await
        .unwrap();
    assert_eq!(store.completes_without_script() - swaps, 1);
    store.purge(&k).await.unwrap();
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
    let trips = store.round_trips();
    // The record lives max(lease, retention) = 60 s; past that, the owner is fenced.
    let late = store.complete(&k, t, &response(), 60_000, start + 61_000).await;
    assert!(matches!(late, Err(StoreError::Fenced(_))), "{late:?}");
    assert_eq!(
        store.round_trips() - trips,
        1,
        "no SET is sent for an expired record"
    );
    // Nothing was written: at the owner's clock the record is still in flight.
    let rec = store.get(&k, now_millis()).await.unwrap().expect("still there");
    assert!(matches!(rec.state, RecordState::InFlight { .. }));
    tokio::time::timeout(Duration::from_secs(5), store.purge(&k))
        .await
        .unwrap()
        .unwrap();
}

/// The record a `complete` or a `renew` by `SET … IFEQ` leaves is the script's, byte for byte
/// and with the same physical expiry: the same calls (same token, same clock) on the machine's
/// Redis (7.0 in CI, which refuses `IFEQ` and runs the scripts) and on Valkey leave equal values
/// and equal `PEXPIRETIME`s after every step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_record_left_is_the_scripts_byte_for_byte() {
    let (Some(valkey), Some(redis)) = (open().await, support::redis_store("IDEMGATE_TEST_REDIS_URL")) else {
        return;
    };
    let swaps = valkey.completes_without_script();
    let trips = valkey.round_trips();
    // After each step, the two servers hold the same value with the same physical expiry: after
    // the begin, a renewal inside the record's expiry (`KEEPTTL`), one past it (`PXAT`, the
    // expiry moves with the lease), and the complete. Without takeover (`on_lease_expiry:
    // fail`) the record has no expiry until it completes, and no renewal passes it.
    let steps = ["begin", "renew within", "renew past", "complete"];
    for takeover in [true, false] {
        let k = key("ifeq-bytes");
        let t = LeaseToken::random();
        let now = now_millis();
        let begin = BeginRequest {
            takeover,
            ..req(t, now)
        };
        for step in steps {
            for store in [&valkey, &redis] {
                match step {
                    "begin" => drop(store.begin(&k, &begin).await.unwrap()),
                    "renew within" => store.renew(&k, t, now + 45_000).await.unwrap(),
                    "renew past" => store.renew(&k, t, now + 70_000).await.unwrap(),
                    _ => store.complete(&k, t, &response(), 60_000, now + 5).await.unwrap(),
                }
            }
            let valkey_left = left_by(&valkey, "IDEMGATE_TEST_VALKEY_URL", &k).await;
            let redis_left = left_by(&redis, "IDEMGATE_TEST_REDIS_URL", &k).await;
            assert_eq!(valkey_left, redis_left, "after {step}, takeover {takeover}");
            let expires = takeover || step == "complete";
            assert_eq!(
                valkey_left.1 > 0,
                expires,
                "expiry after {step}, takeover {takeover}: {}",
                valkey_left.1
            );
        }
        for store in [&valkey, &redis] {
            store.purge(&k).await.unwrap();
        }
    }
    assert_eq!(
        valkey.round_trips() - trips,
        8 + 2,
        "one command per step on Valkey, and the purges"
    );
    assert_eq!(valkey.completes_without_script() - swaps, 2);
    assert_eq!(valkey.renewals_without_script(), 4);
    assert_eq!(
        (redis.completes_without_script(), redis.renewals_without_script()),
        (0, 0),
        "the server at IDEMGATE_TEST_REDIS_URL ran the scripts"
    );
}

/// A key `a` took (its key and token), which a `begin` on `b` found in flight and so marked as
/// waited on: the record is no longer the value `a` wrote.
async fn waited_on(a: &RedisStore, b: &RedisStore, name: &str) -> (String, LeaseToken) {
    let k = key(name);
    let t = LeaseToken::random();
    a.begin(&k, &req(t, now_millis())).await.unwrap();
    let waiting = b
        .begin(&k, &req(LeaseToken::random(), now_millis()))
        .await
        .unwrap();
    assert!(matches!(waiting, Begin::InFlight { .. }), "{waiting:?}");
    (k, t)
}

/// The raw value of `k` on the server at `$var` and its `PEXPIRETIME`.
async fn left_by(store: &RedisStore, var: &str, k: &str) -> (Vec<u8>, i64) {
    let client = redis::Client::open(std::env::var(var).unwrap()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let name = store.record_key(k);
    let value: Vec<u8> = redis::cmd("GET").arg(&name).query_async(&mut conn).await.unwrap();
    let expiry: i64 = redis::cmd("PEXPIRETIME")
        .arg(&name)
        .query_async(&mut conn)
        .await
        .unwrap();
    (value, expiry)
}

/// A refusal with a specific code (`OOM`: a full server under `noeviction`) hands that `complete`
/// to the script, which answers the same refusal; the path stays on, so once the server takes
/// writes again a new miss completes without the script. (Only the generic `ERR`, which a server
/// without `IFEQ` answers, turns it off.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_write_leaves_the_path_on() {
    let Some(server) = support::RedisServer::start_valkey().await else {
        return;
    };
    let store = RedisStore::new(&idemgate_stores::RedisConfig::new(server.url())).unwrap();
    let (k, t) = (key("ifeq-oom"), LeaseToken::random());
    store.begin(&k, &req(t, now_millis())).await.unwrap();
    server
        .command(&["CONFIG", "SET", "maxmemory-policy", "noeviction"])
        .await;
    server.command(&["CONFIG", "SET", "maxmemory", "1"]).await;
    let trips = store.round_trips();
    let refused = store.complete(&k, t, &response(), 60_000, now_millis()).await;
    assert!(matches!(refused, Err(StoreError::Backend(_))), "{refused:?}");
    assert_eq!(
        store.round_trips() - trips,
        2,
        "the SET, refused, then the script, refused"
    );
    server.command(&["CONFIG", "SET", "maxmemory", "0"]).await;
    store
        .complete(&k, t, &response(), 60_000, now_millis())
        .await
        .unwrap();

    let swaps = store.completes_without_script();
    let (k, t) = (key("ifeq-after-oom"), LeaseToken::random());
    store.begin(&k, &req(t, now_millis())).await.unwrap();
    store
        .complete(&k, t, &response(), 60_000, now_millis())
        .await
        .unwrap();
    assert_eq!(
        store.completes_without_script() - swaps,
        1,
        "the path is still on"
    );
}
