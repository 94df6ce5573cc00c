//! Key derivation over arbitrary request parts: never panics, always yields a
//! fixed-shape key (32 lowercase hex digits: the hash tag of the backend key
//! `prefix:{hex}`, whose own shape `src/key/tests/props.rs` checks), is
//! deterministic, and a missing identity is a 401, never a key.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use tower_redis_lock::key::{
    Header, Identity, KeySpace, RequestMethod, Route, UriPath,
};
use tower_redis_lock::lock::Locker;
use tower_redis_lock::{MemoryBackend, RedisLockLayer};

#[derive(Clone, Debug)]
struct UserId(String);

impl std::fmt::Display for UserId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[derive(Arbitrary, Debug)]
struct Input {
    method: Vec<u8>,
    uri: Vec<u8>,
    headers: Vec<(Vec<u8>, Vec<u8>)>,
    identity: Option<String>,
    keyed: bool,
}

fn lockers() -> &'static [Locker; 2] {
    static LOCKERS: OnceLock<[Locker; 2]> = OnceLock::new();
    LOCKERS.get_or_init(|| {
        let layer = RedisLockLayer::new(
            MemoryBackend::new(),
            (
                RequestMethod,
                Route,
                UriPath,
                Header::optional("x-ref"),
                Header::optional("idempotency-key"),
                Header::trusted_identity("x-user-id"),
                Identity::<UserId>::new(),
            ),
        );
        [
            layer.clone().locker(),
            layer
                .key_space(KeySpace::default().secret(b"fuzz secret ----"))
                .locker(),
        ]
    })
}

fuzz_target!(|input: Input| {
    let mut builder = http::Request::builder();
    if let Ok(method) = http::Method::from_bytes(&input.method) {
        builder = builder.method(method);
    }
    if let Ok(uri) = http::Uri::try_from(input.uri.as_slice()) {
        builder = builder.uri(uri);
    }
    for (name, value) in &input.headers {
        if let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(name),
            http::HeaderValue::from_bytes(value),
        ) {
            builder = builder.header(name, value);
        }
    }
    let Ok(request) = builder.body(()) else {
        return;
    };
    let (mut parts, ()) = request.into_parts();
    if let Some(id) = &input.identity {
        parts.extensions.insert(UserId(id.clone()));
    }
    let locker = &lockers()[usize::from(input.keyed)];
    match locker.key_for(&parts) {
        Ok(key) => {
            assert!(input.identity.is_some(), "a key without an identity");
            let hex = key.to_hex();
            assert_eq!(hex.len(), 32);
            assert!(hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')));
            assert_eq!(key.to_string(), hex, "Display is the hex digest");
            assert_eq!(locker.key_for(&parts).ok(), Some(key), "deterministic");
            let other = &lockers()[usize::from(!input.keyed)];
            assert_ne!(
                other.key_for(&parts).ok(),
                Some(key),
                "secret changes the key"
            );
        }
        Err(rejection) => assert!(
            rejection.status() == http::StatusCode::UNAUTHORIZED
                || rejection.status() == http::StatusCode::BAD_REQUEST,
            "{rejection:?}"
        ),
    }
});
