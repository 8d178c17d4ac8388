//! The embedded store's journal: the durable copy of every write that must survive a crash,
//! appended and fsync'd on a thread of its own.
//!
//! Why a journal in front of redb: a durable redb commit flushes the B-tree pages it touched
//! and holds redb's only write transaction while it does, so every reservation queued behind
//! it waited for the disk too. Here redb commits without an fsync and the writes that need the
//! disk go, as frames, into a preallocated file that is overwritten in place: one sequential
//! write and one `fdatasync` per group, measured at about a fifth of a redb commit's fsync on
//! the benchmark machine, and the writer goes on with the next batch meanwhile. The write
//! bypasses the page cache where the file system allows it (`appender.rs`).
//!
//! Every so often the writer makes a durable redb commit (a checkpoint) that records the
//! sequence number of the last frame it covers, names a random generation and one of the
//! journal's two files, and the journal starts again at offset 0 of that file in that
//! generation. Each checkpoint also names, drawn in advance, the generation the next one will
//! use. Recovery replays, in order, the frames from offset 0 of the named file that
//! belong to the named generation and are numbered above the checkpoint, and stops at the first
//! frame that is torn (bad length or checksum), of another generation, or not numbered above
//! the one before it: everything past that point was never acknowledged.
//!
//! Two files, used in turn, because a checkpoint's fsync is made after its commit, off the
//! writer (`sync.rs`): until it is on disk, a crash recovers from the checkpoint before it,
//! whose frames are in the other file and must stay there. The frames written meanwhile go to
//! the named file, in the generation drawn in advance, numbered on from the last frame of the
//! other; so recovery, at the end of the run it replayed, goes on into the other file if that
//! file starts with a frame of that generation and the very next number. A stale run there
//! cannot pass for it, whatever its numbers (after a power loss that tore a run, recovery
//! restarts the count below frames that may still lie in either file): no frame of a
//! generation is written before the checkpoint that names it as next is committed.
//!
//! Frame layout: `len: u32 | crc32(body): u32 | body`, where body is
//! `generation: u64 | seq: u64 | key_len: u32 | key | value`, and an empty value is a delete
//! (a stored record is never empty: it starts with its format byte).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use idemgate_core::notify::Notifier;
use tokio::sync::{mpsc, watch};

use super::Reply;
use super::appender::Appender;

/// Bytes the journal file is preallocated to (written with zeros once, so that an `fdatasync`
/// after overwriting them has no file size or extent to update). A burst larger than this
/// grows the file; it is never shrunk.
pub(super) const PREALLOCATED: u64 = 8 << 20;
const HEADER: usize = 8;
const BODY_FIXED: usize = 8 + 8 + 4;

/// One journaled write, as recovery reads it back.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Frame {
    pub seq: u64,
    pub key: String,
    /// The encoded record, or `None` for a delete.
    pub value: Option<Vec<u8>>,
}

/// Appends one frame to `out`.
pub(super) fn encode(out: &mut Vec<u8>, generation: u64, seq: u64, key: &str, value: Option<&[u8]>) {
    let value = value.unwrap_or_default();
    let body_len = BODY_FIXED + key.len() + value.len();
    let start = out.len();
    out.reserve(HEADER + body_len);
    // A frame is far below 4 GiB: keys are bounded and stored bodies are capped by the config.
    out.extend_from_slice(&u32::try_from(body_len).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&generation.to_le_bytes());
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&u32::try_from(key.len()).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(value);
    let crc = crc32fast::hash(&out[start + HEADER..]);
    out[start + 4..start + HEADER].copy_from_slice(&crc.to_le_bytes());
}

/// The frames recovery must replay, from the journal's two files: the run of `generation` in
/// `files[file]` (see [`read`]), then, if the other file starts with a frame of `upcoming` (the
/// generation the checkpoint drew for the next one) numbered next, the run there: the frames
/// written after a checkpoint whose disk work was still owed when the process stopped.
pub(super) fn replay(
    files: [&[u8]; 2],
    file: usize,
    checkpoint: u64,
    (generation, upcoming): (u64, Option<u64>),
) -> (Vec<Frame>, u64) {
    let (mut frames, highest) = read(files[file], checkpoint, generation);
    let other = files[1 - file.min(1)];
    match parse(other, 0) {
        Some(next) if Some(next.generation) == upcoming && Some(next.seq) == highest.checked_add(1) => {
            let (more, highest) = read(other, highest, next.generation);
            frames.extend(more);
            (frames, highest)
        }
        _ => (frames, highest),
    }
}

