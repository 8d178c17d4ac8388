//! redb's file, with the disk work of a checkpoint taken off the writer thread.
//!
//! A checkpoint is a durable redb commit: redb writes every page the batches since the last one
//! dirtied (about 250 `pwrite`s at 13k misses/s), then fsyncs them. On the benchmark machine
//! that held the writer 3.5 to 3.9 ms (median) every 100 ms, and every outcome arriving
//! meanwhile waited: most of the embedded store's tail. Nothing but the journal needs that done
//! at once: a journal file may be written over only once the checkpoint that covers its frames
//! is on disk. So the writer's periodic checkpoints commit with their disk work *owed*:
//! [`Backend::write`] keeps the pages in memory, [`Backend::sync_data`] skips the fsync, and
//! [`Control::deferring`] records both as owed; the sync thread writes the pages and makes the
//! fsync while the writer goes on and the journal writes the new generation to its other file
//! (`journal.rs`), leaving the frames the previous checkpoint still needs alone. Reads see the
//! kept pages.
//!
//! What keeps a crash before the owed work is done safe:
//! - redb commits in one phase with checksums, so a commit whose pages or fsync never reached
//!   the disk is detected at open and the one before it is used: the same state as a crash in
//!   the middle of redb's own fsync, only possible for longer.
//! - Nothing the previous durable commit uses is overwritten before the owed work is done:
//!   every other write to the file (and every change of its length) first settles it
//!   ([`Control::settle`]). redb keeps the pages of the commits between checkpoints in its own
//!   write buffer, so this normally costs nothing: the next write is the next checkpoint's.
//! - The writer settles before each checkpoint, so at most one checkpoint is ever owed, and
//!   the journal file that the one before it needs is reused only once that one is on disk.
//! - A checkpoint that makes the file shorter owes the cut too ([`Backend::set_len`]): redb
//!   cuts right after a durable commit's fsync, and its open takes a file shorter than an
//!   unclean header's layout as the layout, so a cut made before the header naming it is on
//!   disk loses pages the commit before still uses.

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::ops::Bound;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use redb::backends::FileBackend;
use redb::{BackendError, StorageBackend};

/// Pages the sync thread writes between two yields of its core.
const PAGES_PER_YIELD: usize = 16;

/// The owed checkpoint, shared by redb's backend, the writer and the sync thread.
#[derive(Debug)]
pub(super) struct Control {
    file: FileBackend,
    /// Set by the writer around a checkpoint whose disk work may be owed; changed under the
    /// `pages` lock, so a write either joins the kept pages or comes after them.
    defer: AtomicBool,
    state: Mutex<State>,
    changed: Condvar,
    /// Pages of the owed checkpoint, by offset, until the sync thread has written them.
    pages: Mutex<Pages>,
    /// Whether `pages` holds any, so a read normally skips its lock.
    has_pages: AtomicBool,
    /// Set by a test: the sync thread leaves owed work alone (a writer still does it).
    #[cfg(test)]
    held: AtomicBool,
}

#[derive(Debug, Default)]
struct State {
    owed: bool,
    syncing: bool,
    stopped: bool,
    /// A failed write or fsync: nothing written since can be trusted to be durable.
    failed: Option<String>,
}

#[derive(Debug, Default)]
struct Pages {
    /// What the owed checkpoint wrote up to its (skipped) fsync, by offset.
    by_offset: BTreeMap<u64, Box<[u8]>>,
    /// What was written after that fsync while the deferral lasted: redb's work after a commit,
    /// which may reuse pages the commit before still names, trusting the fsync to be made. Written
    /// only once it is.
    after_sync: BTreeMap<u64, Box<[u8]>>,
    /// The deferral's commit has called its fsync: later writes go to `after_sync`.
    synced: bool,
    /// The deferral grew the file: redb makes a growth durable before a header can name it, so
    /// the owed work starts with an fsync.
    grew: bool,
    /// The longest kept write, so a read knows how far back one may start and still reach it.
    longest: u64,
    /// The length the owed checkpoint cut the file to, made once its pages and fsync are: the
    /// file's length as redb sees it until then.
    cut_to: Option<u64>,
}

