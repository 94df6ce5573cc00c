use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tower::{service_fn, ServiceExt};

use crate::backend::{MemoryBackend, Token};
use crate::key::{Header, KeyPart, KeyWriter, RequestMethod, Route};
use crate::{Lease, RedisLockLayer};

fn echo_status() -> impl tower::Service<
    Request<Full<Bytes>>,
    Response = Response<String>,
    Error = Infallible,
    Future = impl Send,
> + Clone {
    service_fn(|req: Request<Full<Bytes>>| async move {
        let lease = req.extensions().get::<Lease>().cloned();
        let status = lease
            .map(|l| match (l.is_locked(), l.key().is_some()) {
                (true, _) => "Locked",
                (false, true) => "FailOpen",
                (false, false) => "Skipped",
            })
            .unwrap_or_default();
        Ok(Response::new(status.to_string()))
    })
}

#[tokio::test]
async fn inserts_the_lease_and_releases_a_whole_body_before_the_head() {
    let backend = MemoryBackend::new();
    let svc =
        RedisLockLayer::new(backend.clone(), (RequestMethod, Route)).layer_service(echo_status());
    let res = svc
        .oneshot(Request::post("/a").body(Full::default()).unwrap())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    // The body is already whole in memory: the release ran before the
    // head was handed out (streamed bodies release at their end, see
    // lock/body/tests.rs).
    assert!(backend.is_empty(), "released before the head");
    let body = http_body_util::BodyExt::collect(res.into_body())
        .await
        .unwrap()
        .to_bytes();
    assert_eq!(body, Bytes::from("Locked"));
}

#[tokio::test]
async fn held_key_gets_409_without_calling_inner() {
    let backend = MemoryBackend::new();
    let layer = RedisLockLayer::new(backend.clone(), (RequestMethod, Route));
    // Take the key the layer will derive for POST /a, as another request would.
    let (parts, ()) = Request::post("/a").body(()).unwrap().into_parts();
    let mut w = layer.config.settings.key_space.writer();
    layer.config.settings.key.write(&parts, &mut w).unwrap();
    let storage = layer.config.settings.key_space.storage_key(&w.finish());
    backend.try_acquire(&storage, &Token::generate(), Duration::from_secs(3));

    let inner = service_fn(|_: Request<Full<Bytes>>| async {
        panic!("the inner service must not run for a duplicate");
        #[allow(unreachable_code)]
        Ok::<_, Infallible>(Response::new(String::new()))
    });
    let res = layer
        .layer_service(inner)
        .oneshot(Request::post("/a").body(Full::default()).unwrap())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::CONFLICT);
    assert_eq!(res.headers()["retry-after"], "3");
}

#[tokio::test]
async fn closure_key_part_missing_skips_when_configured() {
    let part = |_: &http::request::Parts, _: &mut KeyWriter| {
        Err(crate::key::MissingPart::bad_request("tenant", "no tenant"))
    };
    fn is_part(_: &impl KeyPart) {}
    is_part(&part);
    let layer = RedisLockLayer::new(MemoryBackend::new(), part);
    let res = layer
        .clone()
        .layer_service(echo_status())
        .oneshot(Request::post("/a").body(Full::default()).unwrap())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    let body = body_of(layer.skip_missing_part().layer_service(echo_status())).await;
    assert_eq!(body, "Skipped");
}

#[tokio::test]
async fn a_repeated_header_is_refused_even_when_missing_parts_are_skipped() {
    // A client that adds a second identity line (a gateway that appends)
    // must not choose to run unlocked.
    let layer = RedisLockLayer::new(
        MemoryBackend::new(),
        (Route, Header::trusted_identity("x-user-id")),
    )
    .skip_missing_part();
    let svc = layer.layer_service(echo_status());
    let repeated = Request::post("/a")
        .header("x-user-id", "victim")
        .header("x-user-id", "me")
        .body(Full::default())
        .unwrap();
    let res = svc.clone().oneshot(repeated).await.unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    // Absent: skipped, as configured.
    assert_eq!(body_of(svc).await, "Skipped");
}

