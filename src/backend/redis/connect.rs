//! Getting a connection and keeping it: the fred [`Builder`] with this
//! crate's defaults, connecting with a bounded wait and errors that name the
//! URL (password removed, [`redact_url`]), the refusal of a TLS URL on a
//! build without TLS ([`refuse_tls_without_feature`]), the supervisor that
//! restarts fred's connection task, and the `maxmemory-policy` check at
//! connect and on every reconnection ([`EvictionCheck`]), which also runs
//! the native-command probe (`probe.rs`).

use std::future::Future;
use std::sync::{Arc, Mutex, Weak};
use std::task::Poll;
use std::time::Duration;

use fred::clients::Client;
use fred::error::{Error as FredError, ErrorKind};
use fred::interfaces::{ClientLike, EventInterface};
use fred::socket2::TcpKeepalive;
use fred::types::config::{Config, ReconnectPolicy, TcpConfig};
use fred::types::{Builder, ConnectHandle, CustomCommand, Value};
use tokio::sync::{broadcast, watch};

use super::probe::{Paths, Probed};
use crate::backend::{BackendError, BackendErrorKind};

/// The fred [`Builder`] behind [`RedisBackend::builder`](super::RedisBackend::builder)
/// (see there for the defaults).
pub(super) fn builder(url: &str) -> Result<Builder, BackendError> {
    let config = Config::from_url(url).map_err(|e| {
        BackendError::with_kind(
            BackendErrorKind::Other,
            format!("cannot parse Redis URL `{}`", redact_url(url)),
        )
        .with_source(e)
    })?;
    refuse_tls_without_feature(url, config.uses_tls())?;
    let mut builder = Builder::from_config(config);
    builder
        .set_policy(ReconnectPolicy::new_exponential(0, 50, 2_000, 2))
        .with_connection_config(|c| {
            c.connection_timeout = Duration::from_secs(2);
            c.internal_command_timeout = Duration::from_secs(2);
            c.max_command_attempts = 3;
            c.max_command_buffer_len = 10_000;
            // Small commands answered at once: no Nagle delay; and notice a
            // peer that vanished without a FIN (a dead NAT entry, a host
            // gone) instead of waiting on a half-open socket.
            c.tcp = TcpConfig {
                nodelay: Some(true),
                keepalive: Some(TcpKeepalive::new().with_time(Duration::from_secs(30))),
                ..TcpConfig::default()
            };
        })
        .with_performance_config(|p| {
            p.default_command_timeout = Duration::from_secs(1);
        });
    Ok(builder)
}

/// Refuse `url` when it asks for TLS (`rediss://`, `valkeys://`, and their
/// `-cluster` and `-sentinel` forms, as fred reads them) and `tls_enabled`
/// is false (fred was built without TLS: the `tls-rustls` feature is off).
/// fred alone would only log a warning and connect in plaintext, sending
/// `AUTH user password` in the clear; this error comes before any connection.
pub(crate) fn refuse_tls_without_feature(url: &str, tls_enabled: bool) -> Result<(), BackendError> {
    let asks_tls = url::Url::parse(url).is_ok_and(|u| {
        let scheme = u.scheme();
        scheme.starts_with("rediss") || scheme.starts_with("valkeys")
    });
    if !asks_tls || tls_enabled {
        return Ok(());
    }
    Err(BackendError::with_kind(
        BackendErrorKind::Other,
        format!(
            "Redis URL `{}` asks for TLS, but this build of tower-redis-lock has none: \
             enable its `tls-rustls` feature (refused rather than sending the credentials \
             and every command in plaintext)",
            redact_url(url)
        ),
    ))
}

/// Wait (at most 3 s) for the first connection of a client this crate
/// built; the connection task to hand to [`supervise`].
pub(super) async fn wait_connected<C: ClientLike>(
    client: &C,
    url: &str,
) -> Result<ConnectHandle, BackendError> {
    // `init` subscribes to the connect notification before connecting, so it
    // cannot miss a fast success; bound it in time ourselves.
    match tokio::time::timeout(Duration::from_secs(3), client.init()).await {
        Ok(Ok(task)) => Ok(task),
        Ok(Err(e)) => Err(unreachable_error(url, Some(e))),
        Err(_) => {
            let _ = tokio::time::timeout(Duration::from_millis(100), client.quit()).await;
            Err(unreachable_error(url, None))
        }
    }
}

/// A client that fred refused to build from `url`.
pub(super) fn config_error(url: &str, e: FredError) -> BackendError {
    BackendError::with_kind(
        BackendErrorKind::Other,
        format!("invalid Redis configuration for `{}`", redact_url(url)),
    )
    .with_source(e)
}

