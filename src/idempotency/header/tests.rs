use super::*;

#[test]
fn quoted_and_bare_forms() {
    let k = IdempotencyKey::parse(b"  \"a b\\\"c\\\\\"  ").unwrap();
    assert_eq!(k.as_str(), "a b\"c\\");
    let uuid = "8e03978e-40d5-43e8-bc93-6894a57f9324";
    assert_eq!(
        IdempotencyKey::parse(uuid.as_bytes()).unwrap().as_str(),
        uuid
    );
    assert_eq!(
        IdempotencyKey::parse(b"dGVzdA==").unwrap().as_str(),
        "dGVzdA=="
    );
}

#[test]
fn refusals() {
    use InvalidKey::*;
    assert_eq!(IdempotencyKey::parse(b""), Err(Empty));
    assert_eq!(IdempotencyKey::parse(b"\"\""), Err(Empty));
    assert_eq!(IdempotencyKey::parse(b"\"abc"), Err(Malformed));
    assert_eq!(IdempotencyKey::parse(b"\"a\\b\""), Err(Malformed));
    assert_eq!(IdempotencyKey::parse(b"\"a\";p=1"), Err(Malformed));
    assert_eq!(IdempotencyKey::parse(b"a b"), Err(Character(b' ')));
    assert_eq!(IdempotencyKey::parse(b"a,b"), Err(Character(b',')));
    assert_eq!(
        IdempotencyKey::parse(b"\"caf\xc3\xa9\""),
        Err(Character(0xc3))
    );
    let long = "k".repeat(MAX_KEY_LEN);
    assert!(IdempotencyKey::parse(long.as_bytes()).is_ok());
    let long = "k".repeat(MAX_KEY_LEN + 1);
    assert_eq!(IdempotencyKey::parse(long.as_bytes()), Err(TooLong(256)));
}

#[test]
fn repeated_header_is_refused() {
    let mut h = HeaderMap::new();
    assert_eq!(IdempotencyKey::from_headers(&h), Ok(None));
    h.append(IDEMPOTENCY_KEY, "a".parse().unwrap());
    assert!(IdempotencyKey::from_headers(&h).unwrap().is_some());
    h.append(IDEMPOTENCY_KEY, "b".parse().unwrap());
    assert_eq!(IdempotencyKey::from_headers(&h), Err(InvalidKey::Repeated));
}
