//! The embedded store, idemgate's default: records in a [redb](https://docs.rs/redb) file,
//! durable across restarts and `kill -9`.
//!
//! Why redb: a pure-Rust copy-on-write B-tree with checksummed, atomic commits, so a crash
//! leaves either the old or the new state and nothing to replay; one writer at a time, which is
//! exactly the shape of the group-commit writer below; and a small dependency tree that keeps the
//! gateway's build fast. An LSM (fjall) would write faster under huge volumes but brings
//! compaction and journal tuning that a record store of short-lived keys does not need.
//!
//! Group commit: every mutation goes to one writer thread, which drains whatever is queued
//! (up to [`MAX_BATCH`]) and applies it in one write transaction, committed without an fsync.
//! The writes that must survive a crash (outcomes, releases, purges) also go to the
//! journal (`journal.rs`), whose own thread appends and fsyncs them in groups; those operations are
//! answered only once their frames are on disk, the rest (reservations that may be taken over,
//! renewals) right after the commit. An outcome is therefore on disk before the client sees the
//! response, and one fsync covers many requests. The writer paces itself to the journal: while
//! the journal syncs a group, the writer gathers what arrives into its next batch (for 2 ms at
//! most), since none of it could reach the disk before the next group anyway; one commit then
//! covers more operations (the writer's CPU per miss fell from 12.1-12.6 to 10.6-11.1 µs on the
//! benchmark rig). A reservation that may be taken over never waits for it: those stay off the
//! writer (`reserved.rs`). A periodic durable redb commit (a checkpoint) lets the journal start
//! over; at open, the journal's frames past the last checkpoint are replayed into redb.
//!
//! Answers leave the store's threads in groups: [`EmbeddedStore::spawn_answerer`] starts a task
//! on the callers' runtime that wakes them from inside it (one wake-up from outside per group,
//! not one per caller); without it, or once its runtime has ended, the threads answer directly.
//!
//! Reads that need no write (a replay, a mismatch, a key in flight) are answered from a read
//! snapshot on the caller's task without queueing behind the writer; a replay first waits until
//! every journaled write it could have seen is on disk. The snapshot is one read transaction
//! that the writer replaces after each commit (`snapshot.rs`), not one per caller. Completed
//! records read that way stay decoded in memory for the key's next retries (`recent.rs`).

mod appender;
mod batch;
mod journal;
#[cfg(test)]
mod kill_tests;
mod ops;
mod recent;
#[cfg(test)]
mod recent_tests;
mod reserved;
mod snapshot;
mod sync;
#[cfg(test)]
mod tests;
mod writer;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idemgate_core::notify::Notifier;
use idemgate_core::record::{LeaseToken, Millis, Record, RecordState, StoredResponse, now_millis};
use idemgate_core::rules::{self, Begin, BeginRequest, Write};
use idemgate_core::store::{Store, StoreError};
use redb::{Database, ReadableDatabase, TableDefinition};
use tokio::sync::{mpsc, oneshot};

use ops::{Op, OwnedBegin, Reply};
use reserved::{Entry, State};

const RECORDS: TableDefinition<&str, &[u8]> = TableDefinition::new("records");
/// (expires_at, key) for every record, so a sweep reads only what is due.
const EXPIRY: TableDefinition<(u64, &str), ()> = TableDefinition::new("expiry");
/// `journal_seq`: the sequence number of the last journal frame the durable state includes.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const JOURNAL_SEQ: &str = "journal_seq";
/// `journal_gen`: the generation of the frames written since that checkpoint.
const JOURNAL_GEN: &str = "journal_gen";
/// `journal_file`: the journal file (0 or 1) those frames start in; absent means 0.
const JOURNAL_FILE: &str = "journal_file";
/// `journal_next_gen`: the generation the next checkpoint will name, drawn in advance, so
/// recovery knows the frames written after a checkpoint that never reached the disk.
const JOURNAL_NEXT_GEN: &str = "journal_next_gen";

