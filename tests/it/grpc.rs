//! Both layers in front of a tonic service, driven by a tonic client over
//! real HTTP/2: the `examples/grpc.rs` service (`payments.v1.Payments`),
//! served in-process on a loopback port, on memory and on a
//! `redis-server` of the test's own. Codes are asserted as `tonic::Code`,
//! the retry delay as metadata and as `google.rpc.RetryInfo`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tonic::codec::CompressionEncoding;
use tonic::{Code, Request, Status};
use tower_redis_lock::{IdempotencyLayer, MemoryBackend, RedisBackend, RedisLockLayer};

use crate::common::RedisServer;

#[path = "../../examples/grpc_payments/mod.rs"]
mod payments;

use payments::{CreatePaymentRequest, Demo, Payments, PaymentsClient, StatsRequest};

/// Serve `service` behind `layer` on a free loopback port; the address.
async fn start<L, T, ResBody>(layer: L, service: T) -> String
where
    T: Payments,
    L: tower::Layer<tonic::service::Routes> + Clone + Send + 'static,
    L::Service: tower::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<ResBody>,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + 'static,
    <L::Service as tower::Service<http::Request<tonic::body::Body>>>::Future: Send + 'static,
    ResBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    ResBody::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(payments::serve(
        listener,
        layer,
        service,
        std::future::pending(),
    ));
    addr
}

/// The example's layer (memory store) with `join`, served with the demo.
async fn demo(join: Duration) -> (String, Demo) {
    let layer = IdempotencyLayer::new(MemoryBackend::new(), payments::key())
        .skip_when(payments::not_create)
        .join_timeout(join);
    let service = Demo::default();
    let addr = start(payments::for_tonic(layer), service.clone()).await;
    (addr, service)
}

async fn client(addr: &str) -> PaymentsClient {
    PaymentsClient::connect(addr).await.expect("connect")
}

/// `Create` with the given metadata (`None`: left out).
fn create(
    amount: i64,
    delay_ms: u64,
    user: Option<&str>,
    key: Option<&str>,
) -> Request<CreatePaymentRequest> {
    let mut req = Request::new(CreatePaymentRequest {
        amount,
        currency: "EUR".into(),
        delay_ms,
    });
    if let Some(user) = user {
        req.metadata_mut()
            .insert("x-user-id", user.parse().unwrap());
    }
    if let Some(key) = key {
        req.metadata_mut()
            .insert("idempotency-key", key.parse().unwrap());
    }
    req
}

fn pay(amount: i64, delay_ms: u64, key: &str) -> Request<CreatePaymentRequest> {
    create(amount, delay_ms, Some("alice"), Some(key))
}

