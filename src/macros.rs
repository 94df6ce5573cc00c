//! Boilerplate the idempotency layer still uses until its own branch writes
//! it out (the lock layer uses none of it): its setters
//! (`common_setters!`, over [`HasSettings`]), `Deref` to its settings, its
//! service's accessors and its extractor. Delete this file once nothing
//! uses it.

/// `Deref`/`DerefMut` from a layer's configuration to its
/// [`Settings`](super::settings::Settings) (the field `settings`), so the
/// layer reads `config.ttl` whichever layer it is.
macro_rules! deref_to_settings {
    ($ty:ty) => {
        impl std::ops::Deref for $ty {
            type Target = $crate::settings::Settings;

            fn deref(&self) -> &Self::Target {
                &self.settings
            }
        }

        impl std::ops::DerefMut for $ty {
            fn deref_mut(&mut self) -> &mut Self::Target {
                &mut self.settings
            }
        }
    };
}

/// `get_ref`, `get_mut` and `into_inner` of a middleware service whose
/// wrapped service is the field `inner` (tower-http's accessors).
macro_rules! inner_accessors {
    () => {
        /// The wrapped service.
        pub fn get_ref(&self) -> &S {
            &self.inner
        }

        /// The wrapped service, mutably.
        pub fn get_mut(&mut self) -> &mut S {
            &mut self.inner
        }

        /// Unwrap the inner service.
        pub fn into_inner(self) -> S {
            self.inner
        }
    };
}

/// The axum extractors (`T` and `Option<T>`) of a value a layer put into the
/// request extensions: without the layer in front, `T` is rejected with a
/// 500 naming the layer; `Option<T>` is `None`.
#[cfg(feature = "axum")]
macro_rules! extension_extractor {
    ($ty:ty, $missing:expr) => {
        impl<S: Send + Sync> axum::extract::FromRequestParts<S> for $ty {
            type Rejection = $crate::Rejection;

            async fn from_request_parts(
                parts: &mut http::request::Parts,
                _state: &S,
            ) -> Result<Self, Self::Rejection> {
                parts.extensions.get::<$ty>().cloned().ok_or($missing)
            }
        }

        impl<S: Send + Sync> axum::extract::OptionalFromRequestParts<S> for $ty {
            type Rejection = std::convert::Infallible;

            async fn from_request_parts(
                parts: &mut http::request::Parts,
                _state: &S,
            ) -> Result<Option<Self>, Self::Rejection> {
                Ok(parts.extensions.get::<$ty>().cloned())
            }
        }
    };
}

/// Access to a layer's [`Settings`], for the setters of `common_setters!`.
pub(crate) trait HasSettings {
    /// The settings, to change (copied first if shared).
    fn settings_mut(&mut self) -> &mut crate::settings::Settings;
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
                let s = $crate::macros::HasSettings::settings_mut(&mut self);
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
                let s = $crate::macros::HasSettings::settings_mut(&mut self);
                s.deadline = $crate::settings::at_least_1ms(deadline);
                self
            }

            /// Where the keys live and how they are hashed (prefix and
            /// secret); give every layer of a fleet the same
            /// [`KeySpace`](crate::key::KeySpace).
            ///
            #[doc = concat!("```\n", $use, "\nlet space = tower_redis_lock::key::KeySpace::new(\"shop\").secret(b\"from your secret store\");\nlet layer = ", $new, ".key_space(space);\n# let _ = layer;\n```")]
            pub fn key_space(mut self, space: $crate::key::KeySpace) -> Self {
                $crate::macros::HasSettings::settings_mut(&mut self).key_space = space;
                self
            }

            /// Largest request body received before the lease or claim is
            /// taken (default 64 KiB): 413 problem+json beyond it, at once
            /// for a declared `Content-Length` over it. Not for a lock layer
            /// that streams its body (`stream_body`).
            ///
            #[doc = concat!("```\n", $use, "\nlet layer = ", $new, ".body_limit(16 * 1024);\n# let _ = layer;\n```")]
            pub fn body_limit(mut self, limit: usize) -> Self {
                $crate::macros::HasSettings::settings_mut(&mut self).body_limit = limit;
                self
            }

            /// Time for the whole request body to arrive (default 10 s): a
            /// stalled upload gets 408, and never holds a lease or claim,
            /// which is only taken once the body is in. Not for a lock layer
            /// that streams its body (`stream_body`).
            ///
            #[doc = concat!("```\n", $use, "\nlet layer = ", $new, ".body_timeout(std::time::Duration::from_secs(5));\n# let _ = layer;\n```")]
            pub fn body_timeout(mut self, timeout: std::time::Duration) -> Self {
                $crate::macros::HasSettings::settings_mut(&mut self).body_timeout = timeout;
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
                $crate::macros::HasSettings::settings_mut(&mut self).responder =
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
                $crate::macros::HasSettings::settings_mut(&mut self).responder =
                    Some($crate::rejection::responder(f));
                self
            }
        }
    };
}