/// The frames recovery must replay: the unbroken run from offset 0 of `generation`, keeping
/// those numbered above `checkpoint`. Also returns the highest sequence number in that run (at
/// least `checkpoint`), so numbering never goes back.
pub(super) fn read(bytes: &[u8], checkpoint: u64, generation: u64) -> (Vec<Frame>, u64) {
    let mut frames = Vec::new();
    let mut at = 0;
    let mut before = None;
    let mut highest = checkpoint;
    while let Some(raw) = parse(bytes, at) {
        if raw.generation != generation || before.is_some_and(|seq| raw.seq <= seq) {
            break;
        }
        let Ok(key) = std::str::from_utf8(raw.key) else {
            break;
        };
        before = Some(raw.seq);
        highest = highest.max(raw.seq);
        at = raw.next;
        if raw.seq > checkpoint {
            frames.push(Frame {
                seq: raw.seq,
                key: key.to_owned(),
                value: (!raw.value.is_empty()).then(|| raw.value.to_vec()),
            });
        }
    }
    (frames, highest)
}

struct Raw<'a> {
    generation: u64,
    seq: u64,
    key: &'a [u8],
    value: &'a [u8],
    next: usize,
}

/// The frame at `at`, if one is there whole and its checksum holds.
fn parse(bytes: &[u8], at: usize) -> Option<Raw<'_>> {
    let u32_at = |i: usize| {
        bytes
            .get(i..i + 4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap_or_default()))
    };
    let u64_at = |b: &[u8], i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
    let len = usize::try_from(u32_at(at)?).ok()?;
    let crc = u32_at(at + 4)?;
    let body = bytes.get(at + HEADER..(at + HEADER).checked_add(len)?)?;
    if len < BODY_FIXED || crc32fast::hash(body) != crc {
        return None;
    }
    let key_len = usize::try_from(u32::from_le_bytes(body[16..20].try_into().ok()?)).ok()?;
    let key = body.get(BODY_FIXED..BODY_FIXED.checked_add(key_len)?)?;
    Some(Raw {
        generation: u64_at(body, 0),
        seq: u64_at(body, 8),
        key,
        value: &body[BODY_FIXED + key_len..],
        next: at + HEADER + len,
    })
}

/// Opens (or creates) one journal file, preallocated with zeros, and returns it with what it
/// holds. The caller makes the directory entries durable ([`sync_dirs`]).
pub(super) fn open(path: &Path) -> io::Result<(File, Vec<u8>)> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)?;
    let mut bytes = Vec::new();
    io::Read::read_to_end(&mut &file, &mut bytes)?;
    let len = bytes.len() as u64;
    if len < PREALLOCATED {
        let zeros = vec![0; usize::try_from(PREALLOCATED - len).unwrap_or_default()];
        file.write_all_at(&zeros, len)?;
        file.sync_all()?;
    }
    Ok((file, bytes))
}

/// Makes `dir`'s entries (the store's files) and `dir`'s own entry in its parent durable, so a
/// power loss cannot take a file with acknowledged frames in it. Done at every open: an open
/// cut short before it got here left them unsynced.
pub(super) fn sync_dirs(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()?;
    match dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(parent) => File::open(parent)?.sync_all(),
        None => Ok(()),
    }
}

/// What the writer thread and the readers share with the journal thread.
pub(super) struct Shared {
    /// The highest sequence number in a redb commit, raised before that commit becomes
    /// visible, so a reader that sees a journaled write also sees a number at least its own.
    written: AtomicU64,
    /// The highest sequence number on disk.
    durable: watch::Sender<u64>,
    /// A commit or an fsync failed, or a thread of the store ended ([`Shared::break_down`]).
    broken: AtomicBool,
    /// Fsyncs that answered someone.
    syncs: AtomicU64,
    /// The task that answers callers on their runtime, if one runs ([`Shared::answer`]).
    answerer: Mutex<Option<mpsc::UnboundedSender<Vec<Reply>>>>,
    /// Whether the journal thread is writing and syncing a group, and its end
    /// ([`Shared::wait_while_syncing`]).
    syncing: Mutex<bool>,
    synced: Condvar,
}

impl Shared {
    pub(super) fn new(start: u64) -> Self {
        Self {
            written: AtomicU64::new(start),
            durable: watch::Sender::new(start),
            broken: AtomicBool::new(false),
            syncs: AtomicU64::new(0),
            answerer: Mutex::new(None),
            syncing: Mutex::new(false),
            synced: Condvar::new(),
        }
    }

    fn set_syncing(&self, on: bool) {
        *self.syncing.lock().unwrap_or_else(PoisonError::into_inner) = on;
        if !on {
            self.synced.notify_all();
        }
    }

