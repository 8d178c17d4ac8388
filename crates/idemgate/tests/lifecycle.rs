//! The case-A lifecycle against the real binary (SPEC 2-4, 11): concurrency, replay, conflicts,
//! transient vs final outcomes, key parsing, header allow-list.

mod common;

use std::time::Duration;

use common::{Gateway, Upstream, header, key, post, slug};

const STORES: [&str; 2] = ["memory", "embedded"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forty_concurrent_requests_execute_once() {
    let up = Upstream::start().await;
    for store in STORES {
        let gw = Gateway::start(&up, store, "").await;
        forty_execute_once(&up, &gw, store).await;
    }
}

/// A gateway limited to one core runs tokio's current-thread scheduler (CI machines have more
/// cores, so without this the single-threaded runtime would go untested).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forty_concurrent_requests_execute_once_on_one_worker_thread() {
    let up = Upstream::start().await;
    let routes = "upstreams:\n  app:\n    url: {upstream}\nroutes:\n  - id: orders\n    method: POST\n    path: /api/v1/orders\n    upstream: app\n    policy: required\n    scope: global\n";
    let gw = Gateway::start_yaml(&up, routes, &[("IDEMGATE_WORKER_THREADS", "1")], &[]).await;
    forty_execute_once(&up, &gw, "memory, one worker").await;
}

