use super::*;
use crate::key::DigestKey;

fn key_of(part: &impl KeyPart, req: http::Request<()>) -> Result<crate::key::LockKey, MissingPart> {
    let (parts, ()) = req.into_parts();
    let mut w = KeyWriter::new(&DigestKey::public());
    part.write(&parts, &mut w)?;
    Ok(w.finish())
}

#[derive(Clone)]
struct UserId(&'static str);
impl fmt::Display for UserId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

#[test]
fn method_and_path_distinguish() {
    let get = key_of(
        &(RequestMethod, UriPath),
        http::Request::get("/a").body(()).unwrap(),
    )
    .unwrap();
    let post = key_of(
        &(RequestMethod, UriPath),
        http::Request::post("/a").body(()).unwrap(),
    )
    .unwrap();
    let other = key_of(
        &(RequestMethod, UriPath),
        http::Request::get("/b").body(()).unwrap(),
    )
    .unwrap();
    assert_ne!(get, post);
    assert_ne!(get, other);
}

#[test]
fn route_falls_back_to_path() {
    let route = key_of(&Route, http::Request::get("/x/1?q=2").body(()).unwrap()).unwrap();
    let again = key_of(&Route, http::Request::get("/x/1?q=3").body(()).unwrap()).unwrap();
    assert_eq!(route, again, "the query is not part of the route");
}

#[test]
fn identity_from_extension() {
    let mut a = http::Request::post("/pay").body(()).unwrap();
    a.extensions_mut().insert(UserId("alice"));
    let mut b = http::Request::post("/pay").body(()).unwrap();
    b.extensions_mut().insert(UserId("bob"));
    let part = Identity::<UserId>::new();
    assert_ne!(key_of(&part, a).unwrap(), key_of(&part, b).unwrap());
    let missing = key_of(&part, http::Request::post("/pay").body(()).unwrap()).unwrap_err();
    assert_eq!(missing.status(), http::StatusCode::UNAUTHORIZED);
}

#[test]
fn forged_header_is_ignored_by_identity() {
    // The identity comes from the extension; a client header claiming to
    // be bob does not change alice's key.
    let mut a = http::Request::post("/pay")
        .header("x-user-id", "bob")
        .body(())
        .unwrap();
    a.extensions_mut().insert(UserId("alice"));
    let mut b = http::Request::post("/pay").body(()).unwrap();
    b.extensions_mut().insert(UserId("alice"));
    let part = Identity::<UserId>::new();
    assert_eq!(key_of(&part, a).unwrap(), key_of(&part, b).unwrap());
}

#[test]
fn trusted_header_missing_or_empty_is_401() {
    let part = Header::trusted_identity("x-user-id");
    let err = key_of(&part, http::Request::post("/").body(()).unwrap()).unwrap_err();
    assert_eq!(err.status(), http::StatusCode::UNAUTHORIZED);
    let err = key_of(
        &part,
        http::Request::post("/")
            .header("x-user-id", "")
            .body(())
            .unwrap(),
    )
    .unwrap_err();
    assert_eq!(err.status(), http::StatusCode::UNAUTHORIZED);
}

#[test]
fn repeated_trusted_header_is_400_naming_the_count() {
    // A gateway that appends instead of overwriting leaves the client's
    // own value first: neither value may be trusted.
    let part = Header::trusted_identity("x-user-id");
    let req = http::Request::post("/")
        .header("x-user-id", "bob")
        .header("x-user-id", "alice")
        .body(())
        .unwrap();
    let err = key_of(&part, req).unwrap_err();
    assert_eq!(err.status(), http::StatusCode::BAD_REQUEST);
    assert!(err.detail().contains("`x-user-id`"), "{}", err.detail());
    assert!(err.detail().contains("2 times"), "{}", err.detail());
    assert!(err.detail().contains("overwrite"), "{}", err.detail());
    // One value is fine.
    let one = http::Request::post("/")
        .header("x-user-id", "alice")
        .body(())
        .unwrap();
    assert!(key_of(&part, one).is_ok());
}

#[test]
fn a_header_sent_twice_is_refused_as_malformed() {
    // A handler reads the first value: a second line of anything must
    // not make another key for the same request.
    for part in [
        Header::new("x-order-ref"),
        Header::optional("x-order-ref"),
        Header::trusted_identity("x-order-ref"),
    ] {
        let req = http::Request::post("/")
            .header("x-order-ref", "42")
            .header("x-order-ref", "junk")
            .body(())
            .unwrap();
        let err = key_of(&part, req).unwrap_err();
        assert_eq!(err.status(), http::StatusCode::BAD_REQUEST, "{part:?}");
        assert!(err.is_malformed(), "{part:?}: {err}");
        assert!(err.detail().contains("2 times"), "{}", err.detail());
    }
    // Absent is not malformed.
    let absent = key_of(
        &Header::new("x-order-ref"),
        http::Request::post("/").body(()).unwrap(),
    )
    .unwrap_err();
    assert!(!absent.is_malformed());
}

#[test]
fn a_path_spelled_with_percent_escapes_is_the_same_key() {
    fn check(part: &impl KeyPart) {
        let key = |path: &str| key_of(part, http::Request::post(path).body(()).unwrap()).unwrap();
        assert_eq!(key("/orders/42"), key("/orders/%34%32"));
        assert_eq!(key("/a/%3a"), key("/a/%3A"));
        assert_eq!(key("/a/%3a"), key("/a/:"));
        assert_ne!(key("/orders/42"), key("/orders/43"));
    }
    check(&UriPath);
    check(&Route);
}

#[test]
fn empty_identity_is_401() {
    // An identity whose Display is empty would put every such request
    // in one scope.
    let mut req = http::Request::post("/pay").body(()).unwrap();
    req.extensions_mut().insert(UserId(""));
    let err = key_of(&Identity::<UserId>::new(), req).unwrap_err();
    assert_eq!(err.status(), http::StatusCode::UNAUTHORIZED);
    assert!(err.detail().contains("empty"), "{}", err.detail());
}

#[test]
fn non_utf8_header_values_are_fine() {
    let value = http::HeaderValue::from_bytes(b"\xff\xfe caf\xe9").unwrap();
    let req = http::Request::post("/")
        .header("x-user-id", value)
        .body(())
        .unwrap();
    assert!(key_of(&Header::trusted_identity("x-user-id"), req).is_ok());
}

#[test]
fn header_part_required_and_optional() {
    let err = key_of(
        &Header::new("x-ref"),
        http::Request::get("/").body(()).unwrap(),
    )
    .unwrap_err();
    assert_eq!(err.status(), http::StatusCode::BAD_REQUEST);
    assert!(err.detail().contains("x-ref"));
    assert!(key_of(
        &Header::optional("x-ref"),
        http::Request::get("/").body(()).unwrap()
    )
    .is_ok());
}

#[test]
fn header_names_in_any_case_name_the_same_header() {
    let req = || {
        http::Request::post("/")
            .header("x-user-id", "alice")
            .body(())
            .unwrap()
    };
    let mixed = key_of(&Header::trusted_identity("X-User-Id"), req()).unwrap();
    let lower = key_of(&Header::trusted_identity("x-user-id"), req()).unwrap();
    let typed = key_of(
        &Header::trusted_identity(http::HeaderName::from_static("x-user-id")),
        req(),
    )
    .unwrap();
    assert_eq!(mixed, lower);
    assert_eq!(typed, lower);
    assert!(key_of(&Header::new("X-User-Id"), req()).is_ok());
}

#[test]
#[should_panic(expected = "\"x user id\" is not a valid header name")]
fn an_invalid_header_name_is_named_at_start_up() {
    let _ = Header::new("x user id");
}

#[test]
fn closures_are_parts() {
    let part = |p: &Parts, k: &mut KeyWriter| {
        k.push("q", p.uri.query().unwrap_or("").as_bytes());
        Ok(())
    };
    let a = key_of(&part, http::Request::get("/?a=1").body(()).unwrap()).unwrap();
    let b = key_of(&part, http::Request::get("/?a=2").body(()).unwrap()).unwrap();
    assert_ne!(a, b);
}

/// HTTP/2 sends each cookie as a field of its own (RFC 9113, 8.2.3): not a
/// repeated header, the same key as one HTTP/1.1 line.
#[test]
fn cookies_split_by_http2_are_one_header() {
    let part = Header::new("cookie");
    let split = http::Request::post("/")
        .header("cookie", "a=1")
        .header("cookie", "b=2")
        .body(())
        .unwrap();
    let one = http::Request::post("/")
        .header("cookie", "a=1; b=2")
        .body(())
        .unwrap();
    assert_eq!(key_of(&part, split).unwrap(), key_of(&part, one).unwrap());
}

/// HTTP/2 sends the host as `:authority` (in the URI, no `Host` header):
/// a `Host` key part reads it there, so the same request keys alike over
/// both protocols (400, or another key, over HTTP/2 before).
#[test]
fn the_host_is_read_from_the_authority_over_http2() {
    for part in [Header::new("host"), Header::optional("host")] {
        let http1 = http::Request::post("/pay")
            .header("host", "shop.example")
            .body(())
            .unwrap();
        let http2 = http::Request::post("https://shop.example/pay")
            .body(())
            .unwrap();
        assert_eq!(key_of(&part, http1).unwrap(), key_of(&part, http2).unwrap());
    }
}