/// A first connection that failed (`e`) or timed out (`None`), with the
/// likely cause named: credentials, TLS, or the address.
fn unreachable_error(url: &str, e: Option<FredError>) -> BackendError {
    let url = redact_url(url);
    let message = match &e {
        Some(e) if *e.kind() == ErrorKind::Auth => format!(
            "Redis at `{url}` refused the credentials (wrong password, or the ACL user is \
             disabled or lacks a command)"
        ),
        // `ErrorKind::Tls` exists only with a TLS feature; match the text.
        Some(e) if e.to_string().contains("TLS") || e.details().contains("Certificate") => {
            format!("TLS handshake with Redis at `{url}` failed (is the server's CA trusted?)")
        }
        _ => format!(
            "cannot reach Redis at `{url}` (is redis-server running and the address right?)"
        ),
    };
    let err = BackendError::with_kind(BackendErrorKind::Unavailable, message);
    match e {
        Some(e) => err.with_source(e),
        None => err,
    }
}

/// The URL with any password replaced by `***`, for logs, start-up lines and
/// error messages, read the way a URL parser reads it (the `url` crate): the
/// userinfo password (or a user name alone, which Redis URLs also use for a
/// password) and query parameters named like `*password*`
/// (`sentinelPassword`). A URL that does not parse (or a `key=value`
/// connection string) comes back as its scheme alone (`redis://***`) or as
/// `***`: what a parser cannot read may hold a password anywhere. Any URL
/// with userinfo works, not only Redis ones (`DATABASE_URL`).
pub(crate) fn redact_url(url: &str) -> String {
    const HIDDEN: &str = "***";
    let Ok(mut parsed) = url::Url::parse(url) else {
        return match url.split_once("://") {
            Some((scheme, _))
                if !scheme.is_empty()
                    && scheme
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c)) =>
            {
                format!("{scheme}://{HIDDEN}")
            }
            _ => HIDDEN.to_owned(),
        };
    };
    if parsed.password().is_some() {
        // Cannot fail: a URL with a password has a host.
        let _ = parsed.set_password(Some(HIDDEN));
    } else if !parsed.username().is_empty() {
        let _ = parsed.set_username(HIDDEN);
    }
    if let Some(query) = parsed.query() {
        let query = query
            .split('&')
            .map(|param| match param.split_once('=') {
                Some((name, _)) if name.to_ascii_lowercase().contains("password") => {
                    format!("{name}={HIDDEN}")
                }
                _ => param.to_owned(),
            })
            .collect::<Vec<_>>()
            .join("&");
        parsed.set_query(Some(&query));
    }
    parsed.into()
}

/// Keep fred's connection task alive for clients this crate built. fred ends
/// it for good (no reconnect; every later command times out) when its router
/// meets an error it does not retry: an `ASK` redirection in fred 10.1.0
/// (the command after `ASKING` goes back to the slot's old owner, which
/// answers `ASK` again until the attempts run out), or a first connection
/// that fails. Start it again with jittered back-off (so a fleet that lost
/// the same server does not come back in lockstep); stop after `quit()`.
pub(crate) fn supervise<C: ClientLike + Clone + Send + Sync + 'static>(
    client: C,
    first: ConnectHandle,
) {
    tokio::spawn(async move {
        let mut task = first;
        let mut delay = Duration::from_millis(50);
        loop {
            let started = tokio::time::Instant::now();
            match task.await {
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "redis connection task ended; starting it again")
                }
                // `quit()`, or the runtime is shutting down.
                Ok(Ok(())) | Err(_) => return,
            }
            if started.elapsed() > Duration::from_secs(10) {
                delay = Duration::from_millis(50);
            }
            tokio::time::sleep(jittered(delay, random_u32())).await;
            delay = (delay * 2).min(Duration::from_secs(2));
            task = client.connect();
        }
    });
}

/// `delay` scaled into `[delay / 2, delay]` by the random draw `r` ("equal
/// jitter": never less than half the back-off, never in lockstep).
fn jittered(delay: Duration, r: u32) -> Duration {
    let half = delay / 2;
    half + half.mul_f64(f64::from(r) / f64::from(u32::MAX))
}

/// A random number for jitter (not a secret; 0 if the OS source fails).
fn random_u32() -> u32 {
    let mut bytes = [0u8; 4];
    let _ = getrandom::fill(&mut bytes);
    u32::from_ne_bytes(bytes)
}

