//! Load tools for `bench/run.sh` (see bench/README.md).
//!
//! ```text
//! idemgate-bench rate     --url URL --rate R --duration S [--warmup S] [--connections C]
//!                         [--mode passthrough|miss|replay] [--prefix P] [--pool N]
//! idemgate-bench fill     --url URL --n N [--connections C] [--prefix P]
//! idemgate-bench storm    --url URL --n N --key KEY [--timeout S]
//! idemgate-bench upstream --listen ADDR [--delay-ms D]
//! idemgate-bench floor    --listen ADDR --upstream ADDR
//! idemgate-bench hyper-floor --listen ADDR --upstream ADDR   (built with --features floor)
//! ```
//!
//! `rate` is an open-loop generator in the style of wrk2: connection `c` sends its `k`-th request
//! at the intended time `start + (c + k*C)/R`, and every latency is measured from the intended
//! time, not from when the request was actually written, so a stalled server cannot hide its
//! queue (no coordinated omission). Requests that fall behind are sent as soon as the
//! connection is free; every request scheduled inside the window is sent (bounded by a 10 s
//! drain deadline after the window; whatever is still unsent then is counted as `dropped`).
//! `lag_p99_us` and `lag_max_us` are the generator's own lateness: from when a request could
//! have been sent (its time, or when the previous answer on its connection was read, if later)
//! to when the generator turned to send it. A long tail there is the load side stalling while
//! connections were free; a load-side stall while all of them await answers shows in the
//! latency only.
//!
//! `rate --mode replay` cycles through the keys `{prefix}0 .. {prefix}{pool-1}` (completed
//! beforehand) and counts a response without `Idempotent-Replayed: true` as unexpected.
//!
//! `fill` is closed-loop: C connections send N requests with fresh keys `{prefix}-{c}-{k}` as fast
//! as the server answers (the growth run uses it to reach a number of live records).
//!
//! `storm` opens N connections, then writes the same request (one shared `Idempotency-Key`) on
//! all of them at one instant and measures each caller's latency from that instant.
//!
//! `upstream` is a tiny HTTP/1.1 server that answers `{"ok":true,"id":"ord_1"}` after an optional
//! delay and counts its executions (`GET /executions` answers `{"executions":N}`).
//!
//! `floor` is the least a reverse proxy on tokio can do per request, and `hyper-floor` the same
//! on hyper's server and client with nothing else (`floor.rs`): references that `bench/run.sh`,
//! `bench/ab.sh` and `bench/instructions.sh` measure beside nginx and idemgate, to tell the cost
//! of the HTTP layer from the gateway's own.
//!
//! Everything prints one `RESULT key=value ...` line on stdout. HTTP/1.1 only, keep-alive,
//! Content-Length or chunked response bodies; no TLS. Hand-rolled on purpose: the dependencies
//! are tokio and httparse (hyper's own parser, for `floor`), so it builds in seconds and costs the
//! load side little CPU. `--features floor` adds hyper (for `hyper-floor`) and the gateway's
//! allocator; `build_floor` in bench/lib.sh builds it so, with the gateway's release settings.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{sleep_until, timeout, Instant};

mod floor;

// The gateway's allocator, so a reference proxy differs from it only in what it does.
#[cfg(feature = "floor")]
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const BODY: &str = r#"{"amount":100,"currency":"eur"}"#;
const UPSTREAM_BODY: &str = r#"{"ok":true,"id":"ord_1"}"#;
const IO_TIMEOUT: Duration = Duration::from_secs(5);

fn main() {
    let mut args = std::env::args().skip(1);
    let cmd = args.next().unwrap_or_default();
    let opts = parse_opts(args.collect());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let res = match cmd.as_str() {
        "rate" => rt.block_on(rate(&opts)),
        "storm" => rt.block_on(storm(&opts)),
        "fill" => rt.block_on(fill_cmd(&opts)),
        "upstream" => rt.block_on(upstream(&opts)),
        "floor" => rt.block_on(floor_cmd(&opts, false)),
        "hyper-floor" => rt.block_on(floor_cmd(&opts, true)),
        _ => Err(bad(
            "usage: idemgate-bench rate|fill|storm|upstream|floor|hyper-floor --flag value ...",
        )),
    };
    if let Err(e) = res {
        eprintln!("idemgate-bench {cmd}: {e}");
        std::process::exit(1);
    }
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg.into())
}