#[tokio::test]
#[should_panic(expected = "polled after it completed")]
async fn polling_a_finished_future_panics_with_a_message() {
    use tower_service::Service as _;
    let layer = RedisLockLayer::new(MemoryBackend::new(), (RequestMethod, Route));
    let mut svc = layer.layer_service(echo_status());
    let mut fut = std::pin::pin!(svc.call(Request::post("/a").body(Full::default()).unwrap()));
    let res = fut.as_mut().await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let _ = fut.as_mut().await;
}

#[tokio::test]
async fn on_rejection_takes_any_into_response() {
    let backend = MemoryBackend::new();
    let layer = RedisLockLayer::new(backend.clone(), (RequestMethod, Route))
        .on_rejection(|r| (r.status(), format!("busy: {}", r.kind())));
    let (parts, ()) = Request::post("/a").body(()).unwrap().into_parts();
    let mut w = layer.config.settings.key_space.writer();
    layer.config.settings.key.write(&parts, &mut w).unwrap();
    let storage = layer.config.settings.key_space.storage_key(&w.finish());
    backend.try_acquire(&storage, &Token::generate(), Duration::from_secs(3));
    let res = layer
        .layer_service(echo_status())
        .oneshot(Request::post("/a").body(Full::default()).unwrap())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::CONFLICT);
    let body = http_body_util::BodyExt::collect(res.into_body())
        .await
        .unwrap()
        .to_bytes();
    assert_eq!(body, Bytes::from("busy: conflict"));
}

/// An inner service that counts its clones and its calls.
#[derive(Default)]
struct Counted {
    clones: Arc<AtomicUsize>,
    calls: Arc<AtomicUsize>,
}

impl Clone for Counted {
    fn clone(&self) -> Self {
        self.clones.fetch_add(1, Ordering::SeqCst);
        Self {
            clones: self.clones.clone(),
            calls: self.calls.clone(),
        }
    }
}

impl tower::Service<Request<Full<Bytes>>> for Counted {
    type Response = Response<String>;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Response<String>, Infallible>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<Full<Bytes>>) -> Self::Future {
        self.calls.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Ok(Response::new("ok".to_owned())))
    }
}

#[tokio::test]
async fn the_ready_service_is_called_in_place_when_the_backend_answers_in_the_call() {
    use tower_service::Service as _;
    // MemoryBackend answers in the call, also behind `dyn LockBackend`
    // (through the trait): the ready service is called at once, no clone.
    // A store whose acquire is a future: the ready service goes into it and
    // a clone stays (clone-and-swap).
    for (layer, clones_per_call) in [
        (
            RedisLockLayer::new(MemoryBackend::new(), (RequestMethod, Route)),
            0,
        ),
        (
            RedisLockLayer::new(
                Arc::new(MemoryBackend::new()) as Arc<dyn crate::backend::LockBackend>,
                (RequestMethod, Route),
            ),
            0,
        ),
        (
            RedisLockLayer::new(
                crate::lock::testing::Deferred(MemoryBackend::new()),
                (RequestMethod, Route),
            ),
            1,
        ),
    ] {
        let inner = Counted::default();
        let (clones, calls) = (inner.clones.clone(), inner.calls.clone());
        let mut svc = layer.layer_service(inner);
        for n in 1..=3 {
            std::future::poll_fn(|cx| svc.poll_ready(cx)).await.unwrap();
            let path = format!("/a{n}");
            let res = svc
                .call(Request::post(path).body(Full::default()).unwrap())
                .await
                .unwrap();
            assert_eq!(res.status(), StatusCode::OK);
            assert_eq!(calls.load(Ordering::SeqCst), n);
            assert_eq!(clones.load(Ordering::SeqCst), n * clones_per_call);
        }
    }
}

impl<const STREAM: bool> RedisLockLayer<STREAM> {
    fn layer_service<S>(&self, inner: S) -> super::RedisLock<S, STREAM> {
        tower_layer::Layer::layer(self, inner)
    }
}

