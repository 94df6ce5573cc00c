//! The settings both layers have, and their setters, written once: each
//! layer holds a [`Settings`] and gets the same setters, with the same
//! documentation, from `common_setters!`.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Response;

use crate::key::{KeyPart, KeySpace};
use crate::rejection::{Rejection, Responder};

/// Default deadline of every backend call: 200 ms.
pub(crate) const DEFAULT_DEADLINE: Duration = Duration::from_millis(200);
/// Default largest request body received before a lease or claim: 64 KiB.
pub(crate) const DEFAULT_BODY_LIMIT: usize = 64 * 1024;
/// Default time for the whole request body to arrive: 10 s.
pub(crate) const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// The shortest TTL or deadline a setter accepts.
const MIN_DURATION: Duration = Duration::from_millis(1);

/// What both layers are configured with, in the same words.
#[derive(Clone)]
pub(crate) struct Settings {
    /// The parts of the request that make the key (and the scope).
    pub(crate) key: Arc<dyn KeyPart>,
    /// Where keys live and how they are hashed.
    pub(crate) key_space: KeySpace,
    /// How long a lease or claim lives without its release or record.
    pub(crate) ttl: Duration,
    /// Deadline of every backend call.
    pub(crate) deadline: Duration,
    /// Largest request body received before a lease or claim.
    pub(crate) body_limit: usize,
    /// Time for the whole request body to arrive.
    pub(crate) body_timeout: Duration,
    /// The user's answers instead of problem+json.
    pub(crate) responder: Option<Responder>,
}

impl Settings {
    /// The defaults, with `key` and the layer's own default `ttl`.
    pub(crate) fn new(key: Arc<dyn KeyPart>, ttl: Duration) -> Self {
        Self {
            key,
            key_space: KeySpace::default(),
            ttl,
            deadline: DEFAULT_DEADLINE,
            body_limit: DEFAULT_BODY_LIMIT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            responder: None,
        }
    }

    /// The response for a rejection: the user's responder or problem+json.
    pub(crate) fn reject(&self, rejection: &Rejection) -> Response<Bytes> {
        crate::rejection::respond(self.responder.as_ref(), rejection)
    }
}

/// A TTL or deadline as given, raised to 1 ms.
pub(crate) fn at_least_1ms(d: Duration) -> Duration {
    d.max(MIN_DURATION)
}

/// Access to a layer's [`Settings`], for the setters of `common_setters!`.
pub(crate) trait HasSettings {
    /// The settings, to change (copied first if shared).
    fn settings_mut(&mut self) -> &mut Settings;
}

/// The setters both layers have, documented once. `$layer` is the layer
/// type (with `impl` generics in brackets), `$new` an expression that
/// builds one in a doctest, `$use` its imports.
macro_rules! common_setters {
    ([$($gen:tt)*] $layer:ty, new = $new:literal, imports = $use:literal) => {
        impl<$($gen)*> $layer {
            /// How long a lease (lock layer; default 10 s) or a claim of a
            /// running first request (idempotency layer; default 30 s) lives
            /// without its release or record: the safety net if a process
            /// dies or a network splits. Choose it longer than the slowest
            /// handler, or renew. Values under 1 ms are raised to 1 ms.
            ///
            #[doc = concat!("```\n", $use, "\nlet layer = ", $new, ".ttl(std::time::Duration::from_secs(30));\n# let _ = layer;\n```")]
            pub fn ttl(mut self, ttl: std::time::Duration) -> Self {
                let s = $crate::settings::HasSettings::settings_mut(&mut self);
                s.ttl = $crate::settings::at_least_1ms(ttl);
                self
            }

            /// Deadline for every backend call (default 200 ms). A call that
            /// misses it is answered by the fail policy (503 by default; the
            /// idempotency layer always fails closed), and whatever it may
            /// still do on the server is undone. Values under 1 ms are raised
            /// to 1 ms.
            ///
            #[doc = concat!("```\n", $use, "\nlet layer = ", $new, ".deadline(std::time::Duration::from_millis(100));\n# let _ = layer;\n```")]
            pub fn deadline(mut self, deadline: std::time::Duration) -> Self {
                let s = $crate::settings::HasSettings::settings_mut(&mut self);
                s.deadline = $crate::settings::at_least_1ms(deadline);
                self
            }

            /// Where the keys live and how they are hashed (prefix and
            /// secret); give every layer of a fleet the same
            /// [`KeySpace`](crate::key::KeySpace).
            ///
            #[doc = concat!("```\n", $use, "\nlet space = tower_redis_lock::key::KeySpace::new(\"shop\").secret(b\"from your secret store\");\nlet layer = ", $new, ".key_space(space);\n# let _ = layer;\n```")]
            pub fn key_space(mut self, space: $crate::key::KeySpace) -> Self {
                $crate::settings::HasSettings::settings_mut(&mut self).key_space = space;
                self
            }

            /// Largest request body received before the lease or claim is
            /// taken (default 64 KiB): 413 problem+json beyond it, at once
            /// for a declared `Content-Length` over it. Not for a lock layer
            /// that streams its body (`stream_body`).
            ///
            #[doc = concat!("```\n", $use, "\nlet layer = ", $new, ".body_limit(16 * 1024);\n# let _ = layer;\n```")]
            pub fn body_limit(mut self, limit: usize) -> Self {
                $crate::settings::HasSettings::settings_mut(&mut self).body_limit = limit;
                self
            }

            /// Time for the whole request body to arrive (default 10 s): a
            /// stalled upload gets 408, and never holds a lease or claim,
            /// which is only taken once the body is in. Not for a lock layer
            /// that streams its body (`stream_body`).
            ///
            #[doc = concat!("```\n", $use, "\nlet layer = ", $new, ".body_timeout(std::time::Duration::from_secs(5));\n# let _ = layer;\n```")]
            pub fn body_timeout(mut self, timeout: std::time::Duration) -> Self {
                $crate::settings::HasSettings::settings_mut(&mut self).body_timeout = timeout;
                self
            }

            /// Replace the layer's rejection answers (problem+json) with your
            /// own. The closure gets the [`Rejection`](crate::Rejection) and
            /// returns anything `axum::response::IntoResponse` (without the
            /// `axum` feature: an `http::Response` whose body is
            /// `Body<Data = Bytes>`, such as `Full<Bytes>`; the same closures
            /// work with the feature on). The body must be in memory (a
            /// string, JSON, bytes): a streaming body is replaced by the
            /// default answer, with an error in the log.
            ///
            #[doc = concat!("```\n", $use, "\nlet layer = ", $new, ".on_rejection(|r| (r.status(), r.title()));\n# let _ = layer;\n```")]
            #[cfg(feature = "axum")]
            pub fn on_rejection<F, R>(mut self, f: F) -> Self
            where
                F: Fn(&$crate::Rejection) -> R + Send + Sync + 'static,
                R: axum::response::IntoResponse,
            {
                $crate::settings::HasSettings::settings_mut(&mut self).responder =
                    Some($crate::rejection::responder(f));
                self
            }

            /// Replace the layer's rejection answers (problem+json) with your
            /// own `http::Response` (its body in memory, such as
            /// `Full<Bytes>`; with the `axum` feature anything
            /// `IntoResponse`).
            #[cfg(not(feature = "axum"))]
            pub fn on_rejection<F, B>(mut self, f: F) -> Self
            where
                F: Fn(&$crate::Rejection) -> http::Response<B> + Send + Sync + 'static,
                B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
            {
                $crate::settings::HasSettings::settings_mut(&mut self).responder =
                    Some($crate::rejection::responder(f));
                self
            }
        }
    };
}
