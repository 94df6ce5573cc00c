//! What is kept for a completed request, and its byte encoding.
//!
//! Records read back from storage are untrusted input: anyone who can write
//! the record's key or publish on its channel chooses the bytes. So
//! [`Record::decode`] never panics, checks every length against the bytes
//! present before it splits, bounds the header count by those bytes and by
//! [`MAX_HEADERS`] before it allocates, and refuses what `http` refuses
//! (names, values, statuses outside 100..=999). [`Record::encode`] writes
//! nothing that `decode` rejects.
//!
//! This file depends on `bytes` and `http` only: the `record_decode` fuzz
//! target (`fuzz/fuzz_targets/record_decode.rs`) compiles it on its own, by
//! path, to reach the crate-private codec.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::header::{HeaderName, HeaderValue};
use http::{HeaderMap, StatusCode};

/// The stored outcome of the first request made with a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Record {
    /// The response, kept byte for byte: replayed to retries.
    Response(StoredResponse),
    /// The first request completed, but its response could not be kept.
    /// Retries get a problem+json saying so, never a second execution.
    NotStored {
        /// Status of the original response.
        status: StatusCode,
        /// Why it was not kept.
        reason: NotStoredReason,
    },
}

/// Why a completed response was not kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub(crate) enum NotStoredReason {
    /// The body was larger than the layer's record limit, or the response
    /// more than a record can hold (over [`MAX_HEADERS`] stored header
    /// values, or a value over 4 GiB).
    TooLarge,
    /// The body had no length known up front (a stream) or carried trailers.
    Streaming,
    /// The response body failed before it was complete.
    BodyFailed,
    /// The inner service returned an error instead of a response.
    ServiceFailed,
}

impl NotStoredReason {
    /// Why, in words, for the problem `detail`.
    pub(crate) fn explain(self) -> &'static str {
        match self {
            Self::TooLarge => "its body or headers were larger than a record may hold",
            Self::Streaming => "its body was streamed",
            Self::BodyFailed => "its body failed before it was complete",
            Self::ServiceFailed => "the service failed after the request began",
        }
    }

    fn code(self) -> u8 {
        match self {
            Self::TooLarge => 1,
            Self::Streaming => 2,
            Self::BodyFailed => 3,
            Self::ServiceFailed => 4,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(Self::TooLarge),
            2 => Some(Self::Streaming),
            3 => Some(Self::BodyFailed),
            4 => Some(Self::ServiceFailed),
            _ => None,
        }
    }
}

/// A response as kept in the store: status, the chosen headers, the body,
/// and the chosen trailers (a gRPC answer's status is in its trailers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoredResponse {
    /// The status code.
    pub(crate) status: StatusCode,
    /// The stored headers, in the order the handler set them.
    pub(crate) headers: HeaderMap,
    /// The whole body.
    pub(crate) body: Bytes,
    /// The stored trailers, if the body ended with a trailers frame. `None`
    /// is written in the format of 0.2 (tag `R`), which every instance
    /// reads; `Some` in one 0.2 does not know (tag `T`), for gRPC answers.
    /// Boxed: most records have none.
    pub(crate) trailers: Option<Box<HeaderMap>>,
}

const TAG_RESPONSE: u8 = b'R';
/// A response with trailers: `R`'s fields, the body behind its u32
/// length, then the trailers as the headers are written.
const TAG_RESPONSE_TRAILERS: u8 = b'T';
const TAG_NOT_STORED: u8 = b'N';
const VERSION: u8 = 1;

/// The most header values one record holds. A record is read before
/// anything is known about who wrote it, so the decoder refuses a larger
/// count before it allocates; [`Record::encode`] keeps a response with more
/// as [`NotStoredReason::TooLarge`] instead of writing what would be refused.
/// The headers kept are the layer's configured few: this is far above any
/// real response, and far below what `HeaderMap` holds.
pub(crate) const MAX_HEADERS: usize = 1024;

// `encode` writes the count as a u16, and `HeaderMap::try_with_capacity`
// refuses more than 24,576.
const _: () = assert!(MAX_HEADERS <= u16::MAX as usize && MAX_HEADERS <= 24_576);

/// The fewest bytes one header takes in a record: its name length (u16), a
/// name of at least one byte, its value length (u32); a value may be empty.
const MIN_HEADER_LEN: usize = 2 + 1 + 4;

/// A stored record that could not be decoded (written by an incompatible
/// version, or not by this crate).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CorruptRecord {
    reason: &'static str,
}

