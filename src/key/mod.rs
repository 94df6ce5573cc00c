//! Lock key derivation: which parts of a request make two requests "the same".
//!
//! A key is built from [`KeyPart`]s. Each part writes zero or more labelled
//! values into a [`KeyWriter`]; the writer feeds them, length-prefixed, into a
//! keyed BLAKE3 hash. The result is a [`LockKey`]: 16 bytes, shown as 32 hex
//! characters. Only that digest ever reaches the backend, never a raw header,
//! path or body byte, and its length does not depend on the input.
//!
//! Parts compose as tuples:
//!
//! ```
//! use tower_redis_lock::key::*; // no clash with `http::Method` or `axum::extract::Path`
//!
//! let key = (RequestMethod, Route, Header::trusted_identity("X-User-Id"));
//! # let _ = key;
//! ```
//!
//! Built-ins: [`RequestMethod`], [`Route`] (route template), [`UriPath`]
//! (concrete path), [`Header`], [`Identity`] (typed request extension put
//! there by your auth layer), [`Header::trusted_identity`] (identity from a header you
//! trust) and any closure
//! `Fn(&http::request::Parts, &mut KeyWriter) -> Result<(), MissingPart>`.
//! The request body joins the key through
//! [`RedisLockLayer::digest_body`](crate::RedisLockLayer::digest_body); the
//! idempotency layer always fingerprints it.
//!
//! Where the keys live and how they are hashed is a [`KeySpace`]: the prefix
//! of every backend key and the secret of the keyed digest. A fleet sets one
//! and gives it to every layer.

mod parts;
pub(crate) use parts::{header_name, joined_cookies, push_path};

pub use parts::{Header, Identity, RequestMethod, Route, UriPath};

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use bytes::Bytes;

use http::request::Parts;
use http::StatusCode;

/// Context string for the key used when no secret is configured.
const DEFAULT_KEY_CONTEXT: &str = "tower-redis-lock 2026-11 default key digest v1";
/// Context string that turns a user secret into the BLAKE3 key.
const SECRET_KEY_CONTEXT: &str = "tower-redis-lock 2026-11 secret key digest v1";
/// Context string that turns the digest key into the record MAC key.
const RECORD_KEY_CONTEXT: &str = "tower-redis-lock 2026-12 idempotency record seal v1";

/// Number of digest bytes kept in a [`LockKey`].
pub(crate) const DIGEST_LEN: usize = 16;

/// One ingredient of a lock key.
///
/// Implement it for your own types, or pass a closure with the same signature.
/// A part that cannot be derived from the request (no identity, a missing
/// header) returns [`MissingPart`]; the layer then rejects or skips locking, as
/// configured with
/// [`RedisLockLayer::skip_missing_part`](crate::RedisLockLayer::skip_missing_part).
///
/// ```
/// use tower_redis_lock::key::{KeyPart, KeyWriter, MissingPart};
///
/// // Lock per tenant, taken from a header set by a trusted gateway.
/// let tenant = |parts: &http::request::Parts, key: &mut KeyWriter| {
///     match parts.headers.get("x-tenant") {
///         Some(v) => Ok(key.push("tenant", v.as_bytes())),
///         None => Err(MissingPart::bad_request("tenant", "the x-tenant header is required")),
///     }
/// };
/// fn assert_part(_: &impl KeyPart) {}
/// assert_part(&tenant);
/// ```
pub trait KeyPart: Send + Sync + 'static {
    /// Write this part's values into `key`.
    fn write(&self, parts: &Parts, key: &mut KeyWriter) -> Result<(), MissingPart>;
}

/// A key part that could not be derived from the request.
///
/// Carries the HTTP status the request is rejected with (when the layer is set
/// to reject) and a message for the problem+json `detail`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingPart {
    part: Cow<'static, str>,
    status: StatusCode,
    detail: Cow<'static, str>,
    malformed: bool,
}

