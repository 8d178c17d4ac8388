//! Webhooks (case B) end to end: the real binary, a registry file, the counting upstream, and
//! deliveries signed by the providers' own SDKs (PyPI `stripe`, `twilio`, `standardwebhooks`;
//! npm `@octokit/webhooks-methods`) through the scripts in `tests/webhook_signers/`.
//!
//! The SDK tests need `IDEMGATE_TEST_WEBHOOK_SDKS`, the directory `.ci/run` installs them into
//! (`venv/` and `node/`); without it they print that they were skipped and pass. The other
//! tests sign with the gateway's own HMAC helper and always run.

mod common;
#[path = "webhooks/fixture.rs"]
mod fixture;
#[path = "webhook_signers/mod.rs"]
mod signers;

use std::time::{Duration, Instant};

use base64::Engine as _;
use common::{client, slug};
use fixture::*;
use idemgate::config::webhooks::HmacAlgorithm;
use idemgate::webhook::crypto::{BASE64, hmac};
use serde_json::json;
use signers::sdks;

// ---- deliveries signed by the SDKs (tests/webhook_signers) ---------------------------------

#[tokio::test]
async fn stripe_deliveries_signed_by_stripe_python() {
    let Some(sdk) = sdks("stripe_deliveries_signed_by_stripe_python") else {
        return;
    };
    let s = start().await;
    let path = format!("/hooks/stripe/{}", id(1));
    let event = |id: &str| json!({"id": id, "object": "event", "type": "charge.succeeded"}).to_string();

    // First delivery, signed with the new secret; a caller's Idempotency-Key and identity
    // headers are ignored.
    let evt = unique("evt_");
    let body = event(&evt);
    let sig = sdk.stripe(STRIPE_NEW, now(), &body);
    let headers = [
        ("stripe-signature", sig.as_str()),
        ("idempotency-key", "caller-chosen"),
        ("x-tenant-id", "someone-else"),
    ];
    assert_executed(
        s.deliver(&path, &headers, &body).await,
        &ns_key(1, "stripe", &evt),
        body.len(),
    )
    .await;
    // Stripe redelivers with a fresh timestamp and signature: a replay, the upstream ran once.
    let again = sdk.stripe(STRIPE_NEW, now() + 1, &body);
    assert_replayed(s.deliver(&path, &[("stripe-signature", &again)], &body).await);
    assert_eq!(s.runs(1, "stripe", &evt), 1);
    assert_eq!(s.up.executions_ns("caller-chosen"), 0);

    // Rotation: the old secret verifies too.
    let evt2 = unique("evt_");
    let body2 = event(&evt2);
    let sig = sdk.stripe(STRIPE_OLD, now(), &body2);
    assert_eq!(
        s.deliver(&path, &[("stripe-signature", &sig)], &body2)
            .await
            .status(),
        201
    );

    // Several v1 values (Stripe during a secret roll): one matching is enough.
    let evt3 = unique("evt_");
    let body3 = event(&evt3);
    let t = now();
    let wrong = sdk.stripe("whsec_not_ours", t, &body3);
    let right = sdk.stripe(STRIPE_OLD, t, &body3);
    let v1 = |h: &str| {
        h.split(',')
            .find_map(|p| p.strip_prefix("v1="))
            .unwrap()
            .to_owned()
    };
    let both = format!("t={t},v1={},v1={}", v1(&wrong), v1(&right));
    assert_eq!(
        s.deliver(&path, &[("stripe-signature", &both)], &body3)
            .await
            .status(),
        201
    );
    let total = s.total();
    assert_eq!(total, 3);

    // Refused, and never forwarded: a tampered body, a wrong secret, a stale timestamp, no id.
    let evt4 = unique("evt_");
    let body4 = event(&evt4);
    let sig = sdk.stripe(STRIPE_NEW, now(), &body4);
    let tampered = body4.replace("charge.succeeded", "charge.refunded");
    assert_refused(
        s.deliver(&path, &[("stripe-signature", &sig)], &tampered).await,
        401,
        "invalid-signature",
    )
    .await;
    let sig = sdk.stripe("whsec_wrong", now(), &body4);
    assert_refused(
        s.deliver(&path, &[("stripe-signature", &sig)], &body4).await,
        401,
        "invalid-signature",
    )
    .await;
    let stale = sdk.stripe(STRIPE_NEW, now() - 400, &body4);
    assert_refused(
        s.deliver(&path, &[("stripe-signature", &stale)], &body4).await,
        401,
        "invalid-signature",
    )
    .await;
    let no_id = json!({"object": "event"}).to_string();
    let sig = sdk.stripe(STRIPE_NEW, now(), &no_id);
    assert_refused(
        s.deliver(&path, &[("stripe-signature", &sig)], &no_id).await,
        400,
        "translation-failed",
    )
    .await;
    // Valid signature, unknown webhook id.
    let sig = sdk.stripe(STRIPE_NEW, now(), &body4);
    let other = format!("/hooks/stripe/{}", id(99));
    assert_refused(
        s.deliver(&other, &[("stripe-signature", &sig)], &body4).await,
        404,
        "unknown-webhook",
    )
    .await;
    assert_eq!(s.total(), total, "no refused delivery reached the upstream");
    assert!(
        s.gw.log().contains("webhook translation failed"),
        "translation failures are logged"
    );
    s.assert_log_clean(&[&v1(&right)]);
}

