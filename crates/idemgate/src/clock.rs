//! A timer that bounds one wait after another without entering tokio's timer wheel for each.
//!
//! A fresh tokio `Sleep` per wait is put into the wheel when first polled and taken out when
//! dropped, each under the timer driver's lock. A [`Clock`] stays armed across waits instead:
//! armed at an earlier wait's deadline, it fires at or before a later wait's, and only then is
//! it moved (or earlier, for a shorter wait). One user at a time polls it (a connection's
//! successive request heads, a pooled upstream connection's successive requests), and it wakes
//! the task that polled it last. Left armed after its last wait, it keeps that task's waker and
//! wakes it once for nothing, at most once per bound's length.

use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::time::{Instant, Sleep};

pub(crate) struct Clock {
    sleep: Pin<Box<Sleep>>,
    /// Where `sleep` is set.
    at: Instant,
}

impl Clock {
    pub(crate) fn new(deadline: Instant) -> Self {
        Self {
            sleep: Box::pin(tokio::time::sleep_until(deadline)),
            at: deadline,
        }
    }

    /// Ready once `deadline` has passed. Polling registers the caller's waker; the timer moves
    /// only when it would fire late or has fired at an earlier deadline.
    pub(crate) fn poll_until(&mut self, cx: &mut Context<'_>, deadline: Instant) -> Poll<()> {
        if self.at > deadline {
            self.move_to(deadline);
        }
        loop {
            match self.sleep.as_mut().poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(()) if self.at >= deadline => return Poll::Ready(()),
                // Fired at an earlier wait's deadline: move it to this one.
                Poll::Ready(()) => self.move_to(deadline),
            }
        }
    }

    fn move_to(&mut self, deadline: Instant) {
        self.sleep.as_mut().reset(deadline);
        self.at = deadline;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn poll(clock: &mut Clock, deadline: Instant) -> Poll<()> {
        clock.poll_until(&mut Context::from_waker(std::task::Waker::noop()), deadline)
    }

    async fn wait(clock: &mut Clock, deadline: Instant) {
        std::future::poll_fn(|cx| clock.poll_until(cx, deadline)).await;
    }

    /// Each wait ends at its own deadline: not at an earlier wait's, not before, not much after.
    #[tokio::test(start_paused = true)]
    async fn each_wait_ends_at_its_own_deadline() {
        let start = Instant::now();
        let mut clock = Clock::new(start + Duration::from_secs(10));
        assert!(poll(&mut clock, start + Duration::from_secs(10)).is_pending());
        tokio::time::advance(Duration::from_secs(4)).await;

        // Later: armed at +10 s, the clock fires there and moves on to +14 s.
        let later = Instant::now() + Duration::from_secs(10);
        tokio::time::timeout(Duration::from_secs(60), wait(&mut clock, later))
            .await
            .expect("the later wait ends");
        assert_eq!(Instant::now(), later);

        // Earlier than where the clock is set (a shorter bound): the clock moves back.
        let earlier = Instant::now() + Duration::from_secs(1);
        assert!(poll(&mut clock, Instant::now() + Duration::from_secs(30)).is_pending());
        tokio::time::timeout(Duration::from_secs(60), wait(&mut clock, earlier))
            .await
            .expect("the earlier wait ends");
        assert_eq!(Instant::now(), earlier);
    }

    /// A clock that fired while unused bounds the next wait from that wait's deadline.
    #[tokio::test(start_paused = true)]
    async fn a_clock_that_fired_while_idle_still_waits() {
        let mut clock = Clock::new(Instant::now() + Duration::from_secs(1));
        assert!(poll(&mut clock, Instant::now() + Duration::from_secs(1)).is_pending());
        tokio::time::advance(Duration::from_secs(5)).await;
        let next = Instant::now() + Duration::from_secs(2);
        assert!(
            poll(&mut clock, next).is_pending(),
            "not over before its deadline"
        );
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(poll(&mut clock, next).is_ready());
    }
}
