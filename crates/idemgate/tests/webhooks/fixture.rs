//! The fixture of `tests/webhooks.rs`: a gateway with a route per provider, a registry file with
//! an entry per provider (secrets in its environment), and assertions on what the counting
//! upstream saw.

use std::time::{SystemTime, UNIX_EPOCH};

use idemgate_core::namespace::{Principal, Scope, namespaced_key};
use serde_json::Value;

use crate::common::{Gateway, Upstream, client, header, slug};

/// Registry ids: `wh_` + 32 lowercase hex digits.
pub fn id(n: u8) -> String {
    format!("wh_{:032x}", 0x5eed_0000_u128 + u128::from(n))
}

pub const STRIPE_OLD: &str = "whsec_old_7c1d2e3f4a5b6c7d8e9f";
pub const STRIPE_NEW: &str = "whsec_new_0a9b8c7d6e5f4a3b2c1d";
pub const GH_SECRET: &str = "gh-secret-It's a Secret to Everybody";
pub const TWILIO_TOKEN: &str = "twilio-auth-token-3f9a81";
pub const SW_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
pub const SHOPIFY_SECRET: &str = "shpss_5e1f0c2b";
pub const GITLAB_TOKEN: &str = "glpat-hook-token-77d1";
pub const GENERIC_SECRET: &str = "generic-secret-a0b1";
pub const BASE_URL: &str = "https://hooks.example.com";

pub const ENV: &[(&str, &str)] = &[
    ("WH_STRIPE_OLD", STRIPE_OLD),
    ("WH_STRIPE_NEW", STRIPE_NEW),
    ("WH_GITHUB", GH_SECRET),
    ("WH_TWILIO", TWILIO_TOKEN),
    ("WH_STANDARD", SW_SECRET),
    ("WH_SHOPIFY", SHOPIFY_SECRET),
    ("WH_GITLAB", GITLAB_TOKEN),
    ("WH_GENERIC", GENERIC_SECRET),
];

pub fn entry(n: u8, provider: &str, secrets: &str) -> String {
    format!(
        "- {{id: {}, tenant: acme, project: shop, provider: {provider}, secrets_env: [{secrets}]}}\n",
        id(n)
    )
}

/// Every provider's entry; 2 and 3 are two GitHub hooks of one repository.
pub fn registry() -> String {
    [
        entry(1, "stripe", "WH_STRIPE_OLD, WH_STRIPE_NEW"),
        entry(2, "github", "WH_GITHUB"),
        entry(3, "github", "WH_GITHUB"),
        entry(4, "twilio", "WH_TWILIO"),
        entry(5, "twilio_event_streams", "WH_TWILIO"),
        entry(6, "standard_webhooks", "WH_STANDARD"),
        entry(7, "shopify", "WH_SHOPIFY"),
        entry(8, "gitlab", "WH_GITLAB"),
        entry(9, "generic", "WH_GENERIC"),
    ]
    .concat()
}

pub fn route(provider: &str, extra: &str) -> String {
    format!(
        "  - id: {provider}\n    method: POST\n    path: /hooks/{provider}/{{webhook_id}}\n    upstream: app\n    policy: webhook\n    provider: {provider}\n{extra}"
    )
}

pub fn config_text() -> String {
    let mut yaml = String::from(
        "upstreams:\n  app:\n    url: {upstream}\nwebhooks:\n  registry: webhooks.yaml\nroutes:\n",
    );
    for p in [
        "stripe",
        "github",
        "twilio",
        "twilio_event_streams",
        "standard_webhooks",
        "shopify",
        "gitlab",
    ] {
        yaml.push_str(&route(p, ""));
    }
    yaml.push_str(&route(
        "generic",
        "    generic:\n      header: X-Signature\n      prefix: 'v1='\n      signed: '{header:X-Timestamp}.{body}'\n      identifier: {json_pointer: /event/id}\n",
    ));
    yaml
}

pub struct Setup {
    pub up: Upstream,
    pub gw: Gateway,
}

pub async fn start() -> Setup {
    let up = Upstream::start().await;
    let server = format!("  public_base_url: {BASE_URL}\n");
    let reg = registry();
    let gw = Gateway::start_yaml_with_server(
        &up,
        &server,
        &config_text(),
        ENV,
        &[("webhooks.yaml", reg.as_bytes())],
    )
    .await;
    Setup { up, gw }
}

impl Setup {
    pub async fn deliver(&self, path: &str, headers: &[(&str, &str)], body: &str) -> reqwest::Response {
        let mut req = client()
            .post(self.gw.url(path))
            .header("x-demo-echo-headers", "1")
            .body(body.to_owned());
        for (n, v) in headers {
            req = req.header(*n, *v);
        }
        req.send().await.unwrap()
    }

    /// Executions of the upstream for a delivery to entry `n` (keys as the upstream receives
    /// them).
    pub fn runs(&self, n: u8, provider: &str, identifier: &str) -> u64 {
        self.up.executions_ns(&ns_key(n, provider, identifier))
    }

    pub fn total(&self) -> u64 {
        self.up.counts.total()
    }

    /// Nothing secret reached the gateway's log.
    pub fn assert_log_clean(&self, also: &[&str]) {
        let log = self.gw.log();
        for (_, secret) in ENV {
            assert!(!log.contains(secret), "a secret is in the log");
        }
        for s in also {
            assert!(!log.contains(s), "`{s}` is in the log");
        }
    }
}

pub fn ns_key(n: u8, provider: &str, identifier: &str) -> String {
    let p = Principal::new("acme", "shop", "service:webhook-ingest");
    namespaced_key(
        Scope::Subject,
        Some(&p),
        &format!("{}/{provider}-{identifier}", id(n)),
    )
    .unwrap()
}

pub fn now() -> i64 {
    i64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs()).unwrap()
}

pub fn unique(prefix: &str) -> String {
    format!("{prefix}{:x}", idemgate_core::LeaseToken::random().0 >> 64)
}

/// A first delivery: executed, with the principal and namespaced key in the upstream's headers
/// and the original body.
pub async fn assert_executed(r: reqwest::Response, key: &str, body_len: usize) {
    assert_eq!(r.status(), 201, "{:?}", r.text().await);
    assert!(header(&r, "idempotent-replayed").is_none());
    let v: Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    assert_eq!(
        v["request_bytes"], body_len,
        "the upstream receives the original body"
    );
    let h = &v["headers"];
    assert_eq!(h["idempotency-key"], key);
    assert_eq!(h["x-tenant-id"], "acme");
    assert_eq!(h["x-project-id"], "shop");
    assert_eq!(h["x-subject"], "service:webhook-ingest");
}

pub fn assert_replayed(r: reqwest::Response) {
    assert_eq!(r.status(), 201);
    assert_eq!(header(&r, "idempotent-replayed"), Some("true"));
}

pub async fn assert_refused(r: reqwest::Response, status: u16, expected: &str) {
    assert_eq!(r.status(), status);
    assert_eq!(slug(r).await, expected);
}