#[tokio::test]
async fn github_deliveries_signed_by_octokit() {
    let Some(sdk) = sdks("github_deliveries_signed_by_octokit") else {
        return;
    };
    let s = start().await;
    let body = json!({"action": "opened", "number": 7}).to_string();
    let sig = sdk.octokit(GH_SECRET, &body);
    let delivery = "72d3162e-cc78-11e3-81ab-4c9367dc0958";
    let headers = [
        ("x-hub-signature-256", sig.as_str()),
        ("x-github-delivery", delivery),
    ];
    // One event, two hooks: GitHub sends both the same delivery id; each hook executes once.
    for n in [2, 3] {
        let path = format!("/hooks/github/{}", id(n));
        assert_executed(
            s.deliver(&path, &headers, &body).await,
            &ns_key(n, "github", delivery),
            body.len(),
        )
        .await;
        assert_replayed(s.deliver(&path, &headers, &body).await);
        assert_eq!(s.runs(n, "github", delivery), 1);
    }
    let path = format!("/hooks/github/{}", id(2));
    let tampered = body.replace('7', "8");
    assert_refused(
        s.deliver(&path, &headers, &tampered).await,
        401,
        "invalid-signature",
    )
    .await;
    let wrong = sdk.octokit("not the secret", &body);
    let h = [
        ("x-hub-signature-256", wrong.as_str()),
        ("x-github-delivery", "d-2"),
    ];
    assert_refused(s.deliver(&path, &h, &body).await, 401, "invalid-signature").await;
    let h = [("x-hub-signature-256", sig.as_str())];
    assert_refused(s.deliver(&path, &h, &body).await, 400, "translation-failed").await;
    assert_eq!(s.total(), 2);
    s.assert_log_clean(&[&sig]);
}

