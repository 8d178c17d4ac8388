//! The writer thread: applies batches in redb write transactions, journals what must survive a
//! crash, checkpoints, and replays the journal at open.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use idemgate_core::notify::Notifier;
use idemgate_core::record::{LeaseToken, Millis, Record};
use idemgate_core::rules::{self, Write};
use idemgate_core::store::StoreError;
use redb::{Database, ReadableTable};
use tokio::sync::mpsc;

use super::recent::{self, Recent};
use super::reserved::{Entry, Reserved, State};
use super::snapshot::Snapshot;
use super::{
    Checkpoints, EXPIRY, JOURNAL_FILE, JOURNAL_GEN, JOURNAL_NEXT_GEN, JOURNAL_SEQ, MAX_BATCH, META, Op,
    RECORDS, Reply, SWEEP_BATCH, decode, encode, journal, sync,
};

/// The longest the writer waits for the journal's current group before applying a batch.
const PACE: std::time::Duration = std::time::Duration::from_millis(2);

/// An entry in memory that stands in for a write of the batch, to drop once the batch is
/// committed (see [`Reserved`]).
type StandIn = (String, LeaseToken, State);

/// The journal frames of the batch being applied, and the numbering they continue.
struct Frames {
    buf: Vec<u8>,
    generation: u64,
    /// The journal file they go to (0 or 1).
    file: usize,
    /// The generation the next checkpoint names, as the last one recorded.
    upcoming: u64,
    /// The last sequence number handed out.
    seq: u64,
}

impl Frames {
    fn push(&mut self, key: &str, value: Option<&[u8]>) {
        self.seq += 1;
        journal::encode(&mut self.buf, self.generation, self.seq, key, value);
    }
}

fn new_generation() -> u64 {
    // 64 random bits: a later generation is never mistaken for an earlier one at recovery.
    u64::try_from(LeaseToken::random().0 & u128::from(u64::MAX)).unwrap_or_default()
}

/// The writer thread (see the module doc).
pub(super) struct Writer {
    db: Arc<Database>,
    reserved: Arc<Reserved>,
    /// Replaced after every batch's commit, before the commit's stand-ins go or anyone is
    /// answered (checkpoints change no record, so they leave it).
    snapshot: Arc<Snapshot>,
    recent: Arc<Recent>,
    notifier: Arc<Notifier>,
    commits: Arc<AtomicU64>,
    shared: Arc<journal::Shared>,
    journal: std::sync::mpsc::Sender<journal::Msg>,
    /// Joined before the database is let go, so a store opened again in this process never
    /// meets this one's journal thread still writing.
    journal_thread: std::thread::JoinHandle<()>,
    frames: Frames,
    checkpoints: Checkpoints,
    /// redb's file: a periodic checkpoint leaves its fsync owed to the sync thread.
    control: Arc<sync::Control>,
}

impl Writer {
    pub(super) fn new(
        db: Arc<Database>,
        (reserved, snapshot, recent): (Arc<Reserved>, Arc<Snapshot>, Arc<Recent>),
        notifier: Arc<Notifier>,
        commits: Arc<AtomicU64>,
        (shared, journal, journal_thread): (
            Arc<journal::Shared>,
            std::sync::mpsc::Sender<journal::Msg>,
            std::thread::JoinHandle<()>,
        ),
        (seq, (generation, upcoming)): (u64, (u64, u64)),
        (checkpoints, control): (Checkpoints, Arc<sync::Control>),
    ) -> Self {
        Self {
            db,
            reserved,
            snapshot,
            recent,
            notifier,
            commits,
            shared,
            journal,
            journal_thread,
            frames: Frames {
                buf: Vec::new(),
                generation,
                file: 0,
                upcoming,
                seq,
            },
            checkpoints,
            control,
        }
    }

