use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};

use super::*;
use crate::backend::{LockBackend, MemoryBackend, Token};
use crate::key::{DigestKey, KeyWriter};
use crate::lock::testing::Deferred;

fn held_guard(backend: &MemoryBackend) -> (LeaseGuard, Bytes) {
    let key = KeyWriter::new(&DigestKey::public()).finish();
    let storage = key.storage_key("t");
    let token = Token::generate();
    backend.try_acquire(&storage, &token, Duration::from_secs(10));
    // Answers as futures: the path of a store that is not in process.
    let deferred: Arc<dyn LockBackend> = Arc::new(Deferred(backend.clone()));
    let config = crate::RedisLockLayer::new(deferred, crate::key::RequestMethod)
        .deadline(Duration::from_secs(1))
        .config;
    (
        LeaseGuard::new(
            config,
            storage.clone(),
            key,
            token,
            None,
            tokio::time::Instant::now(),
        ),
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
async fn after_the_release_the_rest_passes_through_and_ends() {
    let backend = MemoryBackend::new();
    let (guard, key) = held_guard(&backend);
    let mut body =
        ResponseBody::locked(Box::pin(stream(&["ab", "cd"])), guard, Some(2), true, None);
    assert_eq!(
        body.frame().await.unwrap().unwrap().into_data().unwrap(),
        "ab"
    );
    assert!(!backend.is_held(&key) && !body.holds_lease());
    // Past the declared length: whatever the inner body still has.
    assert_eq!(
        body.frame().await.unwrap().unwrap().into_data().unwrap(),
        "cd"
    );
    assert!(body.frame().await.is_none());
    assert!(body.is_end_stream());
    assert!(
        body.frame().await.is_none(),
        "polling after the end stays ended"
    );
}

#[tokio::test]
async fn full_and_passthrough_bodies() {
    let mut full = ResponseBody::<StreamBody<tokio_stream_shim::Iter<Chunks>>>::full(
        Bytes::from_static(b"whole"),
    );
    assert!(!full.is_end_stream());
    assert_eq!(full.size_hint().exact(), Some(5));
    assert_eq!(
        full.frame().await.unwrap().unwrap().into_data().unwrap(),
        "whole"
    );
    assert!(full.is_end_stream() && full.frame().await.is_none());
    let empty = ResponseBody::<StreamBody<tokio_stream_shim::Iter<Chunks>>>::full(Bytes::new());
    assert!(empty.is_end_stream());
    let mut plain = ResponseBody::passthrough(stream(&["x"]));
    assert!(!plain.holds_lease());
    assert_eq!(
        plain.frame().await.unwrap().unwrap().into_data().unwrap(),
        "x"
    );
    assert!(plain.frame().await.is_none());
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
