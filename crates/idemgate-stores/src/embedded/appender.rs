//! How the journal thread writes one journal file: past the page cache (`O_DIRECT`) where the
//! file system takes it, else through it.
//!
//! Through the page cache, every group of frames cost the journal thread a copy into the cache
//! and the file system's buffered-write bookkeeping, and then its `fdatasync` looked up the dirty
//! pages, mapped them to blocks and submitted them: most of the thread's CPU, which shares the
//! callers' core on a small gateway (docs/benchmarks-journal.md, 2026-11-28, before noon). Written
//! directly, a group is one block-aligned write from this buffer, and the `fdatasync` after it
//! has no dirty pages to look up and write back: what is left is the disk's cache flush and
//! whatever metadata the file system writes (ext4 without a journal writes the inode whose time
//! the write moved; a write past the end of the file, its size).
//!
//! A direct write starts and ends on a block boundary, from an aligned buffer, and frames end
//! anywhere. So the buffer keeps the frames of the last, partly filled block, and the next group
//! is written from that block's start: those frames go to the disk again with the same bytes, as
//! the page cache's writeback of that page did. The rest of the last block is written as zeros,
//! where the page cache wrote whatever the page held (zeros, or frames of an older generation);
//! recovery stops at either (a frame of length 0; one of another generation, or torn), and the
//! next group overwrites it. The bytes up to the last frame are the same as before, so recovery
//! (`journal::replay`) is unchanged.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// The alignment of direct writes: the logical block size of nearly every disk. A file system
/// or disk that needs more refuses the probe write at open, and the file is written through the
/// page cache.
const BLOCK: usize = 4096;

/// What the journal thread writes one journal file with.
pub(super) struct Appender {
    file: File,
    /// The offset the next frame goes to.
    end: u64,
    /// `None` where direct writes are not available: frames go through the page cache.
    direct: Option<Direct>,
}

impl Appender {
    /// `file` is the journal file as `journal::open` opened it (preallocated); `path` opens it
    /// again for direct writes.
    pub(super) fn new(file: File, path: &Path) -> Self {
        let direct = match Direct::open(path, &file) {
            Ok(d) => Some(d),
            Err(e) => {
                tracing::debug!(error = %e, path = %path.display(), "journal written through the page cache");
                None
            }
        };
        Self { file, end: 0, direct }
    }

    /// The same, always through the page cache.
    #[cfg(test)]
    pub(super) fn buffered(file: File) -> Self {
        Self {
            file,
            end: 0,
            direct: None,
        }
    }

    /// Whether frames bypass the page cache.
    #[cfg(test)]
    pub(super) fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    /// Starts again at offset 0 (a checkpoint wrapped the journal to this file).
    pub(super) fn restart(&mut self) {
        self.end = 0;
        if let Some(d) = &mut self.direct {
            d.buf.clear();
            d.at = 0;
            d.pending = false;
        }
    }

    /// Appends frames. A direct file only gathers them: one write per group ([`Self::flush`]).
    pub(super) fn append(&mut self, frames: &[u8]) -> io::Result<()> {
        match &mut self.direct {
            Some(d) => {
                d.buf.extend(frames);
                d.pending = true;
            }
            None => self.file.write_all_at(frames, self.end)?,
        }
        self.end += frames.len() as u64;
        Ok(())
    }

    /// Writes what [`Self::append`] gathered.
    pub(super) fn flush(&mut self) -> io::Result<()> {
        match &mut self.direct {
            Some(d) => d.flush(),
            None => Ok(()),
        }
    }

    /// Writes what was gathered, then makes every frame appended so far durable.
    pub(super) fn sync(&mut self) -> io::Result<()> {
        self.flush()?;
        // Either descriptor: `fdatasync` acts on the file. After direct writes it finds no dirty
        // page to write back.
        self.file.sync_data()
    }
}

/// A journal file opened with `O_DIRECT`, and the group being gathered for it.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))] // made on Linux only
struct Direct {
    file: File,
    /// The frames of the partly written block the group starts in, then the group's.
    buf: Aligned,
    /// The file offset of the buffer's first byte: a block boundary.
    at: u64,
    /// Whether the buffer holds frames not written yet.
    pending: bool,
}

