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
//! path (`src/backend/replay/record.rs`), to reach the crate-private codec.

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
    /// Encode as `tag ‖ version ‖ status(u16 BE) ‖ ...`:
    /// for a response `count(u16) ‖ (len(u16) name len(u32) value)* ‖ body`;
    /// for a not-stored marker one reason byte.
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
        if tag != TAG_RESPONSE && tag != TAG_NOT_STORED {
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
        let count = usize::from(take_u16(&mut data, "record ends before its header count")?);
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
            let n = usize::from(take_u16(&mut data, "record ends in a header name length")?);
            let name = take(&mut data, n, "header name runs past the record's end")?;
            let name = HeaderName::from_bytes(&name)
                .map_err(|_| CorruptRecord::new("invalid header name"))?;
            let n = take_u32(&mut data, "record ends in a header value length")?;
            let n = usize::try_from(n)
                .map_err(|_| CorruptRecord::new("header value runs past the record's end"))?;
            let value = take(&mut data, n, "header value runs past the record's end")?;
            let value = HeaderValue::from_maybe_shared(value)
                .map_err(|_| CorruptRecord::new("invalid header value"))?;
            headers
                .try_append(name, value)
                .map_err(|_| CorruptRecord::new("more headers than a record may hold"))?;
        }
        Ok(Self::Response(StoredResponse {
            status,
            headers,
            body: data,
        }))
    }
}

/// The bytes of a response record, or `None` when the format cannot hold it.
fn encode_response(r: &StoredResponse) -> Option<Bytes> {
    if r.headers.len() > MAX_HEADERS {
        return None;
    }
    let count = u16::try_from(r.headers.len()).ok()?;
    // Sized (and every length checked) before anything is allocated.
    let mut len = 6 + r.body.len();
    for (name, value) in &r.headers {
        u16::try_from(name.as_str().len()).ok()?;
        u32::try_from(value.len()).ok()?;
        len += 2 + name.as_str().len() + 4 + value.len();
    }
    let mut buf = BytesMut::with_capacity(len);
    buf.put_u8(TAG_RESPONSE);
    buf.put_u8(VERSION);
    buf.put_u16(r.status.as_u16());
    buf.put_u16(count);
    for (name, value) in &r.headers {
        buf.put_u16(u16::try_from(name.as_str().len()).ok()?);
        buf.put_slice(name.as_str().as_bytes());
        buf.put_u32(u32::try_from(value.len()).ok()?);
        buf.put_slice(value.as_bytes());
    }
    buf.put_slice(&r.body);
    Some(buf.freeze())
}

#[cfg(test)]
mod tests {
    use proptest::collection::vec;
    use proptest::prelude::*;

    use super::*;

    fn decode(bytes: &[u8]) -> Result<Record, CorruptRecord> {
        Record::decode(Bytes::copy_from_slice(bytes))
    }

    fn response(status: u16, headers: HeaderMap, body: &'static [u8]) -> Record {
        Record::Response(StoredResponse {
            status: StatusCode::from_u16(status).unwrap(),
            headers,
            body: Bytes::from_static(body),
        })
    }

    #[test]
    fn round_trip() {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", "application/json".parse().unwrap());
        headers.append("set-cookie", "a=1".parse().unwrap());
        headers.append("set-cookie", HeaderValue::from_bytes(b"b=\xff").unwrap());
        let r = response(201, headers, b"{\"id\":\"\x00\xff\"}");
        assert_eq!(Record::decode(r.encode()).unwrap(), r);
        let n = Record::NotStored {
            status: StatusCode::OK,
            reason: NotStoredReason::TooLarge,
        };
        assert_eq!(Record::decode(n.encode()).unwrap(), n);
    }

    /// The encoding is what 0.2 wrote: records already in Redis still read.
    #[test]
    fn encoding_is_unchanged() {
        let mut headers = HeaderMap::new();
        headers.insert("x-a", "1".parse().unwrap());
        let r = response(201, headers, b"ok");
        assert_eq!(
            &r.encode()[..],
            b"R\x01\x00\xc9\x00\x01\x00\x03x-a\x00\x00\x00\x011ok"
        );
        let n = Record::NotStored {
            status: StatusCode::BAD_GATEWAY,
            reason: NotStoredReason::ServiceFailed,
        };
        assert_eq!(&n.encode()[..], b"N\x01\x01\xf6\x04");
    }

