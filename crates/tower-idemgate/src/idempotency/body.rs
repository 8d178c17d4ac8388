//! Body types: [`ResponseBody`], what the layer answers with, and [`RequestBody`], an adapter
//! that lets plain hyper services (whose request body is `hyper::body::Incoming`) sit behind it.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::sync::mpsc;

/// The error type of both bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

pin_project! {
    /// The layer's response body: the inner body untouched (no dedup), a complete body (replays
    /// and problems, no allocation beyond the bytes), or the frames of an execution streamed
    /// from its task while they are captured for the record.
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner { #[pin] body: B },
        Full { data: Option<Bytes> },
        Streamed { rx: mpsc::Receiver<Result<Frame<Bytes>, BoxError>>, hint: SizeHint },
    }
}

impl<B> ResponseBody<B> {
    /// The inner service's body, passed through.
    pub fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
        }
    }

    /// A complete body.
    pub fn full(data: Bytes) -> Self {
        Self {
            kind: Kind::Full {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }

    pub(crate) fn streamed(rx: mpsc::Receiver<Result<Frame<Bytes>, BoxError>>, hint: SizeHint) -> Self {
        Self {
            kind: Kind::Streamed { rx, hint },
        }
    }
}

impl<B> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.kind {
            Kind::Inner { .. } => "inner",
            Kind::Full { .. } => "full",
            Kind::Streamed { .. } => "streamed",
        };
        f.debug_struct("ResponseBody").field("kind", &kind).finish()
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            KindProj::Inner { body } => body.poll_frame(cx).map(|f| f.map(|r| r.map_err(Into::into))),
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            KindProj::Streamed { rx, .. } => rx.poll_recv(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Full { data } => data.is_none(),
            Kind::Streamed { .. } => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Full { data } => SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64)),
            Kind::Streamed { hint, .. } => *hint,
        }
    }
}

pin_project! {
    /// A request body that is either still streaming or already read into memory.
    ///
    /// The layer reads a deduplicated request's body (to fingerprint it) and hands the inner
    /// service a body rebuilt from the bytes, so the inner service's body type must implement
    /// `From<Bytes>`. axum's `Body` and `Full<Bytes>` do; `hyper::body::Incoming` does not, so a
    /// plain hyper service maps its body into this type first:
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http_body_util::BodyExt;
    /// use tower_idemgate::RequestBody;
    ///
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// let streaming = RequestBody::new(http_body_util::Full::new(Bytes::from("abc")));
    /// assert_eq!(streaming.collect().await.unwrap().to_bytes(), "abc");
    /// let rebuilt: RequestBody<http_body_util::Empty<Bytes>> = Bytes::from("abc").into();
    /// assert_eq!(rebuilt.collect().await.unwrap().to_bytes(), "abc");
    /// # });
    /// ```
    pub struct RequestBody<B> {
        #[pin]
        kind: ReqKind<B>,
    }
}

pin_project! {
    #[project = ReqKindProj]
    enum ReqKind<B> {
        Streaming { #[pin] body: B },
        Buffered { data: Option<Bytes> },
    }
}

impl<B> RequestBody<B> {
    /// Wraps a streaming body.
    pub fn new(body: B) -> Self {
        Self {
            kind: ReqKind::Streaming { body },
        }
    }
}

impl<B> From<Bytes> for RequestBody<B> {
    fn from(data: Bytes) -> Self {
        Self {
            kind: ReqKind::Buffered {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }
}

impl<B> std::fmt::Debug for RequestBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestBody").finish_non_exhaustive()
    }
}

impl<B> Body for RequestBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            ReqKindProj::Streaming { body } => body.poll_frame(cx).map(|f| f.map(|r| r.map_err(Into::into))),
            ReqKindProj::Buffered { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            ReqKind::Streaming { body } => body.is_end_stream(),
            ReqKind::Buffered { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            ReqKind::Streaming { body } => body.size_hint(),
            ReqKind::Buffered { data } => SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64)),
        }
    }
}
