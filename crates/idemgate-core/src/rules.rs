//! The transition rules of a record, as pure functions of (current record, request, now).
//!
//! Every store applies these inside its own atomic section (a shard lock, a write transaction, a
//! row lock), so the rules exist once. A store written in another language (the Redis Lua
//! scripts) mirrors them and proves it by passing the same conformance suite.

use crate::fingerprint::Fingerprint;
use crate::record::{LeaseToken, Millis, Record, RecordState, StoredResponse};

/// What `begin` asks of the store.
#[derive(Clone, Debug)]
pub struct BeginRequest<'a> {
    pub fingerprint: Fingerprint,
    pub route: &'a str,
    /// The caller's token for this attempt; a retried `begin` with the same token is the same
    /// attempt and is answered `Acquired` again.
    pub token: LeaseToken,
    /// Used only when a new record is created.
    pub operation_id: &'a str,
    pub lease_ms: u64,
    pub retention_ms: u64,
    /// `on_lease_expiry: retry`: an expired lease may be taken over.
    pub takeover: bool,
    pub now: Millis,
}

/// The store's answer to `begin`: exactly one of these.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Begin {
    /// The caller owns the key and must execute, then complete or release.
    Acquired {
        operation_id: String,
        generation: u64,
        took_over: bool,
    },
    /// Another owner holds a live lease.
    InFlight {
        operation_id: String,
        lease_until: Millis,
    },
    /// A completed record with the same fingerprint: replay it.
    Replay(Box<Record>),
    /// The key is in use (in flight or completed) for another request.
    Mismatch { operation_id: String },
    /// The owner's lease ran out and the route does not allow takeover (`on_lease_expiry: fail`).
    LeaseExpired { operation_id: String },
}

/// How a store must change the record after a rule has decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Write {
    Keep,
    Put(Record),
    Delete,
}

/// A store operation named a token that is not the record's current owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("lease lost: the record is owned by another attempt or gone")]
pub struct Fenced;

/// Decides `begin`.
#[must_use]
pub fn begin(existing: Option<&Record>, req: &BeginRequest<'_>) -> (Begin, Write) {
    let Some(rec) = existing.filter(|r| r.is_live(req.now)) else {
        // Absent, or expired and so gone whether or not a sweep has removed it yet: a first
        // owner, generation 1 (never counting on from an expired record the sweep may keep).
        let (answer, acquisition) = begin_absent(req);
        let record = acquisition.record(req, req.operation_id.to_owned());
        return (answer, Write::Put(record));
    };
    let same = same_request(rec, req);
    match &rec.state {
        RecordState::InFlight { token, .. } if *token == req.token => (
            // The same attempt, retried after its first begin took effect: the same answer.
            // Generation 1 is a first owner, every later one took over an expired lease.
            Begin::Acquired {
                operation_id: rec.operation_id.clone(),
                generation: rec.generation,
                took_over: rec.generation > 1,
            },
            Write::Keep,
        ),
        _ if !same => (
            Begin::Mismatch {
                operation_id: rec.operation_id.clone(),
            },
            Write::Keep,
        ),
        RecordState::Completed { .. } => (Begin::Replay(Box::new(rec.clone())), Write::Keep),
        RecordState::InFlight { lease_until, .. } if req.now < *lease_until => (
            Begin::InFlight {
                operation_id: rec.operation_id.clone(),
                lease_until: *lease_until,
            },
            Write::Keep,
        ),
        RecordState::InFlight { .. } if req.takeover => {
            // The owner died: a new attempt with a new token and a new operation id.
            acquire(req, req.operation_id.to_owned(), rec.generation + 1, true)
        }
        RecordState::InFlight { .. } => (
            Begin::LeaseExpired {
                operation_id: rec.operation_id.clone(),
            },
            Write::Keep,
        ),
    }
}

/// [`begin`] on a record the caller has decoded for this call: a replay takes the record out of
/// `existing` instead of copying it (the copy was about a third of the allocations of a replay
/// on the memory store: strings, the header vector, and the shared promotion of each `Bytes`).
/// Every other answer leaves `existing` as it was.
#[must_use]
pub fn begin_taking(existing: &mut Option<Record>, req: &BeginRequest<'_>) -> (Begin, Write) {
    let replays = existing.as_ref().is_some_and(|rec| {
        // The case of `begin` that answers `Replay`: live, completed, the same request.
        rec.is_live(req.now) && matches!(rec.state, RecordState::Completed { .. }) && same_request(rec, req)
    });
    match existing.take_if(|_| replays) {
        Some(rec) => (Begin::Replay(Box::new(rec)), Write::Keep),
        None => begin(existing.as_ref(), req),
    }
}

