//! A URL that asks for TLS, on a build without `tls-rustls`. A test binary
//! of its own: CI builds it without the TLS feature (`.ci/run`), and a small
//! binary builds in a fraction of the time the whole `it` suite takes. With
//! the feature on (the default), it holds no test.

#![cfg(not(feature = "tls-rustls"))]

use std::time::Duration;

use tower_redis_lock::backend::RedlockBackend;
use tower_redis_lock::RedisBackend;

/// On a build without `tls-rustls`, a URL that asks for TLS is refused by
/// every constructor, with an error that names the feature, and no byte
/// reaches the address: fred alone would only warn and send `AUTH user pass`
/// in plaintext. CI runs this under `--no-default-features --features
/// redis,axum` (`.ci/run`); the decision itself is unit-tested for both
/// builds in `backend::redis::connect`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_url_without_the_tls_feature_is_refused_before_a_byte() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    for scheme in ["rediss", "valkeys"] {
        let url = format!("{scheme}://user:s3cret@127.0.0.1:{port}");
        let check = |what: &str, err: tower_redis_lock::backend::BackendError| {
            let msg = format!("{err}");
            assert!(msg.contains("tls-rustls"), "{what} {scheme}: {msg}");
            assert!(!format!("{err:?}").contains("s3cret"), "{what}: {err:?}");
        };
        check("builder", RedisBackend::builder(&url).unwrap_err());
        check("connect", RedisBackend::connect(&url).await.unwrap_err());
        check(
            "connect_lazy",
            RedisBackend::connect_lazy(&url).unwrap_err(),
        );
        check(
            "connect_pool",
            RedisBackend::connect_pool(&url, 2).await.unwrap_err(),
        );
        check(
            "redlock",
            RedlockBackend::connect(&[url.as_str()]).await.unwrap_err(),
        );
    }
    // Anything that connected sits in the listener's backlog.
    let accepted = tokio::time::timeout(Duration::from_millis(500), listener.accept()).await;
    assert!(
        accepted.is_err(),
        "a connection reached the address: {accepted:?}"
    );
}