fn parse_opts(v: Vec<String>) -> HashMap<String, String> {
    let mut m = HashMap::new();
    let mut it = v.into_iter();
    while let Some(k) = it.next() {
        let k = k.trim_start_matches('-').to_string();
        let val = it.next().unwrap_or_default();
        m.insert(k, val);
    }
    m
}

fn opt<T: std::str::FromStr>(o: &HashMap<String, String>, k: &str, default: Option<T>) -> io::Result<T> {
    match o.get(k) {
        Some(v) => v.parse().map_err(|_| bad(format!("bad value for --{k}: {v}"))),
        None => default.ok_or_else(|| bad(format!("--{k} is required"))),
    }
}

/// `http://127.0.0.1:18002/api/v1/orders` -> (addr, "127.0.0.1:18002", "/api/v1/orders")
fn parse_url(url: &str) -> io::Result<(SocketAddr, String, String)> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| bad("only http:// URLs"))?;
    let (hostport, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let addr: SocketAddr = hostport
        .parse()
        .map_err(|_| bad(format!("need IP:port, got {hostport}")))?;
    if !addr.ip().is_loopback() {
        return Err(bad("refusing a non-loopback target"));
    }
    Ok((addr, hostport.to_string(), path.to_string()))
}

fn request(host: &str, path: &str, key: Option<&str>) -> Vec<u8> {
    let mut r = format!(
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        BODY.len()
    );
    if let Some(k) = key {
        r.push_str("Idempotency-Key: ");
        r.push_str(k);
        r.push_str("\r\n");
    }
    r.push_str("\r\n");
    r.push_str(BODY);
    r.into_bytes()
}

fn find(hay: &[u8], from: usize, needle: &[u8]) -> Option<usize> {
    hay.get(from..)?
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|p| p + from)
}

async fn fill(s: &mut TcpStream, buf: &mut Vec<u8>) -> io::Result<()> {
    buf.reserve(16 * 1024);
    let n = s.read_buf(buf).await?;
    if n == 0 {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed"));
    }
    Ok(())
}

struct Resp {
    status: u16,
    replayed: bool,
    close: bool,
}

/// Reads one response; leaves any bytes after it in `buf`.
async fn read_response(s: &mut TcpStream, buf: &mut Vec<u8>) -> io::Result<Resp> {
    let hend = loop {
        if let Some(p) = find(buf, 0, b"\r\n\r\n") {
            break p + 4;
        }
        fill(s, buf).await?;
    };
    let head = std::str::from_utf8(&buf[..hend]).map_err(|_| bad("non-UTF-8 response head"))?;
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| bad("bad status line"))?;
    let (mut len, mut chunked, mut replayed, mut close) = (0usize, false, false, false);
    for l in lines {
        let Some((n, v)) = l.split_once(':') else { continue };
        let (n, v) = (n.trim(), v.trim());
        if n.eq_ignore_ascii_case("content-length") {
            len = v.parse().map_err(|_| bad("bad content-length"))?;
        } else if n.eq_ignore_ascii_case("transfer-encoding") {
            chunked = v.to_ascii_lowercase().contains("chunked");
        } else if n.eq_ignore_ascii_case("idempotent-replayed") {
            replayed = v.eq_ignore_ascii_case("true");
        } else if n.eq_ignore_ascii_case("connection") {
            close = v.eq_ignore_ascii_case("close");
        }
    }
    let end = if chunked {
        let mut pos = hend;
        loop {
            let le = loop {
                if let Some(p) = find(buf, pos, b"\r\n") {
                    break p;
                }
                fill(s, buf).await?;
            };
            let line = std::str::from_utf8(&buf[pos..le]).map_err(|_| bad("bad chunk line"))?;
            let size = usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16)
                .map_err(|_| bad("bad chunk size"))?;
            pos = le + 2;
            if size == 0 {
                // trailers (none expected) end with an empty line
                loop {
                    if let Some(p) = find(buf, pos, b"\r\n") {
                        if p == pos {
                            break;
                        }
                        pos = p + 2;
                        continue;
                    }
                    fill(s, buf).await?;
                }
                break pos + 2;
            }
            while buf.len() < pos + size + 2 {
                fill(s, buf).await?;
            }
            pos += size + 2;
        }
    } else {
        while buf.len() < hend + len {
            fill(s, buf).await?;
        }
        hend + len
    };
    buf.drain(..end);
    Ok(Resp {
        status,
        replayed,
        close,
    })
}

