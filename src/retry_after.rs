//! `Retry-After` for a 409: when the holder is expected to finish, learned
//! from how long this layer's recent holds took.
//!
//! Each layer keeps the durations of its last [`WINDOW`] holds (acquire to
//! release, per instance). On a conflict the backend reports the holder's
//! remaining TTL in the same round trip as the refused acquire (the Redis
//! store's native acquire reads it from the issue time in the holder's
//! token, a script from `PTTL`); the holder
//! took its lease with the same TTL (the layers of a fleet share their
//! configuration), so it has held it for `ttl − remaining`. The answer is
//!
//! ```text
//! Retry-After = clamp(p90(recent holds) − (ttl − remaining), 1 s, min(remaining, cap))
//! ```
//!
//! rounded up to whole seconds. Until [`MIN_SAMPLES`] holds were seen (a
//! fresh instance, a route that never completed) nothing is known of how
//! long a hold takes, and the TTL says nothing about it either (a 200 ms
//! handler under a 70 s TTL): the answer is then how long the holder has
//! held its lease so far, `ttl − remaining` (a hold is expected to last
//! about as long again), with the same bounds. When the holder's remaining
//! time is unknown too, it is the TTL (capped). A renewed holder looks
//! younger than it is to a `PTTL`: that makes the learned answer later, and
//! the answer before three holds earlier than its true end (the client that
//! comes back early gets a 409 with a better one); read from its token it
//! keeps its age but shows the time left of its first TTL (earlier
//! answers), and none once past it.

use std::sync::Mutex;
use std::time::Duration;

/// How many recent holds the estimate is taken from.
pub(crate) const WINDOW: usize = 64;
/// Holds needed before the estimate is used.
pub(crate) const MIN_SAMPLES: usize = 3;
/// The percentile of recent holds taken as "how long a hold takes".
const PERCENTILE: usize = 90;

/// The durations of a layer's recent holds (a ring of [`WINDOW`]).
#[derive(Debug, Default)]
pub(crate) struct HoldTimes {
    ring: Mutex<Ring>,
}

#[derive(Debug)]
struct Ring {
    // Milliseconds, saturated at u32::MAX (49 days).
    samples: [u32; WINDOW],
    len: usize,
    next: usize,
}

impl Default for Ring {
    fn default() -> Self {
        Self {
            samples: [0; WINDOW],
            len: 0,
            next: 0,
        }
    }
}

impl HoldTimes {
    /// Remember one hold that lasted `held`.
    pub(crate) fn record(&self, held: Duration) {
        let ms = u32::try_from(held.as_millis()).unwrap_or(u32::MAX);
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let next = ring.next;
        ring.samples[next] = ms;
        ring.next = (next + 1) % WINDOW;
        ring.len = (ring.len + 1).min(WINDOW);
    }

    /// The 90th percentile of the recent holds, once enough were seen.
    pub(crate) fn typical(&self) -> Option<Duration> {
        let (mut samples, len) = {
            let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
            (ring.samples, ring.len)
        };
        if len < MIN_SAMPLES {
            return None;
        }
        let samples = &mut samples[..len];
        samples.sort_unstable();
        let idx = (len * PERCENTILE).div_ceil(100).saturating_sub(1);
        Some(Duration::from_millis(u64::from(samples[idx])))
    }

    /// `Retry-After` for a conflict with a holder whose lease has `remaining`
    /// of a `ttl` left (`None`: unknown), capped at `cap`.
    pub(crate) fn retry_after(
        &self,
        remaining: Option<Duration>,
        ttl: Duration,
        cap: Option<Duration>,
    ) -> Duration {
        let known = remaining.is_some();
        let remaining = remaining.unwrap_or(ttl);
        let upper = cap.map_or(remaining, |cap| remaining.min(cap));
        let elapsed = ttl.saturating_sub(remaining);
        let expected = match self.typical() {
            Some(typical) => typical.saturating_sub(elapsed),
            // Nothing learned yet: as long again as the holder has held.
            None if known => elapsed,
            None => remaining,
        };
        // At least 1 s (the header has whole seconds), at most the upper
        // bound (itself at least 1 s).
        expected.min(upper).max(Duration::from_secs(1))
    }
}

#[cfg(test)]
mod tests;
