use super::*;
use crate::idempotency::record::NotStoredReason;

fn done() -> Record {
    Record::NotStored {
        status: http::StatusCode::OK,
        reason: NotStoredReason::Streaming,
    }
}

#[tokio::test]
async fn waiters_get_the_outcome_and_the_entry_goes() {
    let flights = Arc::new(Flights::default());
    let key = Bytes::from_static(b"k");
    let flight = flights.begin(key.clone(), Bytes::from_static(b"fp"));
    assert!(matches!(flights.join(&key, b"other"), Join::Mismatch));
    let Join::Wait(mut rx, _) = flights.join(&key, b"fp") else {
        panic!("in flight");
    };
    flight.finish(Outcome::Recorded(done()));
    assert_eq!(flights.len(), 0);
    let seen = rx.wait_for(Option::is_some).await.unwrap().clone();
    assert!(matches!(seen, Some(Outcome::Recorded(r)) if r == done()));
    assert!(matches!(flights.join(&key, b"fp"), Join::Absent));
}

#[tokio::test]
async fn a_dropped_flight_closes_its_waiters_and_spares_a_newer_one() {
    let flights = Arc::new(Flights::default());
    let key = Bytes::from_static(b"k");
    let old = flights.begin(key.clone(), Bytes::from_static(b"fp"));
    let Join::Wait(mut rx, _) = flights.join(&key, b"fp") else {
        panic!("in flight");
    };
    drop(old);
    assert!(
        rx.wait_for(Option::is_some).await.is_err(),
        "closed, no outcome"
    );
    let newer = flights.begin(key.clone(), Bytes::from_static(b"fp"));
    let stale = Flight {
        flights: flights.clone(),
        key: key.clone(),
        id: u64::MAX,
    };
    drop(stale);
    assert_eq!(
        flights.len(),
        1,
        "an older flight never removes a newer one"
    );
    drop(newer);
    assert_eq!(flights.len(), 0);
}
