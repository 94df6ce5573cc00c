//! [`Claimed`]: the claim a request won, as its run holds it:
//! its key and token, the fingerprint its record is bound to, its renewals,
//! and the duplicates on this instance that wait for its outcome.

use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use super::admission::Won;
use super::config::Config;
use super::flight::{Flight, Outcome};
use crate::backend::{BackendFuture, EntryKey, IdempotencyBackend, Token};
use crate::key::LockKey;
use crate::renewal::{Extend, Renewal, Renewed, Schedule};

/// A claim won by this request: the key, our token, and its renewals.
pub(super) struct Claimed {
    pub(super) key: EntryKey,
    pub(super) digest: LockKey,
    pub(super) token: Token,
    /// The request's fingerprint, to which its record is bound.
    pub(super) fingerprint: Bytes,
    /// When to renew, and until when the claim is known to hold: a third of
    /// the TTL apart, 20 times at most (as the lock's renewal), a sixth of
    /// the TTL after a renewal that failed.
    pub(super) schedule: Schedule,
    /// Where duplicates on this instance wait for the outcome, if joining.
    flight: Option<Flight>,
}

/// The claim as the schedule extends it.
struct ClaimTarget<'a> {
    store: &'a dyn IdempotencyBackend,
    key: &'a EntryKey,
    token: &'a Token,
}

impl Extend for ClaimTarget<'_> {
    fn extend(&self, ttl: Duration) -> Option<BackendFuture<bool>> {
        Some(self.store.extend(self.key, self.token, ttl))
    }
}

impl Claimed {
    /// The claim the store granted to the claim that `won` sent, renewed
    /// from then on.
    pub(super) fn new(config: &Config, won: Won) -> Self {
        let ttl = config.settings.ttl;
        let schedule = Schedule::new(
            &Renewal::new(),
            ttl,
            config.settings.deadline,
            won.sent,
            won.sent + ttl,
            ttl / 6,
        );
        Self {
            key: won.key,
            digest: won.digest,
            token: won.token,
            fingerprint: won.fingerprint,
            schedule,
            flight: won.flight,
        }
    }

    /// When the claim expires, as far as we know.
    pub(super) fn expires(&self) -> Instant {
        self.schedule.valid_until
    }

    /// Push the claim's expiry out by a TTL; `false` when it is not ours
    /// any more (then no renewal follows). A renewal that fails (store
    /// down, slow) is tried again sooner; the expiry we know stays.
    pub(super) async fn renew(&mut self, config: &Config) -> bool {
        let target = ClaimTarget {
            store: config.store.as_ref(),
            key: &self.key,
            token: &self.token,
        };
        match self.schedule.renew(&target).await {
            Renewed::Extended => {
                tracing::debug!(key = %self.digest, outcome = "claim_renewed", renewals = self.schedule.renewals);
                true
            }
            Renewed::Gone => {
                tracing::warn!(key = %self.digest, outcome = "claim_lost", "the claim expired or was taken while its request ran");
                self.schedule.stop();
                false
            }
            Renewed::Failed(error) => {
                tracing::warn!(key = %self.digest, outcome = "renew_failed", error = %error, "claim not renewed");
                true
            }
            Renewed::Stopped => true,
        }
    }

    /// Renew if it is time to.
    pub(super) async fn renew_if_due(&mut self, config: &Config) -> bool {
        match self.schedule.next() {
            Some(at) if at <= Instant::now() => self.renew(config).await,
            _ => true,
        }
    }

    /// Tell the duplicates that joined on this instance, once.
    pub(super) fn finish(&mut self, outcome: Outcome) {
        if let Some(flight) = self.flight.take() {
            flight.finish(outcome);
        }
    }
}
