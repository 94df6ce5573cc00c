//! What a lock layer was built with: [`Config`], shared by the layer, its
//! services, their futures, the leases they hold and its
//! [`Locker`](super::Locker)s; and the choices a builder makes
//! ([`ReleaseMode`]). The bottom of the folder: the engines import it, and
//! it imports only the wait queue's type (`wait.rs`).

use std::sync::Arc;
use std::time::Duration;

use super::wait::WaitQueue;
use crate::backend::{BackendFuture, LockBackend, Token};
use crate::renewal::Renewal;
use crate::retry_after::HoldTimes;
use crate::settings::Settings;
use crate::stats::counters::Counters;
use crate::stats::LockOutcome;

/// Default lease time to live.
pub(crate) const DEFAULT_TTL: Duration = Duration::from_secs(10);

/// When the lease is given back (set with
/// [`fire_and_forget`](crate::RedisLockLayer::fire_and_forget) and
/// [`hold_until_ttl`](crate::RedisLockLayer::hold_until_ttl)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum ReleaseMode {
    /// Release when the response body ends, and *before* its end is reported
    /// to the server, so a client that read the whole response can repeat the
    /// request at once (the default).
    #[default]
    OnCompletion,
    /// Start the release when the response body ends but do not wait for it:
    /// saves the release round trip from the response's tail latency, at the
    /// risk of a spurious 409 for a client that repeats immediately.
    FireAndForget,
    /// Debounce: keep the lease for its whole TTL after a response, so a
    /// repeat within the window is rejected even after completion. (On error,
    /// cancellation or panic before a response the lease is still released.)
    HoldUntilTtl,
}

/// What the layer was built with.
#[derive(Clone)]
pub(crate) struct Config {
    /// What both layers have (key, key space, TTL, deadline, body limits,
    /// responder); read through `Deref`.
    pub(crate) settings: Settings,
    /// A digest of the received body goes into the key.
    pub(crate) digest: bool,
    pub(crate) backend: Arc<dyn LockBackend>,
    /// The backend keeps its keys in this process
    /// ([`Backend::is_in_process`](crate::backend::Backend::is_in_process)):
    /// its acquires and releases are taken through
    /// [`BackendFuture::into_ready`], without a boxed future or a deadline
    /// timer when it answers in the call.
    pub(crate) in_process: bool,
    /// Run unlocked when the backend fails (else 503).
    pub(crate) fail_open: bool,
    /// Run unlocked when a key part is missing (else reject).
    pub(crate) skip_missing: bool,
    pub(crate) release: ReleaseMode,
    pub(crate) stats: Counters<LockOutcome>,
    pub(crate) renewal: Option<Renewal>,
    pub(crate) fencing: bool,
    /// Recent hold durations (shared by clones of the layer), for
    /// `Retry-After`.
    pub(crate) holds: Arc<HoldTimes>,
    /// Upper bound of `Retry-After` on a 409 (`None`: the holder's TTL).
    pub(crate) retry_after_cap: Option<Duration>,
    /// How long a request whose key is held waits for it (`None`: it does
    /// not, 409 at once).
    pub(crate) wait: Option<Duration>,
    /// Most waiters per key, and in all (per instance).
    pub(crate) max_waiters: (usize, usize),
    /// The requests waiting now (shared by clones of the layer).
    pub(crate) queue: Arc<WaitQueue>,
}

deref_to_settings!(Config);

impl Config {
    /// Release `token`'s lease on `key`: telling the waiters of every
    /// instance when this layer's requests wait
    /// ([`release_notify`](LockBackend::release_notify)), a plain release
    /// otherwise.
    pub(crate) fn release_call(&self, key: &bytes::Bytes, token: &Token) -> BackendFuture<bool> {
        match self.wait {
            Some(_) => self.backend.release_notify(key, token),
            None => self.backend.release(key, token),
        }
    }
}
