//! [`ReplayStore`] for [`RedisBackend`]: one hash per key,
//! `prefix:{digest}:idem`, so claim and record share a key (and a Cluster
//! slot). Fields: `s` state (`p` claimed, `d` done), `t` claim token, `f`
//! fingerprint, `r` encoded [`Record`]. Each step is one `EVALSHA` of a
//! script in `backend/redis/scripts.rs`.

use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use fred::interfaces::{ClientLike, EventInterface, LuaInterface, PubsubInterface};
use fred::types::{Builder, Key, Value};

use super::feed::{Feed, Published};
use super::record::Record;
use super::store::{Claim, ReplayStore};
use crate::backend::redis::lock::{as_int, map_err, protocol, token_value, ttl_ms};
use crate::backend::redis::scripts::{ABANDON, CLAIM, COMPLETE, EXTEND_CLAIM};
use crate::backend::{BackendError, BackendErrorKind, BackendFuture, Token};
use crate::RedisBackend;

fn bytes_of(v: &Value) -> Option<Bytes> {
    match v {
        Value::Bytes(b) => Some(b.clone()),
        Value::String(s) => Some(Bytes::from(s.to_string())),
        _ => None,
    }
}

fn parse_claim(reply: &Value) -> Result<Claim, BackendError> {
    let Value::Array(items) = reply else {
        return Err(protocol("claim", reply));
    };
    match items.first().and_then(as_int) {
        Some(1) => Ok(Claim::Claimed),
        Some(2) => Ok(Claim::InFlight {
            retry_after: items
                .get(1)
                .and_then(as_int)
                .filter(|ms| *ms >= 0)
                .map(|ms| Duration::from_millis(ms as u64)),
        }),
        Some(3) => Ok(Claim::Mismatch),
        Some(4) => {
            let data = items
                .get(1)
                .and_then(bytes_of)
                .ok_or_else(|| protocol("claim", reply))?;
            Record::decode(data).map(Claim::Done).map_err(|e| {
                BackendError::with_kind(BackendErrorKind::Protocol, "bad idempotency record")
                    .with_source(e)
            })
        }
        _ => Err(protocol("claim", reply)),
    }
}

impl<C> ReplayStore for RedisBackend<C>
where
    C: LuaInterface + Clone + Send + Sync + 'static,
{
    fn claim(
        &self,
        key: &Bytes,
        token: &Token,
        fingerprint: &[u8],
        lease: Duration,
    ) -> BackendFuture<Claim> {
        let client = self.client().clone();
        let key = Key::from(key.clone());
        let args = vec![
            token_value(token),
            Value::Bytes(Bytes::copy_from_slice(fingerprint)),
            ttl_ms(lease),
        ];
        Box::pin(async move {
            let reply = CLAIM.run_multi(&client, key, args).await.map_err(map_err)?;
            parse_claim(&reply)
        })
    }

    fn complete(
        &self,
        key: &Bytes,
        token: &Token,
        record: &Record,
        retention: Duration,
    ) -> BackendFuture<bool> {
        let client = self.client().clone();
        let key = Key::from(key.clone());
        let args = vec![
            token_value(token),
            Value::Bytes(record.encode()),
            ttl_ms(retention),
        ];
        Box::pin(async move {
            let reply = COMPLETE
                .run_multi(&client, key, args)
                .await
                .map_err(map_err)?;
            as_int(&reply)
                .map(|n| n == 1)
                .ok_or_else(|| protocol("complete", &reply))
        })
    }

    fn extend(&self, key: &Bytes, token: &Token, lease: Duration) -> BackendFuture<bool> {
        let client = self.client().clone();
        let key = Key::from(key.clone());
        let args = vec![token_value(token), ttl_ms(lease)];
        Box::pin(async move {
            let reply = EXTEND_CLAIM
                .run_multi(&client, key, args)
                .await
                .map_err(map_err)?;
            as_int(&reply)
                .map(|n| n == 1)
                .ok_or_else(|| protocol("extend claim", &reply))
        })
    }

    fn abandon(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        let client = self.client().clone();
        let key = Key::from(key.clone());
        let args = vec![token_value(token)];
        Box::pin(async move {
            let reply = ABANDON
                .run_multi(&client, key, args)
                .await
                .map_err(map_err)?;
            as_int(&reply)
                .map(|n| n == 1)
                .ok_or_else(|| protocol("abandon", &reply))
        })
    }

    fn feed(&self) -> Option<BackendFuture<Arc<Feed>>> {
        let client = self.client().clone();
        Some(Box::pin(async move { subscribe(&client).await }))
    }

    fn name(&self) -> &'static str {
        "redis"
    }
}

/// One subscriber connection (same server, settings and reconnect policy
/// as `client`) with `PSUBSCRIBE *:idem`, whose messages feed the returned
/// [`Feed`]; it resubscribes after a reconnect, and ends with the feed.
async fn subscribe<C: ClientLike>(client: &C) -> Result<Arc<Feed>, BackendError> {
    let mut builder = Builder::from_config(client.client_config());
    builder
        .set_connection_config(client.connection_config().clone())
        .set_performance_config(client.perf_config());
    if let Some(policy) = client.client_reconnect_policy() {
        builder.set_policy(policy);
    }
    let subscriber = builder.build_subscriber_client().map_err(map_err)?;
    subscriber.init().await.map_err(map_err)?;
    let resubscribe = subscriber.manage_subscriptions();
    let mut messages = subscriber.message_rx();
    subscriber.psubscribe("*:idem").await.map_err(map_err)?;
    let feed = Arc::new(Feed::default());
    let weak: Weak<Feed> = Arc::downgrade(&feed);
    tokio::spawn(async move {
        while let Ok(message) = messages.recv().await {
            let Some(feed) = weak.upgrade() else { break };
            let published = match bytes_of(&message.value) {
                Some(data) if data.is_empty() => Published::Freed,
                Some(data) => match Record::decode(data) {
                    Ok(record) => Published::Done(record),
                    Err(_) => continue,
                },
                None => continue,
            };
            feed.deliver(message.channel.as_bytes(), published);
        }
        resubscribe.abort();
        let _ = subscriber.quit().await;
    });
    Ok(feed)
}
