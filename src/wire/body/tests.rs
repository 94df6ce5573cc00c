use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use http_body::Frame;
use http_body_util::Full;

use super::*;

/// A body of these chunks, then its end; `stall` never ends instead.
struct Chunks {
    items: VecDeque<&'static str>,
    stall: bool,
}

impl Body for Chunks {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.items.pop_front() {
            Some(s) => Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(s.as_bytes()))))),
            None if self.stall => Poll::Pending,
            None => Poll::Ready(None),
        }
    }
}

fn chunks(parts: &[&'static str]) -> Chunks {
    Chunks {
        items: parts.iter().copied().collect(),
        stall: false,
    }
}

const SECOND: Duration = Duration::from_secs(1);

#[tokio::test]
async fn whole_body_joined_and_digested_within_the_limit() {
    let mut hasher = blake3::Hasher::new();
    let got = receive(
        chunks(&["ab", "", "cd"]),
        &HeaderMap::new(),
        4,
        SECOND,
        Some(&mut hasher),
    )
    .await
    .unwrap();
    assert_eq!(&got[..], b"abcd");
    assert_eq!(hasher.finalize(), blake3::hash(b"abcd"));
    let one = receive(
        Full::new(Bytes::from_static(b"xyz")),
        &HeaderMap::new(),
        4,
        SECOND,
        None,
    )
    .await
    .unwrap();
    assert_eq!(&one[..], b"xyz");
}

#[tokio::test]
async fn over_the_limit_is_413_declared_or_streamed() {
    let over = receive(chunks(&["abc", "de"]), &HeaderMap::new(), 4, SECOND, None).await;
    assert!(matches!(over, Err(Rejection::PayloadTooLarge { limit: 4 })));
    let mut headers = HeaderMap::new();
    headers.insert(http::header::CONTENT_LENGTH, "5".parse().unwrap());
    let declared = receive(Full::new(Bytes::new()), &headers, 4, SECOND, None).await;
    assert!(matches!(
        declared,
        Err(Rejection::PayloadTooLarge { limit: 4 })
    ));
    assert_eq!(declared_length(&headers), Some(5));
}

#[tokio::test(start_paused = true)]
async fn a_stalled_body_is_408() {
    let stalled = Chunks {
        items: ["a"].into(),
        stall: true,
    };
    let got = receive(stalled, &HeaderMap::new(), 4, SECOND, None).await;
    assert!(matches!(got, Err(Rejection::BodyTimeout { .. })));
}
