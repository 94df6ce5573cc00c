use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http_body::{Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use tower::ServiceExt;
use tower_layer::Layer;

use super::*;
use crate::key::Route;
use crate::MemoryBackend;

/// A body that claims `hint` bytes and yields `items`.
struct Chunks {
    items: VecDeque<Result<&'static str, &'static str>>,
    hint: u64,
}

impl Body for Chunks {
    type Data = Bytes;
    type Error = &'static str;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let next = self.items.pop_front();
        Poll::Ready(next.map(|r| r.map(|s| Frame::data(Bytes::from_static(s.as_bytes())))))
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.hint)
    }
}

fn request() -> Request<Full<Bytes>> {
    Request::post("/p")
        .header("idempotency-key", "k")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap()
}

async fn drive(
    items: Vec<Result<&'static str, &'static str>>,
    hint: u64,
) -> (
    MemoryBackend,
    Arc<AtomicUsize>,
    Result<Bytes, &'static str>,
    u16,
) {
    let store = MemoryBackend::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let inner = tower::service_fn(move |_: Request<Full<Bytes>>| {
        r.fetch_add(1, Ordering::SeqCst);
        let body = Chunks {
            items: items.clone().into(),
            hint,
        };
        async move { Ok::<_, Infallible>(Response::new(body)) }
    });
    let svc = IdempotencyLayer::new(store.clone(), Route)
        .record_limit(5)
        .layer(inner);
    let res = svc.clone().oneshot(request()).await.unwrap();
    let first = res.into_body().collect().await.map(|c| c.to_bytes());
    let retry = svc.oneshot(request()).await.unwrap();
    (store, runs, first, retry.status().as_u16())
}

#[tokio::test]
async fn body_longer_than_its_hint_is_delivered_whole_and_not_stored() {
    // Claims 3 bytes (so it is collected), yields 10 (over the limit of 5).
    let (store, runs, first, retry) = drive(vec![Ok("012"), Ok("3456789")], 3).await;
    assert_eq!(first.unwrap(), Bytes::from_static(b"0123456789"));
    assert_eq!(retry, 410, "recorded as not stored, not run again");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(store.idempotency_entries(), 1);
}

#[tokio::test]
async fn custom_rejection_responder() {
    let inner = tower::service_fn(|_: Request<Full<Bytes>>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ran"))))
    });
    let svc = IdempotencyLayer::new(MemoryBackend::new(), Route)
        .on_rejection(|r| (r.status(), r.kind()))
        .layer(inner);
    let req = Request::post("/p").body(Full::new(Bytes::new())).unwrap();
    let res = svc.oneshot(req).await.unwrap();
    assert_eq!(res.status(), 400);
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"idempotency-key-missing");
}

#[tokio::test]
async fn body_error_is_recorded_as_not_stored() {
    // Fails on a layer that frees the key after a broken body: the
    // retry runs (200) and the handler runs twice.
    let (store, runs, first, retry) = drive(vec![Ok("ab"), Err("boom")], 4).await;
    assert_eq!(first.unwrap_err(), "boom", "the error reaches the client");
    assert_eq!(retry, 410, "done, not stored: not run again");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(store.idempotency_entries(), 1, "the outcome is kept");
}

/// `Duration::MAX` as "keep it for ever" is a value a user writes: every
/// duration setter keeps it without a panic (each is added to an `Instant`
/// on the way, which overflows at that size).
#[tokio::test]
async fn the_longest_durations_are_taken_without_a_panic() {
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let inner = tower::service_fn(move |_: Request<Full<Bytes>>| {
        r.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ran")))) }
    });
    let svc = IdempotencyLayer::new(MemoryBackend::new(), Route)
        .ttl(Duration::MAX)
        .deadline(Duration::MAX)
        .body_timeout(Duration::MAX)
        .retention(Duration::MAX)
        .join_timeout(Duration::MAX)
        .layer(inner);
    let first = svc.clone().oneshot(request()).await.unwrap();
    assert_eq!(first.status(), 200);
    let replay = svc.oneshot(request()).await.unwrap();
    assert_eq!(replay.status(), 200);
    let body = replay.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"ran");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the retry is a replay");
}

/// A header named twice among the stored ones (`Location` is stored by
/// default) is stored and replayed once, as it came.
#[tokio::test]
async fn a_stored_header_named_twice_is_replayed_once() {
    let inner = tower::service_fn(|_: Request<Full<Bytes>>| async {
        let mut res = Response::new(Full::new(Bytes::from_static(b"made")));
        *res.status_mut() = http::StatusCode::CREATED;
        res.headers_mut()
            .insert(http::header::LOCATION, "/p/1".parse().unwrap());
        Ok::<_, Infallible>(res)
    });
    let svc = IdempotencyLayer::new(MemoryBackend::new(), Route)
        .store_header(http::header::LOCATION)
        .layer(inner);
    let first = svc.clone().oneshot(request()).await.unwrap();
    assert_eq!(
        first
            .headers()
            .get_all(http::header::LOCATION)
            .iter()
            .count(),
        1
    );
    let replay = svc.oneshot(request()).await.unwrap();
    assert_eq!(replay.status(), http::StatusCode::CREATED);
    let locations: Vec<_> = replay
        .headers()
        .get_all(http::header::LOCATION)
        .iter()
        .collect();
    assert_eq!(locations, ["/p/1"], "replayed as it came");
}

/// A replay keeps what caches must be told by default: `Cache-Control`
/// (a `no-store, private` answer replayed without it could be cached and
/// shown to another user, its `Last-Modified` kept) and `Vary`.
#[tokio::test]
async fn a_replay_keeps_cache_control_and_vary() {
    let inner = tower::service_fn(|_: Request<Full<Bytes>>| async {
        let res = Response::builder()
            .status(201)
            .header("cache-control", "no-store, private")
            .header("vary", "accept-language")
            .header("last-modified", "Sat, 05 Dec 2026 03:00:00 GMT")
            .body(Full::new(Bytes::from_static(b"paid")))
            .unwrap();
        Ok::<_, Infallible>(res)
    });
    let svc = IdempotencyLayer::new(MemoryBackend::new(), Route).layer(inner);
    let first = svc.clone().oneshot(request()).await.unwrap();
    assert_eq!(first.status(), 201);
    let replay = svc.oneshot(request()).await.unwrap();
    assert_eq!(replay.status(), 201);
    assert_eq!(replay.headers()["cache-control"], "no-store, private");
    assert_eq!(replay.headers()["vary"], "accept-language");
}
