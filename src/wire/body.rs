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
/// Each chunk also goes to `digest` when given; for a gRPC request (by its
/// `headers`) the digest is instead over its messages' payloads, not their
/// prefixes, and a compressed or malformed message is refused
/// ([`grpc::digest_messages`](crate::wire::grpc::digest_messages)). One chunk
/// comes back as it arrived, several are joined once.
pub(crate) async fn receive<B>(
    body: B,
    headers: &HeaderMap,
    limit: usize,
    timeout: Duration,
    digest: Option<&mut blake3::Hasher>,
) -> Result<Bytes, Rejection>
where
    B: Body,
{
    if !crate::wire::grpc::is_grpc(headers) {
        return receive_bytes(body, headers, limit, timeout, digest).await;
    }
    let bytes = receive_bytes(body, headers, limit, timeout, None).await?;
    if let Some(digest) = digest {
        let encoding = headers
            .get(crate::wire::grpc::GRPC_ENCODING)
            .and_then(|v| v.to_str().ok());
        crate::wire::grpc::digest_messages(&bytes, encoding, digest)?;
    }
    Ok(bytes)
}

/// [`receive`] for any body, each chunk into `digest` as it is.
async fn receive_bytes<B>(
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
mod tests;
