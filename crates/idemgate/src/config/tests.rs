//! Config parsing: the contract's keys, strictness, and errors that name key and line.

use super::*;
use http::Method;
use idemgate_core::engine::{Concurrency, LeaseExpiry};

const MINIMAL: &str = "
server:
  listen: 127.0.0.1:18080
  max_request_body: 512KiB
store:
  kind: memory
  max_bytes: 1MiB
upstreams:
  orders:
    url: http://127.0.0.1:3000
    timeout: 250ms
idempotency:
  retention: 24h
  lease: 30s
  concurrent: wait
  wait_timeout: 10s
  max_key_length: 64
  reserved_prefixes: [\"t-\", \"x-\"]
  replayed_header: X-Idempotent-Replayed
  max_response_bytes: 1MiB
  store_server_errors: false
  on_lease_expiry: retry
routes:
  - id: refund
    method: POST
    path: /api/v1/orders/{order_id}/refunds
    upstream: orders
    policy: required
    retention: 30d
    on_lease_expiry: fail
    concurrent: reject
  - id: everything-else
    method: [POST, PATCH]
    path: /**
    upstream: orders
    policy: accepted
";

fn err(yaml: &str) -> String {
    Config::from_yaml(yaml).expect_err("must be refused").0
}

#[test]
fn minimal_config_resolves_with_overrides_and_defaults() {
    let c = Config::from_yaml(MINIMAL).unwrap();
    assert_eq!(c.listen.to_string(), "127.0.0.1:18080");
    assert_eq!(c.max_request_body, 512 * 1024);
    assert_eq!(c.store.kind, StoreKind::Memory);
    assert_eq!(c.store.max_bytes, 1024 * 1024);
    let refund = c.routes.find(&Method::POST, "/api/v1/orders/7/refunds").unwrap();
    assert_eq!(&*refund.id, "refund");
    assert_eq!(refund.engine.retention, Duration::from_secs(30 * 86400));
    assert_eq!(refund.engine.on_lease_expiry, LeaseExpiry::Fail);
    assert_eq!(refund.engine.concurrent, Concurrency::Reject);
    assert_eq!(refund.on_store_error, OnStoreError::FailClosed);
    assert_eq!(refund.replayed_header.as_str(), "x-idempotent-replayed");
    assert_eq!(refund.keys.max_len, 64);
    assert_eq!(refund.upstream.timeout, Duration::from_millis(250));
    let other = c.routes.find(&Method::PATCH, "/x").unwrap();
    assert_eq!(other.engine.retention, Duration::from_secs(86400));
    assert_eq!(other.engine.concurrent, Concurrency::Wait);
    assert_eq!(other.on_store_error, OnStoreError::FailOpen);
    assert!(c.routes.find(&Method::GET, "/x").is_none());
}

#[test]
fn unknown_keys_are_named_with_their_line() {
    let yaml = MINIMAL.replace("    timeout: 250ms", "    timeout: 250ms\n    retries: 3");
    let e = err(&yaml);
    assert!(e.contains("retries") && e.contains("line 12"), "{e}");
    let e = err(&MINIMAL.replace("policy: accepted", "policy: accepted\n    colour: red"));
    assert!(e.contains("colour") && e.contains("line"), "{e}");
}

#[test]
fn unlanded_features_are_refused_not_ignored() {
    // Webhooks landed (issue 5): a registry that cannot be read is named with its line.
    let e = err(&format!("{MINIMAL}webhooks:\n  registry: ./webhooks.yaml\n"));
    assert!(e.contains("webhooks.registry") && e.contains("line 37"), "{e}");
    let e = err(&MINIMAL.replace(
        "policy: accepted",
        "policy: accepted\n    status: {resource_id: /id, probe: http://x}",
    ));
    // The status probe landed (SPEC 8): a probe URL without `{resource_id}` is refused.
    assert!(e.contains("status.probe") && e.contains("{resource_id}"), "{e}");
    // Restate upstreams landed (issue 7): a route to one needs a target, and only they take one.
    let e = err(&MINIMAL.replace("    timeout: 250ms", "    kind: restate"));
    assert!(e.contains(".target") && e.contains("Service/handler"), "{e}");
    let e = err(&MINIMAL.replace("    timeout: 250ms", "    admin_url: http://127.0.0.1:9070"));
    assert!(e.contains("admin_url") && e.contains("kind: restate"), "{e}");
    let e = err(&MINIMAL.replace("policy: accepted", "policy: accepted\n    target: Svc/h"));
    assert!(
        e.contains("target") && e.contains("only routes to a `kind: restate`"),
        "{e}"
    );
}

#[test]
fn the_example_file_is_refused_only_for_its_missing_files() {
    // Every feature of the example has landed; what is missing next to it is its key file.
    let example = include_str!("../../../../../shared/idemgate.example.yaml");
    let e = err(example);
    assert!(
        e.contains("api-keys.yaml") && !e.contains("not supported yet"),
        "{e}"
    );
}

#[test]
fn bad_values_name_the_key() {
    let e = err(&MINIMAL.replace("retention: 30d", "retention: forever"));
    assert!(e.contains("forever") && e.contains("line"), "{e}");
    let e = err(&MINIMAL.replace(
        "upstream: orders\n    policy: required",
        "upstream: nowhere\n    policy: required",
    ));
    assert!(
        e.contains("routes[0] (refund).upstream") && e.contains("line 24"),
        "{e}"
    );
    let e = err(&MINIMAL.replace("/api/v1/orders/{order_id}/refunds", "/a/**/b"));
    assert!(e.contains(".path"), "{e}");
    let e = err(&MINIMAL.replace("max_key_length: 64", "key_pattern: \"([\""));
    assert!(e.contains("key_pattern"), "{e}");
    let e = err(&MINIMAL.replace("id: everything-else", "id: refund"));
    assert!(e.contains("duplicate"), "{e}");
}

