//! The gateway when its shared store fails (SPEC 4.5, 10): Redis killed and restarted under
//! traffic, Redis paused past the store timeout, PostgreSQL connections terminated under
//! traffic, and a store that is down when the gateway starts. The gateway is never restarted,
//! every request ends within a bound, completed keys never run again, and the gateway
//! recovers by itself.
//!
//! Redis faults use a redis-server of the test's own (never the shared one); PostgreSQL
//! faults terminate only the gateway's connections (found by `application_name`) or cut a
//! loopback forwarder. Skipped (with a message) without `IDEMGATE_TEST_REDIS_URL` /
//! `IDEMGATE_TEST_PG_URL`.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{
    Gateway, RedisServer, TcpForward, Upstream, header, key, pg_session, pg_terminate, pg_url, post,
    redis_url, slug, store_block, wait_until, with_application_name,
};

/// Background traffic: replays of completed keys and requests with fresh keys, one at a
/// time, recording every status and latency.
struct Traffic {
    ok: Arc<AtomicU64>,
    unavailable: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<(u16, Duration)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Traffic {
    fn start(url: String, done: Vec<String>) -> Self {
        let (ok, unavailable) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let task = {
            let (ok, unavailable, stop, seen) = (ok.clone(), unavailable.clone(), stop.clone(), seen.clone());
            tokio::spawn(async move {
                let mut i = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    let k = if i.is_multiple_of(2) {
                        done[(i / 2) % done.len()].clone()
                    } else {
                        key("traffic")
                    };
                    i += 1;
                    let started = Instant::now();
                    let status = match post(&url, Some(&k), r#"{"amount":1}"#).send().await {
                        Ok(r) => r.status().as_u16(),
                        Err(_) => 0,
                    };
                    seen.lock().unwrap().push((status, started.elapsed()));
                    match status {
                        201 => ok.fetch_add(1, Ordering::Relaxed),
                        503 => unavailable.fetch_add(1, Ordering::Relaxed),
                        _ => 0,
                    };
                }
            })
        };
        Self {
            ok,
            unavailable,
            stop,
            seen,
            task,
        }
    }

    fn ok(&self) -> u64 {
        self.ok.load(Ordering::Relaxed)
    }

    fn unavailable(&self) -> u64 {
        self.unavailable.load(Ordering::Relaxed)
    }

    /// Stops, and checks every request got 201 or 503 within `bound`.
    async fn finish(self, bound: Duration) -> Vec<(u16, Duration)> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap();
        let seen = self.seen.lock().unwrap().clone();
        for (status, took) in &seen {
            assert!(
                *status == 201 || *status == 503,
                "unexpected status {status}: {seen:?}"
            );
            assert!(*took < bound, "a request took {took:?}");
        }
        seen
    }
}

