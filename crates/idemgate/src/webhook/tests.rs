//! `Webhooks::admit` on real routes: the order of checks, the principal and key, and the
//! unit-level timing check (an unknown id costs the same signature work as a bad signature).

use std::sync::Arc;

use super::registry::{Entry, new_id, secret_for};
use super::*;
use crate::config::webhooks::Provider;
use crate::config::{Config, Route};

const NOW: i64 = 1_700_000_000;

fn routes() -> Vec<Arc<Route>> {
    let mut yaml = String::from("upstreams:\n  app:\n    url: http://127.0.0.1:9\nwebhooks: {}\nroutes:\n");
    for p in Provider::ALL {
        let generic = if p == Provider::Generic {
            "    generic: {header: X-Sig, prefix: 'sha256=', identifier: {header: X-Id}}\n"
        } else {
            ""
        };
        yaml.push_str(&format!(
            "  - id: {p}\n    method: POST\n    path: /wh/{p}/{{webhook_id}}\n    upstream: app\n    policy: webhook\n    provider: {p}\n{generic}",
            p = p.as_str()
        ));
    }
    let config = Config::from_yaml(&yaml).unwrap();
    config.routes.iter().cloned().collect()
}

fn route(p: Provider) -> Arc<Route> {
    routes().into_iter().find(|r| r.provider == Some(p)).unwrap()
}

fn webhooks() -> Webhooks {
    Webhooks::new(
        &WebhooksFile {
            registry: None,
            signature_tolerance: None,
        },
        Some("https://hooks.example.com/".into()),
        Path::new("."),
    )
    .unwrap()
}

fn register(w: &Webhooks, provider: Provider, secrets: &[&str], project: &str) -> String {
    let id = new_id();
    w.registry()
        .upsert(Entry {
            id: id.clone(),
            tenant: "acme".into(),
            project: project.into(),
            provider,
            secrets: secrets.iter().map(|s| secret_for(provider, s).unwrap()).collect(),
        })
        .unwrap();
    id
}

fn parts(path: &str, headers: &[(&str, String)]) -> http::request::Parts {
    let mut b = http::Request::post(path);
    for (n, v) in headers {
        b = b.header(*n, v);
    }
    b.body(()).unwrap().into_parts().0
}