fn pct(sorted: &[u32], p: f64) -> u32 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[i.clamp(1, sorted.len()) - 1]
}

#[derive(Default)]
struct Tally {
    lat_us: Vec<u32>,
    /// The generator's own lateness per request: from when it could have sent (its slot, or when
    /// it finished reading the previous answer on its connection, if later) to when it turned to
    /// send. A stall of the load side while connections are free shows here; a stall of the
    /// target does not (its connections are busy), and neither does a load-side stall while every
    /// connection awaits an answer (that one lands in the latency).
    lag_us: Vec<u32>,
    non2xx: u64,
    unexpected: u64,
    sock_errors: u64,
    dropped: u64,
}

// ------------------------------------------------------------------ rate (open loop)

async fn rate(o: &HashMap<String, String>) -> io::Result<()> {
    let url: String = opt(o, "url", None)?;
    let rate: f64 = opt(o, "rate", None)?;
    let duration: f64 = opt(o, "duration", None)?;
    let warmup: f64 = opt(o, "warmup", Some(1.0))?;
    let conns: usize = opt(o, "connections", Some(64))?;
    let mode: String = opt(o, "mode", Some("passthrough".to_string()))?;
    let prefix: String = opt(o, "prefix", Some(format!("o{}", std::process::id())))?;
    let pool: u64 = opt(o, "pool", Some(1000))?;
    if !(rate > 0.0 && duration > 0.0 && conns > 0 && pool > 0) {
        return Err(bad(
            "--rate, --duration, --connections and --pool must be positive",
        ));
    }
    if !["passthrough", "miss", "replay"].contains(&mode.as_str()) {
        return Err(bad("--mode is passthrough, miss or replay"));
    }
    let (addr, host, path) = parse_url(&url)?;
    let mut streams = Vec::with_capacity(conns);
    for _ in 0..conns {
        let s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        streams.push(s);
    }
    let start = Instant::now() + Duration::from_millis(100);
    let measure_from = start + Duration::from_secs_f64(warmup);
    let end = measure_from + Duration::from_secs_f64(duration);
    let deadline = end + Duration::from_secs(10);
    let last_done = Arc::new(std::sync::Mutex::new(measure_from));
    let mut tasks = Vec::new();
    for (c, s) in streams.into_iter().enumerate() {
        let (host, path, mode, prefix) = (host.clone(), path.clone(), mode.clone(), prefix.clone());
        let last_done = last_done.clone();
        tasks.push(tokio::spawn(async move {
            let mut t = Tally::default();
            let mut s = Some(s);
            let mut buf = Vec::with_capacity(16 * 1024);
            let mut k: u64 = 0;
            let mut free_at = start;
            loop {
                let intended = start + Duration::from_secs_f64((c as f64 + (k * conns as u64) as f64) / rate);
                if intended >= end {
                    break;
                }
                if Instant::now() > deadline {
                    // count what is left unsent
                    let left = ((end - intended).as_secs_f64() * rate / conns as f64).ceil() as u64;
                    t.dropped += left;
                    break;
                }
                sleep_until(intended).await;
                // Taken before any reconnect, whose time is the target's (its accept queue).
                let lag = Instant::now().saturating_duration_since(intended.max(free_at));
                let key = match mode.as_str() {
                    "miss" => Some(format!("{prefix}-{c}-{k}")),
                    "replay" => Some(format!("{prefix}{}", (c as u64 + k * conns as u64) % pool)),
                    _ => None,
                };
                let req = request(&host, &path, key.as_deref());
                k += 1;
                if s.is_none() {
                    match TcpStream::connect(addr).await {
                        Ok(n) => {
                            let _ = n.set_nodelay(true);
                            buf.clear();
                            s = Some(n);
                        }
                        Err(_) => {
                            t.sock_errors += 1;
                            free_at = Instant::now();
                            continue;
                        }
                    }
                }
                let st = s.as_mut().unwrap();
                let r = timeout(IO_TIMEOUT, async {
                    st.write_all(&req).await?;
                    read_response(st, &mut buf).await
                })
                .await
                .unwrap_or_else(|_| Err(io::Error::new(io::ErrorKind::TimedOut, "timeout")));
                let measured = intended >= measure_from;
                free_at = Instant::now();
                if measured {
                    t.lag_us.push(lag.as_micros().min(u32::MAX as u128) as u32);
                }
                match r {
                    Ok(resp) => {
                        if measured {
                            let now = Instant::now();
                            let us = now.saturating_duration_since(intended).as_micros();
                            t.lat_us.push(us.min(u32::MAX as u128) as u32);
                            if !(200..300).contains(&resp.status) {
                                t.non2xx += 1;
                            }
                            if resp.replayed != (mode == "replay") {
                                t.unexpected += 1;
                            }
                            let mut l = last_done.lock().unwrap();
                            if now > *l {
                                *l = now;
                            }
                        }
                        if resp.close {
                            s = None;
                        }
                    }
                    Err(_) => {
                        if measured {
                            t.sock_errors += 1;
                        }
                        s = None;
                    }
                }
            }
            t
        }));
    }
    let mut all = Tally::default();
    for task in tasks {
        let t = task.await.map_err(|e| bad(format!("task failed: {e}")))?;
        all.lat_us.extend(t.lat_us);
        all.lag_us.extend(t.lag_us);
        all.non2xx += t.non2xx;
        all.unexpected += t.unexpected;
        all.sock_errors += t.sock_errors;
        all.dropped += t.dropped;
    }
    all.lat_us.sort_unstable();
    all.lag_us.sort_unstable();
    let l = &all.lat_us;
    let errors = all.non2xx + all.unexpected + all.sock_errors + all.dropped;
    // achieved throughput: answers over the window, or over the time it took to drain the queue
    let span = (*last_done.lock().unwrap() - measure_from)
        .as_secs_f64()
        .max(duration);
    println!(
        "RESULT target_rate={rate:.0} rps={:.1} p50_us={} p90_us={} p99_us={} p999_us={} max_us={} requests={} non2xx={} unexpected={} sock_errors={} dropped={} errors={errors} lag_p99_us={} lag_max_us={}",
        l.len() as f64 / span,
        pct(l, 50.0),
        pct(l, 90.0),
        pct(l, 99.0),
        pct(l, 99.9),
        l.last().copied().unwrap_or(0),
        l.len(),
        all.non2xx,
        all.unexpected,
        all.sock_errors,
        all.dropped,
        pct(&all.lag_us, 99.0),
        all.lag_us.last().copied().unwrap_or(0),
    );
    Ok(())
}

