//! `payments.v1.Payments` for `examples/grpc.rs` and its tests
//! (`tests/it/grpc.rs`): the messages, the tonic server and client glue
//! written by hand (what `tonic-build` would generate from the proto below,
//! so the build needs no `protoc`), the demo service, and how it is served
//! behind a layer of this crate.
//!
//! ```proto
//! syntax = "proto3";
//! package payments.v1;
//!
//! service Payments {
//!   rpc Create(CreatePaymentRequest) returns (Payment);
//!   rpc Stats(StatsRequest) returns (StatsReply);
//! }
//! message CreatePaymentRequest { int64 amount = 1; string currency = 2; uint64 delay_ms = 3; }
//! message Payment { string id = 1; int64 amount = 2; string currency = 3; }
//! message StatsRequest {}
//! message StatsReply { uint64 executions = 1; }
//! ```
#![allow(dead_code)]

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tonic::{Request, Response, Status};

/// `payments.v1.CreatePaymentRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CreatePaymentRequest {
    #[prost(int64, tag = "1")]
    pub amount: i64,
    #[prost(string, tag = "2")]
    pub currency: String,
    /// How long the handler waits before it answers.
    #[prost(uint64, tag = "3")]
    pub delay_ms: u64,
}

/// `payments.v1.Payment`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Payment {
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(int64, tag = "2")]
    pub amount: i64,
    #[prost(string, tag = "3")]
    pub currency: String,
}

/// `payments.v1.StatsRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StatsRequest {}

/// `payments.v1.StatsReply`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StatsReply {
    /// How many payments the handler created in this process.
    #[prost(uint64, tag = "1")]
    pub executions: u64,
}

/// The service's full name.
pub const SERVICE: &str = "payments.v1.Payments";
const CREATE: &str = "/payments.v1.Payments/Create";
const STATS: &str = "/payments.v1.Payments/Stats";

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;
type Reply<T> = Result<Response<T>, Status>;

/// The methods of `payments.v1.Payments`, as a handler implements them.
pub trait Payments: Send + Sync + 'static {
    fn create(&self, request: Request<CreatePaymentRequest>) -> BoxFuture<Reply<Payment>>;
    fn stats(&self, request: Request<StatsRequest>) -> BoxFuture<Reply<StatsReply>>;
}

/// The tonic server of [`Payments`] (what `tonic-build` generates).
pub struct PaymentsServer<T> {
    inner: Arc<T>,
}

impl<T> PaymentsServer<T> {
    pub fn new(inner: T) -> Self {
        Self {
            inner: Arc::new(inner),
        }
    }
}

impl<T> Clone for PaymentsServer<T> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<T> tonic::server::NamedService for PaymentsServer<T> {
    const NAME: &'static str = SERVICE;
}

/// One unary method of `T`, as tonic's server calls it.
struct Method<T, M, R> {
    inner: Arc<T>,
    call: fn(&T, Request<M>) -> BoxFuture<Reply<R>>,
}

impl<T, M, R> tonic::server::UnaryService<M> for Method<T, M, R>
where
    T: Payments,
{
    type Response = R;
    type Future = BoxFuture<Reply<R>>;

    fn call(&mut self, request: Request<M>) -> Self::Future {
        (self.call)(&self.inner, request)
    }
}

impl<T, B> tower::Service<http::Request<B>> for PaymentsServer<T>
where
    T: Payments,
    B: http_body::Body + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let inner = self.inner.clone();
        match req.uri().path() {
            CREATE => Box::pin(async move {
                let method = Method {
                    inner,
                    call: T::create,
                };
                let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::default());
                Ok(grpc.unary(method, req).await)
            }),
            STATS => Box::pin(async move {
                let method = Method {
                    inner,
                    call: T::stats,
                };
                let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::default());
                Ok(grpc.unary(method, req).await)
            }),
            _ => Box::pin(async move { Ok(Status::unimplemented("no such method").into_http()) }),
        }
    }
}

/// The tonic client of `payments.v1.Payments` (what `tonic-build`
/// generates).
#[derive(Clone)]
pub struct PaymentsClient {
    inner: tonic::client::Grpc<tonic::transport::Channel>,
}

impl PaymentsClient {
    /// A client over one HTTP/2 connection to `http://{addr}`.
    pub async fn connect(addr: &str) -> Result<Self, tonic::transport::Error> {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
            .connect()
            .await?;
        Ok(Self {
            inner: tonic::client::Grpc::new(channel),
        })
    }

    /// Compress the request messages with `encoding`.
    pub fn send_compressed(mut self, encoding: tonic::codec::CompressionEncoding) -> Self {
        self.inner = self.inner.send_compressed(encoding);
        self
    }

