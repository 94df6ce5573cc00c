//! [`ResponseBody`]: the idempotency layer's response body. A replayed,
//! recorded or rejected answer in one piece, or the handler's body passed
//! through, possibly after the part the layer read while trying to record
//! it. It holds nothing (the claim is the run's, `execution.rs`), so dropping it
//! early costs nothing.

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// Response body of [`Idempotency`](super::Idempotency).
    pub struct ResponseBody<B>
    where
        B: Body,
    {
        #[pin]
        state: State<B>,
    }
}

pin_project! {
    #[project = StateProj]
    #[project_replace = StateOwned]
    enum State<B>
    where
        B: Body,
    {
        /// The handler's body as it is.
        Passthrough { body: Pin<Box<B>> },
        /// Part of the body was already read (while trying to record it):
        /// that part first, then the item that stopped the reading, then the
        /// rest.
        Resumed {
            prefix: Option<Bytes>,
            stopped: Option<Result<Frame<B::Data>, B::Error>>,
            body: Pin<Box<B>>,
        },
        /// A body read whole (or a stored one), handed out as one frame,
        /// then its trailers (a gRPC answer's status), if any.
        Full { data: Option<Bytes>, trailers: Option<HeaderMap> },
        /// Ended.
        Done,
    }
}

impl<B: Body> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            State::Passthrough { .. } => "Passthrough",
            State::Resumed { .. } => "Resumed",
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

    /// What is left of a body after `prefix` was read from it and `stopped`
    /// (a frame or an error) ended the reading: those first, then the rest.
    pub(crate) fn resumed(
        prefix: Bytes,
        stopped: Result<Frame<B::Data>, B::Error>,
        body: Pin<Box<B>>,
    ) -> Self {
        Self {
            state: State::Resumed {
                prefix: (!prefix.is_empty()).then_some(prefix),
                stopped: Some(stopped),
                body,
            },
        }
    }

    pub(crate) fn full(data: Bytes) -> Self {
        Self::full_with_trailers(data, None)
    }

    /// `data` in one frame, then `trailers` when given.
    pub(crate) fn full_with_trailers(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        let data = (!data.is_empty()).then_some(data);
        Self {
            state: if data.is_none() && trailers.is_none() {
                State::Done
            } else {
                State::Full { data, trailers }
            },
        }
    }

    /// An answer the layer made itself (a replay, a rejection): its body
    /// in one piece, and the trailers of a replayed record (carried in its
    /// extensions as [`StoredTrailers`]).
    pub(crate) fn answer(res: http::Response<Bytes>) -> http::Response<Self> {
        let (mut parts, data) = res.into_parts();
        let trailers = parts.extensions.remove::<StoredTrailers>().map(|t| t.0);
        http::Response::from_parts(parts, Self::full_with_trailers(data, trailers))
    }
}

/// The trailers of a replayed record, on their way from the answer (a
/// `Response<Bytes>`, which has no room for them) to its body.
#[derive(Debug, Clone)]
pub(crate) struct StoredTrailers(pub(crate) HeaderMap);

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
            match state.as_mut().project() {
                StateProj::Passthrough { body } => {
                    let item = ready!(body.as_mut().poll_frame(cx));
                    if item.is_none() {
                        // Report the end even if the inner body does not.
                        state.set(State::Done);
                    }
                    return Poll::Ready(item);
                }
                StateProj::Resumed {
                    prefix, stopped, ..
                } => {
                    if let Some(prefix) = prefix.take() {
                        return Poll::Ready(Some(Ok(Frame::data(prefix.into()))));
                    }
                    if let Some(item) = stopped.take() {
                        return Poll::Ready(Some(item));
                    }
                    let StateOwned::Resumed { body, .. } =
                        state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was Resumed")
                    };
                    state.set(State::Passthrough { body });
                }
                StateProj::Full { data, trailers } => {
                    if let Some(data) = data.take() {
                        return Poll::Ready(Some(Ok(Frame::data(data.into()))));
                    }
                    if let Some(trailers) = trailers.take() {
                        return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
                    }
                    state.set(State::Done);
                }
                StateProj::Done => return Poll::Ready(None),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.state {
            State::Passthrough { body } => body.is_end_stream(),
            State::Resumed {
                prefix,
                stopped,
                body,
            } => prefix.is_none() && stopped.is_none() && body.is_end_stream(),
            State::Full { data, trailers } => data.is_none() && trailers.is_none(),
            State::Done => true,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.state {
            State::Full { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            State::Done => SizeHint::with_exact(0),
            State::Passthrough { body } => body.size_hint(),
            State::Resumed {
                prefix,
                stopped,
                body,
            } => {
                let mut taken = prefix.as_ref().map_or(0, |p| p.len() as u64);
                if let Some(Ok(frame)) = stopped {
                    taken += frame.data_ref().map_or(0, |d| d.remaining() as u64);
                }
                let mut hint = body.size_hint();
                // Upper first: `set_lower` panics above the upper bound.
                if let Some(upper) = hint.upper() {
                    hint.set_upper(upper.saturating_add(taken));
                }
                hint.set_lower(hint.lower().saturating_add(taken));
                hint
            }
        }
    }
}

#[cfg(test)]
mod tests;
