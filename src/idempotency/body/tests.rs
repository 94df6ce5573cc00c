use bytes::Bytes;
use http_body::{Body, Frame};
use http_body_util::{BodyExt, StreamBody};

use super::ResponseBody;

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
async fn a_resumed_body_hands_out_what_was_read_then_the_rest() {
    // Read "ab" (the prefix), then stopped at "cd"; "ef" is still in
    // the body.
    let mut body = ResponseBody::resumed(
        Bytes::from_static(b"ab"),
        Ok(Frame::data(Bytes::from_static(b"cd"))),
        Box::pin(stream(&["ef"])),
    );
    assert!(!body.is_end_stream());
    // The inner stream's hint is unknown: at least what was taken.
    assert_eq!(body.size_hint().lower(), 4);
    let mut got = Vec::new();
    while let Some(frame) = body.frame().await {
        got.push(frame.unwrap().into_data().unwrap());
    }
    assert_eq!(got, ["ab", "cd", "ef"]);
    assert!(body.is_end_stream());
    // Nothing read before trailers: the trailers first, no empty frame.
    let mut failed = ResponseBody::<StreamBody<tokio_stream_shim::Iter<Chunks>>>::resumed(
        Bytes::new(),
        Ok(Frame::trailers(http::HeaderMap::new())),
        Box::pin(stream(&[])),
    );
    assert!(failed.frame().await.unwrap().unwrap().is_trailers());
    assert!(failed.frame().await.is_none());
}