    /// Drains the queue into batches until every sender is gone, then makes a last checkpoint.
    pub(super) fn run(mut self, mut rx: mpsc::UnboundedReceiver<Op>) {
        // However this thread ends (a panic included), readers waiting for the disk are told,
        // and the sync thread ends once nothing is owed.
        let _stop = journal::BreakOnExit(self.shared.clone());
        let _sync = StopSync(self.control.clone());
        let mut batch = Vec::with_capacity(MAX_BATCH);
        let mut since_checkpoint = (0u64, Instant::now());
        while let Some(first) = rx.blocking_recv() {
            batch.push(first);
            let mut drain = |batch: &mut Vec<Op>| {
                while batch.len() < MAX_BATCH {
                    match rx.try_recv() {
                        Ok(op) => batch.push(op),
                        Err(_) => break,
                    }
                }
            };
            drain(&mut batch);
            if batch.len() < MAX_BATCH && self.shared.wait_while_syncing(PACE) {
                drain(&mut batch);
            }
            since_checkpoint.0 += self.batch(&mut batch);
            let (bytes, at) = since_checkpoint;
            let due =
                bytes >= self.checkpoints.bytes || (bytes > 0 && at.elapsed() >= self.checkpoints.every);
            if due && !self.checkpoints.paused() && self.checkpoint(true) {
                since_checkpoint = (0, Instant::now());
            }
        }
        // The last one is made durable here: nothing runs after it to make it so.
        self.checkpoint(false);
        self.snapshot.clear();
        let Self {
            journal,
            journal_thread,
            ..
        } = self;
        drop(journal);
        let _ = journal_thread.join();
    }

    /// Applies one batch and answers it: at once, or after its frames are on disk. Returns
    /// the journal bytes it wrote.
    fn batch(&mut self, batch: &mut Vec<Op>) -> u64 {
        if let Err(e) = self.shared.running() {
            let msg = e.to_string();
            batch.drain(..).for_each(|op| op.fail(&msg));
            return 0;
        }
        // An operation waits for the disk if it needs it, or if it read a key that an operation
        // needing the disk wrote earlier in this batch.
        let held: Vec<bool> = {
            let mut durable_keys = std::collections::HashSet::new();
            batch
                .iter()
                .map(|op| {
                    if op.needs_durability() {
                        durable_keys.extend(op.key());
                        true
                    } else {
                        op.key().is_some_and(|k| durable_keys.contains(k))
                    }
                })
                .collect()
        };
        let mut replies = Vec::with_capacity(batch.len());
        let mut stand_ins = Vec::new();
        let fail = self.checkpoints.fail_next_batch();
        let publish = !self.checkpoints.skip_next_publish();
        let applied = apply_batch(
            &self.db,
            batch.drain(..),
            (&mut replies, &mut stand_ins),
            (&mut self.frames, &self.reserved, &self.recent),
            (&self.shared, fail),
        );
        self.commits
            .fetch_add(u64::from(applied.is_ok()), Ordering::Relaxed);
        // Callers that find no stand-in read this snapshot, so it must show the batch before the
        // stand-ins go. After a failed commit too: like any fresh read, it shows what redb shows.
        if publish {
            self.snapshot.publish(&self.db);
            self.recent.published();
        }
        let frames = std::mem::take(&mut self.frames.buf);
        // Committed: redb shows these writes now, so the entries standing in for them go. Not
        // committed: a reservation that may not be taken over was not made, and an outcome goes
        // back to its owner's reservation, which can complete again.
        for (key, token, state) in stand_ins {
            match (&applied, state) {
                (Err(_), State::Completing) => self.reserved.reopen(&key, token),
                _ => self.reserved.remove(&key, token, state),
            }
        }
        if let Err(e) = applied {
            // A failed commit may still be visible (and redb refuses writes after it), while its
            // frames never reach the journal: nothing it shows may be handed out as durable.
            // The store stops until a restart replays the journal.
            tracing::error!(error = %e, "embedded store commit failed; the store stops until restarted");
            self.shared.break_down();
            let msg = format!("commit failed: {e}");
            replies.into_iter().for_each(|r| r.fail(&msg));
            return 0;
        }
        // A replay must not go out while the outcome it hands over could still be lost.
        let settled = frames.is_empty() && self.shared.is_settled();
        let (mut now, mut later) = (Vec::new(), Vec::new());
        for (reply, held) in replies.into_iter().zip(held) {
            if held || (!settled && reply.is_replay()) {
                later.push(reply);
            } else {
                now.push(reply);
            }
        }
        self.shared.answer(now, &self.notifier);
        let bytes = frames.len() as u64;
        if !frames.is_empty() || !later.is_empty() {
            self.append(frames, later);
        }
        bytes
    }

    fn append(&self, frames: Vec<u8>, replies: Vec<Reply>) {
        let msg = journal::Msg::Append {
            frames,
            last_seq: self.frames.seq,
            replies,
        };
        if let Err(std::sync::mpsc::SendError(journal::Msg::Append { replies, .. })) = self.journal.send(msg)
        {
            replies
                .into_iter()
                .for_each(|r| r.fail("embedded store journal stopped"));
        }
    }