impl Pages {
    fn kept(&mut self, after_sync: bool) -> &mut BTreeMap<u64, Box<[u8]>> {
        if after_sync {
            &mut self.after_sync
        } else {
            &mut self.by_offset
        }
    }

    fn is_empty(&self) -> bool {
        self.by_offset.is_empty() && self.after_sync.is_empty()
    }
}

impl Control {
    pub(super) fn new(file: File) -> Result<Arc<Self>, redb::DatabaseError> {
        Ok(Arc::new(Self {
            file: FileBackend::new(file)?,
            defer: AtomicBool::new(false),
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            pages: Mutex::new(Pages::default()),
            has_pages: AtomicBool::new(false),
            #[cfg(test)]
            held: AtomicBool::new(false),
        }))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn pages(&self) -> MutexGuard<'_, Pages> {
        self.pages.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `commit` with its page writes and fsync owed instead of made; the sync thread makes
    /// them. The caller has settled any earlier owed work ([`Control::settle`]).
    pub(super) fn deferring<T>(&self, commit: impl FnOnce() -> T) -> T {
        /// Ends the deferral however `commit` ends (a panic included), so no later write is
        /// kept or sync skipped.
        struct End<'a>(&'a Control);
        impl Drop for End<'_> {
            fn drop(&mut self) {
                let control = self.0;
                let kept = {
                    let pages = control.pages();
                    control.defer.store(false, Ordering::Release);
                    control.has_pages.load(Ordering::Acquire) || pages.cut_to.is_some()
                };
                // A commit that failed before its fsync leaves pages but owes nothing: still
                // written out (and synced) before anything else touches the file.
                if kept {
                    control.lock().owed = true;
                    control.changed.notify_all();
                }
            }
        }
        {
            let mut pages = self.pages();
            pages.synced = false;
            pages.grew = false;
            self.defer.store(true, Ordering::Release);
        }
        let _end = End(self);
        commit()
    }

    /// Returns once nothing is owed: does the work here if the sync thread has not started
    /// it, else waits for the sync thread's.
    pub(super) fn settle(&self) -> io::Result<()> {
        let mut state = self.lock();
        loop {
            if let Some(e) = &state.failed {
                return Err(io::Error::other(format!(
                    "an earlier checkpoint write failed: {e}"
                )));
            }
            if state.syncing {
                state = self.changed.wait(state).unwrap_or_else(PoisonError::into_inner);
            } else if state.owed {
                state = self.sync(state);
            } else {
                return Ok(());
            }
        }
    }

    /// Writes the kept pages and makes the fsync, the state lock released meanwhile. The pages
    /// stay readable until they are in the file.
    fn sync<'a>(&'a self, mut state: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        state.owed = false;
        state.syncing = true;
        drop(state);
        // redb's order: a growth durable before the header naming it, the commit's pages and
        // header, its fsync, the cut it makes after that, then what it wrote after the fsync.
        let grew = std::mem::take(&mut self.pages().grew);
        let result = (if grew { self.file.sync_data() } else { Ok(()) })
            .and_then(|()| self.write_pages(false))
            .and_then(|()| self.file.sync_data())
            .and_then(|()| self.cut())
            .and_then(|()| self.write_pages(true));
        let mut state = self.lock();
        state.syncing = false;
        if let Err(e) = result {
            state.failed = Some(e.to_string());
        }
        // None are added while work is owed (the writer settles before each checkpoint); were
        // one ever left, it stays owed rather than be read over newer data.
        if self.has_pages.load(Ordering::Acquire) || self.pages().cut_to.is_some() {
            state.owed = true;
        }
        self.changed.notify_all();
        state
    }

    /// Writes the kept pages of before the commit's fsync, or of after it.
    fn write_pages(&self, after_sync: bool) -> io::Result<()> {
        if !self.has_pages.load(Ordering::Acquire) {
            return Ok(());
        }
        // Pages are added only while `defer` is set, which ends (under the `pages` lock)
        // before they are owed, and only this (under `syncing`) removes them; so the lock is
        // taken per page: a read waits for one `pwrite` at most.
        let offsets: Vec<u64> = self.pages().kept(after_sync).keys().copied().collect();
        for (i, &offset) in offsets.iter().enumerate() {
            {
                let mut pages = self.pages();
                if let Some(page) = pages.kept(after_sync).get(&offset) {
                    self.file.write(offset, page)?;
                }
            }
            // On a one-core gateway these writes (about 1.5 ms of CPU per checkpoint at 26k
            // misses/s) share the core with the requests: in one run they held them that long.
            // Yielding every few pages lets the requests in between (closed-loop p99 2.5-3.4 ms
            // against 3.9-4.3 ms, docs/benchmarks.md).
            if i % PAGES_PER_YIELD == PAGES_PER_YIELD - 1 {
                std::thread::yield_now();
            }
        }
        let mut pages = self.pages();
        let kept = pages.kept(after_sync);
        for offset in &offsets {
            kept.remove(offset);
        }
        if pages.is_empty() {
            pages.longest = 0;
            self.has_pages.store(false, Ordering::Release);
        }
        Ok(())
    }

    /// Makes the owed cut, after the fsync of the header that names the shorter file: redb's
    /// own order (its commit resizes after its flush), which its open relies on (a file found
    /// shorter than an unclean header's layout is taken as the layout, and a durable commit's
    /// pages past it are gone).
    fn cut(&self) -> io::Result<()> {
        let mut pages = self.pages();
        if let Some(len) = pages.cut_to {
            self.file.set_len(len)?;
            pages.cut_to = None;
        }
        Ok(())
    }

    /// The sync thread: does each owed checkpoint's disk work as soon as it is owed, until
    /// [`Control::stop`]. Returns the error of a failed write or fsync, after which the store
    /// must stop.
    pub(super) fn run(&self) -> Result<(), String> {
        let mut state = self.lock();
        loop {
            if let Some(e) = &state.failed {
                return Err(e.clone());
            }
            if state.owed && !state.syncing && !self.is_held() {
                state = self.sync(state);
            } else if state.stopped {
                return Ok(());
            } else {
                state = self.changed.wait(state).unwrap_or_else(PoisonError::into_inner);
            }
        }
    }

    /// Ends [`Control::run`] once nothing is owed.
    pub(super) fn stop(&self) {
        self.lock().stopped = true;
        self.changed.notify_all();
    }

    fn is_held(&self) -> bool {
        #[cfg(test)]
        return self.held.load(Ordering::Acquire);
        #[cfg(not(test))]
        false
    }

    /// Holds (or lets go) the sync thread, for tests.
    #[cfg(test)]
    pub(super) fn hold(&self, on: bool) {
        self.held.store(on, Ordering::Release);
        let _state = self.lock();
        self.changed.notify_all();
    }

    /// Whether a checkpoint's disk work is owed or under way (for tests).
    #[cfg(test)]
    pub(super) fn is_owed(&self) -> bool {
        let state = self.lock();
        state.owed || state.syncing
    }
}

