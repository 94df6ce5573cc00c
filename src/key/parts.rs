//! The built-in key parts, and how parts compose (tuples, closures, `Arc`,
//! `()`): every `KeyPart::write` body a request's key runs, so a key is
//! derived in this file, writing into the `KeyWriter` of `mod.rs`.

use std::fmt::{self, Write as _};
use std::marker::PhantomData;
use std::sync::Arc;

use http::header::HeaderName;
use http::request::Parts;

use super::{KeyPart, KeyWriter, MissingPart};

/// The request method (`GET`, `POST`, ...).
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestMethod;

impl KeyPart for RequestMethod {
    fn write(&self, parts: &Parts, key: &mut KeyWriter) -> Result<(), MissingPart> {
        key.push("method", parts.method.as_str().as_bytes());
        Ok(())
    }
}

/// The route template, e.g. `/orders/{id}`, so that all requests to one route
/// share a key space whatever the path parameters.
///
/// Read from axum's `MatchedPath` request extension. axum only inserts it for
/// layers added with `Router::layer`, `Router::route_layer` or
/// `MethodRouter::layer`; outside a router (plain hyper, or a layer wrapped
/// around the whole `Router` from the outside) there is no template and the
/// concrete URI path is used instead, exactly like [`UriPath`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Route;

impl KeyPart for Route {
    fn write(&self, parts: &Parts, key: &mut KeyWriter) -> Result<(), MissingPart> {
        #[cfg(feature = "axum")]
        if let Some(matched) = parts.extensions.get::<axum::extract::MatchedPath>() {
            key.push("route", matched.as_str().as_bytes());
            return Ok(());
        }
        push_path(key, "route", parts.uri.path());
        Ok(())
    }
}

/// The concrete URI path, e.g. `/orders/42` (without the query),
/// percent-decoded as a handler reads it: `/orders/%34%32` is `/orders/42`,
/// one key (axum's `Path` extracts `42` from both).
#[derive(Debug, Clone, Copy, Default)]
pub struct UriPath;

impl KeyPart for UriPath {
    fn write(&self, parts: &Parts, key: &mut KeyWriter) -> Result<(), MissingPart> {
        push_path(key, "path", parts.uri.path());
        Ok(())
    }
}

/// A path, percent-decoded: spelling a path another way (`%34%32` for `42`,
/// `%3a` for `%3A`) must not make another key for the same resource. A
/// decoded `%2F` meets a real `/`, so two routes' paths may share a key: a
/// 409 too many, never a second run.
pub(crate) fn push_path(key: &mut KeyWriter, label: &'static str, path: &str) {
    let decoded: std::borrow::Cow<'_, [u8]> = percent_encoding::percent_decode_str(path).into();
    key.push(label, &decoded);
}

/// The `Cookie` fields of `headers` as one value, joined with `"; "` as
/// HTTP/1.1 sends them: HTTP/2 sends each cookie as a field of its own
/// (RFC 9113, 8.2.3), and the two must key (and fingerprint) alike.
pub(crate) fn joined_cookies(headers: &http::HeaderMap) -> Vec<u8> {
    let mut joined = Vec::new();
    for value in headers.get_all(http::header::COOKIE) {
        if !joined.is_empty() {
            joined.extend_from_slice(b"; ");
        }
        joined.extend_from_slice(value.as_bytes());
    }
    joined
}

/// The value of one request header.
///
/// A missing header is a [`MissingPart`] (400) unless built with
/// [`Header::optional`]. A header sent more than once is refused with 400
/// ([`MissingPart::malformed`], rejected even where missing parts are
/// skipped): a handler reads one value, and a client that added a second
/// line would otherwise make another key for the same request. `Cookie`
/// is the exception: HTTP/2 sends each cookie as a field of its own, and
/// they are keyed joined with `"; "`, as one HTTP/1.1 line. `Host` is
/// read from the URI's authority when there is no `Host` header (HTTP/2's
/// `:authority`), so a request keys alike over both protocols. For
/// identities use [`Identity`] or, behind a gateway you trust,
/// [`Header::trusted_identity`].
#[derive(Debug, Clone)]
pub struct Header {
    name: HeaderName,
    kind: HeaderKind,
}

/// What a [`Header`] part does with what it finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HeaderKind {
    /// One value; absence is a missing part (400).
    Required,
    /// One value; absence is part of the key.
    Optional,
    /// Exactly one non-empty value, the caller's identity (401 without it,
    /// 400 when repeated).
    TrustedIdentity,
}

