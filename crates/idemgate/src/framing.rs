//! A strict second reading of each request head, for request-smuggling shapes that hyper
//! tolerates.
//!
//! hyper follows RFC 9112 leniently: with both `Content-Length` and `Transfer-Encoding` it drops
//! the length and lets chunked win, and it folds repeated identical lengths into one. A gateway
//! in front of other proxies must not be lenient there: two hops that pick different framings
//! are how requests get smuggled. hyper also hides what it dropped, so [`Sniffer`] wraps the
//! connection and parses each request head itself (with `httparse`, hyper's own parser) as the
//! bytes go by, following body framing so it stays in step across keep-alive requests. For
//! every head it queues a [`Verdict`]; the service takes one per request, in order, and refuses
//! a bad one with 400 and `Connection: close` before anything is forwarded.
//!
//! If the sniffer ever loses step (a head larger than it keeps, a framing it cannot follow) it
//! switches itself off and hyper's own checks remain.

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The largest request head the sniffer follows (hyper's own limit is about the same order).
const MAX_HEAD: usize = 64 * 1024;

/// Why a request's framing is refused; `None` when it is acceptable.
pub type Verdict = Option<&'static str>;

/// The verdicts of one connection, shared between the reader and the service.
#[derive(Clone, Debug, Default)]
pub struct Verdicts(Arc<Mutex<VecDeque<Verdict>>>);

impl Verdicts {
    /// The verdict for the next request (acceptable when the sniffer had nothing to say).
    #[must_use]
    pub fn next(&self) -> Verdict {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop_front()
            .flatten()
    }

    fn push(&self, v: Verdict) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).push_back(v);
    }
}

#[derive(Debug)]
enum State {
    Head(Vec<u8>),
    Body(u64),
    ChunkSize(Vec<u8>),
    ChunkData(u64),
    ChunkEnd(u8),
    Trailers(Vec<u8>),
    Off,
}

/// A connection wrapper that judges each request head's framing.
#[derive(Debug)]
pub struct Sniffer<IO> {
    inner: IO,
    state: State,
    verdicts: Verdicts,
}

impl<IO> Sniffer<IO> {
    pub fn new(inner: IO) -> (Self, Verdicts) {
        let verdicts = Verdicts::default();
        (
            Self {
                inner,
                state: State::Head(Vec::new()),
                verdicts: verdicts.clone(),
            },
            verdicts,
        )
    }

    fn feed(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            let (state, used) = step(
                std::mem::replace(&mut self.state, State::Off),
                data,
                &self.verdicts,
            );
            self.state = state;
            data = &data[used..];
            if matches!(self.state, State::Off) {
                return;
            }
        }
    }
}

/// The verdicts a connection carrying `chunks` (in that split) gets; for fuzzing and tests.
#[doc(hidden)]
#[must_use]
pub fn verdicts_for(chunks: &[&[u8]]) -> Vec<Verdict> {
    let (mut s, v) = Sniffer::new(());
    for c in chunks {
        s.feed(c);
    }
    let mut q = v.0.lock().unwrap_or_else(PoisonError::into_inner);
    q.drain(..).collect()
}

/// Advances the state machine over `data`; returns the next state and how many bytes it used.
fn step(state: State, data: &[u8], verdicts: &Verdicts) -> (State, usize) {
    match state {
        State::Off => (State::Off, data.len()),
        State::Head(mut head) => {
            if head.is_empty() {
                // The usual case: the whole head came in this read. Judge it where it lies
                // instead of copying it into the buffer first.
                let skip = data.iter().take_while(|b| **b == b'\r' || **b == b'\n').count();
                if let Some(end) = head_end(data, skip) {
                    let (verdict, next) = judge(&data[skip..end]);
                    verdicts.push(verdict);
                    return (if verdict.is_some() { State::Off } else { next }, end);
                }
            }
            let start = head.len().saturating_sub(2);
            head.extend_from_slice(data);
            // Empty lines before a request line are allowed (RFC 9112 2.2).
            let skip = head.iter().take_while(|b| **b == b'\r' || **b == b'\n').count();
            let Some(end) = head_end(&head, start.max(skip)) else {
                return if head.len() > MAX_HEAD {
                    (State::Off, data.len())
                } else {
                    (State::Head(head), data.len())
                };
            };
            let used = data.len() - (head.len() - end);
            let (verdict, next) = judge(&head[skip..end]);
            verdicts.push(verdict);
            (if verdict.is_some() { State::Off } else { next }, used)
        }
        State::Body(left) => {
            let n = left.min(data.len() as u64);
            let next = if n == left {
                State::Head(Vec::new())
            } else {
                State::Body(left - n)
            };
            (next, usize::try_from(n).unwrap_or(data.len()))
        }
        State::ChunkSize(mut line) => match data.iter().position(|b| *b == b'\n') {
            None => {
                line.extend_from_slice(data);
                (
                    if line.len() > 1024 {
                        State::Off
                    } else {
                        State::ChunkSize(line)
                    },
                    data.len(),
                )
            }
            Some(i) => {
                line.extend_from_slice(&data[..=i]);
                let text = String::from_utf8_lossy(&line);
                let hex = text
                    .trim_end_matches(['\r', '\n'])
                    .split(';')
                    .next()
                    .unwrap_or("")
                    .trim();
                match u64::from_str_radix(hex, 16) {
                    Ok(0) => (State::Trailers(Vec::new()), i + 1),
                    Ok(n) => (State::ChunkData(n), i + 1),
                    Err(_) => (State::Off, data.len()),
                }
            }
        },
        State::ChunkData(left) => {
            let n = left.min(data.len() as u64);
            let next = if n == left {
                State::ChunkEnd(2)
            } else {
                State::ChunkData(left - n)
            };
            (next, usize::try_from(n).unwrap_or(data.len()))
        }
        State::ChunkEnd(left) => {
            let n = usize::from(left).min(data.len());
            let left = left - u8::try_from(n).unwrap_or(left);
            (
                if left == 0 {
                    State::ChunkSize(Vec::new())
                } else {
                    State::ChunkEnd(left)
                },
                n,
            )
        }
        State::Trailers(mut t) => {
            let start = t.len().saturating_sub(3);
            t.extend_from_slice(data);
            if t.starts_with(b"\r\n") {
                let used = 2 - (t.len() - data.len()).min(2);
                return (State::Head(Vec::new()), used);
            }
            match find(&t[start..], b"\r\n\r\n") {
                Some(i) => {
                    let end = start + i + 4;
                    (State::Head(Vec::new()), data.len() - (t.len() - end))
                }
                None if t.len() > MAX_HEAD => (State::Off, data.len()),
                None => (State::Trailers(t), data.len()),
            }
        }
    }
}

