//! The completed records lately read ([`super::recent`]): what enters, and that no purge, sweep,
//! expiry or replacement is ever hidden by them.

use super::tests::{open, open_skipping_publish, req, wait_until};
use super::*;
use idemgate_core::RecordState;

fn response(body: &'static [u8]) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), "application/json".into())],
        body: Some(body.into()),
    }
}

async fn completed(store: &EmbeddedStore, key: &str, body: &'static [u8], now: Millis, retention_ms: u64) {
    let token = LeaseToken::random();
    assert!(matches!(
        store.begin(key, &req(token, now)).await,
        Ok(Begin::Acquired { .. })
    ));
    store
        .complete(key, token, &response(body), retention_ms, now)
        .await
        .unwrap();
}

/// `begin`, failing instead of hanging if it never answers.
async fn begin(store: &EmbeddedStore, key: &str, now: Millis) -> Result<Begin, StoreError> {
    tokio::time::timeout(
        Duration::from_secs(10),
        store.begin(key, &req(LeaseToken::random(), now)),
    )
    .await
    .expect("begin answers")
}

fn replayed(answer: Result<Begin, StoreError>) -> StoredResponse {
    match answer {
        Ok(Begin::Replay(rec)) => match rec.state {
            RecordState::Completed { response, .. } => response,
            RecordState::InFlight { .. } => panic!("replayed an in-flight record"),
        },
        other => panic!("expected a replay: {other:?}"),
    }
}

#[tokio::test]
async fn a_replay_read_from_redb_is_kept_and_the_next_one_matches_it() {
    let (_dir, store) = open();
    completed(&store, "k", b"one", 0, 5_000).await;
    assert!(!store.recent.holds("k"), "a miss keeps nothing");
    let first = replayed(begin(&store, "k", 10).await);
    assert!(store.recent.holds("k"));
    let second = replayed(begin(&store, "k", 20).await);
    assert_eq!(first, response(b"one"));
    assert_eq!(second, first);
    // `get` reads through the same records.
    let got = store.get("k", 30).await.unwrap().unwrap();
    assert!(matches!(got.state, RecordState::Completed { response, .. } if response == first));
}

#[tokio::test]
async fn in_flight_records_are_not_kept() {
    let (_dir, store) = open();
    // Durable in redb (`on_lease_expiry: fail`), so later begins read it from the snapshot.
    let mut durable = req(LeaseToken::random(), 0);
    durable.takeover = false;
    assert!(matches!(
        store.begin("k", &durable).await,
        Ok(Begin::Acquired { .. })
    ));
    assert!(matches!(begin(&store, "k", 10).await, Ok(Begin::InFlight { .. })));
    assert!(!store.recent.holds("k"));
}

#[tokio::test]
async fn a_purged_key_runs_again() {
    let (_dir, store) = open();
    completed(&store, "k", b"one", 0, 5_000).await;
    replayed(begin(&store, "k", 10).await);
    assert!(store.recent.holds("k"));
    assert!(store.purge("k").await.unwrap());
    assert!(!store.recent.holds("k"));
    // The key runs again, and its new outcome is kept once read: the purge did not turn the
    // cache off.
    let owner = LeaseToken::random();
    assert!(matches!(
        store.begin("k", &req(owner, 20)).await,
        Ok(Begin::Acquired { .. })
    ));
    store
        .complete("k", owner, &response(b"two"), 5_000, 20)
        .await
        .unwrap();
    assert_eq!(replayed(begin(&store, "k", 30).await), response(b"two"));
    assert!(store.recent.holds("k"));
}

#[tokio::test]
async fn an_expired_record_is_read_again_after_a_new_owner_completed() {
    let (_dir, store) = open();
    completed(&store, "k", b"old", 0, 1_000).await;
    replayed(begin(&store, "k", 500).await);
    assert!(store.recent.holds("k"));
    // Past its retention the key is free; the new owner's outcome replaces it in redb.
    completed(&store, "k", b"new", 2_000, 5_000).await;
    assert_eq!(replayed(begin(&store, "k", 2_100).await), response(b"new"));
    assert_eq!(replayed(begin(&store, "k", 2_200).await), response(b"new"));
    // A caller whose clock is behind the takeover's gets the new outcome too: the takeover's
    // deletion of the old record stopped what was kept of it.
    assert_eq!(replayed(begin(&store, "k", 600).await), response(b"new"));
}

/// A purge whose caller stopped waiting (its timeout, a client gone) still takes effect in
/// redb; the records kept from redb must not outlive it.
#[tokio::test]
async fn a_purge_whose_caller_stopped_waiting_is_not_hidden() {
    let (_dir, store) = open();
    completed(&store, "k", b"one", 0, 60_000).await;
    replayed(begin(&store, "k", 10).await);
    assert!(store.recent.holds("k"));
    {
        let mut purge = std::pin::pin!(store.purge("k"));
        // Polled once: the purge is sent to the writer, then its caller goes away.
        let polled = std::future::poll_fn(|cx| std::task::Poll::Ready(purge.as_mut().poll(cx))).await;
        assert!(polled.is_pending());
    }
    wait_until("the writer purged the record", || {
        store.read("k").unwrap().is_none()
    })
    .await;
    assert!(matches!(begin(&store, "k", 20).await, Ok(Begin::Acquired { .. })));
}