/// redb's storage: its file backend, with writes and syncs going through [`Control`].
#[derive(Debug)]
pub(super) struct Backend(pub Arc<Control>);

impl StorageBackend for Backend {
    fn len(&self) -> Result<u64, io::Error> {
        if let Some(len) = self.0.pages().cut_to {
            return Ok(len);
        }
        self.0.file.len()
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), io::Error> {
        if !self.0.has_pages.load(Ordering::Acquire) {
            return self.0.file.read(offset, out);
        }
        // Under the lock, so the sync thread cannot write a kept page and drop it between this
        // read of the file and the look at the kept pages.
        let pages = self.0.pages();
        self.0.file.read(offset, out)?;
        let end = offset + out.len() as u64;
        let from = offset.saturating_sub(pages.longest);
        // What was written after the commit's fsync is newer: laid over the rest.
        let kept = pages.by_offset.range(from..end);
        for (&at, page) in kept.chain(pages.after_sync.range(from..end)) {
            let (start, stop) = (at.max(offset), (at + page.len() as u64).min(end));
            if start < stop {
                let (src, dst) = ((start - at) as usize, (start - offset) as usize);
                let n = (stop - start) as usize;
                out[dst..dst + n].copy_from_slice(&page[src..src + n]);
            }
        }
        Ok(())
    }

