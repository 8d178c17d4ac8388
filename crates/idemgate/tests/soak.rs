//! The soak (issue 10): one gateway (embedded store, the default) at a steady open-loop rate
//! for ten minutes, one request in ten a retry of an earlier key (a replay), while the
//! gateway's resident memory (`VmRSS`), open file descriptors (`/proc/PID/fd`) and the latency
//! of each interval are sampled. It passes when memory is flat, descriptors do not grow, p99
//! stays stable, and every request was answered 201.
//!
//! Ignored by default (it runs for minutes):
//!
//! ```sh
//! cargo test --release -p idemgate --test soak -- --ignored --nocapture
//! ```
//!
//! `IDEMGATE_SOAK_SECONDS` (default 600), `IDEMGATE_SOAK_RATE` (requests per second, default
//! 100), `IDEMGATE_SOAK_OUT` (a directory for `soak.csv` and `soak.svg`; default the system's
//! temporary directory). Retention is 30 s, so the store reaches a steady state (records
//! expire and are swept) within the first minute; the checks compare the later part of the
//! run with its first half, after a one-minute warm-up.

mod common;

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{Gateway, Upstream};

const YAML: &str = "server:\n  listen: {listen}\nstore:\n  kind: embedded\n\
upstreams:\n  app:\n    url: {upstream}\n    timeout: 5s\n\
idempotency:\n  retention: 30s\n\
routes:\n  - id: writes\n    method: POST\n    path: /writes\n    upstream: app\n    policy: required\n    scope: global\n";

/// What one sampling interval saw.
#[derive(Clone, Debug)]
struct Sample {
    at: f64,
    rss_kib: u64,
    fds: usize,
    requests: usize,
    errors: usize,
    p50_ms: f64,
    p99_ms: f64,
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count)
}