impl MissingPart {
    /// A missing part answered with `status`.
    pub fn new(
        part: impl Into<Cow<'static, str>>,
        status: StatusCode,
        detail: impl Into<Cow<'static, str>>,
    ) -> Self {
        Self {
            part: part.into(),
            status,
            detail: detail.into(),
            malformed: false,
        }
    }

    /// A part the request carries but that cannot be keyed on (a header
    /// sent more than once, a value that does not parse), answered with 400
    /// Bad Request. Unlike a part that is absent, it is rejected even by a
    /// layer that [skips missing parts](crate::RedisLockLayer::skip_missing_part):
    /// a client that could add a second header line would otherwise choose
    /// to run unlocked.
    pub fn malformed(
        part: impl Into<Cow<'static, str>>,
        detail: impl Into<Cow<'static, str>>,
    ) -> Self {
        Self {
            malformed: true,
            ..Self::bad_request(part, detail)
        }
    }

    /// A missing part answered with 400 Bad Request.
    pub fn bad_request(
        part: impl Into<Cow<'static, str>>,
        detail: impl Into<Cow<'static, str>>,
    ) -> Self {
        Self::new(part, StatusCode::BAD_REQUEST, detail)
    }

    /// A missing identity, answered with 401 Unauthorized.
    pub fn unauthenticated(
        part: impl Into<Cow<'static, str>>,
        detail: impl Into<Cow<'static, str>>,
    ) -> Self {
        Self::new(part, StatusCode::UNAUTHORIZED, detail)
    }

    /// Name of the part that was missing.
    pub fn part(&self) -> &str {
        &self.part
    }

    /// Status the request is rejected with.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// Human-readable explanation.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// Whether the part is there but refused ([`malformed`](Self::malformed)),
    /// rather than absent: such a request is always rejected.
    pub fn is_malformed(&self) -> bool {
        self.malformed
    }
}

impl fmt::Display for MissingPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "lock key part `{}` missing: {}", self.part, self.detail)
    }
}

impl std::error::Error for MissingPart {}

/// Collects the labelled values of a key and hashes them.
///
/// Every value is written as `len(label) ‖ label ‖ len(value) ‖ value` (little
/// endian lengths), so `("ab", "c")` and `("a", "bc")` never collide and a
/// value can never pose as a label.
#[derive(Clone)]
pub struct KeyWriter {
    key: [u8; 32],
    /// The encoded parts so far, hashed in one go by `finish` (a key of a
    /// few short parts: one BLAKE3 call, no hasher state to carry around).
    buf: [u8; INLINE],
    len: usize,
    /// Once the parts outgrow `buf`: a hasher that takes them as they come
    /// (boxed: a BLAKE3 hasher holds a chunk buffer and a stack of chaining
    /// values, too large to move with the writer).
    spill: Option<Box<blake3::Hasher>>,
}

/// Bytes of encoded parts a [`KeyWriter`] keeps inline.
const INLINE: usize = 192;

impl fmt::Debug for KeyWriter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyWriter").finish_non_exhaustive()
    }
}

impl KeyWriter {
    pub(crate) fn new(key: &DigestKey) -> Self {
        Self {
            key: key.0,
            buf: [0; INLINE],
            len: 0,
            spill: None,
        }
    }

    /// Add one labelled value. Any bytes are fine: they are hashed, never stored.
    pub fn push(&mut self, label: &str, value: &[u8]) {
        let (l, v) = (label.len(), value.len());
        let end = self.len + 16 + l + v;
        if self.spill.is_none() {
            if let Some(room) = self.buf.get_mut(self.len..end) {
                // The usual case: the whole part fits inline, one bounds check.
                room[..8].copy_from_slice(&(l as u64).to_le_bytes());
                room[8..8 + l].copy_from_slice(label.as_bytes());
                room[8 + l..16 + l].copy_from_slice(&(v as u64).to_le_bytes());
                room[16 + l..].copy_from_slice(value);
                self.len = end;
                return;
            }
        }
        self.write(&(label.len() as u64).to_le_bytes());
        self.write(label.as_bytes());
        self.write(&(value.len() as u64).to_le_bytes());
        self.write(value);
    }

