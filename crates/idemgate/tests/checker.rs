//! The exactly-once checker (issue 10): a Jepsen-style run sized for one machine.
//!
//! Clients write unique keys through one or two real `idemgate` processes to a counting
//! upstream, retrying every key with the same key and body on any error or timeout until it
//! succeeds, while a nemesis takes turns at breaking things: `kill -9` of a gateway and a
//! restart; SIGSTOP of a gateway for longer than the lease; Redis killed, paused (`CLIENT
//! PAUSE`) or stopped (SIGSTOP); PostgreSQL connections terminated; and a fault-injecting proxy
//! between each gateway and its store (delay, drop, reset, blackhole), on one replica or on all.
//! Then every fault is healed, the clients finish their keys, and a final phase of normal
//! traffic runs.
//!
//! The verdict (see `verdict.rs`): every key executed exactly once, except where an execution
//! was cut off by a documented crash point (its gateway killed or paused past the lease while
//! it ran: with `on_lease_expiry: retry` a retry takes over after the lease, SPEC 4), counted
//! apart and printed; no client handed another key's body or an execution the upstream never
//! ran; no patient request past its bound on a live gateway; no unexpected status; every key of
//! the final phase served at its first attempt, unless each failed attempt met a stall of
//! PostgreSQL itself, which a probe writing to it directly records and the output lists; and a
//! run where most requests failed outside the faults, or too few keys were written, fails.
//!
//! Stores: `embedded` (one gateway), `redis` (two gateways, a redis-server of the checker's own
//! with `appendfsync always`), `postgres` (two gateways on the shared server, tables in a schema
//! of the run's own). `IDEMGATE_CHECKER_SECONDS` (default 12) sets the nemesis phase per store;
//! the Redis and PostgreSQL runs need `IDEMGATE_TEST_REDIS_URL` / `IDEMGATE_TEST_PG_URL` (as
//! set by `.ci/run`) and print "skipped" without them. The command is in docs/hardening.md.

mod common;

#[path = "checker/faultproxy.rs"]
mod faultproxy;
#[path = "checker/verdict.rs"]
mod verdict;
#[path = "checker/workload.rs"]
mod workload;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Gateway, RedisServer, Upstream, pg_session, pg_terminate, pg_url, redis_url, signal};
use faultproxy::{Fault, FaultProxy};
use verdict::{Event, Verdict};
use workload::{CheckerUpstream, ClientPlan, KeyHistory, Rng};

/// The nemesis phase per store, in seconds.
fn nemesis_seconds() -> u64 {
    std::env::var("IDEMGATE_CHECKER_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12)
}

fn seed() -> u64 {
    std::env::var("IDEMGATE_CHECKER_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            let t = idemgate_core::LeaseToken::random().0;
            u64::try_from(t & u128::from(u64::MAX)).unwrap()
        })
}

#[derive(Clone, Copy, Debug)]
enum Nemesis {
    KillGateway,
    StopGateway,
    KillRedis,
    PauseRedis,
    StopRedis,
    TerminatePg,
    Proxy(Fault),
}

const PROXY_FAULTS: [Nemesis; 4] = [
    Nemesis::Proxy(Fault::Delay(Duration::from_millis(300))),
    Nemesis::Proxy(Fault::Drop),
    Nemesis::Proxy(Fault::Reset),
    Nemesis::Proxy(Fault::Blackhole),
];

/// Everything a nemesis can break, and the record of what it broke when.
struct World {
    name: &'static str,
    epoch: Instant,
    gateways: Vec<Gateway>,
    proxies: Vec<FaultProxy>,
    redis: Option<RedisServer>,
    pg: Option<(tokio_postgres::Client, Vec<String>)>,
    /// Writes straight to PostgreSQL during a PostgreSQL run ([`PgProbe`]).
    probe: Option<PgProbe>,
    events: Vec<Event>,
}

/// The longest a committed write straight to PostgreSQL may take before it counts as a stall of
/// the database (or of the machine it runs on). A store call fails at 500 ms.
const STALL: Duration = Duration::from_millis(300);

/// A committed write straight to PostgreSQL, not through the fault proxies, every 50 ms of a
/// run. One slower than [`STALL`] becomes an event on every gateway, listed with the nemesis
/// turns: a request that failed then may have failed for the database's sake, and the verdict
/// says so instead of failing the run. A gateway that fails while these writes are fast still
/// fails it (docs/hardening.md, "Seen once").
struct PgProbe {
    stalls: Stalls,
    task: tokio::task::JoinHandle<()>,
}

