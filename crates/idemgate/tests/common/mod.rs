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
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_idemgate"))
            .args(["serve", "--config"])
            .arg(&self.config)
            .arg("--listen")
            .arg(self.addr.to_string())
            .current_dir(self.dir.path())
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap();
        self.child = Some(child);
        wait_until(Duration::from_secs(10), || {
            std::net::TcpStream::connect(self.addr).is_ok()
        })
        .await;
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
        let dir = tempfile::tempdir().unwrap();
        for (name, contents) in files {
            std::fs::write(dir.path().join(name), contents).unwrap();
        }
        let addr = free_addr();
        let yaml = format!(
            "server:\n  listen: {addr}\nstore:\n  kind: memory\n{}",
            body.replace("{upstream}", &format!("http://{}", upstream.addr))
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
        gw.spawn_env(env).await;
        gw
    }

    async fn spawn_env(&mut self, env: &[(&str, &str)]) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_idemgate"))
            .args(["serve", "--config"])
            .arg(&self.config)
            .current_dir(self.dir.path())
            .envs(env.iter().copied())
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap();
        self.child = Some(child);
        let addr = self.addr;
        let log_path = self.log.clone();
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(addr).is_err() {
            assert!(
                Instant::now() < deadline,
                "gateway did not start: {}",
                std::fs::read_to_string(&log_path).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
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
