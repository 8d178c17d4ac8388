//! A future that keeps running when its caller goes away.
//!
//! An execution must run to its end even if the client disconnects (its outcome is recorded
//! and replayed to the retry). Spawning every execution as a task of its own costs a task, a
//! channel and two task switches per miss; instead the request's task polls the execution
//! itself, and only if that task drops it unfinished (the client left) does the rest of the
//! execution move to a task of its own. Either way it holds a token of the executions'
//! tracker from the start, so a graceful shutdown waits for it wherever it runs.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio_util::task::TaskTracker;
use tokio_util::task::task_tracker::TaskTrackerToken;

type Boxed<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// Polls `fut` in place, counted in `tasks`; dropped before it finished, it spawns the rest,
/// still counted.
pub struct Detached<T: Send + 'static> {
    /// The execution and its count in `tasks` (`TaskTracker::wait`), until it finishes.
    running: Option<(Boxed<T>, TaskTrackerToken)>,
}

impl<T: Send + 'static> Detached<T> {
    pub fn new(fut: impl Future<Output = T> + Send + 'static, tasks: &TaskTracker) -> Self {
        Self {
            running: Some((Box::pin(fut), tasks.token())),
        }
    }
}

impl<T: Send + 'static> Future for Detached<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let Some((fut, _)) = self.running.as_mut() else {
            panic!("Detached polled after it finished");
        };
        // A panicking execution is not resumed in a task on drop (it would only panic again).
        let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| fut.as_mut().poll(cx)));
        let out = match polled {
            Ok(Poll::Pending) => return Poll::Pending,
            Ok(Poll::Ready(out)) => out,
            Err(panic) => {
                self.running = None;
                std::panic::resume_unwind(panic);
            }
        };
        self.running = None;
        Poll::Ready(out)
    }
}

impl<T: Send + 'static> Drop for Detached<T> {
    fn drop(&mut self) {
        let Some((fut, token)) = self.running.take() else {
            return;
        };
        // The token goes with it: the tracker counts the task until the execution ends.
        // Outside a runtime (the process is exiting) there is nowhere to run it: the lease
        // expires as after a crash.
        if tokio::runtime::Handle::try_current().is_ok() {
            tokio::spawn(async move {
                let _token = token;
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
        let running = Detached::new(async { 7 }, &tasks);
        assert_eq!(tasks.len(), 1, "counted while it runs in place");
        assert_eq!(running.await, 7);
        assert!(tasks.is_empty(), "nothing was spawned, nothing left counted");
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
