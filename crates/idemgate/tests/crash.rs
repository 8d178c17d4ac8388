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
