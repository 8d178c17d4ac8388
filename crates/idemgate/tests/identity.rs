//! Identity and namespacing (SPEC 1, 5, 7): a stored response never crosses a tenant, a
//! project or a subject; recovery stays inside the caller's namespace; spoofed identity
//! headers never reach the upstream; JWTs are checked strictly.

mod common;

use std::time::{Duration, Instant};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use common::{Gateway, Upstream, header, key, slug};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use sha2::{Digest, Sha256};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/jwt");
const HS_SECRET: &str = "test-only-hs256-secret-of-enough-length";

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(format!("{FIXTURES}/{name}")).unwrap()
}

fn api_keys() -> String {
    let entry = |key: &str, tenant: &str, project: &str, subject: &str| {
        format!(
            "- {{key_sha256: {}, tenant: {tenant}, project: {project}, subject: \"{subject}\"}}\n",
            hex::encode(Sha256::digest(key.as_bytes()))
        )
    };
    [
        entry("k-alice", "acme", "p1", "user:alice"),
        entry("k-bob", "acme", "p1", "user:bob"),
        entry("k-alice-p2", "acme", "p2", "user:alice"),
        entry("k-globex", "globex", "p1", "user:alice"),
    ]
    .concat()
}

const CONFIG: &str = r#"
upstreams:
  app:
    url: {upstream}
identity:
  api_keys:
    file: api-keys.yaml
  jwt:
    issuer: https://auth.test/
    audience: api
    jwks_file: jwks.json
    hs256_secret_env: TEST_HS_SECRET
    claims: { tenant: tenant_id, project: project_id, subject: sub }
    subject_type: user
  trusted_headers:
    trusted_proxies: [127.0.0.2/32]
idempotency:
  wait_timeout: 1s
routes:
  - id: orders
    method: POST
    path: /api/v1/orders
    upstream: app
    policy: required
    recovery: true
  - id: tenant-orders
    method: POST
    path: /api/v1/tenant-orders
    upstream: app
    policy: required
    scope: tenant
  - id: projects
    method: POST
    path: /api/v1/tenant/projects
    upstream: app
    policy: required
    scope: project
    project: _tenant
  - id: echo
    method: POST
    path: /echo
    upstream: app
    policy: accepted
    scope: global
"#;

async fn start(up: &Upstream) -> Gateway {
    let keys = api_keys();
    let jwks = fixture("jwks1.json");
    Gateway::start_yaml(
        up,
        CONFIG,
        &[("TEST_HS_SECRET", HS_SECRET)],
        &[("api-keys.yaml", keys.as_bytes()), ("jwks.json", &jwks)],
    )
    .await
}

fn as_key(api_key: &str, url: &str, idem: Option<&str>, body: &str) -> reqwest::RequestBuilder {
    common::post(url, idem, body).header("x-api-key", api_key)
}

