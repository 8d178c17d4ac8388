//! Operations (SPEC 8, 12): metrics at the right labels, the admin API and its token, purge as
//! the escape hatch, the records CLI, the status probe, and secrets kept out of the log.

mod common;

use std::process::Command;

use common::{Gateway, Upstream, header, key, post, slug};
use sha2::{Digest, Sha256};

const TOKEN: &str = "test-only-admin-token-9f2c";

fn config(admin: &str, tenant_labels: bool, max_bytes: &str) -> String {
    format!(
        r#"
server:
  listen: {{listen}}
  admin_listen: {admin}
  admin_token_env: TEST_ADMIN_TOKEN
store:
  kind: memory
  max_bytes: {max_bytes}
upstreams:
  app:
    url: {{upstream}}
identity:
  api_keys:
    file: keys.yaml
metrics:
  tenant_labels: {tenant_labels}
webhooks:
  registry: hooks.yaml
routes:
  - id: github
    method: POST
    path: /hooks/{{webhook_id}}
    upstream: app
    policy: webhook
    provider: github
  - id: orders
    method: POST
    path: /api/v1/orders
    upstream: app
    policy: required
    status:
      resource_id: /id
      probe: {{upstream}}/outbox/{{resource_id}}
  - id: probe-down
    method: POST
    path: /probe-down
    upstream: app
    policy: required
    status:
      resource_id: /id
      probe: {{upstream}}/outbox-down/{{resource_id}}
"#
    )
}

async fn start(up: &Upstream, tenant_labels: bool, max_bytes: &str) -> (Gateway, String) {
    let admin = common::free_addr();
    let keys = format!(
        "- {{key_sha256: {}, tenant: acme, project: p1, subject: \"user:alice\"}}\n",
        hex::encode(Sha256::digest(b"k-alice"))
    );
    let gw = Gateway::start_full(
        up,
        &config(&admin.to_string(), tenant_labels, max_bytes),
        &[
            ("TEST_ADMIN_TOKEN", TOKEN),
            ("TEST_HOOK_SECRET", "test-only-hook-secret"),
        ],
        &[("keys.yaml", keys.as_bytes()), ("hooks.yaml", b"[]\n")],
    )
    .await;
    (gw, format!("http://{admin}"))
}

fn alice(url: &str, k: Option<&str>, body: &str) -> reqwest::RequestBuilder {
    post(url, k, body).header("x-api-key", "k-alice")
}

async fn admin_get(admin: &str, path: &str, token: Option<&str>) -> reqwest::Response {
    let mut r = common::client().get(format!("{admin}{path}"));
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    r.send().await.unwrap()
}

trait JsonValue {
    async fn json_value(self) -> serde_json::Value;
}

impl JsonValue for reqwest::Response {
    async fn json_value(self) -> serde_json::Value {
        serde_json::from_slice(&self.bytes().await.unwrap()).unwrap()
    }
}

