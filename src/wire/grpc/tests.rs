//! Unit tests of `wire/grpc.rs`.

use http::HeaderValue;

use super::*;

fn headers(content_type: &str) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(CONTENT_TYPE, HeaderValue::from_str(content_type).unwrap());
    h
}

#[test]
fn grpc_content_types() {
    for ct in [
        "application/grpc",
        "application/grpc+proto",
        "application/GRPC+json",
        "application/grpc;charset=utf-8",
    ] {
        assert!(is_grpc(&headers(ct)), "{ct}");
    }
    for ct in [
        "application/grpc-web",
        "application/grpc-web+proto",
        "application/grpcx",
        "application/json",
        "application/gr",
    ] {
        assert!(!is_grpc(&headers(ct)), "{ct}");
    }
    assert!(!is_grpc(&HeaderMap::new()));
}

#[test]
fn status_parsing() {
    let mut h = HeaderMap::new();
    assert_eq!(status_of(&h), None);
    h.insert(GRPC_STATUS, HeaderValue::from_static("14"));
    assert_eq!(status_of(&h), Some(14));
    for bad in ["", "-1", "1x", "1000", " 1"] {
        h.insert(GRPC_STATUS, HeaderValue::from_str(bad).unwrap());
        assert_eq!(status_of(&h), None, "{bad:?}");
    }
}

/// `google.rpc.Code`'s HTTP mapping: what `store_when` is asked.
#[test]
fn http_equivalents() {
    let pairs = [
        (code::OK, 200),
        (code::CANCELLED, 499),
        (code::UNKNOWN, 500),
        (code::INVALID_ARGUMENT, 400),
        (code::DEADLINE_EXCEEDED, 504),
        (code::NOT_FOUND, 404),
        (code::ALREADY_EXISTS, 409),
        (code::PERMISSION_DENIED, 403),
        (code::RESOURCE_EXHAUSTED, 429),
        (code::FAILED_PRECONDITION, 400),
        (code::ABORTED, 409),
        (code::OUT_OF_RANGE, 400),
        (code::UNIMPLEMENTED, 501),
        (code::INTERNAL, 500),
        (code::UNAVAILABLE, 503),
        (15, 500),
        (code::UNAUTHENTICATED, 401),
        (99, 500),
    ];
    for (code, status) in pairs {
        assert_eq!(http_equivalent(code), status, "code {code}");
    }
}

fn frame(flag: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = vec![flag];
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out
}

fn digest(body: &[u8]) -> Result<blake3::Hash, Rejection> {
    let mut h = blake3::Hasher::new();
    digest_messages(body, Some("gzip"), &mut h)?;
    Ok(h.finalize())
}

/// The digest is over the messages: the same messages digest alike, a
/// different one or a different split does not.
#[test]
fn digest_is_over_the_messages() {
    let one = frame(0, b"\x08\x01");
    assert_eq!(digest(&one).unwrap(), digest(&one).unwrap());
    assert_ne!(
        digest(&one).unwrap(),
        digest(&frame(0, b"\x08\x02")).unwrap()
    );
    let two = [frame(0, b"ab"), frame(0, b"c")].concat();
    let other_split = [frame(0, b"a"), frame(0, b"bc")].concat();
    assert_ne!(digest(&two).unwrap(), digest(&other_split).unwrap());
    assert_eq!(digest(&[]).unwrap(), blake3::hash(&[]));
}

#[test]
fn compressed_and_malformed_messages_are_refused() {
    match digest(&frame(1, b"\x1f\x8b")) {
        Err(Rejection::CompressedMessage { encoding }) => assert_eq!(encoding, "gzip"),
        other => panic!("{other:?}"),
    }
    for bad in [
        vec![0, 0, 0],
        frame(2, b"x"),
        [frame(0, b"abc"), vec![0, 0, 0, 0, 9, 1]].concat(),
    ] {
        assert!(
            matches!(digest(&bad), Err(Rejection::MalformedMessage { .. })),
            "{bad:?}"
        );
    }
}