    fn set_len(&self, len: u64) -> Result<(), io::Error> {
        {
            let mut pages = self.0.pages();
            if self.0.defer.load(Ordering::Acquire) {
                // redb cuts its file right after a durable commit's fsync. Here that fsync is
                // owed and the header naming the shorter file is still in memory: cut now, a
                // crash would find the file ending before pages the last durable commit uses.
                // So the cut is owed too; growing the file now is harmless (redb does it before
                // its commits).
                if len < self.0.file.len()? {
                    pages.cut_to = Some(len);
                    return Ok(());
                }
                pages.cut_to = None;
                pages.grew = true;
                return self.0.file.set_len(len);
            }
        }
        self.0.settle()?;
        self.0.file.set_len(len)
    }

    fn sync_data(&self) -> Result<(), io::Error> {
        {
            let mut pages = self.0.pages();
            if self.0.defer.load(Ordering::Acquire) {
                // Owed: `Control::deferring` marks it so once the commit returns. Everything
                // written so far goes before it (a second fsync, a growth's then the commit's,
                // moves the writes between them in front too).
                let after = std::mem::take(&mut pages.after_sync);
                pages.by_offset.extend(after);
                pages.synced = true;
                return Ok(());
            }
        }
        self.0.settle()?;
        self.0.file.sync_data()
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), io::Error> {
        // Under the lock `defer` changes under: redb's readers write buffered pages back under
        // cache pressure, on their own threads, at any moment of a checkpoint.
        {
            let mut pages = self.0.pages();
            if self.0.defer.load(Ordering::Acquire) {
                pages.longest = pages.longest.max(data.len() as u64);
                let after_sync = pages.synced;
                pages.kept(after_sync).insert(offset, data.into());
                self.0.has_pages.store(true, Ordering::Release);
                return Ok(());
            }
        }
        // Outside a checkpoint: after the owed work, so nothing the last durable commit uses
        // is overwritten before that commit is on disk. A reader's write-back can land here and
        // wait for (or do) that work; redb does that only when its cache is full.
        self.0.settle()?;
        self.0.file.write(offset, data)
    }

    fn close(&self) -> Result<(), io::Error> {
        let settled = self.0.settle();
        let closed = self.0.file.close();
        settled.and(closed)
    }