/// Judges one complete head; on success also says how its body is framed.
fn judge(head: &[u8]) -> (Verdict, State) {
    // A bare LF as a line end: some servers accept it, some do not.
    if memchr::memchr_iter(b'\n', head).any(|i| i == 0 || head[i - 1] != b'\r') {
        return (Some("bare LF line ending"), State::Off);
    }
    // Uninitialized slots: an initialized array of 128 headers is a 4 KiB memset per request.
    let mut headers = [const { std::mem::MaybeUninit::<httparse::Header<'_>>::uninit() }; 128];
    let mut req = httparse::Request::new(&mut []);
    if !matches!(
        req.parse_with_uninit_headers(head, &mut headers),
        Ok(httparse::Status::Complete(_))
    ) {
        // hyper refuses it too; say so in case it does not.
        return (Some("malformed request head"), State::Off);
    }
    let (mut lengths, mut length) = (0usize, None);
    let mut te = None;
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            lengths += 1;
            length = Some(h.value);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            if te.is_some() {
                return (Some("several Transfer-Encoding headers"), State::Off);
            }
            te = Some(h.value);
        }
    }
    match (lengths, te) {
        (0, None) => (None, State::Head(Vec::new())),
        (1.., Some(_)) => (Some("both Content-Length and Transfer-Encoding"), State::Off),
        (2.., None) => (Some("several Content-Length headers"), State::Off),
        (_, None) => match length
            .and_then(|len| std::str::from_utf8(len).ok())
            .and_then(|s| s.trim().parse::<u64>().ok())
        {
            Some(0) => (None, State::Head(Vec::new())),
            Some(n) => (None, State::Body(n)),
            None => (Some("invalid Content-Length"), State::Off),
        },
        (0, Some(te)) if te.eq_ignore_ascii_case(b"chunked") => (None, State::ChunkSize(Vec::new())),
        (0, Some(_)) => (Some("unsupported Transfer-Encoding"), State::Off),
    }
}

/// The end of a head: a line break followed by an empty line, with CRLF or bare LF (so a
/// bare-LF head is still seen, and refused).
fn head_end(buf: &[u8], from: usize) -> Option<usize> {
    let rest = buf.get(from..)?;
    memchr::memchr_iter(b'\n', rest).find_map(|j| {
        let i = from + j;
        match (buf.get(i + 1), buf.get(i + 2)) {
            (Some(b'\n'), _) => Some(i + 2),
            (Some(b'\r'), Some(b'\n')) => Some(i + 3),
            _ => None,
        }
    })
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

impl<IO: AsyncRead + Unpin> AsyncRead for Sniffer<IO> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            this.feed(&buf.filled()[before..]);
        }
        polled
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Sniffer<IO> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verdicts(stream: &[u8], chunk: usize) -> Vec<Verdict> {
        let (mut s, v) = Sniffer::new(());
        for part in stream.chunks(chunk) {
            s.feed(part);
        }
        let mut out = Vec::new();
        while let Some(x) = v.0.lock().unwrap().pop_front() {
            out.push(x);
        }
        out
    }

    #[test]
    fn follows_keep_alive_requests_in_any_split() {
        let stream = b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello\
POST /b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n3;ext=1\r\nabc\r\n0\r\nX-T: 1\r\n\r\n\
GET /c HTTP/1.1\r\nHost: x\r\n\r\n\
POST /d HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n";
        for chunk in [1, 2, 3, 7, 64, 4096] {
            assert_eq!(
                verdicts(stream, chunk),
                vec![
                    None,
                    None,
                    None,
                    Some("both Content-Length and Transfer-Encoding")
                ],
                "chunk size {chunk}"
            );
        }
    }

    #[test]
    fn refuses_ambiguous_heads() {
        for (head, why) in [
            (
                &b"POST / HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n"[..],
                "several Content-Length headers",
            ),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n",
                "both Content-Length and Transfer-Encoding",
            ),
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
                "unsupported Transfer-Encoding",
            ),
            (
                b"POST / HTTP/1.1\r\nHost: x\nContent-Length: 0\r\n\r\n",
                "bare LF line ending",
            ),
            (b"POST / HTTP/1.1\nHost: x\n\n", "bare LF line ending"),
            (
                b"POST / HTTP/1.1\r\nContent-Length : 2\r\n\r\n",
                "malformed request head",
            ),
            (
                b"POST / HTTP/1.1\r\nX-A: 1\r\n folded\r\n\r\n",
                "malformed request head",
            ),
        ] {
            assert_eq!(
                verdicts(head, 4096),
                vec![Some(why)],
                "{}",
                String::from_utf8_lossy(head)
            );
        }
    }
}
