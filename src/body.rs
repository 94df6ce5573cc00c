//! [`ResponseBody`]: the response body, holding the lease until its end.

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::lease::{LeaseGuard, ReleaseFuture};

pin_project! {
    /// Response body of [`RedisLock`](crate::RedisLock).
    ///
    /// While it holds the lease, the end of the stream is reported only after
    /// the release finished: the last data frame (by `Content-Length`, or when
    /// the inner body says it has ended) or the final `None` waits for the
    /// backend. If the body is dropped early (client gone) the lease is
    /// released on a spawned task.
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
        Inner {
            // Boxed so the response future can poll it once before handing
            // the response over (see `future.rs`).
            body: Pin<Box<B>>,
            // A frame (or error) that poll took from `body` first.
            first: Option<Result<Frame<B::Data>, B::Error>>,
            guard: Option<LeaseGuard>,
            releasing: Option<ReleaseFuture>,
            // What to hand out once the release finished.
            held: Option<Held<B>>,
            remaining: Option<u64>,
            wait: bool,
        },
        Full { data: Option<Bytes> },
    }
}

enum Held<B: Body> {
    Frame(Frame<B::Data>),
    Error(B::Error),
    End,
}

impl<B: Body> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseBody").finish_non_exhaustive()
    }
}

impl<B: Body> ResponseBody<B> {
    pub(crate) fn unlocked(body: B) -> Self {
        Self {
            kind: Kind::Inner {
                body: Box::pin(body),
                first: None,
                guard: None,
                releasing: None,
                held: None,
                remaining: None,
                wait: true,
            },
        }
    }

    pub(crate) fn locked(
        body: Pin<Box<B>>,
        guard: LeaseGuard,
        declared: Option<u64>,
        wait: bool,
        first: Option<Result<Frame<B::Data>, B::Error>>,
    ) -> Self {
        Self {
            kind: Kind::Inner {
                body,
                first,
                guard: Some(guard),
                releasing: None,
                held: None,
                remaining: declared,
                wait,
            },
        }
    }

    pub(crate) fn full(data: Bytes) -> Self {
        Self {
            kind: Kind::Full {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }

    /// `true` while this body still holds a lease.
    pub fn holds_lease(&self) -> bool {
        matches!(
            &self.kind,
            Kind::Inner { guard: Some(_), .. }
                | Kind::Inner {
                    releasing: Some(_),
                    ..
                }
        )
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
            KindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d.into())))),
            KindProj::Inner {
                body,
                first,
                guard,
                releasing,
                held,
                remaining,
                wait,
            } => loop {
                if let Some(fut) = releasing.as_mut() {
                    ready!(fut.as_mut().poll(cx));
                    *releasing = None;
                    return Poll::Ready(match held.take() {
                        Some(Held::Frame(f)) => Some(Ok(f)),
                        Some(Held::Error(e)) => Some(Err(e)),
                        Some(Held::End) | None => None,
                    });
                }
                let next = match first.take() {
                    Some(item) => Some(item),
                    None => ready!(body.as_mut().poll_frame(cx)),
                };
                let Some(g) = guard.take() else {
                    return Poll::Ready(next);
                };
                // Is this the last thing the client will see?
                let (last, keep) = match next {
                    None => (true, Held::End),
                    Some(Err(e)) => (true, Held::Error(e)),
                    Some(Ok(frame)) => {
                        let mut last = body.is_end_stream();
                        if let (Some(left), Some(data)) = (remaining.as_mut(), frame.data_ref()) {
                            *left = left.saturating_sub(data.remaining() as u64);
                            last |= *left == 0;
                        }
                        (last, Held::Frame(frame))
                    }
                };
                if !last {
                    *guard = Some(g);
                    return Poll::Ready(match keep {
                        Held::Frame(f) => Some(Ok(f)),
                        Held::Error(e) => Some(Err(e)),
                        Held::End => None,
                    });
                }
                if *wait {
                    *held = Some(keep);
                    *releasing = Some(g.release());
                    continue;
                }
                // Fire-and-forget: dropping the armed guard spawns the release.
                drop(g);
                return Poll::Ready(match keep {
                    Held::Frame(f) => Some(Ok(f)),
                    Held::Error(e) => Some(Err(e)),
                    Held::End => None,
                });
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Full { data } => data.is_none(),
            Kind::Inner {
                body,
                first,
                guard,
                releasing,
                held,
                ..
            } => {
                guard.is_none()
                    && first.is_none()
                    && releasing.is_none()
                    && held.is_none()
                    && body.is_end_stream()
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Inner { body, first, .. } => {
                let mut hint = body.size_hint();
                // Count the frame already taken from `body`.
                if let Some(Ok(frame)) = first {
                    let n = frame.data_ref().map_or(0, |d| d.remaining() as u64);
                    // Upper first: `set_lower` panics above the upper bound.
                    if let Some(upper) = hint.upper() {
                        hint.set_upper(upper.saturating_add(n));
                    }
                    hint.set_lower(hint.lower().saturating_add(n));
                }
                hint
            }
        }
    }
}