    /// Six bytes claiming 24,577 headers: `HeaderMap::with_capacity` panicked
    /// on the count (it killed the pub/sub subscriber task and dropped the
    /// connection of a replay).
    #[test]
    fn the_six_byte_poison_is_an_error() {
        assert_eq!(
            decode(b"R\x01\x00\xc8\x60\x01"),
            Err(CorruptRecord::new("more headers than a record may hold"))
        );
    }

    #[test]
    fn crafted_records_are_errors_with_a_reason() {
        let cases: &[(&[u8], &str)] = &[
            (b"", "empty record"),
            (b"X\x01\x00\xc8", "unknown record tag"),
            (b"R", "record ends before its version"),
            (b"R\x09\x00\xc8\x00\x00", "unknown record version"),
            (b"R\x01\x00", "record ends before its status"),
            (b"R\x01\x00\x00\x00\x00", "status outside 100..=999"),
            (b"R\x01\x00\x63\x00\x00", "status outside 100..=999"),
            (b"R\x01\x03\xe8\x00\x00", "status outside 100..=999"),
            (b"R\x01\xff\xff\x00\x00", "status outside 100..=999"),
            (b"R\x01\x00\xc8", "record ends before its header count"),
            (
                b"R\x01\x00\xc8\xff\xff",
                "more headers than a record may hold",
            ),
            (
                b"R\x01\x00\xc8\x04\x01",
                "more headers than a record may hold",
            ),
            // The largest count allowed, but not the bytes to back it.
            (
                b"R\x01\x00\xc8\x04\x00",
                "header count larger than the record's bytes can hold",
            ),
            (
                b"R\x01\x00\xc8\x00\x02\x00\x01a\x00\x00\x00\x00",
                "header count larger than the record's bytes can hold",
            ),
            (
                b"R\x01\x00\xc8\x00\x01\x00\x09ab\x00\x00\x00\x00",
                "header name runs past the record's end",
            ),
            (
                b"R\x01\x00\xc8\x00\x01\xff\xffabcdef",
                "header name runs past the record's end",
            ),
            (
                b"R\x01\x00\xc8\x00\x01\x00\x01a\x00\x00\x00\x09xy",
                "header value runs past the record's end",
            ),
            (
                b"R\x01\x00\xc8\x00\x01\x00\x01a\xff\xff\xff\xff",
                "header value runs past the record's end",
            ),
            (
                b"R\x01\x00\xc8\x00\x02\x00\x08abcdefgh\x00\x00\x00\x00\x00\x01b\x00",
                "record ends in a header value length",
            ),
            (
                b"R\x01\x00\xc8\x00\x02\x00\x01a\x00\x00\x00\x02xy\x00\x00\x00\x00\x00\x00",
                "invalid header name",
            ),
            (
                b"R\x01\x00\xc8\x00\x01\x00\x00\x00\x00\x00\x00\x00",
                "invalid header name",
            ),
            (
                b"R\x01\x00\xc8\x00\x01\x00\x02a \x00\x00\x00\x00",
                "invalid header name",
            ),
            (
                b"R\x01\x00\xc8\x00\x01\x00\x02a:\x00\x00\x00\x00",
                "invalid header name",
            ),
            (
                b"R\x01\x00\xc8\x00\x01\x00\x01a\x00\x00\x00\x01\n",
                "invalid header value",
            ),
            (
                b"R\x01\x00\xc8\x00\x01\x00\x01a\x00\x00\x00\x01\x7f",
                "invalid header value",
            ),
            (
                b"R\x01\x00\xc8\x00\x01\x00\x01a\x00\x00\x00\x03a\rb",
                "invalid header value",
            ),
            (b"N\x01\x00\xc8", "not-stored record ends before its reason"),
            (b"N\x01\x00\x00\x01", "status outside 100..=999"),
            (b"N\x01\x03\xe8\x01", "status outside 100..=999"),
            (b"N\x01\x00\xc8\x00", "unknown not-stored reason"),
            (b"N\x01\x00\xc8\x05", "unknown not-stored reason"),
            (
                b"N\x01\x00\xc8\x01garbage",
                "bytes after a not-stored record",
            ),
            (b"N\x01\x00\xc8\x01\x00", "bytes after a not-stored record"),
        ];
        for &(bad, reason) in cases {
            assert_eq!(decode(bad), Err(CorruptRecord::new(reason)), "{bad:?}");
        }
    }

