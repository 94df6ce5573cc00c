//! [`SessionCheck`]: whether a store's pooled connections are one server
//! session each, asked once.

use tower_redis_lock::backend::BackendError;

use crate::adapter::Adapter;

/// What [`Adapter::one_session_each`] found, kept once it answered (`Err`
/// names a pooler); a failure to ask is not kept.
#[derive(Debug, Default)]
pub(crate) struct SessionCheck(tokio::sync::OnceCell<Result<(), String>>);

impl SessionCheck {
    /// Refuse a pool whose connections are not one server session each.
    pub(crate) async fn check<A: Adapter>(&self, adapter: &A) -> Result<(), BackendError> {
        let found = self
            .0
            .get_or_try_init(|| async {
                Ok::<_, BackendError>(match adapter.one_session_each().await? {
                    true => Ok(()),
                    false => Err(format!(
                        "{}: the pool's connections share server sessions (a transaction-mode \
                         pooler such as pgbouncer pool_mode=transaction?): the key's hold is a \
                         session lock and cannot work there; connect the store directly or \
                         through a session-mode pool",
                        A::NAME
                    )),
                })
            })
            .await?;
        found.clone().map_err(|message| {
            tracing::error!(store = A::NAME, "{message}");
            BackendError::new(message)
        })
    }
}
