//! gRPC on the wire, as far as the layers need it: which requests are gRPC,
//! the status a response carries in its headers (trailers-only) or
//! trailers, and that status's HTTP equivalent; and a trailers-only status
//! answer (`grpc-status`, `grpc-message` and the retry delay as metadata and
//! as a `google.rpc.RetryInfo` in `grpc-status-details-bin`), encoded here
//! by hand: a few bytes of protobuf and base64. No gRPC library: these are
//! a few facts of the protocol (gRPC's `PROTOCOL-HTTP2.md`), and the crate
//! does not depend on tonic.

use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, Response, StatusCode};

use super::retry_after_secs;

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

/// A trailers-only gRPC answer with `code` and `message`, and the retry
/// metadata when `retry_after` is given.
pub(crate) fn status_response(
    code: i32,
    message: &str,
    retry_after: Option<Duration>,
) -> Response<Bytes> {
    let mut res = Response::new(Bytes::new());
    let headers = res.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    headers.insert(GRPC_STATUS, HeaderValue::from(code));
    if let Ok(value) = HeaderValue::from_str(&percent_encode(message)) {
        headers.insert(GRPC_MESSAGE, value);
    }
    if let Some(after) = retry_after {
        headers.insert(RETRY_AFTER, HeaderValue::from(retry_after_secs(after)));
        headers.insert(GRPC_RETRY_PUSHBACK_MS, HeaderValue::from(millis(after)));
        let details = status_details(code, message, after);
        if let Ok(value) = HeaderValue::from_str(&base64(&details)) {
            headers.insert(GRPC_STATUS_DETAILS, value);
        }
    }
    res
}

/// Whole milliseconds, rounded up, at least 1.
fn millis(d: Duration) -> u64 {
    let ms = d.as_millis() + u128::from(!d.subsec_nanos().is_multiple_of(1_000_000));
    u64::try_from(ms).unwrap_or(u64::MAX).max(1)
}

/// `grpc-message`: percent-encoded UTF-8, as gRPC's `PROTOCOL-HTTP2.md`
/// says (bytes other than space and visible ASCII, and `%` itself, as
/// `%XX`).
fn percent_encode(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for b in message.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            const HEX: &[u8; 16] = b"0123456789ABCDEF";
            out.push('%');
            out.push(HEX[usize::from(b >> 4)] as char);
            out.push(HEX[usize::from(b & 0x0f)] as char);
        }
    }
    out
}

/// Base64 without padding (what gRPC asks binary metadata to be sent as).
fn base64(input: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(input.len().div_ceil(3) * 4);
    for chunk in input.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..=chunk.len() {
            out.push(ALPHABET[((n >> (18 - 6 * i)) & 0x3f) as usize] as char);
        }
    }
    out
}

/// `google.rpc.Status { code, message, details: [Any(RetryInfo)] }`,
/// protobuf-encoded.
fn status_details(code: i32, message: &str, retry_after: Duration) -> Vec<u8> {
    // google.protobuf.Duration { int64 seconds = 1; int32 nanos = 2; }
    let mut duration = Vec::new();
    if retry_after.as_secs() > 0 {
        varint_field(&mut duration, 1, retry_after.as_secs());
    }
    if retry_after.subsec_nanos() > 0 {
        varint_field(&mut duration, 2, u64::from(retry_after.subsec_nanos()));
    }
    // google.rpc.RetryInfo { google.protobuf.Duration retry_delay = 1; }
    let mut retry_info = Vec::new();
    bytes_field(&mut retry_info, 1, &duration);
    // google.protobuf.Any { string type_url = 1; bytes value = 2; }
    let mut any = Vec::new();
    bytes_field(
        &mut any,
        1,
        b"type.googleapis.com/google.rpc.RetryInfo".as_slice(),
    );
    bytes_field(&mut any, 2, &retry_info);
    // google.rpc.Status { int32 code = 1; string message = 2; repeated Any details = 3; }
    let mut status = Vec::new();
    if code != 0 {
        // Codes are 0..=16: an int32 that is never negative here.
        varint_field(&mut status, 1, u64::from(code.unsigned_abs()));
    }
    bytes_field(&mut status, 2, message.as_bytes());
    bytes_field(&mut status, 3, &any);
    status
}

fn varint(out: &mut Vec<u8>, mut n: u64) {
    while n >= 0x80 {
        out.push((n as u8 & 0x7f) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

/// A varint field (wire type 0).
fn varint_field(out: &mut Vec<u8>, field: u64, n: u64) {
    varint(out, field << 3);
    varint(out, n);
}

/// A length-delimited field (wire type 2).
fn bytes_field(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    varint(out, (field << 3) | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

#[cfg(test)]
mod tests;