/// The most operations one commit carries.
pub const MAX_BATCH: usize = 512;
/// The most expired records one sweep pass deletes, so a sweep never holds the writer long.
const SWEEP_BATCH: usize = 1000;
/// Encoding version byte in front of every stored record.
const FORMAT: u8 = 1;

/// When the writer makes a checkpoint (a durable redb commit) so the journal can start over:
/// after this many journal bytes, or this long after the last one if anything was journaled
/// since. Each checkpoint holds the writer for one redb fsync; between them redb cannot reuse
/// pages that commits without an fsync freed, so the file grows by about one interval's churn.
/// Short intervals keep each stall short: at 20k misses/s on the benchmark machine a checkpoint
/// every 100 ms took 2.4 ms (p99 of requests 5.5 to 6.9 ms), one every second 18 ms (p99 10 to
/// 16 ms), at the same throughput.
#[derive(Clone, Debug)]
struct Checkpoints {
    bytes: u64,
    every: Duration,
    /// Set by a test that needs its last writes to exist only in the journal.
    #[cfg(test)]
    paused: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// Set by a test: the next batch fails after its writes, before its commit.
    #[cfg(test)]
    fail_next_batch: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// Set by a test: the next batch commits without publishing a snapshot, so callers read the
    /// one before it, as they may in the moment between a commit and its publish.
    #[cfg(test)]
    skip_next_publish: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// Set by a test: redb's cache in bytes, small enough that readers write committed pages
    /// back to the file themselves (redb does that when its cache is full).
    #[cfg(test)]
    cache_bytes: Option<usize>,
}

impl Checkpoints {
    fn paused(&self) -> bool {
        #[cfg(test)]
        if let Some(paused) = &self.paused {
            return paused.load(Ordering::SeqCst);
        }
        false
    }

    fn skip_next_publish(&self) -> bool {
        #[cfg(test)]
        if let Some(skip) = &self.skip_next_publish {
            return skip.swap(false, Ordering::SeqCst);
        }
        false
    }

    fn fail_next_batch(&self) -> bool {
        #[cfg(test)]
        if let Some(fail) = &self.fail_next_batch {
            return fail.swap(false, Ordering::SeqCst);
        }
        false
    }
}

const CHECKPOINTS: Checkpoints = Checkpoints {
    bytes: journal::PREALLOCATED / 2,
    every: Duration::from_millis(100),
    #[cfg(test)]
    paused: None,
    #[cfg(test)]
    fail_next_batch: None,
    #[cfg(test)]
    skip_next_publish: None,
    #[cfg(test)]
    cache_bytes: None,
};

/// A durable record store: records in a redb file and its journal, reservations that may be
/// taken over in memory (see the module doc).
pub struct EmbeddedStore {
    db: Arc<Database>,
    reserved: Arc<reserved::Reserved>,
    snapshot: Arc<snapshot::Snapshot>,
    recent: Arc<recent::Recent>,
    commits: Arc<AtomicU64>,
    journal: Arc<journal::Shared>,
    replayed: usize,
    ops: mpsc::UnboundedSender<Op>,
    notifier: Arc<Notifier>,
    path: PathBuf,
    #[cfg(test)]
    sync: Arc<sync::Control>,
}

