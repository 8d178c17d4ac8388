//! Helpers for the shared-store tests: the Redis store on a shared server, the checks that need
//! two handles on one backend, and (from `idemgate-testkit`) a redis-server of the test's own,
//! for faults that must not touch the shared server.

#![allow(dead_code)] // each test binary uses a different subset

use std::sync::Arc;
use std::time::Duration;

use idemgate_core::engine::{Engine, Outcome, Policy, Started};
use idemgate_core::record::{LeaseToken, StoredResponse, now_millis};
use idemgate_core::rules::{Begin, BeginRequest};
use idemgate_core::{Fingerprint, Store};
use tokio::time::Instant;

/// The Redis store on the shared server whose URL is in `var`, or `None` (and a message) when
/// it is not set.
pub fn redis_store(var: &str) -> Option<Arc<idemgate_stores::RedisStore>> {
    let Ok(url) = std::env::var(var) else {
        println!("skipped: {var} not set");
        return None;
    };
    let config = idemgate_stores::RedisConfig::new(url);
    Some(Arc::new(
        idemgate_stores::RedisStore::new(&config).expect("redis store"),
    ))
}

#[allow(unused_imports)] // each test binary uses a different subset, as `dead_code` above
pub use idemgate_testkit::RedisServer;

pub fn fp(n: u8) -> Fingerprint {
    Fingerprint([n; 32])
}

pub fn req<'a>(token: LeaseToken, now: u64) -> BeginRequest<'a> {
    BeginRequest {
        fingerprint: fp(1),
        route: "r",
        token,
        operation_id: "op_shared",
        lease_ms: 30_000,
        retention_ms: 60_000,
        takeover: true,
        now,
    }
}

pub fn response() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![],
        body: Some(b"done".to_vec().into()),
    }
}

pub fn key(name: &str) -> String {
    idemgate_stores::conformance::unique_key(name)
}

/// Retries `op` until it succeeds, failing after `limit`.
pub async fn eventually<T, E: std::fmt::Debug, F: std::future::Future<Output = Result<T, E>>>(
    limit: Duration,
    mut op: impl FnMut() -> F,
) -> T {
    let deadline = Instant::now() + limit;
    loop {
        match op().await {
            Ok(v) => return v,
            Err(e) => assert!(Instant::now() < deadline, "still failing after {limit:?}: {e:?}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Two handles on one backend (two replicas): concurrent begins on both acquire once, and a
/// waiter on `b` is woken by `a`'s completion through the backend's channel, long before the
/// owner's 30 s lease would have woken it.
pub async fn two_handles_race_and_wake<S: Store>(a: Arc<S>, b: Arc<S>) {
    let k = key("two-handles");
    let now = now_millis();
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let (s, k) = (if i % 2 == 0 { a.clone() } else { b.clone() }, k.clone());
            tokio::spawn(async move { s.begin(&k, &req(LeaseToken::random(), now)).await.unwrap() })
        })
        .collect();
    let mut acquired = 0;
    for t in tasks {
        if matches!(t.await.unwrap(), Begin::Acquired { .. }) {
            acquired += 1;
        }
    }
    assert_eq!(acquired, 1, "exactly one begin acquires across both handles");
    waiter_woken_across(a.clone(), b.clone(), Duration::from_secs(5)).await;
    release_wakes_across(a, b, Duration::from_secs(5)).await;
}

/// An owner on `a` releases (a transient outcome): the waiters on `b` are woken and exactly one
/// of them executes, within `limit` (the owner's lease is 30 s).
pub async fn release_wakes_across<S: Store>(a: Arc<S>, b: Arc<S>, limit: Duration) {
    let policy = Policy {
        lease: Duration::from_secs(30),
        wait_timeout: Duration::from_secs(25),
        ..Policy::default()
    };
    let (ea, eb) = (Engine::new(a), Engine::new(b));
    let k = key("release-across");
    let Started::Execute(owner) = ea.begin(&k, "r", fp(4), &policy).await.unwrap() else {
        panic!("first begin executes")
    };
    let waiters: Vec<_> = (0..4)
        .map(|_| {
            let (eb, k, policy) = (eb.clone(), k.clone(), policy.clone());
            tokio::spawn(async move {
                match eb.begin(&k, "r", fp(4), &policy).await.unwrap() {
                    Started::Execute(exec) => {
                        exec.finish(Outcome::Response(response())).await.unwrap();
                        true
                    }
                    Started::Replay { .. } => false,
                    other => panic!("unexpected {other:?}"),
                }
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(5);
    while eb.store().notifier().watched_keys() == 0 {
        assert!(Instant::now() < deadline, "the waiters never subscribed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    owner.finish(Outcome::NoResponse).await.unwrap();
    let mut executed = 0;
    for w in waiters {
        if tokio::time::timeout(limit, w)
            .await
            .expect("waiter woken")
            .unwrap()
        {
            executed += 1;
        }
    }
    assert_eq!(executed, 1, "after a release exactly one waiter executes");
    assert!(started.elapsed() < limit);
}

/// An owner on `a`, a waiter on `b`: `a`'s completion wakes `b`'s waiter within `limit`.
pub async fn waiter_woken_across<S: Store>(a: Arc<S>, b: Arc<S>, limit: Duration) {
    waiter_woken_across_with(a, b, limit, async || {}).await;
}

/// [`waiter_woken_across`], running `before_finish` once the waiter waits and just before the
/// owner completes (to lose the notification, for instance).
pub async fn waiter_woken_across_with<S: Store>(
    a: Arc<S>,
    b: Arc<S>,
    limit: Duration,
    before_finish: impl AsyncFnOnce(),
) {
    let policy = Policy {
        lease: Duration::from_secs(30),
        wait_timeout: Duration::from_secs(25),
        ..Policy::default()
    };
    let (ea, eb) = (Engine::new(a), Engine::new(b));
    let k = key("wake-across");
    let Started::Execute(owner) = ea.begin(&k, "r", fp(3), &policy).await.unwrap() else {
        panic!("first begin executes")
    };
    let waiter = {
        let (eb, k, policy) = (eb.clone(), k.clone(), policy.clone());
        tokio::spawn(async move { eb.begin(&k, "r", fp(3), &policy).await.unwrap() })
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while eb.store().notifier().watched_keys() == 0 {
        assert!(Instant::now() < deadline, "the waiter never subscribed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The waiter has subscribed; give its re-check (which flags the record) time to land.
    tokio::time::sleep(Duration::from_millis(100)).await;
    before_finish().await;
    let started = Instant::now();
    owner.finish(Outcome::Response(response())).await.unwrap();
    let woken = tokio::time::timeout(limit, waiter)
        .await
        .expect("waiter woken by notification");
    assert!(
        matches!(woken.unwrap(), Started::Replay { .. }),
        "the waiter replays"
    );
    assert!(started.elapsed() < limit);
}
