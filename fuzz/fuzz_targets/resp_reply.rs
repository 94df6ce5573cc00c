//! The RESP2 reply parser of the batcher's own Redis connection over
//! arbitrary bytes (what a broken server or anything between it and us can
//! send): never panics, never claims more bytes than it was given, and a
//! reply it accepts parses the same from a buffer with more bytes after it.
//!
//! The parser is crate-private, so this target compiles its source file by
//! path (it depends on `bytes` only).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../src/backend/redis/resp.rs"]
#[allow(dead_code)]
mod resp;

fuzz_target!(|data: &[u8]| {
    let Ok(Some((frame, used))) = resp::parse(data) else {
        return;
    };
    assert!(used <= data.len());
    let mut longer = data[..used].to_vec();
    longer.extend_from_slice(b":1\r\n");
    match resp::parse(&longer) {
        Ok(Some((again, n))) => {
            assert_eq!(n, used, "the reply's end does not move");
            assert_eq!(again, frame);
        }
        other => panic!("an accepted reply stops parsing with bytes after it: {other:?}"),
    }
});
