//! The completed records lately read ([`super::recent`]): what enters, and that a purge or an
//! expiry is never hidden by them.

use super::tests::{open, req};
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
        .complete(key, token, response(body), retention_ms, now)
        .await
        .unwrap();
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
    let first = replayed(store.begin("k", &req(LeaseToken::random(), 10)).await);
    assert!(store.recent.holds("k"));
    let second = replayed(store.begin("k", &req(LeaseToken::random(), 20)).await);
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
    assert!(matches!(
        store.begin("k", &req(LeaseToken::random(), 10)).await,
        Ok(Begin::InFlight { .. })
    ));
    assert!(!store.recent.holds("k"));
}

#[tokio::test]
async fn a_purged_key_runs_again() {
    let (_dir, store) = open();
    completed(&store, "k", b"one", 0, 5_000).await;
    replayed(store.begin("k", &req(LeaseToken::random(), 10)).await);
    assert!(store.recent.holds("k"));
    assert!(store.purge("k").await.unwrap());
    assert!(!store.recent.holds("k"));
    assert!(matches!(
        store.begin("k", &req(LeaseToken::random(), 20)).await,
        Ok(Begin::Acquired { .. })
    ));
}

#[tokio::test]
async fn an_expired_record_is_read_again_after_a_new_owner_completed() {
    let (_dir, store) = open();
    completed(&store, "k", b"old", 0, 1_000).await;
    replayed(store.begin("k", &req(LeaseToken::random(), 500)).await);
    assert!(store.recent.holds("k"));
    // Past its retention the key is free; the new owner's outcome replaces it in redb.
    completed(&store, "k", b"new", 2_000, 5_000).await;
    assert_eq!(
        replayed(store.begin("k", &req(LeaseToken::random(), 2_100)).await),
        response(b"new")
    );
    assert_eq!(
        replayed(store.begin("k", &req(LeaseToken::random(), 2_200)).await),
        response(b"new")
    );
}

/// Replays race purges on two worker threads: once a purge has answered and the replays that
/// started before it are done, no stale record is kept and the key runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purges_racing_replays_leave_nothing_stale() {
    let (_dir, store) = open();
    for round in 0..200 {
        let key = format!("k{round}");
        completed(&store, &key, b"one", 0, 60_000).await;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (store, key, stop) = (store.clone(), key.clone(), stop.clone());
                tokio::spawn(async move {
                    let mut replays = 0;
                    while !stop.load(Ordering::SeqCst) {
                        match store.begin(&key, &req(LeaseToken::random(), 10)).await {
                            Ok(Begin::Replay(_)) => replays += 1,
                            // The purge took effect; this reader's work is done.
                            Ok(Begin::Acquired { .. } | Begin::InFlight { .. }) => break,
                            other => panic!("{other:?}"),
                        }
                        tokio::task::yield_now().await;
                    }
                    replays
                })
            })
            .collect();
        tokio::task::yield_now().await;
        assert!(store.purge(&key).await.unwrap());
        stop.store(true, Ordering::SeqCst);
        for reader in readers {
            reader.await.unwrap();
        }
        assert!(!store.recent.holds(&key), "round {round}: a purged record stayed");
        assert!(
            !matches!(
                store.begin(&key, &req(LeaseToken::random(), 20)).await,
                Ok(Begin::Replay(_))
            ),
            "round {round}: a purged key replayed"
        );
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

/// The interleaving the store-level race above rarely hits: a reader read the record from a
/// snapshot before the purge, and offers it only after the purge removed the key.
#[test]
fn a_record_read_before_a_purge_and_offered_after_it_is_not_kept() {
    let recent = recent::Recent::default();
    let before = recent.before_read();
    recent.purged("k");
    recent.offer("k", &record(b"purged".to_vec()), 0, before);
    assert!(!recent.holds("k"));
    // Read after the purge counted itself, a record is kept.
    let after = recent.before_read();
    recent.offer("k", &record(b"new".to_vec()), 0, after);
    assert!(recent.holds("k"));
}

#[test]
fn the_bound_is_by_bytes() {
    let recent = recent::Recent::default();
    let big = record(vec![0; 1 << 20]);
    for i in 0..64 {
        let before = recent.before_read();
        recent.offer(&format!("k{i}"), &big, 0, before);
    }
    let kept = (0..64).filter(|i| recent.holds(&format!("k{i}"))).count();
    let bound = (recent::CAPACITY_BYTES >> 20) as usize;
    assert!(
        kept > 0 && kept <= bound,
        "kept {kept} records of 1 MiB under a {bound} MiB bound"
    );
}
