//! [`ResponseBody`]: the lock layer's response body. It holds the lease
//! until the end of the stream, and reports that end only after the
//! release finished.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::lease::{LeaseGuard, ReleaseFuture};

pin_project! {
    /// Response body of [`RedisLock`](super::RedisLock).
    ///
    /// While it holds a lease, the end of the stream is reported only after
    /// the release finished: the last data frame (by `Content-Length`, or when
    /// the inner body says it has ended) or the final `None` waits for the
    /// backend. If the body is dropped early (client gone) the lease is
    /// released on a spawned task; dropped while its release is on its way,
    /// that release goes on without it (the store's rule:
    /// [`LockBackend::release`](crate::backend::LockBackend::release)).
    pub struct ResponseBody<B>
    where
        B: Body,
    {
        #[pin]
        state: State<B>,
    }
}

pin_project! {
    /// Each state owns what it needs; `Done` owns nothing.
    #[project = StateProj]
    #[project_replace = StateOwned]
    enum State<B>
    where
        B: Body,
    {
        /// Frames pass through while `guard` holds the lease; the last one
        /// (or the end) releases it first.
        Streaming {
            // Boxed so the response future can poll it once before handing
            // the response over (see `future.rs`).
            body: Pin<Box<B>>,
            guard: LeaseGuard,
            // A frame (or error) that the response future took from `body`
            // first, handed out before anything else.
            first: Option<Result<Frame<B::Data>, B::Error>>,
            // Bytes still to come by the declared length, if declared.
            remaining: Option<u64>,
            // Wait for the release before handing out the last item (else
            // fire-and-forget).
            wait: bool,
        },
        /// The release runs; `then` is handed out once it finished.
        // Boxed: the release's deadline timer is inline (not `Unpin`), and
        // this body stays `Unpin`.
        Releasing { release: Pin<Box<ReleaseFuture>>, body: Pin<Box<B>>, then: Held<B> },
        /// No lease (left): the inner body as it is.
        Passthrough { body: Pin<Box<B>> },
        /// A body read whole, handed out as one frame.
        Full { data: Bytes },
        /// Ended.
        Done,
    }
}

/// One item of a body, as `poll_frame` hands it out.
type Item<B> = Option<Result<Frame<<B as Body>::Data>, <B as Body>::Error>>;

/// The item the client sees after the release.
enum Held<B: Body> {
    Frame(Frame<B::Data>),
    Error(B::Error),
    End,
}

impl<B: Body> Held<B> {
    /// The item to hand out, and the state after it.
    fn hand_out(self, body: Pin<Box<B>>) -> (Item<B>, State<B>) {
        match self {
            Held::Frame(frame) => (Some(Ok(frame)), State::Passthrough { body }),
            Held::Error(error) => (Some(Err(error)), State::Passthrough { body }),
            Held::End => (None, State::Done),
        }
    }
}

impl<B: Body> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            State::Streaming { .. } => "Streaming",
            State::Releasing { .. } => "Releasing",
            State::Passthrough { .. } => "Passthrough",
            State::Full { .. } => "Full",
            State::Done => "Done",
        };
        f.debug_struct("ResponseBody")
            .field("state", &state)
            .finish_non_exhaustive()
    }
}

impl<B: Body> ResponseBody<B> {
    pub(crate) fn passthrough(body: B) -> Self {
        Self {
            state: State::Passthrough {
                body: Box::pin(body),
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
            state: State::Streaming {
                body,
                guard,
                first,
                remaining: declared,
                wait,
            },
        }
    }

    pub(crate) fn full(data: Bytes) -> Self {
        Self {
            state: if data.is_empty() {
                State::Done
            } else {
                State::Full { data }
            },
        }
    }

    /// `true` while this body still holds a lease.
    #[cfg(test)]
    pub(crate) fn holds_lease(&self) -> bool {
        matches!(
            &self.state,
            State::Streaming { .. } | State::Releasing { .. }
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
        let mut state = self.project().state;
        loop {
            let (item, next) = match state.as_mut().project() {
                StateProj::Passthrough { body } => {
                    let item = ready!(body.as_mut().poll_frame(cx));
                    if item.is_none() {
                        // Report the end even if the inner body does not.
                        state.set(State::Done);
                    }
                    return Poll::Ready(item);
                }
                StateProj::Done => return Poll::Ready(None),
                StateProj::Full { .. } => {
                    let StateOwned::Full { data } = state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was Full")
                    };
                    return Poll::Ready(Some(Ok(Frame::data(data.into()))));
                }
                StateProj::Releasing { release, .. } => {
                    ready!(release.as_mut().poll(cx));
                    let StateOwned::Releasing { body, then, .. } =
                        state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was Releasing")
                    };
                    then.hand_out(body)
                }
                StateProj::Streaming {
                    body,
                    first,
                    remaining,
                    ..
                } => {
                    let next = match first.take() {
                        Some(item) => Some(item),
                        None => ready!(body.as_mut().poll_frame(cx)),
                    };
                    // Is this the last thing the client will see?
                    let (last, held) = match next {
                        None => (true, Held::End),
                        Some(Err(e)) => (true, Held::Error(e)),
                        Some(Ok(frame)) => {
                            let mut last = body.is_end_stream();
                            if let (Some(left), Some(data)) = (remaining.as_mut(), frame.data_ref())
                            {
                                *left = left.saturating_sub(data.remaining() as u64);
                                last |= *left == 0;
                            }
                            (last, Held::Frame(frame))
                        }
                    };
                    if !last {
                        let Held::Frame(frame) = held else {
                            unreachable!("only a frame can be followed by more")
                        };
                        return Poll::Ready(Some(Ok(frame)));
                    }
                    let StateOwned::Streaming {
                        body, guard, wait, ..
                    } = state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was Streaming")
                    };
                    if wait {
                        state.set(State::Releasing {
                            release: Box::pin(guard.release()),
                            body,
                            then: held,
                        });
                        continue;
                    }
                    // Fire-and-forget: dropping the armed guard spawns the
                    // release.
                    drop(guard);
                    held.hand_out(body)
                }
            };
            state.set(next);
            return Poll::Ready(item);
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.state {
            State::Passthrough { body } => body.is_end_stream(),
            State::Done => true,
            // Non-empty data, or the end not yet reported.
            State::Full { .. } | State::Streaming { .. } | State::Releasing { .. } => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.state {
            State::Full { data } => SizeHint::with_exact(data.len() as u64),
            State::Done => SizeHint::with_exact(0),
            State::Passthrough { body } => body.size_hint(),
            State::Streaming { body, first, .. } => {
                let taken = match first {
                    Some(Ok(frame)) => frame.data_ref().map_or(0, |d| d.remaining() as u64),
                    _ => 0,
                };
                with_taken(body.size_hint(), taken)
            }
            State::Releasing { body, then, .. } => {
                let taken = match then {
                    Held::Frame(frame) => frame.data_ref().map_or(0, |d| d.remaining() as u64),
                    _ => 0,
                };
                with_taken(body.size_hint(), taken)
            }
        }
    }
}

/// `hint` of the inner body plus `n` bytes already taken from it and not yet
/// handed out.
fn with_taken(mut hint: SizeHint, n: u64) -> SizeHint {
    // Upper first: `set_lower` panics above the upper bound.
    if let Some(upper) = hint.upper() {
        hint.set_upper(upper.saturating_add(n));
    }
    hint.set_lower(hint.lower().saturating_add(n));
    hint
}

#[cfg(test)]
mod tests;