/// What the `maxmemory-policy` check found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub(crate) enum EvictionPolicy {
    /// `noeviction`: lease keys are never evicted.
    NoEviction,
    /// A policy that may evict lease keys (a warning was logged).
    Evicts(String),
    /// Could not tell (`CONFIG` denied, or an unexpected reply).
    Unknown,
}

/// The `maxmemory-policy` check of one backend (shared by its clones): it
/// runs at connect and again on every reconnection of each of its
/// connections (fred's reconnect notifications: a restarted server, a
/// failover to another one, a configuration changed meanwhile), never on a
/// request's path. It warns once per policy found: again only after the
/// policy changed.
#[derive(Debug)]
pub(super) struct EvictionCheck {
    /// The evicting policy last warned about (`None` once `noeviction` is
    /// seen again).
    warned: Mutex<Option<String>>,
    /// What the last check found.
    last: Mutex<Option<EvictionPolicy>>,
    /// Dropped with the last clone of the backend: ends its listeners.
    alive: watch::Sender<()>,
}

impl Default for EvictionCheck {
    fn default() -> Self {
        Self {
            warned: Mutex::default(),
            last: Mutex::default(),
            alive: watch::channel(()).0,
        }
    }
}

/// When [`EvictionCheck::listen`] checks first, besides every reconnection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum First {
    /// Now if the client is connected already; else at its connection.
    IfConnected,
    /// Not before the next reconnection (the caller checked at connect).
    Later,
    /// The caller checked at connect, and its native-command probe got no
    /// answer: that probe again soon (see [`PROBE_AGAIN`]).
    ProbeAgain,
}

impl First {
    /// After the caller's own check at connect, which found `probed`.
    pub(super) fn after(probed: Probed) -> Self {
        if probed.answered {
            First::Later
        } else {
            First::ProbeAgain
        }
    }
}

/// A native-command probe that got no answer (a timeout, a connection lost
/// on the way, `COMMAND` denied) is asked again this long after, then after
/// twice as long each time it gets none, up to [`PROBE_AGAIN_LAST`] (seven
/// times in about two minutes); after that, at the next reconnection. Until
/// an answer, the road stays as it was (scripts, before any answer): a
/// fleet that connected during a failover finds its native road within
/// seconds, not at its next reconnection.
const PROBE_AGAIN: Duration = Duration::from_secs(1);

/// The longest wait before a probe is asked again.
const PROBE_AGAIN_LAST: Duration = Duration::from_secs(64);

/// When to ask the probe again after one that found `probed`, the last
/// wait having been `last` (`None`: the probe ran for a (re)connection).
fn probe_again(probed: Probed, last: Option<Duration>) -> Option<Duration> {
    match (probed.answered, last) {
        (true, _) => None,
        (false, None) => Some(PROBE_AGAIN),
        (false, Some(last)) if last < PROBE_AGAIN_LAST => Some(last * 2),
        (false, Some(_)) => None,
    }
}

impl EvictionCheck {
    /// Read the server's `maxmemory-policy` (`CONFIG GET`) through `client`
    /// and warn if Redis may evict lease keys (any policy but `noeviction`:
    /// an evicted lease admits a duplicate), once per policy found. A user
    /// whose ACL denies `CONFIG` gets `EvictionPolicy::Unknown` and a debug
    /// line, never an error.
    pub(super) async fn run(&self, client: &Client) -> EvictionPolicy {
        let cmd = CustomCommand::new_static("CONFIG", fred::types::ClusterHash::Random, false);
        let reply = client
            .custom::<Value, _>(cmd, vec!["GET", "maxmemory-policy"])
            .await;
        let policy = match reply {
            Ok(Value::Array(items)) if items.len() >= 2 => items[1].as_string(),
            Ok(Value::Map(map)) => map.inner().into_values().next().and_then(|v| v.as_string()),
            Ok(other) => {
                tracing::debug!(reply = ?other, "unexpected CONFIG GET maxmemory-policy reply");
                None
            }
            Err(e) => {
                tracing::debug!(error = %e, "cannot read maxmemory-policy (CONFIG denied by an ACL?); make sure it is `noeviction`");
                None
            }
        };
        let found = match policy {
            Some(p) if p == "noeviction" => {
                *lock(&self.warned) = None;
                EvictionPolicy::NoEviction
            }
            Some(p) => {
                let mut warned = lock(&self.warned);
                if warned.as_deref() != Some(p.as_str()) {
                    tracing::warn!(
                        maxmemory_policy = %p,
                        "Redis may evict lease keys (maxmemory-policy is not `noeviction`): an evicted lease admits a duplicate request; use `noeviction` or a dedicated Redis for leases"
                    );
                    *warned = Some(p.clone());
                }
                EvictionPolicy::Evicts(p)
            }
            None => EvictionPolicy::Unknown,
        };
        *lock(&self.last) = Some(found.clone());
        found
    }

