//! [`RunToEnd`]: work that must finish whatever becomes of the future that
//! started it (a release, an abandoned claim, an idempotent request whose
//! client left). It runs in its caller's future while that is polled (no
//! spawn, no wake-up of another task on the way), and on a task of its own,
//! on the runtime it was made on, once that future is dropped unfinished.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// A future run to its end: see the module docs. Its output is `None` only
/// when it is polled again after it ended.
pub(crate) struct RunToEnd<T: Send + 'static> {
    run: Option<Pin<Box<dyn Future<Output = T> + Send + 'static>>>,
    /// The runtime it was made on; without one (made outside Tokio), a
    /// dropped run ends with its caller.
    runtime: Option<tokio::runtime::Handle>,
}

impl<T: Send + 'static> RunToEnd<T> {
    pub(crate) fn new(run: impl Future<Output = T> + Send + 'static) -> Self {
        Self {
            run: Some(Box::pin(run)),
            runtime: tokio::runtime::Handle::try_current().ok(),
        }
    }
}

impl<T: Send + 'static> Future for RunToEnd<T> {
    type Output = Option<T>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let Some(run) = self.run.as_mut() else {
            return Poll::Ready(None);
        };
        let out = std::task::ready!(run.as_mut().poll(cx));
        self.run = None;
        Poll::Ready(Some(out))
    }
}

impl<T: Send + 'static> Drop for RunToEnd<T> {
    fn drop(&mut self) {
        if let (Some(run), Some(runtime)) = (self.run.take(), self.runtime.take()) {
            // The caller stopped waiting: the work goes on. A runtime
            // shutting down drops it with its other tasks.
            drop(runtime.spawn(async move {
                let _ = run.await;
            }));
        }
    }
}

#[cfg(test)]
mod tests;
