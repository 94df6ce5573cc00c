//! Joining a request in flight: a duplicate waits, bounded by the layer's
//! join timeout, for the original's outcome instead of a bare 409.
//!
//! On this instance it waits on the original's [`Flight`](super::flight),
//! with no round trip. For a request in flight elsewhere it listens on the
//! layer's [`Feed`] (started on first use, started again after it closed)
//! between two looks at the store, or, without a feed, looks again with
//! growing pauses.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use tokio::time::Instant;

use super::answer::{answer_record, rejected};
use super::config::{Config, FeedSlot, FEED_RETRY};
use super::feed::Feed;
use super::feed::{Published, Waiter};
use super::flight::{Join, Outcome};
use super::record::Record;
use super::seal::open;
use crate::backend::EntryKey;
use crate::key::LockKey;
use crate::stats::IdempotencyOutcome;
use crate::Rejection;

/// First pause between two looks at the store while joining a request that
/// runs on another instance; it doubles up to [`JOIN_POLL_MAX`].
const JOIN_POLL_START: Duration = Duration::from_millis(25);
/// Longest pause between two looks at the store while joining.
const JOIN_POLL_MAX: Duration = Duration::from_millis(200);
/// Longest wait on the feed before one more look at the store: a
/// publication lost (subscriber reconnecting, PUBLISH refused by an ACL)
/// costs a joining duplicate at most this.
const FEED_RECHECK: Duration = Duration::from_secs(2);

/// A duplicate of a request in flight on this instance (same entry key)
/// waits for its outcome, up to `until`: the answer, or `None` to ask the
/// store (nothing in flight here, or it freed the key or went without a
/// word).
pub(super) async fn join_here(
    config: &Config,
    key: &EntryKey,
    fingerprint: &[u8],
    digest: &LockKey,
    until: Instant,
) -> Option<Response<Bytes>> {
    let (mut rx, began) = match config.flights.join(&key.entry, fingerprint) {
        Join::Absent => return None,
        Join::Mismatch => {
            config.stats.record(IdempotencyOutcome::Mismatch);
            return Some(rejected(config, Rejection::Mismatch));
        }
        Join::Wait(rx, began) => (rx, began),
    };
    tracing::debug!(key = %digest, outcome = "joining", "waiting for the request in flight here");
    let waited = match tokio::time::timeout_at(until, rx.wait_for(Option::is_some)).await {
        Ok(Ok(outcome)) => Ok(outcome.clone()),
        // Gone without a word: ask the store.
        Ok(Err(_)) => Ok(None),
        Err(_) => Err(()),
    };
    match waited {
        Ok(Some(Outcome::Recorded(record))) => Some(answer_record(config, digest, record, true)),
        // Freed: ask the store.
        Ok(Some(Outcome::Freed)) | Ok(None) => None,
        // Still running at the bound, or its outcome is unknown.
        Ok(Some(Outcome::Unknown)) | Err(()) => {
            config.stats.record(IdempotencyOutcome::Conflict);
            // The claim's time left, as the store would say it: taken when
            // the request began here.
            let remaining = config.settings.ttl.saturating_sub(began.elapsed());
            let retry_after = config
                .holds
                .retry_after(Some(remaining), config.settings.ttl, None);
            Some(rejected(config, Rejection::InFlight { retry_after }))
        }
    }
}

/// A duplicate's wait for a request in flight on another instance, between
/// two looks at the store.
pub(super) struct Joiner {
    feed: Option<Arc<Feed>>,
    /// Listening for the key, if the feed is live.
    waiter: Option<Waiter>,
    /// The next pause between two looks, without a feed.
    pause: Duration,
    /// Set when a wait on a live feed ran out before the join bound: if
    /// the next look finds the record, the feed missed its publication.
    missed: bool,
    until: Instant,
}

impl Joiner {
    /// Listen for `key` on the layer's feed, if there is one (before the
    /// first claim is sent, so that nothing published after the store's
    /// answer is missed), until `until`.
    pub(super) async fn new(config: &Config, key: &Bytes, until: Instant) -> Self {
        let feed = feed_of(config).await;
        let waiter = feed.as_ref().map(|f| f.waiter(key));
        Self {
            feed,
            waiter,
            pause: JOIN_POLL_START,
            missed: false,
            until,
        }
    }

    /// Whether the join bound is still ahead of `now`.
    pub(super) fn is_open(&self, now: Instant) -> bool {
        now < self.until
    }

