//! Records bound to their request. What the store keeps (and publishes) is
//! a *sealed* record: with a [`KeySpace`] secret, the encoded record behind a
//! MAC over the entry key, the request fingerprint and the record; without
//! one, the encoded record alone, trusted only when read from its own key
//! (a published one is then a wake-up, never an answer).
//!
//! Bytes read back from the store are untrusted input: [`open`] checks the
//! MAC before decoding, and the decoder never panics.

use bytes::{BufMut, Bytes, BytesMut};

use super::record::{CorruptRecord, Record};
use crate::key::KeySpace;

/// First byte of a sealed record (records themselves start with `R`, `T` or `N`).
const SEALED: u8 = b'S';
/// Length of the MAC.
const MAC_LEN: usize = 32;

/// Why stored bytes were not accepted as this request's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unsealed {
    /// The MAC is missing or wrong: not written by this key space for this
    /// key and fingerprint (forged, moved from another key, or written
    /// under another secret).
    Forged,
    /// The MAC is right (or not used) but the record does not decode.
    Corrupt(CorruptRecord),
}

impl std::fmt::Display for Unsealed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Forged => f.write_str(
                "stored idempotency record failed authentication (forged, copied from \
                 another key, or written with another KeySpace secret)",
            ),
            Self::Corrupt(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for Unsealed {}

/// What seals and opens a layer's records: the key derived from its key
/// space's secret, once, when the layer is built (`None` without a secret:
/// records are then encoded alone, and trusted only when read from their
/// own key).
#[derive(Clone, Copy, Default)]
pub(crate) struct SealKey(Option<[u8; 32]>);

impl SealKey {
    /// The seal key of `space`.
    pub(crate) fn of(space: &KeySpace) -> Self {
        Self(space.record_key())
    }

    /// Whether records are sealed (the key space has a secret): only then
    /// is a published record an answer rather than a wake-up.
    pub(crate) fn is_set(&self) -> bool {
        self.0.is_some()
    }
}

fn mac(key: &[u8; 32], entry: &[u8], fingerprint: &[u8], record: &[u8]) -> blake3::Hash {
    let mut h = blake3::Hasher::new_keyed(key);
    for part in [entry, fingerprint, record] {
        h.update(&(part.len() as u64).to_le_bytes());
        h.update(part);
    }
    h.finalize()
}

/// The bytes to store for `record`, bound to `entry` and `fingerprint`.
pub(crate) fn seal(key: &SealKey, entry: &[u8], fingerprint: &[u8], record: &Record) -> Bytes {
    let encoded = record.encode();
    let Some(key) = &key.0 else {
        return encoded;
    };
    let tag = mac(key, entry, fingerprint, &encoded);
    let mut out = BytesMut::with_capacity(1 + MAC_LEN + encoded.len());
    out.put_u8(SEALED);
    out.put_slice(tag.as_bytes());
    out.put_slice(&encoded);
    out.freeze()
}

/// The record in `sealed`, if it was sealed with `key` for `entry` and
/// `fingerprint`.
pub(crate) fn open(
    key: &SealKey,
    entry: &[u8],
    fingerprint: &[u8],
    sealed: Bytes,
) -> Result<Record, Unsealed> {
    let Some(key) = &key.0 else {
        if sealed.first() == Some(&SEALED) {
            // Sealed under a secret this layer does not have.
            return Err(Unsealed::Forged);
        }
        return Record::decode(sealed).map_err(Unsealed::Corrupt);
    };
    if sealed.len() < 1 + MAC_LEN || sealed[0] != SEALED {
        return Err(Unsealed::Forged);
    }
    let encoded = sealed.slice(1 + MAC_LEN..);
    let mut tag = [0u8; MAC_LEN];
    tag.copy_from_slice(&sealed[1..1 + MAC_LEN]);
    // `blake3::Hash` compares in constant time.
    if mac(key, entry, fingerprint, &encoded) != blake3::Hash::from(tag) {
        return Err(Unsealed::Forged);
    }
    Record::decode(encoded).map_err(Unsealed::Corrupt)
}

#[cfg(test)]
mod tests;