fn quantile(sorted: &[Duration], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    // Nearest rank; the index is within the slice by construction.
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i].as_secs_f64() * 1000.0
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a ten-minute soak; run it with --ignored"]
async fn soak_steady_rate_with_retries() {
    let seconds = env("IDEMGATE_SOAK_SECONDS", 600);
    let rate = env("IDEMGATE_SOAK_RATE", 100).max(1);
    let out = std::env::var("IDEMGATE_SOAK_OUT").map_or_else(|_| std::env::temp_dir(), Into::into);
    let up = Upstream::start().await;
    let gw = Gateway::start_full(&up, YAML, &[], &[]).await;
    let pid = gw.pid().unwrap();
    let url = gw.url("/writes");
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();

    let latencies: Arc<Mutex<(Vec<Duration>, usize)>> = Arc::default();
    let answered = Arc::new(AtomicU64::new(0));
    let mut recent: VecDeque<String> = VecDeque::new();
    let mut samples: Vec<Sample> = Vec::new();
    let started = Instant::now();
    let end = started + Duration::from_secs(seconds);
    let interval = Duration::from_secs(5);
    let mut next_sample = started + interval;
    // Open loop: requests leave on a fixed schedule whatever the answers' latency, so a slow
    // gateway shows up as latency (and in-flight requests), not as a lower rate.
    let mut tick = tokio::time::interval(Duration::from_secs_f64(
        1.0 / f64::from(u32::try_from(rate).unwrap()),
    ));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut n = 0u64;
    let (mut sent, mut retries) = (0u64, 0u64);
    while Instant::now() < end {
        tick.tick().await;
        n += 1;
        // One request in ten retries a key from the last few seconds (a replay).
        let key = if n.is_multiple_of(10) && !recent.is_empty() {
            retries += 1;
            recent[usize::try_from(n).unwrap() % recent.len()].clone()
        } else {
            let k = format!("soak-{n}");
            recent.push_back(k.clone());
            if recent.len() > 500 {
                recent.pop_front();
            }
            k
        };
        sent += 1;
        let req = http
            .post(&url)
            .header("idempotency-key", &key)
            .header("content-type", "application/json")
            .body(format!(r#"{{"key":"{key}"}}"#));
        let shared = latencies.clone();
        let answered_one = answered.clone();
        tokio::spawn(async move {
            let t = Instant::now();
            let ok = matches!(req.send().await, Ok(r) if r.status() == 201);
            let mut l = shared.lock().unwrap();
            l.0.push(t.elapsed());
            l.1 += usize::from(!ok);
            answered_one.fetch_add(1, Ordering::SeqCst);
        });
        if Instant::now() >= next_sample {
            next_sample += interval;
            let (mut lat, errors) = std::mem::take(&mut *latencies.lock().unwrap());
            lat.sort();
            let s = Sample {
                at: started.elapsed().as_secs_f64(),
                rss_kib: rss_kib(pid),
                fds: fds(pid),
                requests: lat.len(),
                errors,
                p50_ms: quantile(&lat, 0.50),
                p99_ms: quantile(&lat, 0.99),
            };
            println!(
                "soak: {:>6.0}s rss {:>7} KiB fds {:>4} req {:>5} err {} p50 {:>6.2} ms p99 {:>7.2} ms",
                s.at, s.rss_kib, s.fds, s.requests, s.errors, s.p50_ms, s.p99_ms
            );
            samples.push(s);
        }
    }
    // The last requests are still under way: count executions once every one is answered.
    let deadline = Instant::now() + Duration::from_secs(20);
    while answered.load(Ordering::SeqCst) < sent {
        assert!(
            Instant::now() < deadline,
            "requests still unanswered 20 s after the end"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (replays, executions) = (retries, up.counts.total());
    println!("soak: {sent} requests sent, {replays} retries, {executions} upstream executions");
    write_outputs(&out, &samples);
    judge(&samples, sent, executions, replays);
}

/// Flat memory, no descriptor growth, stable p99, no errors; each compared after a warm-up.
fn judge(samples: &[Sample], sent: u64, executions: u64, retries: u64) {
    assert!(
        samples.len() >= 8,
        "too short to judge: {} samples",
        samples.len()
    );
    let errors: usize = samples.iter().map(|s| s.errors).sum();
    assert_eq!(errors, 0, "requests failed");
    assert_eq!(executions, sent - retries, "every retry was a replay");
    // Skip the first minute (or the first quarter of a short run): the store fills to its
    // steady state (30 s retention) and allocator arenas grow to their working size.
    let warm = (samples.len() / 4).min(12);
    let rest = &samples[warm..];
    let (early, late) = rest.split_at(rest.len() / 2);
    let rss = |s: &[Sample]| median(s.iter().map(|s| s.rss_kib as f64).collect());
    let p99 = |s: &[Sample]| median(s.iter().map(|s| s.p99_ms).collect());
    // Descriptors follow the client's concurrency (a latency spike opens connections), so
    // the floor is what a leak would raise; the peak is printed too.
    let fd_min = |s: &[Sample]| s.iter().map(|s| s.fds).min().unwrap_or(0);
    let fd_max = |s: &[Sample]| s.iter().map(|s| s.fds).max().unwrap_or(0);
    println!(
        "soak: rss median {:.0} -> {:.0} KiB, fds min {} -> {} (max {} -> {}), p99 median {:.2} -> {:.2} ms",
        rss(early),
        rss(late),
        fd_min(early),
        fd_min(late),
        fd_max(early),
        fd_max(late),
        p99(early),
        p99(late)
    );
    assert!(rss(late) <= rss(early) * 1.15 + 4096.0, "memory grew");
    assert!(fd_min(late) <= fd_min(early) + 4, "file descriptors grew");
    // The machine is shared: p99 may wander, but a leak or a growing scan doubles it.
    assert!(p99(late) <= p99(early) * 2.0 + 5.0, "p99 grew");
}

fn write_outputs(dir: &std::path::Path, samples: &[Sample]) {
    let mut csv = String::from("seconds,rss_kib,fds,requests,errors,p50_ms,p99_ms\n");
    for s in samples {
        let _ = writeln!(
            csv,
            "{:.0},{},{},{},{},{:.3},{:.3}",
            s.at, s.rss_kib, s.fds, s.requests, s.errors, s.p50_ms, s.p99_ms
        );
    }
    let _ = std::fs::create_dir_all(dir);
    std::fs::write(dir.join("soak.csv"), csv).unwrap();
    std::fs::write(dir.join("soak.svg"), svg(samples)).unwrap();
    println!("soak: wrote {}/soak.csv and soak.svg", dir.display());
}

/// Three stacked panels (RSS, descriptors, p99) as polylines: no plotting library needed.
fn svg(samples: &[Sample]) -> String {
    let (w, h, pad) = (720.0, 150.0, 40.0);
    let t_max = samples.last().map_or(1.0, |s| s.at).max(1.0);
    #[allow(clippy::cast_precision_loss)]
    let panels: [(&str, Vec<f64>); 3] = [
        (
            "RSS (MiB)",
            samples.iter().map(|s| s.rss_kib as f64 / 1024.0).collect(),
        ),
        ("open fds", samples.iter().map(|s| s.fds as f64).collect()),
        ("p99 latency (ms)", samples.iter().map(|s| s.p99_ms).collect()),
    ];
    let mut out = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{}" font-family="sans-serif" font-size="12">"#,
        3.0 * (h + pad) + pad
    );
    for (i, (label, ys)) in panels.iter().enumerate() {
        #[allow(clippy::cast_precision_loss)]
        let top = pad + i as f64 * (h + pad);
        let y_max = ys.iter().copied().fold(0.0, f64::max).max(1e-9) * 1.1;
        let _ = write!(
            out,
            r##"<rect x="{pad}" y="{top}" width="{}" height="{h}" fill="none" stroke="#999"/><text x="{pad}" y="{}">{label}: 0 to {y_max:.1}; time 0 to {t_max:.0} s</text><polyline fill="none" stroke="#c33" stroke-width="1.5" points=""##,
            w - 2.0 * pad,
            top - 6.0
        );
        for (s, y) in samples.iter().zip(ys) {
            let x = pad + s.at / t_max * (w - 2.0 * pad);
            let _ = write!(out, "{x:.1},{:.1} ", top + h - y / y_max * h);
        }
        out.push_str(r#""/>"#);
    }
    out.push_str("</svg>\n");
    out
}