fn replayed(metadata: &tonic::metadata::MetadataMap) -> bool {
    metadata
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

async fn executions(addr: &str) -> u64 {
    client(addr)
        .await
        .stats(StatsRequest {})
        .await
        .unwrap()
        .into_inner()
        .executions
}

/// `google.rpc.Status` and `RetryInfo`, as a client decodes
/// `grpc-status-details-bin`.
mod pb {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Status {
        #[prost(int32, tag = "1")]
        pub code: i32,
        #[prost(string, tag = "2")]
        pub message: String,
        #[prost(message, repeated, tag = "3")]
        pub details: Vec<Any>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Any {
        #[prost(string, tag = "1")]
        pub type_url: String,
        #[prost(bytes = "vec", tag = "2")]
        pub value: Vec<u8>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct RetryInfo {
        #[prost(message, optional, tag = "1")]
        pub retry_delay: Option<Duration>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Duration {
        #[prost(int64, tag = "1")]
        pub seconds: i64,
        #[prost(int32, tag = "2")]
        pub nanos: i32,
    }
}

/// The retry delay a status carries: `retry-after` (seconds),
/// `grpc-retry-pushback-ms`, and the `RetryInfo` in its details, which
/// must agree.
fn retry_delay(status: &Status) -> Duration {
    use prost::Message;
    let metadata = status.metadata();
    let secs: u64 = metadata
        .get("retry-after")
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let ms: u64 = metadata
        .get("grpc-retry-pushback-ms")
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let details = pb::Status::decode(status.details()).expect("google.rpc.Status details");
    assert_eq!(details.code, status.code() as i32);
    let any = &details.details[0];
    assert_eq!(any.type_url, "type.googleapis.com/google.rpc.RetryInfo");
    let info = pb::RetryInfo::decode(any.value.as_slice()).unwrap();
    let delay = info.retry_delay.expect("a retry delay");
    let delay = Duration::new(delay.seconds as u64, delay.nanos as u32);
    assert_eq!(
        ms,
        delay.as_millis() as u64 + u64::from(!delay.subsec_nanos().is_multiple_of(1_000_000))
    );
    assert_eq!(
        secs,
        (delay.as_secs() + u64::from(delay.subsec_nanos() > 0)).max(1)
    );
    delay
}

/// A retry gets the first answer, marked replayed, and the handler ran
/// once; on `store`.
async fn retry_is_replayed(layer: IdempotencyLayer) {
    let service = Demo::default();
    let addr = start(payments::for_tonic(layer), service.clone()).await;
    let mut c = client(&addr).await;
    let first = c.create(pay(500, 0, "k-replay")).await.unwrap();
    assert!(!replayed(first.metadata()));
    let retry = c.create(pay(500, 0, "k-replay")).await.unwrap();
    assert!(replayed(retry.metadata()), "{:?}", retry.metadata());
    assert_eq!(retry.get_ref(), first.get_ref());
    assert!(first.get_ref().id.starts_with("pay_"));
    assert_eq!(executions(&addr).await, 1);
    // Another key is another payment.
    let other = c.create(pay(500, 0, "k-other")).await.unwrap();
    assert_ne!(other.get_ref().id, first.get_ref().id);
    assert_eq!(service.executions(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_retry_gets_the_first_answer_marked_replayed() {
    let layer = IdempotencyLayer::new(MemoryBackend::new(), payments::key());
    retry_is_replayed(layer.skip_when(payments::not_create)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_retry_gets_the_first_answer_marked_replayed() {
    let server = RedisServer::start();
    let redis = RedisBackend::connect(&server.url()).await.unwrap();
    retry_is_replayed(
        IdempotencyLayer::new(redis, payments::key()).skip_when(payments::not_create),
    )
    .await;
}

/// The example's setting (join up to 5 s): a duplicate in flight waits
/// and gets the first answer, replayed; one execution.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_in_flight_is_joined() {
    let (addr, service) = demo(Duration::from_secs(5)).await;
    let (mut a, mut b) = (client(&addr).await, client(&addr).await);
    let first = tokio::spawn(async move { a.create(pay(700, 400, "k-join")).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let second = b.create(pay(700, 400, "k-join")).await.unwrap();
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.get_ref(), second.get_ref());
    assert!(replayed(second.metadata()));
    assert_eq!(service.executions(), 1);
}

/// Without a join, a duplicate in flight is `ABORTED` with the retry
/// delay; once the first finished, the retry gets its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_in_flight_without_join_is_aborted_with_a_retry_delay() {
    let (addr, service) = demo(Duration::ZERO).await;
    let (mut a, mut b) = (client(&addr).await, client(&addr).await);
    let first = tokio::spawn(async move { a.create(pay(700, 600, "k-held")).await });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let held = b.create(pay(700, 600, "k-held")).await.unwrap_err();
    assert_eq!(held.code(), Code::Aborted, "{held:?}");
    assert!(held.message().contains("still being processed"), "{held:?}");
    let delay = retry_delay(&held);
    assert!(
        delay > Duration::ZERO && delay <= Duration::from_secs(30),
        "{delay:?}"
    );
    let first = first.await.unwrap().unwrap();
    let retry = b.create(pay(700, 600, "k-held")).await.unwrap();
    assert_eq!(retry.get_ref(), first.get_ref());
    assert!(replayed(retry.metadata()));
    assert_eq!(service.executions(), 1);
}

/// Same key, another message: `FAILED_PRECONDITION`, nothing ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_message_under_the_same_key_is_failed_precondition() {
    let (addr, service) = demo(Duration::from_secs(5)).await;
    let mut c = client(&addr).await;
    c.create(pay(100, 0, "k-reuse")).await.unwrap();
    let reused = c.create(pay(101, 0, "k-reuse")).await.unwrap_err();
    assert_eq!(reused.code(), Code::FailedPrecondition, "{reused:?}");
    assert!(reused.message().contains("new key"), "{reused:?}");
    assert!(reused.metadata().get("retry-after").is_none());
    // Another user's equal key is another scope.
    let bob = c
        .create(create(101, 0, Some("bob"), Some("k-reuse")))
        .await
        .unwrap();
    assert!(!replayed(bob.metadata()));
    assert_eq!(service.executions(), 2);
}

/// No `idempotency-key`: `INVALID_ARGUMENT`; a malformed one too; no
/// identity: `UNAUTHENTICATED`. Nothing ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_key_or_identity() {
    let (addr, service) = demo(Duration::ZERO).await;
    let mut c = client(&addr).await;
    let no_key = c
        .create(create(1, 0, Some("alice"), None))
        .await
        .unwrap_err();
    assert_eq!(no_key.code(), Code::InvalidArgument, "{no_key:?}");
    assert!(no_key.message().contains("Idempotency-Key"), "{no_key:?}");
    let bad_key = c
        .create(create(1, 0, Some("alice"), Some("\"open")))
        .await
        .unwrap_err();
    assert_eq!(bad_key.code(), Code::InvalidArgument, "{bad_key:?}");
    let no_user = c.create(create(1, 0, None, Some("k"))).await.unwrap_err();
    assert_eq!(no_user.code(), Code::Unauthenticated, "{no_user:?}");
    assert_eq!(service.executions(), 0);
}

/// Redis down: `UNAVAILABLE` with the retry delay, nothing ran; Redis
/// back: the same call runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_is_unavailable() {
    let mut server = RedisServer::start();
    let redis = RedisBackend::connect(&server.url()).await.unwrap();
    let layer = IdempotencyLayer::new(redis, payments::key());
    let service = Demo::default();
    let addr = start(payments::for_tonic(layer), service.clone()).await;
    let mut c = client(&addr).await;
    c.create(pay(5, 0, "k-up")).await.unwrap();
    server.kill();
    let down = c.create(pay(5, 0, "k-down")).await.unwrap_err();
    assert_eq!(down.code(), Code::Unavailable, "{down:?}");
    assert_eq!(retry_delay(&down), Duration::from_secs(1));
    assert_eq!(service.executions(), 1);
}

/// A gzip-compressed call (a real tonic client compressing) is refused
/// with `UNIMPLEMENTED` and `grpc-accept-encoding: identity`, before the
/// handler and without using up the key: the same call uncompressed runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gzip_request_is_unimplemented_and_leaves_the_key_free() {
    let (addr, service) = demo(Duration::ZERO).await;
    let mut gzip = client(&addr)
        .await
        .send_compressed(CompressionEncoding::Gzip);
    let refused = gzip.create(pay(9, 0, "k-gzip")).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unimplemented, "{refused:?}");
    assert!(refused.message().contains("`gzip`"), "{refused:?}");
    assert_eq!(
        refused.metadata().get("grpc-accept-encoding").unwrap(),
        "identity"
    );
    assert_eq!(service.executions(), 0);
    let plain = client(&addr)
        .await
        .create(pay(9, 0, "k-gzip"))
        .await
        .unwrap();
    assert!(!replayed(plain.metadata()));
    assert_eq!(service.executions(), 1);
}

/// A handler that answers with a status, counting its calls.
#[derive(Clone)]
struct Failing {
    code: Code,
    calls: Arc<AtomicU64>,
}

impl Payments for Failing {
    fn create(
        &self,
        _: Request<CreatePaymentRequest>,
    ) -> std::pin::Pin<
        Box<
            dyn std::future::Future<Output = Result<tonic::Response<payments::Payment>, Status>>
                + Send,
        >,
    > {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let code = self.code;
        Box::pin(async move { Err(Status::new(code, "the card network is down")) })
    }

    fn stats(
        &self,
        _: Request<StatsRequest>,
    ) -> std::pin::Pin<
        Box<
            dyn std::future::Future<Output = Result<tonic::Response<payments::StatsReply>, Status>>
                + Send,
        >,
    > {
        Box::pin(async { Err(Status::unimplemented("no stats")) })
    }
}

/// The gRPC status decides what is stored, as its HTTP equivalent asks
/// `store_when`: by default a handler's `UNAVAILABLE` is recorded as a 503
/// is (the retry gets it, marked replayed, and the handler does not run
/// again); a route that stores no 5xx frees the key, and the retry runs.
/// `ABORTED` (409) is never stored by default.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grpc_status_decides_what_is_stored() {
    let cases: [(Code, bool, u64); 4] = [
        (Code::Unavailable, false, 1),
        (Code::Unavailable, true, 2),
        (Code::DeadlineExceeded, true, 2),
        (Code::Aborted, false, 2),
    ];
    for (code, no_5xx, runs) in cases {
        let mut layer = IdempotencyLayer::new(MemoryBackend::new(), payments::key());
        if no_5xx {
            layer = layer.store_when(|s| !s.is_server_error());
        }
        let calls = Arc::new(AtomicU64::new(0));
        let service = Failing {
            code,
            calls: calls.clone(),
        };
        let addr = start(payments::for_tonic(layer), service).await;
        let mut c = client(&addr).await;
        let first = c.create(pay(1, 0, "k-status")).await.unwrap_err();
        assert_eq!(first.code(), code);
        let retry = c.create(pay(1, 0, "k-status")).await.unwrap_err();
        assert_eq!(retry.code(), code, "{retry:?}");
        assert_eq!(retry.message(), "the card network is down");
        assert_eq!(
            calls.load(Ordering::SeqCst),
            runs,
            "{code:?}, no 5xx: {no_5xx}"
        );
        assert_eq!(replayed(retry.metadata()), runs == 1, "{retry:?}");
    }
}

/// A deterministic error of the handler (`INVALID_ARGUMENT`, 400) is
/// stored and replayed like a success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deterministic_error_is_replayed() {
    let (addr, service) = demo(Duration::ZERO).await;
    let mut c = client(&addr).await;
    let first = c.create(pay(0, 0, "k-zero")).await.unwrap_err();
    assert_eq!(first.code(), Code::InvalidArgument);
    let retry = c.create(pay(0, 0, "k-zero")).await.unwrap_err();
    assert_eq!(retry.code(), Code::InvalidArgument);
    assert_eq!(retry.message(), "amount must be positive");
    assert!(replayed(retry.metadata()));
    assert_eq!(service.executions(), 0);
}

/// The lock layer in front of the same service, keyed on the message
/// digest: a concurrent duplicate is `ABORTED` with the retry delay; a
/// different message is not a duplicate; after the first, it runs again
/// (a lock, not a record).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_layer_answers_a_held_key_aborted() {
    let lock = RedisLockLayer::new(MemoryBackend::new(), payments::key()).digest_body();
    let service = Demo::default();
    let addr = start(payments::for_tonic(lock), service.clone()).await;
    let (mut a, mut b) = (client(&addr).await, client(&addr).await);
    let first = tokio::spawn(async move { a.create(pay(3, 500, "k")).await });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let held = b.create(pay(3, 500, "k")).await.unwrap_err();
    assert_eq!(held.code(), Code::Aborted, "{held:?}");
    assert!(held.message().contains("identical request"), "{held:?}");
    retry_delay(&held);
    b.create(pay(4, 0, "k"))
        .await
        .expect("another message runs");
    first.await.unwrap().unwrap();
    b.create(pay(3, 500, "k"))
        .await
        .expect("the lock was released");
    assert_eq!(service.executions(), 3);
}

