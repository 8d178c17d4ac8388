//! The checker's upstream and clients.
//!
//! The upstream records every execution: the key as received (namespaced), the client attempt
//! that caused it (the `x-checker-attempt` header, forwarded by the gateway), and when it
//! started and answered; its body names the key and the execution, so a client can tell whose
//! outcome it was handed.
//!
//! A client writes one unique key at a time and retries it with the same key and body on every
//! error, timeout or non-final answer until it gets a 201, moving to the next gateway on each
//! retry. Most attempts are patient (they wait up to the bound, so a request that takes longer
//! is a hang); some are impatient and give up early, as a mobile client does, which leaves the
//! execution running while the retry arrives elsewhere.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;

/// How long a patient attempt may take before it counts as hung (unless its gateway was
/// killed or stopped meanwhile).
pub const BOUND: Duration = Duration::from_secs(8);

/// One execution seen by the upstream.
#[derive(Clone, Debug)]
pub struct Exec {
    pub id: u64,
    pub attempt: String,
    pub start: Duration,
    pub end: Option<Duration>,
}

/// A tiny deterministic PRNG (xorshift64*): the test needs cheap randomness, not quality, and
/// printing the seed lets a run's choices be told apart.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `lo..hi` (`hi > lo`).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo)
    }

    pub fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

#[derive(Default)]
pub struct Executions {
    next: AtomicU64,
    by_key: Mutex<HashMap<String, Vec<Exec>>>,
}

impl Executions {
    pub fn of(&self, namespaced: &str) -> Vec<Exec> {
        self.by_key
            .lock()
            .unwrap()
            .get(namespaced)
            .cloned()
            .unwrap_or_default()
    }

    pub fn total(&self) -> u64 {
        self.next.load(Ordering::SeqCst)
    }

    /// Records an execution as the upstream would, for a verdict built by hand.
    #[cfg(test)]
    pub fn record(&self, namespaced: &str, exec: Exec) {
        self.next.fetch_add(1, Ordering::SeqCst);
        let mut map = self.by_key.lock().unwrap();
        map.entry(namespaced.to_owned()).or_default().push(exec);
    }
}

pub struct CheckerUpstream {
    pub addr: SocketAddr,
    pub execs: Arc<Executions>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for CheckerUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl CheckerUpstream {
    pub async fn start(epoch: Instant) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let execs = Arc::new(Executions::default());
        let shared = execs.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let execs = shared.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| handle(req, execs.clone(), epoch));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Self { addr, execs, task }
    }
}

