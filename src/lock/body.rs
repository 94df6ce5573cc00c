//! [`ResponseBody`]: the response body, holding the lease until its end.

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use super::lease::{LeaseGuard, ReleaseFuture};

pin_project! {
    /// Response body of [`RedisLock`](super::RedisLock).
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
            ended: bool,
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
                ended: false,
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
                ended: false,
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
    #[cfg(test)]
    pub(crate) fn holds_lease(&self) -> bool {
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
                ended,
            } => loop {
                if let Some(fut) = releasing.as_mut() {
                    ready!(fut.as_mut().poll(cx));
                    *releasing = None;
                    return Poll::Ready(match held.take() {
                        Some(Held::Frame(f)) => Some(Ok(f)),
                        Some(Held::Error(e)) => Some(Err(e)),
                        Some(Held::End) | None => {
                            *ended = true;
                            None
                        }
                    });
                }
                if *ended {
                    return Poll::Ready(None);
                }
                let next = match first.take() {
                    Some(item) => Some(item),
                    None => ready!(body.as_mut().poll_frame(cx)),
                };
                *ended = next.is_none() && guard.is_none();
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
                    Held::End => {
                        *ended = true;
                        None
                    }
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
                ended,
                ..
            } => {
                *ended
                    || (guard.is_none()
                        && first.is_none()
                        && releasing.is_none()
                        && held.is_none()
                        && body.is_end_stream())
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use bytes::Bytes;
    use http_body_util::{BodyExt, StreamBody};

    use super::*;
    use crate::backend::{LockBackend, MemoryBackend, Token};
    use crate::key::{DigestKey, KeyWriter};

    fn held_guard(backend: &MemoryBackend) -> (LeaseGuard, Bytes) {
        let key = KeyWriter::new(&DigestKey::public()).finish();
        let storage = key.storage_key("t");
        let token = Token::generate();
        backend.try_acquire(&storage, &token, Duration::from_secs(10));
        let arc: Arc<dyn LockBackend> = Arc::new(backend.clone());
        (
            LeaseGuard::new(arc, storage.clone(), key, token, Duration::from_secs(1)),
            storage,
        )
    }

    type Chunks = Vec<Result<Frame<Bytes>, std::convert::Infallible>>;

    fn stream(chunks: &[&'static str]) -> StreamBody<tokio_stream_shim::Iter<Chunks>> {
        let frames: Chunks = chunks
            .iter()
            .map(|c| Ok(Frame::data(Bytes::from_static(c.as_bytes()))))
            .collect();
        StreamBody::new(tokio_stream_shim::Iter(frames.into_iter()))
    }

    mod tokio_stream_shim {
        pub(super) struct Iter<I>(pub(super) std::vec::IntoIter<I::Item>)
        where
            I: IntoIterator;
        impl<T> futures_core::Stream for Iter<Vec<T>> {
            type Item = T;
            fn poll_next(
                mut self: std::pin::Pin<&mut Self>,
                _: &mut std::task::Context<'_>,
            ) -> std::task::Poll<Option<T>> {
                std::task::Poll::Ready(self.0.next())
            }
        }
        impl<T> Unpin for Iter<Vec<T>> {}
    }

    #[tokio::test]
    async fn unknown_length_releases_before_reporting_the_end() {
        let backend = MemoryBackend::new();
        let (guard, key) = held_guard(&backend);
        let mut body = ResponseBody::locked(Box::pin(stream(&["a", "b"])), guard, None, true, None);
        let f = body.frame().await.unwrap().unwrap();
        assert_eq!(f.into_data().unwrap(), "a");
        assert!(backend.is_held(&key) && !body.is_end_stream());
        let f = body.frame().await.unwrap().unwrap();
        assert_eq!(f.into_data().unwrap(), "b");
        assert!(backend.is_held(&key), "the end is not known yet");
        assert!(!body.is_end_stream(), "end must not be reported while held");
        assert!(body.frame().await.is_none());
        assert!(!backend.is_held(&key), "released before None was returned");
        assert!(body.is_end_stream());
    }

    #[tokio::test]
    async fn declared_length_releases_before_the_last_frame() {
        let backend = MemoryBackend::new();
        let (guard, key) = held_guard(&backend);
        let mut body =
            ResponseBody::locked(Box::pin(stream(&["ab", "cd"])), guard, Some(4), true, None);
        body.frame().await.unwrap().unwrap();
        assert!(backend.is_held(&key));
        let last = body.frame().await.unwrap().unwrap();
        assert_eq!(last.into_data().unwrap(), "cd");
        assert!(
            !backend.is_held(&key),
            "released before the frame that completes Content-Length"
        );
    }

    #[tokio::test]
    async fn dropped_body_releases_in_the_background() {
        let backend = MemoryBackend::new();
        let (guard, key) = held_guard(&backend);
        let body = ResponseBody::locked(Box::pin(stream(&["a"])), guard, None, true, None);
        assert!(body.holds_lease());
        drop(body);
        // The spawned release runs on this runtime.
        for _ in 0..100 {
            if !backend.is_held(&key) {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("lease still held after the body was dropped");
    }

    #[tokio::test]
    async fn fire_and_forget_does_not_wait() {
        let backend = MemoryBackend::new();
        let (guard, key) = held_guard(&backend);
        let mut body = ResponseBody::locked(Box::pin(stream(&["a"])), guard, None, false, None);
        body.frame().await.unwrap().unwrap();
        assert!(body.frame().await.is_none());
        for _ in 0..100 {
            if !backend.is_held(&key) {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("fire-and-forget release never ran");
    }
}