async fn body_of(r: reqwest::Response) -> (u16, bool, String) {
    let replayed = header(&r, "idempotent-replayed").is_some();
    (r.status().as_u16(), replayed, r.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_raw_key_never_crosses_tenant_project_or_subject() {
    let up = Upstream::start().await;
    let gw = start(&up).await;
    let url = gw.url("/api/v1/orders");
    for (a, b) in [
        ("k-alice", "k-globex"),
        ("k-alice", "k-alice-p2"),
        ("k-alice", "k-bob"),
    ] {
        let k = key("shared");
        let before = up.counts.total();
        let (sa, ra, first_a) = body_of(as_key(a, &url, Some(&k), "{}").send().await.unwrap()).await;
        let (sb, rb, first_b) = body_of(as_key(b, &url, Some(&k), "{}").send().await.unwrap()).await;
        assert_eq!(
            (sa, ra, sb, rb),
            (201, false, 201, false),
            "{a} and {b} each execute"
        );
        assert_ne!(first_a, first_b);
        assert_eq!(
            up.counts.total(),
            before + 2,
            "two separate executions for {a} / {b}"
        );
        let (_, replay_a, again_a) = body_of(as_key(a, &url, Some(&k), "{}").send().await.unwrap()).await;
        let (_, replay_b, again_b) = body_of(as_key(b, &url, Some(&k), "{}").send().await.unwrap()).await;
        assert!(replay_a && replay_b);
        assert_eq!(
            (again_a, again_b),
            (first_a, first_b),
            "each principal replays its own response"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wider_scopes_share_keys_as_configured() {
    let up = Upstream::start().await;
    let gw = start(&up).await;
    // scope: tenant — alice and bob of acme share one namespace.
    let k = key("tenant");
    let before = up.counts.total();
    let (_, _, first) = body_of(
        as_key("k-alice", &gw.url("/api/v1/tenant-orders"), Some(&k), "{}")
            .send()
            .await
            .unwrap(),
    )
    .await;
    let (_, replayed, second) = body_of(
        as_key("k-bob", &gw.url("/api/v1/tenant-orders"), Some(&k), "{}")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert!(replayed);
    assert_eq!(first, second);
    // scope: project with `project: _tenant` — projects p1 and p2 of acme share one namespace.
    let (_, _, first) = body_of(
        as_key("k-alice", &gw.url("/api/v1/tenant/projects"), Some(&k), "{}")
            .send()
            .await
            .unwrap(),
    )
    .await;
    let (_, replayed, second) = body_of(
        as_key("k-alice-p2", &gw.url("/api/v1/tenant/projects"), Some(&k), "{}")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert!(replayed);
    assert_eq!(first, second);
    assert_eq!(up.counts.total(), before + 2);
    // ... but never another tenant.
    let (_, replayed, _) = body_of(
        as_key("k-globex", &gw.url("/api/v1/tenant-orders"), Some(&k), "{}")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert!(!replayed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_callers_are_refused_where_the_scope_needs_a_principal() {
    let up = Upstream::start().await;
    let gw = start(&up).await;
    let r = common::post(&gw.url("/api/v1/orders"), Some("k1"), "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(slug(r).await, "unauthenticated");
    let r = as_key("wrong", &gw.url("/api/v1/orders"), Some("k1"), "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        401,
        "a wrong key is refused, not treated as anonymous"
    );
    let r = common::post(&gw.url("/api/v1/orders"), Some("k1"), "{}")
        .header("authorization", "Bearer k-alice")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "API keys work as bearer tokens too");
    assert_eq!(up.counts.total(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_stays_in_the_callers_namespace() {
    let up = Upstream::start().await;
    let gw = start(&up).await;
    let url = gw.url("/api/v1/orders");
    let recover = |api_key: &str, k: &str, suffix: &str| {
        common::client()
            .get(gw.url(&format!("/api/v1/orders/by-idempotency-key/{k}{suffix}")))
            .header("x-api-key", api_key)
            .send()
    };
    let alice_key = key("alice");
    let bob_key = key("bob");
    let (_, _, alices) = body_of(
        as_key("k-alice", &url, Some(&alice_key), "{}")
            .send()
            .await
            .unwrap(),
    )
    .await;
    as_key("k-bob", &url, Some(&bob_key), "{}").send().await.unwrap();

    let r = recover("k-alice", &alice_key, "").await.unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(header(&r, "idempotent-replayed"), Some("true"));
    assert_eq!(r.text().await.unwrap(), alices);
    let r = recover("k-alice", &alice_key, "/output").await.unwrap();
    assert_eq!(r.status(), 201);

    let r = recover("k-alice", &bob_key, "").await.unwrap();
    assert_eq!(r.status(), 404, "Alice cannot read Bob's outcome with Bob's key");
    assert_eq!(slug(r).await, "not-found");
    assert_eq!(recover("k-alice", "never-used", "").await.unwrap().status(), 404);
    let with_key = common::client()
        .get(gw.url(&format!("/api/v1/orders/by-idempotency-key/{alice_key}")))
        .header("x-api-key", "k-alice")
        .header("idempotency-key", "x")
        .send()
        .await
        .unwrap();
    assert_eq!(slug(with_key).await, "idempotency-key-not-allowed");

    // In flight: the plain route waits up to wait_timeout (1s), /output answers at once.
    let slow_key = key("slow");
    let slow = tokio::spawn(
        as_key("k-alice", &url, Some(&slow_key), "{}")
            .header("x-demo-delay-ms", "4000")
            .send(),
    );
    common::wait_until(Duration::from_secs(5), || {
        up.executions_ns(&format!("t-acme:p1:user%3Aalice:{slow_key}")) == 1
    })
    .await;
    let started = Instant::now();
    let r = recover("k-alice", &slow_key, "/output").await.unwrap();
    assert!(
        started.elapsed() < Duration::from_millis(800),
        "/output never waits"
    );
    assert_eq!(r.status(), 202);
    let started = Instant::now();
    let r = recover("k-alice", &slow_key, "").await.unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "waited for wait_timeout"
    );
    assert_eq!(r.status(), 202);
    assert_eq!(header(&r, "idempotency-status"), Some("processing"));
    assert!(header(&r, "retry-after").is_some());
    assert_eq!(slow.await.unwrap().unwrap().status(), 201);
    assert_eq!(recover("k-alice", &slow_key, "").await.unwrap().status(), 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spoofed_identity_headers_never_reach_the_upstream() {
    let up = Upstream::start().await;
    let gw = start(&up).await;
    let echo = |r: reqwest::RequestBuilder| async move {
        let v: serde_json::Value =
            serde_json::from_slice(&r.send().await.unwrap().bytes().await.unwrap()).unwrap();
        v["headers"].clone()
    };
    let spoof = |r: reqwest::RequestBuilder| {
        r.header("x-demo-echo-headers", "1")
            .header("x-tenant-id", "evil")
            .header("x-project-id", "evil")
            .header("x-subject", "user:mallory")
    };
    let anon = echo(spoof(common::post(&gw.url("/echo"), None, "{}"))).await;
    for h in ["x-tenant-id", "x-project-id", "x-subject"] {
        assert!(
            anon.get(h).is_none(),
            "anonymous: {h} reached the upstream: {anon}"
        );
    }
    let alice = echo(spoof(as_key("k-alice", &gw.url("/echo"), None, "{}"))).await;
    assert_eq!(alice["x-tenant-id"], "acme");
    assert_eq!(alice["x-project-id"], "p1");
    assert_eq!(alice["x-subject"], "user:alice");
    // Trusted headers count only from a trusted proxy address (127.0.0.2).
    let from = |ip: [u8; 4]| {
        reqwest::Client::builder()
            .no_proxy()
            .local_address(std::net::IpAddr::from(ip))
            .build()
            .unwrap()
    };
    let proxied = |ip| {
        from(ip)
            .post(gw.url("/echo"))
            .header("x-demo-echo-headers", "1")
            .header("x-tenant-id", "initech")
            .header("x-subject", "service:billing")
            .body("{}")
    };
    let trusted = echo(proxied([127, 0, 0, 2])).await;
    assert_eq!(trusted["x-tenant-id"], "initech");
    assert_eq!(trusted["x-subject"], "service:billing");
    assert_eq!(trusted["x-project-id"], "_tenant");
    let untrusted = echo(proxied([127, 0, 0, 1])).await;
    assert!(untrusted.get("x-tenant-id").is_none(), "{untrusted}");
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

fn claims(exp: i64, nbf: i64, iss: &str, aud: &str) -> serde_json::Value {
    let t = i64::try_from(now()).unwrap();
    serde_json::json!({"sub": "alice", "tenant_id": "acme", "project_id": "p1", "iss": iss, "aud": aud, "exp": t + exp, "nbf": t + nbf})
}

fn sign(alg: Algorithm, kid: Option<&str>, key: &EncodingKey, claims: &serde_json::Value) -> String {
    let mut h = Header::new(alg);
    h.kid = kid.map(str::to_owned);
    jsonwebtoken::encode(&h, claims, key).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jwts_are_checked_strictly_and_keys_rotate_without_restart() {
    let up = Upstream::start().await;
    let gw = start(&up).await;
    let rsa1 = EncodingKey::from_rsa_pem(&fixture("rsa1.pem")).unwrap();
    let rsa2 = EncodingKey::from_rsa_pem(&fixture("rsa2.pem")).unwrap();
    let ec1 = EncodingKey::from_ec_pem(&fixture("ec1.pem")).unwrap();
    let ed1 = EncodingKey::from_ed_pem(&fixture("ed1.pem")).unwrap();
    let hs = EncodingKey::from_secret(HS_SECRET.as_bytes());
    let good = claims(600, -10, "https://auth.test/", "api");
    let none_token = {
        let head = URL_SAFE_NO_PAD.encode(r#"{"alg":"none","typ":"JWT"}"#);
        let body = URL_SAFE_NO_PAD.encode(good.to_string());
        format!("{head}.{body}.")
    };
    let cases: Vec<(&str, String, u16)> = vec![
        (
            "valid RS256",
            sign(Algorithm::RS256, Some("rsa-1"), &rsa1, &good),
            201,
        ),
        (
            "valid ES256",
            sign(Algorithm::ES256, Some("ec-1"), &ec1, &good),
            201,
        ),
        (
            "valid EdDSA",
            sign(Algorithm::EdDSA, Some("ed-1"), &ed1, &good),
            201,
        ),
        ("valid HS256", sign(Algorithm::HS256, None, &hs, &good), 201),
        (
            "expired",
            sign(
                Algorithm::RS256,
                Some("rsa-1"),
                &rsa1,
                &claims(-120, -600, "https://auth.test/", "api"),
            ),
            401,
        ),
        (
            "not yet valid",
            sign(
                Algorithm::RS256,
                Some("rsa-1"),
                &rsa1,
                &claims(600, 300, "https://auth.test/", "api"),
            ),
            401,
        ),
        (
            "wrong signature",
            sign(Algorithm::RS256, Some("rsa-1"), &rsa2, &good),
            401,
        ),
        (
            "wrong issuer",
            sign(
                Algorithm::RS256,
                Some("rsa-1"),
                &rsa1,
                &claims(600, -10, "https://evil/", "api"),
            ),
            401,
        ),
        (
            "wrong audience",
            sign(
                Algorithm::RS256,
                Some("rsa-1"),
                &rsa1,
                &claims(600, -10, "https://auth.test/", "other"),
            ),
            401,
        ),
        ("alg none", none_token, 401),
        (
            "RS256 public key as HS256 secret",
            sign(
                Algorithm::HS256,
                Some("rsa-1"),
                &EncodingKey::from_secret(&fixture("rsa1.pub.pem")),
                &good,
            ),
            401,
        ),
        (
            "ES256 header on an RSA kid",
            sign(Algorithm::ES256, Some("rsa-1"), &ec1, &good),
            401,
        ),
    ];
    for (name, token, want) in cases {
        let r = common::post(&gw.url("/api/v1/orders"), Some(&key("jwt")), "{}")
            .bearer_auth(&token)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), want, "{name}");
        if want == 401 {
            assert_eq!(slug(r).await, "unauthenticated", "{name}");
        }
    }
    assert_eq!(up.counts.total(), 4, "only the valid tokens reached the upstream");

    // Rotation: rsa-2 is unknown until the JWKS file publishes it.
    let rotated = sign(Algorithm::RS256, Some("rsa-2"), &rsa2, &good);
    let send = || {
        common::post(&gw.url("/api/v1/orders"), Some(&key("rot")), "{}")
            .bearer_auth(&rotated)
            .send()
    };
    assert_eq!(send().await.unwrap().status(), 401);
    std::fs::write(gw.file("jwks.json.new"), fixture("jwks2.json")).unwrap();
    std::fs::rename(gw.file("jwks.json.new"), gw.file("jwks.json")).unwrap();
    assert_eq!(
        send().await.unwrap().status(),
        201,
        "accepted after the JWKS file changed, no restart"
    );
}
