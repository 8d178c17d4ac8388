//! The upstream connection pool: HTTP/1.1 connections on `hyper::client::conn::http1`.
//!
//! hyper-util's pooled client hashes a pool key on every checkout and, when a response body is
//! still to be read, spawns a task per request that waits to put the connection back. Here an
//! idle connection's sender waits on a per-origin stack (origins are few: a scan, no hashing),
//! and the response body puts it back when it has been read to the end. Each connection still
//! runs in a task of its own. Under callgrind this cut the passthrough path from 51.5k to 43.9k
//! instructions per request. (Driving the connection from the request's own task instead was
//! slower: the connection state is large, and moving it between pool, request and body cost
//! more than the task switch it saved.)
//!
//! A request's bound (the route's `timeout`) runs on its connection's [`Clock`], kept from one
//! request to the next, rather than on a tokio timer entered into the wheel and taken out again
//! per request, each under the timer driver's lock. (Under callgrind that saved 68 instructions
//! per passthrough and 114 per miss, which the check that a request is not sent past its
//! deadline takes back; docs/benchmarks-journal.md.) A checked-out connection serves one request
//! at a time, the clock's one user.
//!
//! A request that hyper hands back unsent (the pooled connection closed before the request was
//! written) is sent again on a new connection; one that may have reached the upstream is never
//! resent.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::uri::{Authority, Scheme};
use http::{Request, Response, Uri};
use http_body::{Body as _, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::clock::Clock;

/// Idle connections kept per origin; more are closed when they come back.
const MAX_IDLE_PER_ORIGIN: usize = 1024;

/// How long a pooled connection may take to become ready for its next request.
const READY_WAIT: Duration = Duration::from_secs(1);

/// Why an upstream request failed.
#[derive(Debug)]
pub enum Error {
    /// The URI has no host, or a scheme other than `http`.
    Target(&'static str),
    /// No connection could be opened.
    Connect(std::io::Error),
    /// Opening a connection took longer than the connect timeout.
    ConnectTimeout,
    /// The HTTP exchange failed.
    Http(hyper::Error),
    /// The caller withdrew the request before it was sent (see [`Upstreams::request_unless`]).
    Withdrawn,
    /// The request's deadline passed: while connecting, waiting for a pooled connection to be
    /// ready, or waiting for the response head; or before it could be sent, and it was not.
    Timeout,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Target(why) => write!(f, "bad upstream target: {why}"),
            Self::Connect(e) => write!(f, "cannot connect: {e}"),
            Self::ConnectTimeout => f.write_str("connect timed out"),
            Self::Http(e) => write!(f, "{e}"),
            Self::Withdrawn => f.write_str("withdrawn before it was sent"),
            Self::Timeout => f.write_str("no response by the deadline"),
        }
    }
}

impl std::error::Error for Error {}

/// A pool of upstream connections, shared by every route.
#[derive(Clone, Debug)]
pub struct Upstreams {
    inner: Arc<Inner>,
}

struct Inner {
    /// Origins are few (one per configured upstream), so a scan beats hashing.
    origins: Mutex<Vec<Origin>>,
    connect_timeout: Duration,
    idle_timeout: Duration,
}

impl fmt::Debug for Inner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Upstreams").finish_non_exhaustive()
    }
}

struct Origin {
    authority: Authority,
    /// The `Host` header for this origin, built once.
    host: HeaderValue,
    /// Most recently used at the back.
    idle: VecDeque<(Conn, Instant)>,
}

/// One HTTP/1.1 connection's request sender (the connection itself runs in a task of its own),
/// and the clock that bounds its requests once one had a deadline.
struct Conn {
    send: http1::SendRequest<Full<Bytes>>,
    clock: Option<Clock>,
}

impl Upstreams {
    #[must_use]
    pub fn new(connect_timeout: Duration, idle_timeout: Duration) -> Self {
        Self {
            inner: Arc::new(Inner {
                origins: Mutex::new(Vec::new()),
                connect_timeout,
                idle_timeout,
            }),
        }
    }

    /// Sends `req` (absolute URI, `http` scheme) and returns the response head; the body keeps
    /// the connection and gives it back to the pool when it has been read to the end.
    ///
    /// A `Host` header is added from the URI unless the request has one.
    ///
    /// # Errors
    /// A bad target, a failed connect, or a failed exchange.
    pub async fn request(&self, req: Request<Full<Bytes>>) -> Result<Response<UpstreamBody>, Error> {
        self.request_unless(req, &|| false, None).await
    }

