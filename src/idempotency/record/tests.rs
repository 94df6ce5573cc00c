//! Unit tests of `record.rs`.

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
        trailers: None,
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
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/record_decode");
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
        "[a-z0-9!#$%&'*+.^_`|~-]{1,24}".prop_map(|s| HeaderName::from_bytes(s.as_bytes()).unwrap()),
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
                Record::Response(StoredResponse { status, headers, body: body.into(), trailers: None })
            }),
        2 => (status(), vec((header_name(), header_value()), 0..8), vec(any::<u8>(), 0..512), vec((header_name(), header_value()), 0..8))
            .prop_map(|(status, pairs, body, trailer_pairs)| {
                let mut headers = HeaderMap::new();
                for (name, value) in pairs {
                    headers.append(name, value);
                }
                let mut trailers = HeaderMap::new();
                for (name, value) in trailer_pairs {
                    trailers.append(name, value);
                }
                Record::Response(StoredResponse { status, headers, body: body.into(), trailers: Some(Box::new(trailers)) })
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

/// A record without trailers (every HTTP route's) is written byte for byte
/// as 0.2 wrote it: these bytes come from 0.2's encoder (`main` before
/// trailers were added), so a 0.2 instance of a rolling deploy reads every
/// HTTP record a new instance writes.
#[test]
fn http_records_keep_the_0_2_bytes() {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", "application/json".parse().unwrap());
    headers.append("location", "/payments/pay_1".parse().unwrap());
    headers.append("etag", "\"a\"".parse().unwrap());
    headers.append("etag", "\"b\"".parse().unwrap());
    let r = response(201, headers, b"{\"id\":\"pay_1\"}");
    let from_0_2: &[u8] = &[
        82, 1, 0, 201, 0, 4, 0, 12, 99, 111, 110, 116, 101, 110, 116, 45, 116, 121, 112, 101, 0, 0,
        0, 16, 97, 112, 112, 108, 105, 99, 97, 116, 105, 111, 110, 47, 106, 115, 111, 110, 0, 8,
        108, 111, 99, 97, 116, 105, 111, 110, 0, 0, 0, 15, 47, 112, 97, 121, 109, 101, 110, 116,
        115, 47, 112, 97, 121, 95, 49, 0, 4, 101, 116, 97, 103, 0, 0, 0, 3, 34, 97, 34, 0, 4, 101,
        116, 97, 103, 0, 0, 0, 3, 34, 98, 34, 123, 34, 105, 100, 34, 58, 34, 112, 97, 121, 95, 49,
        34, 125,
    ];
    assert_eq!(&r.encode()[..], from_0_2);
    assert_eq!(decode(from_0_2).unwrap(), r);
    let n = Record::NotStored {
        status: StatusCode::OK,
        reason: NotStoredReason::Streaming,
    };
    assert_eq!(&n.encode()[..], &[78, 1, 0, 200, 2]);
}

/// A gRPC answer's trailers are kept, in a record of its own tag (`T`),
/// and come back exactly; an empty trailers frame is still trailers.
#[test]
fn trailers_round_trip_under_their_own_tag() {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", "application/grpc".parse().unwrap());
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", "0".parse().unwrap());
    trailers.insert("grpc-message", "ok%20done".parse().unwrap());
    for trailers in [trailers, HeaderMap::new()] {
        let r = Record::Response(StoredResponse {
            status: StatusCode::OK,
            headers: headers.clone(),
            body: Bytes::from_static(b"\0\0\0\0\x02\x08\x01"),
            trailers: Some(Box::new(trailers)),
        });
        let bytes = r.encode();
        assert_eq!(bytes[0], b'T');
        assert_eq!(Record::decode(bytes).unwrap(), r);
    }
}

/// Trailers records read from storage are untrusted too: a body length
/// past the end, a trailer count past the end, bytes after the trailers.
#[test]
fn corrupt_trailers_records_are_refused() {
    let mut base = vec![b'T', 1, 0, 200, 0, 0];
    assert!(decode(&base).is_err(), "no body length");
    base.extend_from_slice(&5u32.to_be_bytes());
    assert!(decode(&base).is_err(), "body past the end");
    base.truncate(6);
    base.extend_from_slice(&0u32.to_be_bytes());
    assert!(decode(&base).is_err(), "no trailer count");
    let mut counted = base.clone();
    counted.extend_from_slice(&900u16.to_be_bytes());
    assert!(decode(&counted).is_err(), "trailer count past the bytes");
    base.extend_from_slice(&0u16.to_be_bytes());
    assert!(decode(&base).is_ok());
    base.push(0);
    assert!(decode(&base).is_err(), "bytes after the trailers");
}

/// What a duplicate joined on this instance is handed is what the store
/// keeps: `kept` is `decode(encode(..))`, at the format's limits and past
/// them.
#[test]
fn kept_is_what_the_store_reads_back() {
    for n in [MAX_HEADERS, MAX_HEADERS + 1] {
        let r = response(201, many_headers(n), b"body");
        assert_eq!(
            Ok(r.clone().kept()),
            Record::decode(r.encode()),
            "{n} headers"
        );
    }
}