async fn forty_execute_once(up: &Upstream, gw: &Gateway, label: &str) {
    let k = key("storm");
    let url = gw.url("/api/v1/orders");
    let calls: Vec<_> = (0..40)
        .map(|_| {
            let req = post(&url, Some(&k), r#"{"amount":100}"#).header("x-demo-delay-ms", "300");
            tokio::spawn(async move {
                let r = req.send().await.unwrap();
                let replayed = header(&r, "idempotent-replayed").is_some();
                (r.status().as_u16(), replayed, r.bytes().await.unwrap())
            })
        })
        .collect();
    let mut results = Vec::new();
    for c in calls {
        results.push(c.await.unwrap());
    }
    assert_eq!(up.executions(&k), 1, "{label}: the upstream ran exactly once");
    assert!(results.iter().all(|(s, _, _)| *s == 201), "{label}: {results:?}");
    assert!(
        results.iter().all(|(_, _, b)| *b == results[0].2),
        "{label}: every caller got the same body"
    );
    assert_eq!(
        results.iter().filter(|(_, r, _)| *r).count(),
        39,
        "{label}: all but one are replays"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_is_byte_identical_and_conflicts_are_refused() {
    let up = Upstream::start().await;
    for store in STORES {
        let gw = Gateway::start(&up, store, "").await;
        let k = key("replay");
        let first = post(
            &gw.url("/api/v1/orders"),
            Some(&k),
            r#"{"amount":1,"currency":"eur"}"#,
        )
        .send()
        .await
        .unwrap();
        assert_eq!(first.status(), 201);
        assert!(header(&first, "idempotent-replayed").is_none());
        let op = header(&first, "x-operation-id").unwrap().to_owned();
        assert!(header(&first, "idempotency-expires").is_some());
        let first_body = first.bytes().await.unwrap();

        // Same JSON, other key order and whitespace, quoted key: the same request.
        let again = post(
            &gw.url("/api/v1/orders"),
            Some(&format!("\"{k}\"")),
            r#"{ "currency": "eur", "amount": 1 }"#,
        )
        .send()
        .await
        .unwrap();
        assert_eq!(again.status(), 201);
        assert_eq!(header(&again, "idempotent-replayed"), Some("true"));
        assert_eq!(header(&again, "x-operation-id"), Some(op.as_str()));
        assert_eq!(header(&again, "content-type"), Some("application/json"));
        assert_eq!(
            again.bytes().await.unwrap(),
            first_body,
            "{store}: byte-identical replay"
        );
        assert_eq!(up.executions(&k), 1);

        let other_body = post(&gw.url("/api/v1/orders"), Some(&k), r#"{"amount":2}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(other_body.status(), 422);
        assert_eq!(header(&other_body, "x-operation-id"), Some(op.as_str()));
        assert_eq!(slug(other_body).await, "idempotency-key-reused");
        let other_route = post(
            &gw.url("/api/v1/other"),
            Some(&k),
            r#"{"amount":1,"currency":"eur"}"#,
        )
        .send()
        .await
        .unwrap();
        assert_eq!(other_route.status(), 422);
        let other_method = common::client()
            .patch(gw.url("/api/v1/orders"))
            .header("idempotency-key", &k)
            .header("content-type", "application/json")
            .body(r#"{"amount":1,"currency":"eur"}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(
            other_method.status(),
            422,
            "PATCH to the catch-all with the same key"
        );
        assert_eq!(
            up.executions(&k),
            1,
            "{store}: conflicts never reach the upstream"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_answers_409_with_retry_after_while_in_flight() {
    let up = Upstream::start().await;
    let gw = Gateway::start(&up, "memory", "").await;
    let k = key("reject");
    let slow = post(&gw.url("/reject"), Some(&k), "{}")
        .header("x-demo-delay-ms", "1500")
        .send();
    let slow = tokio::spawn(slow);
    common::wait_until(Duration::from_secs(5), || up.executions(&k) == 1).await;
    let second = post(&gw.url("/reject"), Some(&k), "{}").send().await.unwrap();
    assert_eq!(second.status(), 409);
    assert!(header(&second, "retry-after").is_some_and(|s| s.parse::<u64>().unwrap() >= 1));
    assert_eq!(slug(second).await, "request-in-flight");
    assert_eq!(slow.await.unwrap().unwrap().status(), 201);
    let third = post(&gw.url("/reject"), Some(&k), "{}").send().await.unwrap();
    assert_eq!(header(&third, "idempotent-replayed"), Some("true"));
    assert_eq!(up.executions(&k), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_outcomes_release_and_final_ones_are_stored() {
    let up = Upstream::start().await;
    let gw = Gateway::start(&up, "embedded", "").await;
    for status in ["500", "503", "429", "408", "425"] {
        let k = key("transient");
        for attempt in 1..=2 {
            let r = post(&gw.url("/api/v1/orders"), Some(&k), "{}")
                .header("x-demo-status", status)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status().as_str(), status);
            assert!(header(&r, "x-operation-id").is_some());
            assert!(header(&r, "idempotent-replayed").is_none());
            assert_eq!(up.executions(&k), attempt, "status {status} released the key");
        }
    }
    for status in ["400", "404", "409", "302", "200"] {
        let k = key("final");
        for _ in 0..2 {
            let r = post(&gw.url("/api/v1/orders"), Some(&k), "{}")
                .header("x-demo-status", status)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status().as_str(), status);
        }
        assert_eq!(up.executions(&k), 1, "status {status} is stored");
    }
    // store_server_errors: true keeps 5xx outcomes.
    let k = key("stored-5xx");
    for _ in 0..2 {
        let r = post(&gw.url("/stored-5xx"), Some(&k), "{}")
            .header("x-demo-status", "502")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 502);
    }
    assert_eq!(up.executions(&k), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_cookie_is_never_replayed() {
    let up = Upstream::start().await;
    let gw = Gateway::start(&up, "memory", "").await;
    let k = key("cookie");
    let first = post(&gw.url("/api/v1/orders"), Some(&k), "{}")
        .header("x-demo-set-cookie", "1")
        .send()
        .await
        .unwrap();
    assert!(
        header(&first, "set-cookie").is_some(),
        "the original caller gets its cookie"
    );
    let replay = post(&gw.url("/api/v1/orders"), Some(&k), "{}")
        .header("x-demo-set-cookie", "1")
        .send()
        .await
        .unwrap();
    assert_eq!(header(&replay, "idempotent-replayed"), Some("true"));
    assert!(header(&replay, "set-cookie").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_responses_are_recorded_but_not_replayed() {
    let up = Upstream::start().await;
    let gw = Gateway::start(&up, "embedded", "").await;
    let k = key("big");
    let first = post(&gw.url("/small"), Some(&k), "{}")
        .header("x-demo-body-bytes", "5000")
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(
        first.bytes().await.unwrap().len(),
        5000,
        "the first caller gets the whole body"
    );
    let again = post(&gw.url("/small"), Some(&k), "{}")
        .header("x-demo-body-bytes", "5000")
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 409);
    let v: serde_json::Value = serde_json::from_slice(&again.bytes().await.unwrap()).unwrap();
    assert!(v["type"].as_str().unwrap().ends_with("response-not-retained"));
    assert!(
        v["detail"].as_str().unwrap().contains("201"),
        "names the original status: {v}"
    );
    assert_eq!(up.executions(&k), 1, "never executed twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_and_key_validation() {
    let up = Upstream::start().await;
    let gw = Gateway::start(&up, "memory", "").await;
    let orders = gw.url("/api/v1/orders");
    let r = post(&orders, None, "{}").send().await.unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(slug(r).await, "missing-idempotency-key");
    for (bad, reason) in [
        ("a".repeat(256), "length"),
        ("has space".to_owned(), "syntax"),
        ("slash/y".to_owned(), "charset"),
        ("sched:1:2".to_owned(), "charset"),
        ("t-forged".to_owned(), "reserved_prefix"),
        ("a, b".to_owned(), "syntax"),
        ("\"unterminated".to_owned(), "syntax"),
    ] {
        let r = post(&orders, Some(&bad), "{}").send().await.unwrap();
        assert_eq!(r.status(), 400, "{bad}");
        let v: serde_json::Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
        assert!(v["type"].as_str().unwrap().ends_with("invalid-idempotency-key"));
        assert_eq!(v["reason"], reason, "{bad}: {v}");
    }
    let two = common::client()
        .post(&orders)
        .header("idempotency-key", "a")
        .header("idempotency-key", "b")
        .send()
        .await
        .unwrap();
    assert_eq!(two.status(), 400, "two header lines");
    // Prohibited: forwarded without a key, refused with one.
    assert_eq!(
        post(&gw.url("/search"), None, "{}")
            .send()
            .await
            .unwrap()
            .status(),
        201
    );
    let r = post(&gw.url("/search"), Some("k1"), "{}").send().await.unwrap();
    assert_eq!(slug(r).await, "idempotency-key-not-allowed");
    // Accepted without a key: forwarded, not deduplicated.
    let before = up.counts.total();
    for _ in 0..2 {
        let r = post(&gw.url("/anything"), None, "{}").send().await.unwrap();
        assert!(header(&r, "x-operation-id").is_none());
    }
    assert_eq!(up.counts.total(), before + 2);
    // handler_internal: the header is forwarded untouched and nothing is deduplicated.
    for _ in 0..2 {
        post(&gw.url("/internal/1"), Some("raw key, untouched"), "{}")
            .send()
            .await
            .unwrap();
    }
    assert_eq!(up.counts.for_key("raw key, untouched"), 2);
    // No route.
    let r = common::client()
        .get(gw.url("/api/v1/orders"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(slug(r).await, "not-found");
    // Nothing above reached the upstream with a key it should not have.
    assert_eq!(up.executions("t-forged"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_failures_release_the_key() {
    let up = Upstream::start().await;
    let dead = common::free_addr();
    let dead_up = Upstream {
        addr: dead,
        counts: up.counts.clone(),
    };
    let gw = Gateway::start(&dead_up, "memory", "").await;
    let k = key("down");
    let r = post(&gw.url("/api/v1/orders"), Some(&k), "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502);
    assert!(header(&r, "x-operation-id").is_some());
    assert_eq!(slug(r).await, "upstream-unavailable");
    // Released: the retry executes again (and fails again), rather than being told in flight.
    let r = post(&gw.url("/api/v1/orders"), Some(&k), "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502);

    // Timeout: the upstream takes longer than `timeout: 5s`.
    let gw = Gateway::start(&up, "memory", "").await;
    let k = key("slow");
    let r = post(&gw.url("/api/v1/orders"), Some(&k), "{}")
        .header("x-demo-delay-ms", "6000")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 504);
    assert_eq!(slug(r).await, "upstream-timeout");
    let r = post(&gw.url("/api/v1/orders"), Some(&k), "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        201,
        "released after the timeout, so the retry executes"
    );
    assert!(header(&r, "idempotent-replayed").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_keys_never_reach_the_log() {
    let up = Upstream::start().await;
    let gw = Gateway::start(&up, "memory", "").await;
    let k = key("secret-key-material");
    let mut operation_ids = Vec::new();
    for _ in 0..2 {
        let r = post(&gw.url("/api/v1/orders"), Some(&k), "{}")
            .send()
            .await
            .unwrap();
        operation_ids.push(header(&r, "x-operation-id").expect("x-operation-id").to_owned());
    }
    post(&gw.url("/api/v1/orders"), Some(&k), "{\"x\":1}")
        .send()
        .await
        .unwrap();
    let log = gw.log();
    assert!(
        log.contains("\"idempotency_key_namespaced\""),
        "access lines are written: {log}"
    );
    assert!(log.contains("\"cache_hit\":true"));
    // The execution and its replay carry their operation id and method into the access line.
    assert_eq!(operation_ids[0], operation_ids[1]);
    let line = format!("\"operation_id\":\"{}\"", operation_ids[0]);
    assert_eq!(log.matches(&line).count(), 2, "{log}");
    assert!(log.contains("\"method\":\"POST\""), "{log}");
    assert!(!log.contains(&k), "the raw key leaked into the log");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_line_times_the_request() {
    let up = Upstream::start().await;
    let gw = Gateway::start(&up, "memory", "").await;
    let r = post(&gw.url("/api/v1/orders"), Some(&key("timed")), "{}")
        .header("x-demo-delay-ms", "150")
        .send()
        .await
        .unwrap();
    let op = header(&r, "x-operation-id").expect("x-operation-id").to_owned();
    let log = gw.log();
    let line = log
        .lines()
        .find(|l| l.contains(&format!("\"operation_id\":\"{op}\"")))
        .unwrap_or_else(|| panic!("no access line for {op}: {log}"));
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    let ms = v["latency_ms"].as_f64().expect("latency_ms");
    assert!(
        (150.0..10_000.0).contains(&ms),
        "the upstream took 150 ms; the line says {ms}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hop_by_hop_headers_are_not_forwarded() {
    let up = Upstream::start().await;
    let gw = Gateway::start(&up, "memory", "").await;
    let r = post(&gw.url("/api/v1/orders"), Some(&key("hop")), "{}")
        .header("x-demo-echo-headers", "1")
        .header("connection", "keep-alive, x-private-hop")
        .header("x-private-hop", "1")
        .header("keep-alive", "timeout=5")
        .header("te", "trailers")
        .header("proxy-authorization", "Basic c2VjcmV0")
        .send()
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    let seen: Vec<&str> = v["headers"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    for hop in ["x-private-hop", "keep-alive", "te", "proxy-authorization"] {
        assert!(!seen.contains(&hop), "{hop} was forwarded: {seen:?}");
    }
    for kept in [
        "x-forwarded-for",
        "x-forwarded-host",
        "x-operation-id",
        "idempotency-key",
        "content-type",
    ] {
        assert!(seen.contains(&kept), "{kept} missing: {seen:?}");
    }
}
