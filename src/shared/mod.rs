//! What both layers share: the pieces the lock and the idempotency layers
//! (and the in-process tables under them) would otherwise each write again.

pub(crate) mod expiring;
