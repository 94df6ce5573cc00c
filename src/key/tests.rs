//! Unit tests of `mod.rs`.

use super::*;

mod props;

fn writer() -> KeyWriter {
    KeyWriter::new(&DigestKey::public())
}

#[test]
fn encoding_is_unambiguous() {
    let mut a = writer();
    a.push("x", b"ab");
    a.push("x", b"c");
    let mut b = writer();
    b.push("x", b"a");
    b.push("x", b"bc");
    assert_ne!(a.finish(), b.finish());

    // A value cannot pose as a label.
    let mut c = writer();
    c.push("method", b"GET");
    let mut d = writer();
    d.push("path", b"GET");
    assert_ne!(c.finish(), d.finish());
}

#[test]
fn secret_changes_digest_and_is_stable() {
    let mut a = KeyWriter::new(&DigestKey::from_secret(b"s1"));
    a.push("x", b"4242");
    let mut b = KeyWriter::new(&DigestKey::from_secret(b"s2"));
    b.push("x", b"4242");
    let mut c = KeyWriter::new(&DigestKey::from_secret(b"s1"));
    c.push("x", b"4242");
    assert_ne!(a.finish(), b.finish());
    assert_eq!(a.finish(), c.finish());
}

#[test]
fn storage_key_has_fixed_shape() {
    let mut a = writer();
    a.push("x", &[0u8; 100_000]);
    let mut b = writer();
    b.push("x", b"\r\n{}:\0");
    for key in [a.finish(), b.finish()] {
        let stored = key.storage_key("trl");
        assert_eq!(stored.len(), 3 + 3 + 32);
        let s = std::str::from_utf8(&stored).unwrap();
        assert!(s.starts_with("trl:{") && s.ends_with('}'));
        assert!(s[5..37].bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(key.to_string(), &s[5..37]);
    }
}

#[test]
fn known_digest_is_stable_across_builds() {
    // Pinned hex, computed once (0.2): a change of the encoding, a label,
    // a context string or the digest length (which would split a fleet
    // running two versions into two lock spaces) fails here.
    let digest = |key: &DigestKey| {
        let mut w = KeyWriter::new(key);
        w.push("method", b"POST");
        w.push("path", b"/pay");
        w.finish()
    };
    let public = digest(&DigestKey::public());
    assert_eq!(public.to_string(), "550f8458a88378fcb652234ecf9e29ed");
    assert_eq!(
        &public.storage_key("trl")[..],
        b"trl:{550f8458a88378fcb652234ecf9e29ed}"
    );
    let keyed = digest(&DigestKey::from_secret(b"fleet secret"));
    assert_eq!(keyed.to_string(), "9776990e540aca1b851d19293b5174ef");
}

#[test]
fn a_writer_gives_the_digest_of_the_whole_encoding_inline_or_spilled() {
    // Sizes around the inline buffer's end, and far past it: the digest is
    // BLAKE3 keyed over the whole encoding, however the writer held it.
    for n in [
        0,
        1,
        100,
        INLINE - 39,
        INLINE - 38,
        INLINE - 37,
        INLINE,
        5_000,
    ] {
        let long = vec![7u8; n];
        let parts: [(&str, &[u8]); 3] = [("method", b"POST"), ("value", &long), ("tail", b"z")];
        let mut w = writer();
        let mut encoding = Vec::new();
        for (label, value) in parts {
            w.push(label, value);
            encoding.extend_from_slice(&(label.len() as u64).to_le_bytes());
            encoding.extend_from_slice(label.as_bytes());
            encoding.extend_from_slice(&(value.len() as u64).to_le_bytes());
            encoding.extend_from_slice(value);
        }
        let whole = blake3::keyed_hash(&DigestKey::public().0, &encoding);
        assert_eq!(
            &w.finish().as_bytes()[..],
            &whole.as_bytes()[..DIGEST_LEN],
            "{n} bytes"
        );
        // A clone finishes the same, and the writer can go on after finish.
        assert_eq!(w.clone().finish(), w.finish());
    }
}

#[test]
fn storage_keys_of_any_prefix_length_have_the_same_form() {
    let mut w = writer();
    w.push("x", b"y");
    let key = w.finish();
    let hex = key.to_string();
    // Short prefixes share one allocation with the reference count, long
    // ones come from a `Vec`: the bytes are the same either way.
    for prefix in [
        "",
        "trl",
        &"p".repeat(INLINE_KEY - 35),
        &"p".repeat(INLINE_KEY),
        &"p".repeat(300),
    ] {
        for suffix in ["", ":idem"] {
            let stored = key.storage_key_with_suffix(prefix, suffix);
            assert_eq!(stored, format!("{prefix}:{{{hex}}}{suffix}").as_bytes());
            assert_eq!(stored.clone(), stored);
        }
    }
}

#[test]
fn hex_of_every_byte_is_lowercase_and_two_digits() {
    let bytes: Vec<u8> = (0..=255).collect();
    let mut out = vec![0u8; 512];
    hex_encode(&bytes, &mut out);
    let expected: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(out, expected.as_bytes());
}

/// A secret under 16 bytes leaves the key space unkeyed (and its digests
/// the public ones); 16 bytes key it.
#[test]
fn a_secret_under_16_bytes_is_no_secret() {
    let writer_hex = |space: &KeySpace| {
        let mut w = space.writer();
        w.push("part", b"value");
        w.finish().to_hex()
    };
    let public = writer_hex(&KeySpace::default());
    for short in [&b""[..], b"short", &[1u8; 15]] {
        let space = KeySpace::default().secret(short);
        assert!(!space.is_keyed(), "{} bytes", short.len());
        assert_eq!(writer_hex(&space), public);
    }
    let keyed = KeySpace::default().secret([1u8; 16]);
    assert!(keyed.is_keyed());
    assert_ne!(writer_hex(&keyed), public);
    // A short secret after a good one undoes it.
    assert!(!keyed.secret(b"").is_keyed());
}
