//! Hostile input, over real HTTP on loopback through axum: every byte of the
//! request is the attacker's. Each case runs against `MemoryBackend` and a
//! real `redis-server` where the backend matters. Nothing may panic, nothing
//! raw may reach a backend key, and the server must keep serving.

use crate::common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use common::{req, send, serve, Conn, Env, Kind, RedisServer};
use http_body::Frame;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tower_redis_lock::key::{Header, Identity, KeyPart, KeySpace, RequestMethod, Route, UriPath};
use tower_redis_lock::{Lease, MemoryBackend, RedisLockLayer};

// ---- environment -----------------------------------------------------------

/// Layers of these tests use a secret (keyed digests), like production.
impl Env {
    async fn keyed_layer(&self, key: impl KeyPart) -> RedisLockLayer {
        self.layer(key)
            .await
            .key_space(KeySpace::default().secret(b"hostile-test-secret"))
    }

    /// The store holds exactly `expected` (for Redis: read back with SCAN,
    /// every key checked for its fixed shape; for memory: every key the
    /// layers acquired, probed with a fresh token).
    fn assert_stored(&self, expected: &BTreeSet<String>) {
        match self.kind {
            Kind::Memory => {
                let held = self.tracked.held_keys();
                for key in &held {
                    assert_fixed_shape(key);
                }
                assert_eq!(&held, expected, "leases held in memory");
            }
            Kind::Redis => {
                let scanned = self.server.as_ref().unwrap().cli(&["--scan"]);
                let keys: BTreeSet<String> = scanned.lines().map(str::to_owned).collect();
                for key in &keys {
                    assert_fixed_shape(key);
                }
                assert_eq!(&keys, expected, "keys in Redis (SCAN)");
            }
        }
    }
}

/// `trl:{<32 lowercase hex>}`, nothing else: no raw byte of the request, and
/// the Redis Cluster hash tag (the text between the first `{` and the next
/// `}`) is exactly the digest, so no input can steer the slot.
fn assert_fixed_shape(key: &str) {
    assert_eq!(key.len(), 38, "fixed length: {key:?}");
    assert!(key.starts_with("trl:{") && key.ends_with('}'), "{key:?}");
    let open = key.find('{').unwrap();
    let close = open + key[open..].find('}').unwrap();
    let tag = &key[open + 1..close];
    assert_eq!(tag.len(), 32, "hash tag is the digest: {key:?}");
    assert!(
        tag.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
        "hash tag is lowercase hex: {key:?}"
    );
}

/// Ask Redis itself: on a cluster-enabled server, `CLUSTER KEYSLOT` of each
/// stored key equals that of its bare digest, i.e. the slot is the digest's.
/// (A hostile `{slot}` would steer it if it reached the key: checked too.)
fn assert_slots_follow_the_digest(hexes: &BTreeSet<String>) {
    let cluster = RedisServer::start_with(&[
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
    ]);
    let slot = |key: &str| cluster.cli(&["CLUSTER", "KEYSLOT", key]);
    for hex in hexes {
        let stored = slot(&stored_key(hex));
        assert!(stored.parse::<u16>().is_ok(), "CLUSTER KEYSLOT: {stored}");
        assert_eq!(stored, slot(hex), "slot of {hex}");
    }
    assert_eq!(
        slot("trl:{slot}:x"),
        slot("slot"),
        "a raw hash tag would steer"
    );
}

fn stored_key(hex: &str) -> String {
    format!("trl:{{{hex}}}")
}

// ---- a handler that holds its lease until told --------------------------------

/// Counts runs, reports the lease key when it starts, waits for a permit.
type Gate = common::Gate<String>;

async fn gated(State(gate): State<Gate>, lease: Lease, body: Bytes) -> String {
    let hex = lease.key().map(|k| k.to_hex()).unwrap_or_default();
    gate.pass(hex.clone()).await;
    format!("{hex} {}", body.len())
}

async fn recv(rx: &mut mpsc::UnboundedReceiver<String>) -> String {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("handler entered within 10 s")
        .expect("gate open")
}

// ---- auth: identity comes from an extension, never from a client header ------

/// The authenticated user, inserted by [`auth`].
#[derive(Clone, Debug)]
struct UserId(String);

