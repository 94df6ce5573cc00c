//! Redlock: one lease held on a majority of independent backends
//! (see [`RedlockBackend`]).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use bytes::Bytes;
use tokio::sync::mpsc;

use super::in_flight::InFlight;
use super::{Acquire, Backend, BackendError, BackendErrorKind, BackendFuture, LockBackend, Token};
use crate::run_to_end::RunToEnd;

/// Default bound on each node's answer.
const DEFAULT_NODE_TIMEOUT: Duration = Duration::from_millis(50);

/// A lease held on a majority of independent nodes (Redlock).
///
/// Each node is any [`LockBackend`], normally a [`RedisBackend`](super::RedisBackend)
/// on its own independent primary (not a replica, not a cluster shard of the
/// others).
///
/// The algorithm from the Redis documentation ("Distributed Locks with
/// Redis"), with every step sent to all nodes at once:
///
/// 1. note the start time, send `acquire` to all N nodes in parallel, each
///    bounded by a short per-node timeout;
/// 2. the lease is ours once a quorum (N/2 + 1) answered "acquired" **and** the
///    validity `ttl - elapsed - drift` (drift = 1 % of the TTL + 2 ms) is still
///    positive; the decision is made as soon as the answers settle it, so the
///    wall time is one round trip to the quorum-th fastest node;
/// 3. otherwise the nodes that did (or may have: an error answer, a timeout)
///    set the key are released at once, in the background; the answer is
///    "held" (409) when another owner's votes alone leave no quorum, an error
///    (503) when failed nodes cost it;
/// 4. release and extend are sent to all nodes in parallel as well.
///
/// The validity is reported with the lease
/// (`Acquire::Acquired { validity, .. }`): [`Lease::remaining`](crate::Lease::remaining)
/// and renewal count from it, not from the whole TTL.
///
/// # Honest limits
///
/// Redlock keeps a lease through the loss of a minority of nodes, which one
/// primary (or a primary with an asynchronous replica) cannot. It is still an
/// *efficiency* lock, not a correctness guarantee (Martin Kleppmann, "How to
/// do distributed locking", 2016): it assumes bounded network delay, bounded
/// process pauses and clocks that advance at roughly the same rate on every
/// node. A GC pause or a stalled handler longer than the validity, a node
/// clock jumping forward (expiring the key early), or a node restarting
/// without persistence while it held one of the quorum's votes can let two
/// holders in. It issues no fencing token. Where a duplicate execution would
/// be wrong rather than wasteful, make the protected operation itself
/// idempotent (stored responses, a unique constraint in the database).
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_redis_lock::{backend::RedlockBackend, key::Route, RedisLockLayer};
///
/// let backend = RedlockBackend::connect(&[
///     "redis://10.0.0.1:6379",
///     "redis://10.0.0.2:6379",
///     "redis://10.0.0.3:6379",
/// ])
/// .await?;
/// let layer = RedisLockLayer::new(backend, Route);
/// # let _ = layer; Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedlockBackend {
    nodes: Arc<[Arc<dyn LockBackend>]>,
    node_timeout: Duration,
    /// Releases and abandoned acquires on their way (`drain` waits for
    /// them: a node counts a release only once it is sent to it).
    in_flight: Arc<InFlight>,
}

impl fmt::Debug for RedlockBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedlockBackend")
            .field("nodes", &self.nodes.len())
            .field("quorum", &self.quorum())
            .field("node_timeout", &self.node_timeout)
            .finish()
    }
}

impl RedlockBackend {
    /// Redlock over `nodes` (at least one; use an odd number, 3 or 5).
    /// Shared nodes are `Arc`s (`Arc<dyn LockBackend>` too).
    pub fn new<B: LockBackend>(nodes: impl IntoIterator<Item = B>) -> Result<Self, BackendError> {
        let nodes: Vec<Arc<dyn LockBackend>> = nodes
            .into_iter()
            .map(|b| Arc::new(b) as Arc<dyn LockBackend>)
            .collect();
        if nodes.is_empty() {
            return Err(BackendError::with_kind(
                BackendErrorKind::Other,
                "redlock needs at least one node",
            ));
        }
        Ok(Self {
            nodes: nodes.into(),
            node_timeout: DEFAULT_NODE_TIMEOUT,
            in_flight: Arc::default(),
        })
    }