    pub async fn create(
        &mut self,
        request: impl tonic::IntoRequest<CreatePaymentRequest>,
    ) -> Reply<Payment> {
        self.unary(request.into_request(), CREATE, "Create").await
    }

    pub async fn stats(
        &mut self,
        request: impl tonic::IntoRequest<StatsRequest>,
    ) -> Reply<StatsReply> {
        self.unary(request.into_request(), STATS, "Stats").await
    }

    async fn unary<M, R>(
        &mut self,
        mut request: Request<M>,
        path: &'static str,
        name: &'static str,
    ) -> Reply<R>
    where
        M: prost::Message + Send + Sync + 'static,
        R: prost::Message + Default + Send + Sync + 'static,
    {
        self.inner
            .ready()
            .await
            .map_err(|e| Status::unavailable(format!("service not ready: {e}")))?;
        request
            .extensions_mut()
            .insert(tonic::GrpcMethod::new(SERVICE, name));
        let path = http::uri::PathAndQuery::from_static(path);
        self.inner
            .unary(request, path, tonic_prost::ProstCodec::default())
            .await
    }
}

/// The demo handler: waits `delay_ms` (at most a minute), creates a
/// payment with a fresh id; an amount of 0 or less is `INVALID_ARGUMENT`
/// (a deterministic answer, stored and replayed like a success).
#[derive(Clone, Default)]
pub struct Demo {
    executions: Arc<AtomicU64>,
}

impl Demo {
    /// How many payments it created.
    pub fn executions(&self) -> u64 {
        self.executions.load(Ordering::SeqCst)
    }
}

impl Payments for Demo {
    fn create(&self, request: Request<CreatePaymentRequest>) -> BoxFuture<Reply<Payment>> {
        let executions = self.executions.clone();
        Box::pin(async move {
            let p = request.into_inner();
            if p.amount <= 0 {
                return Err(Status::invalid_argument("amount must be positive"));
            }
            executions.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(p.delay_ms.min(60_000))).await;
            Ok(Response::new(Payment {
                id: payment_id(),
                amount: p.amount,
                currency: p.currency,
            }))
        })
    }

    fn stats(&self, _: Request<StatsRequest>) -> BoxFuture<Reply<StatsReply>> {
        let executions = self.executions();
        Box::pin(async move { Ok(Response::new(StatsReply { executions })) })
    }
}

/// `pay_` and 24 random hex digits.
fn payment_id() -> String {
    let mut bytes = [0u8; 12];
    getrandom::fill(&mut bytes).expect("the OS random source");
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("pay_{hex}")
}

/// The key of a payment: the method's full path (`Route` falls back to the
/// URI path outside axum's router: `/payments.v1.Payments/Create`) and the
/// caller's identity from `x-user-id` metadata (**trusted in this demo
/// only**: take it from your auth layer in production, `key::Identity<T>`).
pub fn key() -> impl tower_redis_lock::key::KeyPart + Clone {
    use tower_redis_lock::key::{Header, Route};
    (Route, Header::trusted_identity("x-user-id"))
}

/// Every method but `Create` (here: `Stats`, read-only) goes to the
/// handler untouched: a tonic server's layers sit in front of all its
/// methods (`IdempotencyLayer::skip_when`).
pub fn not_create(req: &http::request::Parts) -> bool {
    req.uri.path() != CREATE
}

/// What a tonic server needs in front of a layer of this crate: tonic
/// hands its layers `tonic::body::Body`, which cannot be built from the
/// bytes the layer buffers, so the request body becomes an
/// `axum::body::Body` first (tonic's router takes any body).
pub type ToBufferedBody = fn(http::Request<tonic::body::Body>) -> http::Request<axum::body::Body>;

/// `layer` as `tonic::transport::Server::builder().layer(..)` takes it.
pub fn for_tonic<L>(
    layer: L,
) -> tower::ServiceBuilder<
    tower::layer::util::Stack<
        L,
        tower::layer::util::Stack<
            tower::util::MapRequestLayer<ToBufferedBody>,
            tower::layer::util::Identity,
        >,
    >,
> {
    let to_buffered: ToBufferedBody = |req| req.map(axum::body::Body::new);
    tower::ServiceBuilder::new()
        .map_request(to_buffered)
        .layer(layer)
}

/// Serve `service` behind `layer` on `listener` (HTTP/2, no TLS) until
/// `shutdown` resolves, then let the calls in flight finish.
pub async fn serve<L, T, ResBody>(
    listener: tokio::net::TcpListener,
    layer: L,
    service: T,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error>
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
    tonic::transport::Server::builder()
        .layer(layer)
        .add_service(PaymentsServer::new(service))
        .serve_with_incoming_shutdown(
            tonic::transport::server::TcpIncoming::from(listener),
            shutdown,
        )
        .await
}
