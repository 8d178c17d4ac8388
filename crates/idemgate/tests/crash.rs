//! Crashes, disconnects and shutdown: nothing is lost, nothing runs twice unless the contract
//! says so (SPEC 4: lease expiry; SPEC 10: durable across `kill -9`; SPEC 12: graceful shutdown).

mod common;

use std::time::Duration;

use common::{Gateway, Upstream, header, key, post, slug, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completed_record_survives_kill_9() {
    let up = Upstream::start().await;
    let mut gw = Gateway::start(&up, "embedded", "").await;
    let k = key("durable");
    let first = post(&gw.url("/api/v1/orders"), Some(&k), r#"{"amount":5}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 201);
    let op = header(&first, "x-operation-id").unwrap().to_owned();
    let body = first.bytes().await.unwrap();
    // The client has its response: the record must already be on disk.
    gw.restart().await;
    let retry = post(&gw.url("/api/v1/orders"), Some(&k), r#"{"amount":5}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(retry.status(), 201);
    assert_eq!(header(&retry, "idempotent-replayed"), Some("true"));
    assert_eq!(header(&retry, "x-operation-id"), Some(op.as_str()));
    assert_eq!(retry.bytes().await.unwrap(), body);
    assert_eq!(up.executions(&k), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_flight_then_lease_expiry_retries_or_fails() {
    let up = Upstream::start().await;
    let mut gw = Gateway::start(&up, "embedded", "").await;
    let retry_key = key("midflight-retry");
    let fail_key = key("midflight-fail");
    let r1 = tokio::spawn(
        post(&gw.url("/api/v1/orders"), Some(&retry_key), "{}")
            .header("x-demo-delay-ms", "4000")
            .send(),
    );
    let r2 = tokio::spawn(
        post(&gw.url("/fail"), Some(&fail_key), "{}")
            .header("x-demo-delay-ms", "4000")
            .send(),
    );
    wait_until(Duration::from_secs(5), || {
        up.executions(&retry_key) == 1 && up.executions(&fail_key) == 1
    })
    .await;
    gw.restart().await;
    assert!(
        r1.await.unwrap().is_err() && r2.await.unwrap().is_err(),
        "the clients lost their connections"
    );

    // `retry` (lease 1s): the retry waits for the dead owner's lease to run out, then executes.
    let started = std::time::Instant::now();
    let r = post(&gw.url("/api/v1/orders"), Some(&retry_key), "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    assert!(header(&r, "idempotent-replayed").is_none());
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "taken over at lease expiry, not at wait_timeout"
    );
    assert_eq!(
        up.executions(&retry_key),
        2,
        "executed again after the owner died"
    );

    // `fail`: the outcome is unknown and stays so.
    let r = post(&gw.url("/fail"), Some(&fail_key), "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 409);
    assert_eq!(slug(r).await, "outcome-unknown");
    assert_eq!(up.executions(&fail_key), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_does_not_cancel_the_execution() {
    let up = Upstream::start().await;
    for store in ["memory", "embedded"] {
        let gw = Gateway::start(&up, store, "").await;
        let k = key("disconnect");
        let impatient = post(&gw.url("/api/v1/orders"), Some(&k), "{}")
            .header("x-demo-delay-ms", "800")
            .timeout(Duration::from_millis(200))
            .send()
            .await;
        assert!(impatient.is_err(), "the client gave up");
        let retry = post(&gw.url("/api/v1/orders"), Some(&k), "{}")
            .send()
            .await
            .unwrap();
        assert_eq!(retry.status(), 201);
        assert_eq!(header(&retry, "idempotent-replayed"), Some("true"), "{store}");
        assert_eq!(up.executions(&k), 1, "{store}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_in_flight_requests_and_records_them() {
    let up = Upstream::start().await;
    let mut gw = Gateway::start(&up, "embedded", "").await;
    let k = key("drain");
    let slow = tokio::spawn(
        post(&gw.url("/api/v1/orders"), Some(&k), "{}")
            .header("x-demo-delay-ms", "1000")
            .send(),
    );
    wait_until(Duration::from_secs(5), || up.executions(&k) == 1).await;
    let status = gw.sigterm().await;
    assert!(status.success(), "clean exit: {status:?}");
    let r = slow.await.unwrap().expect("the in-flight request was answered");
    assert_eq!(r.status(), 201);
    gw.restart().await;
    let retry = post(&gw.url("/api/v1/orders"), Some(&k), "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(
        header(&retry, "idempotent-replayed"),
        Some("true"),
        "completed before exit"
    );
    assert_eq!(up.executions(&k), 1);
}

/// Shutdown waits on the gateway's task tracker (`server.rs`); the store calls that finish for
/// clients that went away mid-`begin` (`Engine::background`, which release a key taken for
/// nobody) are on that same tracker, so a shutdown does not cut them off.
#[tokio::test]
async fn shutdown_waits_for_store_calls_of_clients_that_left() {
    let config = idemgate::config::Config::from_yaml(
        "server:\n  listen: 127.0.0.1:0\nstore:\n  kind: memory\nupstreams:\n  app:\n    url: http://127.0.0.1:9\n\
         routes:\n  - id: all\n    method: POST\n    path: /**\n    upstream: app\n    policy: accepted\n    scope: global\n",
    )
    .unwrap();
    let store = idemgate::store::AnyStore::open(&config.store).unwrap();
    let gateway = idemgate::proxy::Gateway::new(config, store);
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    gateway.engine().background().spawn(async move {
        let _ = released.await;
    });
    assert_eq!(gateway.tasks().len(), 1, "one tracker for both");
    gateway.tasks().close();
    let wait = gateway.tasks().wait();
    tokio::pin!(wait);
    assert!(
        tokio::time::timeout(Duration::from_millis(100), &mut wait)
            .await
            .is_err(),
        "the wait holds while the store call runs"
    );
    release.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), wait)
        .await
        .expect("and ends with it");
}