    /// Bound on each node's answer (default 50 ms); a node that misses it
    /// counts as failed for that call. Keep it well below the TTL and below
    /// the layer's deadline.
    ///
    /// ```
    /// # use tower_redis_lock::{backend::RedlockBackend, MemoryBackend};
    /// let b = RedlockBackend::new([MemoryBackend::new()]).unwrap().node_timeout(std::time::Duration::from_millis(20));
    /// ```
    pub fn node_timeout(mut self, timeout: Duration) -> Self {
        self.node_timeout = crate::settings::at_least_1ms(timeout);
        self
    }

    /// Votes needed: `N/2 + 1`.
    pub(crate) fn quorum(&self) -> usize {
        self.nodes.len() / 2 + 1
    }

    /// The clock-drift allowance for `ttl`: 1 % of it plus 2 ms.
    pub(crate) fn drift(ttl: Duration) -> Duration {
        ttl / 100 + Duration::from_millis(2)
    }

    /// Send `call` to every node at once; answers arrive on the receiver as
    /// `(node index, result)`, each within the node timeout. The tasks run on
    /// even if the receiver is dropped.
    fn fan_out<T, F>(&self, call: F) -> mpsc::UnboundedReceiver<(usize, Result<T, BackendError>)>
    where
        T: Send + 'static,
        F: Fn(&dyn LockBackend) -> BackendFuture<T>,
    {
        let (tx, rx) = mpsc::unbounded_channel();
        for (i, node) in self.nodes.iter().enumerate() {
            let fut = call(node.as_ref());
            let tx = tx.clone();
            let timeout = self.node_timeout;
            tokio::spawn(async move {
                let res = match tokio::time::timeout(timeout, fut).await {
                    Ok(res) => res,
                    Err(_) => Err(BackendError::timeout(timeout)),
                };
                let _ = tx.send((i, res));
            });
        }
        rx
    }

    /// Take the lease on a quorum: [`Acquire::Acquired`] with the validity
    /// left (`ttl - elapsed - drift`: how long the lease is safe to rely
    /// on), or [`Acquire::Held`] when another owner holds it on enough nodes
    /// that no quorum was possible. `Err` when no quorum acquired and the
    /// other owner's votes alone do not rule one out (failed nodes cost
    /// it), or when the quorum came too late (validity used up).
    pub(crate) async fn lock(
        &self,
        key: &Bytes,
        token: &Token,
        ttl: Duration,
    ) -> Result<Acquire, BackendError> {
        let start = Instant::now();
        let n = self.nodes.len();
        let quorum = self.quorum();
        let mut rx = {
            let key = key.clone();
            let token = *token;
            self.fan_out(move |node| node.acquire(&key, &token, ttl))
        };
        let mut acquired = Vec::with_capacity(n);
        let mut held: Vec<Option<Duration>> = Vec::new();
        // Nodes that answered an error: the command may still have set the
        // key there (a reply lost after it ran, a timeout), so their votes
        // are given back with ours when the attempt fails.
        let mut failed = Vec::new();
        let mut last_error = None;
        let mut answered = 0;
        while let Some((i, res)) = rx.recv().await {
            answered += 1;
            match res {
                Ok(Acquire::Acquired { .. }) => acquired.push(i),
                Ok(Acquire::Held { retry_after }) => held.push(retry_after),
                Err(e) => {
                    failed.push(i);
                    last_error = Some(e);
                }
            }
            if acquired.len() >= quorum {
                let validity = ttl
                    .checked_sub(start.elapsed())
                    .and_then(|v| v.checked_sub(Self::drift(ttl)));
                if let Some(validity) = validity.filter(|v| !v.is_zero()) {
                    return Ok(Acquire::Acquired {
                        fence: None,
                        validity: Some(validity),
                    });
                }
                acquired.extend(failed);
                self.abandon(key, token, acquired, rx);
                return Err(BackendError::with_kind(
                    BackendErrorKind::Timeout,
                    format!(
                        "redlock quorum reached after {} ms, past the {} ms TTL minus drift",
                        start.elapsed().as_millis(),
                        ttl.as_millis()
                    ),
                ));
            }
            if acquired.len() + (n - answered) < quorum {
                break;
            }
        }
        // No quorum possible. Whether another owner holds it (409) or failed
        // nodes cost it (503) may depend on the answers still in flight:
        // with errors among the answers, wait for those (each bounded by the
        // node timeout) until the holder's votes alone settle it.
        if !failed.is_empty() {
            while held.len() <= n - quorum {
                let Some((i, res)) = rx.recv().await else {
                    break;
                };
                match res {
                    Ok(Acquire::Acquired { .. }) => acquired.push(i),
                    Ok(Acquire::Held { retry_after }) => held.push(retry_after),
                    Err(e) => {
                        failed.push(i);
                        last_error = Some(e);
                    }
                }
            }
        }
        // Undo what we set (or may have set), report why.
        let acquired_count = acquired.len();
        let errors = failed.len();
        acquired.extend(failed);
        self.abandon(key, token, acquired, rx);
        // Held (409) only when the other owner's votes alone leave no
        // quorum; when the errors cost it, the backend is unavailable (503).
        if held.len() > n - quorum {
            return Ok(Acquire::Held {
                retry_after: quorum_free_after(acquired_count, &held, quorum),
            });
        }
        let mut err = BackendError::with_kind(
            BackendErrorKind::Unavailable,
            format!(
                "redlock: only {acquired_count} of {n} nodes acquired ({} held by another \
                 owner, {errors} failed), quorum is {quorum}",
                held.len()
            ),
        );
        if let Some(e) = last_error {
            err = err.with_source(e);
        }
        Err(err)
    }

