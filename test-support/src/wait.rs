//! The one wait helper, for work that has no other signal.

use std::future::Future;
use std::time::Duration;

/// Run `attempt` every `every` until it returns `Ok` or `within` passes
/// (always at least once): the `Ok` value and how long it took, or the last
/// `Err`. For waiting on work that has no other signal (a spawned release, a
/// failover, a server coming back); where a channel or barrier exists, use it.
pub async fn retry_until<T, E, Fut>(
    within: Duration,
    every: Duration,
    mut attempt: impl FnMut() -> Fut,
) -> Result<(Duration, T), E>
where
    Fut: Future<Output = Result<T, E>>,
{
    // tokio's clock: under paused time the deadline moves with the sleeps.
    let started = tokio::time::Instant::now();
    loop {
        match attempt().await {
            Ok(value) => return Ok((started.elapsed(), value)),
            Err(last) if started.elapsed() >= within => return Err(last),
            Err(_) => tokio::time::sleep(every).await,
        }
    }
}

/// Poll `cond` every 5 ms until it holds (`true`) or `within` passes
/// (`false`): [`retry_until`] for a plain condition.
pub async fn eventually(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let check = || std::future::ready(if cond() { Ok(()) } else { Err(()) });
    retry_until(within, Duration::from_millis(5), check)
        .await
        .is_ok()
}
