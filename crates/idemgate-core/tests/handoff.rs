//! Waiters on the process that ran the operation answer from the owner's handed-over outcome:
//! they wait on the key's lead (`lead.rs`) and never read the store.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::TestStore;
use idemgate_core::engine::{Engine, Outcome, Policy, Started};
use idemgate_core::fingerprint::Fingerprint;
use idemgate_core::record::StoredResponse;
use idemgate_core::store::Store;

fn response(body: &'static str) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![("content-type".into(), Bytes::from_static(b"application/json"))],
        body: Some(Bytes::from_static(body.as_bytes())),
    }
}

#[tokio::test]
async fn local_waiters_take_the_outcome_without_reading_the_store() {
    storm(false, false).await;
}

/// On a networked store as on a local one: the same request waits for this process's lead.
#[tokio::test]
async fn waiters_on_a_remote_store_ask_once() {
    storm(true, false).await;
}

/// A store's own wake-up that comes before the hand-off does not send the waiters to the store:
/// while the same request still leads the key, they wait on.
#[tokio::test]
async fn a_store_wake_up_before_the_hand_off_does_not_send_waiters_to_the_store() {
    storm(false, true).await;
    storm(true, true).await;
}

async fn storm(remote: bool, early_wake: bool) {
    const WAITERS: usize = 50;
    let store = Arc::new(TestStore {
        remote,
        early_wake,
        ..TestStore::new()
    });
    let engine = Engine::new(store.clone());
    let (same, other) = (Fingerprint([1; 32]), Fingerprint([2; 32]));
    let policy = Policy::default();
    let Started::Execute(exec) = engine.begin("k", "r", same, &policy).await.unwrap() else {
        panic!("the first request executes");
    };
    let operation_id = exec.operation_id().to_owned();
    // Waiters for the same request; a request with another body or for another route is refused
    // at once (it never waits).
    let mut waiters = Vec::new();
    for i in 0..WAITERS + 2 {
        let (engine, policy) = (engine.clone(), policy.clone());
        let (fp, route) = match i {
            0 => (other, "r"),
            1 => (same, "other-route"),
            _ => (same, "r"),
        };
        waiters.push(tokio::spawn(async move {
            engine.begin("k", route, fp, &policy).await
        }));
    }
    // The same request waits on this process's lead and never asks the store; another body or
    // route asks it and is refused at once.
    let asked = 1 + 2;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while store.begins.load(Ordering::SeqCst) < asked || store.notifier().subscribers("k") < WAITERS {
        assert!(
            tokio::time::Instant::now() < deadline,
            "waiters never went to sleep"
        );
        tokio::task::yield_now().await;
    }
    exec.finish(Outcome::Response(response(r#"{"id":"ord_1"}"#)))
        .await
        .unwrap();
    for (i, w) in waiters.into_iter().enumerate() {
        match (i, w.await.unwrap().unwrap()) {
            (0 | 1, Started::Mismatch { operation_id: op }) => assert_eq!(op, operation_id),
            (
                2..,
                Started::Replay {
                    response: r,
                    operation_id: op,
                    ..
                },
            ) => {
                assert_eq!(op, operation_id);
                assert_eq!(r, response(r#"{"id":"ord_1"}"#));
            }
            (i, other) => panic!("waiter {i}: {other:?}"),
        }
    }
    assert_eq!(
        store.begins.load(Ordering::SeqCst),
        asked,
        "a woken waiter read the store"
    );
    // A later request reads the store as usual and gets the same answer.
    let Started::Replay { operation_id: op, .. } = engine.begin("k", "r", same, &policy).await.unwrap()
    else {
        panic!("replay");
    };
    assert_eq!(op, operation_id);
}

/// Waits until `n` requests subscribed to `k` (they are asleep on the lead).
async fn asleep(store: &TestStore, n: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while store.notifier().subscribers("k") < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "waiters never went to sleep"
        );
        tokio::task::yield_now().await;
    }
}

fn counting() -> Arc<TestStore> {
    Arc::new(TestStore::new())
}

/// A released key wakes the waiters of the lead: exactly one of them executes, the others take
/// its outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_release_one_waiter_takes_over_and_the_rest_replay_it() {
    const WAITERS: usize = 20;
    let store = counting();
    let engine = Engine::new(store.clone());
    let (fp, policy) = (Fingerprint([1; 32]), Policy::default());
    let Started::Execute(first) = engine.begin("k", "r", fp, &policy).await.unwrap() else {
        panic!("the first request executes");
    };
    let executions = Arc::new(AtomicUsize::new(0));
    let waiters: Vec<_> = (0..WAITERS)
        .map(|_| {
            let (engine, policy, executions) = (engine.clone(), policy.clone(), executions.clone());
            tokio::spawn(async move {
                match engine.begin("k", "r", fp, &policy).await.unwrap() {
                    Started::Execute(exec) => {
                        executions.fetch_add(1, Ordering::SeqCst);
                        exec.finish(Outcome::Response(response("{}"))).await.unwrap();
                        "executed"
                    }
                    Started::Replay { .. } => "replayed",
                    other => panic!("{other:?}"),
                }
            })
        })
        .collect();
    asleep(&store, WAITERS).await;
    first.finish(Outcome::NoResponse).await.unwrap();
    let mut replayed = 0;
    for w in waiters {
        replayed += usize::from(w.await.unwrap() == "replayed");
    }
    assert_eq!(executions.load(Ordering::SeqCst), 1, "one waiter took over");
    assert_eq!(replayed, WAITERS - 1);
}

/// An execution dropped without an outcome (its outcome is unknown) gives the lead up: the
/// waiters ask the store, find the key still in flight, and answer at their deadline instead of
/// hanging.
#[tokio::test]
async fn a_dropped_execution_does_not_hang_its_waiters() {
    let store = counting();
    let engine = Engine::new(store.clone());
    let fp = Fingerprint([1; 32]);
    let policy = Policy {
        wait_timeout: Duration::from_millis(300),
        ..Policy::default()
    };
    let Started::Execute(first) = engine.begin("k", "r", fp, &policy).await.unwrap() else {
        panic!("the first request executes");
    };
    let waiter = {
        let (engine, policy) = (engine.clone(), policy.clone());
        tokio::spawn(async move { engine.begin("k", "r", fp, &policy).await })
    };
    asleep(&store, 1).await;
    drop(first);
    let answer = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the waiter answers")
        .unwrap()
        .unwrap();
    assert!(matches!(answer, Started::InFlight { .. }), "{answer:?}");
    assert!(
        store.begins.load(Ordering::SeqCst) >= 2,
        "the waiter asked the store"
    );
}

/// The outcome handed to waiters stays with the key while it has subscribers, which a hot key
/// may always have: it must not share the buffer the owner's response was read into (the
/// gateway hands over the upstream body as a view into its read buffer).
#[tokio::test]
async fn the_handed_over_outcome_does_not_share_the_owner_s_buffer() {
    let store = counting();
    let engine = Engine::new(store.clone());
    let (fp, policy) = (Fingerprint([1; 32]), Policy::default());
    let Started::Execute(exec) = engine.begin("k", "r", fp, &policy).await.unwrap() else {
        panic!("the first request executes");
    };
    let waiter = tokio::spawn({
        let (engine, policy) = (engine.clone(), policy.clone());
        async move { engine.begin("k", "r", fp, &policy).await }
    });
    asleep(&store, 1).await;
    let buffer = Bytes::from(vec![7u8; 64 * 1024]);
    let owned = StoredResponse {
        status: 201,
        headers: vec![("etag".into(), buffer.slice(0..4))],
        body: Some(buffer.slice(100..124)),
    };
    exec.finish(Outcome::Response(owned.clone())).await.unwrap();
    let Started::Replay { response, .. } = waiter.await.unwrap().unwrap() else {
        panic!("the waiter replays");
    };
    assert_eq!(response, owned);
    let inside = |b: &Bytes| buffer.as_ptr_range().contains(&b.as_ptr());
    assert!(
        !inside(response.body.as_ref().unwrap()),
        "the body shares the owner's buffer"
    );
    assert!(
        !inside(&response.headers[0].1),
        "a header shares the owner's buffer"
    );
}
