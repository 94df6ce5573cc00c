//! Waiting for a lease across instances: [`LockBackend::watch`](crate::backend::LockBackend::watch)
//! for [`RedisBackend`](super::RedisBackend).
//!
//! One subscriber connection per backend (made on the first watch, same
//! server, settings and reconnect policy as the backend's client),
//! subscribed with `SSUBSCRIBE` (sharded pub/sub: on a cluster the channel
//! lives in its key's slot, on the node that runs the release script) to
//! the channels of exactly the keys this process has waiters on; the last
//! waiter of a key to leave unsubscribes it (`SUNSUBSCRIBE`). The
//! subscription commands go through one task, in the order they were asked
//! for, so a key's unsubscribe never overtakes its next subscribe.
//!
//! What it hears goes to the backend's [`Watchers`] (a release from another
//! instance bumps its key; the echo of our own is dropped). A reconnect of
//! the subscriber (fred resubscribes) or messages dropped because it fell
//! behind bump every watched key: a release may have been missed, so each
//! waiter looks once more. Its connection failing ends every watch (the
//! waiters look with a back-off). If the server refuses `SPUBLISH` or
//! `SSUBSCRIBE` to this client (an ACL without the channel), watching is
//! off for the life of the backend and waiters look with a back-off.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;
use fred::clients::{Client, SubscriberClient};
use fred::error::Error as FredError;
use fred::interfaces::{ClientLike, EventInterface, PubsubInterface};
use fred::types::Builder;
use tokio::sync::{mpsc, oneshot};

use super::scripts::map_err;
use crate::backend::contract::Watch;
use crate::backend::watchers::{Subscription, Watchers};
use crate::backend::{BackendError, BackendFuture};

/// The watched keys of one backend and the task that keeps its
/// subscriptions (shared by the backend's clones).
pub(crate) struct Subscriptions {
    /// The watched keys (the lease calls bump and mark them).
    pub(super) watchers: Arc<Watchers>,
    tx: mpsc::UnboundedSender<Subscription>,
    /// The task's receiver, until the first watch starts it.
    rx: Mutex<Option<mpsc::UnboundedReceiver<Subscription>>>,
    /// The backend's client, whose settings the subscriber copies, until
    /// the first watch starts the task.
    client: Mutex<Option<Client>>,
    /// Set when the server refused pub/sub to this client (ACL).
    refused: Arc<AtomicBool>,
}

impl std::fmt::Debug for Subscriptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscriptions")
            .field("watchers", &self.watchers)
            .field("refused", &self.refused.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Subscriptions {
    /// Subscriptions for the backend over `client` (nothing is connected
    /// before the first watch).
    pub(crate) fn new(client: &Client) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        Self {
            watchers: Arc::new(Watchers::with_subscriber(tx.clone())),
            tx,
            rx: Mutex::new(Some(rx)),
            client: Mutex::new(Some(client.clone())),
            refused: Arc::default(),
        }
    }

    /// Watch `key`: subscribed to its channel when the future resolves.
    /// `None` once the server refused pub/sub to this client.
    pub(crate) fn watch(&self, key: &Bytes) -> Option<BackendFuture<Watch>> {
        if self.refused.load(Ordering::Relaxed) {
            return None;
        }
        self.start();
        let (watch, first) = self.watchers.watch(key);
        if !first {
            return Some(BackendFuture::ready(Ok(watch)));
        }
        let (reply, answer) = oneshot::channel();
        if self
            .tx
            .send(Subscription::Subscribe(key.clone(), reply))
            .is_err()
        {
            return None;
        }
        Some(BackendFuture::new(async move {
            match answer.await {
                Ok(Ok(())) => Ok(watch),
                Ok(Err(e)) => Err(e),
                Err(_) => Err(BackendError::new("the subscriber task ended")),
            }
        }))
    }

    /// Start the subscription task (once, inside a runtime).
    fn start(&self) {
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let rx = self.rx.lock().unwrap_or_else(|p| p.into_inner()).take();
        let client = self.client.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let (Some(rx), Some(client)) = (rx, client) {
            handle.spawn(run(
                client,
                rx,
                Arc::downgrade(&self.watchers),
                self.refused.clone(),
            ));
        }
    }
}

/// A connected subscriber and its listening tasks.
struct Live {
    client: SubscriberClient,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// Cleared when its connection failed: the next subscribe makes a new
    /// one.
    healthy: Arc<AtomicBool>,
}

impl Live {
    async fn end(self) {
        for task in self.tasks {
            task.abort();
        }
        let _ = self.client.quit().await;
    }
}