    /// [`Upstreams::request`], unless `withdrawn` says so right before the request is written
    /// (after any wait for a connection): then nothing is sent and the answer is
    /// [`Error::Withdrawn`]. For an owner whose lease may have run out meanwhile.
    ///
    /// With a `deadline`, the response head must arrive by then, connecting included, and a
    /// request already past it when its connection is ready is not sent.
    ///
    /// # Errors
    /// As [`Upstreams::request`], [`Error::Withdrawn`], and [`Error::Timeout`].
    pub async fn request_unless(
        &self,
        mut req: Request<Full<Bytes>>,
        withdrawn: &(dyn Fn() -> bool + Sync),
        deadline: Option<tokio::time::Instant>,
    ) -> Result<Response<UpstreamBody>, Error> {
        let authority = target(req.uri())?;
        let (mut pooled, host) = self.inner.checkout(&authority);
        req.headers_mut().entry(header::HOST).or_insert(host);
        *req.uri_mut() = origin_form(req.uri());
        loop {
            let reused = pooled.is_some();
            let mut conn = match pooled.take() {
                Some(conn) => conn,
                None => by(deadline, self.connect(&authority)).await??,
            };
            // A pooled connection is normally ready at once; one whose upstream stopped reading
            // a request body it answered early never is. It is closed after a short wait
            // instead of holding this request until the route's timeout (nothing was sent on it).
            // (`is_ready` first: the usual case then arms no timer.)
            if reused
                && !conn.send.is_ready()
                && !matches!(
                    by(deadline, tokio::time::timeout(READY_WAIT, conn.send.ready())).await?,
                    Ok(Ok(()))
                )
            {
                pooled = self.inner.checkout(&authority).0;
                continue;
            }
            if withdrawn() {
                // Unused: back to the pool (a fresh one was just opened for this request).
                self.inner.checkin(&authority, conn);
                return Err(Error::Withdrawn);
            }
            // A request past its deadline is not sent: its caller answers that it timed out and
            // lets a retry run it, so sent now it could run twice (a gateway paused before this
            // point, then resumed).
            if deadline.is_some_and(|d| d <= tokio::time::Instant::now()) {
                self.inner.checkin(&authority, conn);
                return Err(Error::Timeout);
            }
            let sent = conn.send.try_send_request(req);
            let sent = match deadline {
                Some(deadline) => {
                    let clock = conn.clock.get_or_insert_with(|| Clock::new(deadline));
                    by_clock(sent, clock, deadline).await?
                }
                None => sent.await,
            };
            match sent {
                Ok(resp) => {
                    let back = Some((conn, self.inner.clone(), authority));
                    return Ok(resp.map(|body| UpstreamBody {
                        body,
                        ended: false,
                        back,
                    }));
                }
                Err(mut e) => match e.take_message() {
                    // Never written: safe to send again, on a fresh connection.
                    Some(unsent) if reused => {
                        req = unsent;
                        pooled = self.inner.checkout(&authority).0;
                    }
                    _ => return Err(Error::Http(e.into_error())),
                },
            }
        }
    }

    async fn connect(&self, authority: &Authority) -> Result<Conn, Error> {
        let host = authority.host().trim_start_matches('[').trim_end_matches(']');
        let port = authority.port_u16().unwrap_or(80);
        let stream = tokio::time::timeout(self.inner.connect_timeout, TcpStream::connect((host, port)))
            .await
            .map_err(|_| Error::ConnectTimeout)?
            .map_err(Error::Connect)?;
        let _ = stream.set_nodelay(true);
        let (send, conn) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(Error::Http)?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "upstream connection ended with an error");
            }
        });
        Ok(Conn { send, clock: None })
    }

    /// Idle connections to `authority` that are still open.
    #[must_use]
    pub fn idle_open(&self, authority: &str) -> usize {
        let origins = self
            .inner
            .origins
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        origins
            .iter()
            .find(|o| o.authority.as_str().eq_ignore_ascii_case(authority))
            .map_or(0, |o| o.idle.iter().filter(|(c, _)| !c.send.is_closed()).count())
    }
}

impl Inner {
    /// The most recently used idle connection still within the idle timeout, if any, and the
    /// origin's `Host` value.
    fn checkout(&self, authority: &Authority) -> (Option<Conn>, HeaderValue) {
        let mut origins = self
            .origins
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let origin = match origins.iter().position(|o| same_origin(&o.authority, authority)) {
            Some(i) => &mut origins[i],
            None => {
                origins.push(Origin {
                    authority: authority.clone(),
                    host: host_header(authority),
                    idle: VecDeque::new(),
                });
                origins.last_mut().expect("just pushed")
            }
        };
        let now = Instant::now();
        let conn = loop {
            match origin.idle.pop_back() {
                Some((conn, since)) if now.duration_since(since) < self.idle_timeout => break Some(conn),
                // Older ones lie further in front; drop them all.
                Some(_) => origin.idle.clear(),
                None => break None,
            }
        };
        (conn, origin.host.clone())
    }

