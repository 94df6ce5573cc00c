//! When a token was issued: the last 6 bytes of every [`Token`](super::Token)
//! are the milliseconds since the Unix epoch at which it was made (big
//! endian), so that a store that finds a key held can tell, from the holder's
//! token alone, how long it has been held: a refused `SET … NX PX … GET`
//! returns the holder's token, and the time left follows without a second
//! command (`PTTL`).
//!
//! The token comes back from Redis: untrusted bytes (anyone who can write the
//! key can put anything there, and an instance of an older version stores
//! 16 random bytes). [`time_left`] reads only what is plausible: 32
//! lowercase hex digits whose time lies within the lease's life of now;
//! anything else is `None` (unknown). Standard library only: the fuzz target
//! `holder_token` compiles this file on its own, by path.

use std::time::{SystemTime, UNIX_EPOCH};

/// Bytes of a token that carry its issue time.
pub(crate) const STAMP: usize = 6;

/// Milliseconds since the Unix epoch, now (0 for a clock set before it).
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// `ms` (its low 48 bits: good until the year 10889) into the last
/// [`STAMP`] bytes of `token`.
pub(crate) fn stamp(token: &mut [u8; 16], ms: u64) {
    token[16 - STAMP..].copy_from_slice(&ms.to_be_bytes()[8 - STAMP..]);
}

/// The issue time in `hex`, a token as Redis stores it (32 lowercase hex
/// digits), or `None` if it is not one.
#[cfg_attr(not(feature = "redis"), allow(dead_code))] // read back from Redis only
pub(crate) fn issued_ms(hex: &[u8]) -> Option<u64> {
    if hex.len() != 32 || !hex.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    let mut ms = 0u64;
    for &b in &hex[32 - 2 * STAMP..] {
        let digit = match b {
            b'0'..=b'9' => b - b'0',
            _ => b - b'a' + 10,
        };
        ms = (ms << 4) | u64::from(digit);
    }
    Some(ms)
}

/// How long the lease of the token `holder` (as Redis stores it) has left,
/// in ms, for a holder that took it with a TTL of `ttl_ms` (the layers of a
/// fleet share their configuration), at `now_ms`: `ttl − (now − issued)`.
///
/// `None` when that cannot be told: not a token of this format (a value
/// someone else wrote, an older instance's random token), issued more than
/// the TTL from now in either direction (a holder that renewed its lease
/// past its first TTL, whose time left its token does not show; or clocks
/// that disagree by more than a lease's life). A holder's clock up to a TTL
/// ahead of ours reads as just issued. An estimate: a holder that renewed
/// within its first TTL, or took the lease with a longer TTL than ours,
/// has more left than it says (a `Retry-After` that comes early, answered
/// 409 again).
#[cfg_attr(not(feature = "redis"), allow(dead_code))] // read back from Redis only
pub(crate) fn time_left(holder: &[u8], ttl_ms: u64, now_ms: u64) -> Option<u64> {
    let issued = issued_ms(holder)?;
    if issued > now_ms {
        return (issued - now_ms < ttl_ms).then_some(ttl_ms);
    }
    let age = now_ms - issued;
    (age < ttl_ms).then(|| ttl_ms - age)
}