/// The example binary as other clients drive it: `$ADDR`, `REDIS_URL`, the
/// start-up line, `Create` with `x-user-id` and `idempotency-key` metadata
/// replayed, `Stats` without either, and a graceful exit on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_binary_serves_payments_v1_on_redis() {
    use std::io::BufRead;
    let binary = crate::common::examples::example_binary("grpc");
    let server = RedisServer::start();
    let mut child = std::process::Command::new(binary)
        .env("ADDR", "127.0.0.1:0")
        .env("REDIS_URL", server.url())
        .env_remove("REDLOCK_URLS")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the grpc example");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.contains("with the redis"), "{line}");
    let addr = line
        .split_whitespace()
        .nth(3)
        .expect("grpc listening on ADDR ...")
        .to_owned();
    let mut c = client(&addr).await;
    let first = c.create(pay(42, 0, "k-example")).await.unwrap();
    let retry = c.create(pay(42, 0, "k-example")).await.unwrap();
    assert_eq!(first.get_ref(), retry.get_ref());
    assert!(replayed(retry.metadata()));
    assert_eq!(executions(&addr).await, 1);
    let stopped = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(stopped.success());
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status:?}");
}

/// Two instances on one Redis: a duplicate in flight on the other instance
/// waits for the first call's record (published through Redis, trailers
/// and all) and gets its answer, replayed; one execution in all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_duplicate_on_another_instance_is_joined() {
    let server = RedisServer::start();
    let space =
        tower_redis_lock::key::KeySpace::new("grpc").secret(b"a test secret of 32 bytes, at least");
    let mut addrs = Vec::new();
    let mut services = Vec::new();
    for _ in 0..2 {
        let redis = RedisBackend::connect(&server.url()).await.unwrap();
        let layer = IdempotencyLayer::new(redis, payments::key())
            .key_space(space.clone())
            .skip_when(payments::not_create)
            .join_timeout(Duration::from_secs(5));
        let service = Demo::default();
        addrs.push(start(payments::for_tonic(layer), service.clone()).await);
        services.push(service);
    }
    let (mut a, mut b) = (client(&addrs[0]).await, client(&addrs[1]).await);
    let first = tokio::spawn(async move { a.create(pay(8, 500, "k-fleet")).await });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let second = b.create(pay(8, 500, "k-fleet")).await.unwrap();
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.get_ref(), second.get_ref());
    assert!(replayed(second.metadata()));
    assert_eq!(services[0].executions() + services[1].executions(), 1);
}
