//! What the rows of the table say: their states, what a committed row
//! answers a claim, and the clock their expiries are written in.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tower_redis_lock::backend::contract::Claim;
use tower_redis_lock::backend::BackendError;

use crate::adapter::{Adapter, Found, Hold};

/// A claim row (PostgreSQL: in the handler's transaction, seen committed
/// only when the handler committed it itself; SQLite: a hold row of the
/// store's first version).
pub(crate) const STATE_CLAIMED: i16 = 0;
/// A record.
pub(crate) const STATE_DONE: i16 = 1;
/// Final without a record: the handler ended the request's transaction
/// itself (answered `transaction-ended`).
pub(crate) const STATE_ENDED: i16 = 2;
/// SQLite's claim row, written in the handler's transaction: seen
/// committed only when the handler committed it itself.
pub(crate) const STATE_IN_TXN: i16 = 3;

/// Milliseconds since the Unix epoch, by this machine's clock (a row hold's
/// expiry: one machine).
pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

pub(crate) fn millis(d: Duration) -> i64 {
    d.as_millis().min(LONGEST_MS as u128) as i64
}

/// The longest span written to the database: ten years (what the layers
/// clamp their settings to), well inside PostgreSQL's `interval` (a
/// `Duration::MAX` retention given to a store directly was out of its
/// range).
const LONGEST_MS: i64 = 10 * 365 * 24 * 3600 * 1000;

pub(super) fn positive_ms(ms: Option<i64>) -> Option<Duration> {
    ms.filter(|ms| *ms > 0)
        .map(|ms| Duration::from_millis(ms as u64))
}

/// What a committed row of the key says to a claim.
pub(super) enum Seen {
    /// The answer.
    Answer(Claim),
    /// A claim row its handler committed itself: final if its claim is
    /// gone (PostgreSQL: its hold is free; SQLite: it expired).
    Orphan,
}

/// What a committed row of the key says to a claim for `fp`. Untrusted
/// bytes: compared, never decoded here; a malformed row is an error.
pub(super) fn answer_of<A: Adapter>(found: Found, fp: &[u8]) -> Result<Seen, BackendError> {
    if found.fingerprint != fp {
        return Ok(Seen::Answer(Claim::Mismatch));
    }
    let in_flight = |left_ms| {
        Seen::Answer(Claim::InFlight {
            retry_after: positive_ms(left_ms),
        })
    };
    Ok(match (found.state, found.record) {
        (STATE_DONE, Some(record)) => Seen::Answer(Claim::Done(Bytes::from(record))),
        (STATE_ENDED, _) => Seen::Answer(Claim::Ended),
        // PostgreSQL's claim row is seen committed only when its handler
        // committed the transaction itself: its hold tells whether the
        // claim still runs.
        (STATE_CLAIMED, _) if A::HOLD == Hold::Session => Seen::Orphan,
        // SQLite: a hold row of the store's first version, in flight until
        // it expires.
        (STATE_CLAIMED, _) => in_flight(found.left_ms),
        (STATE_IN_TXN, _) if found.left_ms.is_some_and(|ms| ms > 0) => in_flight(found.left_ms),
        (STATE_IN_TXN, _) => Seen::Orphan,
        (state, _) => {
            return Err(BackendError::protocol(format!(
                "idempotency store: a malformed row (state {state})"
            )))
        }
    })
}