    /// A durable redb commit that records the last journaled sequence number, after which the
    /// journal starts over at offset 0 of its other file in the generation the last checkpoint
    /// drew for it. With `owed`, its disk work is left to the sync thread (`sync.rs`). Returns
    /// whether it succeeded.
    fn checkpoint(&mut self, owed: bool) -> bool {
        let (seq, file) = (self.frames.seq, 1 - self.frames.file);
        let generations @ (next, after) = (self.frames.upcoming, new_generation());
        let started = Instant::now();
        // The file the journal goes to holds the frames the previous checkpoint covers, which a
        // crash needs until that checkpoint is on disk. It almost always is by now.
        if let Err(e) = self.control.settle() {
            tracing::error!(error = %e, "embedded store checkpoint failed");
            return false;
        }
        let committed = if owed {
            self.control
                .deferring(|| write_checkpoint(&self.db, seq, generations, file))
        } else {
            write_checkpoint(&self.db, seq, generations, file)
        };
        if let Err(e) = committed {
            tracing::error!(error = %e, "embedded store checkpoint failed");
            return false;
        }
        tracing::debug!(seq, owed, took = ?started.elapsed(), "embedded store checkpoint");
        self.frames.generation = next;
        self.frames.upcoming = after;
        self.frames.file = file;
        let _ = self.journal.send(journal::Msg::Wrap(file));
        true
    }
}

/// A durable commit of the journal position: every frame up to `seq` is in redb, frames from
/// here on belong to generation `next`, in journal file `file`, where recovery starts, and the
/// next checkpoint will name generation `after`.
fn write_checkpoint(
    db: &Database,
    seq: u64,
    (next, after): (u64, u64),
    file: usize,
) -> Result<(), redb::Error> {
    let txn = db.begin_write()?;
    {
        let mut meta = txn.open_table(META)?;
        meta.insert(JOURNAL_SEQ, seq)?;
        meta.insert(JOURNAL_GEN, next)?;
        meta.insert(JOURNAL_NEXT_GEN, after)?;
        meta.insert(JOURNAL_FILE, file as u64)?;
    }
    txn.commit()?;
    Ok(())
}

/// Applies a batch in one write transaction, committed without an fsync; its journaled writes
/// are announced as written before the commit makes them visible.
fn apply_batch(
    db: &Database,
    ops: impl Iterator<Item = Op>,
    (replies, stand_ins): (&mut Vec<Reply>, &mut Vec<StandIn>),
    (frames, reserved, recent): (&mut Frames, &Reserved, &Recent),
    (shared, fail): (&journal::Shared, bool),
) -> Result<(), redb::Error> {
    let mut txn = db.begin_write()?;
    // Durable through the journal, then the next checkpoint; see `Op::needs_durability`.
    txn.set_durability(redb::Durability::None)
        .map_err(|e| redb::Error::Io(std::io::Error::other(e.to_string())))?;
    let first = frames.seq;
    let removes = {
        let mut records = txn.open_table(RECORDS)?;
        let mut expiry = txn.open_table(EXPIRY)?;
        let mut tables = Tables {
            records: &mut records,
            expiry: &mut expiry,
            frames,
            journaling: false,
            reserved,
            stand_ins,
            removes: false,
        };
        for op in ops {
            tables.journaling = op.needs_durability();
            replies.push(tables.apply(op)?);
        }
        tables.removes
    };
    if removes {
        // Before the commit can show: the records callers keep from redb stop answering.
        recent.removing();
    }
    if frames.seq > first {
        shared.wrote(frames.seq);
    }
    if fail {
        return Err(redb::Error::Io(std::io::Error::other("injected by a test")));
    }
    txn.commit()?;
    Ok(())
}

