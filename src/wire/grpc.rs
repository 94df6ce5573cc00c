//! gRPC on the wire, as far as the layers need it: which requests are gRPC,
//! the length-prefixed messages of a request body, the status a response
//! carries in its headers (trailers-only) or trailers, and that status's
//! HTTP equivalent. No gRPC library: these are a few facts of the protocol
//! (gRPC's `PROTOCOL-HTTP2.md`), and the crate does not depend on tonic.

use http::header::{HeaderName, CONTENT_TYPE};
use http::{HeaderMap, StatusCode};

use crate::rejection::Rejection;

/// The status code of a gRPC answer.
pub(crate) const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
/// Its message, percent-encoded.
pub(crate) const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
/// Its details: a `google.rpc.Status`, base64.
pub(crate) const GRPC_STATUS_DETAILS: HeaderName =
    HeaderName::from_static("grpc-status-details-bin");
/// The compression of the messages.
pub(crate) const GRPC_ENCODING: HeaderName = HeaderName::from_static("grpc-encoding");
/// The compressions a peer accepts.
pub(crate) const GRPC_ACCEPT_ENCODING: HeaderName = HeaderName::from_static("grpc-accept-encoding");
/// gRPC's retry pushback (gRFC A6): milliseconds before the next attempt,
/// read by gRPC's built-in retry policies.
pub(crate) const GRPC_RETRY_PUSHBACK_MS: HeaderName =
    HeaderName::from_static("grpc-retry-pushback-ms");

/// The headers and trailers of a gRPC answer that a record keeps whatever
/// the layer's `stored_headers` say: without them a replay is no valid
/// gRPC answer (`grpc-encoding`: a compressed response stays readable).
pub(crate) const PROTOCOL_HEADERS: [HeaderName; 5] = [
    CONTENT_TYPE,
    GRPC_STATUS,
    GRPC_MESSAGE,
    GRPC_STATUS_DETAILS,
    GRPC_ENCODING,
];

/// The status codes this crate uses (numbers from gRPC's `statuscodes.md`).
pub(crate) mod code {
    pub(crate) const OK: i32 = 0;
    pub(crate) const CANCELLED: i32 = 1;
    pub(crate) const UNKNOWN: i32 = 2;
    pub(crate) const INVALID_ARGUMENT: i32 = 3;
    pub(crate) const DEADLINE_EXCEEDED: i32 = 4;
    pub(crate) const NOT_FOUND: i32 = 5;
    pub(crate) const ALREADY_EXISTS: i32 = 6;
    pub(crate) const PERMISSION_DENIED: i32 = 7;
    pub(crate) const RESOURCE_EXHAUSTED: i32 = 8;
    pub(crate) const FAILED_PRECONDITION: i32 = 9;
    pub(crate) const ABORTED: i32 = 10;
    pub(crate) const OUT_OF_RANGE: i32 = 11;
    pub(crate) const UNIMPLEMENTED: i32 = 12;
    pub(crate) const INTERNAL: i32 = 13;
    pub(crate) const UNAVAILABLE: i32 = 14;
    pub(crate) const UNAUTHENTICATED: i32 = 16;
}

/// Whether `headers` are those of a gRPC request or answer:
/// `content-type: application/grpc`, `application/grpc+proto`,
/// `application/grpc+json`, ... (gRPC-Web, `application/grpc-web*`, is not:
/// put the layer inside the layer that translates it).
pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    let Some(value) = headers.get(CONTENT_TYPE) else {
        return false;
    };
    let value = value.as_bytes();
    const GRPC: &[u8] = b"application/grpc";
    if value.len() < GRPC.len() || !value[..GRPC.len()].eq_ignore_ascii_case(GRPC) {
        return false;
    }
    matches!(value.get(GRPC.len()), None | Some(b'+' | b';'))
}

/// The `grpc-status` in `headers`, if there is a well-formed one.
pub(crate) fn status_of(headers: &HeaderMap) -> Option<i32> {
    let value = headers.get(GRPC_STATUS)?.to_str().ok()?;
    if value.is_empty() || value.len() > 3 || !value.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    value.parse().ok()
}

/// The HTTP status a gRPC status stands for, as `google.rpc.Code`
/// documents it ("HTTP Mapping"): what the layer's `store_when` is asked
/// about a gRPC answer. A code outside 0..=16 is 500, like `UNKNOWN`.
pub(crate) fn http_equivalent(grpc_code: i32) -> StatusCode {
    let status = match grpc_code {
        code::OK => 200,
        code::CANCELLED => 499,
        code::INVALID_ARGUMENT | code::FAILED_PRECONDITION | code::OUT_OF_RANGE => 400,
        code::DEADLINE_EXCEEDED => 504,
        code::NOT_FOUND => 404,
        code::ALREADY_EXISTS | code::ABORTED => 409,
        code::PERMISSION_DENIED => 403,
        code::UNAUTHENTICATED => 401,
        code::RESOURCE_EXHAUSTED => 429,
        code::UNIMPLEMENTED => 501,
        code::UNAVAILABLE => 503,
        _ => 500,
    };
    StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

/// The gRPC code for an HTTP status (the reverse of [`http_equivalent`],
/// for a [`MissingPart`](crate::key::MissingPart) made with any status).
pub(crate) fn code_for_http(status: StatusCode) -> i32 {
    match status.as_u16() {
        400 => code::INVALID_ARGUMENT,
        401 => code::UNAUTHENTICATED,
        403 => code::PERMISSION_DENIED,
        404 => code::NOT_FOUND,
        408 | 504 => code::DEADLINE_EXCEEDED,
        409 => code::ABORTED,
        413 | 429 => code::RESOURCE_EXHAUSTED,
        499 => code::CANCELLED,
        501 => code::UNIMPLEMENTED,
        503 => code::UNAVAILABLE,
        s if (400..500).contains(&s) => code::FAILED_PRECONDITION,
        s if (500..600).contains(&s) => code::INTERNAL,
        _ => code::UNKNOWN,
    }
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
pub(crate) fn digest_messages(
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
