//! An outcome the client already has must be recorded even when the store fails at that moment
//! (SPEC 4: the record is kept before a retry can run the operation again). The gateway keeps the
//! key reserved and records the outcome as soon as the store answers again.

mod common;

use std::time::Duration;

use common::{Gateway, RedisServer, Upstream, header, key, post, store_block, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_the_store_missed_is_recorded_once_it_is_back() {
    if std::env::var("IDEMGATE_TEST_REDIS_URL").is_err() {
        println!("skipped: IDEMGATE_TEST_REDIS_URL not set");
        return;
    }
    let Some(server) = RedisServer::start().await else {
        return;
    };
    let up = Upstream::start().await;
    let gw = Gateway::start(
        &up,
        &store_block("redis", &server.url(), "  timeout: 300ms\n"),
        "",
    )
    .await;
    let k = key("late");
    // The upstream takes 800 ms; the store stops answering while it runs and for a while after,
    // so the first attempt to record the outcome fails.
    let call = tokio::spawn(
        post(&gw.url("/api/v1/orders"), Some(&k), "{}")
            .header("x-demo-delay-ms", "800")
            .send(),
    );
    wait_until(Duration::from_secs(5), || up.executions(&k) == 1).await;
    server.command(&["CLIENT", "PAUSE", "1500", "ALL"]).await;
    let first = call.await.unwrap().unwrap();
    assert_eq!(first.status(), 201, "the client gets the upstream's answer");
    wait_until(Duration::from_secs(15), || {
        gw.log().contains("outcome recorded after the store came back")
    })
    .await;
    let retry = post(&gw.url("/api/v1/orders"), Some(&k), "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(
        header(&retry, "idempotent-replayed"),
        Some("true"),
        "recorded late, replayed"
    );
    assert_eq!(up.executions(&k), 1, "never run twice");
}
