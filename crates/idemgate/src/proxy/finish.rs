//! After the upstream answered: the outcome is completed or released, and an outcome the store
//! could not take yet is retried in the background while the key stays held.

use std::time::{Duration, Instant};

use idemgate_core::engine::{Execution, Finished, Outcome};
use idemgate_core::store::StoreError;

use super::Gateway;
use crate::store::AnyStore;

impl Gateway {
    /// Completes or releases an execution, timing the store call.
    pub(super) async fn finish(&self, mut exec: Execution<AnyStore>, outcome: Outcome) -> Option<Finished> {
        let timer = Instant::now();
        let first = exec.try_finish(&outcome).await;
        let op = if matches!(first, Ok(Finished::Completed { .. })) {
            "complete"
        } else {
            "release"
        };
        self.metrics.store_latency(op, timer.elapsed().as_secs_f64());
        match first {
            Ok(f) => Some(f),
            Err(StoreError::Fenced(_)) => {
                tracing::error!(
                    "the lease was lost before the outcome was recorded; a retry may run the operation again"
                );
                None
            }
            Err(e) => {
                // The response still goes to the client: the upstream ran. The key stays
                // reserved (the lease is still renewed) and the outcome is recorded as soon as
                // the store answers again, so a retry waits and then replays instead of running
                // the operation a second time.
                tracing::warn!(error = %e, "could not record the outcome yet; retrying in the background");
                // Kept for up to `RECORD_PATIENCE`: bytes of its own, not a view into the
                // upstream connection's read buffer.
                let outcome = match outcome {
                    Outcome::Response(response) => Outcome::Response(response.compacted()),
                    Outcome::NoResponse => Outcome::NoResponse,
                };
                self.tasks.spawn(record_later(exec, outcome));
                None
            }
        }
    }
}

impl Gateway {
    /// [`Execution::withdraw`], timed like every release.
    pub(super) async fn withdraw(&self, exec: Execution<AnyStore>) {
        let timer = Instant::now();
        exec.withdraw().await;
        self.metrics
            .store_latency("release", timer.elapsed().as_secs_f64());
    }
}

/// How long an outcome the client already has is retried into a failing store.
const RECORD_PATIENCE: Duration = Duration::from_secs(600);

/// Keeps trying to record `outcome`, with backoff, while the execution holds the key.
async fn record_later(mut exec: Execution<AnyStore>, outcome: Outcome) {
    let deadline = Instant::now() + RECORD_PATIENCE;
    let mut delay = Duration::from_millis(50);
    loop {
        tokio::time::sleep(delay).await;
        match exec.try_finish(&outcome).await {
            Ok(_) => {
                tracing::info!(operation_id = %exec.operation_id(), "outcome recorded after the store came back");
                return;
            }
            Err(StoreError::Fenced(_)) => {
                tracing::error!(operation_id = %exec.operation_id(), "the lease was lost before the outcome was recorded; a retry may have run the operation again");
                return;
            }
            Err(e) if Instant::now() >= deadline => {
                tracing::error!(error = %e, operation_id = %exec.operation_id(), "gave up recording the outcome; the lease rule decides what a retry gets");
                return;
            }
            Err(_) => delay = (delay * 2).min(Duration::from_secs(1)),
        }
    }
}