async fn handle(
    req: http::Request<hyper::body::Incoming>,
    execs: Arc<Executions>,
    epoch: Instant,
) -> Result<http::Response<Full<Bytes>>, Infallible> {
    let h = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let (key, attempt) = (h("idempotency-key"), h("x-checker-attempt"));
    let delay: u64 = h("x-checker-delay-ms").parse().unwrap_or(0);
    let id = execs.next.fetch_add(1, Ordering::SeqCst) + 1;
    let exec = Exec {
        id,
        attempt,
        start: epoch.elapsed(),
        end: None,
    };
    let index = {
        let mut map = execs.by_key.lock().unwrap();
        let list = map.entry(key.clone()).or_default();
        list.push(exec);
        list.len() - 1
    };
    let _ = req.into_body().collect().await;
    tokio::time::sleep(Duration::from_millis(delay)).await;
    if let Some(e) = execs.by_key.lock().unwrap().get_mut(&key) {
        e[index].end = Some(epoch.elapsed());
    }
    let body = format!(r#"{{"key":"{key}","exec":{id}}}"#);
    let mut resp = http::Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = http::StatusCode::CREATED;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    Ok(resp)
}

/// What became of one attempt.
#[derive(Clone, Debug)]
pub enum Outcome {
    /// 201 with the execution id named by the body and whether it was a replay.
    Ok { exec: u64, replayed: bool },
    /// A 201 whose body is not this key's: the worst violation.
    Foreign(String),
    /// Any other status (retried); the problem slug when there is one.
    Status(u16, String),
    /// An impatient client gave up before the bound.
    GaveUp,
    /// A patient client reached the bound.
    Timeout,
    /// Connection refused, reset, or closed mid-way.
    Error(String),
}

#[derive(Clone, Debug)]
pub struct Attempt {
    pub id: String,
    pub gateway: usize,
    pub start: Duration,
    pub end: Duration,
    pub outcome: Outcome,
}

/// One key's history, as its client saw it.
#[derive(Clone, Debug)]
pub struct KeyHistory {
    pub raw: String,
    pub final_phase: bool,
    pub attempts: Vec<Attempt>,
    pub done: bool,
    pub body: String,
    pub delay: String,
}

impl KeyHistory {
    pub fn namespaced(&self) -> String {
        format!("t-*:*:*:{}", self.raw)
    }
}

pub struct ClientPlan {
    pub id: usize,
    pub gateways: Vec<SocketAddr>,
    pub epoch: Instant,
    /// No new key is started after this.
    pub traffic_until: Instant,
    /// A key still not written by then is abandoned (a verdict failure).
    pub give_up_at: Instant,
    pub final_phase: bool,
    pub seed: u64,
    pub run: String,
    /// The upstream sleeps up to this long per execution (chosen per key).
    pub max_delay_ms: u64,
    /// The share of attempts (percent) that give up early, outside the final phase.
    pub impatient_percent: u64,
}

/// Writes keys one after the other until `traffic_until`; returns every key's history.
pub async fn client(plan: ClientPlan) -> Vec<KeyHistory> {
    let http = reqwest::Client::builder()
        .no_proxy()
        .pool_idle_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let mut rng = Rng::new(plan.seed);
    let mut keys = Vec::new();
    let mut n = 0u64;
    while Instant::now() < plan.traffic_until {
        n += 1;
        let raw = format!("{}-c{}-{n}", plan.run, plan.id);
        let body = format!(r#"{{"key":"{raw}","amount":{}}}"#, rng.range(1, 1000));
        let delay = rng.range(0, plan.max_delay_ms.max(1)).to_string();
        let mut hist = KeyHistory {
            raw: raw.clone(),
            final_phase: plan.final_phase,
            attempts: Vec::new(),
            done: false,
            body: body.clone(),
            delay: delay.clone(),
        };
        let mut gw = usize::try_from(rng.next()).unwrap_or(0) % plan.gateways.len();
        while Instant::now() < plan.give_up_at {
            // In the final phase every attempt is patient: the system is healed.
            let patient = plan.final_phase || !rng.chance(plan.impatient_percent);
            let limit = if patient {
                BOUND
            } else {
                Duration::from_millis(rng.range(200, 2000))
            };
            let id = format!("c{}-{n}-{}", plan.id, hist.attempts.len());
            let start = plan.epoch.elapsed();
            let outcome = send(&http, plan.gateways[gw], &hist, &id, limit, patient).await;
            let ok = matches!(outcome, Outcome::Ok { .. } | Outcome::Foreign(_));
            hist.attempts.push(Attempt {
                id,
                gateway: gw,
                start,
                end: plan.epoch.elapsed(),
                outcome,
            });
            if ok {
                hist.done = true;
                break;
            }
            gw = (gw + 1) % plan.gateways.len();
            // A short backoff, so a gateway that refuses connections is not hammered.
            tokio::time::sleep(Duration::from_millis(rng.range(10, 100))).await;
        }
        keys.push(hist);
    }
    keys
}

/// One attempt at writing `key` through `gateway`.
async fn send(
    http: &reqwest::Client,
    gateway: SocketAddr,
    key: &KeyHistory,
    id: &str,
    limit: Duration,
    patient: bool,
) -> Outcome {
    let sent = http
        .post(format!("http://{gateway}/writes"))
        .header("idempotency-key", &key.raw)
        .header("content-type", "application/json")
        .header("x-checker-attempt", id)
        .header("x-checker-delay-ms", &key.delay)
        .body(key.body.clone())
        .timeout(limit)
        .send();
    match sent.await {
        Ok(r) => {
            let status = r.status().as_u16();
            let replayed = r.headers().contains_key("idempotent-replayed");
            match r.bytes().await {
                Ok(b) if status == 201 => judge_body(&key.namespaced(), &b, replayed),
                Ok(b) => Outcome::Status(status, slug(&b)),
                Err(e) => read_error(&e, patient),
            }
        }
        Err(e) => read_error(&e, patient),
    }
}

/// After the run, every written key once more (patient, spread over the gateways): each must
/// be a replay of the very execution its client accepted. Returns each key's answer, in order.
pub async fn reread(keys: &[KeyHistory], gateways: &[SocketAddr], epoch: Instant) -> Vec<Option<Attempt>> {
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let mut tasks = tokio::task::JoinSet::new();
    let lanes = 8;
    for lane in 0..lanes {
        let mine: Vec<(usize, KeyHistory)> = keys
            .iter()
            .enumerate()
            .filter(|(i, k)| i % lanes == lane && k.done)
            .map(|(i, k)| (i, k.clone()))
            .collect();
        let (http, gateways) = (http.clone(), gateways.to_vec());
        tasks.spawn(async move {
            let mut out = Vec::new();
            for (i, key) in mine {
                let gateway = i % gateways.len();
                let id = format!("reread-{i}");
                let start = epoch.elapsed();
                let outcome = send(&http, gateways[gateway], &key, &id, BOUND, true).await;
                let end = epoch.elapsed();
                out.push((
                    i,
                    Attempt {
                        id,
                        gateway,
                        start,
                        end,
                        outcome,
                    },
                ));
            }
            out
        });
    }
    let mut answers = vec![None; keys.len()];
    while let Some(lane) = tasks.join_next().await {
        for (i, a) in lane.unwrap() {
            answers[i] = Some(a);
        }
    }
    answers
}

fn read_error(e: &reqwest::Error, patient: bool) -> Outcome {
    if e.is_timeout() {
        if patient {
            Outcome::Timeout
        } else {
            Outcome::GaveUp
        }
    } else {
        Outcome::Error(format!("{e:?}").chars().take(160).collect())
    }
}

fn judge_body(namespaced: &str, body: &[u8], replayed: bool) -> Outcome {
    let v: serde_json::Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(_) => return Outcome::Foreign(String::from_utf8_lossy(body).into_owned()),
    };
    match (v["key"].as_str(), v["exec"].as_u64()) {
        (Some(k), Some(exec)) if k == namespaced => Outcome::Ok { exec, replayed },
        _ => Outcome::Foreign(v.to_string()),
    }
}

fn slug(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            v["type"]
                .as_str()
                .map(|t| t.rsplit('/').next().unwrap_or_default().to_owned())
        })
        .unwrap_or_default()
}
