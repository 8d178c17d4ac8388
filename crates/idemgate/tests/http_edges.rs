//! HTTP framing at the edge: smuggling shapes refused before anything is forwarded, body
//! limits, over raw sockets so the client library cannot tidy the request up.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::{Gateway, Upstream};

fn raw(gw: &Gateway, request: &str) -> String {
    let mut s = TcpStream::connect(gw.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut out = Vec::new();
    // Read to EOF: a refused framing must also close the connection.
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smuggling_shapes_are_refused_and_nothing_is_forwarded() {
    let up = Upstream::start().await;
    let gw = Gateway::start(&up, "memory", "").await;
    let cases = [
        "POST /anything HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        "POST /anything HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n",
        "POST /anything HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}",
        "POST /anything HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}x",
        "POST /anything HTTP/1.1\r\nHost: x\r\nContent-Length : 2\r\n\r\n{}",
        "POST /anything HTTP/1.1\nHost: x\nContent-Length: 2\n\n{}",
        "POST /anything HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n folded\r\nContent-Length: 2\r\n\r\n{}",
        "POST /anything HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    ];
    for case in cases {
        let resp = raw(&gw, case);
        assert!(resp.starts_with("HTTP/1.1 400"), "{case:?} -> {resp}");
    }
    assert_eq!(up.counts.total(), 0, "the upstream received nothing");
    // A clean request on a kept-alive connection after a chunked one still goes through.
    let ok = raw(
        &gw,
        "POST /anything HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\nPOST /anything HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
    );
    assert_eq!(ok.matches("HTTP/1.1 201").count(), 2, "{ok}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_over_the_limit_are_413() {
    let up = Upstream::start().await;
    let gw = Gateway::start_with(&up, "memory", "", "  max_request_body: 1KiB\n").await;
    let body = "x".repeat(2048);
    let resp = raw(
        &gw,
        &format!(
            "POST /api/v1/orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: big\r\nContent-Length: 2048\r\n\r\n{body}"
        ),
    );
    assert!(resp.starts_with("HTTP/1.1 413"), "{resp}");
    assert!(resp.contains("payload-too-large"));
    let chunked = format!(
        "POST /api/v1/orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: big2\r\nTransfer-Encoding: chunked\r\n\r\n800\r\n{body}\r\n0\r\n\r\n"
    );
    let resp = raw(&gw, &chunked);
    assert!(resp.starts_with("HTTP/1.1 413"), "chunked: {resp}");
    assert_eq!(up.counts.total(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_headers_are_431() {
    let up = Upstream::start().await;
    let gw = Gateway::start(&up, "memory", "").await;
    let big = "x".repeat(100 * 1024);
    let resp = raw(
        &gw,
        &format!("POST /anything HTTP/1.1\r\nHost: x\r\nX-Big: {big}\r\nContent-Length: 0\r\n\r\n"),
    );
    assert!(
        resp.starts_with("HTTP/1.1 431"),
        "{}",
        &resp[..resp.len().min(200)]
    );
    assert_eq!(up.counts.total(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_is_cut_off_while_normal_requests_are_served() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = Upstream::start().await;
    let gw = Gateway::start_with(&up, "memory", "", "  header_read_timeout: 2s\n").await;
    let started = std::time::Instant::now();
    let mut slow = Vec::new();
    for _ in 0..200 {
        let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
        s.write_all(b"P").await.unwrap();
        slow.push(s);
    }
    // One byte a second; a normal request in the middle of it is answered.
    let drip = tokio::spawn(async move {
        let mut closed = 0;
        for round in 0..6 {
            tokio::time::sleep(Duration::from_secs(1)).await;
            closed = 0;
            for s in &mut slow {
                if s.write_all(b"O").await.is_err() {
                    closed += 1;
                    continue;
                }
                let mut buf = [0u8; 256];
                match tokio::time::timeout(Duration::from_millis(1), s.read(&mut buf)).await {
                    Ok(Ok(0) | Err(_)) => closed += 1,
                    Ok(Ok(_)) => closed += 1, // an error response, then close
                    Err(_) => {}
                }
            }
            if closed == 200 {
                return (round, closed);
            }
        }
        (6, closed)
    });
    let ok = common::post(&gw.url("/anything"), None, "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 201, "served during the attack");
    let (rounds, closed) = drip.await.unwrap();
    assert_eq!(closed, 200, "every slow socket was cut off");
    assert!(
        rounds <= 4 && started.elapsed() < Duration::from_secs(8),
        "cut off at the header timeout"
    );
    assert_eq!(up.counts.total(), 1);
}

/// Responses far larger than the server's write buffer (hyper's 408 KiB), streamed from the
/// upstream, arrive whole and in order on one pipelined, kept-alive connection, and the
/// connection serves a small request after them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_responses_arrive_whole_on_a_kept_alive_connection() {
    let up = Upstream::start().await;
    let gw = Gateway::start(&up, "memory", "").await;
    let size = 3 << 20;
    let big = format!(
        "POST /anything HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nx-demo-body-bytes: {size}\r\nContent-Length: 2\r\n\r\n{{}}"
    );
    let small = "POST /anything HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}";
    // Pipelined: the second large response is queued behind the first.
    let text = raw(&gw, &format!("{big}{big}{small}"));
    assert_eq!(text.matches("HTTP/1.1 201").count(), 3, "three answers");
    let pads: Vec<usize> = text
        .split("\"pad\":\"")
        .skip(1)
        .map(|rest| rest.bytes().take_while(|b| *b == b'x').count())
        .collect();
    assert_eq!(pads.len(), 2, "two large bodies");
    for pad in pads {
        assert!(
            pad > size - 100 && pad < size,
            "a whole body: {pad} padding bytes"
        );
    }
    assert!(
        text.trim_end().ends_with('}'),
        "the small answer is last and whole"
    );
    assert_eq!(up.counts.total(), 3);
}