/// Replays the journal's frames past the last checkpoint into redb and makes that durable with
/// a checkpoint that starts a new generation; returns the sequence number and generations (the
/// current one and the next checkpoint's) to continue from and how many frames were replayed.
/// Only the generation the last checkpoint named is replayed, then the one it drew for the next
/// (`journal::replay`): a journal beside another database file (a lost or restored
/// `records.redb`) replays nothing.
pub(super) fn recover(db: &Database, journal: [&[u8]; 2]) -> Result<(u64, (u64, u64), usize), StoreError> {
    let txn = db.begin_write().map_err(StoreError::backend)?;
    let (checkpoint, generation, upcoming, file) = {
        let meta = txn.open_table(META).map_err(StoreError::backend)?;
        let get = |name| -> Result<Option<u64>, StoreError> {
            Ok(meta.get(name).map_err(StoreError::backend)?.map(|v| v.value()))
        };
        // A store written before the second file names none: its journal is file 0.
        let file = usize::from(get(JOURNAL_FILE)? == Some(1));
        (
            get(JOURNAL_SEQ)?.unwrap_or(0),
            get(JOURNAL_GEN)?,
            get(JOURNAL_NEXT_GEN)?,
            file,
        )
    };
    let (frames, seq) = match generation {
        Some(generation) => journal::replay(journal, file, checkpoint, (generation, upcoming)),
        None => (Vec::new(), checkpoint),
    };
    {
        let mut records = txn.open_table(RECORDS).map_err(StoreError::backend)?;
        let mut expiry = txn.open_table(EXPIRY).map_err(StoreError::backend)?;
        let mut unused = Frames {
            buf: Vec::new(),
            generation: 0,
            file: 0,
            upcoming: 0,
            seq,
        };
        let (reserved, mut stand_ins) = (Reserved::default(), Vec::new());
        let mut tables = Tables {
            records: &mut records,
            expiry: &mut expiry,
            frames: &mut unused,
            journaling: false,
            reserved: &reserved,
            stand_ins: &mut stand_ins,
            removes: false,
        };
        for frame in &frames {
            let old = tables.load(&frame.key)?;
            let write = match &frame.value {
                Some(bytes) => Write::Put(decode(bytes)?),
                None => Write::Delete,
            };
            tables
                .write(&frame.key, old.as_ref(), write)
                .map_err(StoreError::backend)?;
        }
    }
    txn.commit().map_err(StoreError::backend)?;
    // Durable before the journal starts over in file 0 (the journal thread's first file).
    let generations = (new_generation(), new_generation());
    write_checkpoint(db, seq, generations, 0).map_err(StoreError::backend)?;
    if !frames.is_empty() {
        tracing::info!(frames = frames.len(), "embedded store replayed its journal");
    }
    Ok((seq, generations, frames.len()))
}

struct Tables<'a, 't> {
    records: &'a mut redb::Table<'t, &'static str, &'static [u8]>,
    expiry: &'a mut redb::Table<'t, (u64, &'static str), ()>,
    frames: &'a mut Frames,
    /// Whether the operation being applied must survive a crash, so its writes are journaled.
    journaling: bool,
    reserved: &'a Reserved,
    stand_ins: &'a mut Vec<StandIn>,
    /// Whether a completed record was deleted or replaced ([`super::recent`]).
    removes: bool,
}

impl Tables<'_, '_> {
    fn load(&self, key: &str) -> Result<Option<Record>, StoreError> {
        let value = self.records.get(key).map_err(StoreError::backend)?;
        value.map(|v| decode(v.value())).transpose()
    }

    fn write(&mut self, key: &str, old: Option<&Record>, write: Write) -> Result<(), redb::Error> {
        self.removes |= old.is_some_and(recent::may_hold) && !matches!(write, Write::Keep);
        match write {
            Write::Keep => return Ok(()),
            Write::Put(rec) => {
                if let Some(old) = old.filter(|o| o.expires_at != rec.expires_at) {
                    self.expiry.remove((old.expires_at, key))?;
                }
                let bytes = encode(&rec);
                self.records.insert(key, bytes.as_slice())?;
                self.expiry.insert((rec.expires_at, key), ())?;
                if self.journaling {
                    self.frames.push(key, Some(&bytes));
                }
            }
            Write::Delete => {
                if let Some(old) = old {
                    self.expiry.remove((old.expires_at, key))?;
                }
                self.records.remove(key)?;
                if self.journaling {
                    self.frames.push(key, None);
                }
            }
        }
        Ok(())
    }

