//! [`IdempotencyBackend`] for [`RedisBackend`]: one hash per entry,
//! `prefix:{scope}:digest:idem`, so claim and record share a key, and the
//! scope's quota keys (`prefix:{scope}:idem-quota`, `…:idem-bytes`) share its
//! Cluster slot. Fields: `s` state (`p` claimed, `d` done, `a` abandoned),
//! `t` claim token, `f` fingerprint, `r` sealed record, `w` a duplicate
//! waits (see `scripts.rs`). Each step is one `EVALSHA` of a
//! script in `backend/redis/scripts.rs`.

use std::time::Duration;

use bytes::Bytes;
use fred::interfaces::{ClientLike, EventInterface, LuaInterface, PubsubInterface};
use fred::types::{Builder, Key, Value};

use crate::backend::idempotency::IdempotencyBackend;
use crate::backend::redis::scripts::{as_int, map_err, protocol, token_value, ttl_ms};
use crate::backend::redis::scripts::{ABANDON, CLAIM, COMPLETE, EXTEND_CLAIM};
use crate::backend::{BackendError, BackendFuture, Token};
use crate::backend::{Claim, EntryKey};
use crate::key::KeySpace;
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
    let millis = |i: usize| {
        items
            .get(i)
            .and_then(as_int)
            .filter(|ms| *ms >= 0)
            .map(|ms| Duration::from_millis(ms as u64))
    };
    match items.first().and_then(as_int) {
        Some(1) => Ok(Claim::Claimed),
        Some(2) => Ok(Claim::InFlight {
            retry_after: millis(1),
        }),
        Some(3) => Ok(Claim::Mismatch),
        Some(4) => items
            .get(1)
            .and_then(bytes_of)
            .map(Claim::Done)
            .ok_or_else(|| protocol("claim", reply)),
        Some(5) => Ok(Claim::OverQuota {
            retry_after: millis(1).unwrap_or(Duration::from_secs(1)),
        }),
        // Our own request gave up on this claim (a re-sent command landing
        // late): nothing was claimed, and nobody waits for this answer.
        Some(6) => Err(BackendError::new(
            "the claim landed after its request gave up on it",
        )),
        _ => Err(protocol("claim", reply)),
    }
}

/// The three keys of an idempotency script: the entry, the scope's entries
/// and the scope's bytes (one hash slot: the scope is the hash tag).
fn keys_of(key: &EntryKey) -> Vec<Key> {
    vec![
        Key::from(key.entry.clone()),
        Key::from(key.scope_key(":idem-quota")),
        Key::from(key.scope_key(":idem-bytes")),
    ]
}

fn member(key: &EntryKey) -> Value {
    Value::Bytes(key.member.clone())
}

fn flag(reply: &Value, what: &'static str) -> Result<bool, BackendError> {
    as_int(reply)
        .map(|n| n == 1)
        .ok_or_else(|| protocol(what, reply))
}

impl<C> IdempotencyBackend for RedisBackend<C>
where
    C: LuaInterface + Clone + Send + Sync + 'static,
{
    fn claim(
        &self,
        key: &EntryKey,
        token: &Token,
        fingerprint: &[u8],
        lease: Duration,
        max_entries: u64,
        max_bytes: u64,
    ) -> BackendFuture<Claim> {
        self.deliveries.saw_ttl(lease);
        let client = self.client.clone();
        let keys = keys_of(key);
        let args = vec![
            token_value(token),
            Value::Bytes(Bytes::copy_from_slice(fingerprint)),
            ttl_ms(lease),
            member(key),
            Value::Integer(max_entries.min(i64::MAX as u64) as i64),
            Value::Integer(max_bytes.min(i64::MAX as u64) as i64),
        ];
        BackendFuture::new(async move {
            let reply = CLAIM
                .run_multi(&client, keys, args)
                .await
                .map_err(map_err)?;
            parse_claim(&reply)
        })
    }

    fn complete(
        &self,
        key: &EntryKey,
        token: &Token,
        record: &Bytes,
        retention: Duration,
    ) -> BackendFuture<bool> {
        let client = self.client.clone();
        let keys = keys_of(key);
        let args = vec![
            token_value(token),
            Value::Bytes(record.clone()),
            ttl_ms(retention),
            member(key),
        ];
        BackendFuture::new(async move {
            let reply = COMPLETE
                .run_multi(&client, keys, args)
                .await
                .map_err(map_err)?;
            flag(&reply, "complete")
        })
    }

    fn extend(&self, key: &EntryKey, token: &Token, lease: Duration) -> BackendFuture<bool> {
        self.deliveries.saw_ttl(lease);
        let client = self.client.clone();
        let keys = keys_of(key);
        let args = vec![token_value(token), ttl_ms(lease), member(key)];
        BackendFuture::new(async move {
            let reply = EXTEND_CLAIM
                .run_multi(&client, keys, args)
                .await
                .map_err(map_err)?;
            flag(&reply, "extend claim")
        })
    }

    fn abandon(&self, key: &EntryKey, token: &Token, lease: Duration) -> BackendFuture<bool> {
        // Delivered like a release: in the caller's future while it waits,
        // on a task of its own once it stops waiting, retried until Redis
        // answers or a lease has passed.
        let attempt = {
            let client = self.client.clone();
            let (keys, args) = (
                keys_of(key),
                vec![token_value(token), member(key), ttl_ms(lease)],
            );
            move || {
                let (client, keys, args) = (client.clone(), keys.clone(), args.clone());
                async move {
                    let reply = ABANDON
                        .run_multi(&client, keys, args)
                        .await
                        .map_err(map_err)?;
                    flag(&reply, "abandon")
                }
            }
        };
        self.deliveries.deliver(attempt(), attempt)
    }

    fn hold(&self) -> Option<Box<dyn Send>> {
        Some(Box::new(self.deliveries.ticket()))
    }

    fn feed(
        &self,
        key_space: &KeySpace,
    ) -> Option<BackendFuture<tokio::sync::mpsc::Receiver<(Bytes, Bytes)>>> {
        let client = self.client.clone();
        let pattern = channel_pattern(key_space.prefix());
        Some(BackendFuture::new(async move {
            subscribe(&client, pattern).await
        }))
    }

    fn claimed(&self, _key: &EntryKey, _token: &Token, _extensions: &mut http::Extensions) {}

    fn is_transactional(&self) -> bool {
        false
    }
}