/// `Duration::MAX` as "as long as it takes" is a value a user writes: every
/// duration setter keeps it without a panic (each is added to an `Instant`
/// on the way, which overflows at that size).
#[tokio::test]
async fn the_longest_durations_are_taken_without_a_panic() {
    let backend = MemoryBackend::new();
    let layer = RedisLockLayer::new(backend.clone(), (RequestMethod, Route))
        .ttl(Duration::MAX)
        .deadline(Duration::MAX)
        .body_timeout(Duration::MAX)
        .retry_after_cap(Duration::MAX)
        .wait(Duration::MAX)
        .renew(
            crate::lock::Renewal::new()
                .every(Duration::MAX)
                .max_total(Duration::MAX),
        );
    let svc = layer.clone().layer_service(echo_status());
    let res = svc
        .clone()
        .oneshot(Request::post("/a").body(Full::default()).unwrap())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);

    // A duplicate of a held key waits (for ever, as asked): still waiting
    // after 50 ms, not a panic and not an answer.
    let (parts, ()) = Request::post("/a").body(()).unwrap().into_parts();
    let mut w = layer.config.settings.key_space.writer();
    layer.config.settings.key.write(&parts, &mut w).unwrap();
    let storage = layer.config.settings.key_space.storage_key(&w.finish());
    backend.try_acquire(&storage, &Token::generate(), Duration::from_secs(3));
    let waiting = tokio::time::timeout(
        Duration::from_millis(50),
        svc.oneshot(Request::post("/a").body(Full::default()).unwrap()),
    )
    .await;
    assert!(waiting.is_err(), "the duplicate waits for the held key");
}

/// A debounce layer keeps the lease for its whole TTL: a repeat is told
/// the time the lease has left, not a guess at when its holder finishes
/// (the holder finished already).
#[tokio::test(start_paused = true)]
async fn a_debounced_repeat_is_told_the_time_the_lease_has_left() {
    let svc = RedisLockLayer::new(MemoryBackend::new(), (RequestMethod, Route))
        .ttl(Duration::from_secs(30))
        .hold_until_ttl()
        .layer_service(echo_status());
    let first = svc
        .clone()
        .oneshot(Request::post("/a").body(Full::default()).unwrap())
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    tokio::time::advance(Duration::from_secs(2)).await;
    let repeat = svc
        .oneshot(Request::post("/a").body(Full::default()).unwrap())
        .await
        .unwrap();
    assert_eq!(repeat.status(), StatusCode::CONFLICT);
    assert_eq!(repeat.headers()["retry-after"], "28");
}

/// What `svc` answers to `POST /a`, as text.
async fn body_of<S, B>(svc: S) -> String
where
    S: tower::Service<Request<Full<Bytes>>, Response = Response<B>>,
    S::Error: std::fmt::Debug,
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let res = svc
        .oneshot(Request::post("/a").body(Full::default()).unwrap())
        .await
        .unwrap();
    let body = http_body_util::BodyExt::collect(res.into_body())
        .await
        .unwrap()
        .to_bytes();
    String::from_utf8(body.to_vec()).unwrap()
}

/// A renewal that is sent before the lease's expiry and not answered by it
/// loses the lease at the expiry, not at the renewal's deadline: by then
/// another request may hold the key.
#[tokio::test(start_paused = true)]
async fn a_renewal_stalled_past_the_expiry_loses_the_lease_at_the_expiry() {
    let backend = crate::lock::testing::StallsRenewals {
        memory: MemoryBackend::new(),
        answered: 1,
        calls: Arc::default(),
    };
    let layer = RedisLockLayer::new(backend, (RequestMethod, Route))
        .ttl(Duration::from_secs(1))
        .deadline(Duration::from_secs(10))
        .renew(crate::lock::Renewal::new().every(Duration::from_millis(400)));
    let svc = service_fn(|req: Request<Full<Bytes>>| async move {
        let lease = req.extensions().get::<Lease>().cloned().unwrap();
        let began = tokio::time::Instant::now();
        lease.lost().await;
        Ok::<_, Infallible>(Response::new(format!("{}", began.elapsed().as_millis())))
    });
    let body = body_of(layer.layer_service(svc)).await;
    let lost_after: u64 = body.parse().unwrap();
    // Renewed at 400 ms (valid until 1,400 ms); the renewal at 800 ms
    // never answers.
    assert!(
        lost_after <= 1_400,
        "lost {lost_after} ms after the start, past the expiry at 1,400 ms"
    );
}