// ------------------------------------------------------------------ fill (closed loop)

async fn fill_cmd(o: &HashMap<String, String>) -> io::Result<()> {
    let url: String = opt(o, "url", None)?;
    let n: u64 = opt(o, "n", None)?;
    let conns: u64 = opt(o, "connections", Some(64))?;
    let prefix: String = opt(o, "prefix", Some(format!("f{}", std::process::id())))?;
    let (addr, host, path) = parse_url(&url)?;
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..conns.max(1) {
        let (host, path, prefix) = (host.clone(), path.clone(), prefix.clone());
        // connection c sends requests c, c + conns, c + 2*conns, ... below n
        tasks.push(tokio::spawn(async move {
            let (mut ok, mut fresh, mut errs) = (0u64, 0u64, 0u64);
            let mut s: Option<TcpStream> = None;
            let mut buf = Vec::with_capacity(16 * 1024);
            let mut i = c;
            while i < n {
                if s.is_none() {
                    match TcpStream::connect(addr).await {
                        Ok(x) => {
                            let _ = x.set_nodelay(true);
                            buf.clear();
                            s = Some(x);
                        }
                        Err(_) => {
                            errs += 1;
                            if errs > 1000 {
                                break;
                            }
                            tokio::time::sleep(Duration::from_millis(10)).await;
                            continue;
                        }
                    }
                }
                let st = s.as_mut().unwrap();
                let req = request(&host, &path, Some(&format!("{prefix}-{i}")));
                let r = timeout(IO_TIMEOUT, async {
                    st.write_all(&req).await?;
                    read_response(st, &mut buf).await
                })
                .await
                .unwrap_or_else(|_| Err(io::Error::new(io::ErrorKind::TimedOut, "timeout")));
                match r {
                    Ok(resp) if (200..300).contains(&resp.status) => {
                        ok += 1;
                        if !resp.replayed {
                            fresh += 1;
                        }
                    }
                    Ok(_) => errs += 1,
                    Err(_) => {
                        errs += 1;
                        s = None;
                    }
                }
                i += conns;
            }
            (ok, fresh, errs)
        }));
    }
    let (mut ok, mut fresh, mut errs) = (0, 0, 0);
    for t in tasks {
        let (a, b, c) = t.await.map_err(|e| bad(format!("task failed: {e}")))?;
        ok += a;
        fresh += b;
        errs += c;
    }
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "RESULT n={n} ok={ok} fresh={fresh} errors={errs} secs={secs:.2} rps={:.1}",
        ok as f64 / secs
    );
    Ok(())
}