impl CorruptRecord {
    /// A record refused for `reason`: a fixed phrase, never bytes of the
    /// record (they may be anyone's).
    pub(crate) const fn new(reason: &'static str) -> Self {
        Self { reason }
    }
}

impl std::fmt::Display for CorruptRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "stored idempotency record could not be decoded: {}",
            self.reason
        )
    }
}

impl std::error::Error for CorruptRecord {}

/// Split `n` bytes off the front of `data`, or fail with `reason` when
/// fewer are left.
fn take(data: &mut Bytes, n: usize, reason: &'static str) -> Result<Bytes, CorruptRecord> {
    if data.len() < n {
        return Err(CorruptRecord::new(reason));
    }
    Ok(data.split_to(n))
}

fn take_u8(data: &mut Bytes, reason: &'static str) -> Result<u8, CorruptRecord> {
    if data.is_empty() {
        return Err(CorruptRecord::new(reason));
    }
    Ok(data.get_u8())
}

fn take_u16(data: &mut Bytes, reason: &'static str) -> Result<u16, CorruptRecord> {
    if data.len() < 2 {
        return Err(CorruptRecord::new(reason));
    }
    Ok(data.get_u16())
}

fn take_u32(data: &mut Bytes, reason: &'static str) -> Result<u32, CorruptRecord> {
    if data.len() < 4 {
        return Err(CorruptRecord::new(reason));
    }
    Ok(data.get_u32())
}

impl Record {
    /// This record as [`encode`](Self::encode) writes it: a response the
    /// format cannot hold is its not-stored marker, so that what a duplicate
    /// joined on this instance is handed is what the store keeps.
    pub(crate) fn kept(self) -> Self {
        match self {
            Self::Response(r) if !fits(&r) => Self::NotStored {
                status: r.status,
                reason: NotStoredReason::TooLarge,
            },
            other => other,
        }
    }

    /// Encode as `tag ‖ version ‖ status(u16 BE) ‖ ...`:
    /// for a response `count(u16) ‖ (len(u16) name len(u32) value)* ‖ body`;
    /// for a response with trailers (tag `T`) `count ‖ headers ‖
    /// len(u32) body ‖ count ‖ trailers`; for a not-stored marker one
    /// reason byte.
    ///
    /// Whatever it writes, [`decode`](Self::decode) reads back as the same
    /// record: a response that the format cannot hold (more than
    /// [`MAX_HEADERS`] header values, a value over `u32::MAX` bytes) is
    /// written as not stored ([`NotStoredReason::TooLarge`]) with its status,
    /// never cut short. Names always fit their u16 length: `http` refuses
    /// names over 65,535 bytes.
    pub(crate) fn encode(&self) -> Bytes {
        match self {
            Self::Response(r) => encode_response(r).unwrap_or_else(|| {
                Self::NotStored {
                    status: r.status,
                    reason: NotStoredReason::TooLarge,
                }
                .encode()
            }),
            Self::NotStored { status, reason } => {
                let mut buf = BytesMut::with_capacity(5);
                buf.put_u8(TAG_NOT_STORED);
                buf.put_u8(VERSION);
                buf.put_u16(status.as_u16());
                buf.put_u8(reason.code());
                buf.freeze()
            }
        }
    }

    /// Decode what [`encode`](Self::encode) wrote, from bytes that anyone
    /// may have written: an error, never a panic, for anything else.
    pub(crate) fn decode(mut data: Bytes) -> Result<Self, CorruptRecord> {
        let tag = take_u8(&mut data, "empty record")?;
        if tag != TAG_RESPONSE && tag != TAG_RESPONSE_TRAILERS && tag != TAG_NOT_STORED {
            return Err(CorruptRecord::new("unknown record tag"));
        }
        if take_u8(&mut data, "record ends before its version")? != VERSION {
            return Err(CorruptRecord::new("unknown record version"));
        }
        let status = take_u16(&mut data, "record ends before its status")?;
        let status = StatusCode::from_u16(status)
            .map_err(|_| CorruptRecord::new("status outside 100..=999"))?;
        if tag == TAG_NOT_STORED {
            let code = take_u8(&mut data, "not-stored record ends before its reason")?;
            let reason = NotStoredReason::from_code(code)
                .ok_or(CorruptRecord::new("unknown not-stored reason"))?;
            if !data.is_empty() {
                return Err(CorruptRecord::new("bytes after a not-stored record"));
            }
            return Ok(Self::NotStored { status, reason });
        }
        let headers = decode_headers(&mut data)?;
        if tag == TAG_RESPONSE {
            return Ok(Self::Response(StoredResponse {
                status,
                headers,
                body: data,
                trailers: None,
            }));
        }
        let n = take_u32(&mut data, "record ends before its body length")?;
        let n = usize::try_from(n)
            .map_err(|_| CorruptRecord::new("body runs past the record's end"))?;
        let body = take(&mut data, n, "body runs past the record's end")?;
        let trailers = decode_headers(&mut data)?;
        if !data.is_empty() {
            return Err(CorruptRecord::new("bytes after a record's trailers"));
        }
        Ok(Self::Response(StoredResponse {
            status,
            headers,
            body,
            trailers: Some(Box::new(trailers)),
        }))
    }
}