/// Completes `n` keys on `gw` and returns them.
async fn completed_keys(gw: &Gateway, n: usize) -> Vec<String> {
    let mut done = Vec::new();
    for i in 0..n {
        let k = key(&format!("done{i}"));
        let r = post(&gw.url("/api/v1/orders"), Some(&k), r#"{"amount":1}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
        done.push(k);
    }
    done
}

/// Every completed key ran once and still replays.
async fn completed_keys_ran_once(gw: &Gateway, up: &Upstream, done: &[String]) {
    for k in done {
        let r = post(&gw.url("/api/v1/orders"), Some(k), r#"{"amount":1}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
        assert_eq!(header(&r, "idempotent-replayed"), Some("true"));
        assert_eq!(up.executions(k), 1, "a completed key ran again");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted_under_traffic() {
    if redis_url().is_none() {
        return;
    }
    let Some(mut server) = RedisServer::start().await else {
        return;
    };
    let up = Upstream::start().await;
    let mut gw = Gateway::start(
        &up,
        &store_block("redis", &server.url(), "  timeout: 500ms\n"),
        "",
    )
    .await;
    let done = completed_keys(&gw, 10).await;
    let traffic = Traffic::start(gw.url("/api/v1/orders"), done.clone());
    wait_until(Duration::from_secs(10), || traffic.ok() >= 20).await;

    server.kill9();
    wait_until(Duration::from_secs(10), || traffic.unavailable() >= 5).await;
    server.restart().await;
    let before = traffic.ok();
    wait_until(Duration::from_secs(15), || traffic.ok() >= before + 20).await;

    let seen = traffic.finish(Duration::from_secs(3)).await;
    assert!(gw.is_running(), "the gateway was never restarted");
    completed_keys_ran_once(&gw, &up, &done).await;
    println!(
        "redis kill/restart: {} requests, {} answered 503 while Redis was down",
        seen.len(),
        seen.iter().filter(|s| s.0 == 503).count()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_paused_past_the_timeout_fails_closed_on_required_and_open_on_accepted() {
    if redis_url().is_none() {
        return;
    }
    let Some(server) = RedisServer::start().await else {
        return;
    };
    let up = Upstream::start().await;
    let gw = Gateway::start(
        &up,
        &store_block("redis", &server.url(), "  timeout: 300ms\n"),
        "",
    )
    .await;
    let warm = post(&gw.url("/api/v1/orders"), Some(&key("warm")), "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(warm.status(), 201);

    server.command(&["CLIENT", "PAUSE", "3000", "ALL"]).await;
    let started = Instant::now();
    let required = post(&gw.url("/api/v1/orders"), Some(&key("paused")), "{}")
        .send()
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(required.status(), 503);
    assert!(header(&required, "retry-after").is_some());
    assert_eq!(slug(required).await, "store-unavailable");

    let started = Instant::now();
    let accepted = post(&gw.url("/anything"), Some(&key("paused-accepted")), "{}")
        .send()
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(accepted.status(), 201, "accepted routes fail open: forwarded");
    assert!(header(&accepted, "idempotent-replayed").is_none());

    // The pause ends; the same gateway deduplicates again.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = post(&gw.url("/api/v1/orders"), Some(&key("after-pause")), "{}")
            .send()
            .await
            .unwrap();
        if r.status() == 201 {
            break;
        }
        assert!(Instant::now() < deadline, "no recovery after the pause");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_connections_terminated_under_traffic_recover() {
    let Some(base) = pg_url() else { return };
    let name = format!(
        "idemgate-faults-{:x}",
        idemgate_core::LeaseToken::random().0 >> 64
    );
    let url = with_application_name(&base, &name);
    let up = Upstream::start().await;
    let gw = Gateway::start(
        &up,
        &store_block("postgres", &url, "  timeout: 2s\n  pool_size: 4\n"),
        "",
    )
    .await;
    let admin = pg_session(&base).await;
    let done = completed_keys(&gw, 10).await;
    let traffic = Traffic::start(gw.url("/api/v1/orders"), done.clone());
    wait_until(Duration::from_secs(10), || traffic.ok() >= 20).await;

    let mut terminated = 0;
    for _ in 0..3 {
        terminated += pg_terminate(&admin, &name).await;
        let before = traffic.ok();
        wait_until(Duration::from_secs(10), || traffic.ok() >= before + 10).await;
    }
    assert!(
        terminated >= 3,
        "the gateway's connections were terminated ({terminated})"
    );

    let seen = traffic.finish(Duration::from_secs(5)).await;
    let mut gw = gw;
    assert!(gw.is_running());
    completed_keys_ran_once(&gw, &up, &done).await;
    println!(
        "pg_terminate_backend x3 ({terminated} connections): {} requests, {} answered 503",
        seen.len(),
        seen.iter().filter(|s| s.0 == 503).count()
    );
}

/// A gateway whose store is down at start starts anyway, follows `on_store_error` meanwhile,
/// and deduplicates once the store is reachable, without a restart.
async fn starts_with_the_store_down(store: &str, bring_up: impl AsyncFnOnce()) {
    let up = Upstream::start().await;
    let mut gw = Gateway::start(&up, store, "").await;
    let started = Instant::now();
    let required = post(&gw.url("/api/v1/orders"), Some(&key("down")), "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(required.status(), 503);
    assert!(started.elapsed() < Duration::from_secs(3));
    let accepted = post(&gw.url("/anything"), Some(&key("down-accepted")), "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(accepted.status(), 201);

    bring_up().await;
    let k = key("up");
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let r = post(&gw.url("/api/v1/orders"), Some(&k), "{}")
            .send()
            .await
            .unwrap();
        if r.status() == 201 {
            break;
        }
        assert!(Instant::now() < deadline, "no recovery once the store came up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let replay = post(&gw.url("/api/v1/orders"), Some(&k), "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(header(&replay, "idempotent-replayed"), Some("true"));
    assert!(gw.is_running());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_with_redis_down() {
    if redis_url().is_none() {
        return;
    }
    let Some(mut server) = RedisServer::unstarted() else {
        return;
    };
    let store = store_block("redis", &server.url(), "  timeout: 300ms\n");
    starts_with_the_store_down(&store, async || server.up().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_with_postgres_down() {
    let Some(base) = pg_url() else { return };
    let mut forward = TcpForward::new("127.0.0.1:5432".parse().unwrap());
    let url = base.replacen("127.0.0.1:5432", &format!("127.0.0.1:{}", forward.port), 1);
    if url == base {
        println!("skipped: IDEMGATE_TEST_PG_URL is not on 127.0.0.1:5432");
        return;
    }
    let store = store_block("postgres", &url, "  timeout: 300ms\n  pool_size: 2\n");
    starts_with_the_store_down(&store, async || forward.start().await).await;
}

/// Counted by Redis itself (`INFO commandstats` on a server of the test's own): a miss
/// through the gateway is two store calls (begin's `SET NX GET`, the complete script), a
/// replay one (`SET NX GET`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_counts_two_calls_per_miss_and_one_per_replay() {
    if redis_url().is_none() {
        return;
    }
    let Some(server) = RedisServer::start().await else {
        return;
    };
    let (warm, miss, replay) = count_store_calls(&server).await;
    assert_eq!(miss.evalsha - warm.evalsha, 20, "one script call per miss");
    assert_eq!(
        miss.set - warm.set,
        40,
        "and one SET NX GET (plus the script's own SET)"
    );
    assert_eq!(miss.get - warm.get, 20, "no GET but the script's own");
    assert_eq!(miss.other, warm.other, "and no other command");
    assert_eq!(replay.set - miss.set, 20, "one SET NX GET per replay");
    assert_eq!(replay.evalsha, miss.evalsha, "and no script");
    assert_eq!(replay.get, miss.get, "and no GET");
}

/// The same on Valkey, which takes `SET … IFEQ`: a miss is `SET NX GET` and `SET IFEQ`, no
/// script and no `GET`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valkey_counts_two_sets_per_miss_and_no_script() {
    let Some(server) = RedisServer::start_valkey().await else {
        return;
    };
    let (warm, miss, replay) = count_store_calls(&server).await;
    assert_eq!(miss.set - warm.set, 40, "SET NX GET and SET IFEQ per miss");
    assert_eq!(miss.evalsha, warm.evalsha, "no script");
    assert_eq!(miss.get, warm.get, "no GET");
    assert_eq!(miss.other, warm.other, "and no other command");
    assert_eq!(replay.set - miss.set, 20, "one SET NX GET per replay");
    assert_eq!(replay.evalsha, miss.evalsha, "and no script");
}

/// Calls a server counted (`INFO commandstats`), as a store client could send them itself
/// (commands run inside a script count there too).
#[derive(Clone, Copy, Debug)]
struct Calls {
    evalsha: u64,
    set: u64,
    get: u64,
    other: u64,
}

/// A gateway on `server`: the counts after a warm-up (connections made, scripts loaded), after
/// 20 misses, and after 20 replays of them.
async fn count_store_calls(server: &RedisServer) -> (Calls, Calls, Calls) {
    let up = Upstream::start().await;
    let gw = Gateway::start(&up, &store_block("redis", &server.url(), ""), "").await;
    let url = gw.url("/api/v1/orders");
    let warm = key("warm");
    for _ in 0..2 {
        post(&url, Some(&warm), "{}").send().await.unwrap();
    }
    let calls = async || {
        let info = server.command(&["INFO", "commandstats"]).await;
        let count = |cmd: &str| -> u64 {
            info.lines()
                .find_map(|l| l.strip_prefix(&format!("cmdstat_{cmd}:calls=")))
                .and_then(|rest| rest.split(',').next())
                .map_or(0, |n| n.parse().unwrap())
        };
        let others = ["eval", "script|load", "hgetall", "ping", "multi", "exec"];
        Calls {
            evalsha: count("evalsha"),
            set: count("set"),
            get: count("get"),
            other: others.iter().map(|c| count(c)).sum(),
        }
    };
    let before = calls().await;
    let keys: Vec<String> = (0..20).map(|i| key(&format!("rt{i}"))).collect();
    for k in &keys {
        let r = post(&url, Some(k), "{}").send().await.unwrap();
        assert_eq!(r.status(), 201);
    }
    let missed = calls().await;
    for k in &keys {
        let r = post(&url, Some(k), "{}").send().await.unwrap();
        assert_eq!(header(&r, "idempotent-replayed"), Some("true"));
    }
    (before, missed, calls().await)
}
