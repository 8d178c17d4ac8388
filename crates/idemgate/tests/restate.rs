//! Restate upstreams against a real Restate server (SPEC 9).
//!
//! Needs the server binary (`IDEMGATE_TEST_RESTATE_BIN`, installed by `.ci/run` from npm's
//! `@restatedev/restate-server-linux-x64`); without it the test prints that it was skipped.
//! The server tries to reach the internet at start, so everything runs in a private network
//! namespace: the test re-executes itself under `unshare --net` (loopback only), and inside it
//! starts the Restate server, the test service (`crates/restate-test-service`, built on demand),
//! the gateway and the clients. One Restate boot serves every scenario, one after the other.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

/// Set in the re-executed test inside the network namespace.
const IN_NETNS: &str = "IDEMGATE_TEST_RESTATE_IN_NETNS";
const SERVICE_VAR: &str = "IDEMGATE_TEST_RESTATE_SERVICE";
/// Restate's default ports are free in a fresh namespace.
const INGRESS: &str = "http://127.0.0.1:8080";
const ADMIN: &str = "http://127.0.0.1:9070";
const SERVICE_ADDR: &str = "127.0.0.1:9080";
/// Bound on the whole run inside the namespace.
const RUN_LIMIT: Duration = Duration::from_secs(240);

#[test]
fn restate_upstream() {
    let Some(server) = std::env::var_os("IDEMGATE_TEST_RESTATE_BIN") else {
        eprintln!(
            "restate: skipped (set IDEMGATE_TEST_RESTATE_BIN to a restate-server binary; .ci/run installs one)"
        );
        return;
    };
    if std::env::var_os(IN_NETNS).is_some() {
        let service = PathBuf::from(std::env::var_os(SERVICE_VAR).expect("service path"));
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
            .block_on(scenarios(Path::new(&server), &service));
        return;
    }
    let service = service_binary();
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new("unshare")
        .args([
            "--net",
            "--",
            "sh",
            "-c",
            "ip link set lo up && exec \"$0\" \"$@\"",
        ])
        .arg(exe)
        .args(["--exact", "restate_upstream", "--nocapture", "--test-threads=1"])
        .env(IN_NETNS, "1")
        .env(SERVICE_VAR, &service)
        .spawn()
        .expect("unshare (util-linux) is needed to run the Restate tests");
    let deadline = Instant::now() + RUN_LIMIT + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the Restate scenarios did not finish within {RUN_LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "the Restate scenarios failed (output above)");
}

/// The test service binary in this test's target directory, (re)built first so that a
/// `cargo test -p idemgate` never runs a stale one (a no-op when it is up to date).
fn service_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/restate-<hash> -> target/<profile>/restate-test-service
    let profile_dir = exe.parent().and_then(Path::parent).unwrap().to_path_buf();
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../restate-test-service/Cargo.toml");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut build = Command::new(cargo);
    build
        .args(["build", "--quiet", "--manifest-path"])
        .arg(&manifest)
        .arg("--target-dir")
        .arg(profile_dir.parent().unwrap());
    if profile_dir.ends_with("release") {
        build.arg("--release");
    }
    assert!(
        build.status().expect("cargo").success(),
        "could not build the Restate test service"
    );
    let bin = profile_dir.join("restate-test-service");
    assert!(bin.exists(), "{} is missing", bin.display());
    bin
}

/// A child process killed when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(cmd: &mut Command, log: &Path) -> Proc {
    let out = std::fs::File::create(log).unwrap();
    Proc(
        cmd.stdout(Stdio::from(out.try_clone().unwrap()))
            .stderr(Stdio::from(out))
            .spawn()
            .unwrap(),
    )
}

