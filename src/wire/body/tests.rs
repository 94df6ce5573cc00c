//! Unit tests of `wire/body.rs`.

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
        false,
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
        false,
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
    let over = receive(
        chunks(&["abc", "de"]),
        &HeaderMap::new(),
        false,
        4,
        SECOND,
        None,
    )
    .await;
    assert!(matches!(over, Err(Rejection::PayloadTooLarge { limit: 4 })));
    let mut headers = HeaderMap::new();
    headers.insert(http::header::CONTENT_LENGTH, "5".parse().unwrap());
    let declared = receive(Full::new(Bytes::new()), &headers, false, 4, SECOND, None).await;
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
    let got = receive(stalled, &HeaderMap::new(), false, 4, SECOND, None).await;
    assert!(matches!(got, Err(Rejection::BodyTimeout { .. })));
}

fn frame(flag: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = vec![flag];
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out
}

fn digest(body: &[u8]) -> Result<blake3::Hash, Rejection> {
    let mut h = blake3::Hasher::new();
    digest_messages(body, Some("gzip"), &mut h)?;
    Ok(h.finalize())
}

/// The digest is over the messages: the same messages digest alike, a
/// different one or a different split does not.
#[test]
fn digest_is_over_the_messages() {
    let one = frame(0, b"\x08\x01");
    assert_eq!(digest(&one).unwrap(), digest(&one).unwrap());
    assert_ne!(
        digest(&one).unwrap(),
        digest(&frame(0, b"\x08\x02")).unwrap()
    );
    let two = [frame(0, b"ab"), frame(0, b"c")].concat();
    let other_split = [frame(0, b"a"), frame(0, b"bc")].concat();
    assert_ne!(digest(&two).unwrap(), digest(&other_split).unwrap());
    assert_eq!(digest(&[]).unwrap(), blake3::hash(&[]));
}

#[test]
fn compressed_and_malformed_messages_are_refused() {
    match digest(&frame(1, b"\x1f\x8b")) {
        Err(Rejection::CompressedMessage { encoding }) => assert_eq!(encoding, "gzip"),
        other => panic!("{other:?}"),
    }
    // Flagged compressed, with no compressor named: a malformed message
    // (gRPC's INTERNAL), not an encoding the client could change.
    for encoding in [None, Some("identity")] {
        let mut hasher = blake3::Hasher::new();
        assert!(
            matches!(
                digest_messages(&frame(1, b"x"), encoding, &mut hasher),
                Err(Rejection::MalformedMessage { .. })
            ),
            "{encoding:?}"
        );
    }
    for bad in [
        vec![0, 0, 0],
        frame(2, b"x"),
        [frame(0, b"abc"), vec![0, 0, 0, 0, 9, 1]].concat(),
    ] {
        assert!(
            matches!(digest(&bad), Err(Rejection::MalformedMessage { .. })),
            "{bad:?}"
        );
    }
}

/// A gRPC request (`grpc`) is digested over its messages, and its
/// `grpc-encoding` names a compressed message's compressor; the same bytes
/// as a plain request are digested as they are.
#[tokio::test]
async fn a_grpc_body_is_digested_over_its_messages() {
    let body = [frame(0, b"ab"), frame(0, b"c")].concat();
    let mut headers = HeaderMap::new();
    headers.insert(GRPC_ENCODING, "gzip".parse().unwrap());
    let mut hasher = blake3::Hasher::new();
    let got = receive(
        Full::new(Bytes::from(body.clone())),
        &headers,
        true,
        64,
        SECOND,
        Some(&mut hasher),
    )
    .await
    .unwrap();
    assert_eq!(&got[..], &body[..]);
    assert_eq!(hasher.finalize(), digest(&body).unwrap());
    let mut plain = blake3::Hasher::new();
    let got = receive(
        Full::new(Bytes::from(body.clone())),
        &headers,
        false,
        64,
        SECOND,
        Some(&mut plain),
    )
    .await
    .unwrap();
    assert_eq!(&got[..], &body[..]);
    assert_eq!(plain.finalize(), blake3::hash(&body));
    let compressed = frame(1, b"\x1f\x8b");
    let refused = receive(
        Full::new(Bytes::from(compressed)),
        &headers,
        true,
        64,
        SECOND,
        Some(&mut blake3::Hasher::new()),
    )
    .await;
    match refused {
        Err(Rejection::CompressedMessage { encoding }) => assert_eq!(encoding, "gzip"),
        other => panic!("{other:?}"),
    }
}