impl std::fmt::Display for UserId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A stand-in auth layer: `Authorization: Bearer <percent-encoded user id>`
/// (`Bearer` alone: an empty id, as a sloppy auth layer might insert).
/// Percent-decoding lets a test put any bytes (CR, LF, NUL, braces) into an
/// identity, as a real token's claims could.
async fn auth(mut req: Request, next: Next) -> Response {
    let token = req
        .headers()
        .get("authorization")
        .and_then(|v| match v.as_bytes() {
            // An empty token (the server trims the space after `Bearer`)
            // is an empty identity, for the layer to refuse.
            b"Bearer" => Some(&b""[..]),
            v => v.strip_prefix(b"Bearer "),
        })
        .map(percent_decode);
    match token {
        Some(id) => {
            let id = UserId(String::from_utf8_lossy(&id).into_owned());
            req.extensions_mut().insert(id);
            next.run(req).await
        }
        None => http::StatusCode::UNAUTHORIZED.into_response(),
    }
}

fn percent_decode(input: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(input.len());
    let mut i = 0;
    while i < input.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if input[i] == b'%' && i + 2 < input.len() {
            if let (Some(h), Some(l)) = (hex(input[i + 1]), hex(input[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(input[i]);
        i += 1;
    }
    out
}

fn bearer(id: &str) -> String {
    format!("Bearer {id}")
}

// ---- raw HTTP/1.1 over TCP, for what a well-behaved client cannot send ------

/// Write `request` (concurrently, ignoring write errors: the server may
/// answer and close before it read everything) and read until the server
/// closes or 10 s pass. Returns the status code, if any response arrived.
async fn raw(addr: SocketAddr, request: Vec<u8>) -> Option<u16> {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut rd, mut wr) = stream.into_split();
    let writer = tokio::spawn(async move {
        let _ = wr.write_all(&request).await;
        let _ = wr.flush().await;
        wr // keep the write half open until the reader is done
    });
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), async {
        let mut buf = [0u8; 8192];
        loop {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    got.extend_from_slice(&buf[..n]);
                    if head_complete(&got) {
                        break;
                    }
                }
            }
        }
    })
    .await;
    writer.abort();
    status_of(&got)
}

/// Read one whole response (head and `content-length` body) from `stream`.
async fn read_reply(stream: &mut tokio::net::TcpStream) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length: "))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                if got.len() >= end + 4 + len {
                    break;
                }
            }
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await
    .expect("a response within 5 s");
    String::from_utf8_lossy(&got).into_owned()
}

fn head_complete(buf: &[u8]) -> bool {
    buf.windows(4).any(|w| w == b"\r\n\r\n")
}

fn status_of(buf: &[u8]) -> Option<u16> {
    let line = buf.split(|&b| b == b'\n').next()?;
    let line = std::str::from_utf8(line).ok()?;
    line.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()
}

/// Request head with the given extra header lines (already `name: value`).
fn head(method: &str, path: &str, extra: &[&[u8]]) -> Vec<u8> {
    let mut out = format!("{method} {path} HTTP/1.1\r\nhost: localhost\r\n").into_bytes();
    for line in extra {
        out.extend_from_slice(line);
        out.extend_from_slice(b"\r\n");
    }
    out
}

// ---- 1. CRLF, braces, colons and NUL never reach a key ----------------------

async fn hostile_bytes_never_reach_the_key(kind: Kind) {
    let env = Env::new(kind).await;
    let (gate, mut entered) = Gate::new();
    let layer = env
        .layer((
            RequestMethod,
            UriPath,
            Identity::<UserId>::new(),
            Header::optional("x-ref"),
        ))
        .await
        .digest_body()
        .body_limit(1024);
    let app = Router::new()
        .route("/o/{id}", post(gated).layer(layer))
        .with_state(gate.clone())
        .layer(middleware::from_fn(auth));
    let addr = serve(app).await;

    // (identity, path, x-ref, body): CR, LF, NUL, braces and colons in every
    // place a client (or a token's claims) can put them.
    let cases: [(&str, &str, &str, &str); 6] = [
        (
            "%0D%0Atrl:%7Bx%7D%00",
            "/o/%0D%0A%00%7Bslot%7D:1",
            "{a}:b",
            "\r\n\0{}:",
        ),
        ("%7Bslot%7D", "/o/%7Bslot%7D", "{slot}", "{slot}"),
        ("}{", "/o/:::", "}{", "}{"),
        ("%00", "/o/%00", "", "\0"),
        // The colon case: identity "a:b" + ref "c" vs identity "a" + ref "b:c".
        ("a:b", "/o/1", "c", ""),
        ("a", "/o/1", "b:c", ""),
    ];
    let tasks: Vec<_> = cases
        .iter()
        .map(|(id, path, xref, body)| {
            let auth = bearer(id);
            let mut headers = vec![("authorization", auth.as_str())];
            if !xref.is_empty() {
                headers.push(("x-ref", xref));
            }
            tokio::spawn(send(addr, req("POST", path, &headers, body)))
        })
        .collect();
    // All six are in the handler at once: six different keys, none 409.
    let mut hexes = BTreeSet::new();
    for _ in 0..cases.len() {
        hexes.insert(recv(&mut entered).await);
    }
    assert_eq!(hexes.len(), cases.len(), "every case got its own key");
    let expected: BTreeSet<String> = hexes.iter().map(|h| stored_key(h)).collect();
    for key in &expected {
        assert_fixed_shape(key);
    }
    env.assert_stored(&expected);
    if matches!(kind, Kind::Redis) {
        assert_slots_follow_the_digest(&hexes);
    }

    gate.permits.add_permits(cases.len());
    for t in tasks {
        let reply = t.await.unwrap();
        assert_eq!(reply.status, 200, "{:?}", reply.body);
    }
    assert_eq!(env.held(), 0, "all released");
}