    /// Statuses at both ends of `http`'s range, and a header with an empty
    /// value (the shortest header there is) at the count's byte bound.
    #[test]
    fn edges_that_are_valid() {
        for status in [100, 999] {
            let r = response(status, HeaderMap::new(), b"");
            assert_eq!(Record::decode(r.encode()), Ok(r));
        }
        let empty = decode(b"R\x01\x00\xc8\x00\x01\x00\x01a\x00\x00\x00\x00").unwrap();
        let Record::Response(r) = &empty else {
            panic!("{empty:?}")
        };
        assert_eq!(r.headers.get("a").unwrap(), "");
        assert!(r.body.is_empty());
        // Names are case-insensitive: `http` keeps them in lower case.
        let upper = decode(b"R\x01\x00\xc8\x00\x01\x00\x01A\x00\x00\x00\x00").unwrap();
        assert_eq!(upper, empty);
    }

    /// The message says what was wrong, never what the bytes were.
    #[test]
    fn the_error_names_the_fault_not_the_bytes() {
        let err = decode(b"R\x01\x00\xc8\x00\x01\x00\x05evil!\x00\x00\x00\x01\n").unwrap_err();
        let shown = err.to_string();
        assert_eq!(
            shown,
            "stored idempotency record could not be decoded: invalid header value"
        );
        assert!(!shown.contains("evil"));
    }

