use super::*;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Answers from a script: true, false, or an error.
struct Scripted {
    answers: std::sync::Mutex<Vec<Result<bool, &'static str>>>,
    calls: AtomicUsize,
}

impl Extend for Scripted {
    fn extend(&self, _: Duration) -> Option<BackendFuture<bool>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let next = self.answers.lock().unwrap().remove(0);
        Some(crate::backend::BackendFuture::ready(
            next.map_err(crate::backend::BackendError::new),
        ))
    }
}

#[test]
fn interval_is_a_fraction_of_the_ttl_and_capped() {
    let ttl = Duration::from_secs(3);
    assert_eq!(Renewal::new().interval(ttl), Duration::from_secs(1));
    assert_eq!(
        Renewal::new().at_fraction(0.5).interval(ttl),
        Duration::from_millis(1500)
    );
    assert_eq!(
        Renewal::new().every(Duration::from_secs(10)).interval(ttl),
        Duration::from_millis(2700)
    );
    assert_eq!(
        Renewal::new().at_fraction(f64::NAN).interval(ttl),
        Duration::from_secs(1)
    );
}

#[tokio::test(start_paused = true)]
async fn renews_every_interval_retries_sooner_after_a_failure_and_stops_at_the_cap() {
    let ttl = Duration::from_secs(3);
    let now = Instant::now();
    let mut s = Schedule::new(
        &Renewal::new().max_renewals(2),
        ttl,
        Duration::from_millis(200),
        now,
        now + ttl,
        Duration::from_millis(500),
    );
    let target = Scripted {
        answers: std::sync::Mutex::new(vec![Err("down"), Ok(true), Ok(true), Ok(false)]),
        calls: AtomicUsize::new(0),
    };
    assert_eq!(
        s.next(),
        Some(now + Duration::from_secs(1)),
        "a third of the TTL"
    );
    tokio::time::sleep_until(s.next().unwrap()).await;
    assert!(matches!(s.renew(&target).await, Renewed::Failed(_)));
    assert_eq!(
        s.next(),
        Some(now + Duration::from_millis(1500)),
        "sooner after a failure"
    );
    assert_eq!(s.valid_until, now + ttl, "a failure extends nothing");
    tokio::time::sleep_until(s.next().unwrap()).await;
    assert!(matches!(s.renew(&target).await, Renewed::Extended));
    assert_eq!(s.valid_until, now + Duration::from_millis(1500) + ttl);
    tokio::time::sleep_until(s.next().unwrap()).await;
    assert!(matches!(s.renew(&target).await, Renewed::Extended));
    assert_eq!(s.renewals, 2);
    assert_eq!(s.next(), None, "capped at two renewals");
    assert_eq!(target.calls.load(Ordering::SeqCst), 3);
}

#[tokio::test(start_paused = true)]
async fn never_scheduled_past_the_known_expiry_and_capped_by_total_time() {
    let ttl = Duration::from_secs(3);
    let now = Instant::now();
    let s = Schedule::new(
        &Renewal::new().every(Duration::from_secs(2)),
        ttl,
        Duration::from_millis(200),
        now,
        now + Duration::from_secs(1),
        Duration::from_secs(1),
    );
    assert_eq!(
        s.next(),
        Some(now + Duration::from_secs(1)),
        "the validity comes first"
    );
    let s = Schedule::new(
        &Renewal::new().max_total(Duration::from_millis(500)),
        ttl,
        Duration::from_millis(200),
        now,
        now + ttl,
        Duration::from_secs(1),
    );
    assert_eq!(
        s.next(),
        None,
        "the first renewal would come after the total"
    );
}

/// Past the known expiry (every renewal failed), a failed renewal is tried
/// again `retry` later, not at once: a store that fails at once (down,
/// its buffer full) is not asked again in a loop while the work runs.
#[tokio::test(start_paused = true)]
async fn past_the_known_expiry_a_failed_renewal_waits_its_retry() {
    let ttl = Duration::from_secs(3);
    let now = Instant::now();
    let retry = Duration::from_millis(500);
    let mut s = Schedule::new(
        &Renewal::new(),
        ttl,
        Duration::from_millis(200),
        now,
        now + ttl,
        retry,
    );
    let target = Scripted {
        answers: std::sync::Mutex::new(vec![Err("down"); 20]),
        calls: AtomicUsize::new(0),
    };
    tokio::time::sleep_until(now + ttl + Duration::from_millis(100)).await;
    let sent = Instant::now();
    assert!(matches!(s.renew(&target).await, Renewed::Failed(_)));
    assert_eq!(s.next(), Some(sent + retry), "tried again a retry later");
}