impl std::fmt::Debug for EmbeddedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedStore")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl EmbeddedStore {
    /// Opens (or creates) the store in directory `dir` (files `records.redb`, `records.journal`
    /// and `records.journal.1` inside), replaying the journal if the last process did not stop
    /// cleanly.
    ///
    /// # Errors
    /// The directory or the database cannot be created or opened (another process holds it).
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, StoreError> {
        Self::open_with(dir.as_ref(), CHECKPOINTS.clone())
    }

    fn open_with(dir: &Path, checkpoints: Checkpoints) -> Result<Self, StoreError> {
        std::fs::create_dir_all(dir).map_err(StoreError::backend)?;
        let path = dir.join("records.redb");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(StoreError::backend)?;
        let control = sync::Control::new(file).map_err(StoreError::backend)?;
        #[allow(unused_mut)] // changed by tests only
        let mut builder = redb::Builder::new();
        #[cfg(test)]
        if let Some(bytes) = checkpoints.cache_bytes {
            builder.set_cache_size(bytes);
        }
        let db = Arc::new(
            builder
                .create_with_backend(sync::Backend(control.clone()))
                .map_err(StoreError::backend)?,
        );
        let paths = [dir.join("records.journal"), dir.join("records.journal.1")];
        let (first, first_bytes) = journal::open(&paths[0]).map_err(StoreError::backend)?;
        let (second, second_bytes) = journal::open(&paths[1]).map_err(StoreError::backend)?;
        journal::sync_dirs(dir).map_err(StoreError::backend)?;
        let (seq, generations, replayed) = writer::recover(&db, [&first_bytes, &second_bytes])?;
        drop((first_bytes, second_bytes));
        // The probe of a direct write (`appender.rs`) writes the first block of each file back
        // with the bytes it holds.
        let files = [
            appender::Appender::new(first, &paths[0]),
            appender::Appender::new(second, &paths[1]),
        ];
        let notifier = Arc::new(Notifier::default());
        let shared = Arc::new(journal::Shared::new(seq));
        let (journal_tx, journal_rx) = std::sync::mpsc::channel();
        let (journal_shared, journal_notifier) = (shared.clone(), notifier.clone());
        // Thread names stay under 16 bytes: Linux cuts them at 15, and `top -H`, `perf` and
        // bench/ab.sh must tell the journal and the writer apart.
        let journal_thread = std::thread::Builder::new()
            .name("store-journal".into())
            .spawn(move || journal::run(files, &journal_rx, &journal_shared, &journal_notifier))
            .map_err(StoreError::backend)?;
        let (sync_control, sync_shared) = (control.clone(), shared.clone());
        std::thread::Builder::new()
            .name("store-sync".into())
            .spawn(move || {
                // Its page writes share the callers' core on a one-core gateway: a batch thread
                // leaves them to run when the callers' thread blocks or its slice ends.
                batch::become_batch_thread();
                if let Err(e) = sync_control.run() {
                    tracing::error!(error = %e, "embedded store checkpoint write failed; the store stops until restarted");
                    sync_shared.break_down();
                }
            })
            .map_err(StoreError::backend)?;
        let (tx, rx) = mpsc::unbounded_channel();
        let commits = Arc::new(AtomicU64::new(0));
        let reserved = Arc::new(reserved::Reserved::default());
        let snapshot = Arc::new(snapshot::Snapshot::default());
        snapshot.publish(&db);
        let recent = Arc::new(recent::Recent::default());
        let writer = writer::Writer::new(
            db.clone(),
            (reserved.clone(), snapshot.clone(), recent.clone()),
            notifier.clone(),
            commits.clone(),
            (shared.clone(), journal_tx, journal_thread),
            (seq, generations),
            (checkpoints, control.clone()),
        );
        std::thread::Builder::new()
            .name("store-writer".into())
            .spawn(move || {
                batch::become_batch_thread();
                writer.run(rx);
            })
            .map_err(StoreError::backend)?;
        Ok(Self {
            db,
            reserved,
            snapshot,
            recent,
            commits,
            journal: shared,
            replayed,
            ops: tx,
            notifier,
            path,
            #[cfg(test)]
            sync: control,
        })
    }

    /// Journal frames replayed when the store was opened: writes acknowledged after the last
    /// checkpoint of a process that did not shut down cleanly.
    #[must_use]
    pub fn replayed_at_open(&self) -> usize {
        self.replayed
    }

    /// Commits so far (each carries a batch of operations).
    #[must_use]
    pub fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    /// Journal fsyncs so far that answered operations waiting for the disk.
    #[must_use]
    pub fn durable_commits(&self) -> u64 {
        self.journal.syncs()
    }

    /// Deletes records expired at `now`, at most one batch; returns how many.
    ///
    /// # Errors
    /// The write transaction failed.
    pub async fn sweep(&self, now: Millis) -> Result<usize, StoreError> {
        let held = self.reserved.sweep(now);
        Ok(held + self.call(|tx| Op::Sweep(now, tx)).await?)
    }

    /// Sweeps in the background every `every` (and straight again while batches come back full)
    /// until the store is dropped.
    pub fn spawn_sweeper(self: &Arc<Self>, every: Duration) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                loop {
                    let Some(store) = weak.upgrade() else { return };
                    match store.sweep(now_millis()).await {
                        Ok(n) if n >= SWEEP_BATCH => tokio::task::yield_now().await,
                        Ok(_) => break,
                        Err(e) => {
                            tracing::warn!(error = %e, "embedded store sweep failed");
                            break;
                        }
                    }
                }
            }
        })
    }

    /// Answers the store's callers from a task on the current runtime instead of from the
    /// store's threads: one wake-up from outside per group of replies instead of one per reply
    /// (see `journal::Shared::answer`). Start it on the runtime the callers run on; if that
    /// runtime ends, the store's threads answer again themselves.
    ///
    /// # Panics
    /// Outside a Tokio runtime.
    pub fn spawn_answerer(&self) -> tokio::task::JoinHandle<()> {
        let (tx, mut rx) = mpsc::unbounded_channel::<Vec<Reply>>();
        self.journal.answer_through(tx);
        let notifier = self.notifier.clone();
        tokio::spawn(async move {
            while let Some(group) = rx.recv().await {
                group.into_iter().for_each(|r| r.send(&notifier));
            }
        })
    }

    async fn call<T>(
        &self,
        op: impl FnOnce(oneshot::Sender<Result<T, StoreError>>) -> Op,
    ) -> Result<T, StoreError> {
        let (tx, rx) = oneshot::channel();
        self.ops.send(op(tx)).map_err(|_| writer_gone())?;
        rx.await.map_err(|_| writer_gone())?
    }

    /// After a failed write the store stops (see `journal::Shared::break_down`): decisions made
    /// in memory stop with it, or a reservation could be granted whose outcome can never be
    /// recorded.
    fn check_running(&self) -> Result<(), StoreError> {
        self.journal.running().map_err(StoreError::backend)
    }

    /// Decides `begin` on the caller's task, under the key's shard lock: from the key's entry in
    /// memory if it has one, else from a redb snapshot. A reservation that may be taken over is
    /// kept in memory only.
    fn decide_begin(&self, key: &str, req: &BeginRequest<'_>) -> Result<Decided, StoreError> {
        let mut shard = self.reserved.lock(key);
        if let Some(entry) = shard.get_mut(key) {
            let (answer, write) = entry.begin(req);
            return Ok(match write {
                Write::Keep => Decided::Now(answer),
                // A takeover of a reservation whose owner's lease ran out.
                Write::Put(record) if req.takeover && entry.state == State::Memory => {
                    entry.record = record;
                    Decided::Now(answer)
                }
                _ => Decided::Writer,
            });
        }
        let mut current = self.lookup(key, req.now)?;
        let (answer, write) = rules::begin_taking(&mut current, req);
        Ok(match write {
            Write::Keep => Decided::Now(answer),
            Write::Put(record) if req.takeover => {
                shard.insert(
                    key.into(),
                    Entry {
                        record,
                        state: State::Memory,
                    },
                );
                match current {
                    None => Decided::Now(answer),
                    Some(dead) => {
                        // Sent under the shard lock: it reaches the writer before any later
                        // write of this key.
                        let (tx, rx) = oneshot::channel();
                        self.ops
                            .send(Op::Forget(key.to_owned(), Box::new(dead), tx))
                            .map_err(|_| writer_gone())?;
                        Decided::Replacing(answer, rx)
                    }
                }
            }
            _ => Decided::Writer,
        })
    }

    /// `key`'s record in redb, as the writer last published it, after its last commit that
    /// changed records (see [`snapshot`]).
    fn read(&self, key: &str) -> Result<Option<Record>, StoreError> {
        self.snapshot.read(&self.db, key)
    }

    /// `key`'s record as [`Self::read`] finds it, from the completed records lately read
    /// ([`recent`]) when it is there and live at `now`.
    fn lookup(&self, key: &str, now: Millis) -> Result<Option<Record>, StoreError> {
        if let Some(record) = self.recent.get(key, now) {
            return Ok(Some(record));
        }
        let before = self.recent.before_read();
        let record = self.read(key)?;
        if let Some(record) = &record {
            self.recent.offer(key, record, now, before);
        }
        Ok(record)
    }
}