#[test]
fn upstream_shortcut() {
    let c = Config::for_upstream("http://127.0.0.1:3000", None).unwrap();
    let r = c.routes.find(&Method::POST, "/anything/at/all").unwrap();
    assert_eq!(r.policy, PolicyKind::Accepted);
    assert_eq!(r.scope, Scope::Global);
    assert_eq!(c.store.kind, StoreKind::Embedded);
    assert_eq!(c.store.path, PathBuf::from("./idemgate-data"));
    assert!(c.routes.find(&Method::GET, "/x").is_none());
    assert!(Config::for_upstream("ftp://x", None).is_err());
}

#[test]
fn identity_methods_keep_their_order_and_default_scope_becomes_subject() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("keys.yaml"), "[]").unwrap();
    let yaml = MINIMAL.replace(
        "idempotency:\n",
        "identity:\n  trusted_headers:\n    trusted_proxies: [10.0.0.0/8]\n  api_keys:\n    file: keys.yaml\nidempotency:\n",
    );
    let c = Config::from_yaml_in(&yaml, dir.path()).unwrap();
    assert!(c.identity.is_some());
    assert_eq!(c.routes.find(&Method::POST, "/x").unwrap().scope, Scope::Subject);
    let e = Config::from_yaml_in(&yaml.replace("keys.yaml", "missing.yaml"), dir.path())
        .unwrap_err()
        .0;
    assert!(e.contains("identity.api_keys.file") && e.contains("line"), "{e}");
    let e = err(&yaml.replace("  api_keys:", "  ldap:"));
    assert!(e.contains("ldap"), "{e}");
    let e = err(&yaml.replace("10.0.0.0/8", "not-a-net"));
    assert!(e.contains("not-a-net"), "{e}");
}

#[test]
fn shared_stores_need_a_url_and_take_only_their_keys() {
    let store = |block: &str| MINIMAL.replace("store:\n  kind: memory\n  max_bytes: 1MiB\n", block);
    let c = Config::from_yaml(&store(
        "store:\n  kind: redis\n  url: redis://127.0.0.1:6379/2\n  timeout: 250ms\n  prefix: gw-eu\n",
    ))
    .unwrap();
    assert_eq!(c.store.kind, StoreKind::Redis);
    assert_eq!(c.store.url.as_deref(), Some("redis://127.0.0.1:6379/2"));
    assert_eq!(c.store.timeout, Duration::from_millis(250));
    assert_eq!(c.store.prefix, "gw-eu");
    let c = Config::from_yaml(&store(
        "store:\n  kind: postgres\n  url: postgres://u@db/idemgate\n  pool_size: 4\n",
    ))
    .unwrap();
    assert_eq!((c.store.pool_size, c.store.timeout), (4, Duration::from_secs(2)));
    for (block, want) in [
        ("store:\n  kind: redis\n", "store.url"),
        ("store:\n  kind: postgres\n", "store.url"),
        ("store:\n  kind: memory\n  url: redis://x\n", "store.url"),
        ("store:\n  kind: redis\n  url: http://x\n", "store.url"),
        (
            "store:\n  kind: postgres\n  url: \"postgres://db:notaport/x\"\n",
            "store.url",
        ),
        (
            "store:\n  kind: postgres\n  url: postgres://db/x\n  prefix: p\n",
            "store.prefix",
        ),
        (
            "store:\n  kind: redis\n  url: redis://x\n  pool_size: 2\n",
            "store.pool_size",
        ),
        (
            "store:\n  kind: redis\n  url: redis://x\n  timeout: 1ms\n",
            "store.timeout",
        ),
    ] {
        let e = err(&store(block));
        assert!(e.contains(want), "{block}: {e}");
    }
}
