//! The peer middleware written over fred (`peer/mod.rs` has the redis-rs
//! one): the same steps, so the client's own share of the layer's cost is
//! visible beside the redis-rs peer's.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::StatusCode;

use crate::peer::{key_and_token, PEER_RELEASE, TTL};

/// The same middleware written over fred (`Client::init`, its defaults but
/// TCP_NODELAY, as the layer's own connection has), so that the client's own
/// share of the layer's cost is visible beside the redis-rs peer's.
#[derive(Clone)]
pub struct FredPeer {
    client: fred::clients::Client,
    release: Arc<fred::types::scripts::Script>,
}

impl FredPeer {
    /// A fred peer connected to `url`.
    pub async fn connect(url: &str) -> Self {
        use fred::interfaces::ClientLike;
        let config = fred::types::config::Config::from_url(url).expect("fred config");
        let client = fred::types::Builder::from_config(config)
            .with_connection_config(|c| {
                c.tcp = fred::types::config::TcpConfig {
                    nodelay: Some(true),
                    ..Default::default()
                };
            })
            .build()
            .expect("fred client");
        client.init().await.expect("fred connects");
        Self {
            client,
            release: Arc::new(fred::types::scripts::Script::from_lua(PEER_RELEASE)),
        }
    }
}

/// `peer::peer_lock` over fred: `SET key token NX PX ttl`, run, compare-and-delete
/// (`EVALSHA`, loaded again on `NOSCRIPT`).
pub async fn fred_peer_lock(State(peer): State<FredPeer>, req: Request, next: Next) -> Response {
    use fred::interfaces::KeysInterface;
    use fred::types::{Expiration, SetOptions};
    let (key, token) = key_and_token(&req);
    let set: Result<Option<String>, fred::error::Error> = peer
        .client
        .set(
            key.as_str(),
            token.as_str(),
            Some(Expiration::PX(TTL.as_millis() as i64)),
            Some(SetOptions::NX),
            false,
        )
        .await;
    match set {
        Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
        Ok(None) => StatusCode::CONFLICT.into_response(),
        Ok(Some(_)) => {
            let res = next.run(req).await;
            let _: Result<i64, fred::error::Error> = peer
                .release
                .evalsha_with_reload(&peer.client, key.as_str(), token.as_str())
                .await;
            res
        }
    }
}