/// A delivery for `provider` that is well formed but signed with the wrong secret (or none that
/// any registry holds), with an identifier in its slot.
fn badly_signed(provider: Provider) -> (Vec<(&'static str, String)>, Vec<u8>) {
    let zeros = "0".repeat(64);
    let b64 = "AAAAAAAAAAAAAAAAAAAAAAAAAAA=".to_owned();
    let json = br#"{"id":"evt_1"}"#.to_vec();
    match provider {
        Provider::Stripe => (vec![("stripe-signature", format!("t={NOW},v1={zeros}"))], json),
        Provider::Github => (
            vec![
                ("x-hub-signature-256", format!("sha256={zeros}")),
                ("x-github-delivery", "d1".into()),
            ],
            json,
        ),
        Provider::Shopify => (
            vec![
                ("x-shopify-hmac-sha256", b64),
                ("x-shopify-event-id", "e1".into()),
            ],
            json,
        ),
        Provider::Gitlab => (
            vec![
                ("x-gitlab-token", "nope".into()),
                ("idempotency-key", "k1".into()),
            ],
            json,
        ),
        Provider::StandardWebhooks => (
            vec![
                ("webhook-id", "msg_1".into()),
                ("webhook-timestamp", NOW.to_string()),
                ("webhook-signature", format!("v1,{b64}")),
            ],
            json,
        ),
        Provider::Twilio => (
            vec![
                ("x-twilio-signature", b64),
                ("content-type", "application/x-www-form-urlencoded".into()),
            ],
            b"MessageSid=SM1&MessageStatus=sent".to_vec(),
        ),
        Provider::TwilioEventStreams => (
            vec![
                ("x-twilio-signature", b64),
                ("i-twilio-idempotency-token", "tok".into()),
            ],
            Vec::new(),
        ),
        Provider::Generic => (
            vec![("x-sig", format!("sha256={zeros}")), ("x-id", "i1".into())],
            json,
        ),
    }
}

#[test]
fn unknown_ids_cost_the_same_signature_work_as_bad_signatures() {
    let w = webhooks();
    // Two secrets somewhere in the registry: every check computes two MACs per signed message.
    register(&w, Provider::Gitlab, &["a", "b"], "p");
    for p in Provider::ALL {
        let r = route(p);
        let known = register(&w, p, &["whsec_c2VjcmV0LXNlY3JldC1zZWNyZXQ="], "p");
        let (headers, body) = badly_signed(p);
        let path = format!("/wh/{}/x", p.as_str());
        let (bad_sig, bad_work) = w.check(&r, &known, &parts(&path, &headers), &body, NOW);
        assert_eq!(bad_sig.unwrap_err().kind, Kind::InvalidSignature, "{p:?}");
        // An entry in rotation (two secrets) costs the same as one with a single secret: every
        // check is padded to the registry's largest number of secrets.
        let rotating = register(
            &w,
            p,
            &["whsec_c2VjcmV0LXNlY3JldC1zZWNyZXQ=", "whsec_b3RoZXI="],
            "p",
        );
        let (res, work) = w.check(&r, &rotating, &parts(&path, &headers), &body, NOW);
        assert_eq!(res.unwrap_err().kind, Kind::InvalidSignature, "{p:?}");
        assert_eq!(work, bad_work, "{p:?}: the number of secrets does not show");
        let unknown_id = new_id();
        let (unknown, unknown_work) = w.check(&r, &unknown_id, &parts(&path, &headers), &body, NOW);
        assert_eq!(unknown.unwrap_err().kind, Kind::UnknownWebhook, "{p:?}");
        assert!(bad_work > 0, "{p:?}: the bad signature was checked");
        assert_eq!(
            unknown_work, bad_work,
            "{p:?}: an unknown id does the same HMAC work"
        );
        // An id of another provider is unknown on this route, after the same work.
        let other = if p == Provider::Github {
            Provider::Shopify
        } else {
            Provider::Github
        };
        let foreign = register(&w, other, &["s"], "p");
        let (res, work) = w.check(&r, &foreign, &parts(&path, &headers), &body, NOW);
        assert_eq!(res.unwrap_err().kind, Kind::UnknownWebhook);
        assert_eq!(work, bad_work);
        // Malformed ids take the same path.
        let (res, work) = w.check(&r, "wh_nope", &parts(&path, &headers), &body, NOW);
        assert_eq!(res.unwrap_err().kind, Kind::UnknownWebhook);
        assert_eq!(work, bad_work);
    }
}

fn github_delivery(secret: &str, delivery: Option<&str>, body: &[u8]) -> http::request::Parts {
    let mac = crypto::hmac(
        crate::config::webhooks::HmacAlgorithm::Sha256,
        secret.as_bytes(),
        &[body],
    );
    let mut headers = vec![("x-hub-signature-256", format!("sha256={}", hex::encode(mac)))];
    if let Some(d) = delivery {
        headers.push(("x-github-delivery", d.to_owned()));
    }
    headers.push(("idempotency-key", "caller-chosen".into()));
    parts("/wh/github/x", &headers)
}

#[test]
fn an_admitted_delivery_has_the_registry_principal_and_a_provider_key() {
    let w = webhooks();
    let r = route(Provider::Github);
    let id = register(&w, Provider::Github, &["old", "new"], "shop");
    for secret in ["old", "new"] {
        let a = w
            .check(&r, &id, &github_delivery(secret, Some("d-1"), b"{}"), b"{}", NOW)
            .0
            .unwrap();
        assert_eq!(a.principal, Principal::new("acme", "shop", WEBHOOK_SUBJECT));
        assert_eq!(
            a.raw_key,
            format!("{id}/github-d-1"),
            "the caller's Idempotency-Key plays no part"
        );
        assert_eq!(a.provider, "github");
    }
    let other = register(&w, Provider::Github, &["new"], "shop");
    let b = w
        .check(
            &r,
            &other,
            &github_delivery("new", Some("d-1"), b"{}"),
            b"{}",
            NOW,
        )
        .0
        .unwrap();
    assert_ne!(
        b.raw_key,
        format!("{id}/github-d-1"),
        "two hooks, one delivery id: two keys"
    );
}

#[test]
fn signature_comes_before_translation() {
    let w = webhooks();
    let r = route(Provider::Github);
    let id = register(&w, Provider::Github, &["s"], "p");
    let e = w
        .check(&r, &id, &github_delivery("wrong", None, b"{}"), b"{}", NOW)
        .0
        .unwrap_err();
    assert_eq!(
        e.kind,
        Kind::InvalidSignature,
        "an unsigned delivery learns nothing about its id"
    );
    let e = w
        .check(&r, &id, &github_delivery("s", None, b"{}"), b"{}", NOW)
        .0
        .unwrap_err();
    assert_eq!(e.kind, Kind::TranslationFailed);
    let e = w
        .check(&r, &id, &github_delivery("s", Some("d"), b"{}"), b"{}x", NOW)
        .0
        .unwrap_err();
    assert_eq!(e.kind, Kind::InvalidSignature, "tampered body");
    assert!(
        !e.detail.contains("sha256="),
        "no signature in the problem: {}",
        e.detail
    );
}

#[test]
fn setup_refuses_bad_base_urls_and_missing_registries() {
    let file = WebhooksFile {
        registry: None,
        signature_tolerance: None,
    };
    for bad in ["hooks.example.com", "ftp://x", "https://x/?a=1"] {
        assert!(
            Webhooks::new(&file, Some(bad.into()), Path::new(".")).is_err(),
            "{bad}"
        );
    }
    let missing = WebhooksFile {
        registry: Some("does-not-exist.yaml".into()),
        signature_tolerance: None,
    };
    let e = Webhooks::new(&missing, None, Path::new(".")).unwrap_err();
    assert_eq!(e.key, "webhooks.registry");
}