    fn checkin(&self, authority: &Authority, conn: Conn) {
        let now = Instant::now();
        let mut origins = self
            .origins
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(origin) = origins.iter_mut().find(|o| same_origin(&o.authority, authority)) else {
            return;
        };
        while origin
            .idle
            .front()
            .is_some_and(|(_, since)| now.duration_since(*since) >= self.idle_timeout)
        {
            origin.idle.pop_front();
        }
        if origin.idle.len() < MAX_IDLE_PER_ORIGIN {
            origin.idle.push_back((conn, now));
        }
    }
}

/// An upstream response body. Read to the end and dropped, it returns its connection to the
/// pool; dropped earlier, the connection is closed.
pub struct UpstreamBody {
    body: Incoming,
    ended: bool,
    /// The connection and where it goes back to.
    back: Option<(Conn, Arc<Inner>, Authority)>,
}

impl fmt::Debug for UpstreamBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamBody")
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

impl http_body::Body for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        let frame = Pin::new(&mut this.body).poll_frame(cx);
        if let Poll::Ready(None) = frame {
            this.ended = true;
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        // A body not read to its end leaves the connection mid-response: it cannot be reused.
        if !self.is_end_stream() {
            return;
        }
        if let Some((conn, pool, authority)) = self.back.take()
            && !conn.send.is_closed()
        {
            pool.checkin(&authority, conn);
        }
    }
}

/// `fut`, unless `deadline` passes first (a tokio timer: for the rare waits, connecting and a
/// pooled connection that is not ready).
async fn by<T>(deadline: Option<tokio::time::Instant>, fut: impl Future<Output = T>) -> Result<T, Error> {
    match deadline {
        Some(deadline) => tokio::time::timeout_at(deadline, fut)
            .await
            .map_err(|_| Error::Timeout),
        None => Ok(fut.await),
    }
}

/// [`by`] on the connection's `clock`, for the wait every request makes: its response head.
async fn by_clock<T>(
    fut: impl Future<Output = T>,
    clock: &mut Clock,
    deadline: tokio::time::Instant,
) -> Result<T, Error> {
    let mut fut = pin!(fut);
    std::future::poll_fn(|cx| {
        if let Poll::Ready(out) = fut.as_mut().poll(cx) {
            return Poll::Ready(Ok(out));
        }
        clock.poll_until(cx, deadline).map(|()| Err(Error::Timeout))
    })
    .await
}

/// Whether two authorities name the same pool. Byte equality, not `Authority`'s own comparison
/// (case-insensitive, byte by byte: 390 instructions a request for two lookups, under callgrind):
/// a route's requests all carry its upstream's authority as configured, so the spellings of one
/// host differing only in case at most get pools of their own.
fn same_origin(a: &Authority, b: &Authority) -> bool {
    a.as_str() == b.as_str()
}

/// The origin a request goes to; only plain `http` is supported.
fn target(uri: &Uri) -> Result<Authority, Error> {
    match uri.scheme() {
        Some(s) if *s == Scheme::HTTP => {}
        Some(_) => return Err(Error::Target("only http:// upstreams are supported")),
        None => return Err(Error::Target("the URI is not absolute")),
    }
    uri.authority()
        .cloned()
        .ok_or(Error::Target("the URI has no host"))
}

/// `Host` for an origin: its host, and its port unless that is 80 (as hyper-util's client did).
fn host_header(authority: &Authority) -> HeaderValue {
    let value = match authority.port_u16() {
        Some(port) if port != 80 => format!("{}:{port}", authority.host()),
        _ => authority.host().to_owned(),
    };
    HeaderValue::from_str(&value).unwrap_or_else(|_| HeaderValue::from_static("localhost"))
}

/// `/path?query` of an absolute URI: what HTTP/1.1 sends to an origin server.
fn origin_form(uri: &Uri) -> Uri {
    let mut parts = http::uri::Parts::default();
    parts.path_and_query = Some(
        uri.path_and_query()
            .cloned()
            .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/")),
    );
    Uri::from_parts(parts).unwrap_or_else(|_| Uri::from_static("/"))
}