fn writer_gone() -> StoreError {
    StoreError::Backend("embedded store writer stopped".into())
}

fn decode(bytes: &[u8]) -> Result<Record, StoreError> {
    match bytes.split_first() {
        Some((&FORMAT, rest)) => postcard::from_bytes(rest).map_err(|e| StoreError::Corrupt(Box::new(e))),
        _ => Err(StoreError::Corrupt("unknown record format".into())),
    }
}

fn encode(rec: &Record) -> Vec<u8> {
    let mut out = vec![FORMAT];
    // Serializing plain structs into a Vec cannot fail.
    out.extend(postcard::to_stdvec(rec).unwrap_or_default());
    out
}

/// How `begin` was decided on the caller's task.
enum Decided {
    Now(Begin),
    /// A reservation in memory replaced a dead record in redb: answer once the writer deleted it,
    /// so it cannot show again when the reservation is gone.
    Replacing(Begin, oneshot::Receiver<Result<bool, StoreError>>),
    /// Only the writer can decide (a durable write).
    Writer,
}

impl Store for EmbeddedStore {
    async fn begin(&self, key: &str, req: &BeginRequest<'_>) -> Result<Begin, StoreError> {
        self.check_running()?;
        loop {
            return match self.decide_begin(key, req)? {
                Decided::Now(answer) => {
                    if matches!(answer, Begin::Replay(_)) {
                        // The outcome it hands over may still be on its way to the disk.
                        self.journal.settle().await.map_err(StoreError::backend)?;
                    }
                    Ok(answer)
                }
                Decided::Replacing(answer, forgotten) => {
                    let forgotten = forgotten.await;
                    if !matches!(forgotten, Ok(Ok(true))) {
                        self.reserved.remove(key, req.token, State::Memory);
                        self.notifier.notify(key);
                    }
                    match forgotten {
                        Ok(Ok(true)) => Ok(answer),
                        // The dead record changed before the writer could delete it: its owner
                        // completed or renewed after its lease ran out, in the moment before a
                        // snapshot showed it. Taking over would run the operation twice; decide
                        // again on what redb holds now (published before this answer).
                        Ok(Ok(false)) => continue,
                        failed => {
                            Err(failed
                                .map_or_else(|_| writer_gone(), |r| r.err().unwrap_or_else(writer_gone)))
                        }
                    }
                }
                Decided::Writer => {
                    // A reservation that may not be taken over must reach the disk: the writer
                    // decides.
                    let owned = OwnedBegin::new(req);
                    self.call(|tx| Op::Begin(key.to_owned(), owned, tx)).await
                }
            };
        }
    }