/// Polls an async condition until it holds, failing after `limit`.
async fn eventually<F, Fut>(limit: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while !cond().await {
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

async fn ok(url: &str) -> bool {
    common::client()
        .get(url)
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
}

const API_KEYS: [(&str, &str, &str); 3] = [
    ("k-alice", "acme", "user:alice"),
    ("k-bob", "acme", "user:bob"),
    // Another tenant, the same subject name: only the tenant tells them apart.
    ("k-carol", "globex", "user:alice"),
];

const CONFIG: &str = r"server:
  listen: {listen}
store:
  kind: memory
upstreams:
  checkout:
    kind: restate
    url: http://127.0.0.1:8080
    admin_url: http://127.0.0.1:9070
    timeout: 10s
identity:
  api_keys:
    file: keys.yaml
idempotency:
  wait_timeout: 1s
routes:
  - id: create
    method: POST
    path: /api/v1/checkout
    upstream: checkout
    target: Checkout/create
    policy: required
    retention: 48h
    recovery: true
  - id: pay
    method: POST
    path: /api/v1/pay
    upstream: checkout
    target: Checkout/fail
    policy: required
    retention: 48h
  - id: internal
    method: POST
    path: /api/v1/internal
    upstream: checkout
    target: Checkout/create
    policy: handler_internal
  - id: slow
    method: POST
    path: /api/v1/slow
    upstream: checkout
    target: Checkout/stuck
    policy: required
    retention: 48h
    recovery: true
";

/// Everything Restate-side is up and the deployment registered; then the scenarios.
async fn scenarios(server: &Path, service: &Path) {
    let dir = tempfile::tempdir().unwrap();
    let _restate = spawn(
        Command::new(server)
            .args(["--no-logo", "--node-name", "n1", "--base-dir"])
            .arg(dir.path().join("restate")),
        &dir.path().join("restate.log"),
    );
    let service_log = dir.path().join("service.log");
    let _service = spawn(Command::new(service).arg(SERVICE_ADDR), &service_log);
    eventually(Duration::from_secs(60), "Restate healthy", || async {
        ok(&format!("{ADMIN}/health")).await && ok(&format!("{INGRESS}/restate/health")).await
    })
    .await;
    let keys: String = API_KEYS
        .iter()
        .map(|(key, tenant, subject)| {
            format!(
                "- {{key_sha256: {}, tenant: {tenant}, project: p1, subject: \"{subject}\"}}\n",
                hex::encode(Sha256::digest(key.as_bytes()))
            )
        })
        .collect();
    let demo = common::Upstream::start().await;
    let gw = common::Gateway::start_full(&demo, CONFIG, &[], &[("keys.yaml", keys.as_bytes())]).await;
    // Registered after the gateway started, as in a deployment where idemgate comes up first:
    // its first retention write may find no service yet (404) and is then retried.
    let registered = common::client()
        .post(format!("{ADMIN}/deployments"))
        .header("content-type", "application/json")
        .body(serde_json::json!({ "uri": format!("http://{SERVICE_ADDR}") }).to_string())
        .send()
        .await
        .unwrap();
    assert!(
        registered.status().is_success(),
        "register: {}",
        registered.text().await.unwrap()
    );
    let t = T {
        gw: &gw,
        service_log: &service_log,
    };
    t.concurrent_duplicates_run_once_and_replay().await;
    t.terminal_errors_are_replayed().await;
    t.tenants_with_the_same_raw_key_run_apart().await;
    t.recovery_by_key_is_the_callers_own().await;
    t.reused_key_with_another_body_is_422().await;
    t.retention_reaches_restate().await;
    t.policies_apply_before_restate().await;
    eprintln!("restate: all scenarios passed");
}

/// The scenarios' shared handles.
struct T<'a> {
    gw: &'a common::Gateway,
    service_log: &'a Path,
}

async fn json(r: reqwest::Response) -> serde_json::Value {
    serde_json::from_slice(&r.bytes().await.unwrap()).unwrap()
}

/// SPEC 5, 9: the word never reaches a client, in a header's name or its value.
fn assert_no_restate(r: &reqwest::Response) {
    for (name, value) in r.headers() {
        let v = String::from_utf8_lossy(value.as_bytes()).to_lowercase();
        assert!(
            !name.as_str().contains("restate") && !v.contains("restate"),
            "{name}: {v}"
        );
    }
}

impl T<'_> {
    fn post(
        &self,
        path: &str,
        api_key: &str,
        key: Option<&str>,
        body: &serde_json::Value,
    ) -> reqwest::RequestBuilder {
        common::post(&self.gw.url(path), key, &body.to_string()).header("x-api-key", api_key)
    }

    fn get(&self, path: &str, api_key: &str) -> reqwest::RequestBuilder {
        common::client()
            .get(self.gw.url(path))
            .header("x-api-key", api_key)
    }

    /// Executions of `handler` the service printed for a body `name`.
    fn executions(&self, handler: &str, name: &str) -> usize {
        let prefix = format!("executed {handler} ");
        let needle = format!(" name={name} ");
        std::fs::read_to_string(self.service_log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with(&prefix) && l.contains(&needle))
            .count()
    }

    async fn concurrent_duplicates_run_once_and_replay(&self) {
        let k = common::key("dup");
        let body = serde_json::json!({"name": k, "delay_ms": 800});
        let sends = (0..8).map(|_| self.post("/api/v1/checkout", "k-alice", Some(&k), &body).send());
        let answers = futures_join(sends).await;
        let mut seen = Vec::new();
        for r in answers {
            let r = r.unwrap();
            assert_eq!(r.status(), 200);
            assert_no_restate(&r);
            let op = common::header(&r, "x-operation-id").unwrap().to_owned();
            seen.push((op, json(r).await));
        }
        assert!(seen.windows(2).all(|w| w[0] == w[1]), "{seen:?}");
        assert_eq!(
            self.executions("create", &k),
            1,
            "8 concurrent duplicates, one execution: {}",
            std::fs::read_to_string(self.service_log).unwrap_or_default()
        );
        let (op, first) = &seen[0];
        let fresh_key = common::key("fresh");
        let fresh_body = serde_json::json!({"name": fresh_key});
        let fresh = self.post("/api/v1/checkout", "k-alice", Some(&fresh_key), &fresh_body);
        let fresh = fresh.send().await.unwrap();
        assert_eq!(fresh.status(), 200);
        assert_eq!(
            common::header(&fresh, "idempotent-replayed"),
            None,
            "a first execution"
        );
        assert!(op.starts_with("inv_"), "{op}");
        assert_eq!(first["tenant"], "acme");

        let replay = self
            .post("/api/v1/checkout", "k-alice", Some(&k), &body)
            .send()
            .await
            .unwrap();
        assert_eq!(replay.status(), 200);
        assert_no_restate(&replay);
        assert_eq!(common::header(&replay, "x-operation-id"), Some(op.as_str()));
        assert_eq!(common::header(&replay, "idempotent-replayed"), Some("true"));
        let expires = common::header(&replay, "idempotency-expires").expect("Idempotency-Expires");
        assert!(humantime::parse_rfc3339_weak(&expires[..19]).is_ok(), "{expires}");
        assert_eq!(&json(replay).await, first);
        assert_eq!(self.executions("create", &k), 1);
        eprintln!("restate: concurrent duplicates ran once; the replay is the same");
    }

    async fn terminal_errors_are_replayed(&self) {
        let k = common::key("pay");
        let body = serde_json::json!({"name": k});
        let first = self
            .post("/api/v1/pay", "k-alice", Some(&k), &body)
            .send()
            .await
            .unwrap();
        assert_eq!(first.status(), 409);
        assert_no_restate(&first);
        let op = common::header(&first, "x-operation-id").unwrap().to_owned();
        let first = json(first).await;
        assert_eq!(first["message"], "insufficient funds");
        let again = self
            .post("/api/v1/pay", "k-alice", Some(&k), &body)
            .send()
            .await
            .unwrap();
        assert_eq!(again.status(), 409);
        assert_eq!(common::header(&again, "x-operation-id"), Some(op.as_str()));
        assert!(common::header(&again, "idempotency-expires").is_some());
        assert_eq!(json(again).await, first);
        assert_eq!(self.executions("fail", &k), 1, "a terminal error is not retried");
        eprintln!("restate: a terminal error is replayed");
    }

    async fn tenants_with_the_same_raw_key_run_apart(&self) {
        let k = common::key("shared");
        let body = serde_json::json!({"name": k});
        let acme = self
            .post("/api/v1/checkout", "k-alice", Some(&k), &body)
            .send()
            .await
            .unwrap();
        let globex = self
            .post("/api/v1/checkout", "k-carol", Some(&k), &body)
            .send()
            .await
            .unwrap();
        assert_eq!((acme.status().as_u16(), globex.status().as_u16()), (200, 200));
        assert_ne!(
            common::header(&acme, "x-operation-id"),
            common::header(&globex, "x-operation-id")
        );
        assert_eq!(json(acme).await["tenant"], "acme");
        assert_eq!(json(globex).await["tenant"], "globex");
        assert_eq!(self.executions("create", &k), 2, "one execution per tenant");
        eprintln!("restate: two tenants with one raw key ran separately");
    }

    async fn recovery_by_key_is_the_callers_own(&self) {
        let k = common::key("rec");
        let body = serde_json::json!({"name": k});
        let created = self
            .post("/api/v1/checkout", "k-alice", Some(&k), &body)
            .send()
            .await
            .unwrap();
        assert_eq!(created.status(), 200);
        let op = common::header(&created, "x-operation-id").unwrap().to_owned();
        let created = json(created).await;
        for suffix in ["", "/output"] {
            let path = format!("/api/v1/checkout/by-idempotency-key/{k}{suffix}");
            let mine = self.get(&path, "k-alice").send().await.unwrap();
            assert_eq!(mine.status(), 200, "{path}");
            assert_no_restate(&mine);
            assert_eq!(common::header(&mine, "x-operation-id"), Some(op.as_str()));
            assert_eq!(common::header(&mine, "idempotent-replayed"), Some("true"));
            assert_eq!(json(mine).await, created);
            // Bob has Alice's raw key, but his namespace holds nothing under it.
            let bobs = self.get(&path, "k-bob").send().await.unwrap();
            assert_eq!(bobs.status(), 404, "{path}");
            assert_no_restate(&bobs);
            assert_eq!(common::slug(bobs).await, "not-found");
        }
        let unknown = self
            .get("/api/v1/checkout/by-idempotency-key/never-sent", "k-alice")
            .send()
            .await
            .unwrap();
        assert_eq!(unknown.status(), 404);
        assert_eq!(common::slug(unknown).await, "not-found");

        // Still running: `/output` answers 202 at once, a plain recovery after `wait_timeout`.
        let k = common::key("slow");
        let body = serde_json::json!({"name": k, "delay_ms": 4000});
        let running = tokio::spawn(self.post("/api/v1/slow", "k-alice", Some(&k), &body).send());
        let log = self.service_log.to_path_buf();
        let name = k.clone();
        eventually(Duration::from_secs(10), "slow handler started", || {
            let started = std::fs::read_to_string(&log)
                .unwrap_or_default()
                .contains(&format!(" name={name} "));
            async move { started }
        })
        .await;
        for suffix in ["/output", ""] {
            let path = format!("/api/v1/slow/by-idempotency-key/{k}{suffix}");
            let r = self.get(&path, "k-alice").send().await.unwrap();
            assert_eq!(r.status(), 202, "{path}");
            assert_no_restate(&r);
            assert_eq!(common::header(&r, "idempotency-status"), Some("processing"));
            assert!(common::header(&r, "retry-after").is_some());
        }
        let done = running.await.unwrap().unwrap();
        assert_eq!(done.status(), 200);
        let path = format!("/api/v1/slow/by-idempotency-key/{k}");
        let r = self.get(&path, "k-alice").send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(json(r).await["done"], true);
        eprintln!("restate: recovery works for the owner, 404 for another subject, 202 while running");
    }

    async fn reused_key_with_another_body_is_422(&self) {
        let k = common::key("reuse");
        let first = self
            .post(
                "/api/v1/checkout",
                "k-alice",
                Some(&k),
                &serde_json::json!({"name": k}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(first.status(), 200);
        let other = format!("{k}-other");
        let reused = self
            .post(
                "/api/v1/checkout",
                "k-alice",
                Some(&k),
                &serde_json::json!({"name": other}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(reused.status(), 422);
        assert_eq!(common::slug(reused).await, "idempotency-key-reused");
        // The same key on another Restate route is another request too.
        let elsewhere = self
            .post(
                "/api/v1/pay",
                "k-alice",
                Some(&k),
                &serde_json::json!({"name": k}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(elsewhere.status(), 422);
        assert_eq!(self.executions("create", &other), 0);
        assert_eq!(self.executions("fail", &k), 0);
        // Keys order and whitespace do not matter (canonical JSON): still a replay.
        let same = self
            .post(
                "/api/v1/checkout",
                "k-alice",
                Some(&k),
                &serde_json::json!({"name": k}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(same.status(), 200);
        assert_eq!(self.executions("create", &k), 1);
        eprintln!("restate: a reused key with another body is 422");
    }

    async fn retention_reaches_restate(&self) {
        // 48h, written by the gateway at start through the admin API.
        eventually(Duration::from_secs(30), "retention applied", || async {
            let Ok(r) = common::client()
                .get(format!("{ADMIN}/services/Checkout"))
                .send()
                .await
            else {
                return false;
            };
            let v: serde_json::Value =
                serde_json::from_slice(&r.bytes().await.unwrap_or_default()).unwrap_or_default();
            v["idempotency_retention"] == "2d"
        })
        .await;
        let log = self.gw.log();
        assert!(
            log.contains("applied the route retention to the Restate service"),
            "{log}"
        );
        let retried = log.matches("could not apply the retention").count();
        eprintln!(
            "restate: route retention is visible in Restate's service configuration \
             ({retried} attempt(s) retried before the deployment was registered)"
        );
    }

    async fn policies_apply_before_restate(&self) {
        let body = serde_json::json!({"name": "no-key"});
        let r = self
            .post("/api/v1/checkout", "k-alice", None, &body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
        assert_eq!(common::slug(r).await, "missing-idempotency-key");
        let r = self
            .post("/api/v1/checkout", "k-alice", Some("t-forged"), &body)
            .send()
            .await
            .unwrap();
        assert_eq!(common::slug(r).await, "invalid-idempotency-key");
        let r = common::post(&self.gw.url("/api/v1/checkout"), Some("anon"), &body.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(common::slug(r).await, "unauthenticated");
        assert_eq!(self.executions("create", "no-key"), 0);
        // `handler_internal`: the client's Idempotency-Key is not idemgate's to read, and it
        // must not become Restate's either (Restate would deduplicate it across tenants).
        let k = common::key("internal");
        let body = serde_json::json!({"name": k});
        for api_key in ["k-alice", "k-carol"] {
            let r = self
                .post("/api/v1/internal", api_key, Some(&k), &body)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
        }
        assert_eq!(self.executions("create", &k), 2, "no raw key reached Restate");
        eprintln!("restate: policies refuse before Restate; handler_internal keys never reach it");
    }
}

/// Runs request futures concurrently (each on its own task), in order.
async fn futures_join<F>(futs: impl Iterator<Item = F>) -> Vec<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futs.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}
