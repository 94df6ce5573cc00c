//! The `Idempotency-Key` request header: parsing and validation.

use std::fmt;
use std::sync::Arc;

use http::header::HeaderName;
use http::HeaderMap;

/// Name of the request header carrying the key.
pub(crate) const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// Longest accepted key, in bytes of the (unquoted) value.
pub(crate) const MAX_KEY_LEN: usize = 255;

/// A validated `Idempotency-Key`.
///
/// Accepted forms (after trimming surrounding whitespace):
///
/// - the draft's form, an RFC 8941 sf-string: `"8e03978e-40d5-43e8-bc93-6894a57f9324"`
///   (printable ASCII; `\"` and `\\` escapes);
/// - a bare token, as many clients send it: `8e03978e-40d5-43e8-bc93-6894a57f9324`
///   (letters, digits and ``!#$%&'*+-.^_`|~:/=``, so UUIDs, ULIDs and base64 fit).
///
/// Both forms of the same value are the same key. The value must be 1 to
/// 255 bytes long; parameters (`"k";a=1`) and repeated headers are
/// refused. With the `axum` feature it is also an extractor for handlers
/// behind an [`IdempotencyLayer`](crate::idempotency::IdempotencyLayer).
///
/// [`downstream`](Self::downstream) is the key to pass on to a payment
/// provider (or any service with idempotency keys of its own).
#[derive(Clone)]
pub struct IdempotencyKey(String, Option<Arc<str>>);

impl PartialEq for IdempotencyKey {
    fn eq(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}

impl Eq for IdempotencyKey {}

impl std::hash::Hash for IdempotencyKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.hash(state)
    }
}

impl IdempotencyKey {
    /// Parse one header value.
    pub(crate) fn parse(value: &[u8]) -> Result<Self, InvalidKey> {
        let value = value.trim_ascii();
        if value.is_empty() {
            return Err(InvalidKey::Empty);
        }
        let key = if value[0] == b'"' {
            parse_sf_string(value)?
        } else {
            for &b in value {
                if !is_bare(b) {
                    return Err(InvalidKey::Character(b));
                }
            }
            // Only ASCII passed the check above.
            String::from_utf8_lossy(value).into_owned()
        };
        if key.is_empty() {
            return Err(InvalidKey::Empty);
        }
        if key.len() > MAX_KEY_LEN {
            return Err(InvalidKey::TooLong(key.len()));
        }
        Ok(Self(key, None))
    }

    /// The key from request headers: `Ok(None)` when absent, an error when
    /// invalid or repeated.
    pub(crate) fn from_headers(headers: &HeaderMap) -> Result<Option<Self>, InvalidKey> {
        let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
        let Some(first) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(InvalidKey::Repeated);
        }
        Self::parse(first.as_bytes()).map(Some)
    }

    /// The key's value (unquoted).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The **downstream key**: what to send a payment provider (or any
    /// service outside the database) as *its* idempotency key for this
    /// request. Stable across every retry of the request (the same
    /// `Idempotency-Key`, identity and route give the same value, on every
    /// instance sharing the key space), and derived from the scoped key, so
    /// two users who both send `Idempotency-Key: 1` get different ones: 36
    /// characters, `trl-` and 32 hex digits of a keyed digest (with the key
    /// space's secret, nothing of the client's key or identity can be read
    /// from it).
    ///
    /// The database transaction cannot undo a call to a provider: a crash
    /// between the call and the commit rolls the claim back and the retry
    /// calls the provider again. With this key the provider sees the same
    /// idempotency key twice and charges once. Not the client's raw key
    /// (two clients' keys collide at the provider), not a fresh key per
    /// attempt (the provider charges each).
    ///
    /// Set by the [`IdempotencyLayer`](crate::idempotency::IdempotencyLayer) once
    /// the request won its claim; empty on a key that no layer admitted.
    pub fn downstream(&self) -> &str {
        self.1.as_deref().unwrap_or("")
    }

    /// The key with its downstream key.
    pub(crate) fn with_downstream(mut self, downstream: String) -> Self {
        self.1 = Some(downstream.into());
        self
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey({:?})", self.0)
    }
}

/// Why an `Idempotency-Key` header was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub(crate) enum InvalidKey {
    /// Empty value (or `""`).
    Empty,
    /// Longer than [`MAX_KEY_LEN`] bytes (the length seen).
    TooLong(usize),
    /// A byte not allowed in this form.
    Character(u8),
    /// A quoted string without its closing quote, a dangling escape, or
    /// anything after the closing quote.
    Malformed,
    /// The header appeared more than once.
    Repeated,
}

impl fmt::Display for InvalidKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty => f.write_str("the Idempotency-Key header is empty"),
            Self::TooLong(n) => write!(
                f,
                "the Idempotency-Key is {n} bytes long; at most {MAX_KEY_LEN} are allowed"
            ),
            Self::Character(b) => write!(
                f,
                "the Idempotency-Key contains the byte 0x{b:02x}, which is not allowed \
                 (send a quoted string of printable ASCII, or a bare token such as a UUID)"
            ),
            Self::Malformed => f.write_str(
                "the Idempotency-Key is not a well-formed quoted string (RFC 8941 sf-string)",
            ),
            Self::Repeated => f.write_str("the Idempotency-Key header must appear only once"),
        }
    }
}

impl std::error::Error for InvalidKey {}

/// tchar (RFC 9110) plus `:`, `/` (sf-token) and `=` (base64 padding).
fn is_bare(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~:/=".contains(&b)
}

/// RFC 8941 §4.2.5, with nothing allowed after the closing quote.
fn parse_sf_string(value: &[u8]) -> Result<String, InvalidKey> {
    let mut out = String::with_capacity(value.len());
    let mut iter = value[1..].iter().copied();
    loop {
        match iter.next() {
            None => return Err(InvalidKey::Malformed),
            Some(b'\\') => match iter.next() {
                Some(c @ (b'"' | b'\\')) => out.push(c as char),
                _ => return Err(InvalidKey::Malformed),
            },
            Some(b'"') => {
                return match iter.next() {
                    None => Ok(out),
                    Some(_) => Err(InvalidKey::Malformed),
                }
            }
            Some(c @ 0x20..=0x7e) => out.push(c as char),
            Some(c) => return Err(InvalidKey::Character(c)),
        }
    }
}

#[cfg(test)]
mod tests;