impl Header {
    /// Key on `name` (any case: `"X-Order-Ref"` is `x-order-ref`); its
    /// absence is a missing part.
    ///
    /// ```
    /// let part = tower_redis_lock::key::Header::new("X-Order-Ref");
    /// # let _ = part;
    /// ```
    ///
    /// # Panics
    /// If `name` is not a valid header name at all (a space, a colon): a
    /// programming error, caught at start-up, with the name in the message.
    pub fn new<N>(name: N) -> Self
    where
        N: TryInto<HeaderName> + fmt::Debug,
        N::Error: fmt::Debug,
    {
        Self {
            name: header_name(name, "for a key part"),
            kind: HeaderKind::Required,
        }
    }

    /// Key on `name` when present; its absence is part of the key too.
    ///
    /// ```
    /// let part = tower_redis_lock::key::Header::optional(http::header::IF_MATCH);
    /// # let _ = part;
    /// ```
    pub fn optional<N>(name: N) -> Self
    where
        N: TryInto<HeaderName> + fmt::Debug,
        N::Error: fmt::Debug,
    {
        Self {
            name: header_name(name, "for a key part"),
            kind: HeaderKind::Optional,
        }
    }

    /// The caller's identity taken from a request header **that you trust**.
    ///
    /// Only use this when something in front of the service (an API gateway, a
    /// proxy that authenticates and overwrites the header) guarantees the value:
    /// a client that can set the header can otherwise lock other users out by
    /// sending their id. Prefer [`Identity`] with your auth layer's extension.
    ///
    /// A missing or empty header is a [`MissingPart`] answered with 401. A header
    /// that appears more than once is answered with 400: a gateway that appends
    /// its value instead of overwriting the client's would otherwise let the
    /// client's own value through. (One header line is taken as it is, commas
    /// included: a gateway must not append to it with a comma either.)
    ///
    /// ```
    /// let part = tower_redis_lock::key::Header::trusted_identity("X-User-Id");
    /// # let _ = part;
    /// ```
    ///
    /// # Panics
    /// If `name` is not a valid header name at all (a space, a colon): a
    /// programming error, caught at start-up, with the name in the message.
    pub fn trusted_identity<N>(name: N) -> Self
    where
        N: TryInto<HeaderName> + fmt::Debug,
        N::Error: fmt::Debug,
    {
        Self {
            name: header_name(name, "for a key part"),
            kind: HeaderKind::TrustedIdentity,
        }
    }
}

impl KeyPart for Header {
    fn write(&self, parts: &Parts, key: &mut KeyWriter) -> Result<(), MissingPart> {
        if self.kind == HeaderKind::TrustedIdentity {
            return self.write_identity(parts, key);
        }
        key.push("header", self.name.as_str().as_bytes());
        let mut values = parts.headers.get_all(&self.name).iter();
        let first = values.next();
        let more = values.count();
        if more > 0 && self.name == http::header::COOKIE {
            key.push("value", &joined_cookies(&parts.headers));
            return Ok(());
        }
        if more > 0 {
            // A handler reads one value (`HeaderMap::get`: the first); keyed
            // on all of them, a second line of anything would make another
            // key for the same request.
            return Err(MissingPart::malformed(
                "header",
                format!(
                    "the `{}` header appeared {} times; send it once",
                    self.name,
                    more + 1
                ),
            ));
        }
        match first {
            Some(value) => {
                key.push("value", value.as_bytes());
                Ok(())
            }
            // HTTP/2 carries the host in `:authority`, which hyper puts in
            // the URI, with no `Host` header: the same request keys alike
            // over both protocols.
            None if self.name == http::header::HOST && parts.uri.authority().is_some() => {
                let authority = parts.uri.authority().map_or("", |a| a.as_str());
                key.push("value", authority.as_bytes());
                Ok(())
            }
            None if self.kind == HeaderKind::Optional => Ok(()),
            None => Err(MissingPart::bad_request(
                "header",
                format!("the `{}` header is required on this route", self.name),
            )),
        }
    }
}

/// The caller's identity from a typed request extension that your
/// authentication layer inserted (`req.extensions_mut().insert(UserId(..))`).
///
/// This is the safe way to key by user: a client cannot forge an extension.
/// The value is formatted with `Display`. A request without the extension, or
/// whose value displays as the empty string, is a [`MissingPart`] answered
/// with 401 (or passed through unlocked, see
/// [`RedisLockLayer::skip_missing_part`](crate::RedisLockLayer::skip_missing_part)).
///
/// ```
/// #[derive(Clone)]
/// struct UserId(u64);
/// impl std::fmt::Display for UserId {
///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result { self.0.fmt(f) }
/// }
/// let part = tower_redis_lock::key::Identity::<UserId>::new();
/// # let _ = part;
/// ```
pub struct Identity<T> {
    _marker: PhantomData<fn() -> T>,
}

