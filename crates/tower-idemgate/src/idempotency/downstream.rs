//! [`Downstream`]: the execution task's side of the client's response body.
//!
//! While the body is still being captured for the record (within `max_response_bytes`), frames
//! the client is not ready for wait in a backlog instead of stopping the task: the record is
//! then completed as soon as the handler's body ends, however slowly the client reads, and a
//! stalled client cannot keep the key in flight. The backlog holds only bytes that are captured
//! anyway, so it is bounded by the limit. Past the limit nothing is captured and frames go out
//! with backpressure, as any streamed response.

use std::collections::VecDeque;

use bytes::Bytes;
use http_body::Frame;
use tokio::sync::mpsc::{self, error::TrySendError};

use super::BoxError;

type Item = Result<Frame<Bytes>, BoxError>;

pub(crate) struct Downstream {
    /// `None` once the client went away: frames are then dropped.
    tx: Option<mpsc::Sender<Item>>,
    backlog: VecDeque<Item>,
}

impl Downstream {
    pub fn new(tx: Option<mpsc::Sender<Item>>) -> Self {
        Self {
            tx,
            backlog: VecDeque::new(),
        }
    }

    /// Hands `item` on without waiting: sent if the channel has room, else queued.
    pub fn offer(&mut self, item: Item) {
        self.backlog.push_back(item);
        while let (Some(tx), Some(next)) = (&self.tx, self.backlog.pop_front()) {
            match tx.try_send(next) {
                Ok(()) => {}
                Err(TrySendError::Full(next)) => {
                    self.backlog.push_front(next);
                    return;
                }
                Err(TrySendError::Closed(_)) => self.gone(),
            }
        }
    }

    /// Hands `item` on after everything queued, waiting for the client.
    pub async fn send(&mut self, item: Item) {
        self.backlog.push_back(item);
        while let (Some(tx), Some(next)) = (&self.tx, self.backlog.pop_front()) {
            if tx.send(next).await.is_err() {
                self.gone();
            }
        }
    }

    fn gone(&mut self) {
        self.tx = None;
        self.backlog.clear();
    }
}
