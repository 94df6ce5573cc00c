//! What is kept for a completed request, and its byte encoding.

// The byte encoding is only needed by the Redis store; the memory store
// keeps records as values.
#![cfg_attr(not(feature = "redis"), allow(dead_code))]

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
    /// The body was larger than the layer's record limit.
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
            Self::TooLarge => "its body was larger than the record limit",
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

/// A response as kept in the store: status, the chosen headers, the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoredResponse {
    /// The status code.
    pub(crate) status: StatusCode,
    /// The stored headers, in the order the handler set them.
    pub(crate) headers: HeaderMap,
    /// The whole body.
    pub(crate) body: Bytes,
}

const TAG_RESPONSE: u8 = b'R';
const TAG_NOT_STORED: u8 = b'N';
const VERSION: u8 = 1;

/// A stored record that could not be decoded (written by an incompatible
/// version, or not by this crate).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CorruptRecord;

impl std::fmt::Display for CorruptRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("stored idempotency record could not be decoded")
    }
}

impl std::error::Error for CorruptRecord {}

impl Record {
    /// Encode as `tag ‖ version ‖ status(u16 BE) ‖ ...`:
    /// for a response `count(u16) ‖ (len(u16) name len(u32) value)* ‖ body`;
    /// for a not-stored marker one reason byte.
    pub(crate) fn encode(&self) -> Bytes {
        match self {
            Self::Response(r) => {
                let mut buf = BytesMut::with_capacity(8 + r.body.len() + 64 * r.headers.len());
                buf.put_u8(TAG_RESPONSE);
                buf.put_u8(VERSION);
                buf.put_u16(r.status.as_u16());
                buf.put_u16(r.headers.len().min(u16::MAX as usize) as u16);
                for (name, value) in r.headers.iter().take(u16::MAX as usize) {
                    buf.put_u16(name.as_str().len() as u16);
                    buf.put_slice(name.as_str().as_bytes());
                    buf.put_u32(value.len() as u32);
                    buf.put_slice(value.as_bytes());
                }
                buf.put_slice(&r.body);
                buf.freeze()
            }
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

    /// Decode what [`encode`](Self::encode) wrote.
    pub(crate) fn decode(mut data: Bytes) -> Result<Self, CorruptRecord> {
        fn need(data: &Bytes, n: usize) -> Result<(), CorruptRecord> {
            if data.remaining() < n {
                Err(CorruptRecord)
            } else {
                Ok(())
            }
        }
        need(&data, 4)?;
        let tag = data.get_u8();
        if data.get_u8() != VERSION {
            return Err(CorruptRecord);
        }
        let status = StatusCode::from_u16(data.get_u16()).map_err(|_| CorruptRecord)?;
        match tag {
            TAG_RESPONSE => {
                need(&data, 2)?;
                let count = data.get_u16() as usize;
                let mut headers = HeaderMap::with_capacity(count);
                for _ in 0..count {
                    need(&data, 2)?;
                    let n = data.get_u16() as usize;
                    need(&data, n)?;
                    let name =
                        HeaderName::from_bytes(&data.split_to(n)).map_err(|_| CorruptRecord)?;
                    need(&data, 4)?;
                    let n = data.get_u32() as usize;
                    need(&data, n)?;
                    let value = HeaderValue::from_maybe_shared(data.split_to(n))
                        .map_err(|_| CorruptRecord)?;
                    headers.append(name, value);
                }
                Ok(Self::Response(StoredResponse {
                    status,
                    headers,
                    body: data,
                }))
            }
            TAG_NOT_STORED => {
                need(&data, 1)?;
                let reason = NotStoredReason::from_code(data.get_u8()).ok_or(CorruptRecord)?;
                Ok(Self::NotStored { status, reason })
            }
            _ => Err(CorruptRecord),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", "application/json".parse().unwrap());
        headers.append("set-cookie", "a=1".parse().unwrap());
        headers.append("set-cookie", HeaderValue::from_bytes(b"b=\xff").unwrap());
        let r = Record::Response(StoredResponse {
            status: StatusCode::CREATED,
            headers,
            body: Bytes::from_static(b"{\"id\":\"\x00\xff\"}"),
        });
        assert_eq!(Record::decode(r.encode()).unwrap(), r);
        let n = Record::NotStored {
            status: StatusCode::OK,
            reason: NotStoredReason::TooLarge,
        };
        assert_eq!(Record::decode(n.encode()).unwrap(), n);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for bad in [
            &b""[..],
            b"R",
            b"R\x01\x00",
            b"X\x01\x00\xc8",
            b"R\x01\x00\xc8\x00\x05",
        ] {
            assert_eq!(
                Record::decode(Bytes::copy_from_slice(bad)),
                Err(CorruptRecord)
            );
        }
        let mut ok = Record::Response(StoredResponse {
            status: StatusCode::OK,
            headers: HeaderMap::new(),
            body: Bytes::new(),
        })
        .encode()
        .to_vec();
        ok[1] = 9; // unknown version
        assert_eq!(Record::decode(ok.into()), Err(CorruptRecord));
    }
}
