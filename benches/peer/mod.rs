//! What both load benches share: the hand-written peer middleware (a
//! redis-rs `SET NX PX` + Lua compare-and-delete, as a user would write it
//! in thirty lines), serving a router on loopback, and reading settings from
//! the environment.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use http::StatusCode;

/// The machine's load average over 1, 5 and 15 minutes, for a report.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// The peer's lease time to live (the layers use the same).
pub const TTL: Duration = Duration::from_secs(10);

/// `name` from the environment, parsed, or `default`.
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

pub const PEER_RELEASE: &str = r#"if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0"#;

/// The peer's state: one redis-rs connection manager and its release script.
#[derive(Clone)]
pub struct Peer {
    con: redis_rs::aio::ConnectionManager,
    release: Arc<redis_rs::Script>,
}

impl Peer {
    /// A peer over `con`.
    pub fn new(con: redis_rs::aio::ConnectionManager) -> Self {
        Self {
            con,
            release: Arc::new(redis_rs::Script::new(PEER_RELEASE)),
        }
    }
}

/// A peer request's key (method, path, and the `x-user-id` header when
/// there is one) and a fresh 128-bit token in hex, as a user writes them.
pub fn key_and_token(req: &Request) -> (String, String) {
    let mut key = format!("peer:{}:{}", req.method(), req.uri().path());
    if let Some(user) = req.headers().get("x-user-id") {
        key.push(':');
        key.push_str(&String::from_utf8_lossy(user.as_bytes()));
    }
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).expect("the OS random source");
    (key, format!("{:032x}", u128::from_le_bytes(bytes)))
}

/// The hand-written middleware: `SET key token NX PX ttl`, run, compare-and-delete.
/// Keyed on method and path, and on the `x-user-id` header when a request
/// has one (the quickstart's identity part).
pub async fn peer_lock(State(peer): State<Peer>, req: Request, next: Next) -> Response {
    let (key, token) = key_and_token(&req);
    let mut con = peer.con.clone();
    let set: redis_rs::RedisResult<Option<String>> = redis_rs::cmd("SET")
        .arg(&key)
        .arg(&token)
        .arg("NX")
        .arg("PX")
        .arg(TTL.as_millis() as u64)
        .query_async(&mut con)
        .await;
    match set {
        Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
        Ok(None) => StatusCode::CONFLICT.into_response(),
        Ok(Some(_)) => {
            let res = next.run(req).await;
            let _: redis_rs::RedisResult<i64> = peer
                .release
                .key(&key)
                .arg(&token)
                .invoke_async(&mut con)
                .await;
            res
        }
    }
}

/// Serve `router` on a free loopback port (TCP_NODELAY on every accepted
/// connection); the address to send load to.
pub async fn serve(router: Router) -> SocketAddr {
    use axum::serve::ListenerExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move {
        axum::serve(listener, router).await.expect("serve");
    });
    addr
}
