//! A Redis (or Valkey) server of the test's own, for faults that must not touch the shared one.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A redis-server child on a loopback port of its own, with an append-only file fsynced on every
/// write, so that `kill -9` loses nothing acknowledged.
pub struct RedisServer {
    pub port: u16,
    program: String,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl RedisServer {
    /// Starts one on a free port, or `None` (the test is skipped, with a message) when
    /// `redis-server` is not installed.
    pub async fn start() -> Option<Self> {
        Self::start_program("redis-server").await
    }

    /// A Valkey server from `IDEMGATE_TEST_VALKEY_BIN` (`.ci/run` builds one), or `None` (the
    /// test is skipped, with a message).
    pub async fn start_valkey() -> Option<Self> {
        let Ok(program) = std::env::var("IDEMGATE_TEST_VALKEY_BIN") else {
            println!("skipped: IDEMGATE_TEST_VALKEY_BIN not set");
            return None;
        };
        Self::start_program(&program).await
    }

    /// A redis-server on a reserved port, not started yet (for "the store is down at start"):
    /// [`RedisServer::up`] starts it.
    pub fn unstarted() -> Option<Self> {
        Self::unstarted_program("redis-server")
    }

    /// Starts an [`RedisServer::unstarted`] server.
    pub async fn up(&mut self) {
        self.spawn().await;
    }

    async fn start_program(program: &str) -> Option<Self> {
        let mut server = Self::unstarted_program(program)?;
        server.spawn().await;
        Some(server)
    }

    fn unstarted_program(program: &str) -> Option<Self> {
        if Command::new(program).arg("--version").output().is_err() {
            println!("skipped: {program} not installed");
            return None;
        }
        // Reserved by binding and released: the server binds it when it starts.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        Some(Self {
            port,
            program: program.to_owned(),
            dir: tempfile::tempdir().unwrap(),
            child: None,
        })
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    async fn spawn(&mut self) {
        let child = Command::new(&self.program)
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--save", "", "--appendonly", "yes", "--appendfsync", "always"])
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "{} did not start", self.program);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// SIGKILL.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }

    /// Starts it again on the same port and data directory.
    pub async fn restart(&mut self) {
        self.kill9();
        self.spawn().await;
    }

    /// The process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends one command over a fresh connection and returns the raw reply (RESP, as read in
    /// one go: enough for the short replies and the `INFO` sections tests read). An error reply
    /// fails the test: a fault that was not set up would make the test prove nothing.
    pub async fn command(&self, args: &[&str]) -> String {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .unwrap();
        let mut req = format!("*{}\r\n", args.len());
        for a in args {
            req.push_str(&format!("${}\r\n{a}\r\n", a.len()));
        }
        s.write_all(req.as_bytes()).await.unwrap();
        let mut buf = vec![0; 64 * 1024];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .expect("redis answered")
            .unwrap();
        assert!(
            n > 0,
            "{args:?}: the server closed the connection without a reply"
        );
        let reply = String::from_utf8_lossy(&buf[..n]).into_owned();
        assert!(!reply.starts_with('-'), "{args:?}: {reply}");
        reply
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill9();
    }
}