#[tokio::test]
async fn twilio_deliveries_signed_by_twilio_python() {
    let Some(sdk) = sdks("twilio_deliveries_signed_by_twilio_python") else {
        return;
    };
    let s = start().await;
    // A messaging status callback: form parameters, the public URL signed.
    let sid = unique("SM");
    let params = [
        ("MessageSid", sid.as_str()),
        ("MessageStatus", "delivered"),
        ("AccountSid", "AC123"),
        ("To", "+15558675310"),
        ("From", "+15017122661"),
    ];
    let form: String = form_urlencoded::Serializer::new(String::new())
        .extend_pairs(params)
        .finish();
    let path = format!("/hooks/twilio/{}?tenant=acme", id(4));
    let sign = |url: &str, params: &[(&str, &str)]| {
        sdk.python(&json!({"sdk": "twilio", "secret": TWILIO_TOKEN, "url": url, "params": params}))
    };
    let sig = sign(&format!("{BASE_URL}{path}"), &params);
    let headers = [
        ("x-twilio-signature", sig.as_str()),
        ("content-type", "application/x-www-form-urlencoded"),
    ];
    let identifier = format!("{sid}-delivered");
    assert_executed(
        s.deliver(&path, &headers, &form).await,
        &ns_key(4, "twilio", &identifier),
        form.len(),
    )
    .await;
    assert_replayed(s.deliver(&path, &headers, &form).await);
    assert_eq!(s.runs(4, "twilio", &identifier), 1);
    // The same URL signed with the default port written out is accepted too.
    let with_port = sign(&format!("{}:443{path}", BASE_URL), &params);
    let headers = [
        ("x-twilio-signature", with_port.as_str()),
        ("content-type", "application/x-www-form-urlencoded"),
    ];
    assert_replayed(s.deliver(&path, &headers, &form).await);
    // A changed parameter breaks the signature; a callback without its status is untranslatable.
    let tampered = form.replace("delivered", "failed");
    assert_refused(
        s.deliver(&path, &headers, &tampered).await,
        401,
        "invalid-signature",
    )
    .await;
    let partial = [("MessageSid", sid.as_str()), ("AccountSid", "AC123")];
    let sig = sign(&format!("{BASE_URL}{path}"), &partial);
    let body: String = form_urlencoded::Serializer::new(String::new())
        .extend_pairs(partial)
        .finish();
    let h = [
        ("x-twilio-signature", sig.as_str()),
        ("content-type", "application/x-www-form-urlencoded"),
    ];
    assert_refused(s.deliver(&path, &h, &body).await, 400, "translation-failed").await;

    // Event Streams: a JSON body covered by `bodySHA256`, the idempotency token in a header.
    let body =
        json!([{"specversion": "1.0", "type": "com.twilio.messaging.message.delivered", "id": unique("EZ")}])
            .to_string();
    let hash = sdk.python(&json!({"sdk": "twilio_hash", "body": body}));
    let path = format!("/hooks/twilio_event_streams/{}?bodySHA256={hash}", id(5));
    let sig = sdk.python(
        &json!({"sdk": "twilio", "secret": TWILIO_TOKEN, "url": format!("{BASE_URL}{path}"), "body": body}),
    );
    let token = unique("tok-");
    let headers = [
        ("x-twilio-signature", sig.as_str()),
        ("content-type", "application/json"),
        ("i-twilio-idempotency-token", token.as_str()),
    ];
    let key = ns_key(5, "twilio_event_streams", &token);
    assert_executed(s.deliver(&path, &headers, &body).await, &key, body.len()).await;
    assert_replayed(s.deliver(&path, &headers, &body).await);
    let tampered = body.replace("delivered", "failed");
    assert_refused(
        s.deliver(&path, &headers, &tampered).await,
        401,
        "invalid-signature",
    )
    .await;
    assert_eq!(s.total(), 2);
    s.assert_log_clean(&[&with_port]);
}

#[tokio::test]
async fn standard_webhooks_signed_by_standardwebhooks() {
    let Some(sdk) = sdks("standard_webhooks_signed_by_standardwebhooks") else {
        return;
    };
    let s = start().await;
    let path = format!("/hooks/standard_webhooks/{}", id(6));
    let msg = unique("msg_");
    let body = json!({"type": "invoice.paid", "data": {"n": 1}}).to_string();
    let sign = |t: i64, body: &str| {
        sdk.python(&json!({"sdk": "standardwebhooks", "secret": SW_SECRET, "msg_id": msg, "timestamp": t, "body": body}))
    };
    let t = now().to_string();
    let sig = sign(now(), &body);
    let headers = [
        ("webhook-id", msg.as_str()),
        ("webhook-timestamp", t.as_str()),
        ("webhook-signature", sig.as_str()),
    ];
    assert_executed(
        s.deliver(&path, &headers, &body).await,
        &ns_key(6, "standard_webhooks", &msg),
        body.len(),
    )
    .await;
    assert_replayed(s.deliver(&path, &headers, &body).await);
    assert_eq!(s.runs(6, "standard_webhooks", &msg), 1);
    assert_refused(s.deliver(&path, &headers, "{}").await, 401, "invalid-signature").await;
    let old = now() - 400;
    let stale = sign(old, &body);
    let old = old.to_string();
    let h = [
        ("webhook-id", msg.as_str()),
        ("webhook-timestamp", old.as_str()),
        ("webhook-signature", stale.as_str()),
    ];
    assert_refused(s.deliver(&path, &h, &body).await, 401, "invalid-signature").await;
    assert_eq!(s.total(), 1);
    s.assert_log_clean(&[&sig]);
}

