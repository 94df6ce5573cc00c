//! What every check of the suite uses: keys of its own, drawn at random,
//! and the panic that names a method which answered an error.

use bytes::Bytes;

use crate::backend::{BackendError, EntryKey, Token};
use crate::key::{KeySpace, LockKey};

/// A digest of its own for `check`: random, so runs never meet.
pub(super) fn fresh_digest(check: &str) -> LockKey {
    let mut w = KeySpace::default().writer();
    w.push("check", check.as_bytes());
    w.push("run", Token::generate().as_bytes());
    w.finish()
}

/// A lease key of its own for `check`, as the lock layer makes them
/// (`trl:{hex}`).
pub(super) fn fresh_lease_key(check: &str) -> Bytes {
    KeySpace::default().storage_key(&fresh_digest(check))
}

/// An entry named `name` in `scope`.
pub(super) fn entry_in(scope: &LockKey, name: &str) -> EntryKey {
    let mut w = KeySpace::default().writer();
    w.push("entry", name.as_bytes());
    EntryKey::new(&KeySpace::default(), scope, &w.finish())
}

/// `result`, or a panic naming the `method` that answered an error.
pub(super) fn answered<T>(method: &str, result: Result<T, BackendError>) -> T {
    result.unwrap_or_else(|e| panic!("{method}: the store answered an error: {e}"))
}
