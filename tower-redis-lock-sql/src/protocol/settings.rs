//! A SQL store's settings and their defaults.

use std::time::Duration;

/// Default bound on one wait for another claim's hold of the key.
pub(crate) const DEFAULT_LOCK_WAIT: Duration = Duration::from_millis(100);
/// Least time between two sweeps.
pub(crate) const SWEEP_EVERY: Duration = Duration::from_secs(5);
/// Rows one batch of a sweep deletes.
pub(crate) const SWEEP_BATCH: i64 = 1_000;
/// Most time one sweep spends (batch after batch while they come back full).
pub(crate) const SWEEP_BUDGET: Duration = Duration::from_secs(2);
/// Default bound on the handler's `COMMIT` (and on finding out whether one
/// whose answer was lost landed).
pub(crate) const DEFAULT_COMMIT_TIMEOUT: Duration = Duration::from_secs(5);

/// A store's settings (its builders change them; claims in flight keep
/// the ones they started with).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    /// Bound on one wait for another claim's hold of the key.
    pub(crate) lock_wait: Duration,
    /// The statement that opens the handler's transaction (`None`: the
    /// adapter's own).
    pub(crate) begin: Option<&'static str>,
    /// Bound on the handler's `COMMIT`, and on finding out whether one
    /// whose answer was lost landed.
    pub(crate) commit_timeout: Duration,
}
