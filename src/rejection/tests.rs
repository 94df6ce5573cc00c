//! Unit tests of `rejection.rs`.

use super::*;

#[test]
fn conflict_is_problem_json_with_retry_after() {
    let key = crate::key::KeyWriter::new(&crate::key::DigestKey::public()).finish();
    let r = Rejection::Conflict {
        key,
        retry_after: Duration::from_millis(1500),
    };
    let res = r.to_response();
    assert_eq!(res.status(), StatusCode::CONFLICT);
    assert_eq!(res.headers()[CONTENT_TYPE], PROBLEM_JSON);
    assert_eq!(res.headers()[RETRY_AFTER], "2");
    let v: serde_json::Value = serde_json::from_slice(res.body()).unwrap();
    assert_eq!(v["status"], 409);
    assert_eq!(v["type"], problem_type("conflict"));
    assert!(v["title"].is_string() && v["detail"].is_string());
    // The key digest is not echoed to the client.
    assert!(!String::from_utf8_lossy(res.body()).contains(&key.to_hex()));
}

/// One of every rejection, by an exhaustive match: a new variant fails
/// to compile here until it is listed (and then needs its docs anchor).
fn every_rejection() -> Vec<Rejection> {
    let key = crate::key::KeyWriter::new(&crate::key::DigestKey::public()).finish();
    let secs = Duration::from_secs(1);
    let all = vec![
        Rejection::Conflict {
            key,
            retry_after: secs,
        },
        Rejection::Unavailable { retry_after: secs },
        Rejection::PayloadTooLarge { limit: 1 },
        Rejection::BodyTimeout { after: secs },
        Rejection::InvalidBody,
        Rejection::MissingPart(MissingPart::bad_request("p", "d")),
        Rejection::MissingIdempotencyKey,
        Rejection::InvalidIdempotencyKey { reason: "r".into() },
        Rejection::InFlight { retry_after: secs },
        Rejection::Mismatch,
        Rejection::OverQuota { retry_after: secs },
        Rejection::NotStored {
            status: StatusCode::OK,
            reason: "r",
        },
        Rejection::MissingExtension {
            extractor: "Lease",
            layer: "RedisLockLayer",
        },
    ];
    for r in &all {
        match r {
            Rejection::Conflict { .. }
            | Rejection::Unavailable { .. }
            | Rejection::PayloadTooLarge { .. }
            | Rejection::BodyTimeout { .. }
            | Rejection::InvalidBody
            | Rejection::MissingPart(_)
            | Rejection::MissingIdempotencyKey
            | Rejection::InvalidIdempotencyKey { .. }
            | Rejection::InFlight { .. }
            | Rejection::Mismatch
            | Rejection::OverQuota { .. }
            | Rejection::NotStored { .. }
            | Rejection::MissingExtension { .. } => {}
        }
    }
    all
}

/// The kinds the replay service answers with directly (not through a
/// `Rejection`), read from the file that makes them
/// (`replay/answer.rs`): the second argument of each
/// `problem_response(` call.
fn replay_service_kinds() -> Vec<String> {
    let source = include_str!("../replay/answer.rs");
    let kinds: Vec<String> = source
        .split("problem_response(")
        .skip(1)
        .map(|call| {
            let after_status = &call[call.find(',').expect("a second argument") + 1..];
            let literal = after_status.trim_start();
            assert!(literal.starts_with('"'), "a literal kind: {literal:.40}");
            literal[1..literal[1..].find('"').unwrap() + 1].to_owned()
        })
        .collect();
    assert!(
        !kinds.is_empty(),
        "the replay service answers handler-failed"
    );
    kinds
}

#[test]
fn every_problem_type_links_to_its_documented_anchor() {
    let docs = include_str!("../rejection.rs");
    let mut kinds: Vec<String> = every_rejection()
        .iter()
        .map(|r| {
            let v: serde_json::Value = serde_json::from_slice(r.to_response().body()).unwrap();
            assert_eq!(v["type"], problem_type(r.kind()), "{r:?}");
            r.kind().to_owned()
        })
        .collect();
    kinds.extend(replay_service_kinds());
    for kind in &kinds {
        assert_eq!(
            problem_type(kind),
            format!(
                "https://docs.rs/tower-redis-lock/{}.{}/tower_redis_lock/enum.Rejection.html#{kind}",
                env!("CARGO_PKG_VERSION_MAJOR"),
                env!("CARGO_PKG_VERSION_MINOR")
            )
        );
        // rustdoc makes `### kind` in the enum docs `id="kind"`.
        assert!(
            docs.contains(&format!("\n/// ### {kind}\n")),
            "`{kind}` has no `### {kind}` heading in the `Rejection` docs"
        );
    }
    assert!(kinds.iter().any(|k| k == "handler-failed"));
}

#[test]
fn retry_after_rounds_up_and_is_at_least_one() {
    assert_eq!(retry_after_secs(Duration::ZERO), 1);
    assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
    assert_eq!(retry_after_secs(Duration::from_secs(3)), 3);
    assert_eq!(retry_after_secs(Duration::from_millis(3001)), 4);
}

#[test]
fn statuses() {
    assert_eq!(Rejection::PayloadTooLarge { limit: 1 }.status(), 413);
    assert_eq!(
        Rejection::BodyTimeout {
            after: Duration::from_secs(1)
        }
        .status(),
        408
    );
    assert_eq!(Rejection::InvalidBody.status(), 400);
    let r = Rejection::Unavailable {
        retry_after: Duration::from_secs(1),
    };
    assert_eq!(r.status(), 503);
    assert_eq!(r.to_response().headers()[RETRY_AFTER], "1");
    assert!(Rejection::PayloadTooLarge { limit: 1 }
        .to_response()
        .headers()
        .get(RETRY_AFTER)
        .is_none());
}
