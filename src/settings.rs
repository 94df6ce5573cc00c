//! The settings both layers have ([`Settings`]: key, key space, TTL,
//! deadline, body limits, responder), their defaults, and the bound a TTL
//! or deadline setter applies ([`at_least_1ms`], [`at_most_max`]). Each layer holds a
//! `Settings` in its configuration and writes its own setters out, so that
//! a setter's documentation speaks of its layer.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Response;

use crate::key::{KeyPart, KeySpace};
use crate::rejection::{Rejection, Responder};

/// Default deadline of every backend call: 200 ms.
pub(crate) const DEFAULT_DEADLINE: Duration = Duration::from_millis(200);
/// Default largest request body received before a lease or claim: 64 KiB.
pub(crate) const DEFAULT_BODY_LIMIT: usize = 64 * 1024;
/// Default time for the whole request body to arrive: 10 s.
pub(crate) const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// The shortest TTL or deadline a setter accepts.
const MIN_DURATION: Duration = Duration::from_millis(1);
/// The longest duration any setter keeps: ten years. `Duration::MAX` ("as
/// long as it takes") is lowered to it, so that a deadline made by adding
/// it to an `Instant` never overflows (that panics) and it fits the
/// milliseconds Redis takes.
pub(crate) const MAX_DURATION: Duration = Duration::from_secs(10 * 365 * 24 * 60 * 60);

/// What both layers are configured with, in the same words.
#[derive(Clone)]
pub(crate) struct Settings {
    /// The parts of the request that make the key (and the scope).
    pub(crate) key: Arc<dyn KeyPart>,
    /// Where keys live and how they are hashed.
    pub(crate) key_space: KeySpace,
    /// How long a lease or claim lives without its release or record.
    pub(crate) ttl: Duration,
    /// Deadline of every backend call.
    pub(crate) deadline: Duration,
    /// Largest request body received before a lease or claim.
    pub(crate) body_limit: usize,
    /// Time for the whole request body to arrive.
    pub(crate) body_timeout: Duration,
    /// The user's answers instead of problem+json.
    pub(crate) responder: Option<Responder>,
}

impl Settings {
    /// The defaults, with `key` and the layer's own default `ttl`.
    pub(crate) fn new(key: Arc<dyn KeyPart>, ttl: Duration) -> Self {
        Self {
            key,
            key_space: KeySpace::default(),
            ttl,
            deadline: DEFAULT_DEADLINE,
            body_limit: DEFAULT_BODY_LIMIT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            responder: None,
        }
    }

    /// The response for a rejection: the user's responder or problem+json.
    pub(crate) fn reject(&self, rejection: &Rejection) -> Response<Bytes> {
        crate::rejection::respond(self.responder.as_ref(), rejection)
    }
}

/// A TTL or deadline as given, raised to 1 ms and lowered to
/// [`MAX_DURATION`].
pub(crate) fn at_least_1ms(d: Duration) -> Duration {
    d.clamp(MIN_DURATION, MAX_DURATION)
}

/// A duration as given, lowered to [`MAX_DURATION`].
pub(crate) fn at_most_max(d: Duration) -> Duration {
    d.min(MAX_DURATION)
}