    /// Applies one operation; errors that only concern this caller go into its reply, errors of
    /// the transaction itself abort the batch.
    fn apply(&mut self, op: Op) -> Result<Reply, redb::Error> {
        Ok(match op {
            Op::Begin(key, owned, reply) => {
                // Only a reservation that may not be taken over comes here (the rest is decided
                // in memory, `EmbeddedStore::decide_begin`), but any request is decided right.
                let req = owned.as_req();
                let mut shard = self.reserved.lock(&key);
                let stored = match self.load(&key) {
                    Ok(stored) => stored,
                    Err(e) => return Ok(Reply::Begin(reply, Err(e))),
                };
                let (answer, write) = match shard.get(key.as_str()) {
                    Some(entry) => entry.begin(&req),
                    None => rules::begin(stored.as_ref(), &req),
                };
                if let Write::Put(record) = &write {
                    // Until the commit shows it in redb, the entry answers for it.
                    let state = State::Durable;
                    shard.insert(
                        key.as_str().into(),
                        Entry {
                            record: record.clone(),
                            state,
                        },
                    );
                    self.stand_ins.push((key.clone(), req.token, state));
                }
                drop(shard);
                self.write(&key, stored.as_ref(), write)?;
                Reply::Begin(reply, Ok(answer))
            }
            Op::Record {
                key,
                token,
                record,
                reply,
            } => {
                // Still this owner's completing reservation (not purged meanwhile)?
                let ours = self
                    .reserved
                    .lock(&key)
                    .get(key.as_str())
                    .is_some_and(|e| e.state == State::Completing && e.token() == Some(token));
                if !ours {
                    return Ok(Reply::Unit(reply, Err(rules::Fenced.into()), None));
                }
                let stored = match self.load(&key) {
                    Ok(stored) => stored,
                    Err(e) => return Ok(Reply::Unit(reply, Err(e), None)),
                };
                self.write(&key, stored.as_ref(), Write::Put(record))?;
                self.stand_ins.push((key.clone(), token, State::Completing));
                Reply::Unit(reply, Ok(()), Some(key))
            }
            Op::Complete {
                key,
                token,
                response,
                retention_ms,
                now,
                reply,
            } => {
                let result = self.mutate(&key, |old| {
                    rules::complete(old, token, response, retention_ms, now)
                })?;
                Reply::Unit(reply, result, Some(key))
            }
            Op::Release(key, token, reply) => {
                let result = self.mutate(&key, |old| rules::release(old, token))?;
                Reply::Unit(reply, result, Some(key))
            }
            Op::Renew(key, token, until, reply) => {
                let result = self.mutate(&key, |old| rules::renew(old, token, until))?;
                Reply::Unit(reply, result, None)
            }
            Op::Purge(key, reply) => match self.load(&key) {
                Ok(old) => {
                    let existed = old.is_some();
                    self.write(&key, old.as_ref(), Write::Delete)?;
                    Reply::Bool(reply, Ok(existed), Some(key))
                }
                Err(e) => Reply::Bool(reply, Err(e), Some(key)),
            },
            Op::Forget(key, dead, reply) => match self.load(&key) {
                Ok(Some(old)) if old == *dead => {
                    self.write(&key, Some(&old), Write::Delete)?;
                    Reply::Bool(reply, Ok(true), None)
                }
                Ok(old) => Reply::Bool(reply, Ok(old.is_none()), None),
                Err(e) => Reply::Bool(reply, Err(e), None),
            },
            Op::Sweep(now, reply) => Reply::Count(reply, Ok(self.sweep(now)?)),
        })
    }

    fn mutate(
        &mut self,
        key: &str,
        rule: impl FnOnce(Option<&Record>) -> Result<Write, rules::Fenced>,
    ) -> Result<Result<(), StoreError>, redb::Error> {
        // A reservation in memory shadows whatever redb holds for the key: another owner's.
        if self.reserved.lock(key).contains_key(key) {
            return Ok(Err(rules::Fenced.into()));
        }
        let old = match self.load(key) {
            Ok(old) => old,
            Err(e) => return Ok(Err(e)),
        };
        match rule(old.as_ref()) {
            Ok(write) => {
                self.write(key, old.as_ref(), write)?;
                Ok(Ok(()))
            }
            Err(fenced) => Ok(Err(fenced.into())),
        }
    }

    fn sweep(&mut self, now: Millis) -> Result<usize, redb::Error> {
        let due: Vec<(u64, String)> = self
            .expiry
            // Due means `expires_at <= now` (a record is gone at its expiry instant).
            .range(..(now.saturating_add(1), ""))?
            .take(SWEEP_BATCH)
            .map(|e| e.map(|(k, _)| (k.value().0, k.value().1.to_owned())))
            .collect::<Result<_, _>>()?;
        for (at, key) in &due {
            self.expiry.remove((*at, key.as_str()))?;
            // The index may lag a record whose expiry moved; delete only what is really due.
            let old = self.load(key);
            if !matches!(&old, Ok(Some(rec)) if rec.is_live(now)) {
                let removed = self.records.remove(key.as_str())?.is_some();
                // A record that does not decode counts: it may be one the cache holds.
                let kept = match &old {
                    Ok(Some(rec)) => recent::may_hold(rec),
                    Ok(None) => false,
                    Err(_) => true,
                };
                self.removes |= removed && kept;
            }
        }
        Ok(due.len())
    }
}

/// Ends the sync thread when the writer thread ends, normally or by a panic.
struct StopSync(Arc<sync::Control>);

impl Drop for StopSync {
    fn drop(&mut self) {
        self.0.stop();
    }
}
