//! `floor`: the least an HTTP/1.1 reverse proxy on tokio can do per request, as a reference for
//! the passthrough target (bench/README.md, "Reference proxies").
//!
//! Per client connection it keeps one upstream connection (nginx's keep-alive pool, in the
//! steady state of a closed-loop run) and, per request: reads and parses the head with
//! `httparse` (the parser hyper uses), reads a `Content-Length` body, writes the head (minus
//! `Connection`) and the body upstream in one write, reads and parses the response head the
//! same way, and writes the response back as it came in one write. No routing, no header
//! rewriting beyond that, no timeouts: whatever a real proxy adds on top, idemgate's passthrough
//! included, is cost above this floor. It follows only bodies framed by `Content-Length`: a
//! message it could not delimit (chunked, a response without a length, `HEAD`, 1xx) ends the
//! connection with an error rather than let the two sides fall out of step.

use std::io;
use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const MAX_HEADERS: usize = 64;

pub async fn run(listen: SocketAddr, upstream: SocketAddr) -> io::Result<()> {
    let listener = TcpListener::bind(listen).await?;
    loop {
        let (client, _) = listener.accept().await?;
        tokio::spawn(async move {
            let _ = serve(client, upstream).await;
        });
    }
}

async fn serve(mut client: TcpStream, upstream: SocketAddr) -> io::Result<()> {
    client.set_nodelay(true)?;
    let mut up: Option<TcpStream> = None;
    let mut inbuf = Vec::with_capacity(8192);
    let mut upbuf = Vec::with_capacity(8192);
    let mut out = Vec::with_capacity(8192);
    loop {
        let (head_len, body_len) = loop {
            if let Some(parsed) = parse_request(&inbuf, &mut out)? {
                break parsed;
            }
            if read_more(&mut client, &mut inbuf).await? == 0 {
                return Ok(());
            }
        };
        while inbuf.len() < head_len + body_len {
            if read_more(&mut client, &mut inbuf).await? == 0 {
                return Ok(());
            }
        }
        out.extend_from_slice(&inbuf[head_len..head_len + body_len]);
        inbuf.drain(..head_len + body_len);
        let conn = match up.as_mut() {
            Some(c) => c,
            None => {
                let c = TcpStream::connect(upstream).await?;
                c.set_nodelay(true)?;
                up.insert(c)
            }
        };
        conn.write_all(&out).await?;
        let total = loop {
            if let Some(total) = parse_response(&upbuf)? {
                break total;
            }
            if read_more(conn, &mut upbuf).await? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        };
        while upbuf.len() < total {
            if read_more(conn, &mut upbuf).await? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
        client.write_all(&upbuf[..total]).await?;
        upbuf.drain(..total);
    }
}

async fn read_more(s: &mut TcpStream, buf: &mut Vec<u8>) -> io::Result<usize> {
    if buf.capacity() - buf.len() < 4096 {
        buf.reserve(8192);
    }
    s.read_buf(buf).await
}

/// A complete request head in `buf`: its length and the body's, with the head to send
/// upstream written to `out` (cleared first). `None` while the head is incomplete.
fn parse_request(buf: &[u8], out: &mut Vec<u8>) -> io::Result<Option<(usize, usize)>> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let head_len = match req.parse(buf).map_err(invalid)? {
        httparse::Status::Complete(n) => n,
        httparse::Status::Partial => return Ok(None),
    };
    // A HEAD's response carries a length but no body, and CONNECT is a tunnel: neither is
    // delimited by the rule below.
    if matches!(req.method, Some("HEAD" | "CONNECT")) {
        return Err(invalid("the floor forwards no HEAD or CONNECT"));
    }
    out.clear();
    out.extend_from_slice(req.method.unwrap_or("GET").as_bytes());
    out.push(b' ');
    out.extend_from_slice(req.path.unwrap_or("/").as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    let mut body_len = 0;
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("connection") {
            continue;
        }
        if h.name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(invalid("the floor follows Content-Length bodies only"));
        }
        if h.name.eq_ignore_ascii_case("content-length") {
            body_len = content_length(h.value)?;
        }
        out.extend_from_slice(h.name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(h.value);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    Ok(Some((head_len, body_len)))
}

/// The length of a complete response (head and `Content-Length` body) at the start of `buf`.
fn parse_response(buf: &[u8]) -> io::Result<Option<usize>> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut headers);
    let head_len = match resp.parse(buf).map_err(invalid)? {
        httparse::Status::Complete(n) => n,
        httparse::Status::Partial => return Ok(None),
    };
    let status = resp.code.unwrap_or(0);
    if status < 200 {
        return Err(invalid("the floor forwards no 1xx response"));
    }
    let mut body_len = None;
    for h in resp.headers.iter() {
        if h.name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(invalid("the floor follows Content-Length bodies only"));
        }
        if h.name.eq_ignore_ascii_case("content-length") {
            body_len = Some(content_length(h.value)?);
        }
    }
    // Without a length a response runs to the connection's close, which the floor does not follow.
    let body_len = match (body_len, status) {
        (Some(n), _) => n,
        (None, 204 | 304) => 0,
        (None, _) => return Err(invalid("a response without Content-Length")),
    };
    Ok(Some(head_len + body_len))
}

fn content_length(v: &[u8]) -> io::Result<usize> {
    std::str::from_utf8(v)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .ok_or_else(|| invalid("bad content-length"))
}

fn invalid(e: impl ToString) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
}

/// `hyper-floor`: the same proxy on hyper's HTTP/1 server and client, with nothing else (no
/// routing, no header work, no timeouts): what hyper itself costs per request, between the
/// floor above and a full proxy built on it such as idemgate.
#[cfg(feature = "floor")]
pub async fn run_hyper(listen: SocketAddr, upstream: SocketAddr) -> io::Result<()> {
    use std::sync::Arc;

    use hyper::body::Incoming;
    use hyper::service::service_fn;
    use hyper_util::rt::TokioIo;

    let listener = TcpListener::bind(listen).await?;
    loop {
        let (client, _) = listener.accept().await?;
        client.set_nodelay(true)?;
        tokio::spawn(async move {
            let Ok(up) = TcpStream::connect(upstream).await else {
                return;
            };
            let _ = up.set_nodelay(true);
            let Ok((send, conn)) = hyper::client::conn::http1::handshake(TokioIo::new(up)).await else {
                return;
            };
            tokio::spawn(conn);
            // hyper's server takes one request at a time per connection, so the lock is never
            // contended; it only lets the `Fn` service reach the connection's sender.
            let send = Arc::new(tokio::sync::Mutex::new(send));
            let svc = service_fn(move |req: hyper::Request<Incoming>| {
                let send = send.clone();
                async move {
                    let mut send = send.lock().await;
                    // Ready for the next request only once the previous response is read.
                    send.ready().await?;
                    send.send_request(req).await
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .keep_alive(true)
                .serve_connection(TokioIo::new(client), svc)
                .await;
        });
    }
}