    /// Wait for the outcome of the request in flight, until the bound or
    /// the next look at the store is due. `Some`: a record published for
    /// this key and fingerprint, trusted as our answer; `None`: look at the
    /// store again. `now` is before the bound.
    pub(super) async fn wait(
        &mut self,
        config: &Config,
        key: &EntryKey,
        fingerprint: &[u8],
        now: Instant,
    ) -> Option<Record> {
        let Some(w) = self.waiter.as_mut() else {
            tokio::time::sleep(self.pause.min(self.until - now)).await;
            self.pause = (self.pause * 2).min(JOIN_POLL_MAX);
            return None;
        };
        match w.wait(self.until.min(now + FEED_RECHECK)).await {
            // Only a record sealed with the secret for this key and
            // fingerprint is an answer; anything else published is a
            // wake-up: look at the store.
            Some(Published::Done(sealed)) => {
                if let Some(record) = published_record(config, key, fingerprint, sealed) {
                    return Some(record);
                }
                self.listen(&key.entry);
            }
            // Freed: listen again, then claim.
            Some(Published::Freed) => self.listen(&key.entry),
            // The bound or a recheck: one more look. A closed feed stops
            // being listened to.
            None => {
                let live = self.feed.as_ref().is_some_and(|f| f.is_live());
                self.missed = live;
                if !live || Instant::now() >= self.until {
                    self.waiter = None;
                }
            }
        }
        None
    }

    fn listen(&mut self, key: &Bytes) {
        self.waiter = self.feed.as_ref().map(|f| f.waiter(key));
    }

    /// The store answered with the record after a wait on a live feed ran
    /// out: the feed missed its publication (logged once per layer).
    pub(super) fn found_done(&self, config: &Config) {
        if self.missed {
            feed_missed(config);
        }
    }
}

/// The layer's feed of published outcomes, started on first use and again
/// after it closed; `None` when the store publishes nothing or its
/// subscriber cannot be opened now (then waiters look again instead; a new
/// attempt is made at most once per [`FEED_RETRY`], and the first failure
/// is logged).
pub(in crate::idempotency) async fn feed_of(config: &Config) -> Option<Arc<Feed>> {
    let slot = &config.feed;
    let live = |slot: &FeedSlot| {
        slot.current
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .filter(|f| f.is_live())
            .cloned()
    };
    if let Some(feed) = live(slot) {
        return Some(feed);
    }
    // Not started yet (nothing runs until awaited); `None` for a store
    // that publishes nothing, with no lock taken.
    let start = config.store.as_ref().feed(&config.settings.key_space)?;
    let mut starting = slot.starting.lock().await;
    if let Some(feed) = live(slot) {
        return Some(feed);
    }
    if starting.is_some_and(|failed| failed.elapsed() < FEED_RETRY) {
        return None;
    }
    let bound = config.settings.deadline.max(Duration::from_secs(1));
    let error = match tokio::time::timeout(bound, start).await {
        Ok(Ok(publications)) => {
            let feed = Feed::listen(publications);
            *starting = None;
            *slot.current.lock().unwrap_or_else(|p| p.into_inner()) = Some(feed.clone());
            return Some(feed);
        }
        Ok(Err(e)) => e.to_string(),
        Err(_) => format!("no answer within {} ms", bound.as_millis()),
    };
    *starting = Some(Instant::now());
    if !slot.warned.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            error = %error,
            "no subscription for joining duplicates (check that the Redis user may PSUBSCRIBE \
             and PUBLISH on the key space's channels, see SECURITY.md); duplicates look at the \
             store again instead, which answers them later"
        );
    }
    None
}

/// A waiter found by looking at the store a record whose publication its
/// feed never delivered: the subscription is refused (an ACL without the
/// channel rules: Redis refuses `PSUBSCRIBE` without the client hearing of
/// it) or was lost. Logged once per layer; joins keep working, later.
fn feed_missed(config: &Config) {
    if !config.feed.warned.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "no subscription delivered a record that a duplicate waited for (check that the \
             Redis user may PSUBSCRIBE and PUBLISH on the key space's channels, see \
             SECURITY.md); duplicates look at the store again instead, which answers them later"
        );
    }
}

/// A record published for a joining duplicate, if it may be trusted as its
/// answer: only with a secret (sealed for this key and fingerprint).
/// Without one, a publication is only a wake-up and the record is read from
/// its key.
fn published_record(
    config: &Config,
    key: &EntryKey,
    fingerprint: &[u8],
    sealed: Bytes,
) -> Option<Record> {
    if !config.seal_key.is_set() {
        return None;
    }
    match open(&config.seal_key, &key.entry, fingerprint, sealed) {
        Ok(record) => Some(record),
        Err(e) => {
            tracing::warn!(error = %e, outcome = "forged_publication", "ignored a record published for a waiting duplicate; reading the store instead");
            None
        }
    }
}