/// A record replaced after its expiry, read by a caller whose clock is behind the one that
/// replaced it, in the moment between the replacing commit and its snapshot (which the test
/// stretches by skipping one publish): later callers get the new record, never the old one.
#[tokio::test]
async fn a_replaced_record_is_not_kept_from_a_stale_snapshot() {
    let (_dir, store, skip) = open_skipping_publish();
    completed(&store, "k", b"old", 0, 1_000).await;
    // At 2_000 the old record is expired; a reservation that must reach redb replaces it, and
    // that commit publishes no snapshot.
    skip.store(true, Ordering::SeqCst);
    let owner = LeaseToken::random();
    let mut durable = req(owner, 2_000);
    durable.takeover = false;
    assert!(matches!(
        store.begin("k", &durable).await,
        Ok(Begin::Acquired { .. })
    ));
    // A caller whose clock says 500 reads the stale snapshot: the old record, live for it.
    replayed(begin(&store, "k", 500).await);
    assert!(
        !store.recent.holds("k"),
        "kept from a snapshot older than a replacement"
    );
    store
        .complete("k", owner, &response(b"new"), 5_000, 2_100)
        .await
        .unwrap();
    assert_eq!(replayed(begin(&store, "k", 600).await), response(b"new"));
    assert_eq!(replayed(begin(&store, "k", 2_200).await), response(b"new"));
}

#[tokio::test]
async fn a_sweep_is_not_hidden() {
    let (_dir, store) = open();
    completed(&store, "k", b"one", 0, 1_000).await;
    replayed(begin(&store, "k", 10).await);
    assert!(store.recent.holds("k"));
    assert_eq!(store.sweep(5_000).await.unwrap(), 1);
    assert!(!store.recent.holds("k"));
    // Even for a caller whose clock is far behind the sweep's.
    assert!(matches!(begin(&store, "k", 20).await, Ok(Begin::Acquired { .. })));
}

/// Replays race purges on two worker threads: no replay that started after its purge was
/// answered hands out the purged record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_replay_after_an_answered_purge() {
    let (_dir, store) = open();
    for round in 0..200 {
        let key = format!("k{round}");
        completed(&store, &key, b"one", 0, 60_000).await;
        let purged = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (store, key, purged) = (store.clone(), key.clone(), purged.clone());
                tokio::spawn(async move {
                    loop {
                        let after = purged.load(Ordering::SeqCst);
                        match begin(&store, &key, 10).await {
                            Ok(Begin::Replay(_)) => {
                                assert!(!after, "{key}: replayed after its purge was answered");
                            }
                            Ok(Begin::Acquired { .. } | Begin::InFlight { .. }) if after => return,
                            Ok(Begin::Acquired { .. } | Begin::InFlight { .. }) => {}
                            other => panic!("{other:?}"),
                        }
                        tokio::task::yield_now().await;
                    }
                })
            })
            .collect();
        tokio::task::yield_now().await;
        assert!(store.purge(&key).await.unwrap());
        purged.store(true, Ordering::SeqCst);
        for reader in readers {
            reader.await.unwrap();
        }
    }
}

fn record(body: Vec<u8>) -> Record {
    Record {
        state: RecordState::Completed {
            token: LeaseToken::random(),
            response: StoredResponse {
                status: 200,
                headers: vec![],
                body: Some(body.into()),
            },
        },
        fingerprint: idemgate_core::Fingerprint([1; 32]),
        route: "r".into(),
        operation_id: "op".into(),
        created_at: 0,
        expires_at: 10,
        generation: 1,
    }
}

/// The protocol of `removals` on its own, step by step.
#[test]
fn nothing_read_across_a_removal_answers() {
    let recent = recent::Recent::default();
    // Read before a removal, offered after it committed (the count is odd): not kept.
    let before = recent.before_read();
    recent.removing();
    recent.offer("a", &record(b"a".to_vec()), 0, before);
    assert!(!recent.holds("a"));
    // Read while the removal is between its commit and its publish: not kept either.
    let during = recent.before_read();
    recent.offer("b", &record(b"b".to_vec()), 0, during);
    assert!(!recent.holds("b"));
    recent.published();
    assert!(!recent.holds("a") && !recent.holds("b"));
    // Read after the publish: kept, until the next removal starts.
    let after = recent.before_read();
    recent.offer("c", &record(b"c".to_vec()), 0, after);
    assert!(recent.get("c", 0).is_some());
    recent.removing();
    assert!(recent.get("c", 0).is_none());
    recent.published();
    assert!(recent.get("c", 0).is_none(), "read before that removal");
    // Expired at 10.
    let fresh = recent.before_read();
    recent.offer("d", &record(b"d".to_vec()), 0, fresh);
    assert!(recent.get("d", 9).is_some());
    assert!(recent.get("d", 10).is_none());
}

#[test]
fn the_bound_is_by_bytes() {
    let recent = recent::Recent::default();
    let body = 64 << 10;
    let big = record(vec![0; body]);
    for i in 0..512 {
        recent.offer(&format!("k{i}"), &big, 0, recent.before_read());
    }
    let kept = (0..512).filter(|i| recent.holds(&format!("k{i}"))).count();
    let bound = recent::CAPACITY_BYTES as usize / body;
    assert!(
        kept > bound / 2 && kept <= bound,
        "kept {kept} records of 64 KiB under a bound of {bound}"
    );
    // One as large as `max_response_bytes`'s default fits in a shard.
    recent.offer("large", &record(vec![0; 1 << 20]), 0, recent.before_read());
    assert!(recent.holds("large"));
}
