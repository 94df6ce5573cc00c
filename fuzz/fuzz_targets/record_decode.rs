//! The idempotency record decoder over arbitrary bytes (what anyone who can
//! write a record's key or publish on its channel hands it): never panics,
//! and whatever it accepts re-encodes to a record that decodes to the same
//! value, and to the same bytes again.
//!
//! The codec is crate-private, so this target compiles its source file on its
//! own, by path (it depends on `bytes` and `http` only, which this crate
//! has): the code fuzzed is the code the crate ships, with no fuzzing entry
//! point in the public API.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;

#[path = "../../src/idempotency/record.rs"]
#[allow(dead_code)]
mod record;

use record::Record;

fuzz_target!(|data: &[u8]| {
    let Ok(record) = Record::decode(Bytes::copy_from_slice(data)) else {
        return;
    };
    let bytes = record.encode();
    let again =
        Record::decode(bytes.clone()).expect("a decoded record re-encodes to one that decodes");
    assert_eq!(again, record);
    assert_eq!(again.encode(), bytes, "the encoding is canonical");
});