impl Direct {
    #[cfg(target_os = "linux")]
    fn open(path: &Path, buffered: &File) -> io::Result<Self> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)?;
        let mut buf = Aligned::with_capacity(64 << 10)?;
        // A file system may take the flag and refuse the writes (or want larger blocks): that
        // shows here, not on a group that callers wait for. The probe writes the first block
        // back with the bytes it holds, so it changes nothing, whatever recovery still reads.
        let block = buf.first_block();
        buffered.read_exact_at(block, 0)?;
        let probed = file.write_all_at(block, 0);
        block.fill(0);
        probed?;
        Ok(Self {
            file,
            buf,
            at: 0,
            pending: false,
        })
    }

    #[cfg(not(target_os = "linux"))]
    fn open(_: &Path, _: &File) -> io::Result<Self> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "direct writes are used on Linux only",
        ))
    }

    fn flush(&mut self) -> io::Result<()> {
        if !self.pending {
            return Ok(());
        }
        self.file.write_all_at(self.buf.padded(), self.at)?;
        self.at += self.buf.keep_last_block() as u64;
        self.pending = false;
        Ok(())
    }
}

/// Bytes that start at a [`BLOCK`]-aligned address: a larger `Vec` and the aligned offset in it
/// (the workspace forbids the `unsafe` of an aligned allocation).
struct Aligned {
    raw: Vec<u8>,
    start: usize,
    len: usize,
}

impl Aligned {
    /// Room for `capacity` bytes plus a block of padding, zeroed.
    fn with_capacity(capacity: usize) -> io::Result<Self> {
        let raw = vec![0; capacity + 2 * BLOCK];
        let start = raw.as_ptr().align_offset(BLOCK);
        if start >= BLOCK {
            return Err(io::Error::other("no aligned offset in the journal buffer"));
        }
        Ok(Self { raw, start, len: 0 })
    }

    fn room(&self) -> usize {
        self.raw.len() - self.start
    }

    /// The first block of an empty buffer, for the probe at open; zero it again after use.
    #[cfg(target_os = "linux")]
    fn first_block(&mut self) -> &mut [u8] {
        debug_assert_eq!(self.len, 0);
        &mut self.raw[self.start..][..BLOCK]
    }

    fn extend(&mut self, bytes: &[u8]) {
        let needed = self.len + bytes.len() + BLOCK;
        if needed > self.room() {
            // Only the journal's own buffer, which an allocation failure ends anyway.
            let Ok(mut bigger) = Self::with_capacity(needed.next_power_of_two()) else {
                panic!("no aligned offset in a new journal buffer");
            };
            bigger.raw[bigger.start..][..self.len].copy_from_slice(&self.raw[self.start..][..self.len]);
            bigger.len = self.len;
            *self = bigger;
        }
        self.raw[self.start + self.len..][..bytes.len()].copy_from_slice(bytes);
        self.len += bytes.len();
    }

    /// The contents, and zeros to the end of their last block.
    fn padded(&mut self) -> &[u8] {
        let whole = self.len.next_multiple_of(BLOCK);
        self.raw[self.start + self.len..self.start + whole].fill(0);
        &self.raw[self.start..][..whole]
    }

    /// Keeps only the bytes of the last, partly filled block, moved to the front, and zeros
    /// after them; returns how many bytes went (whole blocks).
    fn keep_last_block(&mut self) -> usize {
        let gone = self.len - self.len % BLOCK;
        let end = self.start + self.len;
        self.raw.copy_within(self.start + gone..end, self.start);
        self.len -= gone;
        self.raw[self.start + self.len..end].fill(0);
        gone
    }

    fn clear(&mut self) {
        let end = self.start + self.len;
        self.raw[self.start..end].fill(0);
        self.len = 0;
    }
}

#[cfg(test)]
#[path = "appender_tests.rs"]
mod tests;