    /// Release on the nodes in `acquired` (those that said "acquired" and
    /// those that answered an error) now, and on every node whose acquire is
    /// still in flight once it answers (unless it answered "held").
    fn abandon(
        &self,
        key: &Bytes,
        token: &Token,
        acquired: Vec<usize>,
        mut rx: mpsc::UnboundedReceiver<(usize, Result<Acquire, BackendError>)>,
    ) {
        let nodes = self.nodes.clone();
        let key = key.clone();
        let token = *token;
        let timeout = self.node_timeout;
        let in_flight = self.in_flight.clone();
        let ticket = in_flight.ticket();
        tokio::spawn(async move {
            let _ticket = ticket;
            let release = |i: usize| {
                let fut = nodes[i].release(&key, &token);
                let ticket = in_flight.ticket();
                tokio::spawn(async move {
                    let _ = tokio::time::timeout(timeout, fut).await;
                    drop(ticket);
                });
            };
            for i in acquired {
                release(i);
            }
            while let Some((i, res)) = rx.recv().await {
                if !matches!(res, Ok(Acquire::Held { .. })) {
                    release(i);
                }
            }
        });
    }

    /// Run a compare-and-act step on all nodes; `Ok(true)` once a quorum
    /// said yes, `Ok(false)` once the nodes that said no leave too few for
    /// a quorum, `Err` otherwise (a node that failed or did not answer may
    /// hold the lease: it is no "no").
    async fn quorum_of<F>(&self, what: &str, call: F) -> Result<bool, BackendError>
    where
        F: Fn(&dyn LockBackend) -> BackendFuture<bool>,
    {
        let n = self.nodes.len();
        let quorum = self.quorum();
        let mut rx = self.fan_out(call);
        let (mut yes, mut no) = (0, 0);
        let mut last_error = None;
        while let Some((_, res)) = rx.recv().await {
            match res {
                Ok(true) => yes += 1,
                Ok(false) => no += 1,
                Err(e) => last_error = Some(e),
            }
            if yes >= quorum {
                return Ok(true);
            }
            if n - no < quorum {
                return Ok(false);
            }
        }
        let mut err = BackendError::with_kind(
            BackendErrorKind::Unavailable,
            format!(
                "redlock {what}: only {} of {n} nodes answered, quorum is {quorum}",
                yes + no
            ),
        );
        if let Some(e) = last_error {
            err = err.with_source(e);
        }
        Err(err)
    }

