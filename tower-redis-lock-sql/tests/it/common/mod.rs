//! Shared test helpers: the `redis-server` harness and the wait helpers
//! (from the `test-support` crate), loopback HTTP serving and a small HTTP/1
//! client, the serial runtime, a small random generator, the example
//! binaries and PostgreSQL databases of a test's own.
#![allow(dead_code, unreachable_pub, unused_imports)]

#[cfg(all(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
pub mod charging;
pub mod examples;
pub mod pg;
#[cfg(all(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
pub mod pgbouncer;
#[cfg(all(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
pub mod proxy;
#[cfg(all(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
pub mod stores;

pub(crate) use tower_redis_lock_test_support::{eventually, free_port, retry_until, RedisServer};

use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};

/// Serve an axum router on a loopback port.
pub async fn serve(router: axum::Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, router).await.unwrap();
    });
    addr
}

/// A response read to the end.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

/// Whether the idempotency layer replayed this answer
/// (`Idempotent-Replayed: true`).
pub fn replayed(reply: &Reply) -> bool {
    reply
        .headers
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

/// One request on a fresh connection, or why there was no answer (refused,
/// reset, cut off mid-answer: the server died).
pub async fn try_send(addr: SocketAddr, req: http::Request<Full<Bytes>>) -> Result<Reply, String> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let io = hyper_util::rt::TokioIo::new(stream);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let res = sender
        .send_request(req)
        .await
        .map_err(|e| format!("request: {e}"))?;
    let (parts, body) = res.into_parts();
    let body = body
        .collect()
        .await
        .map_err(|e| format!("body: {e}"))?
        .to_bytes();
    Ok(Reply {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body,
    })
}

/// Build a request.
pub fn req(
    method: &str,
    uri: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> http::Request<Full<Bytes>> {
    let mut b = http::Request::builder()
        .method(method)
        .uri(uri)
        .header("host", "localhost");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(Full::new(Bytes::copy_from_slice(body.as_bytes())))
        .unwrap()
}

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Run `f` on a fresh multi-thread runtime (2 workers). Tests run through
/// this one at a time: the crash tests load the machine, and a neighbour's
/// load must not eat their margins.
pub fn run<F, Fut>(f: F) -> Fut::Output
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future,
{
    let _serial = SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
        .block_on(f())
}

/// A small xorshift generator for load tests (pacing, kill times), seeded
/// from the clock and `salt`: each run differs, each worker of a run too.
pub struct Rng(u64);

impl Rng {
    pub fn new(salt: u64) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64;
        Self((nanos ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        lo + self.0 % (hi - lo + 1)
    }
}
