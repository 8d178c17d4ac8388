//! Black-box harness: the real `idemgate` binary over loopback, in front of the counting demo
//! upstream running in the test process.

#![allow(dead_code)] // each test binary uses a different subset

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemgate::demo::Counts;

/// The counting upstream.
pub struct Upstream {
    pub addr: SocketAddr,
    pub counts: Arc<Counts>,
}

impl Upstream {
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let counts = Arc::new(Counts::default());
        tokio::spawn(idemgate::demo::serve(listener, counts.clone()));
        Self { addr, counts }
    }

    /// Executions seen for a raw key (the upstream receives the namespaced, global-scope key).
    pub fn executions(&self, raw: &str) -> u64 {
        self.counts.for_key(&format!("t-*:*:*:{raw}"))
    }
}

/// The routes every black-box test runs against; `{upstream}` is filled in.
pub const ROUTES: &str = r"
routes:
  - id: orders
    method: POST
    path: /api/v1/orders
    upstream: app
    policy: required
    scope: global
  - id: other
    method: POST
    path: /api/v1/other
    upstream: app
    policy: required
    scope: global
  - id: reject
    method: POST
    path: /reject
    upstream: app
    policy: required
    scope: global
    concurrent: reject
  - id: fail
    method: POST
    path: /fail
    upstream: app
    policy: required
    scope: global
    on_lease_expiry: fail
  - id: small
    method: POST
    path: /small
    upstream: app
    policy: required
    scope: global
    max_response_bytes: 1KiB
  - id: stored-5xx
    method: POST
    path: /stored-5xx
    upstream: app
    policy: required
    scope: global
    store_server_errors: true
  - id: search
    method: POST
    path: /search
    upstream: app
    policy: prohibited
  - id: internal
    method: POST
    path: /internal/{id}
    upstream: app
    policy: handler_internal
  - id: catch-all
    method: [POST, PATCH]
    path: /**
    upstream: app
    policy: accepted
    scope: global
";

/// A gateway process and its files (kept across restarts).
pub struct Gateway {
    pub addr: SocketAddr,
    child: Option<Child>,
    dir: tempfile::TempDir,
    config: PathBuf,
    log: PathBuf,
}

pub fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

impl Gateway {
    /// Starts a gateway with `store` (`memory` or `embedded`), `extra` YAML under
    /// `idempotency:` and the standard routes.
    pub async fn start(upstream: &Upstream, store: &str, idempotency: &str) -> Self {
        Self::start_with(upstream, store, idempotency, "").await
    }

    pub async fn start_with(upstream: &Upstream, store: &str, idempotency: &str, server: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let addr = free_addr();
        let yaml = format!(
            "server:\n  listen: {addr}\n  shutdown_timeout: 10s\n{server}store:\n  kind: {store}\n{path}upstreams:\n  app:\n    url: http://{up}\n    timeout: 5s\nidempotency:\n  lease: 1s\n  wait_timeout: 10s\n{idempotency}{ROUTES}",
            path = if store == "embedded" {
                format!("  path: {}\n", dir.path().join("data").display())
            } else {
                String::new()
            },
            up = upstream.addr,
        );
        let config = dir.path().join("idemgate.yaml");
        std::fs::write(&config, yaml).unwrap();
        let log = dir.path().join("gateway.log");
        let mut gw = Self {
            addr,
            child: None,
            dir,
            config,
            log,
        };
        gw.spawn().await;
        gw
    }

    async fn spawn(&mut self) {
        self.spawn_env(&[]).await;
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// `kill -9`.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }

    /// SIGTERM, then wait for the exit (bounded).
    pub async fn sigterm(&mut self) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("running");
        Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = c.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "gateway did not exit after SIGTERM");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn restart(&mut self) {
        self.kill9();
        self.spawn().await;
    }

    pub fn config_path(&self) -> &str {
        self.config.to_str().unwrap()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Polls `cond` until it holds, failing the test after `limit`.
pub async fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(Instant::now() < deadline, "condition not met within {limit:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

/// A POST with an idempotency key and a JSON body.
pub fn post(url: &str, key: Option<&str>, body: &str) -> reqwest::RequestBuilder {
    let mut req = client()
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_owned());
    if let Some(k) = key {
        req = req.header("idempotency-key", k);
    }
    req
}

/// A unique raw key.
pub fn key(name: &str) -> String {
    format!("{name}-{:x}", idemgate_core::LeaseToken::random().0)
}

pub fn header<'a>(r: &'a reqwest::Response, name: &str) -> Option<&'a str> {
    r.headers().get(name).and_then(|v| v.to_str().ok())
}

/// The problem slug of a problem+json body.
pub async fn slug(r: reqwest::Response) -> String {
    assert_eq!(header(&r, "content-type"), Some("application/problem+json"));
    let v: serde_json::Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    v["type"].as_str().unwrap().rsplit('/').next().unwrap().to_owned()
}

impl Gateway {
    /// Starts a gateway from a YAML body (everything but `server` and `store`), with `{upstream}`
    /// replaced by the upstream's URL, extra environment variables, and files copied into its
    /// directory first (`(name, contents)`).
    pub async fn start_yaml(
        upstream: &Upstream,
        body: &str,
        env: &[(&str, &str)],
        files: &[(&str, &[u8])],
    ) -> Self {
        Self::start_yaml_with_server(upstream, "", body, env, files).await
    }

    /// [`Gateway::start_yaml`] with `server` lines (indented two spaces, ending in a newline)
    /// added under `server:`, e.g. `"  public_base_url: https://hooks.example.com\n"`.
    pub async fn start_yaml_with_server(
        upstream: &Upstream,
        server: &str,
        body: &str,
        env: &[(&str, &str)],
        files: &[(&str, &[u8])],
    ) -> Self {
        let yaml = format!("server:\n  listen: {{listen}}\n{server}store:\n  kind: memory\n{body}");
        Self::start_full(upstream, &yaml, env, files).await
    }

    async fn spawn_env(&mut self, env: &[(&str, &str)]) {
        // The port came from `free_addr`, which gives it back before the gateway binds it; another
        // test may take it meanwhile (then a connect would reach *that* listener). So the gateway
        // is ready when its own log says it listens; if it could not bind, it moves to a new port.
        for _ in 0..5 {
            let from = std::fs::metadata(&self.log).map_or(0, |m| m.len());
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.log)
                .unwrap();
            let mut child = Command::new(env!("CARGO_BIN_EXE_idemgate"))
                .args(["serve", "--config"])
                .arg(&self.config)
                .current_dir(self.dir.path())
                .envs(env.iter().copied())
                .stdout(Stdio::from(log.try_clone().unwrap()))
                .stderr(Stdio::from(log))
                .spawn()
                .unwrap();
            let since = |path: &PathBuf| {
                let text = std::fs::read(path).unwrap_or_default();
                String::from_utf8_lossy(text.get(usize::try_from(from).unwrap()..).unwrap_or_default())
                    .into_owned()
            };
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                if since(&self.log).contains("idemgate listening")
                    && std::net::TcpStream::connect(self.addr).is_ok()
                {
                    self.child = Some(child);
                    return;
                }
                if child.try_wait().unwrap().is_some() {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "gateway did not start: {}",
                    since(&self.log)
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let out = since(&self.log);
            assert!(out.contains("cannot listen"), "gateway exited at start: {out}");
            let moved = free_addr();
            let config = std::fs::read_to_string(&self.config).unwrap();
            std::fs::write(
                &self.config,
                config.replace(&self.addr.to_string(), &moved.to_string()),
            )
            .unwrap();
            self.addr = moved;
        }
        panic!("the gateway found no free port in 5 tries");
    }

    /// A file in the gateway's directory.
    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

impl Upstream {
    /// Executions seen for a namespaced key, as the upstream receives it.
    pub fn executions_ns(&self, namespaced: &str) -> u64 {
        self.counts.for_key(namespaced)
    }
}

// ---- Shared stores (Redis, PostgreSQL): servers, store blocks, fault helpers ----

/// `IDEMGATE_TEST_REDIS_URL`, or `None` after printing that the test is skipped.
pub fn redis_url() -> Option<String> {
    let url = std::env::var("IDEMGATE_TEST_REDIS_URL").ok();
    if url.is_none() {
        println!("skipped: IDEMGATE_TEST_REDIS_URL not set");
    }
    url
}

/// `IDEMGATE_TEST_PG_URL`, or `None` after printing that the test is skipped.
pub fn pg_url() -> Option<String> {
    let url = std::env::var("IDEMGATE_TEST_PG_URL").ok();
    if url.is_none() {
        println!("skipped: IDEMGATE_TEST_PG_URL not set");
    }
    url
}

/// The `store` argument of [`Gateway::start`] for a shared store: the kind, then more lines
/// of the `store:` block (`extra`, each indented by two spaces and ending in a newline).
pub fn store_block(kind: &str, url: &str, extra: &str) -> String {
    format!("{kind}\n  url: \"{url}\"\n{}", extra.trim_end_matches('\n'))
}

/// `url` with an `application_name` query parameter, so a test can find its own connections.
pub fn with_application_name(url: &str, name: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}application_name={name}")
}

#[allow(unused_imports)] // each test binary uses a different subset, as `dead_code` above
pub use idemgate_testkit::RedisServer;

/// A PostgreSQL session of the test's own (to terminate or inspect the gateway's connections).
pub async fn pg_session(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    client
}

/// Terminates every backend whose `application_name` is `name`; returns how many.
pub async fn pg_terminate(admin: &tokio_postgres::Client, name: &str) -> i64 {
    let rows = admin
        .query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
            &[&name],
        )
        .await
        .unwrap();
    i64::try_from(rows.len()).unwrap()
}

impl Gateway {
    /// Whether the gateway process is still the one started (it has not exited).
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().unwrap().is_none())
    }
}

/// A loopback TCP forwarder to `target` that a test can start late and stop: a server that
/// is down, then up, without touching the real one.
pub struct TcpForward {
    pub port: u16,
    target: SocketAddr,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl TcpForward {
    pub fn new(target: SocketAddr) -> Self {
        Self {
            port: free_addr().port(),
            target,
            task: None,
        }
    }

    /// Starts accepting and forwarding on `port`.
    pub async fn start(&mut self) {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", self.port))
            .await
            .unwrap();
        let target = self.target;
        self.task = Some(tokio::spawn(async move {
            // Connections live in the set, so stopping the forwarder (aborting this task)
            // drops and closes every one of them.
            let mut conns = tokio::task::JoinSet::new();
            while let Ok((mut inbound, _)) = listener.accept().await {
                conns.spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        }));
    }

    /// Closes the listener and every forwarded connection.
    pub fn stop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

impl Drop for TcpForward {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Gateway {
    /// Starts a gateway from a complete YAML file with `{listen}` and `{upstream}` placeholders.
    pub async fn start_full(
        upstream: &Upstream,
        yaml: &str,
        env: &[(&str, &str)],
        files: &[(&str, &[u8])],
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        for (name, contents) in files {
            std::fs::write(dir.path().join(name), contents).unwrap();
        }
        let addr = free_addr();
        let yaml = yaml
            .replace("{listen}", &addr.to_string())
            .replace("{upstream}", &format!("http://{}", upstream.addr));
        let config = dir.path().join("idemgate.yaml");
        std::fs::write(&config, yaml).unwrap();
        let log = dir.path().join("gateway.log");
        let mut gw = Self {
            addr,
            child: None,
            dir,
            config,
            log,
        };
        gw.spawn_env(env).await;
        gw
    }
}

// ---- Process control for the checker and the soak (tests/checker.rs, tests/soak.rs) ----

impl Gateway {
    /// The process id while it runs (after [`Gateway::kill9`] there is none; `restart` starts
    /// a killed gateway again on the same address and files).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }
}

/// Sends a signal by name (`STOP`, `CONT`, ...) with kill(1), so no test needs `unsafe`.
pub fn signal(pid: u32, name: &str) {
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(status.success(), "kill -{name} {pid}");
}
