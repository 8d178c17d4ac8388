//! What a store keeps per namespaced key: the [`Record`], its [`RecordState`], the
//! [`StoredResponse`] replayed to retries, and the [`LeaseToken`] that fences owners.

use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::fingerprint::Fingerprint;

/// Milliseconds since the Unix epoch. Records carry wall-clock times because they outlive the
/// process (embedded store) and are shared between replicas (redis, postgres).
pub type Millis = u64;

/// The current wall-clock time in [`Millis`].
#[must_use]
pub fn now_millis() -> Millis {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Identifies one acquisition of a key. Every store operation after `begin` names the token it
/// holds, and a store refuses a token that is not the record's current one: a late owner whose
/// lease was taken over can neither complete nor release the newer owner's record.
///
/// Tokens are random (128 bits) rather than a counter so that a `begin` retried after it already
/// took effect can be recognised as the same attempt and answered `Acquired` again.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LeaseToken(pub u128);

impl LeaseToken {
    /// A fresh random token.
    #[must_use]
    pub fn random() -> Self {
        Self(rand::random())
    }
}

impl std::fmt::Debug for LeaseToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LeaseToken({:08x}…)", (self.0 >> 96) as u32)
    }
}

/// A response as kept for replay.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredResponse {
    pub status: u16,
    /// Only allow-listed headers (see [`crate::engine::is_storable_header`]), in upstream order.
    pub headers: Vec<(String, Bytes)>,
    /// `None` when the body exceeded `max_response_bytes`: the outcome is recorded (the operation
    /// ran) but cannot be replayed.
    pub body: Option<Bytes>,
}

impl StoredResponse {
    /// A copy whose bytes are its own. The response the gateway records shares its body with
    /// the buffer it was read into from the upstream (8 KiB to hundreds); whatever keeps a
    /// response beyond the call that recorded it keeps this copy, so that it does not hold that
    /// buffer alive.
    #[must_use]
    pub fn compacted(&self) -> Self {
        Self {
            status: self.status,
            headers: self
                .headers
                .iter()
                .map(|(n, v)| (n.clone(), Bytes::copy_from_slice(v)))
                .collect(),
            body: self.body.as_deref().map(Bytes::copy_from_slice),
        }
    }

    /// Approximate heap size, used by the memory store's byte budget.
    #[must_use]
    pub fn approx_bytes(&self) -> usize {
        let headers: usize = self.headers.iter().map(|(n, v)| n.len() + v.len() + 48).sum();
        headers + self.body.as_ref().map_or(0, Bytes::len) + 32
    }
}

/// Where a record is in its lifecycle.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RecordState {
    /// An owner holds the key while the upstream runs.
    InFlight { token: LeaseToken, lease_until: Millis },
    /// The outcome is final and replayed until `expires_at`.
    Completed {
        token: LeaseToken,
        response: StoredResponse,
    },
}

/// One namespaced key's record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub state: RecordState,
    pub fingerprint: Fingerprint,
    /// The route id that created the record.
    pub route: String,
    /// Stable id of the operation, sent as `x-operation-id` on the first response and replays.
    pub operation_id: String,
    pub created_at: Millis,
    /// After this instant the record is gone: a `begin` treats it as absent and sweeps remove it.
    pub expires_at: Millis,
    /// Counts acquisitions of this key (1 for the first owner, +1 on each takeover).
    pub generation: u64,
}

impl Record {
    /// Whether the record still exists at `now`.
    #[must_use]
    pub fn is_live(&self, now: Millis) -> bool {
        now < self.expires_at
    }

    /// The token of the current (or last) owner.
    #[must_use]
    pub fn token(&self) -> LeaseToken {
        match &self.state {
            RecordState::InFlight { token, .. } | RecordState::Completed { token, .. } => *token,
        }
    }

    /// Approximate heap size, used by the memory store's byte budget.
    #[must_use]
    pub fn approx_bytes(&self, key: &str) -> usize {
        let response = match &self.state {
            RecordState::InFlight { .. } => 0,
            RecordState::Completed { response, .. } => response.approx_bytes(),
        };
        key.len() + self.route.len() + self.operation_id.len() + response + 160
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_compacted_response_is_equal_and_shares_no_bytes() {
        let buffer = Bytes::from(vec![7u8; 64 * 1024]);
        let response = StoredResponse {
            status: 201,
            headers: vec![("etag".into(), buffer.slice(0..4))],
            body: Some(buffer.slice(100..124)),
        };
        let compacted = response.compacted();
        assert_eq!(compacted, response);
        let inside = |b: &Bytes| buffer.as_ptr_range().contains(&b.as_ptr());
        assert!(!inside(compacted.body.as_ref().unwrap()));
        assert!(!inside(&compacted.headers[0].1));
    }
}