/// Over Redlock a renewed lease keeps back the clock-drift allowance, as
/// its first lease did: the watchdog and `Lease::remaining` count the TTL
/// minus it from the renewal, not the whole TTL.
#[tokio::test(start_paused = true)]
async fn a_renewed_redlock_lease_keeps_back_the_drift_allowance() {
    let nodes = [
        MemoryBackend::new(),
        MemoryBackend::new(),
        MemoryBackend::new(),
    ];
    let redlock = crate::backend::RedlockBackend::new(nodes).unwrap();
    let ttl = Duration::from_secs(10);
    let drift = crate::backend::RedlockBackend::drift(ttl);
    let layer = RedisLockLayer::new(redlock, (RequestMethod, Route))
        .ttl(ttl)
        .renew(crate::lock::Renewal::new().every(Duration::from_secs(1)));
    let svc = service_fn(|req: Request<Full<Bytes>>| async move {
        let lease = req.extensions().get::<Lease>().cloned().unwrap();
        // Renewed at 1 s; looked at 500 ms later (paused time).
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        Ok::<_, Infallible>(Response::new(format!(
            "{} {}",
            lease.renewals(),
            lease.remaining().as_millis()
        )))
    });
    let body = body_of(layer.layer_service(svc)).await;
    let (renewals, remaining) = body.split_once(' ').unwrap();
    assert_eq!(renewals, "1", "{body}");
    let remaining: u128 = remaining.parse().unwrap();
    let most = (ttl - drift - Duration::from_millis(500)).as_millis();
    assert!(
        remaining <= most,
        "{remaining} ms left 500 ms after a renewal: more than the TTL minus the drift ({most} ms)"
    );
}

/// A digest asked for and then a streamed body: refused at start-up (the
/// streamed layer ignored the digest, and every body keyed alike, before).
#[test]
#[should_panic(expected = "`stream_body()` after `digest_body()`")]
fn a_digest_of_a_streamed_body_is_refused_at_start_up() {
    let _ = RedisLockLayer::new(MemoryBackend::new(), Route)
        .digest_body()
        .stream_body();
}

/// `Locker::key_for` answers a missing identity with its part's own 401
/// and counts nothing, also for a layer that skips locking then (a
/// generic 400 and one `skipped` counted, before).
#[test]
fn key_for_a_missing_identity_is_its_401_and_counts_nothing() {
    let layer = RedisLockLayer::new(MemoryBackend::new(), Header::trusted_identity("x-user-id"))
        .skip_missing_part();
    let (parts, ()) = Request::new(()).into_parts();
    let got = layer.locker().key_for(&parts);
    assert!(matches!(&got, Err(r) if r.status() == 401), "{got:?}");
    assert_eq!(layer.stats().skipped, 0);
}

/// With `fire_and_forget()`, an empty answer (a 204, gRPC's trailers-only
/// `Status`) still reads as ended before it is polled, so an HTTP/2 server
/// sends its head with END_STREAM (it read as not ended, and hyper sent
/// the head alone, `content-length: 0` even on a 204, then an empty DATA
/// frame: a trailers-only gRPC reply lost its trailers). The lease is
/// released all the same.
#[tokio::test]
async fn an_empty_answer_reads_as_ended_when_the_release_is_fire_and_forget() {
    let backend = MemoryBackend::new();
    let empty = service_fn(|_: Request<Full<Bytes>>| async move {
        let mut res = Response::new(Full::<Bytes>::default());
        *res.status_mut() = StatusCode::NO_CONTENT;
        Ok::<_, Infallible>(res)
    });
    let svc = RedisLockLayer::new(backend.clone(), (RequestMethod, Route))
        .fire_and_forget()
        .layer_service(empty);
    let res = svc
        .oneshot(Request::post("/a").body(Full::default()).unwrap())
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::NO_CONTENT);
    assert!(
        http_body::Body::is_end_stream(res.body()),
        "ended before polled"
    );
    drop(res);
    assert!(
        tower_redis_lock_test_support::eventually(Duration::from_secs(2), || backend.is_empty())
            .await,
        "released"
    );
}

