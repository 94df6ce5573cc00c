//! Micro-benchmarks: key derivation (with the body digest at 1 KiB and
//! 64 KiB) and the layer's overhead over `MemoryBackend`, driven through
//! `tower::ServiceExt::oneshot` against the bare service.
//!
//! ```text
//! cargo bench --bench micro
//! ```

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use tower::{service_fn, Layer, ServiceExt};
use tower_redis_lock::key::{Header, RequestMethod, UriPath};
use tower_redis_lock::lock::Locker;
use tower_redis_lock::{MemoryBackend, RedisLockLayer};

fn request(path: &str, body: Bytes) -> Request<Full<Bytes>> {
    Request::post(path)
        .header("x-user-id", "user-4242")
        .header("content-length", body.len())
        .body(Full::new(body))
        .expect("request")
}

fn key_derivation(c: &mut Criterion) {
    let locker = RedisLockLayer::new(
        MemoryBackend::new(),
        (
            RequestMethod,
            UriPath,
            Header::trusted_identity("x-user-id"),
        ),
    )
    .locker();
    let (parts, _) = request("/orders/42/pay", Bytes::new()).into_parts();

    let mut g = c.benchmark_group("key");
    g.bench_function("head (method, path, header)", |b| {
        b.iter(|| locker.key_for(black_box(&parts)).expect("key"))
    });
    // The digest as hex: the `{hex}` of the backend key `prefix:{hex}`
    // (the backend key itself is built inside the crate).
    g.bench_function("to_hex", |b| {
        let key = locker.key_for(&parts).expect("key");
        b.iter(|| black_box(key).to_hex())
    });
    for size in [1024usize, 64 * 1024] {
        let body = Bytes::from(vec![b'x'; size]);
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_with_input(
            BenchmarkId::new("head + body digest", size),
            &body,
            |b, body| {
                b.iter(|| {
                    let hash = blake3::hash(black_box(body));
                    let head = locker.key_for(&parts).expect("key");
                    locker.key_with(|k| {
                        k.push("head", head.as_bytes());
                        k.push("body", hash.as_bytes());
                    })
                })
            },
        );
    }
    g.finish();
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

async fn handler(_req: Request<Full<Bytes>>) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(Response::new(Full::new(Bytes::from_static(b"ok"))))
}

/// One request through `svc`, body read to the end (the lease is released
/// only then).
async fn call<S, B>(svc: S, req: Request<Full<Bytes>>)
where
    S: tower::Service<Request<Full<Bytes>>, Response = Response<B>, Error = Infallible>,
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let res = svc.oneshot(req).await.expect("infallible");
    assert_eq!(res.status(), 200);
    let _ = res.into_body().collect().await.expect("body");
}

fn layer_overhead(c: &mut Criterion) {
    let rt = rt();
    let n = AtomicU64::new(0);
    let path = |n: &AtomicU64| format!("/pay/{}", n.fetch_add(1, Ordering::Relaxed));

    let mut g = c.benchmark_group("oneshot");
    g.measurement_time(Duration::from_secs(3));
    g.bench_function("bare service", |b| {
        b.iter(|| rt.block_on(call(service_fn(handler), request(&path(&n), Bytes::new()))))
    });
    let layer = RedisLockLayer::new(MemoryBackend::new(), (RequestMethod, UriPath));
    g.bench_function("layer memory, unique keys", |b| {
        b.iter(|| {
            let svc = layer.layer(service_fn(handler));
            rt.block_on(call(svc, request(&path(&n), Bytes::new())))
        })
    });
    g.bench_function("layer memory, same key", |b| {
        b.iter(|| {
            let svc = layer.layer(service_fn(handler));
            rt.block_on(call(svc, request("/pay/same", Bytes::new())))
        })
    });
    for size in [1024usize, 64 * 1024] {
        let body = Bytes::from(vec![b'x'; size]);
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_with_input(
            BenchmarkId::new("bare service, body", size),
            &body,
            |b, body| {
                b.iter(|| rt.block_on(call(service_fn(handler), request(&path(&n), body.clone()))))
            },
        );
        let digest = RedisLockLayer::new(MemoryBackend::new(), (RequestMethod, UriPath))
            .digest_body()
            .body_limit(64 * 1024);
        g.bench_with_input(
            BenchmarkId::new("layer memory + body digest", size),
            &body,
            |b, body| {
                b.iter(|| {
                    let svc = digest.layer(service_fn(handler));
                    rt.block_on(call(svc, request(&path(&n), body.clone())))
                })
            },
        );
    }
    g.finish();

    // The `Locker` path alone: acquire + release, no HTTP.
    let locker = Locker::new(MemoryBackend::new(), UriPath);
    c.bench_function("locker memory acquire+release", |b| {
        b.iter(|| {
            let key =
                locker.key_with(|k| k.push("n", &n.fetch_add(1, Ordering::Relaxed).to_le_bytes()));
            rt.block_on(async {
                let guard = locker.lock(key).await.expect("free");
                guard.release().await;
            })
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = key_derivation, layer_overhead
}
criterion_main!(benches);