// ---- without the SDKs -----------------------------------------------------------------------

#[tokio::test]
async fn unknown_ids_answer_404() {
    let s = start().await;
    let body = "{}";
    let mac = hex::encode(hmac(
        HmacAlgorithm::Sha256,
        GH_SECRET.as_bytes(),
        &[body.as_bytes()],
    ));
    let sig = format!("sha256={mac}");
    let headers = [
        ("x-hub-signature-256", sig.as_str()),
        ("x-github-delivery", "d-1"),
    ];
    let unregistered = id(99);
    let stripe_entry = id(1);
    // Not registered, malformed, and registered for another provider than the route's.
    for wid in [unregistered.as_str(), "wh_nope", "WH_0", stripe_entry.as_str()] {
        let r = s.deliver(&format!("/hooks/github/{wid}"), &headers, body).await;
        assert_refused(r, 404, "unknown-webhook").await;
    }
    assert_eq!(s.total(), 0);
}

#[tokio::test]
async fn gitlab_shopify_and_generic_deliveries() {
    let s = start().await;
    // GitLab: the token is the secret; its Idempotency-Key (stable across retries) is the id.
    let path = format!("/hooks/gitlab/{}", id(8));
    let key = "0a6c5f8e-3a1b-4c2d-9e8f-7a6b5c4d3e2f";
    let body = r#"{"object_kind":"push"}"#;
    let headers = [("x-gitlab-token", GITLAB_TOKEN), ("idempotency-key", key)];
    assert_executed(
        s.deliver(&path, &headers, body).await,
        &ns_key(8, "gitlab", key),
        body.len(),
    )
    .await;
    assert_replayed(s.deliver(&path, &headers, body).await);
    let wrong = [
        ("x-gitlab-token", "glpat-hook-token-77d2"),
        ("idempotency-key", key),
    ];
    assert_refused(s.deliver(&path, &wrong, body).await, 401, "invalid-signature").await;
    let no_key = [("x-gitlab-token", GITLAB_TOKEN)];
    assert_refused(s.deliver(&path, &no_key, body).await, 400, "translation-failed").await;

    // A burst of concurrent redeliveries while the first still runs: one execution, the others
    // wait for it and replay.
    let burst = "1b7d6e9f-2c3a-4b5d-8e6f-9a0b1c2d3e4f";
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let req = client()
            .post(s.gw.url(&path))
            .header("x-gitlab-token", GITLAB_TOKEN)
            .header("idempotency-key", burst)
            .header("x-demo-delay-ms", "300")
            .body(body.to_owned());
        set.spawn(async move { req.send().await.unwrap().status() });
    }
    while let Some(status) = set.join_next().await {
        assert_eq!(status.unwrap(), 201);
    }
    assert_eq!(s.runs(8, "gitlab", burst), 1);

    // Shopify: base64 HMAC-SHA256 of the body; X-Shopify-Event-Id.
    let path = format!("/hooks/shopify/{}", id(7));
    let body = r#"{"id":820982911946154508,"email":"jon@example.com"}"#;
    let sig = BASE64.encode(hmac(
        HmacAlgorithm::Sha256,
        SHOPIFY_SECRET.as_bytes(),
        &[body.as_bytes()],
    ));
    let headers = [
        ("x-shopify-hmac-sha256", sig.as_str()),
        ("x-shopify-event-id", "98880550-7158-44d4-b7cd-2c97c8a091b5"),
    ];
    let r = s.deliver(&path, &headers, body).await;
    assert_executed(
        r,
        &ns_key(7, "shopify", "98880550-7158-44d4-b7cd-2c97c8a091b5"),
        body.len(),
    )
    .await;
    assert_refused(s.deliver(&path, &headers, "{}").await, 401, "invalid-signature").await;

    // Generic: `v1=` + hex HMAC-SHA256 of `{X-Timestamp}.{body}`, id at /event/id.
    let path = format!("/hooks/generic/{}", id(9));
    let body = r#"{"event":{"id":"ev_42","kind":"paid"}}"#;
    let mac = hmac(
        HmacAlgorithm::Sha256,
        GENERIC_SECRET.as_bytes(),
        &[b"1700000000.", body.as_bytes()],
    );
    let sig = format!("v1={}", hex::encode(mac));
    let headers = [("x-signature", sig.as_str()), ("x-timestamp", "1700000000")];
    assert_executed(
        s.deliver(&path, &headers, body).await,
        &ns_key(9, "generic", "ev_42"),
        body.len(),
    )
    .await;
    assert_replayed(s.deliver(&path, &headers, body).await);
    let moved = [("x-signature", sig.as_str()), ("x-timestamp", "1700000001")];
    assert_refused(s.deliver(&path, &moved, body).await, 401, "invalid-signature").await;
    assert_eq!(s.total(), 4);
    s.assert_log_clean(&[]);
}

