//! Unit tests of `rejection.rs`.

use http::{HeaderValue, StatusCode};

use super::*;

/// The default answer becomes a gRPC status for a gRPC request only; a
/// hook's gRPC answer is kept, its HTTP answer replaced.
#[test]
fn answers_follow_the_request_protocol() {
    let r = Rejection::Mismatch;
    let http = respond(None, &r);
    assert!(http.extensions().get::<Rejected>().is_some());
    let kept = for_request(http, false);
    assert_eq!(kept.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert!(kept.extensions().get::<Rejected>().is_none());
    let turned = for_request(respond(None, &r), true);
    assert_eq!(turned.headers()["grpc-status"], "9");
    let hook: Responder = Arc::new(|r: &Rejection| {
        let mut res = r.to_grpc_response();
        res.headers_mut()
            .insert("x-hook", HeaderValue::from_static("1"));
        res
    });
    let hooked = for_request(respond(Some(&hook), &r), true);
    assert_eq!(hooked.headers()["x-hook"], "1");
    let http_hook: Responder = Arc::new(|r: &Rejection| r.to_response());
    let replaced = for_request(respond(Some(&http_hook), &r), true);
    assert_eq!(replaced.headers()["grpc-status"], "9");
    // An answer that is no rejection's passes untouched.
    let other = for_request(Response::new(Bytes::from_static(b"x")), true);
    assert!(other.headers().is_empty());
}