    fn try_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.0.file.try_lock_range(start, end)
    }

    fn try_lock_shared_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.0.file.try_lock_shared_range(start, end)
    }

    fn lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.0.file.lock_range(start, end)
    }

    fn lock_shared_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.0.file.lock_shared_range(start, end)
    }

    fn unlock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.0.file.unlock_range(start, end)
    }

    fn query_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.0.file.query_lock_range(start, end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(path: &std::path::Path) -> File {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .unwrap()
    }

    /// Pages written while a checkpoint's disk work is owed are read back from memory, over
    /// whatever the file holds, until the work is done; then from the file.
    #[test]
    fn kept_pages_are_read_over_the_file_until_written() {
        let dir = tempfile::tempdir().unwrap();
        let control = Control::new(open(&dir.path().join("f"))).unwrap();
        let backend = Backend(control.clone());
        backend.set_len(5 * 4096).unwrap();
        backend.write(0, &[9; 5 * 4096]).unwrap();
        let read = |offset: u64, len: usize| {
            let mut out = vec![0; len];
            backend.read(offset, &mut out).unwrap();
            out
        };
        control.hold(true);
        control.deferring(|| {
            backend.write(4096, &[1; 4096]).unwrap();
            backend.write(3 * 4096, &[2; 8192]).unwrap();
            backend.sync_data().unwrap();
        });
        assert!(control.is_owed());
        let expected = |offset: usize, len: usize| -> Vec<u8> {
            (offset..offset + len)
                .map(|i| match i / 4096 {
                    1 => 1,
                    3 | 4 => 2,
                    _ => 9,
                })
                .collect()
        };
        for (offset, len) in [
            (0, 5 * 4096),
            (4000, 200),
            (4096, 4096),
            (8000, 8192),
            (4 * 4096 + 7, 9),
        ] {
            assert_eq!(
                read(offset as u64, len),
                expected(offset, len),
                "at {offset}+{len}"
            );
        }
        // A write outside a checkpoint first does the owed work, so it lands after it.
        backend.write(3 * 4096, &[3; 4096]).unwrap();
        assert!(!control.is_owed());
        let mut on_disk = vec![0; 5 * 4096];
        std::os::unix::fs::FileExt::read_exact_at(
            &File::open(dir.path().join("f")).unwrap(),
            &mut on_disk,
            0,
        )
        .unwrap();
        let mut want = expected(0, 5 * 4096);
        want[3 * 4096..4 * 4096].fill(3);
        assert_eq!(on_disk, want);
        assert_eq!(read(0, 5 * 4096), want);
    }

    /// What a deferred commit writes after its (skipped) fsync, redb's work after a commit, is
    /// kept apart and written after the fsync; a second fsync (a growth's, then the commit's)
    /// puts what came before it in front. Reads see the newest bytes throughout.
    #[test]
    fn writes_after_the_owed_fsync_are_kept_apart() {
        let dir = tempfile::tempdir().unwrap();
        let control = Control::new(open(&dir.path().join("f"))).unwrap();
        let backend = Backend(control.clone());
        backend.set_len(4 * 4096).unwrap();
        backend.write(0, &[9; 4 * 4096]).unwrap();
        control.deferring(|| {
            backend.set_len(5 * 4096).unwrap();
            backend.write(0, &[1; 4096]).unwrap();
            backend.sync_data().unwrap(); // the growth's
            backend.write(4096, &[2; 4096]).unwrap();
            backend.sync_data().unwrap(); // the commit's
            backend.write(2 * 4096, &[3; 4096]).unwrap();
            backend.write(4096, &[4; 4096]).unwrap();
        });
        {
            let pages = control.pages();
            assert!(pages.grew);
            assert_eq!(pages.by_offset.keys().copied().collect::<Vec<_>>(), [0, 4096]);
            assert_eq!(
                pages.after_sync.keys().copied().collect::<Vec<_>>(),
                [4096, 2 * 4096]
            );
        }
        let want: Vec<u8> = [1, 4, 3, 9, 0].iter().flat_map(|b| [*b; 4096]).collect();
        let mut seen = vec![0; 5 * 4096];
        backend.read(0, &mut seen).unwrap();
        assert_eq!(seen, want);
        control.settle().unwrap();
        assert!(!control.is_owed());
        let on_disk = std::fs::read(dir.path().join("f")).unwrap();
        assert_eq!(on_disk, want);
        let pages = control.pages();
        assert!(pages.is_empty() && !pages.grew);
    }

    /// A checkpoint whose commit makes redb's file shorter leaves the cut owed with its pages:
    /// until they and their fsync are made, the file keeps the length the last durable commit's
    /// header names, so a crash meanwhile opens at that commit. (Cut at once, the copy below
    /// failed to open: its layout is rebuilt from the shorter length, and the last durable
    /// commit's pages past it were gone; the checker's kill test met it as "Page ... extends
    /// past the end of its region".)
    #[test]
    fn a_checkpoint_that_shortens_the_file_leaves_it_whole_until_its_work_is_done() {
        type Table<'t> = redb::Table<'t, u64, &'static [u8]>;
        const T: redb::TableDefinition<u64, &[u8]> = redb::TableDefinition::new("t");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("records.redb");
        let control = Control::new(open(&path)).unwrap();
        let db = redb::Builder::new()
            .create_with_backend(Backend(control.clone()))
            .unwrap();
        let commit = |change: &dyn Fn(&mut Table)| {
            let txn = db.begin_write().unwrap();
            change(&mut txn.open_table(T).unwrap());
            txn.commit().unwrap();
        };
        let quick = |change: &dyn Fn(&mut Table)| {
            let mut txn = db.begin_write().unwrap();
            txn.set_durability(redb::Durability::None).unwrap();
            change(&mut txn.open_table(T).unwrap());
            txn.commit().unwrap();
        };
        let insert = |keys: std::ops::Range<u64>| {
            quick(&|t| {
                for i in keys.clone() {
                    t.insert(i, [7; 1000].as_slice()).unwrap();
                }
            });
        };
        let remove = |keys: std::ops::Range<u64>| {
            quick(&|t| {
                for i in keys.clone() {
                    t.remove(i).unwrap();
                }
            });
        };
        // Records at the end of the file (behind others, removed first), deleted after the last
        // durable commit: a later durable commit frees their pages and gives the space back,
        // while the commit before it still names those pages.
        insert(1000..3000);
        insert(10_000..14_000);
        for _ in 0..3 {
            commit(&|t| {
                t.insert(u64::MAX, b"durable".as_slice()).unwrap();
            });
        }
        remove(1000..3000);
        for _ in 0..3 {
            commit(&|t| {
                t.insert(u64::MAX, b"durable".as_slice()).unwrap();
            });
        }
        remove(10_000..14_000);
        let physical = || std::fs::metadata(&path).unwrap().len();
        let mut owed_cut = None;
        for round in 0..50 {
            // As the writer does before each checkpoint.
            control.settle().unwrap();
            let before = physical();
            control.deferring(|| {
                commit(&|t| {
                    t.insert(round, b"owed".as_slice()).unwrap();
                });
            });
            let len = Backend(control.clone()).len().unwrap();
            if len < before {
                owed_cut = Some((round, before, len));
                break;
            }
        }
        let (round, before, len) = owed_cut.expect("no checkpoint made the file shorter");
        assert!(control.is_owed());

        // What a crash now leaves: the file as it is on disk.
        let crashed = dir.path().join("crashed.redb");
        std::fs::copy(&path, &crashed).unwrap();
        let reopened = redb::Database::open(&crashed).expect("the crashed copy opens");
        let txn = redb::ReadableDatabase::begin_read(&reopened).unwrap();
        let t = txn.open_table(T).unwrap();
        assert_eq!(t.get(u64::MAX).unwrap().unwrap().value(), b"durable");
        // The owed checkpoint itself never reached the disk; the one before it did.
        assert!(t.get(round).unwrap().is_none());
        if round > 0 {
            assert_eq!(t.get(round - 1).unwrap().unwrap().value(), b"owed");
        }
        drop((t, txn, reopened));
        assert_eq!(
            physical(),
            before,
            "the cut was made before the checkpoint's fsync"
        );

        control.settle().unwrap();
        assert_eq!(physical(), len, "the owed cut is made with the rest of the work");
        assert_eq!(Backend(control.clone()).len().unwrap(), len);
        drop(db);
    }
}
