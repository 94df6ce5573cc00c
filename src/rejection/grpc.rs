//! A [`Rejection`] as a gRPC client needs it: a trailers-only response
//! (HTTP 200, `grpc-status` and `grpc-message` in the one headers frame)
//! with the code chosen per kind (see "gRPC" in the [`Rejection`] docs), the
//! retry delay as metadata (`retry-after` in seconds, gRPC's
//! `grpc-retry-pushback-ms`) and as a `google.rpc.RetryInfo` in
//! `grpc-status-details-bin`. Encoded here by hand: a few bytes of
//! protobuf and base64, no gRPC library.

use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::Response;

use super::{retry_after_secs, Rejection};
use crate::wire::grpc::{
    code, code_for_http, status_of, GRPC_ACCEPT_ENCODING, GRPC_MESSAGE, GRPC_RETRY_PUSHBACK_MS,
    GRPC_STATUS, GRPC_STATUS_DETAILS,
};

/// What the layers put in the extensions of a rejection's answer, so that
/// the service, which knows whether the request was gRPC, can answer a gRPC
/// client in its protocol ([`for_request`]).
#[derive(Debug, Clone)]
pub(crate) struct Rejected(pub(crate) Rejection);

impl Rejection {
    /// The gRPC status code a gRPC request gets for this rejection (the
    /// protocol's number, e.g. `tonic::Code::from_i32(r.grpc_code())`);
    /// each kind's code and why are under "gRPC" in the docs above.
    pub fn grpc_code(&self) -> i32 {
        match self {
            Self::Conflict { .. } | Self::InFlight { .. } => code::ABORTED,
            Self::Unavailable { .. } => code::UNAVAILABLE,
            Self::PayloadTooLarge { .. } | Self::OverQuota { .. } => code::RESOURCE_EXHAUSTED,
            Self::BodyTimeout { .. } => code::DEADLINE_EXCEEDED,
            Self::InvalidBody => code::CANCELLED,
            Self::MalformedMessage { .. } | Self::MissingExtension { .. } => code::INTERNAL,
            Self::CompressedMessage { .. } => code::UNIMPLEMENTED,
            Self::MissingPart(m) => code_for_http(m.status()),
            Self::MissingIdempotencyKey | Self::InvalidIdempotencyKey { .. } => {
                code::INVALID_ARGUMENT
            }
            Self::Mismatch => code::FAILED_PRECONDITION,
            Self::NotStored { .. } => code::ALREADY_EXISTS,
        }
    }

    /// The answer a gRPC request gets: a trailers-only response with
    /// [`grpc_code`](Self::grpc_code), the title and detail as
    /// `grpc-message`, and where a retry can succeed the delay as
    /// `retry-after` (whole seconds), `grpc-retry-pushback-ms` and a
    /// `google.rpc.RetryInfo` in `grpc-status-details-bin`. What the layers
    /// send to gRPC requests by default; an `on_rejection` hook can return it
    /// too.
    pub fn to_grpc_response(&self) -> Response<Bytes> {
        let message = format!("{}: {}", self.title(), self.detail());
        let mut res = status_response(self.grpc_code(), &message, self.retry_after());
        if let Self::CompressedMessage { .. } = self {
            // What gRPC's compression spec asks of a server that refuses
            // an encoding: name the ones it takes.
            res.headers_mut()
                .insert(GRPC_ACCEPT_ENCODING, HeaderValue::from_static("identity"));
        }
        res
    }
}

/// The answer for a request: a rejection's answer (it carries
/// [`Rejected`]) becomes its gRPC answer when the request is gRPC and the
/// answer is not one already (an `on_rejection` hook may return one, and
/// is then obeyed; an HTTP answer is nothing a gRPC client can read).
/// Anything else is returned as it is.
pub(crate) fn for_request(mut res: Response<Bytes>, grpc: bool) -> Response<Bytes> {
    let Some(Rejected(rejection)) = res.extensions_mut().remove::<Rejected>() else {
        return res;
    };
    if grpc && status_of(res.headers()).is_none() {
        return rejection.to_grpc_response();
    }
    res
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
pub(crate) fn percent_encode(message: &str) -> String {
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
pub(crate) fn base64(input: &[u8]) -> String {
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
pub(crate) fn status_details(code: i32, message: &str, retry_after: Duration) -> Vec<u8> {
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
