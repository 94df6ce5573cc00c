//! Receiving the request body before a lease or claim is taken: whole,
//! within a size limit and a deadline, so that a client who stalls or
//! floods holds nothing and costs a bounded amount of memory.

use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::HeaderMap;
use http_body::Body;
use http_body_util::BodyExt;

use crate::rejection::Rejection;

/// The `Content-Length` a request declares, if it declares a valid one.
pub(crate) fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

/// Receive the whole body: at most `limit` bytes (413 beyond, and at once for
/// a declared length over it), within `timeout` (408), a broken stream 400.
/// Each chunk also goes to `digest` when given. One chunk comes back as it
/// arrived, several are joined once.
pub(crate) async fn receive<B>(
    body: B,
    headers: &HeaderMap,
    limit: usize,
    timeout: Duration,
    mut digest: Option<&mut blake3::Hasher>,
) -> Result<Bytes, Rejection>
where
    B: Body,
{
    if declared_length(headers).is_some_and(|len| len > limit as u64) {
        return Err(Rejection::PayloadTooLarge { limit });
    }
    let collect = async {
        let mut body = std::pin::pin!(body);
        let mut chunks: Vec<Bytes> = Vec::new();
        let mut total = 0usize;
        while let Some(frame) = body.as_mut().frame().await {
            let frame = frame.map_err(|_| Rejection::InvalidBody)?;
            if let Ok(mut data) = frame.into_data() {
                let n = data.remaining();
                total = total.saturating_add(n);
                if total > limit {
                    return Err(Rejection::PayloadTooLarge { limit });
                }
                let bytes = data.copy_to_bytes(n);
                if let Some(hasher) = digest.as_deref_mut() {
                    hasher.update(&bytes);
                }
                if !bytes.is_empty() {
                    chunks.push(bytes);
                }
            }
        }
        Ok((chunks, total))
    };
    let (mut chunks, total) = match tokio::time::timeout(timeout, collect).await {
        Ok(collected) => collected?,
        Err(_) => return Err(Rejection::BodyTimeout { after: timeout }),
    };
    Ok(match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.pop().unwrap_or_default(),
        _ => {
            let mut buf = BytesMut::with_capacity(total);
            for chunk in &chunks {
                buf.extend_from_slice(chunk);
            }
            buf.freeze()
        }
    })
}

#[cfg(test)]
mod tests {
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
}
