//! [`IdempotencyBackend`] for [`RedisBackend`], the hub of a claim's
//! calls: one hash per entry, `prefix:{scope}:digest:idem`, so claim and
//! record share a key, and the scope's quota keys (`prefix:{scope}:idem-quota`,
//! `…:idem-bytes`) share its Cluster slot. Fields: `s` state (`p` claimed,
//! `d` done, `a` abandoned), `t` claim token, `f` fingerprint, `r` sealed
//! record, `w` a duplicate waits (see `scripts.rs`). Each step is a
//! [`Job`] (one `EVALSHA`) on the entry's connection of the same dispatch
//! as the leases (`dispatch.rs`), sent at once rather than behind the
//! lane's batch in flight (`Job::keeps_lane`); an abandoned claim is
//! delivered like a release (`deliver.rs`).
//! And the pub/sub subscriber that feeds joining duplicates.

use std::time::Duration;

use bytes::Bytes;
use fred::clients::Client;
use fred::interfaces::{ClientLike, EventInterface, PubsubInterface};
use fred::types::Builder;

use super::deliver::After;
use super::job::Job;
use super::scripts::{bytes_of, map_err};
use super::RedisBackend;
use crate::backend::idempotency::IdempotencyBackend;
use crate::backend::{BackendError, BackendFuture, Claim, ClaimTerms, EntryKey, Token};
use crate::key::KeySpace;

/// How much longer than its deadline the layer waits for a claim (see
/// [`IdempotencyBackend::claim_timeout`] below).
const CLAIM_BACKSTOP: Duration = Duration::from_millis(50);

impl IdempotencyBackend for RedisBackend {
    fn claim(
        &self,
        key: &EntryKey,
        token: &Token,
        fingerprint: &[u8],
        terms: &ClaimTerms,
    ) -> BackendFuture<Claim> {
        self.deliveries.saw_ttl(terms.lease);
        let hex = token.to_hex();
        let job = Job::claim(key, hex, fingerprint, terms);
        // fred's own timer, at the layer's deadline: a claim still queued
        // (in a reconnection, or sent before the connection was found dead)
        // when the layer gives up is marked timed out and never sent.
        // Dropped by the layer's timer instead, it would stay queued, to
        // land once Redis is back and take the key from a request that
        // still runs, whose record would then be refused (the abandon that
        // follows may itself time out before it is sent: it cannot be what
        // undoes such a claim). The layer waits a little longer than this
        // (`claim_timeout`), so that fred's timer is the one that fires.
        let (client, within) = (self.dispatch.connection(&job).clone(), terms.timeout);
        BackendFuture::new(async move {
            job.read(job.send_within(&client, within).await)?
                .into_claim()
        })
    }

    fn complete(
        &self,
        key: &EntryKey,
        token: &Token,
        fingerprint: &[u8],
        record: &Bytes,
        retention: Duration,
    ) -> BackendFuture<bool> {
        let job = Job::complete(key, token.to_hex(), fingerprint, record, retention);
        let client = self.dispatch.connection(&job).clone();
        BackendFuture::new(async move { job.read(job.send(&client).await)?.into_done() })
    }

    fn extend(&self, key: &EntryKey, token: &Token, lease: Duration) -> BackendFuture<bool> {
        self.deliveries.saw_ttl(lease);
        let job = Job::extend_claim(key, token.to_hex(), lease);
        let client = self.dispatch.connection(&job).clone();
        BackendFuture::new(async move { job.read(job.send(&client).await)?.into_done() })
    }

    fn abandon(&self, key: &EntryKey, token: &Token, lease: Duration) -> BackendFuture<bool> {
        // Delivered like a release: in the caller's future while it waits,
        // on a task of its own once it stops waiting, retried until Redis
        // answers or a lease has passed.
        let job = Job::abandon(key, token.to_hex(), lease);
        let first = self.dispatch.send(job.clone());
        let delivery = self
            .deliveries
            .deliver(&self.dispatch, job, first, After::Nothing);
        BackendFuture::new(delivery)
    }

    /// The layer's deadline and a little more: a claim gives up by fred's
    /// own timer, at the deadline (see [`claim`](Self::claim)); the layer's
    /// timer is only the backstop.
    fn claim_timeout(&self, deadline: Duration) -> Duration {
        deadline.saturating_add(CLAIM_BACKSTOP)
    }

    fn hold(&self) -> Option<Box<dyn Send>> {
        Some(Box::new(self.deliveries.ticket()))
    }

    fn feed(
        &self,
        key_space: &KeySpace,
    ) -> Option<BackendFuture<tokio::sync::mpsc::Receiver<(Bytes, Bytes)>>> {
        let client = self.dispatch.clients()[0].clone();
        let prefix = key_space.prefix().to_owned();
        Some(BackendFuture::new(async move {
            subscribe(&client, prefix).await
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
/// refused subscription is an error. When the subscriber quits, the
/// receiver ends: the layer's feed (`idempotency/feed.rs`) closes, its
/// waiters fall back to reading the store, and the layer subscribes again
/// on a later joining request. A connection lost and not reconnected (a
/// client built without a reconnect policy) does not end the receiver
/// (fred 10.1 closes it on `QUIT` only): its waiters are then woken by
/// their periodic look at the store, not by publications.
async fn subscribe(
    client: &Client,
    prefix: String,
) -> Result<tokio::sync::mpsc::Receiver<(Bytes, Bytes)>, BackendError> {
    let mut builder = Builder::from_config(client.client_config());
    builder
        .set_connection_config(client.connection_config().clone())
        .set_performance_config(client.perf_config());
    if let Some(policy) = client.client_reconnect_policy() {
        builder.set_policy(policy);
    }
    let subscriber = builder.build_subscriber_client().map_err(map_err)?;
    // Until it is handed to its task below, a subscriber given up on (this
    // future dropped: the layer's bound passed, its request went away)
    // quits: fred's connection task outlives the client handle.
    let mut unkept = QuitUnlessKept(Some(subscriber.clone()));
    subscriber.init().await.map_err(map_err)?;
    let mut messages = subscriber.message_rx();
    if let Err(e) = subscriber.psubscribe(channel_pattern(&prefix)).await {
        return Err(map_err(e));
    }
    unkept.0 = None;
    let resubscribe = subscriber.manage_subscriptions();
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

/// A subscriber that quits when dropped, unless taken out (see
/// [`subscribe`]).
struct QuitUnlessKept(Option<fred::clients::SubscriberClient>);

impl Drop for QuitUnlessKept {
    fn drop(&mut self) {
        let Some(subscriber) = self.0.take() else {
            return;
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            drop(runtime.spawn(async move {
                let _ = subscriber.quit().await;
            }));
        }
    }
}

/// Publications held for the layer before the subscriber drops new ones.
const PUBLICATIONS: usize = 1024;

#[cfg(test)]
mod tests;