// ------------------------------------------------------------------ storm

async fn storm(o: &HashMap<String, String>) -> io::Result<()> {
    let url: String = opt(o, "url", None)?;
    let n: usize = opt(o, "n", Some(1000))?;
    let key: String = opt(o, "key", None)?;
    let limit: f64 = opt(o, "timeout", Some(15.0))?;
    let (addr, host, path) = parse_url(&url)?;
    let req = Arc::new(request(&host, &path, Some(&key)));
    let mut streams = Vec::with_capacity(n);
    for _ in 0..n {
        let s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        streams.push(s);
    }
    // give the server a moment to accept every connection before the burst
    let start = Instant::now() + Duration::from_millis(300);
    sleep_until(start).await;
    // The burst: one loop writes every request back to back (a task and a timer per caller
    // would spread the sends over the client's own scheduling). Each caller's latency runs from
    // its own send; `burst_max_us` is the slowest answer counted from the first send.
    let mut sent = Vec::with_capacity(n);
    for s in &streams {
        let at = Instant::now();
        let mut off = 0;
        while off < req.len() {
            match s.try_write(&req[off..]) {
                Ok(k) => off += k,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => s.writable().await?,
                Err(e) => return Err(e),
            }
        }
        sent.push(at);
    }
    let mut tasks = Vec::with_capacity(n);
    for (mut s, at) in streams.into_iter().zip(sent) {
        tasks.push(tokio::spawn(async move {
            let mut buf = Vec::with_capacity(4096);
            let r = timeout(Duration::from_secs_f64(limit), read_response(&mut s, &mut buf))
                .await
                .unwrap_or_else(|_| Err(io::Error::new(io::ErrorKind::TimedOut, "timeout")));
            let done = Instant::now();
            (r.map(|r| (r.status, r.replayed)), done - at, done - start)
        }));
    }
    let (mut lat, mut statuses) = (Vec::with_capacity(n), HashMap::<u16, u64>::new());
    let (mut fresh, mut replayed, mut non2xx, mut sock) = (0u64, 0u64, 0u64, 0u64);
    let mut burst_max = Duration::ZERO;
    for task in tasks {
        let (r, d, since_burst) = task.await.map_err(|e| bad(format!("task failed: {e}")))?;
        lat.push(d.as_micros().min(u32::MAX as u128) as u32);
        burst_max = burst_max.max(since_burst);
        match r {
            Ok((status, rep)) => {
                *statuses.entry(status).or_default() += 1;
                if !(200..300).contains(&status) {
                    non2xx += 1;
                } else if rep {
                    replayed += 1;
                } else {
                    fresh += 1;
                }
            }
            Err(_) => sock += 1,
        }
    }
    lat.sort_unstable();
    let mut st: Vec<_> = statuses.into_iter().collect();
    st.sort();
    let st: Vec<String> = st.iter().map(|(s, c)| format!("{s}:{c}")).collect();
    println!(
        "RESULT n={n} ok={} fresh={fresh} replayed={replayed} non2xx={non2xx} sock_errors={sock} min_us={} p50_us={} p99_us={} max_us={} burst_max_us={} statuses={}",
        fresh + replayed,
        lat.first().copied().unwrap_or(0),
        pct(&lat, 50.0),
        pct(&lat, 99.0),
        lat.last().copied().unwrap_or(0),
        burst_max.as_micros(),
        if st.is_empty() { "none".to_string() } else { st.join(",") }
    );
    Ok(())
}