impl<T> Identity<T> {
    /// Key on the `T` extension.
    pub fn new() -> Self {
        Self {
            _marker: PhantomData,
        }
    }
}

impl<T> Default for Identity<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Clone for Identity<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Identity<T> {}

impl<T> fmt::Debug for Identity<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Identity<{}>", std::any::type_name::<T>())
    }
}

impl<T> KeyPart for Identity<T>
where
    T: fmt::Display + Send + Sync + 'static,
{
    fn write(&self, parts: &Parts, key: &mut KeyWriter) -> Result<(), MissingPart> {
        match parts.extensions.get::<T>() {
            Some(id) => {
                let mut buf = String::new();
                // Writing into a String cannot fail unless Display itself
                // reports an error; treat that as a missing identity.
                if write!(buf, "{id}").is_err() {
                    return Err(missing_identity());
                }
                // An empty identity would put every such request in one
                // scope: it is no identity.
                if buf.is_empty() {
                    return Err(MissingPart::unauthenticated(
                        "identity",
                        "this route is locked per user, and the request's authenticated \
                         identity is empty",
                    ));
                }
                key.push("identity", buf.as_bytes());
                Ok(())
            }
            None => Err(missing_identity()),
        }
    }
}

fn missing_identity() -> MissingPart {
    MissingPart::unauthenticated(
        "identity",
        "this route is locked per user, and the request carries no authenticated identity",
    )
}

impl Header {
    /// [`Header::trusted_identity`]'s part: exactly one non-empty value.
    fn write_identity(&self, parts: &Parts, key: &mut KeyWriter) -> Result<(), MissingPart> {
        let mut values = parts.headers.get_all(&self.name).iter();
        let first = values.next();
        let more = values.count();
        if more > 0 {
            // A gateway that appends rather than overwrites leaves the
            // client's own value beside its own: trust neither.
            return Err(MissingPart::malformed(
                "identity",
                format!(
                    "the `{}` identity header appeared {} times; the gateway in front of this \
                     service must overwrite it with exactly one value, not append to it",
                    self.name,
                    more + 1
                ),
            ));
        }
        match first {
            Some(value) if !value.is_empty() => {
                key.push("identity", value.as_bytes());
                Ok(())
            }
            _ => Err(MissingPart::unauthenticated(
                "identity",
                format!(
                    "this route is locked per user, and the `{}` header is missing or empty",
                    self.name
                ),
            )),
        }
    }
}

/// A header name from anything `http` accepts, lower-cased; an invalid one
/// is a configuration error named in the panic message, with what it was
/// for (`purpose`: "for a key part", "to fingerprint").
pub(crate) fn header_name<N>(name: N, purpose: &str) -> HeaderName
where
    N: TryInto<HeaderName> + fmt::Debug,
    N::Error: fmt::Debug,
{
    let shown = format!("{name:?}");
    match name.try_into() {
        Ok(name) => name,
        Err(e) => panic!("tower-redis-lock: {shown} is not a valid header name {purpose} ({e:?})"),
    }
}

impl<F> KeyPart for F
where
    F: Fn(&Parts, &mut KeyWriter) -> Result<(), MissingPart> + Send + Sync + 'static,
{
    fn write(&self, parts: &Parts, key: &mut KeyWriter) -> Result<(), MissingPart> {
        self(parts, key)
    }
}

impl KeyPart for () {
    fn write(&self, _: &Parts, _: &mut KeyWriter) -> Result<(), MissingPart> {
        Ok(())
    }
}

impl<T: KeyPart + ?Sized> KeyPart for Arc<T> {
    fn write(&self, parts: &Parts, key: &mut KeyWriter) -> Result<(), MissingPart> {
        (**self).write(parts, key)
    }
}

macro_rules! tuple_key_part {
    ($($name:ident),+) => {
        impl<$($name: KeyPart),+> KeyPart for ($($name,)+) {
            #[allow(non_snake_case)]
            fn write(&self, parts: &Parts, key: &mut KeyWriter) -> Result<(), MissingPart> {
                let ($($name,)+) = self;
                $($name.write(parts, key)?;)+
                Ok(())
            }
        }
    };
}

tuple_key_part!(A);
tuple_key_part!(A, B);
tuple_key_part!(A, B, C);
tuple_key_part!(A, B, C, D);
tuple_key_part!(A, B, C, D, E);
tuple_key_part!(A, B, C, D, E, F);
tuple_key_part!(A, B, C, D, E, F, G);
tuple_key_part!(A, B, C, D, E, F, G, H);

#[cfg(test)]
mod tests;
