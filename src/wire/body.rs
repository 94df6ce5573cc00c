//! Receiving the request body before a lease or claim is taken: whole,
//! within a size limit and a deadline, so that a client who stalls or
//! floods holds nothing and costs a bounded amount of memory; digested as
//! it arrives, a gRPC request's over its messages (a 5-byte prefix, a
//! compressed flag and a u32 length, before each).

use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::HeaderMap;
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError};

use super::grpc::GRPC_ENCODING;
use crate::rejection::Rejection;

/// A body's error, boxed.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The `Content-Length` a request declares, if it declares a valid one.
pub(crate) fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

/// Receive the whole body: at most `limit` bytes (413 beyond, and at once for
/// a declared length over it), within `timeout` (408), a broken stream 400
/// (413 when it broke on a body limit set in front of the layer: see
/// [`stream_error`]).
/// Each chunk also goes to `digest` when given; for a gRPC request (`grpc`,
/// as [`is_grpc`](super::grpc::is_grpc) read its `headers`) the digest is
/// instead over its messages' payloads, not their prefixes, and a
/// compressed or malformed message is refused ([`digest_messages`]). One
/// chunk comes back as it arrived; from the second on, chunks are copied
/// into one buffer as they come.
pub(crate) async fn receive<B>(
    body: B,
    headers: &HeaderMap,
    grpc: bool,
    limit: usize,
    timeout: Duration,
    digest: Option<&mut blake3::Hasher>,
) -> Result<Bytes, Rejection>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    if !grpc {
        return receive_bytes(body, headers, limit, timeout, digest).await;
    }
    let bytes = receive_bytes(body, headers, limit, timeout, None).await?;
    if let Some(digest) = digest {
        let encoding = headers.get(GRPC_ENCODING).and_then(|v| v.to_str().ok());
        digest_messages(&bytes, encoding, digest)?;
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
    B::Error: Into<BoxError>,
{
    let declared = declared_length(headers);
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(Rejection::PayloadTooLarge { limit });
    }
    // What the body's buffer may grow to: the declared length when there is
    // one (hyper ends the body there), else the limit.
    let cap = declared.map_or(limit, |len| {
        usize::try_from(len).map_or(limit, |len| len.min(limit))
    });
    let collect = async {
        let mut body = std::pin::pin!(body);
        // One chunk is kept as it came (no copy); from the second on, the
        // bytes are copied into one buffer as they come: a client sending
        // one-byte frames must not hold a `Bytes` (and the read buffer it
        // points into) per byte.
        let mut first: Option<Bytes> = None;
        let mut joined: Option<BytesMut> = None;
        let mut total = 0usize;
        while let Some(frame) = body.as_mut().frame().await {
            let frame = frame.map_err(|e| {
                let e: BoxError = e.into();
                stream_error(&*e)
            })?;
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
                if bytes.is_empty() {
                    continue;
                }
                match (&mut joined, &first) {
                    (Some(buf), _) => append(buf, &bytes, cap),
                    (None, None) => first = Some(bytes),
                    (None, Some(one)) => {
                        // Room to double, or the declared length when it is
                        // less (no growth): what a client declares reserves
                        // no more than twice what it sent.
                        let room = cap.min(total.saturating_mul(2)).max(total);
                        let mut buf = BytesMut::with_capacity(room);
                        buf.extend_from_slice(one);
                        buf.extend_from_slice(&bytes);
                        first = None;
                        joined = Some(buf);
                    }
                }
            }
        }
        Ok(match joined {
            Some(buf) => buf.freeze(),
            None => first.unwrap_or_default(),
        })
    };
    match tokio::time::timeout(timeout, collect).await {
        Ok(collected) => collected,
        Err(_) => Err(Rejection::BodyTimeout { after: timeout }),
    }
}

/// What a body stream's error answers: 413 when a body limit set in front
/// of the layer cut the body off (tower-http's `RequestBodyLimitLayer` and
/// axum's limits wrap the body in `http_body_util::Limited`, whose error is
/// `LengthLimitError`, here or under an `axum::Error`); else 400, the
/// client broke the stream.
fn stream_error(e: &(dyn std::error::Error + 'static)) -> Rejection {
    let mut cause = Some(e);
    while let Some(e) = cause {
        if e.is::<LengthLimitError>() {
            return Rejection::BodyLimited;
        }
        cause = e.source();
    }
    Rejection::InvalidBody
}

/// `bytes` onto `buf`, growing it (by doubling) to at most `cap` (the
/// declared length, or the limit): the body's buffer never has room for
/// more than that (`BytesMut`'s own growth could double past it, and the
/// frozen body keeps that room), nor less than what it must hold.
/// `buf.len() + bytes.len()` is at most the limit (checked before).
fn append(buf: &mut BytesMut, bytes: &[u8], cap: usize) {
    if buf.capacity() - buf.len() < bytes.len() {
        let room = (2 * buf.capacity()).min(cap).max(buf.len() + bytes.len());
        let mut grown = BytesMut::with_capacity(room);
        grown.extend_from_slice(buf);
        *buf = grown;
    }
    buf.extend_from_slice(bytes);
}

/// The bytes before each message: a compressed flag and a u32 length.
const PREFIX_LEN: usize = 5;

/// Digest the messages of a gRPC request body into `digest`: each
/// message's payload (not its prefix), with its length, so two bodies
/// digest alike exactly when they carry the same messages.
///
/// A compressed message (flag 1) is refused: its payload depends on the
/// compressor, so a gzip retry of an identity call would not be the same
/// request (`encoding` names the `grpc-encoding` for the answer). A body
/// that is not a whole number of messages is refused as malformed.
fn digest_messages(
    mut body: &[u8],
    encoding: Option<&str>,
    digest: &mut blake3::Hasher,
) -> Result<(), Rejection> {
    while !body.is_empty() {
        let Some((prefix, rest)) = body.split_first_chunk::<PREFIX_LEN>() else {
            return Err(Rejection::MalformedMessage {
                reason: "the body ends inside a message's 5-byte prefix",
            });
        };
        match prefix[0] {
            0 => {}
            // Compressed by no compressor: the gRPC protocol calls that an
            // error of the message (INTERNAL), not an encoding to refuse.
            1 if matches!(encoding, None | Some("identity")) => {
                return Err(Rejection::MalformedMessage {
                    reason:
                        "a message is flagged compressed but the request names no grpc-encoding",
                })
            }
            1 => {
                return Err(Rejection::CompressedMessage {
                    encoding: encoding.unwrap_or("unknown").to_owned(),
                })
            }
            _ => {
                return Err(Rejection::MalformedMessage {
                    reason: "a message's compressed flag is neither 0 nor 1",
                })
            }
        }
        let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
        if rest.len() < len {
            return Err(Rejection::MalformedMessage {
                reason: "a message is longer than the rest of the body",
            });
        }
        let (payload, rest) = rest.split_at(len);
        digest.update(&(len as u64).to_le_bytes());
        digest.update(payload);
        body = rest;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
