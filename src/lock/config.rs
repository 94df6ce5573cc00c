//! What a lock layer was built with: [`Config`], shared by the layer, its
//! services, their futures, the leases they hold and its
//! [`Locker`](super::Locker)s; and the choices a builder makes
//! ([`ReleaseMode`]). Data and its defaults only: what is done with it is
//! in `acquire.rs` (take a lease) and `lease.rs` (give it back). The bottom
//! of the folder: the engines import it, and it imports only the wait
//! queue's type (`wait.rs`).

use std::sync::Arc;
use std::time::Duration;

use super::wait::WaitQueue;
use crate::backend::LockBackend;
use crate::key::KeyPart;
use crate::renewal::Renewal;
use crate::retry_after::HoldTimes;
use crate::settings::Settings;
use crate::stats::{Counters, LockOutcome};

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
    /// responder).
    pub(crate) settings: Settings,
    /// A digest of the received body goes into the key.
    pub(crate) digest: bool,
    /// The store: an in-process one answers in the call
    /// ([`BackendFuture::into_ready`](crate::backend::contract::BackendFuture::into_ready)),
    /// and its answer is taken without a boxed future or a deadline timer.
    pub(crate) backend: Arc<dyn LockBackend>,
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
    /// Most request-body bytes held by waiters in all (per instance).
    pub(crate) max_waiting_bytes: usize,
    /// The requests waiting now (shared by clones of the layer).
    pub(crate) queue: Arc<WaitQueue>,
}

impl Config {
    /// A layer's configuration over `backend`, keyed by `key`, with the
    /// defaults (see the table on [`RedisLockLayer`](crate::RedisLockLayer)).
    pub(crate) fn new(backend: impl LockBackend, key: impl KeyPart) -> Self {
        Self {
            settings: Settings::new(Arc::new(key), DEFAULT_TTL),
            digest: false,
            backend: Arc::new(backend),
            fail_open: false,
            skip_missing: false,
            release: ReleaseMode::OnCompletion,
            stats: Counters::new("lock"),
            renewal: None,
            fencing: false,
            holds: Default::default(),
            retry_after_cap: None,
            wait: None,
            max_waiters: (super::wait::DEFAULT_PER_KEY, super::wait::DEFAULT_TOTAL),
            max_waiting_bytes: super::wait::DEFAULT_BYTES,
            queue: Default::default(),
        }
    }

    /// Warn (once per process) when this layer's keys leave the process
    /// unkeyed (no secret in its key space, a store beyond this process).
    pub(crate) fn warn_if_unkeyed(&self) {
        let in_process = self.backend.is_in_process();
        self.settings.key_space.warn_if_public(in_process);
    }
}