/// A header count and that many headers, from bytes anyone may have
/// written: the count is checked against [`MAX_HEADERS`] and the bytes
/// left before anything is allocated.
fn decode_headers(data: &mut Bytes) -> Result<HeaderMap, CorruptRecord> {
    let count = usize::from(take_u16(data, "record ends before its header count")?);
    if count > MAX_HEADERS {
        return Err(CorruptRecord::new("more headers than a record may hold"));
    }
    if count > data.len() / MIN_HEADER_LEN {
        return Err(CorruptRecord::new(
            "header count larger than the record's bytes can hold",
        ));
    }
    // Checked against both bounds above: at most MAX_HEADERS.
    let mut headers = HeaderMap::try_with_capacity(count)
        .map_err(|_| CorruptRecord::new("more headers than a record may hold"))?;
    for _ in 0..count {
        let n = usize::from(take_u16(data, "record ends in a header name length")?);
        let name = take(data, n, "header name runs past the record's end")?;
        let name =
            HeaderName::from_bytes(&name).map_err(|_| CorruptRecord::new("invalid header name"))?;
        let n = take_u32(data, "record ends in a header value length")?;
        let n = usize::try_from(n)
            .map_err(|_| CorruptRecord::new("header value runs past the record's end"))?;
        let value = take(data, n, "header value runs past the record's end")?;
        let value = HeaderValue::from_maybe_shared(value)
            .map_err(|_| CorruptRecord::new("invalid header value"))?;
        headers
            .try_append(name, value)
            .map_err(|_| CorruptRecord::new("more headers than a record may hold"))?;
    }
    Ok(headers)
}

/// The bytes of a response record, or `None` when the format cannot hold it.
fn encode_response(r: &StoredResponse) -> Option<Bytes> {
    // Sized (and every length checked) before anything is allocated.
    let mut len = 4 + headers_len(&r.headers)? + r.body.len();
    if let Some(trailers) = &r.trailers {
        u32::try_from(r.body.len()).ok()?;
        len += 4 + headers_len(trailers)?;
    }
    let mut buf = BytesMut::with_capacity(len);
    let tag = match r.trailers {
        None => TAG_RESPONSE,
        Some(_) => TAG_RESPONSE_TRAILERS,
    };
    buf.put_u8(tag);
    buf.put_u8(VERSION);
    buf.put_u16(r.status.as_u16());
    encode_headers(&mut buf, &r.headers)?;
    match &r.trailers {
        None => buf.put_slice(&r.body),
        Some(trailers) => {
            buf.put_u32(u32::try_from(r.body.len()).ok()?);
            buf.put_slice(&r.body);
            encode_headers(&mut buf, trailers)?;
        }
    }
    Some(buf.freeze())
}

/// Whether [`encode_response`] can hold `r` (without writing it).
fn fits(r: &StoredResponse) -> bool {
    headers_len(&r.headers).is_some()
        && match &r.trailers {
            None => true,
            Some(t) => u32::try_from(r.body.len()).is_ok() && headers_len(t).is_some(),
        }
}

/// The bytes `headers` take (count included), or `None` when the format
/// cannot hold them.
fn headers_len(headers: &HeaderMap) -> Option<usize> {
    if headers.len() > MAX_HEADERS {
        return None;
    }
    let mut len = 2;
    for (name, value) in headers {
        u16::try_from(name.as_str().len()).ok()?;
        u32::try_from(value.len()).ok()?;
        len += 2 + name.as_str().len() + 4 + value.len();
    }
    Some(len)
}

fn encode_headers(buf: &mut BytesMut, headers: &HeaderMap) -> Option<()> {
    buf.put_u16(u16::try_from(headers.len()).ok()?);
    for (name, value) in headers {
        buf.put_u16(u16::try_from(name.as_str().len()).ok()?);
        buf.put_slice(name.as_str().as_bytes());
        buf.put_u32(u32::try_from(value.len()).ok()?);
        buf.put_slice(value.as_bytes());
    }
    Some(())
}

#[cfg(test)]
mod tests;