    /// Connect to independent Redis primaries, one URL each (any form
    /// [`RedisBackend::builder`](super::RedisBackend::builder) accepts), all
    /// at once, and return as soon as a quorum of them connected (each node
    /// is given up to 3 s); an error if no quorum did by then. Nodes not yet
    /// connected keep connecting, and reconnecting, in the background; until
    /// it is up, such a node counts as down in every quorum (so right after
    /// the start, one more node lost can leave no quorum for a moment where
    /// waiting for every node would have left one). Commands are never
    /// re-sent after a
    /// lost reply (`max_command_attempts = 1`); one queued while its node is
    /// reconnecting may still run there once the node is back, however long
    /// that takes (a lease call carries no fred command timeout: the node
    /// timeout bounds its caller's wait, not the command), after the node
    /// timeout gave up on it: such a late acquire holds only that minority
    /// node, and its caller's release is queued behind it.
    ///
    /// A URL that cannot be parsed is an error naming its position
    /// (`redlock node 2 of 3`; the URL itself is withheld, it may hold a
    /// password); nothing connects then. When fewer than a quorum connect,
    /// the error names the unreachable URLs, passwords removed.
    #[cfg(feature = "redis")]
    pub async fn connect<S: AsRef<str>>(urls: &[S]) -> Result<Self, BackendError> {
        use fred::interfaces::ClientLike;

        use super::redis::connect::redact_url;

        if urls.is_empty() {
            return Err(BackendError::with_kind(
                BackendErrorKind::Other,
                "redlock needs at least one Redis URL",
            ));
        }
        let mut clients = Vec::with_capacity(urls.len());
        for (i, url) in urls.iter().enumerate() {
            let url = url.as_ref().trim();
            // Which one: a URL that does not parse is not shown (it may hold
            // a password anywhere).
            let mut builder = super::RedisBackend::builder(url).map_err(|e| {
                BackendError::with_kind(
                    BackendErrorKind::Other,
                    format!("redlock node {} of {}", i + 1, urls.len()),
                )
                .with_source(e)
            })?;
            builder
                .with_config(|c| c.fail_fast = false)
                .with_connection_config(|c| c.max_command_attempts = 1);
            let client = builder.build().map_err(|e| {
                BackendError::with_kind(
                    BackendErrorKind::Other,
                    format!("invalid Redis configuration for `{}`", redact_url(url)),
                )
                .with_source(e)
            })?;
            clients.push((url, client));
        }
        // Only once every URL parsed: start connecting.
        for (_, client) in &clients {
            super::redis::connect::supervise(client.clone(), client.connect());
        }
        // Each node gets 3 s; the first quorum to connect ends the wait.
        let mut waits = tokio::task::JoinSet::new();
        for (i, (_, c)) in clients.iter().enumerate() {
            let c = c.clone();
            waits.spawn(async move {
                let up = tokio::time::timeout(Duration::from_secs(3), c.wait_for_connect())
                    .await
                    .is_ok_and(|r| r.is_ok());
                (i, up)
            });
        }
        let quorum = clients.len() / 2 + 1;
        let urls: Vec<String> = clients.iter().map(|(url, _)| redact_url(url)).collect();
        // Per node: `None` while its wait runs, then whether it connected.
        let mut up: Vec<Option<bool>> = vec![None; clients.len()];
        let mut connected = 0;
        while connected < quorum {
            match waits.join_next().await {
                Some(Ok((i, ok))) => {
                    up[i] = Some(ok);
                    connected += usize::from(ok);
                }
                // A wait that panicked leaves its node unknown: unreachable.
                Some(Err(_)) => {}
                None => break,
            }
        }
        let named = |wanted: fn(Option<bool>) -> bool| -> Vec<&str> {
            urls.iter()
                .zip(&up)
                .filter(|(_, u)| wanted(**u))
                .map(|(url, _)| url.as_str())
                .collect()
        };
        if connected < quorum {
            // Every wait ended (the loop stops early only at a quorum).
            for (_, c) in &clients {
                let _ = tokio::time::timeout(Duration::from_millis(100), c.quit()).await;
            }
            return Err(BackendError::with_kind(
                BackendErrorKind::Unavailable,
                format!(
                    "redlock: cannot reach a quorum ({quorum} of {}); unreachable: {}",
                    clients.len(),
                    named(|u| u != Some(true)).join(", ")
                ),
            ));
        }
        let failed = named(|u| u == Some(false));
        if !failed.is_empty() {
            tracing::warn!(
                unreachable = %failed.join(", "),
                "redlock: starting with a quorum but not all nodes; the rest keep reconnecting"
            );
        }
        // The waits still running are the nodes still connecting: a warning
        // for each that does not within its 3 s, without holding up the
        // start (a healthy node is up in a moment and says nothing).
        if !waits.is_empty() {
            tokio::spawn(async move {
                while let Some(joined) = waits.join_next().await {
                    if let Ok((i, false)) = joined {
                        tracing::warn!(
                            node = %urls[i],
                            "redlock: a node did not connect within 3 s; it keeps reconnecting"
                        );
                    }
                }
            });
        }
        Self::new(
            clients
                .into_iter()
                .map(|(_, c)| super::RedisBackend::new_owned(c)),
        )
    }
}

