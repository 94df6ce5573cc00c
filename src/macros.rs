//! Small pieces of boilerplate both layers need, written once.

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
