//! Unit tests of `rejection/kinds.rs`.

use http::header::{CONTENT_TYPE, RETRY_AFTER};

use super::*;
use crate::wire::problem::{problem_type, PROBLEM_JSON};

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
        Rejection::BodyLimited,
        Rejection::BodyTimeout { after: secs },
        Rejection::InvalidBody,
        Rejection::MissingPart(MissingPart::bad_request("p", "d")),
        Rejection::CompressedMessage {
            encoding: "gzip".into(),
        },
        Rejection::MalformedMessage { reason: "r" },
        Rejection::MissingIdempotencyKey,
        Rejection::InvalidIdempotencyKey { reason: "r".into() },
        Rejection::InFlight { retry_after: secs },
        Rejection::OutcomeUnknown { retry_after: secs },
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
            | Rejection::BodyLimited
            | Rejection::BodyTimeout { .. }
            | Rejection::InvalidBody
            | Rejection::MissingPart(_)
            | Rejection::CompressedMessage { .. }
            | Rejection::MalformedMessage { .. }
            | Rejection::MissingIdempotencyKey
            | Rejection::InvalidIdempotencyKey { .. }
            | Rejection::InFlight { .. }
            | Rejection::OutcomeUnknown { .. }
            | Rejection::Mismatch
            | Rejection::OverQuota { .. }
            | Rejection::NotStored { .. }
            | Rejection::MissingExtension { .. } => {}
        }
    }
    all
}

/// The kinds the idempotency layer answers with directly (not through a
/// `Rejection`), read from the file that makes them
/// (`idempotency/answer.rs`): the second argument of each
/// `problem_response(` call.
fn replay_service_kinds() -> Vec<String> {
    let source = include_str!("../../idempotency/answer.rs");
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
    let docs = include_str!("../kinds.rs");
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

/// Every kind's gRPC code is the one its docs name ("gRPC: **`CODE`**"),
/// and its gRPC answer is trailers-only with that code.
#[test]
fn every_kind_documents_its_grpc_code() {
    const NAMES: [&str; 17] = [
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    ];
    let docs = include_str!("../kinds.rs");
    for r in every_rejection() {
        let heading = format!("\n/// ### {}\n", r.kind());
        let section = &docs[docs.find(&heading).unwrap() + heading.len()..];
        let section = &section[..section.find("/// ###").unwrap_or(section.len())];
        let name = NAMES[r.grpc_code() as usize];
        let grpc = &section[section.find("/// gRPC: ").expect("a gRPC paragraph")..];
        assert!(
            grpc.contains(&format!("**`{name}`**")),
            "{}: code {name} is not the one documented",
            r.kind()
        );
        let res = r.to_grpc_response();
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(res.headers()[CONTENT_TYPE], "application/grpc");
        assert_eq!(res.headers()["grpc-status"], r.grpc_code().to_string());
        assert!(res.body().is_empty(), "trailers-only: no body");
        assert_eq!(
            res.headers().contains_key("grpc-retry-pushback-ms"),
            r.retry_after().is_some()
        );
    }
    assert!(docs.contains("### handler-failed\n") && docs.contains("gRPC: **`UNKNOWN`**"));
}

/// A missing part's code follows its HTTP status.
#[test]
fn missing_part_codes_follow_the_status() {
    let unauthenticated = Rejection::MissingPart(MissingPart::unauthenticated("identity", "d"));
    assert_eq!(unauthenticated.grpc_code(), 16);
    let bad = Rejection::MissingPart(MissingPart::bad_request("header", "d"));
    assert_eq!(bad.grpc_code(), 3);
    let forbidden = Rejection::MissingPart(MissingPart::new("tenant", StatusCode::FORBIDDEN, "d"));
    assert_eq!(forbidden.grpc_code(), 7);
}

#[test]
fn compressed_message_names_the_accepted_encoding() {
    let r = Rejection::CompressedMessage {
        encoding: "gzip".into(),
    };
    let res = r.to_grpc_response();
    assert_eq!(res.headers()["grpc-status"], "12");
    assert_eq!(res.headers()["grpc-accept-encoding"], "identity");
    let message = res.headers()["grpc-message"].to_str().unwrap();
    assert!(message.contains("`gzip`"), "{message}");
}