/// A layer over memory that waits (30 s) for `POST /a`, whose key another
/// request holds for a minute.
fn waiting_behind_a_holder() -> RedisLockLayer {
    let backend = MemoryBackend::new();
    let layer =
        RedisLockLayer::new(backend.clone(), (RequestMethod, Route)).wait(Duration::from_secs(30));
    let (parts, ()) = Request::post("/a").body(()).unwrap().into_parts();
    let mut w = layer.config.settings.key_space.writer();
    layer.config.settings.key.write(&parts, &mut w).unwrap();
    let storage = layer.config.settings.key_space.storage_key(&w.finish());
    backend.try_acquire(&storage, &Token::generate(), Duration::from_secs(60));
    layer
}

/// Frees a flag when dropped: stands for the read buffer a server handed a
/// body out of (hyper hands a one-chunk body out as a slice of its
/// connection's read buffer, which the slice keeps whole).
struct ReadBuffer(Arc<std::sync::atomic::AtomicBool>, Vec<u8>);

impl AsRef<[u8]> for ReadBuffer {
    fn as_ref(&self) -> &[u8] {
        &self.1
    }
}

impl Drop for ReadBuffer {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// A waiter is counted against `max_waiting_bytes` for the bytes it
/// holds: a one-byte body sliced out of a large buffer must not keep that
/// buffer while it waits (it would be counted 1 and hold the whole buffer).
#[tokio::test]
async fn a_waiter_does_not_keep_the_buffer_its_body_came_in() {
    let layer = waiting_behind_a_holder();

    let freed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let buffer = Bytes::from_owner(ReadBuffer(freed.clone(), vec![b'x'; 64 * 1024]));
    let body = buffer.slice(..1);
    drop(buffer);
    let svc = layer.clone().layer_service(echo_status());
    let waiter = tokio::spawn(svc.oneshot(Request::post("/a").body(Full::new(body)).unwrap()));
    for _ in 0..1000 {
        if layer.stats().waited == 1 {
            break;
        }
        tokio::task::yield_now().await;
    }
    assert_eq!(layer.stats().waited, 1, "the request waits");
    assert!(
        freed.load(Ordering::SeqCst),
        "the waiter keeps the 64 KiB buffer its 1-byte body came in"
    );
    waiter.abort();
}

/// A lease the renewal watchdog found lost is counted once: its release,
/// which then finds the key gone, does not count it again.
#[tokio::test(start_paused = true)]
async fn a_lease_found_lost_by_its_watchdog_is_counted_once() {
    let layer = RedisLockLayer::new(MemoryBackend::new(), (RequestMethod, Route))
        .ttl(Duration::from_secs(1))
        .renew(crate::lock::Renewal::new().max_renewals(0));
    let svc = service_fn(|req: Request<Full<Bytes>>| async move {
        let lease = req.extensions().get::<Lease>().cloned().unwrap();
        lease.lost().await;
        Ok::<_, Infallible>(Response::new(String::from("lost")))
    });
    assert_eq!(body_of(layer.layer_service(svc)).await, "lost");
    let stats = layer.stats();
    assert_eq!((stats.lease_lost, stats.released), (1, 0), "{stats:?}");
}

/// A waiter whose request is dropped (its client gone, an outer timeout)
/// adds its time to the wait statistics, as one that was answered does:
/// `mean_wait` divides by every waiter counted in `waited`.
#[tokio::test(start_paused = true)]
async fn a_waiter_that_goes_away_counts_its_wait() {
    let layer = waiting_behind_a_holder();

    let svc = layer.clone().layer_service(echo_status());
    let waiter = tokio::spawn(svc.oneshot(Request::post("/a").body(Full::default()).unwrap()));
    while layer.stats().waited == 0 {
        tokio::task::yield_now().await;
    }
    tokio::time::advance(Duration::from_millis(500)).await;
    waiter.abort();
    let _ = waiter.await;
    let mean = layer.stats().mean_wait().expect("a wait was counted");
    assert!(mean >= Duration::from_millis(500), "{mean:?}");
}
