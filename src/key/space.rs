//! [`KeySpace`]: the prefix of every backend key and the secret of the keyed
//! digest.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;

use super::{DigestKey, KeyWriter, LockKey, RECORD_KEY_CONTEXT};

/// The default key prefix.
const DEFAULT_PREFIX: &str = "trl";

/// Where keys live and how they are hashed: the prefix of every backend key
/// (`prefix:{digest}`) and the secret that makes the digest a MAC.
///
/// Both layers take one ([`RedisLockLayer::key_space`](crate::RedisLockLayer::key_space),
/// [`IdempotencyLayer::key_space`](crate::IdempotencyLayer::key_space)); a
/// fleet builds it once, from its secret store, and hands the same value to
/// every layer of every instance. Without a secret, digests are stable but
/// unkeyed: low-entropy key material (user ids, amounts) could be recovered
/// from a shared backend by guessing, so the first layer over a shared
/// backend logs a warning, once per process (none for
/// [`MemoryBackend`](crate::MemoryBackend), whose keys never leave the
/// process).
///
/// ```
/// use tower_redis_lock::key::KeySpace;
///
/// let space = KeySpace::new("shop").secret(b"32 bytes from your secret store.");
/// # let _ = space;
/// ```
#[derive(Clone)]
pub struct KeySpace {
    prefix: Arc<str>,
    digest: DigestKey,
    /// The length of a secret that was given and refused as too short.
    short_secret: Option<usize>,
}

/// The shortest secret [`KeySpace::secret`] accepts.
pub(crate) const MIN_SECRET_LEN: usize = 16;

impl Default for KeySpace {
    /// Prefix `trl`, no secret.
    fn default() -> Self {
        Self::new(DEFAULT_PREFIX)
    }
}

impl fmt::Debug for KeySpace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeySpace")
            .field("prefix", &self.prefix)
            .field("keyed", &self.is_keyed())
            .finish()
    }
}

impl KeySpace {
    /// Keys under `prefix` (`prefix:{digest}`), no secret yet.
    ///
    /// ```
    /// # use tower_redis_lock::key::KeySpace;
    /// let space = KeySpace::new("shop:lock");
    /// # let _ = space;
    /// ```
    ///
    /// # Panics
    /// If `prefix` contains `{` or `}`: it would move the Redis Cluster hash
    /// tag out of the digest (a configuration error, caught at start-up).
    pub fn new(prefix: &str) -> Self {
        assert!(
            !prefix.contains(['{', '}']),
            "tower-redis-lock: the key prefix must not contain '{{' or '}}' (it would steer the Redis Cluster hash slot): {prefix:?}"
        );
        Self {
            prefix: Arc::from(prefix),
            digest: DigestKey::public(),
            short_secret: None,
        }
    }

    /// Hash keys with `secret` (BLAKE3 keyed mode). Every instance sharing a
    /// backend must use the same secret: at least 16 bytes, random (32 from
    /// your secret store is a good size).
    ///
    /// A secret shorter than 16 bytes is **no secret**: keys stay unkeyed,
    /// and the first layer over a shared backend logs the "no secret"
    /// warning, naming the length it was given. So
    /// `secret(std::env::var("LOCK_SECRET").unwrap_or_default())` with the
    /// variable unset warns instead of keying every digest with the empty
    /// string, which anyone who can read the store could compute too.
    ///
    /// ```
    /// # use tower_redis_lock::key::KeySpace;
    /// let space = KeySpace::default().secret(b"from your secret store");
    /// # let _ = space;
    /// ```
    pub fn secret(mut self, secret: impl AsRef<[u8]>) -> Self {
        let secret = secret.as_ref();
        if secret.len() < MIN_SECRET_LEN {
            self.digest = DigestKey::public();
            self.short_secret = Some(secret.len());
        } else {
            self.digest = DigestKey::from_secret(secret);
            self.short_secret = None;
        }
        self
    }

    pub(crate) fn is_keyed(&self) -> bool {
        self.digest != DigestKey::public()
    }

    pub(crate) fn writer(&self) -> KeyWriter {
        KeyWriter::new(&self.digest)
    }

    /// The key prefix (`trl` by default).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))] // the Redis store's
    pub(crate) fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The key that authenticates stored idempotency records, derived from
    /// the secret; `None` without a secret (records are then trusted only
    /// when read from their own key).
    pub(crate) fn record_key(&self) -> Option<[u8; 32]> {
        self.is_keyed()
            .then(|| blake3::derive_key(RECORD_KEY_CONTEXT, &self.digest.0))
    }

    /// The backend key of `key`: `prefix:{hex}`.
    pub(crate) fn storage_key(&self, key: &LockKey) -> Bytes {
        key.storage_key(&self.prefix)
    }

    /// Warn once per process when the keys leave the process unkeyed.
    pub(crate) fn warn_if_public(&self, backend_in_process: bool) {
        if !backend_in_process {
            self.digest.warn_if_public(self.short_secret);
        }
    }
}
