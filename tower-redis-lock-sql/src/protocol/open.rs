//! [`Open`]: one open claim of a store.

use tokio::time::Instant;

use super::ClaimConn;
use crate::adapter::{Adapter, Ask};
use crate::open_count::Counted;

/// One open claim: from its claim until its completion or abandon has
/// finished with its connection (in the table of open claims meanwhile, or
/// moved into the completion or the abandon's task). Counted while it lives.
pub(crate) struct Open<A: Adapter> {
    pub(crate) ask: Ask,
    pub(super) expires: Instant,
    /// Tells the transaction the claim opened apart.
    pub(crate) marker: A::Marker,
    /// The handler ended the transaction itself: the next completion writes
    /// its record outside any transaction.
    pub(super) ended: bool,
    pub(super) conn: ClaimConn<A::Conn>,
    pub(super) _counted: Counted,
}