    /// Waits, at most `limit`, while the journal thread writes and syncs a group. The writer
    /// calls it before applying a batch: an outcome that arrives meanwhile cannot reach the disk
    /// before the next group anyway, so it may as well join this batch (one commit for more
    /// operations). Returns whether it waited.
    pub(super) fn wait_while_syncing(&self, limit: std::time::Duration) -> bool {
        let syncing = self.syncing.lock().unwrap_or_else(PoisonError::into_inner);
        if !*syncing {
            return false;
        }
        drop(
            self.synced
                .wait_timeout_while(syncing, limit, |on| *on)
                .unwrap_or_else(PoisonError::into_inner),
        );
        true
    }

    /// From now on, groups of replies go to `tx`, whose task answers them on the callers'
    /// runtime (see [`super::EmbeddedStore::spawn_answerer`]).
    pub(super) fn answer_through(&self, tx: mpsc::UnboundedSender<Vec<Reply>>) {
        *self.answerer.lock().unwrap_or_else(PoisonError::into_inner) = Some(tx);
    }

    /// Answers a group of replies. Each caller waits on its runtime; woken from this thread,
    /// each costs that runtime a wake-up from outside (on the current-thread scheduler a write
    /// to its event fd, one system call per reply). Handed to the answerer task, a group costs
    /// one, and the task wakes the callers from inside. Without that task (not started, or its
    /// runtime has ended), the replies go out from here.
    pub(super) fn answer(&self, replies: Vec<Reply>, notifier: &Notifier) {
        if replies.is_empty() {
            return;
        }
        let unsent = {
            let mut answerer = self.answerer.lock().unwrap_or_else(PoisonError::into_inner);
            match answerer.as_ref() {
                Some(tx) => match tx.send(replies) {
                    Ok(()) => return,
                    Err(mpsc::error::SendError(back)) => {
                        *answerer = None;
                        back
                    }
                },
                None => replies,
            }
        };
        unsent.into_iter().for_each(|r| r.send(notifier));
    }

    pub(super) fn wrote(&self, seq: u64) {
        self.written.store(seq, Ordering::Release);
    }

    /// Whether every journaled write visible now is on disk.
    pub(super) fn is_settled(&self) -> bool {
        *self.durable.borrow() >= self.written.load(Ordering::Acquire)
    }

    pub(super) fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    /// The store's one answer once it has stopped.
    pub(super) fn running(&self) -> io::Result<()> {
        if self.is_broken() {
            return Err(io::Error::other(
                "embedded store stopped after a failed write; restart to recover",
            ));
        }
        Ok(())
    }

    pub(super) fn syncs(&self) -> u64 {
        self.syncs.load(Ordering::Relaxed)
    }

    /// Stops the store: nothing more is written or handed out as durable until a restart
    /// replays the journal, and readers waiting in [`Shared::settle`] get an error.
    pub(super) fn break_down(&self) {
        self.broken.store(true, Ordering::Release);
        self.durable.send_modify(|_| {});
    }

    /// Waits until every journaled write visible now is on disk, so that what a reader is
    /// about to hand out (a replay) cannot be undone by a crash.
    pub(super) async fn settle(&self) -> io::Result<()> {
        let target = self.written.load(Ordering::Acquire);
        if *self.durable.borrow() < target {
            let mut rx = self.durable.subscribe();
            // The sender lives in `self`, so the channel cannot close while we wait.
            let _ = rx.wait_for(|d| *d >= target || self.is_broken()).await;
        }
        self.running()
    }
}

/// Stops the store when the thread holding it ends, normally or by a panic, so nobody waits in
/// [`Shared::settle`] for a write that will never be made durable.
pub(super) struct BreakOnExit(pub Arc<Shared>);

impl Drop for BreakOnExit {
    fn drop(&mut self) {
        self.0.break_down();
    }
}

/// The most frame bytes one fsync covers, so a steady stream cannot put the fsync off.
const GROUP_BYTES: usize = 4 << 20;

/// From the writer thread to the journal thread, in commit order.
pub(super) enum Msg {
    /// Frames to append (possibly none), the highest sequence number handed out so far, and
    /// the replies to send once everything up to it is on disk.
    Append {
        frames: Vec<u8>,
        last_seq: u64,
        replies: Vec<Reply>,
    },
    /// A checkpoint covers every frame so far: the next frame goes to offset 0 of this file.
    Wrap(usize),
}