// ---- 2. identity: a forged header cannot lock out another user ----------------

async fn forged_identity_header_cannot_lock_out_another_user(kind: Kind) {
    let env = Env::new(kind).await;
    let (gate, mut entered) = Gate::new();
    let layer = env
        .layer((RequestMethod, Route, Identity::<UserId>::new()))
        .await;
    let app = Router::new()
        .route("/pay", post(gated).layer(layer))
        .with_state(gate.clone())
        .layer(middleware::from_fn(auth));
    let addr = serve(app).await;

    // Mallory authenticates as himself but claims to be alice in every header
    // a naive key might read, and holds his lease.
    let forged = [
        ("authorization", "Bearer mallory"),
        ("x-user-id", "alice"),
        ("x-forwarded-user", "alice"),
        ("x-remote-user", "alice"),
    ];
    let mallory = tokio::spawn(send(addr, req("POST", "/pay", &forged, "")));
    let mallory_key = recv(&mut entered).await;

    // Alice, authenticated, is admitted while Mallory's request is in flight.
    let alice = tokio::spawn(send(
        addr,
        req("POST", "/pay", &[("authorization", "Bearer alice")], ""),
    ));
    let alice_key = recv(&mut entered).await;
    assert_ne!(alice_key, mallory_key, "the forged header is not the key");

    // A real duplicate of Alice's request is still refused.
    let dup = send(
        addr,
        req("POST", "/pay", &[("authorization", "Bearer alice")], ""),
    )
    .await;
    assert_eq!(dup.status, 409);

    gate.permits.add_permits(2);
    assert_eq!(alice.await.unwrap().status, 200);
    assert_eq!(mallory.await.unwrap().status, 200);
    assert_eq!(gate.runs(), 2);
    assert_eq!(env.held(), 0);
}

/// The contrast that shows why: keyed on a client header, the same forgery
/// does lock Alice out. (`Header::trusted_identity` is only for headers a gateway sets.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untrusted_header_identity_is_forgeable() {
    let (gate, mut entered) = Gate::new();
    let layer = RedisLockLayer::new(
        MemoryBackend::new(),
        (RequestMethod, Route, Header::trusted_identity("x-user-id")),
    )
    .key_space(KeySpace::default().secret(b"s --------------"));
    let app = Router::new()
        .route("/pay", post(gated).layer(layer))
        .with_state(gate.clone());
    let addr = serve(app).await;
    let mallory = tokio::spawn(send(
        addr,
        req("POST", "/pay", &[("x-user-id", "alice")], ""),
    ));
    recv(&mut entered).await;
    let alice = send(addr, req("POST", "/pay", &[("x-user-id", "alice")], "")).await;
    assert_eq!(
        alice.status, 409,
        "a client-set identity header is forgeable"
    );
    gate.permits.add_permits(1);
    assert_eq!(mallory.await.unwrap().status, 200);
}

// ---- 3. bytes hyper refuses: NUL, bare CR, a 1 MiB header, many headers -------

