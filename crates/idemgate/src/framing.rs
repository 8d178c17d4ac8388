//! A strict second reading of each request head, for request-smuggling shapes that hyper
//! tolerates.
//!
//! hyper follows RFC 9112 leniently: with both `Content-Length` and `Transfer-Encoding` it drops
//! the length and lets chunked win, and it folds repeated identical lengths into one. A gateway
//! in front of other proxies must not be lenient there: two hops that pick different framings
//! are how requests get smuggled. hyper also hides what it dropped, so [`Sniffer`] wraps the
//! connection and reads the framing headers of each request head itself as the bytes go by
//! (see [`judge`]), following body framing so it stays in step across keep-alive requests. For
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
                if let Some((verdict, next, len)) = judge(&data[skip..]) {
                    verdicts.push(verdict);
                    return (if verdict.is_some() { State::Off } else { next }, skip + len);
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
            // `head_end` found the empty line judge stops at, so this is never `None`.
            let Some((verdict, next, _)) = judge(&head[skip..end]) else {
                debug_assert!(false, "judge found no end where head_end did");
                return (State::Off, data.len());
            };
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

/// Judges the head at the start of `buf` (request line, header lines, an empty line): its
/// verdict, how its body is framed, and its length up to and including the empty line. `None`
/// when `buf` holds no complete head. Nothing after the empty line is read, so the verdict does
/// not depend on how the bytes were split across reads.
///
/// Only the framing headers are read, line by line, instead of parsing every header: the whole
/// head is hyper's to parse, and a head hyper refuses never reaches the service, so the sniffer
/// needs to agree with hyper only on heads hyper accepts (a test checks it against `httparse`,
/// hyper's parser). What it refuses on its own are the shapes two parsers disagree on: any bare
/// LF, a folded line, and whitespace between a framing header's name and its colon
/// (`Transfer-Encoding : chunked`, a classic smuggling probe).
fn judge(buf: &[u8]) -> Option<(Verdict, State, usize)> {
    let (mut lengths, mut length) = (0usize, None);
    let mut te = None;
    let (mut bare_lf, mut malformed, mut several_te) = (false, false, false);
    let mut line_start = 0;
    for nl in memchr::memchr_iter(b'\n', buf) {
        let cr = nl > 0 && buf[nl - 1] == b'\r';
        // A bare LF as a line end: some servers accept it, some do not.
        bare_lf |= !cr;
        let line = &buf[line_start..nl - usize::from(cr)];
        let first = line_start == 0;
        line_start = nl + 1;
        let Some(&lead) = line.first() else {
            let refused = if bare_lf {
                Some("bare LF line ending")
            } else if malformed {
                Some("malformed request head")
            } else if several_te {
                Some("several Transfer-Encoding headers")
            } else {
                None
            };
            let (verdict, next) = match refused {
                Some(why) => (Some(why), State::Off),
                None => framed(lengths, length, te),
            };
            return Some((verdict, next, line_start));
        };
        if first {
            continue; // the request line
        }
        let framing = match lead {
            b' ' | b'\t' => Framing::Malformed,
            b'c' | b'C' => framing_value(line, b"content-length"),
            b't' | b'T' => framing_value(line, b"transfer-encoding"),
            _ => Framing::Other,
        };
        match framing {
            Framing::Other => {}
            Framing::Malformed => malformed = true,
            Framing::Value(v) if lead.eq_ignore_ascii_case(&b'c') => {
                lengths += 1;
                length = Some(v);
            }
            Framing::Value(v) => {
                several_te |= te.is_some();
                te = Some(v);
            }
        }
    }
    None
}

/// The verdict on a head's framing headers, and how its body is framed.
fn framed(lengths: usize, length: Option<&[u8]>, te: Option<&[u8]>) -> (Verdict, State) {
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

/// What a header line says about framing.
enum Framing<'a> {
    /// Another header.
    Other,
    /// The framing header `name`, with its value trimmed of spaces and tabs.
    Value(&'a [u8]),
    /// `name` followed by whitespace before its colon.
    Malformed,
}

/// Reads `line` (no CRLF) as the header `name` (lowercase), compared without case.
fn framing_value<'a>(line: &'a [u8], name: &[u8]) -> Framing<'a> {
    let Some((head, rest)) = line.split_at_checked(name.len()) else {
        return Framing::Other;
    };
    if !head.eq_ignore_ascii_case(name) {
        return Framing::Other;
    }
    let blank = |b: &u8| *b == b' ' || *b == b'\t';
    match rest.first() {
        Some(b':') => {
            let v = &rest[1..];
            let from = v.iter().position(|b| !blank(b)).unwrap_or(v.len());
            let to = v.iter().rposition(|b| !blank(b)).map_or(from, |i| i + 1);
            Framing::Value(&v[from..to])
        }
        Some(b) if blank(b) => match rest.iter().find(|b| !blank(b)) {
            Some(b':') => Framing::Malformed,
            _ => Framing::Other,
        },
        _ => Framing::Other,
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

    /// The framing the sniffer read before it read only the framing headers: every header
    /// parsed with `httparse`, as hyper parses them.
    fn judged_by_httparse(head: &[u8]) -> Option<(Verdict, State)> {
        if memchr::memchr_iter(b'\n', head).any(|i| i == 0 || head[i - 1] != b'\r') {
            return Some((Some("bare LF line ending"), State::Off));
        }
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut req = httparse::Request::new(&mut headers);
        if !matches!(req.parse(head), Ok(httparse::Status::Complete(_))) {
            return None; // hyper refuses it: the service never sees it
        }
        let (mut lengths, mut length, mut tes) = (0usize, None, Vec::new());
        for h in req.headers.iter() {
            if h.name.eq_ignore_ascii_case("content-length") {
                lengths += 1;
                length = Some(h.value);
            } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                tes.push(h.value);
            }
        }
        Some(match (lengths, tes.as_slice()) {
            (_, [_, _, ..]) => (Some("several Transfer-Encoding headers"), State::Off),
            (0, []) => (None, State::Head(Vec::new())),
            (1.., [_]) => (Some("both Content-Length and Transfer-Encoding"), State::Off),
            (2.., []) => (Some("several Content-Length headers"), State::Off),
            (_, []) => match length
                .and_then(|len| std::str::from_utf8(len).ok())
                .and_then(|s| s.trim().parse::<u64>().ok())
            {
                Some(0) => (None, State::Head(Vec::new())),
                Some(n) => (None, State::Body(n)),
                None => (Some("invalid Content-Length"), State::Off),
            },
            (0, [te]) if te.eq_ignore_ascii_case(b"chunked") => (None, State::ChunkSize(Vec::new())),
            (0, [_]) => (Some("unsupported Transfer-Encoding"), State::Off),
        })
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(4000))]

        /// On every head hyper's parser accepts, the sniffer reads the framing hyper's parser
        /// reads: names in any case, values with spaces and tabs around them, look-alike names,
        /// repeated and conflicting headers.
        #[test]
        fn reads_the_framing_httparse_reads(
            lines in proptest::collection::vec(
                (
                    proptest::sample::select(vec![
                        "Content-Length", "content-length", "CONTENT-length", "Transfer-Encoding",
                        "transfer-encoding", "TRANSFER-ENCODING", "Content-Length-X", "Content-Lengthx",
                        "X-Content-Length", "Transfer-Encodings", "Host", "Content-Type", "T", "C", " Host",
                    ]),
                    proptest::sample::select(vec![":", ": ", ":\t", " :", "\t:", ":   ", ""]),
                    proptest::sample::select(vec![
                        "0", "5", " 12 ", "12\t", "chunked", "Chunked", " chunked ", "gzip",
                        "chunked, gzip", "+5", "-1", "abc", "", "18446744073709551616", "a\tb",
                        "5\r", "\r5", "5\x0b", "\u{a0}5", "\x00", "\x7f", "é", "5\r\n 6",
                    ]),
                    // Line ends: CRLF, a bare LF, a bare CR, a CR doubled.
                    proptest::sample::select(vec!["\r\n", "\r\n", "\r\n", "\n", "\r", "\r\r\n"]),
                ),
                0..6,
            ),
            request_line in proptest::sample::select(vec![
                "POST /x HTTP/1.1", "GET / HTTP/1.0", "PRI * HTTP/2.0", "POST  /x HTTP/1.1",
                "POST /x\tHTTP/1.1", "Content-Length: 5",
            ]),
        ) {
            let mut head = format!("{request_line}\r\n").into_bytes();
            for (name, sep, value, end) in &lines {
                head.extend_from_slice(format!("{name}{sep}{value}{end}").as_bytes());
            }
            head.extend_from_slice(b"\r\n");
            let bytes: Vec<&[u8]> = head.chunks(1).collect();
            proptest::prop_assert_eq!(verdicts_for(&bytes), verdicts_for(&[&head]), "split byte by byte");
            // The old reading judged a head up to the end `head_end` finds (a generated head
            // may end early, at an empty line a bare LF makes, or not at all).
            let Some(end) = head_end(&head, 0) else {
                return Ok(());
            };
            let head = &head[..end];
            if let Some(expected) = judged_by_httparse(head) {
                let (verdict, state, len) = judge(head).expect("a complete head");
                proptest::prop_assert_eq!(len, head.len());
                proptest::prop_assert_eq!(
                    (verdict, format!("{state:?}")),
                    (expected.0, format!("{:?}", expected.1)),
                    "{}", String::from_utf8_lossy(head)
                );
            }
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
            (
                b"POST / HTTP/1.1\r\nTransfer-Encoding\t: chunked\r\n\r\n",
                "malformed request head",
            ),
            (
                b"POST / HTTP/1.1\r\nHost: x\r\ntransfer-encoding: chunked\r\nTRANSFER-ENCODING: chunked\r\n\r\n",
                "several Transfer-Encoding headers",
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