/// The journal thread: writes whatever is queued, one `fdatasync` for all of it (group
/// commit), then answers the replies that waited for it.
/// It starts at offset 0 of `files[0]`, the file the checkpoint at open named.
pub(super) fn run(
    mut files: [Appender; 2],
    rx: &std::sync::mpsc::Receiver<Msg>,
    shared: &Arc<Shared>,
    notifier: &Notifier,
) {
    let _stop = BreakOnExit(shared.clone());
    let mut file = 0;
    while let Ok(first) = rx.recv() {
        shared.set_syncing(true);
        let mut replies = Vec::new();
        let mut last = None;
        let mut wrote = [false; 2];
        let mut result = shared.running();
        let mut grouped = 0;
        let mut next = Some(first);
        while let Some(msg) = next.take() {
            match msg {
                Msg::Append {
                    frames,
                    last_seq,
                    replies: r,
                } => {
                    if !frames.is_empty() && result.is_ok() {
                        result = files[file].append(&frames);
                        grouped += frames.len();
                        wrote[file] = true;
                    }
                    last = Some(last_seq);
                    replies.extend(r);
                }
                Msg::Wrap(to) => {
                    // What was gathered for the file left is written before the next file's.
                    if result.is_ok() {
                        result = files[file].flush();
                    }
                    file = to.min(1);
                    files[file].restart();
                }
            }
            if grouped < GROUP_BYTES {
                next = rx.try_recv().ok();
            }
        }
        // A group across a wrap syncs the file it left first: frames in the new file are
        // replayed only after every frame before them (`replay`), and none is acknowledged
        // before both syncs.
        for i in [1 - file, file] {
            if wrote[i] && result.is_ok() {
                result = files[i].sync();
            }
        }
        match result {
            Ok(()) => {
                if wrote.contains(&true) {
                    shared.syncs.fetch_add(1, Ordering::Relaxed);
                }
                if let Some(last) = last {
                    shared.durable.send_if_modified(|d| {
                        let raised = last > *d;
                        *d = (*d).max(last);
                        raised
                    });
                }
                shared.answer(replies, notifier);
            }
            Err(e) => {
                tracing::error!(error = %e, "embedded store journal write failed; the store stops until restarted");
                shared.break_down();
                let msg = format!("journal write failed: {e}");
                replies.into_iter().for_each(|r| r.fail(&msg));
            }
        }
        shared.set_syncing(false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(generation: u64, seqs: std::ops::RangeInclusive<u64>) -> Vec<u8> {
        let mut out = Vec::new();
        for seq in seqs {
            let value = format!("v{seq}");
            let value = (seq % 5 != 0).then_some(value.as_bytes());
            encode(&mut out, generation, seq, &format!("k{seq}"), value);
        }
        out
    }

    fn seqs(bytes: &[u8], checkpoint: u64, generation: u64) -> (Vec<u64>, u64) {
        let (frames, highest) = read(bytes, checkpoint, generation);
        (frames.iter().map(|f| f.seq).collect(), highest)
    }

    /// The writer's pacing: no wait while the journal is idle, a wait that ends when the group
    /// it waits on is synced, and one that gives up at its limit.
    #[test]
    fn the_writer_waits_for_the_group_being_synced_and_no_longer() {
        use std::time::{Duration, Instant};
        let shared = Arc::new(Shared::new(0));
        assert!(
            !shared.wait_while_syncing(Duration::from_secs(5)),
            "idle: no wait"
        );
        shared.set_syncing(true);
        let syncing = shared.clone();
        let ends = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            syncing.set_syncing(false);
        });
        let started = Instant::now();
        assert!(shared.wait_while_syncing(Duration::from_secs(5)));
        let waited = started.elapsed();
        ends.join().unwrap();
        assert!(
            waited >= Duration::from_millis(40) && waited < Duration::from_secs(4),
            "woken when the group was synced, not at the limit: {waited:?}"
        );
        shared.set_syncing(true);
        let started = Instant::now();
        assert!(shared.wait_while_syncing(Duration::from_millis(30)));
        assert!(
            started.elapsed() >= Duration::from_millis(30),
            "a stuck fsync holds nobody past the limit"
        );
    }

    #[test]
    fn frames_read_back_in_order_and_past_the_checkpoint_only() {
        let mut bytes = frames(7, 1..=10);
        bytes.resize(bytes.len() + 4096, 0);
        let (frames, highest) = read(&bytes, 0, 7);
        assert_eq!(frames.len(), 10);
        assert_eq!(
            frames[2],
            Frame {
                seq: 3,
                key: "k3".into(),
                value: Some(b"v3".to_vec())
            }
        );
        assert_eq!(frames[4].value, None, "an empty value is a delete");
        assert_eq!(highest, 10);
        assert_eq!(seqs(&bytes, 6, 7), ((7..=10).collect(), 10));
        assert_eq!(seqs(&bytes, 12, 7), (vec![], 12), "numbering never goes back");
    }

    #[test]
    fn a_torn_or_corrupt_frame_ends_the_journal() {
        let whole = frames(7, 1..=10);
        let torn = &whole[..whole.len() - 3];
        assert_eq!(seqs(torn, 0, 7).0, (1..=9).collect::<Vec<_>>());
        let mut flipped = whole.clone();
        let third = frames(7, 1..=2).len() + HEADER + 10;
        flipped[third] ^= 1;
        assert_eq!(seqs(&flipped, 0, 7).0, vec![1, 2]);
        assert_eq!(seqs(&[0; 64], 0, 7), (vec![], 0), "zeros hold nothing");
        assert_eq!(
            seqs(&frames(5, 1..=3), 0, 7),
            (vec![], 0),
            "a generation the checkpoint does not name (a journal beside another database file)"
        );
    }

    fn replayed(files: [&[u8]; 2], file: usize, checkpoint: u64, generation: u64) -> (Vec<u64>, u64) {
        // Each test checkpoint drew the next generation, 2 after 1 and 3 after 2.
        let (frames, highest) = replay(files, file, checkpoint, (generation, Some(generation + 1)));
        (frames.iter().map(|f| f.seq).collect(), highest)
    }

    /// A checkpoint at 20 named generation 2 in file 1, and its fsync was still owed when the
    /// process stopped: redb comes back with the checkpoint before it (10, generation 1, file
    /// 0), and the frames written since went to file 1.
    #[test]
    fn recovery_goes_on_into_the_other_file_from_the_next_number_only() {
        let old = frames(1, 1..=20);
        let new = frames(2, 21..=25);
        assert_eq!(
            replayed([&old, &new], 0, 10, 1),
            ((11..=25).collect(), 25),
            "the owed checkpoint never reached the disk: both files"
        );
        assert_eq!(
            replayed([&old, &new], 1, 20, 2),
            ((21..=25).collect(), 25),
            "it did: file 1 alone"
        );
        // File 0 torn before 20: frames 21.. were never acknowledged (a group across a wrap is
        // acknowledged after both files' syncs), and do not follow on.
        let torn = &old[..frames(1, 1..=15).len() + 3];
        assert_eq!(replayed([torn, &new], 0, 10, 1), ((11..=15).collect(), 15));
        // A stale run in the other file is not followed: an older generation and lower numbers,
        // or the next number in a generation the checkpoint did not draw (numbering restarted
        // below it after a power loss tore a run).
        let stale = frames(7, 3..=9);
        assert_eq!(replayed([&old, &stale], 0, 10, 1), ((11..=20).collect(), 20));
        let stale = frames(7, 21..=23);
        assert_eq!(replayed([&old, &stale], 0, 10, 1), ((11..=20).collect(), 20));
        assert_eq!(
            replay([&old, &new], 0, 10, (1, None)).1,
            20,
            "a checkpoint that drew none (written before the second file) follows none"
        );
        assert_eq!(replayed([&new, &old], 0, 20, 2), ((21..=25).collect(), 25));
        // Nothing after the checkpoint in its own file: the other file follows on from it.
        assert_eq!(replayed([&[0; 64], &new], 0, 20, 1), ((21..=25).collect(), 25));
        assert_eq!(replayed([&[0; 64], &[0; 64]], 0, 20, 1), (vec![], 20));
    }

    #[test]
    fn after_a_wrap_the_older_generation_behind_the_new_one_is_ignored() {
        // Generation 1 wrote 1..=20; a checkpoint at 20, then generation 2 overwrote the start.
        let mut bytes = frames(1, 1..=20);
        let newer = frames(2, 21..=23);
        bytes[..newer.len()].copy_from_slice(&newer);
        assert_eq!(seqs(&bytes, 20, 2), ((21..=23).collect(), 23));
        // A crash before any new frame reached offset 0: only frames the checkpoint covers.
        assert_eq!(seqs(&frames(1, 1..=20), 20, 2), (vec![], 20));
        // A frame of the same generation numbered at or below the one before ends the run (a
        // stale frame from before a restart that reused the offset).
        let mut stale = frames(2, 21..=23);
        stale.extend(frames(2, 22..=22));
        assert_eq!(seqs(&stale, 20, 2).0, vec![21, 22, 23]);
        // A frame of another generation ends it too, whatever its number.
        let mut other = frames(2, 21..=23);
        other.extend(frames(3, 24..=24));
        assert_eq!(seqs(&other, 20, 2).0, vec![21, 22, 23]);
    }
}