    async fn complete(
        &self,
        key: &str,
        token: LeaseToken,
        response: &StoredResponse,
        retention_ms: u64,
        now: Millis,
    ) -> Result<(), StoreError> {
        self.check_running()?;
        // The store keeps the response until its commit, which a slow disk can put well past
        // this call: copied here, outside the shard's lock, into bytes of its own.
        let response = response.compacted();
        let decided = {
            let mut shard = self.reserved.lock(key);
            match shard.get_mut(key) {
                Some(entry) if entry.state != State::Durable && entry.token() == Some(token) => {
                    match rules::complete(Some(&entry.record), token, response, retention_ms, now) {
                        Ok(Write::Put(record)) => {
                            // In flight to everyone until the writer's commit shows the outcome.
                            entry.state = State::Completing;
                            Ok(record)
                        }
                        Ok(_) => return Ok(()),
                        Err(fenced) => return Err(fenced.into()),
                    }
                }
                // Another owner's reservation shadows whatever redb holds.
                Some(_) => return Err(rules::Fenced.into()),
                None => Err(response),
            }
        };
        match decided {
            Ok(record) => {
                let recorded = self
                    .call(|reply| Op::Record {
                        key: key.to_owned(),
                        token,
                        record,
                        reply,
                    })
                    .await;
                if recorded.is_err() {
                    // Not recorded: the reservation is its owner's again, to complete later or
                    // release, and its lease counts again (it was held while completing).
                    self.reserved.reopen(key, token);
                }
                recorded
            }
            Err(response) => {
                self.call(|reply| Op::Complete {
                    key: key.to_owned(),
                    token,
                    response,
                    retention_ms,
                    now,
                    reply,
                })
                .await
            }
        }
    }