/// When will `quorum` nodes be free: our own votes are free now, a holder's
/// node when its lease runs out. `None` if too little is known: fewer
/// known times than a quorum (holders whose time left is unknown, nodes
/// that answered an error: an even number of nodes can answer "held" with
/// two of four erring), where the latest known time would only be a lower
/// bound.
fn quorum_free_after(ours: usize, held: &[Option<Duration>], quorum: usize) -> Option<Duration> {
    let mut free: Vec<Duration> = std::iter::repeat_n(Duration::ZERO, ours)
        .chain(held.iter().flatten().copied())
        .collect();
    free.sort_unstable();
    free.get(quorum - 1).copied()
}

impl LockBackend for RedlockBackend {
    fn acquire(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        let this = self.clone();
        let key = key.clone();
        let token = *token;
        BackendFuture::new(async move { this.lock(&key, &token, ttl).await })
    }

    /// Runs to its end when its future is dropped (the layer drops it at
    /// its deadline, or when the request goes away): on a task of its own.
    fn release(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        let this = self.clone();
        let key = key.clone();
        let token = *token;
        // Counted from the call, not from the first poll: a release handed
        // to a task (a dropped lease guard) before `drain` is still waited
        // for.
        let ticket = self.in_flight.ticket();
        let run = RunToEnd::new(async move {
            let released = this
                .quorum_of("release", |node| node.release(&key, &token))
                .await;
            drop(ticket);
            released
        });
        BackendFuture::new(async move { run.await.unwrap_or(Ok(false)) })
    }

    fn extend(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<bool> {
        let this = self.clone();
        let key = key.clone();
        let token = *token;
        BackendFuture::new(async move {
            let start = Instant::now();
            let ok = this
                .quorum_of("extend", |node| node.extend(&key, &token, ttl))
                .await?;
            Ok(ok && start.elapsed() + Self::drift(ttl) < ttl)
        })
    }

    /// Redlock issues no fencing token (see the type's docs): a plain
    /// acquire, `fence: None`.
    fn acquire_fenced(&self, key: &Bytes, token: &Token, ttl: Duration) -> BackendFuture<Acquire> {
        self.acquire(key, token, ttl)
    }

    /// Releases of a quorum are not heard: a plain release.
    fn release_notify(&self, key: &Bytes, token: &Token) -> BackendFuture<bool> {
        self.release(key, token)
    }

    /// Hears no releases: waiting requests look again with a back-off.
    fn watch(&self, _key: &Bytes) -> Option<BackendFuture<crate::backend::contract::Watch>> {
        None
    }

    fn native_calls(&self) -> Option<u64> {
        None
    }
}

impl Backend for RedlockBackend {
    fn name(&self) -> &'static str {
        "redlock"
    }

    fn is_in_process(&self) -> bool {
        false
    }

    /// Waits for this backend's own releases and abandoned acquires (sent
    /// to every node), then for each node's.
    fn drain(&self, timeout: Duration) -> BackendFuture<()> {
        let nodes = self.nodes.clone();
        let in_flight = self.in_flight.clone();
        // `None`: too far to name, as long as it takes.
        let until = Instant::now().checked_add(timeout);
        let left = move || {
            until.map_or(Duration::MAX, |u| {
                u.saturating_duration_since(Instant::now())
            })
        };
        BackendFuture::new(async move {
            let mut first_error = None;
            if let Err(pending) = in_flight.idle(left()).await {
                first_error = Some(BackendError::with_kind(
                    BackendErrorKind::Timeout,
                    format!(
                        "{pending} redlock release(s) still on their way after {} ms; those \
                         leases expire after their TTL",
                        timeout.as_millis()
                    ),
                ));
            }
            for node in nodes.iter() {
                // One deadline for all nodes: the whole drain takes ~`timeout` at most.
                let left = left();
                if let Err(e) = node.drain(left).await {
                    first_error.get_or_insert(e);
                }
            }
            first_error.map_or(Ok(()), Err)
        })
    }
}

#[cfg(test)]
mod tests;