fn plain_app(gate: &Gate, layer: RedisLockLayer) -> Router {
    Router::new()
        .route("/pay", post(gated).layer(layer))
        .with_state(gate.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nul_and_bare_cr_in_header_values_get_400() {
    let (gate, mut entered) = Gate::new();
    let layer = RedisLockLayer::new(
        MemoryBackend::new(),
        (RequestMethod, Route, Header::trusted_identity("x-user-id")),
    )
    .key_space(KeySpace::default().secret(b"s --------------"));
    let addr = serve(plain_app(&gate, layer)).await;

    for bad in [
        &b"x-user-id: al\0ice"[..],
        &b"x-user-id: al\rice"[..],
        &b"x-user-id: alice\r\n x-folded: continuation"[..],
    ] {
        let mut request = head("POST", "/pay", &[bad, b"content-length: 0"]);
        request.extend_from_slice(b"\r\n");
        assert_eq!(raw(addr, request).await, Some(400), "{bad:?}");
    }
    assert_eq!(gate.runs(), 0, "never reached the handler");

    // The server is still serving.
    gate.permits.add_permits(1);
    let ok = send(addr, req("POST", "/pay", &[("x-user-id", "alice")], "")).await;
    assert_eq!(ok.status, 200);
    recv(&mut entered).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_mib_header_is_rejected_by_hyper() {
    let (gate, mut entered) = Gate::new();
    let layer = RedisLockLayer::new(
        MemoryBackend::new(),
        (RequestMethod, Route, Header::trusted_identity("x-user-id")),
    )
    .key_space(KeySpace::default().secret(b"s --------------"));
    let addr = serve(plain_app(&gate, layer)).await;

    let mut line = b"x-user-id: ".to_vec();
    line.resize(line.len() + (1 << 20), b'a');
    let mut request = head("POST", "/pay", &[&line, b"content-length: 0"]);
    request.extend_from_slice(b"\r\n");
    let status = raw(addr, request).await;
    assert_eq!(
        status,
        Some(431),
        "hyper answers 431 Request Header Fields Too Large"
    );
    assert_eq!(gate.runs(), 0);

    gate.permits.add_permits(1);
    let ok = send(addr, req("POST", "/pay", &[("x-user-id", "alice")], "")).await;
    assert_eq!(ok.status, 200, "still serving");
    recv(&mut entered).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_headers_are_rejected_and_repeats_are_refused() {
    let (gate, _entered) = Gate::new();
    let layer = RedisLockLayer::new(
        MemoryBackend::new(),
        (RequestMethod, Route, Header::new("x-ref")),
    )
    .key_space(KeySpace::default().secret(b"s --------------"))
    .skip_missing_part();
    let addr = serve(plain_app(&gate, layer)).await;

    let lines: Vec<Vec<u8>> = (0..5_000)
        .map(|i| format!("x-ref: {i}").into_bytes())
        .collect();
    let mut refs: Vec<&[u8]> = lines.iter().map(Vec::as_slice).collect();
    refs.push(b"content-length: 0");
    let mut request = head("POST", "/pay", &refs);
    request.extend_from_slice(b"\r\n");
    assert_eq!(raw(addr, request).await, Some(431), "5,000 headers");
    assert_eq!(gate.runs(), 0);

    // Under hyper's cap (100), a repeated header is refused (a handler
    // reads one value; a second line must not make another key), even by a
    // layer that skips missing parts.
    let mut b = http::Request::post("/pay").header("host", "localhost");
    for i in 0..90 {
        b = b.header("x-ref", i.to_string());
    }
    let request = b.body(http_body_util::Full::new(Bytes::new())).unwrap();
    let refused = send(addr, request).await;
    assert_eq!(refused.status, 400, "90 lines of one header");
    let detail = String::from_utf8_lossy(&refused.body);
    assert!(detail.contains("90 times"), "the detail says why: {detail}");
    assert_eq!(gate.runs(), 0);
}

async fn non_utf8_header_bytes_are_keyed(kind: Kind) {
    let env = Env::new(kind).await;
    let (gate, mut entered) = Gate::new();
    let layer = env
        .layer((RequestMethod, Route, Header::trusted_identity("x-user-id")))
        .await;
    let addr = serve(plain_app(&gate, layer)).await;

    let with = |bytes: &'static [u8]| {
        let request = http::Request::post("/pay")
            .header("host", "localhost")
            .header("x-user-id", http::HeaderValue::from_bytes(bytes).unwrap())
            .body(http_body_util::Full::new(Bytes::new()))
            .unwrap();
        async move { Conn::open(addr).await.send(request).await }
    };
    let first = tokio::spawn(with(b"\xff\xfe caf\xe9"));
    let a = recv(&mut entered).await;
    let other = tokio::spawn(with(b"\xfe\xff caf\xe9"));
    let b = recv(&mut entered).await;
    assert_ne!(a, b, "different bytes, different keys");
    env.assert_stored(&[stored_key(&a), stored_key(&b)].into_iter().collect());
    let dup = with(b"\xff\xfe caf\xe9").await;
    assert_eq!(dup.status, 409);
    assert_eq!(dup.headers["content-type"], "application/problem+json");
    gate.permits.add_permits(2);
    assert_eq!(first.await.unwrap().status, 200);
    assert_eq!(other.await.unwrap().status, 200);
    assert_eq!(env.held(), 0);
}

/// Identity edge cases, on both layers: a repeated trusted identity header
/// (a gateway that appends) is 400 naming the count; an empty identity
/// (empty header, or an extension that displays as "") is 401. The handler
/// never runs and nothing is stored.
async fn repeated_or_empty_identity_is_refused_by_both_layers(kind: Kind) {
    let env = Env::new(kind).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        move || async move {
            runs.fetch_add(1, Ordering::SeqCst);
            "ran"
        }
    };
    let header = || (RequestMethod, Route, Header::trusted_identity("x-user-id"));
    let typed = || (RequestMethod, Route, Identity::<UserId>::new());
    let app = Router::new()
        .route(
            "/lock",
            post(handler.clone()).layer(env.keyed_layer(header()).await),
        )
        .route(
            "/idem",
            post(handler.clone()).layer(env.idempotency_layer(header()).await),
        )
        .route(
            "/lock-id",
            post(handler.clone())
                .layer(env.keyed_layer(typed()).await)
                .layer(middleware::from_fn(auth)),
        )
        .route(
            "/idem-id",
            post(handler)
                .layer(env.idempotency_layer(typed()).await)
                .layer(middleware::from_fn(auth)),
        );
    let addr = serve(app).await;
    let idem = ("idempotency-key", "k-1");

    for path in ["/lock", "/idem"] {
        let twice = [("x-user-id", "mallory"), ("x-user-id", "alice"), idem];
        let r = send(addr, req("POST", path, &twice, "")).await;
        assert_eq!(r.status, 400, "{path}");
        assert_eq!(r.headers["content-type"], "application/problem+json");
        let detail = r.json()["detail"].as_str().unwrap().to_owned();
        assert!(
            detail.contains("`x-user-id` identity header appeared 2 times")
                && detail.contains("overwrite"),
            "{path}: {detail}"
        );
        let empty = send(addr, req("POST", path, &[("x-user-id", ""), idem], "")).await;
        assert_eq!(empty.status, 401, "{path}: empty header");
    }
    for path in ["/lock-id", "/idem-id"] {
        let r = send(
            addr,
            req("POST", path, &[("authorization", "Bearer "), idem], ""),
        )
        .await;
        assert_eq!(r.status, 401, "{path}: empty identity");
        assert_eq!(r.headers["content-type"], "application/problem+json");
        let detail = r.json()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains("empty"), "{path}: {detail}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0, "no handler ran");
    if let Kind::Redis = kind {
        assert_eq!(env.server().dbsize(), 0, "nothing stored");
    }
    assert_eq!(env.held(), 0);

    // The same routes serve a well-formed identity.
    let one = [("x-user-id", "alice"), idem];
    assert_eq!(send(addr, req("POST", "/lock", &one, "")).await.status, 200);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

// ---- 4. bodies: stalled, over the limit ----------------------------------------

/// Request body wrapper counting the bytes the layer pulled from the client.
struct Counting {
    inner: Body,
    read: Arc<AtomicUsize>,
}

impl http_body::Body for Counting {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            if let Some(data) = frame.data_ref() {
                self.read.fetch_add(data.len(), Ordering::SeqCst);
            }
        }
        polled
    }
}

/// Outermost middleware: reports each request's arrival, counts body bytes.
#[derive(Clone)]
struct Probe {
    arrived: mpsc::UnboundedSender<()>,
    read: Arc<AtomicUsize>,
}

async fn probe(State(probe): State<Probe>, req: Request, next: Next) -> Response {
    let _ = probe.arrived.send(());
    let read = probe.read.clone();
    let req = req.map(|inner| Body::new(Counting { inner, read }));
    next.run(req).await
}

fn probed(app: Router) -> (Router, mpsc::UnboundedReceiver<()>, Arc<AtomicUsize>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let read = Arc::new(AtomicUsize::new(0));
    let probe = Probe {
        arrived: tx,
        read: read.clone(),
    };
    (
        app.layer(middleware::from_fn_with_state(probe, self::probe)),
        rx,
        read,
    )
}

async fn stalled_body_gets_408_without_holding_the_lease(kind: Kind) {
    let env = Env::new(kind).await;
    let (gate, mut entered) = Gate::new();
    let timeout = Duration::from_millis(800);
    let layer = env
        .layer((RequestMethod, Route))
        .await
        .digest_body()
        .body_limit(1024)
        .body_timeout(timeout);
    let app = Router::new()
        .route("/pay", post(gated).layer(layer))
        .with_state(gate.clone());
    let (app, mut arrived, _) = probed(app);
    let addr = serve(app).await;

    // A: 10 of 100 declared bytes, then silence.
    let mut stalled = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut request = head("POST", "/pay", &[b"content-length: 100"]);
    request.extend_from_slice(b"\r\n0123456789");
    let sent_at = Instant::now();
    stalled.write_all(&request).await.unwrap();
    arrived.recv().await.unwrap();

    // B: the same route, completes its body late but within the deadline.
    let mut late = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut request = head("POST", "/pay", &[b"content-length: 4"]);
    request.extend_from_slice(b"\r\nab");
    late.write_all(&request).await.unwrap();
    arrived.recv().await.unwrap();

    // Both are inside the layer, reading their bodies: no lease exists yet,
    // for as long as we look (bounded: 300 ms, well inside the deadline).
    let look_until = Instant::now() + Duration::from_millis(300);
    while Instant::now() < look_until {
        assert_eq!(env.held(), 0, "no lease while the body stalls");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // B's body arrives: only now is its lease taken.
    late.write_all(b"cd").await.unwrap();
    let b_key = recv(&mut entered).await;
    env.assert_stored(&[stored_key(&b_key)].into_iter().collect());

    // A gets 408 once the deadline passes; its lease never existed.
    let reply = read_reply(&mut stalled).await;
    let took = sent_at.elapsed();
    assert_eq!(status_of(reply.as_bytes()), Some(408), "{reply}");
    assert!(took >= timeout, "not before the deadline: {took:?}");
    assert!(reply.contains("application/problem+json"), "{reply}");
    env.assert_stored(&[stored_key(&b_key)].into_iter().collect());
    assert_eq!(gate.runs(), 1, "the stalled request never ran");

    gate.permits.add_permits(1);
    let reply = read_reply(&mut late).await;
    assert_eq!(status_of(reply.as_bytes()), Some(200), "{reply}");
    assert!(reply.ends_with(" 4"), "handler got all 4 bytes: {reply}");
    assert!(
        common::eventually(Duration::from_secs(2), || env.held() == 0).await,
        "released"
    );
}

/// Without a body digest too, the lease waits for the whole body: a client
/// that sends 5 of 100 declared bytes and stalls holds no lease, and a
/// complete request to the same key is admitted meanwhile (not 409). The
/// stalled one gets 408, whose detail names the setting to change.
async fn stalled_body_without_digest_holds_no_lease(kind: Kind) {
    let env = Env::new(kind).await;
    let (gate, mut entered) = Gate::new();
    let timeout = Duration::from_millis(800);
    let layer = env
        .layer((RequestMethod, Route))
        .await
        .body_timeout(timeout);
    let app = Router::new()
        .route("/accounts/acct-1/debit", post(gated).layer(layer))
        .with_state(gate.clone());
    let (app, mut arrived, read) = probed(app);
    let addr = serve(app).await;

    // A: 5 of 100 declared bytes, then silence.
    let mut stalled = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut request = head("POST", "/accounts/acct-1/debit", &[b"content-length: 100"]);
    request.extend_from_slice(b"\r\n01234");
    stalled.write_all(&request).await.unwrap();
    arrived.recv().await.unwrap();
    // Someone (the layer, or the handler's extractor) has pulled A's 5 bytes:
    // A is past its head, waiting for the rest of its body.
    assert!(
        common::eventually(Duration::from_secs(5), || read.load(Ordering::SeqCst) == 5).await,
        "A's first bytes were read"
    );
    assert_eq!(env.held(), 0, "no lease while A's body is incomplete");

    // B: the same key, complete: admitted while A stalls.
    let b = tokio::spawn(send(
        addr,
        req("POST", "/accounts/acct-1/debit", &[], "hello"),
    ));
    let b_key = recv(&mut entered).await;
    env.assert_stored(&[stored_key(&b_key)].into_iter().collect());
    gate.permits.add_permits(1);
    let b = b.await.unwrap();
    assert_eq!(b.status, 200, "B admitted, not 409: {:?}", b.body);
    assert!(b.body.ends_with(b" 5"), "B's handler got its 5 bytes");

    // A gets 408 problem+json naming the setter; it never ran.
    let reply = read_reply(&mut stalled).await;
    assert_eq!(status_of(reply.as_bytes()), Some(408), "{reply}");
    assert!(reply.contains("application/problem+json"), "{reply}");
    assert!(
        reply.contains("body_timeout"),
        "detail names the setter: {reply}"
    );
    assert_eq!(gate.runs(), 1, "the stalled request never ran");
    assert!(
        common::eventually(Duration::from_secs(2), || env.held() == 0).await,
        "released"
    );
}

/// The opt-out's trade-off, as documented on `stream_body`: the lease is
/// taken at the request head, so a client that stalls mid-body holds it and
/// a complete duplicate gets 409 until the upload finishes.
async fn stream_body_holds_the_lease_while_the_body_stalls(kind: Kind) {
    /// Reports its lease before reading the body (it streams it).
    async fn streaming(State(gate): State<Gate>, lease: Lease, body: Body) -> String {
        let hex = lease.key().map(|k| k.to_hex()).unwrap_or_default();
        gate.pass(hex.clone()).await;
        let body = http_body_util::BodyExt::collect(body)
            .await
            .unwrap()
            .to_bytes();
        format!("{hex} {}", body.len())
    }
    let env = Env::new(kind).await;
    let (gate, mut entered) = Gate::new();
    let layer = env.layer((RequestMethod, Route)).await.stream_body();
    let app = Router::new()
        .route("/upload", post(streaming).layer(layer))
        .with_state(gate.clone());
    let addr = serve(app).await;

    // A: 5 of 100 declared bytes, then silence; its handler runs at once.
    let mut stalled = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut request = head("POST", "/upload", &[b"content-length: 100"]);
    request.extend_from_slice(b"\r\n01234");
    stalled.write_all(&request).await.unwrap();
    let a_key = recv(&mut entered).await;
    env.assert_stored(&[stored_key(&a_key)].into_iter().collect());

    // B, complete, same key: 409 while A uploads.
    let b = send(addr, req("POST", "/upload", &[], "hello")).await;
    assert_eq!(b.status, 409, "the stalled upload holds the lease");
    assert_eq!(gate.runs(), 1);

    // A finishes its body: 200 with all 100 bytes, and the lease is gone.
    gate.permits.add_permits(1);
    stalled.write_all(&[b'x'; 95]).await.unwrap();
    let reply = read_reply(&mut stalled).await;
    assert_eq!(status_of(reply.as_bytes()), Some(200), "{reply}");
    assert!(
        reply.ends_with(" 100"),
        "handler got all 100 bytes: {reply}"
    );
    assert!(
        common::eventually(Duration::from_secs(2), || env.held() == 0).await,
        "released"
    );
}

/// Without a digest, a body over the limit is refused too (before any
/// lease), and the detail says which setting raises it.
async fn oversized_body_without_digest_gets_413_naming_the_setter(kind: Kind) {
    let env = Env::new(kind).await;
    let (gate, _entered) = Gate::new();
    let layer = env.layer((RequestMethod, Route)).await.body_limit(1024);
    let app = Router::new()
        .route("/pay", post(gated).layer(layer))
        .with_state(gate.clone());
    let addr = serve(app).await;
    let big = "x".repeat(2000);
    let reply = send(addr, req("POST", "/pay", &[], &big)).await;
    assert_eq!(reply.status, 413);
    let detail = reply.json()["detail"].as_str().unwrap().to_owned();
    assert!(detail.contains("1024-byte"), "{detail}");
    assert!(
        detail.contains("`body_limit`") && detail.contains("`stream_body`"),
        "{detail}"
    );
    assert_eq!(gate.runs(), 0);
    assert_eq!(env.held(), 0);
}

async fn endless_chunked_body_gets_413_after_at_most_the_limit(kind: Kind) {
    const LIMIT: usize = 16 * 1024;
    const CHUNK: usize = 1024;
    let env = Env::new(kind).await;
    let (gate, _entered) = Gate::new();
    let layer = env
        .keyed_layer((RequestMethod, Route))
        .await
        .digest_body()
        .body_limit(LIMIT);
    let app = Router::new()
        .route("/up", post(gated).layer(layer))
        .with_state(gate.clone());
    let (app, _arrived, read) = probed(app);
    let addr = serve(app).await;

    // A chunked body that would never end: the writer stops only when the
    // server stops reading or answers, or after 64 MiB (bounded).
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut rd, mut wr) = stream.into_split();
    let answered = Arc::new(AtomicBool::new(false));
    let writer = {
        let answered = answered.clone();
        tokio::spawn(async move {
            let mut sent = 0usize;
            let request = head("POST", "/up", &[b"transfer-encoding: chunked"]);
            if wr.write_all(&request).await.is_err() || wr.write_all(b"\r\n").await.is_err() {
                return sent;
            }
            let mut chunk = format!("{CHUNK:x}\r\n").into_bytes();
            chunk.resize(chunk.len() + CHUNK, b'x');
            chunk.extend_from_slice(b"\r\n");
            while sent < 64 << 20 && !answered.load(Ordering::SeqCst) {
                match tokio::time::timeout(Duration::from_secs(2), wr.write_all(&chunk)).await {
                    Ok(Ok(())) => sent += CHUNK,
                    _ => break,
                }
            }
            sent
        })
    };
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    tokio::time::timeout(Duration::from_secs(10), async {
        while !head_complete(&got) {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await
    .expect("answered within 10 s");
    answered.store(true, Ordering::SeqCst);
    let client_sent = writer.await.unwrap();
    let server_read = read.load(Ordering::SeqCst);
    println!("endless body: server read {server_read} bytes (limit {LIMIT}); client got {client_sent} bytes into the socket");
    assert_eq!(status_of(&got), Some(413));
    assert!(
        server_read <= LIMIT + CHUNK,
        "read at most the limit plus one chunk: {server_read}"
    );
    assert!(server_read > LIMIT, "read just past the limit to know");
    assert!(client_sent < 64 << 20, "the client was stopped");
    assert_eq!(gate.runs(), 0);
    assert_eq!(env.held(), 0, "no lease for a rejected body");

    // A declared Content-Length over the limit is refused before any byte
    // of the body is read.
    read.store(0, Ordering::SeqCst);
    let request = head("POST", "/up", &[b"content-length: 10000000000", b""]);
    assert_eq!(raw(addr, request).await, Some(413));
    assert_eq!(read.load(Ordering::SeqCst), 0, "nothing read");
    assert_eq!(env.held(), 0);
}

/// A body limit set in front of the layer (tower-http's
/// `RequestBodyLimitLayer` and axum's limits wrap the body in
/// `http_body_util::Limited`) cuts the body off while the layer reads it:
/// the client is told 413, not that it broke its stream (400).
async fn a_body_cut_off_by_a_limit_in_front_is_413(kind: Kind) {
    let env = Env::new(kind).await;
    let (gate, _entered) = Gate::new();
    let layer = env.keyed_layer((RequestMethod, Route)).await.digest_body();
    let app = Router::new()
        .route("/pay", post(gated).layer(layer))
        .layer(axum::middleware::map_request(|req: Request| async move {
            req.map(|body| Body::new(http_body_util::Limited::new(body, 100)))
        }))
        .with_state(gate.clone());
    let addr = serve(app).await;
    let reply = send(addr, req("POST", "/pay", &[], &"x".repeat(2000))).await;
    assert_eq!(reply.status, 413);
    let kind = reply.json()["type"].as_str().unwrap_or("").to_owned();
    assert!(kind.ends_with("#payload-too-large"), "{kind}");
    let detail = reply.json()["detail"].as_str().unwrap().to_owned();
    assert!(
        !detail.contains("`body_limit`"),
        "not the layer's limit: {detail}"
    );
    // Under the limit it runs.
    gate.permits.add_permits(1);
    assert_eq!(
        send(addr, req("POST", "/pay", &[], "small")).await.status,
        200
    );
    assert_eq!(gate.runs(), 1);
    assert_eq!(env.held(), 0);
}

// ---- 5. an Idempotency-Key over 255 bytes --------------------------------------

/// Until the idempotency layer (which will reject keys over 255 bytes with
/// 400) lands, `Idempotency-Key` joins the key through the `Header` part:
/// any length is hashed to the same fixed-size key, and keys differing in
/// their last byte are different locks.
async fn long_idempotency_key_is_hashed_to_a_fixed_key(kind: Kind) {
    let env = Env::new(kind).await;
    let (gate, mut entered) = Gate::new();
    let layer = env
        .layer((RequestMethod, Route, Header::new("idempotency-key")))
        .await;
    let addr = serve(plain_app(&gate, layer)).await;

    let long_a = "k".repeat(300);
    let long_b = format!("{}j", "k".repeat(299));
    let huge = "z".repeat(64 * 1024);
    let mut tasks = Vec::new();
    let mut hexes = BTreeSet::new();
    for key in [&long_a, &long_b, &huge] {
        let key = key.clone();
        tasks.push(tokio::spawn(async move {
            send(addr, req("POST", "/pay", &[("idempotency-key", &key)], "")).await
        }));
        hexes.insert(recv(&mut entered).await);
    }
    assert_eq!(hexes.len(), 3);
    env.assert_stored(&hexes.iter().map(|h| stored_key(h)).collect());
    let dup = send(
        addr,
        req("POST", "/pay", &[("idempotency-key", &long_a)], ""),
    )
    .await;
    assert_eq!(dup.status, 409);
    gate.permits.add_permits(3);
    for t in tasks {
        assert_eq!(t.await.unwrap().status, 200);
    }
    assert_eq!(env.held(), 0);
}

suite!(
    hostile_bytes_never_reach_the_key,
    repeated_or_empty_identity_is_refused_by_both_layers,
    forged_identity_header_cannot_lock_out_another_user,
    non_utf8_header_bytes_are_keyed,
    stalled_body_gets_408_without_holding_the_lease,
    stalled_body_without_digest_holds_no_lease,
    stream_body_holds_the_lease_while_the_body_stalls,
    oversized_body_without_digest_gets_413_naming_the_setter,
    endless_chunked_body_gets_413_after_at_most_the_limit,
    a_body_cut_off_by_a_limit_in_front_is_413,
    long_idempotency_key_is_hashed_to_a_fixed_key,
);
