//! Memory stays bounded under 1,000 concurrent large uploads to a route with
//! a body digest: the layer buffers at most its limit per request, however
//! much a client sends. Its own test binary, so the peak RSS (`VmHWM`) is
//! this test's alone. Real HTTP over loopback; every loop is bounded.

#[path = "it/common/mod.rs"]
mod common;

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tokio::sync::Barrier;
use tower_redis_lock::key::{Header, KeySpace, RequestMethod, Route};
use tower_redis_lock::{MemoryBackend, RedisLockLayer};

const LIMIT: usize = 64 * 1024;
const CHUNK: usize = 4 * 1024;
const UPLOADS: usize = 1_000;
/// Half fit the limit (buffered, hashed, passed on), half are 4 MiB each
/// (2 GiB in all if anything buffered them whole).
const SMALL: usize = 60 * 1024;
const LARGE: usize = 4 << 20;

/// A chunked body of `len` bytes, every chunk a slice of one shared buffer
/// (so the client side costs no memory), with no size hint (so the server
/// cannot refuse it from a `Content-Length`).
struct Chunked {
    chunk: Bytes,
    left: usize,
}

impl Body for Chunked {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        let n = self.left.min(self.chunk.len());
        self.left -= n;
        Poll::Ready(Some(Ok(Frame::data(self.chunk.slice(..n)))))
    }
}

fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/self/status"))
}

type Sender = hyper::client::conn::http1::SendRequest<Chunked>;

async fn connect(addr: std::net::SocketAddr) -> Sender {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(async move {
        let _ = conn.await;
    });
    sender
}

async fn upload(mut sender: Sender, id: usize, len: usize, chunk: Bytes) -> (u16, Bytes) {
    let request = http::Request::post("/upload")
        .header("host", "localhost")
        .header("x-upload-id", id.to_string())
        .body(Chunked { chunk, left: len })
        .unwrap();
    match sender.send_request(request).await {
        Ok(res) => {
            let status = res.status().as_u16();
            let body = res.into_body().collect().await.map(|b| b.to_bytes());
            (status, body.unwrap_or_default())
        }
        // The server may answer 413 and close while the client is still
        // sending; hyper's client then reports the broken write instead.
        Err(e) => (0, Bytes::from(e.to_string())),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_concurrent_large_uploads_stay_bounded() {
    let small = UPLOADS / 2;
    // Every admitted upload waits until all are inside the handler: their
    // bodies are all buffered at the same moment.
    let barrier = Arc::new(Barrier::new(small));
    let layer = RedisLockLayer::new(
        MemoryBackend::new(),
        (RequestMethod, Route, Header::new("x-upload-id")),
    )
    .key_space(KeySpace::default().secret(b"memory test ----"))
    .digest_body()
    .body_limit(LIMIT);
    let lock = layer.clone();
    let app = Router::new().route(
        "/upload",
        post(move |body: Bytes| {
            let barrier = barrier.clone();
            async move {
                if body.len() == SMALL {
                    barrier.wait().await;
                }
                body.len().to_string()
            }
        })
        .layer(layer),
    );
    let addr = common::serve(app).await;
    let chunk = Bytes::from(vec![b'u'; CHUNK]);

    // Warm up (runtime, allocator arenas), then take the baseline.
    let (status, _) = upload(connect(addr).await, usize::MAX, 1, chunk.clone()).await;
    assert_eq!(status, 200);
    let baseline = status_kib("VmHWM:");
    // Open the 1,000 connections first (one after the other: a burst of
    // 1,000 SYNs can overflow the accept queue and stall on SYN retries),
    // then start all uploads at once.
    let mut senders = Vec::with_capacity(UPLOADS);
    for _ in 0..UPLOADS {
        senders.push(connect(addr).await);
    }
    let tasks: Vec<_> = senders
        .into_iter()
        .enumerate()
        .map(|(i, sender)| {
            let len = if i % 2 == 0 { SMALL } else { LARGE };
            tokio::spawn(upload(sender, i, len, chunk.clone()))
        })
        .collect();
    let started = Instant::now();
    let mut ok = 0;
    let mut too_large = 0;
    for (i, t) in tasks.into_iter().enumerate() {
        let (status, body) = tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("every upload answered within 120 s")
            .unwrap();
        if i % 2 == 0 {
            assert_eq!(status, 200, "upload {i}: {body:?}");
            assert_eq!(body, SMALL.to_string(), "handler got the whole body");
            ok += 1;
        } else {
            // 413, or the connection closed under the client's feet right
            // after the server refused: never a success.
            assert!(
                status == 413 || status == 0,
                "upload {i}: {status} {body:?}"
            );
            too_large += 1;
        }
    }
    let took = started.elapsed();
    let peak = status_kib("VmHWM:");
    let grown_mib = (peak.saturating_sub(baseline)) as f64 / 1024.0;
    println!(
        "1,000 concurrent uploads ({ok} x {} KiB admitted, {too_large} x {} MiB refused, limit {} KiB): \
         peak RSS {:.1} MiB (baseline {:.1} MiB, +{grown_mib:.1} MiB) in {took:?}",
        SMALL / 1024,
        LARGE >> 20,
        LIMIT / 1024,
        peak as f64 / 1024.0,
        baseline as f64 / 1024.0,
    );
    // Every lease released: each one taken (the warm-up and the small
    // uploads; a refused upload never takes one) was given back.
    let counts = lock.stats();
    assert_eq!(counts.acquired, small as u64 + 1, "{counts:?}");
    assert_eq!(
        counts.released, counts.acquired,
        "every lease released: {counts:?}"
    );
    assert_eq!(counts.release_failed + counts.lease_lost, 0, "{counts:?}");
    // Buffering everything sent would take > 2 GiB; the limit allows
    // 1,000 x (64 + 4) KiB = 66 MiB of body buffers plus connection state.
    assert!(
        grown_mib < 256.0,
        "peak RSS grew by {grown_mib:.1} MiB under 1,000 concurrent uploads"
    );
}