    async fn release(&self, key: &str, token: LeaseToken) -> Result<(), StoreError> {
        self.check_running()?;
        let released = {
            let mut shard = self.reserved.lock(key);
            match shard.get(key) {
                Some(entry) if entry.state == State::Memory => {
                    match rules::release(Some(&entry.record), token) {
                        Ok(Write::Delete) => {
                            shard.remove(key);
                            Some(Ok(true))
                        }
                        Ok(_) => Some(Ok(false)),
                        Err(fenced) => Some(Err(fenced)),
                    }
                }
                Some(_) => Some(Err(rules::Fenced)),
                None => None,
            }
        };
        match released {
            Some(Ok(woke)) => {
                if woke {
                    self.notifier.notify(key);
                }
                Ok(())
            }
            Some(Err(fenced)) => Err(fenced.into()),
            None => self.call(|tx| Op::Release(key.to_owned(), token, tx)).await,
        }
    }

    async fn renew(&self, key: &str, token: LeaseToken, lease_until: Millis) -> Result<(), StoreError> {
        self.check_running()?;
        let renewed = {
            let mut shard = self.reserved.lock(key);
            match shard.get_mut(key) {
                Some(entry) if entry.state != State::Durable => {
                    Some(match rules::renew(Some(&entry.record), token, lease_until) {
                        Ok(Write::Put(record)) => {
                            entry.record = record;
                            Ok(())
                        }
                        Ok(_) => Ok(()),
                        Err(fenced) => Err(fenced.into()),
                    })
                }
                Some(_) => Some(Err(rules::Fenced.into())),
                None => None,
            }
        };
        match renewed {
            Some(result) => result,
            None => {
                self.call(|tx| Op::Renew(key.to_owned(), token, lease_until, tx))
                    .await
            }
        }
    }

    async fn get(&self, key: &str, now: Millis) -> Result<Option<Record>, StoreError> {
        self.check_running()?;
        let held = self.reserved.lock(key).get(key).map(|e| e.record.clone());
        let record = match held {
            Some(record) => Some(record),
            None => self.lookup(key, now)?,
        };
        let record = record.filter(|r| r.is_live(now));
        if record
            .as_ref()
            .is_some_and(|r| matches!(r.state, RecordState::Completed { .. }))
        {
            self.journal.settle().await.map_err(StoreError::backend)?;
        }
        Ok(record)
    }

    async fn purge(&self, key: &str) -> Result<bool, StoreError> {
        let held = self.reserved.lock(key).remove(key).is_some();
        let stored = self.call(|tx| Op::Purge(key.to_owned(), tx)).await?;
        Ok(held || stored)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.check_running()?;
        self.db.begin_read().map(drop).map_err(StoreError::backend)
    }

    fn notifier(&self) -> &Arc<Notifier> {
        &self.notifier
    }
}
