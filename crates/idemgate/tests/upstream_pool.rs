//! The upstream connection pool against a real TCP upstream that counts connections and
//! requests: reuse, concurrency, connections closed while idle, bodies dropped half-read, and
//! `Connection: close`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use idemgate::upstream::Upstreams;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::Notify;

/// A plain HTTP/1.1 upstream written on raw TCP, so the test decides when a connection closes.
struct Upstream {
    authority: String,
    connections: Arc<AtomicUsize>,
    requests: Arc<AtomicUsize>,
    hosts: Arc<Mutex<Vec<String>>>,
    close_idle: Arc<Notify>,
}

#[derive(Clone, Copy, Default)]
struct Answer {
    body_len: usize,
    close: bool,
    /// Answer the first request head at once, then stop reading the connection (an upstream
    /// that refuses a large request body early and never drains it).
    stop_reading: bool,
    /// Answer the requests from this one on (counting from 1, all connections) after `delay`.
    delay_from: usize,
    delay: Duration,
}

/// A keep-alive upstream answering `body_len` bytes.
fn answering(body_len: usize) -> Answer {
    Answer {
        body_len,
        ..Answer::default()
    }
}

async fn upstream(answer: Answer) -> Upstream {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = Upstream {
        authority: listener.local_addr().unwrap().to_string(),
        connections: Arc::default(),
        requests: Arc::default(),
        hosts: Arc::default(),
        close_idle: Arc::new(Notify::new()),
    };
    let (connections, requests, hosts, close_idle) = (
        up.connections.clone(),
        up.requests.clone(),
        up.hosts.clone(),
        up.close_idle.clone(),
    );
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            connections.fetch_add(1, Ordering::SeqCst);
            let (requests, hosts, close_idle) = (requests.clone(), hosts.clone(), close_idle.clone());
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    tokio::select! {
                        n = sock.read_buf(&mut buf) => {
                            if !matches!(n, Ok(n) if n > 0) {
                                return;
                            }
                        }
                        () = close_idle.notified() => return,
                    }
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&buf[..end]).to_string();
                        buf.drain(..end + 4);
                        let n = requests.fetch_add(1, Ordering::SeqCst) + 1;
                        if answer.delay_from > 0 && n >= answer.delay_from {
                            tokio::time::sleep(answer.delay).await;
                        }
                        if let Some(h) = head.lines().find_map(|l| l.strip_prefix("host: ")) {
                            hosts.lock().unwrap().push(h.to_owned());
                        }
                        let mut resp = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n", answer.body_len);
                        if answer.close {
                            resp.push_str("connection: close\r\n");
                        }
                        resp.push_str("\r\n");
                        let mut out = resp.into_bytes();
                        out.resize(out.len() + answer.body_len, b'x');
                        if sock.write_all(&out).await.is_err() || answer.close {
                            return;
                        }
                        if answer.stop_reading {
                            close_idle.notified().await;
                            return;
                        }
                    }
                }
            });
        }
    });
    up
}

fn pool() -> Upstreams {
    Upstreams::new(Duration::from_secs(5), Duration::from_secs(60))
}

fn get(authority: &str) -> Request<Full<Bytes>> {
    Request::get(format!("http://{authority}/orders?x=1"))
        .body(Full::new(Bytes::new()))
        .unwrap()
}

async fn call(pool: &Upstreams, authority: &str) -> Bytes {
    let resp = pool.request(get(authority)).await.expect("upstream answers");
    assert_eq!(resp.status(), 200);
    resp.into_body().collect().await.unwrap().to_bytes()
}