/// The channels of this key space's entries: `prefix:{*:idem`, with glob
/// characters of the prefix escaped, so the subscriber never hears (and
/// never decodes) what other key spaces or other tenants publish.
pub(crate) fn channel_pattern(prefix: &str) -> String {
    let mut out = String::with_capacity(prefix.len() + 8);
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push_str(":{*:idem");
    out
}

/// Whether `channel` is one of ours: `prefix:{…:idem`.
fn is_ours(prefix: &str, channel: &[u8]) -> bool {
    channel.len() > prefix.len() + 2
        && channel.starts_with(prefix.as_bytes())
        && channel[prefix.len()..].starts_with(b":{")
        && channel.ends_with(b":idem")
}

/// One subscriber connection (same server, settings and reconnect policy
/// as `client`) with `PSUBSCRIBE prefix:{*:idem`; it resubscribes after a
/// reconnect. What is published on this key space's channels goes to the
/// returned receiver as bytes, never decoded here (the waiter opens it). A
/// refused subscription is an error. When the connection ends, the
/// receiver ends: the layer's feed (`replay/feed.rs`) closes, its waiters
/// fall back to reading the store, and the layer subscribes again on a
/// later joining request.
async fn subscribe<C: ClientLike>(
    client: &C,
    pattern: String,
) -> Result<tokio::sync::mpsc::Receiver<(Bytes, Bytes)>, BackendError> {
    let mut builder = Builder::from_config(client.client_config());
    builder
        .set_connection_config(client.connection_config().clone())
        .set_performance_config(client.perf_config());
    if let Some(policy) = client.client_reconnect_policy() {
        builder.set_policy(policy);
    }
    let subscriber = builder.build_subscriber_client().map_err(map_err)?;
    subscriber.init().await.map_err(map_err)?;
    let mut messages = subscriber.message_rx();
    if let Err(e) = subscriber.psubscribe(pattern.clone()).await {
        let _ = subscriber.quit().await;
        return Err(map_err(e));
    }
    let resubscribe = subscriber.manage_subscriptions();
    let prefix = pattern
        .strip_suffix(":{*:idem")
        .unwrap_or_default()
        .replace('\\', "");
    let (tx, rx) = tokio::sync::mpsc::channel(PUBLICATIONS);
    tokio::spawn(async move {
        loop {
            let message = match messages.recv().await {
                Ok(message) => message,
                // Messages were dropped while we were slow: their waiters
                // read the store when their wait ends; keep listening.
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
            };
            if tx.is_closed() {
                break; // the layer dropped its feed
            }
            let channel = message.channel.as_bytes();
            if !is_ours(&prefix, channel) {
                continue;
            }
            let Some(data) = bytes_of(&message.value) else {
                continue;
            };
            // Full: dropped; its waiters look at the store within seconds.
            if let Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) =
                tx.try_send((Bytes::copy_from_slice(channel), data))
            {
                break;
            }
        }
        // `tx` drops here: the layer's feed closes.
        resubscribe.abort();
        let _ = subscriber.quit().await;
    });
    Ok(rx)
}

/// Publications held for the layer before the subscriber drops new ones.
const PUBLICATIONS: usize = 1024;

#[cfg(test)]
mod tests;
