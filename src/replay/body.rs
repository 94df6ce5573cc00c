//! [`ReplayBody`]: the response body of the idempotency layer. It copies
//! the first response into the record and finishes the claim (record or
//! free) *before* reporting the end of the stream, so a client that read the
//! whole response and retries at once gets the replay, not a 409.

use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::{HeaderMap, StatusCode};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::record::{NotStoredReason, Record, StoredResponse};
use super::service::{ClaimGuard, FinishFuture};

/// What will be recorded once the body ends.
#[derive(Debug)]
pub(crate) struct Capture {
    status: StatusCode,
    headers: HeaderMap,
    buf: Option<BytesMut>,
    limit: usize,
    reason: Option<NotStoredReason>,
    retention: Duration,
}

impl Capture {
    /// The response is not kept (only the fact that it happened).
    pub(crate) fn not_stored(
        status: StatusCode,
        reason: NotStoredReason,
        retention: Duration,
    ) -> Self {
        Self {
            status,
            headers: HeaderMap::new(),
            buf: None,
            limit: 0,
            reason: Some(reason),
            retention,
        }
    }

    /// Keep the body, expected to be `expected` bytes, at most `limit`.
    pub(crate) fn buffer(
        status: StatusCode,
        headers: HeaderMap,
        expected: usize,
        limit: usize,
        retention: Duration,
    ) -> Self {
        Self {
            status,
            headers,
            buf: Some(BytesMut::with_capacity(expected.min(limit))),
            limit,
            reason: None,
            retention,
        }
    }

    fn push(&mut self, data: &[u8]) {
        if let Some(buf) = &mut self.buf {
            if buf.len() + data.len() > self.limit {
                self.buf = None;
                self.reason = Some(NotStoredReason::TooLarge);
            } else {
                buf.extend_from_slice(data);
            }
        }
    }

    fn trailers(&mut self) {
        self.buf = None;
        self.reason.get_or_insert(NotStoredReason::Streaming);
    }

    pub(crate) fn finish(self, guard: ClaimGuard) -> FinishFuture {
        let retention = self.retention;
        let record = match (self.reason, self.buf) {
            (None, Some(buf)) => Record::Response(StoredResponse {
                status: self.status,
                headers: self.headers,
                body: buf.freeze(),
            }),
            (reason, _) => Record::NotStored {
                status: self.status,
                reason: reason.unwrap_or(NotStoredReason::Streaming),
            },
        };
        guard.complete(record, retention)
    }
}

pin_project! {
    /// Response body of [`Idempotency`](crate::replay::Idempotency): a
    /// replayed or rejected answer, or the handler's body watched until its
    /// end.
    pub struct ReplayBody<B>
    where
        B: Body,
    {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B>
    where
        B: Body,
    {
        Full { data: Option<Bytes> },
        Inner {
            #[pin]
            body: B,
            guard: Option<ClaimGuard>,
            capture: Option<Capture>,
            finishing: Option<FinishFuture>,
            // What to hand out once the claim is finished.
            held: Option<Held<B>>,
        },
    }
}

enum Held<B: Body> {
    Frame(Frame<B::Data>),
    Error(B::Error),
    End,
}

impl<B: Body> std::fmt::Debug for ReplayBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplayBody").finish_non_exhaustive()
    }
}

impl<B: Body> ReplayBody<B> {
    pub(crate) fn full(data: Bytes) -> Self {
        Self {
            kind: Kind::Full { data: Some(data) },
        }
    }

    pub(crate) fn passthrough(body: B) -> Self {
        Self {
            kind: Kind::Inner {
                body,
                guard: None,
                capture: None,
                finishing: None,
                held: None,
            },
        }
    }

    pub(crate) fn watched(body: B, guard: ClaimGuard, capture: Option<Capture>) -> Self {
        Self {
            kind: Kind::Inner {
                body,
                guard: Some(guard),
                capture,
                finishing: None,
                held: None,
            },
        }
    }
}

impl<B> Body for ReplayBody<B>
where
    B: Body,
    B::Data: From<Bytes>,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        match self.project().kind.project() {
            KindProj::Full { data } => {
                Poll::Ready(data.take().map(|d| Ok(Frame::data(B::Data::from(d)))))
            }
            KindProj::Inner {
                mut body,
                guard,
                capture,
                finishing,
                held,
            } => loop {
                if let Some(f) = finishing.as_mut() {
                    ready!(f.as_mut().poll(cx));
                    *finishing = None;
                    return Poll::Ready(match held.take() {
                        Some(Held::Frame(frame)) => Some(Ok(frame)),
                        Some(Held::Error(e)) => Some(Err(e)),
                        Some(Held::End) | None => None,
                    });
                }
                if guard.is_none() {
                    return body.as_mut().poll_frame(cx);
                }
                let keep = match ready!(body.as_mut().poll_frame(cx)) {
                    None => Held::End,
                    Some(Err(e)) => {
                        // A broken response is not kept: free the key.
                        *capture = None;
                        Held::Error(e)
                    }
                    Some(Ok(frame)) => {
                        let frame = match frame.into_data() {
                            Ok(mut data) => {
                                let bytes = data.copy_to_bytes(data.remaining());
                                if let Some(c) = capture.as_mut() {
                                    c.push(&bytes);
                                }
                                Frame::data(B::Data::from(bytes))
                            }
                            Err(frame) => {
                                if frame.is_trailers() {
                                    if let Some(c) = capture.as_mut() {
                                        c.trailers();
                                    }
                                }
                                frame
                            }
                        };
                        if !body.is_end_stream() {
                            return Poll::Ready(Some(Ok(frame)));
                        }
                        Held::Frame(frame)
                    }
                };
                // The end (or an error): finish the claim before saying so.
                let Some(g) = guard.take() else {
                    continue;
                };
                *finishing = Some(match capture.take() {
                    Some(c) => c.finish(g),
                    None => g.abandon(),
                });
                *held = Some(keep);
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full { data } => data.is_none(),
            Kind::Inner {
                body,
                guard,
                finishing,
                held,
                ..
            } => guard.is_none() && finishing.is_none() && held.is_none() && body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Inner { body, .. } => body.size_hint(),
        }
    }
}