    fn many_headers(n: usize) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for i in 0..n {
            // Half distinct names, half values appended to one name.
            if i % 2 == 0 {
                headers.append(
                    HeaderName::from_bytes(format!("x-{i}").as_bytes()).unwrap(),
                    HeaderValue::from(i),
                );
            } else {
                headers.append("set-cookie", HeaderValue::from(i));
            }
        }
        assert_eq!(headers.len(), n);
        headers
    }

    /// `encode` writes nothing `decode` refuses: a response over the format's
    /// limits is kept as "not stored, too large" with its status, never cut
    /// short; at the limits it round-trips.
    #[test]
    fn encode_never_writes_what_decode_refuses() {
        let at = response(200, many_headers(MAX_HEADERS), b"body");
        assert_eq!(Record::decode(at.encode()), Ok(at));
        let over = response(201, many_headers(MAX_HEADERS + 1), b"body");
        assert_eq!(
            Record::decode(over.encode()),
            Ok(Record::NotStored {
                status: StatusCode::CREATED,
                reason: NotStoredReason::TooLarge,
            })
        );
        // The longest name `http` accepts fits the u16 length; one byte more
        // is refused by `http` itself, so `name.len()` always fits.
        let longest = vec![b'n'; u16::MAX as usize];
        assert!(HeaderName::from_bytes(&[b'n'; u16::MAX as usize + 1]).is_err());
        let mut headers = HeaderMap::new();
        headers.insert(
            HeaderName::from_bytes(&longest).unwrap(),
            "v".parse().unwrap(),
        );
        let r = response(200, headers, b"");
        assert_eq!(Record::decode(r.encode()), Ok(r));
        // A value over u32::MAX bytes takes the same path as too many
        // headers (`encode_response` returns `None`); 4 GiB is more than a
        // test should allocate, so that branch is read, not run.
    }

    /// The seed corpus of the `record_decode` fuzz target (and whatever a
    /// local fuzz run added to it) goes through the decoder here too, so it
    /// runs where cargo-fuzz is missing. Seeds named `ok-*` must decode and
    /// re-encode byte for byte; `bad-*` must be refused.
    #[test]
    fn fuzz_corpus_replays() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/record_decode");
        let entries = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("fuzz corpus {} missing: {e}", dir.display()));
        let (mut ok, mut bad) = (0, 0);
        for entry in entries {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let bytes = std::fs::read(&path).unwrap();
            let decoded = decode(&bytes);
            if let Ok(record) = &decoded {
                assert_eq!(
                    Record::decode(record.encode()).as_ref(),
                    Ok(record),
                    "{name}"
                );
            }
            if name.starts_with("ok-") {
                assert_eq!(
                    decoded.map(|r| r.encode()),
                    Ok(Bytes::from(bytes)),
                    "{name}"
                );
                ok += 1;
            } else if name.starts_with("bad-") {
                assert!(decoded.is_err(), "{name} decoded: {decoded:?}");
                bad += 1;
            }
        }
        assert!(
            ok >= 3 && bad >= 5,
            "seeds missing in {}: {ok} ok, {bad} bad",
            dir.display()
        );
    }

    fn header_name() -> impl Strategy<Value = HeaderName> {
        prop_oneof![
            Just(HeaderName::from_static("set-cookie")),
            Just(HeaderName::from_static("content-type")),
            "[a-z0-9!#$%&'*+.^_`|~-]{1,24}"
                .prop_map(|s| HeaderName::from_bytes(s.as_bytes()).unwrap()),
        ]
    }

    fn header_value() -> impl Strategy<Value = HeaderValue> {
        // Every byte `http` allows in a value: tab, 0x20..=0xff but DEL.
        let byte = prop_oneof![Just(b'\t'), 0x20u8..0x7f, 0x80u8..=0xff];
        vec(byte, 0..48).prop_map(|v| HeaderValue::from_bytes(&v).unwrap())
    }

    fn status() -> impl Strategy<Value = StatusCode> {
        (100u16..=999).prop_map(|s| StatusCode::from_u16(s).unwrap())
    }

    fn record() -> impl Strategy<Value = Record> {
        let reason = prop_oneof![
            Just(NotStoredReason::TooLarge),
            Just(NotStoredReason::Streaming),
            Just(NotStoredReason::BodyFailed),
            Just(NotStoredReason::ServiceFailed),
        ];
        prop_oneof![
            3 => (status(), vec((header_name(), header_value()), 0..24), vec(any::<u8>(), 0..512))
                .prop_map(|(status, pairs, body)| {
                    let mut headers = HeaderMap::new();
                    for (name, value) in pairs {
                        headers.append(name, value);
                    }
                    Record::Response(StoredResponse { status, headers, body: body.into() })
                }),
            1 => (status(), reason).prop_map(|(status, reason)| Record::NotStored { status, reason }),
        ]
    }

    /// Decode, and if it decodes, re-encode and decode again: the same
    /// record (what the `record_decode` fuzz target checks).
    fn check(bytes: Vec<u8>) -> Result<(), TestCaseError> {
        if let Ok(record) = Record::decode(bytes.into()) {
            prop_assert_eq!(Record::decode(record.encode()), Ok(record));
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        /// Every record the layer can make round-trips.
        #[test]
        fn every_record_round_trips(r in record()) {
            prop_assert_eq!(Record::decode(r.encode()), Ok(r));
        }

        /// Arbitrary bytes never panic; what decodes round-trips.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in vec(any::<u8>(), 0..512)) {
            check(bytes)?;
        }

        /// Bytes that start like a record (right tag and version, any status
        /// and count) get past the first checks: still no panic.
        #[test]
        fn plausible_bytes_never_panic(
            tag in prop_oneof![Just(TAG_RESPONSE), Just(TAG_NOT_STORED)],
            status in any::<u16>(),
            count in prop_oneof![any::<u16>(), 0u16..8],
            rest in vec(any::<u8>(), 0..512),
        ) {
            let mut bytes = vec![tag, VERSION];
            bytes.extend_from_slice(&status.to_be_bytes());
            bytes.extend_from_slice(&count.to_be_bytes());
            bytes.extend_from_slice(&rest);
            check(bytes)?;
        }

        /// A valid record with one byte changed, or cut short, or with bytes
        /// added: no panic; what decodes round-trips. A not-stored record
        /// cut short or lengthened is refused.
        #[test]
        fn damaged_records_never_panic(
            r in record(),
            at in any::<prop::sample::Index>(),
            byte in any::<u8>(),
            tail in vec(any::<u8>(), 1..16),
        ) {
            let good = r.encode().to_vec();
            let i = at.index(good.len());
            let mut flipped = good.clone();
            flipped[i] = byte;
            check(flipped)?;
            check(good[..i].to_vec())?;
            let mut longer = good.clone();
            longer.extend_from_slice(&tail);
            check(longer.clone())?;
            if matches!(r, Record::NotStored { .. }) {
                prop_assert!(Record::decode(Bytes::copy_from_slice(&good[..i])).is_err());
                prop_assert!(Record::decode(longer.into()).is_err());
            }
        }
    }
}
