//! Properties of the key digest, checked with proptest, and pinned
//! known-answer values.

use proptest::collection::vec;
use proptest::prelude::*;

use super::super::{DigestKey, KeyWriter, LockKey, DIGEST_LEN};

fn digest(key: &DigestKey, parts: &[(String, Vec<u8>)]) -> LockKey {
    let mut w = KeyWriter::new(key);
    for (label, value) in parts {
        w.push(label, value);
    }
    w.finish()
}

fn parts() -> impl Strategy<Value = Vec<(String, Vec<u8>)>> {
    vec((".{0,8}", vec(any::<u8>(), 0..64)), 0..6)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Whatever goes in (any bytes, any length, any number of parts), the
    /// stored key has one fixed shape: `prefix:{32 hex}`.
    #[test]
    fn digest_has_fixed_length(parts in parts(), big in vec(any::<u8>(), 0..4096)) {
        let mut parts = parts;
        parts.push(("body".into(), big));
        let key = digest(&DigestKey::public(), &parts);
        prop_assert_eq!(key.as_bytes().len(), DIGEST_LEN);
        prop_assert_eq!(key.to_hex().len(), 2 * DIGEST_LEN);
        let stored = key.storage_key("trl");
        prop_assert_eq!(stored.len(), "trl:{".len() + 2 * DIGEST_LEN + 1);
        prop_assert!(stored[5..37].iter().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
    }

    /// The same tuple always gives the same digest (no per-process salt).
    #[test]
    fn digest_is_deterministic(parts in parts()) {
        prop_assert_eq!(digest(&DigestKey::public(), &parts), digest(&DigestKey::public(), &parts));
    }

    /// Moving the boundary between two values changes the digest:
    /// ("ab", "c") != ("a", "bc"), for any bytes and any two split points.
    #[test]
    fn split_point_matters(bytes in vec(any::<u8>(), 0..64), i in any::<prop::sample::Index>(), j in any::<prop::sample::Index>()) {
        let (i, j) = (i.index(bytes.len() + 1), j.index(bytes.len() + 1));
        prop_assume!(i != j);
        let split = |at: usize| vec![("v".to_string(), bytes[..at].to_vec()), ("v".to_string(), bytes[at..].to_vec())];
        prop_assert_ne!(digest(&DigestKey::public(), &split(i)), digest(&DigestKey::public(), &split(j)));
    }

    /// Different part tuples (labels or values) give different digests.
    #[test]
    fn different_tuples_differ(a in parts(), b in parts()) {
        prop_assume!(a != b);
        prop_assert_ne!(digest(&DigestKey::public(), &a), digest(&DigestKey::public(), &b));
    }

    /// A label's bytes cannot move into the value (or back).
    #[test]
    fn label_value_boundary_matters(label in "[a-z:{}]{1,8}", value in vec(any::<u8>(), 0..16)) {
        let (cut, last) = label.split_at(label.len() - 1);
        let mut moved = last.as_bytes().to_vec();
        moved.extend_from_slice(&value);
        prop_assert_ne!(
            digest(&DigestKey::public(), &[(label.clone(), value)]),
            digest(&DigestKey::public(), &[(cut.to_string(), moved)])
        );
    }

    /// Keyed mode is a MAC: the same input under two secrets gives two keys,
    /// and neither is the public (unkeyed) digest.
    #[test]
    fn secret_makes_a_mac(parts in parts(), s1 in vec(any::<u8>(), 0..40), s2 in vec(any::<u8>(), 0..40)) {
        prop_assume!(s1 != s2);
        let k1 = digest(&DigestKey::from_secret(&s1), &parts);
        let k2 = digest(&DigestKey::from_secret(&s2), &parts);
        let public = digest(&DigestKey::public(), &parts);
        prop_assert_ne!(k1, k2);
        prop_assert_ne!(k1, public);
        prop_assert_ne!(k2, public);
        prop_assert_eq!(k1, digest(&DigestKey::from_secret(&s1), &parts));
    }
}

/// Pinned digests: the same in every process, build and machine. A change
/// here splits a fleet running two versions into two lock spaces, so it must
/// be a deliberate, documented (breaking) change.
#[test]
fn known_answers() {
    let tuple = [
        ("method".to_string(), b"POST".to_vec()),
        ("route".to_string(), b"/pay".to_vec()),
        ("identity".to_string(), b"alice".to_vec()),
    ];
    let public = digest(&DigestKey::public(), &tuple);
    let keyed = digest(
        &DigestKey::from_secret(b"correct horse battery staple"),
        &tuple,
    );
    let empty = digest(&DigestKey::public(), &[]);
    assert_eq!(public.to_hex(), "8241f09bab86b8d16c9a7c9c0af2ddda");
    assert_eq!(keyed.to_hex(), "bbe32b9ddc81347a620ffda587a128ad");
    assert_eq!(empty.to_hex(), "1fbf85531e025f7b221fd3e518ba0f67");
    assert_eq!(
        &public.storage_key("trl")[..],
        format!("trl:{{{}}}", public.to_hex()).as_bytes()
    );
}

#[test]
fn unkeyed_and_keyed_digest_keys_differ() {
    assert!(DigestKey::public() != DigestKey::from_secret(b""));
    assert!(DigestKey::from_secret(b"a") != DigestKey::from_secret(b"b"));
}
