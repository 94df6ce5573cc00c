use super::*;

#[test]
fn default_policy() {
    // 408 included: below this layer the body has arrived whole (the
    // layer's own 408 comes before any claim), so a 408 there is a timeout
    // that cut a handler that may have charged.
    for ok in [200, 201, 204, 303, 400, 402, 404, 408, 422, 500, 502, 503] {
        assert!(
            default_store_when(StatusCode::from_u16(ok).unwrap()),
            "{ok}"
        );
    }
    for no in [101, 409, 429] {
        assert!(
            !default_store_when(StatusCode::from_u16(no).unwrap()),
            "{no}"
        );
    }
}

#[test]
#[should_panic(expected = "\"x request id\" is not a valid header name to fingerprint")]
fn an_invalid_fingerprint_header_is_named_at_start_up() {
    let layer = IdempotencyLayer::new(crate::MemoryBackend::new(), crate::key::RequestMethod);
    let _ = layer.fingerprint_header("x request id");
}