async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn sequential_requests_share_one_connection_and_send_the_origin_host() {
    let up = upstream(answering(10)).await;
    let pool = pool();
    for _ in 0..20 {
        assert_eq!(call(&pool, &up.authority).await.len(), 10);
    }
    assert_eq!(up.requests.load(Ordering::SeqCst), 20);
    assert_eq!(up.connections.load(Ordering::SeqCst), 1);
    assert_eq!(pool.idle_open(&up.authority), 1);
    assert!(up.hosts.lock().unwrap().iter().all(|h| *h == up.authority));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_each_get_a_connection_and_all_come_back() {
    let up = upstream(answering(100)).await;
    let pool = pool();
    let calls: Vec<_> = (0..32)
        .map(|_| {
            let (pool, authority) = (pool.clone(), up.authority.clone());
            tokio::spawn(async move { call(&pool, &authority).await.len() })
        })
        .collect();
    for c in calls {
        assert_eq!(c.await.unwrap(), 100);
    }
    let opened = up.connections.load(Ordering::SeqCst);
    assert!((1..=32).contains(&opened), "{opened} connections for 32 calls");
    assert_eq!(pool.idle_open(&up.authority), opened);
    // Later calls reuse them: no new connection.
    for _ in 0..10 {
        call(&pool, &up.authority).await;
    }
    assert_eq!(up.connections.load(Ordering::SeqCst), opened);
    assert_eq!(up.requests.load(Ordering::SeqCst), 42);
}

#[tokio::test]
async fn a_connection_the_upstream_closed_while_idle_is_not_used() {
    let up = upstream(answering(10)).await;
    let pool = pool();
    call(&pool, &up.authority).await;
    assert_eq!(pool.idle_open(&up.authority), 1);
    up.close_idle.notify_waiters();
    wait_until("the pool sees the close", || pool.idle_open(&up.authority) == 0).await;
    call(&pool, &up.authority).await;
    assert_eq!(up.connections.load(Ordering::SeqCst), 2);
    // Sent once: the closed connection never carried the second request.
    assert_eq!(up.requests.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_body_dropped_half_read_closes_its_connection() {
    let up = upstream(answering(4 << 20)).await;
    let pool = pool();
    let resp = pool.request(get(&up.authority)).await.unwrap();
    let mut body = resp.into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert!(first.data_ref().is_some_and(|d| !d.is_empty()));
    drop(body);
    assert_eq!(pool.idle_open(&up.authority), 0);
    assert_eq!(call(&pool, &up.authority).await.len(), 4 << 20);
    assert_eq!(up.connections.load(Ordering::SeqCst), 2);
    assert_eq!(pool.idle_open(&up.authority), 1);
}

#[tokio::test]
async fn connection_close_from_the_upstream_is_honoured() {
    let up = upstream(Answer {
        close: true,
        ..answering(10)
    })
    .await;
    let pool = pool();
    for _ in 0..3 {
        call(&pool, &up.authority).await;
    }
    assert_eq!(up.connections.load(Ordering::SeqCst), 3);
    assert_eq!(up.requests.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn refused_connections_and_bad_targets_are_errors() {
    let pool = pool();
    let closed = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let err = pool.request(get(&closed.to_string())).await.unwrap_err();
    assert!(err.to_string().contains("cannot connect"), "{err}");
    let https = Request::get("https://127.0.0.1:1/")
        .body(Full::new(Bytes::new()))
        .unwrap();
    assert!(pool.request(https).await.is_err());
}

/// An upstream that answered before reading a large request body and stopped reading leaves
/// its connection unable to take another request: the next call gives up on it after a short
/// wait and uses a new connection, instead of waiting for it until the route's timeout.
#[tokio::test]
async fn a_connection_stuck_writing_a_request_body_is_not_waited_for() {
    let up = upstream(Answer {
        stop_reading: true,
        ..answering(2)
    })
    .await;
    let pool = pool();
    let big = Request::post(format!("http://{}/upload", up.authority))
        .body(Full::new(Bytes::from(vec![b'x'; 64 << 20])))
        .unwrap();
    let resp = pool.request(big).await.expect("answered early");
    assert_eq!(resp.into_body().collect().await.unwrap().to_bytes().len(), 2);
    let second = tokio::time::timeout(Duration::from_secs(10), call(&pool, &up.authority))
        .await
        .expect("not held by the stuck connection");
    assert_eq!(second.len(), 2);
    assert_eq!(up.connections.load(Ordering::SeqCst), 2);
    up.close_idle.notify_waiters();
}

/// A request's deadline holds on a reused connection whose clock an earlier request set further
/// out, and a request is not cut short by an earlier request's deadline that passed meanwhile.
#[tokio::test]
async fn each_request_is_bounded_by_its_own_deadline_on_a_reused_connection() {
    let slow = Duration::from_millis(1500);
    let up = upstream(Answer {
        delay_from: 3,
        delay: slow,
        ..answering(2)
    })
    .await;
    let pool = pool();
    let by = |ms| Some(tokio::time::Instant::now() + Duration::from_millis(ms));
    let send = |deadline| pool.request_unless(get(&up.authority), &|| false, deadline);
    let body = |resp: http::Response<idemgate::upstream::UpstreamBody>| async {
        resp.into_body().collect().await.unwrap().to_bytes()
    };
    // Answered at once: the connection's clock is set 60 s out, then moved back to 1 s.
    assert_eq!(body(send(by(60_000)).await.unwrap()).await.len(), 2);
    assert_eq!(body(send(by(1_000)).await.unwrap()).await.len(), 2);
    // The second request's deadline passes while the connection is idle.
    tokio::time::sleep(Duration::from_millis(1_100)).await;

    let started = Instant::now();
    let answered = send(by(5_000)).await.expect("answered within its own deadline");
    assert_eq!(body(answered).await.len(), 2);
    assert!(started.elapsed() >= slow, "the upstream took {slow:?}");

    let started = Instant::now();
    let late = send(by(300)).await;
    let took = started.elapsed();
    assert!(
        matches!(late, Err(idemgate::upstream::Error::Timeout)),
        "{late:?}"
    );
    assert!(
        took >= Duration::from_millis(300),
        "ended at its deadline, not before: {took:?}"
    );
    assert!(
        took < Duration::from_millis(1200),
        "ended at its deadline, not the upstream's answer: {took:?}"
    );
    assert_eq!(
        up.connections.load(Ordering::SeqCst),
        1,
        "every request reused the connection"
    );
}

/// A request whose deadline passed before it could be sent is not sent: the caller answers that
/// it timed out and lets a retry run it, so sent late it could run twice.
#[tokio::test]
async fn a_request_past_its_deadline_is_not_sent() {
    let up = upstream(answering(2)).await;
    let pool = pool();
    call(&pool, &up.authority).await;
    let past = Some(tokio::time::Instant::now());
    let late = pool.request_unless(get(&up.authority), &|| false, past).await;
    assert!(
        matches!(late, Err(idemgate::upstream::Error::Timeout)),
        "{late:?}"
    );
    call(&pool, &up.authority).await;
    assert_eq!(
        up.requests.load(Ordering::SeqCst),
        2,
        "the late request never reached the upstream"
    );
    assert_eq!(
        up.connections.load(Ordering::SeqCst),
        1,
        "its connection went back unused"
    );
}