    fn write(&mut self, bytes: &[u8]) {
        if let Some(hasher) = &mut self.spill {
            hasher.update(bytes);
            return;
        }
        let end = self.len + bytes.len();
        if let Some(room) = self.buf.get_mut(self.len..end) {
            room.copy_from_slice(bytes);
            self.len = end;
            return;
        }
        // The same bytes in the same order: the same digest.
        let mut hasher = Box::new(blake3::Hasher::new_keyed(&self.key));
        hasher.update(&self.buf[..self.len]);
        hasher.update(bytes);
        self.spill = Some(hasher);
    }

    /// Finish into the key digest.
    pub fn finish(&self) -> LockKey {
        let hash = match &self.spill {
            Some(hasher) => hasher.finalize(),
            None => blake3::keyed_hash(&self.key, &self.buf[..self.len]),
        };
        let mut digest = [0u8; DIGEST_LEN];
        digest.copy_from_slice(&hash.as_bytes()[..DIGEST_LEN]);
        LockKey { digest }
    }
}

/// The 32-byte BLAKE3 key the digests are computed with.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct DigestKey([u8; 32]);

impl DigestKey {
    /// The public default: digests are stable but not secret.
    pub(crate) fn public() -> Self {
        Self(blake3::derive_key(DEFAULT_KEY_CONTEXT, b""))
    }

    /// Derived from a user secret: digests become a MAC.
    pub(crate) fn from_secret(secret: &[u8]) -> Self {
        Self(blake3::derive_key(SECRET_KEY_CONTEXT, secret))
    }
}

/// Set once the "no secret" warning was logged: one line per process, not
/// one per route.
#[cfg(not(feature = "__test-hooks"))]
static NO_SECRET_WARNING: std::sync::Once = std::sync::Once::new();

// The internal `__test-hooks` feature (enabled only by this crate's own
// dev-dependency on itself) makes it one line per *thread*: the integration
// tests share one process, and each test runs on a thread of its own, so the
// tests of the warning see a fresh flag without a public reset function.
#[cfg(feature = "__test-hooks")]
thread_local! {
    static NO_SECRET_WARNING: std::sync::Once = const { std::sync::Once::new() };
}

impl DigestKey {
    /// Log, once per process, that digests are unkeyed when no secret is
    /// set (`short`: the length of a secret refused as too short).
    pub(crate) fn warn_if_public(&self, short: Option<usize>) {
        if *self == Self::public() {
            #[cfg(feature = "__test-hooks")]
            NO_SECRET_WARNING.with(|once| Self::warn_public_once(once, short));
            #[cfg(not(feature = "__test-hooks"))]
            Self::warn_public_once(&NO_SECRET_WARNING, short);
        }
    }

    fn warn_public_once(once: &std::sync::Once, short: Option<usize>) {
        once.call_once(|| {
            let given = match short {
                Some(n) => format!(
                    " was given {n} bytes, fewer than the {} it needs, and ignored them",
                    MIN_SECRET_LEN
                ),
                None => String::new(),
            };
            tracing::warn!(
                "tower-redis-lock: no secret configured (KeySpace::secret{given}); lock keys \
                 are an unkeyed digest, so low-entropy key material (user ids, card numbers, \
                 amounts) can be recovered from the backend by guessing. Give every instance \
                 the same secret of at least 16 random bytes from your secret store."
            );
        });
    }
}

impl fmt::Debug for DigestKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DigestKey(..)")
    }
}

