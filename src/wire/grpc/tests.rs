//! Unit tests of `wire/grpc.rs`.

use std::time::Duration;

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

/// `google.rpc.Status`, `google.protobuf.Any`, `google.rpc.RetryInfo`
/// and `google.protobuf.Duration` as prost reads them: the hand-written
/// encoder must agree with a protobuf library.
mod pb {
    #[derive(Clone, PartialEq, prost::Message)]
    pub(super) struct Status {
        #[prost(int32, tag = "1")]
        pub(super) code: i32,
        #[prost(string, tag = "2")]
        pub(super) message: String,
        #[prost(message, repeated, tag = "3")]
        pub(super) details: Vec<Any>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub(super) struct Any {
        #[prost(string, tag = "1")]
        pub(super) type_url: String,
        #[prost(bytes = "vec", tag = "2")]
        pub(super) value: Vec<u8>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub(super) struct RetryInfo {
        #[prost(message, optional, tag = "1")]
        pub(super) retry_delay: Option<Duration>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub(super) struct Duration {
        #[prost(int64, tag = "1")]
        pub(super) seconds: i64,
        #[prost(int32, tag = "2")]
        pub(super) nanos: i32,
    }
}

#[test]
fn status_details_decode_as_protobuf() {
    use prost::Message;
    let bytes = status_details(10, "held: wait", Duration::from_millis(2_250));
    let status = pb::Status::decode(bytes.as_slice()).unwrap();
    assert_eq!(status.code, 10);
    assert_eq!(status.message, "held: wait");
    assert_eq!(status.details.len(), 1);
    assert_eq!(
        status.details[0].type_url,
        "type.googleapis.com/google.rpc.RetryInfo"
    );
    let info = pb::RetryInfo::decode(status.details[0].value.as_slice()).unwrap();
    assert_eq!(
        info.retry_delay,
        Some(pb::Duration {
            seconds: 2,
            nanos: 250_000_000
        })
    );
}

#[test]
fn base64_is_unpadded_standard() {
    for (input, expected) in [
        (&b""[..], ""),
        (b"f", "Zg"),
        (b"fo", "Zm8"),
        (b"foo", "Zm9v"),
        (b"foobar", "Zm9vYmFy"),
        (b"\xff\xfe\xfd", "//79"),
    ] {
        assert_eq!(base64(input), expected);
    }
}

/// gRPC's `Percent-Byte-Unencoded` is space and visible ASCII but `%`;
/// everything else is `%XX` of its UTF-8 bytes.
#[test]
fn grpc_message_is_percent_encoded() {
    assert_eq!(
        percent_encode("wait 2 s: 100% sure"),
        "wait 2 s: 100%25 sure"
    );
    assert_eq!(percent_encode("é\n"), "%C3%A9%0A");
    assert_eq!(percent_encode("`a`~"), "`a`~");
}

#[test]
fn retry_metadata_rounds_up() {
    let res = status_response(14, "down", Some(Duration::from_micros(1_500)));
    assert_eq!(res.headers()["grpc-retry-pushback-ms"], "2");
    assert_eq!(res.headers()["retry-after"], "1");
    assert!(res.headers().contains_key("grpc-status-details-bin"));
    let res = status_response(14, "down", None);
    assert!(!res.headers().contains_key("grpc-retry-pushback-ms"));
    assert!(!res.headers().contains_key("grpc-status-details-bin"));
    assert_eq!(millis(Duration::ZERO), 1);
    assert_eq!(millis(Duration::from_millis(7)), 7);
}