// ------------------------------------------------------------------ upstream

async fn floor_cmd(o: &HashMap<String, String>, on_hyper: bool) -> io::Result<()> {
    let listen: SocketAddr = opt(o, "listen", None)?;
    let upstream: SocketAddr = opt(o, "upstream", None)?;
    if !listen.ip().is_loopback() || !upstream.ip().is_loopback() {
        return Err(bad("refusing a non-loopback address"));
    }
    if !on_hyper {
        return floor::run(listen, upstream).await;
    }
    #[cfg(feature = "floor")]
    return floor::run_hyper(listen, upstream).await;
    #[cfg(not(feature = "floor"))]
    Err(bad("hyper-floor needs a build with --features floor"))
}

async fn upstream(o: &HashMap<String, String>) -> io::Result<()> {
    let listen: String = opt(o, "listen", None)?;
    let delay = Duration::from_millis(opt(o, "delay-ms", Some(0u64))?);
    let addr: SocketAddr = listen.parse().map_err(|_| bad("--listen IP:port"))?;
    if !addr.ip().is_loopback() {
        return Err(bad("refusing a non-loopback listen address"));
    }
    let listener = TcpListener::bind(addr).await?;
    let count = Arc::new(AtomicU64::new(0));
    loop {
        let (s, _) = listener.accept().await?;
        let count = count.clone();
        tokio::spawn(async move {
            let _ = serve_conn(s, count, delay).await;
        });
    }
}

async fn serve_conn(mut s: TcpStream, count: Arc<AtomicU64>, delay: Duration) -> io::Result<()> {
    s.set_nodelay(true)?;
    let mut buf = Vec::with_capacity(8192);
    loop {
        let hend = loop {
            if let Some(p) = find(&buf, 0, b"\r\n\r\n") {
                break p + 4;
            }
            fill(&mut s, &mut buf).await?;
        };
        let head = String::from_utf8_lossy(&buf[..hend]).into_owned();
        let mut len = 0usize;
        for l in head.split("\r\n").skip(1) {
            if let Some((n, v)) = l.split_once(':') {
                if n.trim().eq_ignore_ascii_case("content-length") {
                    len = v.trim().parse().unwrap_or(0);
                }
            }
        }
        while buf.len() < hend + len {
            fill(&mut s, &mut buf).await?;
        }
        buf.drain(..hend + len);
        let first = head.split("\r\n").next().unwrap_or("");
        let body = if first.starts_with("GET /executions") {
            format!("{{\"executions\":{}}}", count.load(Ordering::SeqCst))
        } else {
            count.fetch_add(1, Ordering::SeqCst);
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            UPSTREAM_BODY.to_string()
        };
        let resp = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(resp.as_bytes()).await?;
    }
}
