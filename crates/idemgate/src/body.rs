//! The response body type, and reading bodies with a limit.
//!
//! Replays and problems are a `Full` body (no boxing on the replay path); proxied upstream
//! bodies are streamed through a boxed body.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What the gateway answers with: a complete body, or a stream.
pub enum Body {
    Full(Option<Bytes>),
    Stream(UnsyncBoxBody<Bytes, BoxError>),
}

/// A complete in-memory body.
#[must_use]
pub fn full(bytes: Bytes) -> Body {
    Body::Full((!bytes.is_empty()).then_some(bytes))
}

/// A streamed body.
pub fn stream<B>(body: B) -> Body
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    Body::Stream(body.map_err(|e| e.into()).boxed_unsync())
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            Body::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Body::Stream(s) => Pin::new(s).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Body::Full(b) => b.is_none(),
            Body::Stream(s) => s.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Body::Full(b) => SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64)),
            Body::Stream(s) => s.size_hint(),
        }
    }
}

/// How reading a body with a limit ended.
pub enum Read<B> {
    /// The whole body, within the limit.
    Complete(Bytes),
    /// Over the limit: what was read so far, and the rest of the body still to stream.
    TooLarge(Bytes, B),
}

/// Reads `body` until it ends or more than `limit` bytes arrived.
///
/// # Errors
/// The body failed mid-way.
pub async fn read_limited<B>(mut body: B, limit: usize) -> Result<Read<B>, BoxError>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    if body.size_hint().lower() > limit as u64 {
        return Ok(Read::TooLarge(Bytes::new(), body));
    }
    let mut buf = BytesMut::new();
    let mut first: Option<Bytes> = None;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.map_err(|e| e.into())?.into_data() else {
            continue; // trailers are not forwarded
        };
        // Keep a single chunk without copying: the common case of a small body.
        match (&first, buf.is_empty()) {
            (None, true) => first = Some(data),
            _ => {
                if let Some(f) = first.take() {
                    buf.extend_from_slice(&f);
                }
                buf.extend_from_slice(&data);
            }
        }
        let len = first.as_ref().map_or(buf.len(), Bytes::len);
        if len > limit {
            let so_far = first.take().unwrap_or_else(|| buf.split().freeze());
            return Ok(Read::TooLarge(so_far, body));
        }
    }
    Ok(Read::Complete(first.unwrap_or_else(|| buf.freeze())))
}

/// The part of a body already read, followed by the rest of it.
pub struct Prefixed<B> {
    prefix: Option<Bytes>,
    rest: B,
}

impl<B> Prefixed<B> {
    pub fn new(prefix: Bytes, rest: B) -> Self {
        Self {
            prefix: (!prefix.is_empty()).then_some(prefix),
            rest,
        }
    }
}

impl<B> http_body::Body for Prefixed<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(prefix) = self.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(prefix))));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }
}
