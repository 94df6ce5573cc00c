use super::*;
use crate::idempotency::record::NotStoredReason;
use http::StatusCode;

fn record() -> Record {
    Record::NotStored {
        status: StatusCode::CREATED,
        reason: NotStoredReason::TooLarge,
    }
}

#[test]
fn sealed_records_open_only_for_their_key_fingerprint_and_secret() {
    let space = SealKey::of(&KeySpace::default().secret(b"s1 -------------"));
    let sealed = seal(&space, b"k1", b"fp", &record());
    assert_eq!(open(&space, b"k1", b"fp", sealed.clone()), Ok(record()));
    assert_eq!(
        open(&space, b"k2", b"fp", sealed.clone()),
        Err(Unsealed::Forged),
        "moved to another key"
    );
    assert_eq!(
        open(&space, b"k1", b"fp2", sealed.clone()),
        Err(Unsealed::Forged),
        "another fingerprint"
    );
    let other = SealKey::of(&KeySpace::default().secret(b"s2 -------------"));
    assert_eq!(
        open(&other, b"k1", b"fp", sealed.clone()),
        Err(Unsealed::Forged)
    );
    assert_eq!(
        open(
            &SealKey::of(&KeySpace::default()),
            b"k1",
            b"fp",
            sealed.clone()
        ),
        Err(Unsealed::Forged),
        "a layer without the secret does not trust it either"
    );
    let mut flipped = sealed.to_vec();
    *flipped.last_mut().unwrap() ^= 1;
    assert_eq!(
        open(&space, b"k1", b"fp", flipped.into()),
        Err(Unsealed::Forged)
    );
    // An unsealed record (what a co-tenant can write) is refused.
    assert_eq!(
        open(&space, b"k1", b"fp", record().encode()),
        Err(Unsealed::Forged)
    );
    for short in [&b""[..], b"S", &sealed[..20]] {
        assert_eq!(
            open(&space, b"k1", b"fp", Bytes::copy_from_slice(short)),
            Err(Unsealed::Forged)
        );
    }
}

#[test]
fn without_a_secret_the_record_is_stored_as_encoded() {
    let space = SealKey::of(&KeySpace::default());
    assert!(!space.is_set());
    let sealed = seal(&space, b"k1", b"fp", &record());
    assert_eq!(sealed, record().encode());
    assert_eq!(open(&space, b"k1", b"fp", sealed), Ok(record()));
    assert!(matches!(
        open(&space, b"k1", b"fp", Bytes::from_static(b"R\x01")),
        Err(Unsealed::Corrupt(_))
    ));
}