// ------------------------------------------------------------ key space

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

    /// A [`KeyWriter`] that digests under this key space (its secret, if
    /// any): the layers derive every key with one. A store's own tests use
    /// it to make the [`LockKey`]s of an
    /// [`EntryKey`](crate::backend::contract::EntryKey), as the layer would.
    ///
    /// ```
    /// use tower_redis_lock::key::KeySpace;
    /// let space = KeySpace::default();
    /// let mut w = space.writer();
    /// w.push("user", b"alice");
    /// assert_eq!(w.finish(), { let mut w = space.writer(); w.push("user", b"alice"); w.finish() });
    /// ```
    pub fn writer(&self) -> KeyWriter {
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

// ------------------------------------------------------------ lock key

/// A derived lock key: a fixed-length digest of the key parts.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LockKey {
    digest: [u8; DIGEST_LEN],
}

impl LockKey {
    /// The raw digest bytes.
    pub fn as_bytes(&self) -> &[u8; DIGEST_LEN] {
        &self.digest
    }

    /// The digest as 32 lowercase hex characters (what logs and Redis show).
    pub fn to_hex(&self) -> String {
        let mut out = [0u8; DIGEST_LEN * 2];
        hex_encode(&self.digest, &mut out);
        String::from_utf8_lossy(&out).into_owned()
    }

    /// The backend key: `prefix:{hex}`.
    ///
    /// The braces make the digest a Redis Cluster hash tag, so every key
    /// derived from one request (lock, fence, stored response) shares a slot.
    pub(crate) fn storage_key(&self, prefix: &str) -> Bytes {
        self.storage_key_with_suffix(prefix, "")
    }

    /// The backend key with a suffix: `prefix:{hex}suffix`.
    pub(crate) fn storage_key_with_suffix(&self, prefix: &str, suffix: &str) -> Bytes {
        let mut hex = [0u8; DIGEST_LEN * 2];
        hex_encode(&self.digest, &mut hex);
        let parts: [&[u8]; 5] = [prefix.as_bytes(), b":{", &hex, b"}", suffix.as_bytes()];
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if len <= INLINE_KEY {
            // One allocation, and clones that only count references (a
            // `Bytes` from a `Vec` allocates again at its first clone).
            let mut key = InlineKey {
                len,
                buf: [0; INLINE_KEY],
            };
            let mut at = 0;
            for part in parts {
                key.buf[at..at + part.len()].copy_from_slice(part);
                at += part.len();
            }
            return Bytes::from_owner(key);
        }
        parts.concat().into()
    }
}

/// Longest backend key kept in one allocation with its reference count.
const INLINE_KEY: usize = 96;

/// A backend key's bytes, owned by the `Bytes` that shares them.
struct InlineKey {
    len: usize,
    buf: [u8; INLINE_KEY],
}

impl AsRef<[u8]> for InlineKey {
    fn as_ref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl fmt::Display for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = [0u8; DIGEST_LEN * 2];
        hex_encode(&self.digest, &mut out);
        // hex_encode only writes ASCII hex digits.
        f.write_str(std::str::from_utf8(&out).map_err(|_| fmt::Error)?)
    }
}

impl fmt::Debug for LockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LockKey({self})")
    }
}

pub(crate) fn hex_encode(input: &[u8], out: &mut [u8]) {
    /// Both hex digits of every byte: one lookup per byte.
    const PAIRS: [[u8; 2]; 256] = {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut pairs = [[0u8; 2]; 256];
        let mut i = 0;
        while i < 256 {
            pairs[i] = [HEX[i >> 4], HEX[i & 0x0f]];
            i += 1;
        }
        pairs
    };
    for (pair, b) in out.chunks_exact_mut(2).zip(input) {
        pair.copy_from_slice(&PAIRS[*b as usize]);
    }
}

/// Digest of a request body, as fed into the key (label `body`).
pub(crate) fn body_part(key: &mut KeyWriter, body_hash: &blake3::Hash) {
    key.push("body", body_hash.as_bytes());
}

#[cfg(test)]
mod tests;