/// The same request as the record's: its fingerprint (compared in constant time) and route.
fn same_request(rec: &Record, req: &BeginRequest<'_>) -> bool {
    rec.fingerprint.ct_eq(&req.fingerprint) && rec.route == req.route
}

fn acquire(req: &BeginRequest<'_>, operation_id: String, generation: u64, took_over: bool) -> (Begin, Write) {
    let record = Acquisition::of(req, generation).record(req, operation_id.clone());
    (
        Begin::Acquired {
            operation_id,
            generation,
            took_over,
        },
        Write::Put(record),
    )
}

/// [`begin`] where the key has no live record (none, or an expired one): always a first owner,
/// and what `begin` itself answers then. A store that writes its records itself (the memory
/// store, for a key with no entry) writes the in-flight record from these terms and the
/// request, without building a [`Record`] (its operation id and route copied) only to encode it.
#[must_use]
pub fn begin_absent(req: &BeginRequest<'_>) -> (Begin, Acquisition) {
    let acquisition = Acquisition::of(req, 1);
    let answer = Begin::Acquired {
        operation_id: req.operation_id.to_owned(),
        generation: acquisition.generation,
        took_over: false,
    };
    (answer, acquisition)
}

/// The terms of the in-flight record a new owner writes: with the request's token,
/// fingerprint, route and operation id, the whole record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Acquisition {
    pub generation: u64,
    pub created_at: Millis,
    pub lease_until: Millis,
    pub expires_at: Millis,
}

impl Acquisition {
    fn of(req: &BeginRequest<'_>, generation: u64) -> Self {
        Self {
            generation,
            created_at: req.now,
            lease_until: req.now + req.lease_ms,
            // With takeover, a dead owner's record lives as long as a completed one would.
            // Without (`on_lease_expiry: fail`, money movement) it never expires: the key
            // answers `outcome-unknown` until an operator purges it (SPEC 4), because letting it
            // lapse would let the operation run twice.
            expires_at: if req.takeover {
                req.now + req.lease_ms.max(req.retention_ms)
            } else {
                Millis::MAX
            },
        }
    }

    /// The in-flight record these terms make for `req`.
    #[must_use]
    pub fn record(&self, req: &BeginRequest<'_>, operation_id: String) -> Record {
        Record {
            state: RecordState::InFlight {
                token: req.token,
                lease_until: self.lease_until,
            },
            fingerprint: req.fingerprint,
            route: req.route.to_owned(),
            operation_id,
            created_at: self.created_at,
            expires_at: self.expires_at,
            generation: self.generation,
        }
    }
}

/// Decides `complete`: the owner stores its final outcome.
///
/// # Errors
/// [`Fenced`] when `token` is not the record's owner.
pub fn complete(
    existing: Option<&Record>,
    token: LeaseToken,
    response: StoredResponse,
    retention_ms: u64,
    now: Millis,
) -> Result<Write, Fenced> {
    let rec = existing.ok_or(Fenced)?;
    // A copy only for the owner's completion; the other answers need none.
    Ok(match completion(rec.standing(), token, retention_ms, now)? {
        Some(expires_at) => completed(rec.clone(), token, response, expires_at),
        None => Write::Keep,
    })
}

/// [`complete`] decided on a record's [`Standing`] alone, for a store that can read it without
/// decoding the record and write the completed one itself (the memory store rewrites its entry in
/// place): `Some(expires_at)` when `token` completes the record, which then holds its response,
/// the same token, every other field as it was and this expiry; `None` when `token` has already
/// completed it (a retry after it took effect: nothing to write).
///
/// # Errors
/// [`Fenced`] when `token` is not the record's owner (a store fences a missing record itself).
pub fn completion(
    rec: Standing,
    token: LeaseToken,
    retention_ms: u64,
    now: Millis,
) -> Result<Option<Millis>, Fenced> {
    // An expired record is gone (the owner lost it), whether or not a sweep has removed it yet.
    if now >= rec.expires_at || rec.token != token {
        return Err(Fenced);
    }
    // Retried after it took effect: already done, not a conflict.
    Ok((!rec.completed).then_some(now + retention_ms))
}