    /// What the last check found (`None`: none has finished yet).
    #[cfg(test)]
    pub(super) fn last(&self) -> Option<EvictionPolicy> {
        lock(&self.last).clone()
    }

    /// Check on every (re)connection of each of `clients` (fred tells of
    /// the first connection too), through the client that connected, and
    /// first as `first` says. One task per connection, subscribed before
    /// this returns; each ends with the last clone of the backend (or when
    /// its client quits). Outside a Tokio runtime nothing is checked.
    pub(super) fn listen(self: &Arc<Self>, clients: &[Client], first: First, paths: &Arc<Paths>) {
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        for (i, client) in clients.iter().enumerate() {
            // Subscribed before looking at the connection: a connection
            // made in between is told, not missed.
            let events = client.reconnect_rx();
            let (now, again) = match first {
                First::IfConnected => (i == 0 && client.is_connected(), None),
                First::Later => (false, None),
                First::ProbeAgain => (false, (i == 0).then_some(PROBE_AGAIN)),
            };
            let alive = self.alive.subscribe();
            let check = (Arc::downgrade(self), Arc::downgrade(paths));
            handle.spawn(recheck(client.clone(), events, alive, check, now, again));
        }
    }
}

/// The native-command probe through `client`, and again on
/// [`probe_again`]'s schedule while it gets no answer; it ends there, or
/// once the backend is gone (it holds only `paths`' weak reference while
/// it waits).
pub(super) async fn probe_until_answered(client: Client, paths: Weak<Paths>) {
    let mut last = None;
    loop {
        let Some(strong) = paths.upgrade() else {
            return;
        };
        let probed = strong.probe(&client).await;
        drop(strong);
        let Some(wait) = probe_again(probed, last) else {
            return;
        };
        tokio::time::sleep(wait).await;
        last = Some(wait);
    }
}

/// One connection's listener: the check (now, if `now`), then again on
/// each reconnection, until the backend is gone; and the native-command
/// probe alone again after `again`, while it gets no answer
/// ([`probe_again`]): each connection asks again for its own probe (its
/// reconnection's; at connect, the first connection's, which the caller
/// probed through).
async fn recheck(
    client: Client,
    mut events: broadcast::Receiver<fred::types::config::Server>,
    mut alive: watch::Receiver<()>,
    (check, paths): (Weak<EvictionCheck>, Weak<Paths>),
    now: bool,
    mut again: Option<Duration>,
) {
    // Both checks, through the client that (re)connected (or the probe
    // alone, `probe_only`); `None` once the backend is gone.
    let run = |client: Client, probe_only: bool| {
        let (check, paths) = (check.upgrade(), paths.upgrade());
        async move {
            let (Some(check), Some(paths)) = (check, paths) else {
                return None;
            };
            if !probe_only {
                check.run(&client).await;
            }
            Some(paths.probe(&client).await)
        }
    };
    if now {
        let Some(probed) = run(client.clone(), false).await else {
            return;
        };
        again = probe_again(probed, None);
    }
    loop {
        let wake = {
            let mut next = std::pin::pin!(events.recv());
            let mut gone = std::pin::pin!(alive.changed());
            let mut timer = again.map(|after| Box::pin(tokio::time::sleep(after)));
            std::future::poll_fn(|cx| {
                // Only an error ever comes: the backend is gone.
                if gone.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(None);
                }
                if let Some(timer) = timer.as_mut() {
                    if timer.as_mut().poll(cx).is_ready() {
                        return Poll::Ready(Some(Wake::ProbeAgain));
                    }
                }
                next.as_mut().poll(cx).map(|event| Some(Wake::Event(event)))
            })
            .await
        };
        let (probe_only, last) = match wake {
            Some(Wake::ProbeAgain) => (true, again),
            // Reconnected, or fell behind the notifications: check.
            Some(Wake::Event(Ok(_) | Err(broadcast::error::RecvError::Lagged(_)))) => (false, None),
            // The backend is gone, or its client quit.
            None | Some(Wake::Event(Err(broadcast::error::RecvError::Closed))) => return,
        };
        let Some(probed) = run(client.clone(), probe_only).await else {
            return;
        };
        again = probe_again(probed, last);
    }
}

/// What woke a connection's listener.
enum Wake {
    /// fred's reconnect notification (or its error).
    Event(Result<fred::types::config::Server, broadcast::error::RecvError>),
    /// Time to ask the probe again.
    ProbeAgain,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
pub(crate) mod tests;
