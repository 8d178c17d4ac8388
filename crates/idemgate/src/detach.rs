//! A future that keeps running when its caller goes away.
//!
//! An execution must run to its end even if the client disconnects (its outcome is recorded
//! and replayed to the retry). Spawning every execution as a task of its own costs a task, a
//! channel and two task switches per miss; instead the request's task polls the execution
//! itself, and only if that task drops it unfinished (the client left) does the rest of the
//! execution move to a task of its own, tracked for graceful shutdown like any execution.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio_util::task::TaskTracker;

type Boxed<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// Polls `fut` in place; dropped before it finished, it spawns the rest on `tasks`.
pub struct Detached<T: Send + 'static> {
    fut: Option<Boxed<T>>,
    tasks: TaskTracker,
}

impl<T: Send + 'static> Detached<T> {
    pub fn new(fut: impl Future<Output = T> + Send + 'static, tasks: &TaskTracker) -> Self {
        Self {
            fut: Some(Box::pin(fut)),
            tasks: tasks.clone(),
        }
    }
}

impl<T: Send + 'static> Future for Detached<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let Some(fut) = self.fut.as_mut() else {
            panic!("Detached polled after it finished");
        };
        let out = std::task::ready!(fut.as_mut().poll(cx));
        self.fut = None;
        Poll::Ready(out)
    }
}

impl<T: Send + 'static> Drop for Detached<T> {
    fn drop(&mut self) {
        let Some(fut) = self.fut.take() else { return };
        // Outside a runtime (the process is exiting) there is nowhere to run it: the lease
        // expires as after a crash.
        if tokio::runtime::Handle::try_current().is_ok() {
            self.tasks.spawn(async move {
                let _ = fut.await;
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn runs_in_place_and_returns_its_output() {
        let tasks = TaskTracker::new();
        assert_eq!(Detached::new(async { 7 }, &tasks).await, 7);
        assert!(tasks.is_empty(), "nothing was spawned");
    }

    #[tokio::test]
    async fn dropped_unfinished_it_finishes_in_a_task() {
        let tasks = TaskTracker::new();
        let done = Arc::new(AtomicBool::new(false));
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let flag = done.clone();
        let work = Detached::new(
            async move {
                let _ = wait.await;
                flag.store(true, Ordering::SeqCst);
            },
            &tasks,
        );
        // The caller gives up while the work is pending.
        let gave_up = tokio::time::timeout(Duration::from_millis(20), work).await;
        assert!(gave_up.is_err());
        assert_eq!(tasks.len(), 1, "the rest moved to a task");
        go.send(()).unwrap();
        tasks.close();
        tokio::time::timeout(Duration::from_secs(5), tasks.wait())
            .await
            .expect("the detached work finishes");
        assert!(done.load(Ordering::SeqCst));
    }
}
