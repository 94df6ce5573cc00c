//! [`ResponseBody`]: the response body of the idempotency layer.
//!
//! The claim is always finished (recorded or freed) in the response future,
//! before the response head is handed to the server: a storable response is
//! collected there (it is small and its length is known), recorded, and sent
//! as one piece, so head and body leave in one write and a client that read
//! the response and retries at once is always replayed.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// Response body of [`Idempotency`](crate::replay::Idempotency): a
    /// replayed, recorded or rejected answer in one piece, or the handler's
    /// body passed through (possibly after a part already read).
    pub struct ResponseBody<B>
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
        Inner { #[pin] body: B },
        // Part of the body was read while trying to record it: hand that
        // out first, then the frame that stopped the reading, then the rest.
        Resumed {
            prefix: Option<Bytes>,
            held: Option<Held<B>>,
            body: Pin<Box<B>>,
        },
    }
}

pub(crate) enum Held<B: Body> {
    Frame(Frame<B::Data>),
    Error(B::Error),
}

impl<B: Body> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseBody").finish_non_exhaustive()
    }
}

impl<B: Body> ResponseBody<B> {
    pub(crate) fn full(data: Bytes) -> Self {
        Self {
            kind: Kind::Full { data: Some(data) },
        }
    }

    pub(crate) fn passthrough(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
        }
    }

    pub(crate) fn resumed(prefix: Bytes, held: Held<B>, body: Pin<Box<B>>) -> Self {
        Self {
            kind: Kind::Resumed {
                prefix: (!prefix.is_empty()).then_some(prefix),
                held: Some(held),
                body,
            },
        }
    }
}

impl<B> Body for ResponseBody<B>
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
            KindProj::Inner { body } => body.poll_frame(cx),
            KindProj::Resumed { prefix, held, body } => {
                if let Some(p) = prefix.take() {
                    return Poll::Ready(Some(Ok(Frame::data(B::Data::from(p)))));
                }
                match held.take() {
                    Some(Held::Frame(frame)) => Poll::Ready(Some(Ok(frame))),
                    Some(Held::Error(e)) => Poll::Ready(Some(Err(e))),
                    None => body.as_mut().poll_frame(cx),
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full { data } => data.is_none(),
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Resumed { prefix, held, body } => {
                prefix.is_none() && held.is_none() && body.is_end_stream()
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Inner { body } => body.size_hint(),
            Kind::Resumed { prefix, held, body } => {
                let mut extra = prefix.as_ref().map_or(0, |p| p.len() as u64);
                if let Some(Held::Frame(f)) = held {
                    extra += f.data_ref().map_or(0, |d| bytes::Buf::remaining(d) as u64);
                }
                let inner = body.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(inner.lower().saturating_add(extra));
                if let Some(upper) = inner.upper() {
                    hint.set_upper(upper.saturating_add(extra));
                }
                hint
            }
        }
    }
}
