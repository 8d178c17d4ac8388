//! Several gateway replicas on one shared store (SPEC 10): two real `idemgate` processes on
//! the same Redis, then on the same PostgreSQL, keep every guarantee of SPEC 4 between them.
//!
//! Skipped (with a message) when `IDEMGATE_TEST_REDIS_URL` / `IDEMGATE_TEST_PG_URL` is unset.

mod common;

use common::{Gateway, Upstream, header, key, pg_url, post, redis_url, slug, store_block};

/// Duplicates split over two replicas run once; replays and conflicts work from either
/// replica; records survive restarting both.
async fn two_replicas(store: &str) {
    let up = Upstream::start().await;
    let mut a = Gateway::start(&up, store, "").await;
    let mut b = Gateway::start(&up, store, "").await;

    // 40 concurrent requests with one key, alternating between the replicas, while the first
    // one is still running upstream.
    let k = key("replicas-storm");
    let calls: Vec<_> = (0..40)
        .map(|i| {
            let gw = if i % 2 == 0 { &a } else { &b };
            let req = post(&gw.url("/api/v1/orders"), Some(&k), r#"{"amount":100}"#)
                .header("x-demo-delay-ms", "300");
            tokio::spawn(async move {
                let r = req.send().await.unwrap();
                let replayed = header(&r, "idempotent-replayed").is_some();
                let op = header(&r, "x-operation-id").unwrap_or_default().to_owned();
                (r.status().as_u16(), replayed, op, r.bytes().await.unwrap())
            })
        })
        .collect();
    let mut results = Vec::new();
    for c in calls {
        results.push(c.await.unwrap());
    }
    assert_eq!(up.executions(&k), 1, "{store}: the upstream ran exactly once");
    assert!(results.iter().all(|r| r.0 == 201), "{store}: {results:?}");
    assert_eq!(
        results.iter().filter(|r| r.1).count(),
        39,
        "{store}: all but one replay"
    );
    assert!(
        results.iter().all(|r| r.2 == results[0].2 && r.3 == results[0].3),
        "{store}: one operation id and one body for every caller"
    );

    // Executed on one replica, replayed on the other; a different body is refused there too.
    let k2 = key("replicas-replay");
    let first = post(&a.url("/api/v1/orders"), Some(&k2), r#"{"amount":7}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 201);
    let op = header(&first, "x-operation-id").unwrap().to_owned();
    let body = first.bytes().await.unwrap();
    let replay = post(&b.url("/api/v1/orders"), Some(&k2), r#"{"amount":7}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(header(&replay, "idempotent-replayed"), Some("true"), "{store}");
    assert_eq!(header(&replay, "x-operation-id"), Some(op.as_str()), "{store}");
    assert_eq!(replay.bytes().await.unwrap(), body, "{store}");
    let reused = post(&b.url("/api/v1/orders"), Some(&k2), r#"{"amount":8}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(reused.status(), 422, "{store}");
    assert_eq!(slug(reused).await, "idempotency-key-reused");

    // Every gateway restarted (kill -9): the records are in the shared store.
    a.restart().await;
    b.restart().await;
    for (gw, k, body_json) in [(&a, &k, r#"{"amount":100}"#), (&b, &k2, r#"{"amount":7}"#)] {
        let r = post(&gw.url("/api/v1/orders"), Some(k), body_json)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201, "{store}");
        assert_eq!(
            header(&r, "idempotent-replayed"),
            Some("true"),
            "{store}: after restart"
        );
    }
    assert_eq!(up.executions(&k), 1, "{store}");
    assert_eq!(up.executions(&k2), 1, "{store}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_on_redis() {
    let Some(url) = redis_url() else { return };
    two_replicas(&store_block("redis", &url, "")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_on_postgres() {
    let Some(url) = pg_url() else { return };
    two_replicas(&store_block("postgres", &url, "  pool_size: 4\n")).await;
}