/// What [`completion`] needs of a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Standing {
    /// The current (or last) owner's token.
    pub token: LeaseToken,
    /// Whether the record holds an outcome.
    pub completed: bool,
    /// When the record is gone (see [`Record::is_live`]).
    pub expires_at: Millis,
}

impl Record {
    /// The fields [`completion`] decides on.
    #[must_use]
    pub fn standing(&self) -> Standing {
        Standing {
            token: self.token(),
            completed: matches!(self.state, RecordState::Completed { .. }),
            expires_at: self.expires_at,
        }
    }
}

/// The owner's in-flight record `done`, completed with `response`.
fn completed(mut done: Record, token: LeaseToken, response: StoredResponse, expires_at: Millis) -> Write {
    done.state = RecordState::Completed { token, response };
    done.expires_at = expires_at;
    Write::Put(done)
}

/// Decides `release`: the owner gives the key back after a transient outcome.
///
/// # Errors
/// [`Fenced`] when another attempt owns the record.
pub fn release(existing: Option<&Record>, token: LeaseToken) -> Result<Write, Fenced> {
    match existing.map(|r| &r.state) {
        // Retried after it took effect (or swept): nothing left to release.
        None => Ok(Write::Keep),
        Some(RecordState::InFlight { token: t, .. }) if *t == token => Ok(Write::Delete),
        Some(_) => Err(Fenced),
    }
}

/// Decides `renew`: the owner extends its lease while the upstream runs.
///
/// # Errors
/// [`Fenced`] when the token no longer owns an in-flight record.
pub fn renew(existing: Option<&Record>, token: LeaseToken, lease_until: Millis) -> Result<Write, Fenced> {
    match existing {
        Some(rec) => match rec.state {
            RecordState::InFlight {
                token: t,
                lease_until: held,
            } if t == token => {
                let mut renewed = rec.clone();
                // Never shortened: renewals may overlap or land late (a retried or delayed
                // call), and the owner counts on the latest one it saw succeed
                // (`Execution::lease_held`).
                let lease_until = lease_until.max(held);
                renewed.state = RecordState::InFlight { token, lease_until };
                renewed.expires_at = renewed.expires_at.max(lease_until);
                Ok(Write::Put(renewed))
            }
            _ => Err(Fenced),
        },
        None => Err(Fenced),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::StoredResponse;

    /// `begin_taking` answers as `begin` does on every kind of record, and takes the record only
    /// when it replays it.
    #[test]
    fn begin_taking_answers_as_begin() {
        let (now, fp, other_fp) = (1_000, Fingerprint([1; 32]), Fingerprint([2; 32]));
        let record = |state, fingerprint, route: &str, expires_at| Record {
            state,
            fingerprint,
            route: route.into(),
            operation_id: "op_1".into(),
            created_at: 0,
            expires_at,
            generation: 1,
        };
        let done = || RecordState::Completed {
            token: LeaseToken(7),
            response: StoredResponse {
                status: 201,
                headers: Vec::new(),
                body: None,
            },
        };
        let running = |lease_until| RecordState::InFlight {
            token: LeaseToken(7),
            lease_until,
        };
        let cases = [
            (record(done(), fp, "r", 2_000), true),
            (record(done(), other_fp, "r", 2_000), false),
            (record(done(), fp, "other", 2_000), false),
            (record(done(), fp, "r", 500), false),
            (record(running(1_500), fp, "r", 2_000), false),
            (record(running(500), fp, "r", 2_000), false),
        ];
        for (rec, replays) in cases {
            for takeover in [false, true] {
                let req = BeginRequest {
                    fingerprint: fp,
                    route: "r",
                    token: LeaseToken(9),
                    operation_id: "op_2",
                    lease_ms: 100,
                    retention_ms: 1_000,
                    takeover,
                    now,
                };
                let mut existing = Some(rec.clone());
                assert_eq!(
                    begin_taking(&mut existing, &req),
                    begin(Some(&rec), &req),
                    "{rec:?}"
                );
                assert_eq!(existing.is_none(), replays, "{rec:?}");
            }
        }
    }
}