/// A frame's bytes whose owner counts itself: how many frames a reader
/// still holds (each would keep its read buffer alive).
struct Counted(std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl AsRef<[u8]> for Counted {
    fn as_ref(&self) -> &[u8] {
        b"x"
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// `frames` one-byte frames, noting the most frames held at once.
struct Tiny {
    frames: usize,
    live: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    most: usize,
}

impl Body for Tiny {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let held = self.live.load(std::sync::atomic::Ordering::SeqCst);
        self.most = self.most.max(held);
        if self.frames == 0 {
            assert!(self.most <= 2, "{} one-byte frames held at once", self.most);
            return Poll::Ready(None);
        }
        self.frames -= 1;
        self.live.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let owner = Counted(self.live.clone());
        Poll::Ready(Some(Ok(Frame::data(Bytes::from_owner(owner)))))
    }
}

/// A client sending one-byte frames up to the limit: the frames are copied
/// as they come, never held one `Bytes` each.
#[tokio::test]
async fn one_byte_frames_are_not_held_one_each() {
    let live = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let body = Tiny {
        frames: 4096,
        live: live.clone(),
        most: 0,
    };
    let mut hasher = blake3::Hasher::new();
    let got = receive(
        body,
        &HeaderMap::new(),
        false,
        4096,
        SECOND,
        Some(&mut hasher),
    )
    .await
    .unwrap();
    assert_eq!(&got[..], &[b'x'; 4096][..]);
    assert_eq!(hasher.finalize(), blake3::hash(&[b'x'; 4096]));
}

/// The body's buffer grows to the limit at most: a frozen body keeps its
/// buffer's room, and the docs promise `body_limit` per request.
#[test]
fn the_joined_buffer_never_has_room_past_the_limit() {
    let limit = 64 * 1024;
    let mut buf = BytesMut::with_capacity(2 * 24 * 1024);
    buf.extend_from_slice(&[b'a'; 24 * 1024]);
    buf.extend_from_slice(b"b");
    let mut total = buf.len();
    while total < limit {
        let n = (limit - total).min(1000);
        append(&mut buf, &vec![b'c'; n], limit);
        total += n;
        assert!(buf.capacity() <= limit, "room for {} bytes", buf.capacity());
    }
    assert_eq!(buf.len(), limit);
}

/// A declared length near what a huge `body_limit` allows reserves nothing
/// up front: the buffer grows with the bytes that came (it asked the
/// allocator for the declared 2^50 bytes at the second chunk, and the
/// process aborted, before).
#[tokio::test]
async fn a_huge_declared_length_reserves_only_what_came() {
    let mut headers = HeaderMap::new();
    headers.insert(http::header::CONTENT_LENGTH, (1u64 << 50).into());
    let got = receive(
        chunks(&["a", "b", "c"]),
        &headers,
        false,
        usize::MAX,
        SECOND,
        None,
    )
    .await
    .unwrap();
    assert_eq!(&got[..], b"abc");
}

/// An honest declared length caps the buffer's growth: a 600-byte body
/// that came in pieces is held in 600 bytes of room, not the next power of
/// two (1,024).
#[test]
fn the_joined_buffer_grows_to_the_declared_length_at_most() {
    let declared = 600;
    let mut buf = BytesMut::with_capacity(2);
    buf.extend_from_slice(b"ab");
    while buf.len() < declared {
        let n = (declared - buf.len()).min(7);
        append(&mut buf, &vec![b'c'; n], declared);
        assert!(
            buf.capacity() <= declared,
            "room for {} bytes",
            buf.capacity()
        );
    }
    assert_eq!(buf.len(), declared);
}
