//! `Idempotency-Key` parsing over arbitrary header bytes (what any client
//! sends): never panics; whatever it accepts is 1 to 255 bytes of printable
//! ASCII, and the value's two accepted spellings (a bare token where the
//! value allows one, and the RFC 8941 sf-string) parse to the same key.
//!
//! The parser is crate-private, so this target compiles its source file on
//! its own, by path (it depends on `http` only), as `record_decode` does.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../src/idempotency/header.rs"]
#[allow(dead_code)]
mod key;

use key::IdempotencyKey;

/// The value as an sf-string: quoted, `\` and `"` escaped.
fn quoted(value: &str) -> Vec<u8> {
    let mut out = vec![b'"'];
    for b in value.bytes() {
        if b == b'"' || b == b'\\' {
            out.push(b'\\');
        }
        out.push(b);
    }
    out.push(b'"');
    out
}

fuzz_target!(|data: &[u8]| {
    let Ok(parsed) = IdempotencyKey::parse(data) else {
        return;
    };
    let value = parsed.as_str();
    assert!(!value.is_empty() && value.len() <= key::MAX_KEY_LEN, "length {}", value.len());
    assert!(value.bytes().all(|b| (0x20..0x7f).contains(&b)), "printable ASCII only");
    let again = IdempotencyKey::parse(&quoted(value)).expect("the sf-string form parses");
    assert_eq!(again.as_str(), value, "both forms are the same key");
    // Sent bare, the value is the same key wherever it is a token (only
    // the token characters the parser accepts bare; a copy of its set, which
    // is private to the module).
    let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~:/=".contains(&b);
    if value.bytes().all(token) {
        let bare = IdempotencyKey::parse(value.as_bytes()).expect("a token parses bare");
        assert_eq!(bare.as_str(), value, "the bare form is the same key");
    }
});