/// (start, end) of each probe write slower than [`STALL`].
type Stalls = Arc<std::sync::Mutex<Vec<(Duration, Duration)>>>;

impl PgProbe {
    async fn start(url: &str, schema: &str, epoch: Instant) -> Self {
        let client = pg_session(url).await;
        client
            .batch_execute(&format!("CREATE TABLE {schema}.probe (at bigint)"))
            .await
            .unwrap();
        let insert = format!("INSERT INTO {schema}.probe VALUES ($1)");
        let stalls = Stalls::default();
        let seen = Arc::clone(&stalls);
        let task = tokio::spawn(async move {
            loop {
                let start = epoch.elapsed();
                let at = i64::try_from(start.as_millis()).unwrap_or(i64::MAX);
                // Bounded: a write that never returns is a stall to its bound.
                let _ = tokio::time::timeout(Duration::from_secs(5), client.execute(&insert, &[&at])).await;
                let end = epoch.elapsed();
                if end - start > STALL {
                    seen.lock().unwrap().push((start, end));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        Self { stalls, task }
    }

    /// The stalls so far, as events on every one of `gateways`.
    fn events(&self, gateways: usize) -> Vec<Event> {
        let stalls = self.stalls.lock().unwrap();
        stalls
            .iter()
            .map(|&(start, end)| Event {
                what: format!("PostgreSQL write took {:.0?} (probe, direct)", end - start),
                gateways: (0..gateways).collect(),
                crash: false,
                start,
                end,
            })
            .collect()
    }
}

impl Drop for PgProbe {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl World {
    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    /// Runs one nemesis turn to its end (the fault is lifted before it returns).
    async fn turn(&mut self, nemesis: Nemesis, rng: &mut Rng) {
        let start = self.now();
        let gw = usize::try_from(rng.next()).unwrap_or(0) % self.gateways.len();
        let hold = |rng: &mut Rng, lo, hi| Duration::from_millis(rng.range(lo, hi));
        let all: Vec<usize> = (0..self.gateways.len()).collect();
        let (what, gateways, crash) = match nemesis {
            Nemesis::KillGateway => {
                self.gateways[gw].kill9();
                tokio::time::sleep(hold(rng, 200, 1000)).await;
                self.gateways[gw].restart().await;
                (format!("kill -9 of gateway {gw}, then restart"), vec![gw], true)
            }
            Nemesis::StopGateway => {
                // Longer than the lease (1 s), sometimes longer than an impatient client.
                let pid = self.gateways[gw].pid().unwrap();
                signal(pid, "STOP");
                tokio::time::sleep(hold(rng, 1300, 3500)).await;
                signal(pid, "CONT");
                (format!("SIGSTOP of gateway {gw} past the lease"), vec![gw], true)
            }
            Nemesis::KillRedis => {
                let redis = self.redis.as_mut().unwrap();
                redis.kill9();
                tokio::time::sleep(hold(rng, 300, 1500)).await;
                redis.restart().await;
                ("kill -9 of redis-server, then restart".to_owned(), all, false)
            }
            Nemesis::PauseRedis => {
                let ms = rng.range(800, 2500);
                let redis = self.redis.as_ref().unwrap();
                let reply = redis.command(&["CLIENT", "PAUSE", &ms.to_string(), "ALL"]).await;
                assert!(reply.starts_with("+OK"), "CLIENT PAUSE: {reply}");
                tokio::time::sleep(Duration::from_millis(ms)).await;
                (format!("CLIENT PAUSE {ms} ms"), all, false)
            }
            Nemesis::StopRedis => {
                let pid = self.redis.as_ref().unwrap().pid().unwrap();
                signal(pid, "STOP");
                tokio::time::sleep(hold(rng, 500, 2500)).await;
                signal(pid, "CONT");
                ("SIGSTOP of redis-server".to_owned(), all, false)
            }
            Nemesis::TerminatePg => {
                let (admin, names) = self.pg.as_ref().unwrap();
                let mut n = 0;
                for _ in 0..3 {
                    for name in names {
                        n += pg_terminate(admin, name).await;
                    }
                    tokio::time::sleep(hold(rng, 100, 400)).await;
                }
                (format!("pg_terminate_backend x3 ({n} backends)"), all, false)
            }
            Nemesis::Proxy(fault) => {
                // One replica cut off (a partition) or all of them.
                let targets: Vec<usize> = if rng.chance(40) {
                    all
                } else {
                    vec![gw % self.proxies.len()]
                };
                for &t in &targets {
                    self.proxies[t].set(fault);
                }
                tokio::time::sleep(hold(rng, 500, 2000)).await;
                for &t in &targets {
                    self.proxies[t].set(Fault::Pass);
                }
                (
                    format!("proxy {fault:?} for gateways {targets:?}"),
                    targets,
                    false,
                )
            }
        };
        let end = self.now();
        self.events.push(Event {
            what,
            gateways,
            crash,
            start,
            end,
        });
    }

    /// Every process runs and every path to the store is open.
    fn healed(&mut self) -> bool {
        self.gateways.iter_mut().all(Gateway::is_running)
            && self.proxies.iter().all(|p| p.fault() == Fault::Pass)
            && self.redis.as_ref().is_none_or(|r| r.pid().is_some())
    }
}

/// The checker's lease and wait: short, so that takeovers happen within the run and waits end
/// in answers.
const IDEMPOTENCY: &str = "  lease: 1s\n  wait_timeout: 1500ms\n";

/// The gateway configuration: one `required` route, a short store bound so that faults end in
/// answers, and the `idempotency` block given.
fn gateway_yaml(store: &str, idempotency: &str) -> String {
    format!(
        "server:\n  listen: {{listen}}\n  shutdown_timeout: 5s\nstore:\n{store}  timeout: 500ms\n\
         upstreams:\n  app:\n    url: {{upstream}}\n    timeout: 3s\n\
         idempotency:\n{idempotency}\
         routes:\n  - id: writes\n    method: POST\n    path: /writes\n    upstream: app\n    \
         policy: required\n    scope: global\n"
    )
}

async fn start_gateway(up: &CheckerUpstream, store: &str) -> Gateway {
    start_gateway_with(up, store, IDEMPOTENCY).await
}

async fn start_gateway_with(up: &CheckerUpstream, store: &str, idempotency: &str) -> Gateway {
    // The harness fills `{upstream}` from a demo `Upstream`; this one only lends the address.
    let lend = Upstream {
        addr: up.addr,
        counts: Arc::default(),
    };
    Gateway::start_full(&lend, &gateway_yaml(store, idempotency), &[], &[]).await
}

/// A Redis server of the test's own behind a fault proxy, the checker's upstream, and the
/// gateway's store block for them; `None` (skipped) without Redis.
async fn redis_behind_a_proxy() -> Option<(RedisServer, CheckerUpstream, FaultProxy, String)> {
    redis_url()?;
    let redis = RedisServer::start().await?;
    let up = CheckerUpstream::start(Instant::now()).await;
    let proxy = FaultProxy::start(std::net::SocketAddr::from(([127, 0, 0, 1], redis.port))).await;
    let store = format!("  kind: redis\n  url: \"redis://127.0.0.1:{}/\"\n", proxy.port);
    Some((redis, up, proxy, store))
}

/// PostgreSQL for gateways behind fault proxies: where the proxies forward to, and a schema of
/// the test's own on the shared server (keeping other tests' tables apart); `None` (skipped)
/// without PostgreSQL.
struct PgBehindProxies {
    url: String,
    target: std::net::SocketAddr,
    /// `user[:password]@`, host and port left out: each store block names its proxy.
    login: String,
    db: String,
    schema: String,
    admin: tokio_postgres::Client,
}

impl PgBehindProxies {
    /// `tag` sets the schema apart from other tests' (the seed may be fixed, and tests run
    /// side by side).
    async fn new(tag: &str) -> Option<Self> {
        let url = pg_url()?;
        let config: tokio_postgres::Config = url.parse().unwrap();
        let target = match (config.get_hosts().first(), config.get_ports().first()) {
            (Some(tokio_postgres::config::Host::Tcp(h)), port) => {
                let host: std::net::IpAddr = if h == "localhost" {
                    [127, 0, 0, 1].into()
                } else {
                    h.parse().unwrap()
                };
                std::net::SocketAddr::new(host, port.copied().unwrap_or(5432))
            }
            _ => {
                println!("skipped: the checker needs a TCP PostgreSQL URL");
                return None;
            }
        };
        let password = config
            .get_password()
            .map(|p| format!(":{}", String::from_utf8_lossy(p)))
            .unwrap_or_default();
        let login = format!("{}{password}@", config.get_user().unwrap_or("postgres"));
        let db = config.get_dbname().unwrap_or("postgres").to_owned();
        let schema = format!("checker_{tag}_{:x}", Rng::new(seed()).next() % 0xffff_ffff);
        let admin = pg_session(&url).await;
        admin
            .batch_execute(&format!("CREATE SCHEMA {schema}"))
            .await
            .unwrap();
        Some(Self {
            url,
            target,
            login,
            db,
            schema,
            admin,
        })
    }

    /// A gateway's store block: through `proxy`, as `application_name` `name`.
    fn store_block(&self, proxy: &FaultProxy, name: &str, pool_size: usize) -> String {
        let Self {
            login, db, schema, ..
        } = self;
        format!(
            "  kind: postgres\n  url: \"postgres://{login}127.0.0.1:{}/{db}?application_name={name}&options=-c%20search_path%3D{schema}\"\n  pool_size: {pool_size}\n",
            proxy.port
        )
    }

    async fn drop_schema(&self) {
        self.admin
            .batch_execute(&format!("DROP SCHEMA {} CASCADE", self.schema))
            .await
            .unwrap();
    }
}

/// Writes to one gateway's `/writes` route, each request with a key and a client timeout.
struct Writer {
    http: reqwest::Client,
    url: String,
}

impl Writer {
    fn new(gw: &Gateway) -> Self {
        Self {
            http: reqwest::Client::builder().no_proxy().build().unwrap(),
            url: format!("http://{}/writes", gw.addr),
        }
    }

    async fn send(&self, key: &str, timeout: Duration) -> reqwest::Result<reqwest::Response> {
        self.http
            .post(&self.url)
            .header("idempotency-key", key)
            .body("{}")
            .timeout(timeout)
            .send()
            .await
    }

    /// The status of a request with a 5 s timeout.
    async fn status(&self, key: &str) -> u16 {
        self.send(key, Duration::from_secs(5))
            .await
            .unwrap()
            .status()
            .as_u16()
    }

    /// Writes until one succeeds: the first store call also connects (and migrates), and on a
    /// loaded machine (CI runs the nemesis tests beside these) it has outlasted the store's
    /// 500 ms bound and got 503. What a test checks starts after.
    async fn warm_up(&self) {
        let deadline = Instant::now() + Duration::from_secs(15);
        for attempt in 0.. {
            let status = self.status(&format!("warm-{attempt}")).await;
            if status == 201 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the gateway never reached its store: {status}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Runs the clients and the nemesis, heals, runs the final phase, and judges.
async fn run(world: World, up: &CheckerUpstream, menu: &[Nemesis], clients: usize) -> Verdict {
    run_for(world, up, menu, clients, nemesis_seconds(), (300, 25)).await
}

/// [`run`] with the nemesis phase's length, the longest upstream delay a client asks for and
/// the share of impatient attempts (percent).
async fn run_for(
    mut world: World,
    up: &CheckerUpstream,
    menu: &[Nemesis],
    clients: usize,
    seconds: u64,
    (max_delay_ms, impatient_percent): (u64, u64),
) -> Verdict {
    let seed = seed();
    let mut rng = Rng::new(seed);
    let run_id = format!("{}{:x}", world.name, rng.next() % 0xffff_ffff);
    println!(
        "checker[{}]: seed {seed}, {clients} clients, {} gateway(s), nemesis {seconds} s",
        world.name,
        world.gateways.len()
    );
    let gateways: Vec<_> = world.gateways.iter().map(|g| g.addr).collect();
    let epoch = world.epoch;
    let warmup = Duration::from_secs(1);
    let traffic_until = Instant::now() + warmup + Duration::from_secs(seconds);
    let plan = |id, until: Instant, final_phase, seed| ClientPlan {
        id,
        gateways: gateways.clone(),
        epoch,
        traffic_until: until,
        give_up_at: until + Duration::from_secs(30),
        final_phase,
        seed,
        run: run_id.clone(),
        max_delay_ms,
        impatient_percent,
    };
    let tasks: Vec<_> = (0..clients)
        .map(|i| tokio::spawn(workload::client(plan(i, traffic_until, false, rng.next()))))
        .collect();

    tokio::time::sleep(warmup).await;
    let mut next = usize::try_from(rng.next()).unwrap_or(0) % menu.len().max(1);
    while Instant::now() < traffic_until {
        if menu.is_empty() {
            tokio::time::sleep_until(traffic_until.into()).await;
            break;
        }
        world.turn(menu[next], &mut rng).await;
        next = (next + 1) % menu.len();
        tokio::time::sleep(Duration::from_millis(rng.range(300, 800))).await;
    }
    assert!(world.healed(), "every turn lifts its fault");

    // Heal: the clients finish the keys they hold (bounded by their give-up time).
    let healing = Instant::now();
    let mut keys: Vec<KeyHistory> = Vec::new();
    for t in tasks {
        keys.extend(t.await.unwrap());
    }
    let heal = healing.elapsed();

    // The final phase: normal traffic on the healed system.
    let final_until = Instant::now() + Duration::from_secs(3);
    let tasks: Vec<_> = (0..clients)
        .map(|i| tokio::spawn(workload::client(plan(100 + i, final_until, true, rng.next()))))
        .collect();
    for t in tasks {
        keys.extend(t.await.unwrap());
    }
    if let Some(probe) = &world.probe {
        world.events.extend(probe.events(world.gateways.len()));
    }
    let mut verdict = Verdict::judge(&keys, &up.execs, &world.events, seconds);
    // Every key once more: a completed key replays what its client accepted, and never runs
    // again (records lost, or overwritten by a fenced owner, would show here).
    let answers = workload::reread(&keys, &gateways, epoch).await;
    verdict.judge_rereads(&keys, &answers, &up.execs, &world.events);
    verdict.print(world.name, &world.events, heal);
    verdict
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_on_embedded_under_kill_and_stop() {
    let epoch = Instant::now();
    let up = CheckerUpstream::start(epoch).await;
    let gw = start_gateway(&up, "  kind: embedded\n").await;
    let world = World {
        name: "embedded",
        epoch,
        gateways: vec![gw],
        proxies: Vec::new(),
        redis: None,
        pg: None,
        probe: None,
        events: Vec::new(),
    };
    let menu = [Nemesis::KillGateway, Nemesis::StopGateway];
    run(world, &up, &menu, 6).await.assert_pass();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_on_redis_under_gateway_and_store_faults() {
    if redis_url().is_none() {
        return;
    }
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let epoch = Instant::now();
    let up = CheckerUpstream::start(epoch).await;
    let target = std::net::SocketAddr::from(([127, 0, 0, 1], redis.port));
    let mut proxies = Vec::new();
    let mut gateways = Vec::new();
    for _ in 0..2 {
        let proxy = FaultProxy::start(target).await;
        let store = format!("  kind: redis\n  url: \"redis://127.0.0.1:{}/\"\n", proxy.port);
        gateways.push(start_gateway(&up, &store).await);
        proxies.push(proxy);
    }
    let world = World {
        name: "redis",
        epoch,
        gateways,
        proxies,
        redis: Some(redis),
        pg: None,
        probe: None,
        events: Vec::new(),
    };
    let mut menu = vec![
        Nemesis::KillGateway,
        Nemesis::KillRedis,
        Nemesis::StopGateway,
        Nemesis::PauseRedis,
        Nemesis::StopRedis,
    ];
    menu.extend(PROXY_FAULTS);
    run(world, &up, &menu, 8).await.assert_pass();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_on_postgres_under_gateway_and_store_faults() {
    let Some(pg) = PgBehindProxies::new("nemesis").await else {
        return;
    };
    let schema = &pg.schema;
    let epoch = Instant::now();
    let up = CheckerUpstream::start(epoch).await;
    let (mut proxies, mut gateways, mut names) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..2 {
        let proxy = FaultProxy::start(pg.target).await;
        let name = format!("{schema}_gw{i}");
        let store = pg.store_block(&proxy, &name, 4);
        gateways.push(start_gateway(&up, &store).await);
        proxies.push(proxy);
        names.push(name);
    }
    let world = World {
        name: "postgres",
        epoch,
        gateways,
        proxies,
        redis: None,
        pg: Some((pg_session(&pg.url).await, names)),
        probe: Some(PgProbe::start(&pg.url, schema, epoch).await),
        events: Vec::new(),
    };
    let mut menu = vec![Nemesis::KillGateway, Nemesis::TerminatePg, Nemesis::StopGateway];
    menu.extend(PROXY_FAULTS);
    let verdict = run(world, &up, &menu, 8).await;
    pg.drop_schema().await;
    verdict.assert_pass();
}

/// The checker has teeth: two gateways that do not share a store (each its own memory store)
/// are not replicas, and an impatient client's retry on the other one runs the key again
/// with no fault anywhere. The verdict must call that out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checker_flags_duplicates_between_gateways_that_share_no_store() {
    let epoch = Instant::now();
    let up = CheckerUpstream::start(epoch).await;
    let mut gateways = Vec::new();
    for _ in 0..2 {
        gateways.push(start_gateway(&up, "  kind: memory\n").await);
    }
    let world = World {
        name: "unshared",
        epoch,
        gateways,
        proxies: Vec::new(),
        redis: None,
        pg: None,
        probe: None,
        events: Vec::new(),
    };
    // Slow executions and impatient clients, so that many give up while an execution runs.
    let verdict = run_for(world, &up, &[], 12, 5, (2000, 60)).await;
    let duplicates = verdict
        .violations
        .iter()
        .filter(|v| v.contains("cut off by no fault"))
        .count();
    assert!(
        duplicates > 0,
        "the checker missed the duplicates: {:?}",
        verdict.violations
    );
}

/// A client that gives up while its `begin` is on its way to Redis leaves no reservation
/// behind: its retry executes as soon as the abandoned call has answered, not a lease later
/// (`begin_call.rs` in the core), and the upstream runs once. Before, the retry waited out the
/// 60 s lease and got 409 `request-in-flight` at its 5 s wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_mid_begin_leaves_no_reservation_on_redis() {
    let Some((_redis, up, proxy, store)) = redis_behind_a_proxy().await else {
        return;
    };
    let gw = start_gateway_with(&up, &store, "  lease: 60s\n  wait_timeout: 5s\n").await;
    let w = Writer::new(&gw);
    w.warm_up().await;
    // 300 ms there and back, inside the store's 500 ms timeout: the call is cut off by the
    // client, not by the store.
    proxy.set(Fault::Delay(Duration::from_millis(150)));
    assert!(
        w.send("gone", Duration::from_millis(50)).await.is_err(),
        "the client gave up before its begin was answered"
    );
    proxy.set(Fault::Pass);
    let started = Instant::now();
    let retry = w.send("gone", Duration::from_secs(10)).await.unwrap();
    let took = started.elapsed();
    assert_eq!(retry.status(), 201, "the retry executes");
    assert!(took < Duration::from_secs(4), "the retry waited {took:?}");
    assert_eq!(up.execs.of("t-*:*:*:gone").len(), 1, "the upstream ran once");
}

/// A finding of the checker, held: after a fault on the way to Redis is lifted, the next
/// request is served at once. Requests kept failing for a full store timeout after the heal
/// while the connection manager slept in a reconnect backoff begun during the fault.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_serves_at_once_when_a_fault_is_lifted() {
    let Some((_redis, up, proxy, store)) = redis_behind_a_proxy().await else {
        return;
    };
    let gw = start_gateway(&up, &store).await;
    let w = Writer::new(&gw);
    assert_eq!(w.status("heal-warm").await, 201);
    let (mut slow, mut worst) = (Vec::new(), Duration::ZERO);
    for round in 0..6 {
        for fault in [Fault::Drop, Fault::Reset] {
            proxy.set(fault);
            // Traffic during the fault keeps the connection manager reconnecting.
            for i in 0..3 {
                let status = w.status(&format!("heal-{round}-{fault:?}-during-{i}")).await;
                assert_eq!(status, 503);
            }
            proxy.set(Fault::Pass);
            let started = Instant::now();
            let status = w.status(&format!("heal-{round}-{fault:?}-after")).await;
            let took = started.elapsed();
            worst = worst.max(took);
            // The regression this guards against answered 503 at the store's 500 ms timeout. A
            // healed call takes about 20 ms here, and once took 316 ms with both cores loaded by
            // other tests: the bound stays under the timeout with room for such a machine.
            if status != 201 || took > Duration::from_millis(450) {
                slow.push((round, fault, status, took));
            }
        }
    }
    println!("first request after a lifted fault: slowest {worst:?}");
    assert!(slow.is_empty(), "first requests after the heal: {slow:?}");
}

/// A finding of the checker, held: a store call's deadline covered opening a connection, so
/// while opening one took longer than the store's timeout (a PostgreSQL slow to accept as every
/// replica reconnects after a partition) every attempt was cut off half-open, the pool never
/// refilled and every request got 503. Connections now open on tasks of their own and land in
/// the pool when they are ready: the first requests fail at the timeout, the next are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_recovers_when_opening_a_connection_outlasts_the_store_timeout() {
    let Some(pg) = PgBehindProxies::new("slow").await else {
        return;
    };
    let up = CheckerUpstream::start(Instant::now()).await;
    let proxy = FaultProxy::start(pg.target).await;
    let store = pg.store_block(&proxy, &format!("{}_slow", pg.schema), 2);
    let gw = start_gateway(&up, &store).await;
    let w = Writer::new(&gw);
    // Migrated, and a connection in the pool.
    w.warm_up().await;
    // The pooled connections are cut, and opening a new one now takes 800 ms, longer than the
    // store's 500 ms timeout; statements on an open connection stay fast.
    proxy.set(Fault::Drop);
    assert_eq!(w.status("slow-cut").await, 503);
    proxy.set(Fault::SlowConnect(Duration::from_millis(800)));
    let started = Instant::now();
    let mut statuses = Vec::new();
    while Instant::now() < started + Duration::from_secs(8) {
        statuses.push(w.status(&format!("slow-{}", statuses.len())).await);
        if statuses.ends_with(&[201, 201, 201]) {
            break;
        }
    }
    println!(
        "requests while opening took 800 ms: {statuses:?} in {:?}",
        started.elapsed()
    );
    pg.drop_schema().await;
    // The first calls fail at the store's timeout while their connections open; then the
    // pool serves. Without the change no call succeeded.
    let first = statuses.iter().position(|s| *s == 201);
    assert!(
        first.is_some_and(|i| i <= 3),
        "not served again in time: {statuses:?}"
    );
    assert!(
        statuses.ends_with(&[201, 201, 201]),
        "not served steadily: {statuses:?}"
    );
}

/// A finding of the checker, held: a gateway that gets a key's `begin` back only after the
/// lease it took has run out does not call the upstream, since another replica may already
/// have taken the key over and executed (the checker saw a gateway stopped right after its
/// `begin` execute a second time on waking). Here the lease is 100 ms and the store's answer
/// takes 140 ms there and back (well inside the store's 500 ms timeout); the gateway answers
/// 409 and releases the key, and the retry executes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_begin_answered_after_its_lease_ran_out_does_not_execute() {
    let Some((_redis, up, proxy, store)) = redis_behind_a_proxy().await else {
        return;
    };
    let gw = start_gateway_with(&up, &store, "  lease: 100ms\n  wait_timeout: 1500ms\n").await;
    let w = Writer::new(&gw);
    w.warm_up().await;
    proxy.set(Fault::Delay(Duration::from_millis(70)));
    let late = w.send("late", Duration::from_secs(5)).await.unwrap();
    let status = late.status().as_u16();
    let body = late.text().await.unwrap();
    assert_eq!(status, 409, "{body}");
    assert!(body.contains("request-in-flight"), "{body}");
    assert!(
        up.execs.of("t-*:*:*:late").is_empty(),
        "the upstream was not called"
    );
    // Operators see it: the access log's outcome (and the conflict counter's reason).
    let log = gw.log();
    assert!(log.contains("\"outcome\":\"lease_lost\""), "access log:\n{log}");
    // And the configuration was called out at start: a 100 ms lease against a 500 ms bound.
    assert!(
        log.contains("lease shorter than twice store.timeout"),
        "log:\n{log}"
    );
    proxy.set(Fault::Pass);
    assert_eq!(
        w.status("late").await,
        201,
        "the key was released: the retry executes"
    );
    assert_eq!(up.execs.of("t-*:*:*:late").len(), 1, "once");
}