fn metric(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .find(|l| labels.iter().all(|lab| l.contains(lab)))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_stats_count_a_scripted_sequence_at_the_right_labels() {
    let up = Upstream::start().await;
    // Room for a couple of records, so a later reservation is a store error.
    let (gw, admin) = start(&up, true, "800").await;
    let url = gw.url("/api/v1/orders");
    let k = key("m");
    assert_eq!(alice(&url, Some(&k), "{}").send().await.unwrap().status(), 201); // miss
    assert_eq!(alice(&url, Some(&k), "{}").send().await.unwrap().status(), 201); // replay
    assert_eq!(alice(&url, None, "{}").send().await.unwrap().status(), 400); // missing
    assert_eq!(
        alice(&url, Some("t-forged"), "{}").send().await.unwrap().status(),
        400
    ); // invalid
    assert_eq!(
        alice(&url, Some(&k), "{\"x\":1}").send().await.unwrap().status(),
        422
    ); // conflict
    let mut store_error = None;
    for i in 0..20 {
        let r = alice(&url, Some(&format!("{k}-fill{i}")), "{}")
            .send()
            .await
            .unwrap();
        if r.status() == 503 {
            store_error = Some(i);
            assert_eq!(slug(r).await, "store-unavailable");
            break;
        }
    }
    let fills = store_error.expect("the small memory store fills up");

    let text = admin_get(&admin, "/metrics", None).await.text().await.unwrap();
    let at = ["tenant=\"acme\"", "project=\"p1\"", "endpoint=\"orders\""];
    let m = |name: &str, extra: &[&str]| {
        let labels: Vec<&str> = at.iter().chain(extra).copied().collect();
        metric(&text, name, &labels)
    };
    assert_eq!(
        m("idempotency_cache_miss_total", &[]),
        Some(1.0 + f64::from(fills)),
        "{text}"
    );
    assert_eq!(m("idempotency_cache_hit_total", &["status=\"201\""]), Some(1.0));
    assert_eq!(
        m("idempotency_key_missing_total", &["class=\"required\""]),
        Some(1.0)
    );
    assert_eq!(
        m("idempotency_key_invalid_total", &["reason=\"reserved_prefix\""]),
        Some(1.0)
    );
    assert_eq!(
        m("idempotency_conflict_total", &["reason=\"key_reused\""]),
        Some(1.0)
    );
    assert_eq!(m("idempotency_store_errors_total", &[]), Some(1.0));
    assert_eq!(
        m("idempotency_key_present_total", &["case=\"A\""]),
        Some(4.0 + f64::from(fills))
    );
    assert!(
        text.contains("idempotency_store_duration_seconds_bucket"),
        "{text}"
    );
    assert!(text.contains("idempotency_upstream_duration_seconds_bucket"));

    let stats: serde_json::Value = admin_get(&admin, "/admin/stats", Some(TOKEN))
        .await
        .json_value()
        .await;
    let orders = &stats["orders"];
    assert_eq!(orders["requests"], 5 + fills + 1);
    assert_eq!(orders["cache_hits"], 1);
    assert_eq!(orders["cache_misses"], 1 + fills);
    assert_eq!(orders["enforced"], 1);
    assert_eq!(orders["invalid_key"], 1);
    assert_eq!(orders["store_errors"], 1);
    assert_eq!(orders["responses_stored"], 1 + fills);

    // tenant_labels: false drops tenant and project.
    let (gw2, admin2) = start(&up, false, "1MiB").await;
    alice(&gw2.url("/api/v1/orders"), Some(&key("n")), "{}")
        .send()
        .await
        .unwrap();
    let text = admin_get(&admin2, "/metrics", None).await.text().await.unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with("idempotency_cache_miss_total{"))
        .unwrap();
    assert!(
        !line.contains("tenant=") && !line.contains("project=") && line.contains("endpoint=\"orders\""),
        "{line}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_api_needs_its_token_and_purge_frees_a_key() {
    let up = Upstream::start().await;
    let (gw, admin) = start(&up, true, "1MiB").await;
    for (token, want) in [(None, 401), (Some("wrong"), 401), (Some(TOKEN), 200)] {
        assert_eq!(
            admin_get(&admin, "/admin/stats", token).await.status().as_u16(),
            want,
            "{token:?}"
        );
    }
    assert_eq!(admin_get(&admin, "/healthz", None).await.status(), 200);
    assert_eq!(admin_get(&admin, "/readyz", None).await.status(), 200);

    let url = gw.url("/api/v1/orders");
    let k = key("purge");
    alice(&url, Some(&k), "{}").send().await.unwrap();
    let namespaced = format!("t-acme:p1:user%3Aalice:{k}");
    let path = format!("/admin/records/{}", namespaced.replace('%', "%25"));
    let rec: serde_json::Value = admin_get(&admin, &path, Some(TOKEN)).await.json_value().await;
    assert_eq!(rec["state"], "completed");
    assert!(rec.get("body").is_none(), "no body unless asked");
    let rec: serde_json::Value = admin_get(&admin, &format!("{path}?body=true"), Some(TOKEN))
        .await
        .json_value()
        .await;
    assert!(rec["body"].as_str().unwrap().contains("\"execution\""));

    // The CLI, against the admin API.
    let cli = |action: &str| {
        Command::new(env!("CARGO_BIN_EXE_idemgate"))
            .args(["records", action, &namespaced, "--admin", &admin])
            .env("IDEMGATE_ADMIN_TOKEN", TOKEN)
            .output()
            .unwrap()
    };
    let out = cli("inspect");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"completed\""));
    let out = cli("purge");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "{\"purged\":true}");
    assert_eq!(up.executions_ns(&namespaced), 1);
    let again = alice(&url, Some(&k), "{}").send().await.unwrap();
    assert!(
        header(&again, "idempotent-replayed").is_none(),
        "purged: the retry executes again"
    );
    assert_eq!(up.executions_ns(&namespaced), 2);
    assert!(String::from_utf8_lossy(&cli("inspect").stdout).contains("completed"));

    // Every endpoint the admin OpenAPI document lists answers (with the token).
    let doc: serde_json::Value = admin_get(&admin, "/admin/openapi.json", Some(TOKEN))
        .await
        .json_value()
        .await;
    assert_eq!(doc["openapi"], "3.1.0");
    for (p, item) in doc["paths"].as_object().unwrap() {
        if item.get("get").is_some() {
            let p = p.replace("{key}", &namespaced.replace('%', "%25"));
            let status = admin_get(&admin, &p, Some(TOKEN)).await.status();
            assert!(status.is_success(), "{p}: {status}");
        }
    }

    // Neither the token, the API key nor the raw idempotency key reaches the log.
    let log = gw.log();
    for secret in [TOKEN, "k-alice", k.as_str()] {
        assert!(!log.contains(secret), "{secret} leaked into the log");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_probe_answers_processing_first_then_asks() {
    let up = Upstream::start().await;
    let (gw, _admin) = start(&up, true, "1MiB").await;
    let k = key("probe");
    let first = alice(&gw.url("/api/v1/orders"), Some(&k), "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(header(&first, "idempotency-status"), Some("processing"));
    let replay = alice(&gw.url("/api/v1/orders"), Some(&k), "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(header(&replay, "idempotent-replayed"), Some("true"));
    assert_eq!(
        header(&replay, "idempotency-status"),
        Some("completed"),
        "the probe said completed"
    );
    let k = key("probe-down");
    alice(&gw.url("/probe-down"), Some(&k), "{}")
        .send()
        .await
        .unwrap();
    let replay = alice(&gw.url("/probe-down"), Some(&k), "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(
        header(&replay, "idempotency-status"),
        Some("processing"),
        "a failing probe falls back"
    );
    assert!(gw.log().contains("status probe failed"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_are_provisioned_through_the_admin_api() {
    let up = Upstream::start().await;
    let (gw, admin) = start(&up, true, "1MiB").await;
    let url = gw.url("/api/v1/orders");
    let as_bob = || post(&url, Some("bob-1"), "{}").header("x-api-key", "k-bob-new");
    assert_eq!(
        as_bob().send().await.unwrap().status(),
        401,
        "not provisioned yet"
    );
    let digest = hex::encode(Sha256::digest(b"k-bob-new"));
    let add =
        serde_json::json!({"key_sha256": digest, "tenant": "acme", "project": "p1", "subject": "user:bob"});
    let r = common::client()
        .post(format!("{admin}/admin/api-keys"))
        .bearer_auth(TOKEN)
        .body(add.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(as_bob().send().await.unwrap().status(), 201);
    let list = admin_get(&admin, "/admin/api-keys", Some(TOKEN))
        .await
        .json_value()
        .await;
    assert!(
        list.as_array()
            .unwrap()
            .iter()
            .any(|k| k["key_sha256"] == digest.as_str())
    );
    assert!(
        !list.to_string().contains("k-bob-new"),
        "only digests are ever shown"
    );
    // Written through to the key file, so it survives a restart.
    let file = std::fs::read_to_string(gw.file("keys.yaml")).unwrap();
    assert!(file.contains(&digest) && file.contains("user:bob"), "{file}");
    let r = common::client()
        .delete(format!("{admin}/admin/api-keys/{digest}"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.json_value().await["removed"], true);
    assert_eq!(
        as_bob().send().await.unwrap().status(),
        401,
        "removed keys stop working at once"
    );
    let bad = common::client()
        .post(format!("{admin}/admin/api-keys"))
        .bearer_auth(TOKEN)
        .body("{\"key_sha256\": \"nothex\", \"tenant\": \"a\", \"subject\": \"user:x\"}")
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhooks_are_provisioned_through_the_admin_api() {
    use hmac::{Hmac, Mac};
    let up = Upstream::start().await;
    let (gw, admin) = start(&up, true, "1MiB").await;
    let add =
        serde_json::json!({"tenant": "acme", "provider": "github", "secrets_env": ["TEST_HOOK_SECRET"]});
    let r = common::client()
        .post(format!("{admin}/admin/webhooks"))
        .bearer_auth(TOKEN)
        .body(add.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let id = r.json_value().await["id"].as_str().unwrap().to_owned();
    assert!(id.starts_with("wh_") && id.len() == 35, "{id}");
    let list = admin_get(&admin, "/admin/webhooks", Some(TOKEN))
        .await
        .json_value()
        .await;
    assert_eq!(list[0]["id"], id.as_str());
    assert!(
        !list.to_string().contains("test-only-hook-secret"),
        "secrets are never shown"
    );
    let body = r#"{"action":"opened"}"#;
    let mut mac = Hmac::<Sha256>::new_from_slice(b"test-only-hook-secret").unwrap();
    mac.update(body.as_bytes());
    let sig = format!("sha256={}", hex::encode(mac.finalize().into_bytes()));
    let deliver = || {
        common::client()
            .post(gw.url(&format!("/hooks/{id}")))
            .header("x-hub-signature-256", &sig)
            .header("x-github-delivery", "d-1")
            .body(body)
            .send()
    };
    assert_eq!(deliver().await.unwrap().status(), 201);
    let again = deliver().await.unwrap();
    assert_eq!(header(&again, "idempotent-replayed"), Some("true"));
    assert_eq!(up.counts.total(), 1);
    let r = common::client()
        .delete(format!("{admin}/admin/webhooks/{id}"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.json_value().await["removed"], true);
    assert_eq!(
        deliver().await.unwrap().status(),
        404,
        "a removed webhook is unknown"
    );
}

/// Validates an OpenAPI document with openapi-spec-validator (PyPI), installed by .ci/run into
/// the same venv as the webhook SDKs; `None` (skipped) without it.
fn validate_openapi(doc: &str) -> Option<Result<(), String>> {
    let dir = std::env::var("IDEMGATE_TEST_WEBHOOK_SDKS").ok()?;
    let python = format!("{dir}/venv/bin/python");
    let script =
        "import json, sys\nfrom openapi_spec_validator import validate\nvalidate(json.load(sys.stdin))\n";
    let mut child = Command::new(python)
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .ok()?;
    use std::io::Write as _;
    child.stdin.take().unwrap().write_all(doc.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    Some(if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openapi_documents_validate() {
    let up = Upstream::start().await;
    let (_gw, admin) = start(&up, true, "1MiB").await;
    let admin_doc = admin_get(&admin, "/admin/openapi.json", Some(TOKEN))
        .await
        .text()
        .await
        .unwrap();
    let demo = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/demo.yaml");
    let out = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["openapi", "--config", demo])
        .output()
        .unwrap();
    assert!(out.status.success());
    let client_doc = String::from_utf8(out.stdout).unwrap();
    for (name, doc) in [("admin", admin_doc), ("client", client_doc)] {
        match validate_openapi(&doc) {
            None => {
                println!("skipped: IDEMGATE_TEST_WEBHOOK_SDKS (with openapi-spec-validator) not set");
                return;
            }
            Some(result) => assert!(result.is_ok(), "{name} document: {result:?}"),
        }
    }
}