/// The subscription task: subscribe and unsubscribe in the order asked, on
/// one subscriber made on the first subscribe (and again after its
/// connection failed).
async fn run(
    client: Client,
    mut rx: mpsc::UnboundedReceiver<Subscription>,
    watchers: Weak<Watchers>,
    refused: Arc<AtomicBool>,
) {
    let mut live: Option<Live> = None;
    while let Some(cmd) = rx.recv().await {
        match cmd {
            Subscription::Subscribe(key, reply) => {
                if live
                    .as_ref()
                    .is_some_and(|l| !l.healthy.load(Ordering::Acquire))
                {
                    if let Some(old) = live.take() {
                        old.end().await;
                    }
                }
                if live.is_none() {
                    match connect(&client, &key, &watchers).await {
                        Ok(l) => live = Some(l),
                        Err(e) => {
                            note_refusal(&e, &refused);
                            unsubscribed(&watchers, &key);
                            let _ = reply.send(Err(map_err(e)));
                            continue;
                        }
                    }
                }
                let Some(l) = &live else { continue };
                let result = l.client.ssubscribe(channel(&key)).await;
                if let Err(e) = &result {
                    note_refusal(e, &refused);
                    unsubscribed(&watchers, &key);
                }
                let _ = reply.send(result.map_err(map_err));
            }
            Subscription::Unsubscribe(key) => {
                // Watched again since: keep the subscription.
                let watched = watchers.upgrade().is_some_and(|w| w.is_watched(&key));
                if let (false, Some(l)) = (watched, &live) {
                    let _ = l.client.sunsubscribe(channel(&key)).await;
                }
            }
        }
    }
    if let Some(l) = live {
        l.end().await;
    }
}

/// `key`'s subscription failed: none of its watches is live (see
/// [`Watchers::unsubscribed`]).
fn unsubscribed(watchers: &Weak<Watchers>, key: &Bytes) {
    if let Some(w) = watchers.upgrade() {
        w.unsubscribed(key);
    }
}

/// A refusal for lack of permission turns watching off for good.
fn note_refusal(e: &FredError, refused: &AtomicBool) {
    if e.details().contains("NOPERM") || e.details().contains("no permissions") {
        tracing::warn!(error = %e, "Redis refused sharded pub/sub to this client (ACL): waiting requests look for the lease with a back-off instead of being woken by its release");
        refused.store(true, Ordering::Relaxed);
    }
}

/// A key's channel: the key itself (its slot on a cluster).
fn channel(key: &Bytes) -> fred::bytes_utils::Str {
    fred::bytes_utils::Str::from(String::from_utf8_lossy(key).into_owned())
}

/// Make and connect a subscriber like `like` (same server, settings and
/// reconnect policy), check that this client may publish on the channel of
/// `key` (an empty message, which no waiter takes for a release), and
/// start listening.
async fn connect(like: &Client, key: &Bytes, watchers: &Weak<Watchers>) -> Result<Live, FredError> {
    let mut builder = Builder::from_config(like.client_config());
    builder
        .set_connection_config(like.connection_config().clone())
        .set_performance_config(like.perf_config());
    if let Some(policy) = like.client_reconnect_policy() {
        builder.set_policy(policy);
    }
    let client = builder.build_subscriber_client()?;
    client.init().await?;
    if let Err(e) = client.spublish::<i64, _, _>(channel(key), "").await {
        let _ = client.quit().await;
        return Err(e);
    }
    let healthy = Arc::new(AtomicBool::new(true));
    let mut tasks = vec![client.manage_subscriptions()];
    let mut messages = client.message_rx();
    let heard = watchers.clone();
    tasks.push(tokio::spawn(async move {
        use tokio::sync::broadcast::error::RecvError;
        loop {
            let message = match messages.recv().await {
                Ok(message) => message,
                Err(RecvError::Lagged(_)) => {
                    match heard.upgrade() {
                        Some(w) => w.bump_all(),
                        None => return,
                    }
                    continue;
                }
                Err(RecvError::Closed) => return,
            };
            let Some(w) = heard.upgrade() else { return };
            let data: &[u8] = match &message.value {
                fred::types::Value::Bytes(b) => b,
                fred::types::Value::String(s) => s.as_bytes(),
                _ => continue,
            };
            w.heard(message.channel.as_bytes(), data);
        }
    }));
    let mut reconnects = client.reconnect_rx();
    let woken = watchers.clone();
    tasks.push(tokio::spawn(async move {
        // fred resubscribes after a reconnect; releases made meanwhile were
        // not heard.
        while reconnects.recv().await.is_ok() {
            match woken.upgrade() {
                Some(w) => w.bump_all(),
                None => return,
            }
        }
    }));
    let mut errors = client.error_rx();
    let failed = watchers.clone();
    let flag = healthy.clone();
    tasks.push(tokio::spawn(async move {
        // The connection failed: nothing is heard until it is back; end
        // the watches so that their waiters look with a back-off.
        while errors.recv().await.is_ok() {
            flag.store(false, Ordering::Release);
            match failed.upgrade() {
                Some(w) => w.close_all(),
                None => return,
            }
        }
    }));
    Ok(Live {
        client,
        tasks,
        healthy,
    })
}