#[tokio::test]
async fn the_registry_reloads_without_a_restart() {
    let s = start().await;
    let path = format!("/hooks/github/{}", id(42));
    let body = r#"{"zen":"Keep it logically awesome."}"#;
    let mac = hex::encode(hmac(
        HmacAlgorithm::Sha256,
        GH_SECRET.as_bytes(),
        &[body.as_bytes()],
    ));
    let sig = format!("sha256={mac}");
    let headers = [
        ("x-hub-signature-256", sig.as_str()),
        ("x-github-delivery", "ping-1"),
    ];
    assert_refused(s.deliver(&path, &headers, body).await, 404, "unknown-webhook").await;

    // A new hook appears in the file; a broken file in between keeps the old entries.
    std::fs::write(s.gw.file("webhooks.yaml"), "- [this is not an entry").unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let known = format!("/hooks/github/{}", id(2));
    let r = s.deliver(&known, &headers, body).await;
    assert_eq!(
        r.status(),
        201,
        "a broken registry file keeps the last good entries"
    );
    let reg = format!("{}{}", registry(), entry(42, "github", "WH_GITHUB"));
    std::fs::write(s.gw.file("webhooks.yaml"), reg).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = s.deliver(&path, &headers, body).await;
        if r.status() == 201 {
            break;
        }
        assert_eq!(slug(r).await, "unknown-webhook");
        assert!(Instant::now() < deadline, "the new entry was not picked up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(s.runs(42, "github", "ping-1"), 1);
    assert!(
        s.gw.log().contains("not reloaded"),
        "the broken file was reported"
    );
}

#[test]
fn a_registry_that_cannot_be_used_is_a_config_error() {
    let dir = tempfile::tempdir().unwrap();
    let check = |registry: &str| {
        std::fs::write(dir.path().join("webhooks.yaml"), registry).unwrap();
        let config = dir.path().join("idemgate.yaml");
        std::fs::write(&config, config_text().replace("{upstream}", "http://127.0.0.1:9")).unwrap();
        std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
            .args(["check", "--config"])
            .arg(&config)
            .env_clear()
            .env("WH_GITHUB", GH_SECRET)
            .output()
            .unwrap()
    };
    let ok = check(&entry(2, "github", "WH_GITHUB"));
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    // An unset variable, and an id that is not 128 bits of hex: exit 64, naming the variable
    // and the entry's position, never the id or a secret.
    for (registry, expect) in [
        (entry(2, "github", "WH_UNSET"), "WH_UNSET"),
        (
            format!(
                "{}- {{id: wh_1234, tenant: a, provider: github, secrets_env: [WH_GITHUB]}}\n",
                entry(2, "github", "WH_GITHUB")
            ),
            "entry 2",
        ),
    ] {
        let out = check(&registry);
        assert_eq!(out.status.code(), Some(64));
        let err = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
        assert!(err.contains("webhooks.registry") && err.contains(expect), "{err}");
        assert!(
            !err.contains(&id(2)) && !err.contains("wh_1234") && !err.contains(GH_SECRET),
            "{err}"
        );
    }
}
