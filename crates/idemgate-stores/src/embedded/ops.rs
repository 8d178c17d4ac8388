//! The operations the embedded store's callers hand to its writer thread, and the replies the
//! writer sends back (at once, or once the journal has made them durable).

use idemgate_core::notify::Notifier;
use idemgate_core::record::{LeaseToken, Millis, Record, StoredResponse};
use idemgate_core::rules::{Begin, BeginRequest};
use idemgate_core::store::StoreError;
use tokio::sync::oneshot;

impl Op {
    /// The key the operation touches (a sweep touches whichever are due).
    pub(super) fn key(&self) -> Option<&str> {
        match self {
            Op::Begin(key, ..) | Op::Release(key, ..) | Op::Renew(key, ..) | Op::Purge(key, ..) => Some(key),
            Op::Forget(key, ..) => Some(key),
            Op::Complete { key, .. } | Op::Record { key, .. } => Some(key),
            Op::Sweep(..) => None,
        }
    }

    /// Answers the operation with an error without applying it.
    pub(super) fn fail(self, msg: &str) {
        let err = || StoreError::Backend(msg.to_owned().into());
        match self {
            Op::Begin(_, _, tx) => drop(tx.send(Err(err()))),
            Op::Complete { reply, .. } | Op::Record { reply, .. } => drop(reply.send(Err(err()))),
            Op::Release(_, _, tx) | Op::Renew(_, _, _, tx) => drop(tx.send(Err(err()))),
            Op::Purge(_, tx) => drop(tx.send(Err(err()))),
            Op::Sweep(_, tx) => drop(tx.send(Err(err()))),
            Op::Forget(_, _, tx) => drop(tx.send(Err(err()))),
        }
    }

    /// Whether this operation must reach the disk before it is answered.
    ///
    /// A completed outcome, a release, a purge, and a reservation that may never be taken over
    /// (`on_lease_expiry: fail`) must survive a crash. A reservation that may be taken over need
    /// not: if a crash loses it, the key is free at restart, which is exactly what its lease
    /// expiry would have allowed (the crash point SPEC 4 already names). Renewals and sweeps are
    /// rewritten or redone anyway. So the common miss (begin, complete) costs one fsync, not two.
    pub(super) fn needs_durability(&self) -> bool {
        match self {
            Op::Begin(_, owned, _) => !owned.takeover,
            Op::Complete { .. } | Op::Record { .. } | Op::Release(..) | Op::Purge(..) => true,
            Op::Renew(..) | Op::Sweep(..) | Op::Forget(..) => false,
        }
    }
}

pub(super) enum Op {
    Begin(String, OwnedBegin, oneshot::Sender<Result<Begin, StoreError>>),
    Complete {
        key: String,
        token: LeaseToken,
        response: StoredResponse,
        retention_ms: u64,
        now: Millis,
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
    /// An outcome decided on the caller's task for a reservation held in memory ([`reserved`]),
    /// written if that reservation is still there and completing.
    Record {
        key: String,
        token: LeaseToken,
        record: Record,
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
    Release(String, LeaseToken, oneshot::Sender<Result<(), StoreError>>),
    Renew(
        String,
        LeaseToken,
        Millis,
        oneshot::Sender<Result<(), StoreError>>,
    ),
    Purge(String, oneshot::Sender<Result<bool, StoreError>>),
    /// Deletes the dead record (expired, or an owner's whose lease ran out) that a reservation
    /// in memory replaced, so it cannot show again once that reservation is gone; only if it is
    /// still exactly that record. Answers whether it is gone (deleted now, or already); `false`
    /// means redb holds another record for the key than the one the reservation replaced.
    Forget(String, Box<Record>, oneshot::Sender<Result<bool, StoreError>>),
    Sweep(Millis, oneshot::Sender<Result<usize, StoreError>>),
}

/// A [`BeginRequest`] that can cross to the writer thread.
pub(super) struct OwnedBegin {
    fingerprint: idemgate_core::Fingerprint,
    route: String,
    token: LeaseToken,
    operation_id: String,
    lease_ms: u64,
    retention_ms: u64,
    takeover: bool,
    now: Millis,
}

impl OwnedBegin {
    pub(super) fn new(req: &BeginRequest<'_>) -> Self {
        Self {
            fingerprint: req.fingerprint,
            route: req.route.to_owned(),
            token: req.token,
            operation_id: req.operation_id.to_owned(),
            lease_ms: req.lease_ms,
            retention_ms: req.retention_ms,
            takeover: req.takeover,
            now: req.now,
        }
    }

    pub(super) fn as_req(&self) -> BeginRequest<'_> {
        BeginRequest {
            fingerprint: self.fingerprint,
            route: &self.route,
            token: self.token,
            operation_id: &self.operation_id,
            lease_ms: self.lease_ms,
            retention_ms: self.retention_ms,
            takeover: self.takeover,
            now: self.now,
        }
    }
}

/// A reply held back until the batch's commit succeeded.
pub(super) enum Reply {
    Begin(
        oneshot::Sender<Result<Begin, StoreError>>,
        Result<Begin, StoreError>,
    ),
    Unit(
        oneshot::Sender<Result<(), StoreError>>,
        Result<(), StoreError>,
        Option<String>,
    ),
    /// A purge's answer names its key, whose waiters it wakes; a forget's names none.
    Bool(
        oneshot::Sender<Result<bool, StoreError>>,
        Result<bool, StoreError>,
        Option<String>,
    ),
    Count(
        oneshot::Sender<Result<usize, StoreError>>,
        Result<usize, StoreError>,
    ),
}

impl Reply {
    pub(super) fn is_replay(&self) -> bool {
        matches!(self, Self::Begin(_, Ok(Begin::Replay(_))))
    }

    pub(super) fn fail(self, e: &str) {
        let err = || StoreError::Backend(e.to_owned().into());
        match self {
            Self::Begin(tx, _) => drop(tx.send(Err(err()))),
            Self::Unit(tx, _, _) => drop(tx.send(Err(err()))),
            Self::Bool(tx, _, _) => drop(tx.send(Err(err()))),
            Self::Count(tx, _) => drop(tx.send(Err(err()))),
        }
    }

    pub(super) fn send(self, notifier: &Notifier) {
        match self {
            Self::Begin(tx, r) => drop(tx.send(r)),
            // The caller first: woken before the key's waiters, an owner hands its outcome over
            // before they look for it (`lead.rs`).
            Self::Unit(tx, r, key) => {
                let wake = r.is_ok().then_some(key).flatten();
                drop(tx.send(r));
                if let Some(key) = wake {
                    notifier.notify(&key);
                }
            }
            Self::Bool(tx, r, key) => {
                drop(tx.send(r));
                if let Some(key) = key {
                    notifier.notify(&key);
                }
            }
            Self::Count(tx, r) => drop(tx.send(r)),
        }
    }
}
