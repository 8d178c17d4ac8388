use std::io::Read;

use super::*;

/// A journal file as an earlier run left it: stale bytes everywhere, as frames of an older
/// generation would be.
fn stale_file(dir: &Path, name: &str) -> (File, std::path::PathBuf) {
    let path = dir.join(name);
    std::fs::write(&path, vec![0xAA; 256 << 10]).expect("write");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .expect("open");
    (file, path)
}

fn contents(path: &Path) -> Vec<u8> {
    let mut bytes = Vec::new();
    File::open(path)
        .expect("open")
        .read_to_end(&mut bytes)
        .expect("read");
    bytes
}

/// Groups of frames of awkward sizes: within a block, up to its end, across one and many. The
/// bytes do not repeat with the block size (a byte from the wrong block shows) and are never 0
/// (a byte left out shows).
fn groups() -> Vec<Vec<u8>> {
    let mut state = 0x9E37_79B9_7F4A_7C15_u64;
    [1, 100, 3995, 4096, 4097, 1, 10_000, 8192, 70_000, 3]
        .into_iter()
        .map(|n| {
            (0..n)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state.to_le_bytes()[0] | 1
                })
                .collect()
        })
        .collect()
}

/// After every sync, the file holds every frame appended, byte for byte, from offset 0; a
/// direct file has zeros after them to the end of their block (recovery's end of the journal).
fn appends_every_group_in_place(mut out: Appender, path: &Path) {
    let mut all = Vec::new();
    for (i, group) in groups().into_iter().enumerate() {
        // Some groups come in two batches, as the writer's messages do.
        let (a, b) = group.split_at(group.len() / 3);
        out.append(a).expect("append");
        out.append(b).expect("append");
        all.extend_from_slice(&group);
        out.sync().expect("sync");
        let on_disk = contents(path);
        assert_eq!(on_disk[..all.len()], all[..], "group {i}: frames on disk");
        if out.is_direct() {
            let block_end = all.len().next_multiple_of(BLOCK);
            assert!(
                on_disk[all.len()..block_end].iter().all(|b| *b == 0),
                "group {i}: zeros to the end of the block"
            );
            assert!(
                on_disk[block_end..].starts_with(&[0xAA]),
                "nothing written past that block"
            );
        }
    }
    // A checkpoint wraps the journal back to this file: the next frames start at offset 0.
    out.restart();
    out.append(b"again").expect("append");
    out.sync().expect("sync");
    let on_disk = contents(path);
    assert_eq!(&on_disk[..5], b"again");
    if out.is_direct() {
        assert!(on_disk[5..BLOCK].iter().all(|b| *b == 0));
    }
    assert_eq!(
        on_disk[BLOCK..all.len()],
        all[BLOCK..],
        "the rest is left as it was"
    );
}

#[test]
fn a_direct_journal_file_holds_every_frame_in_place() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (file, path) = stale_file(dir.path(), "direct");
    let out = Appender::new(file, &path);
    if !out.is_direct() {
        eprintln!("skipped: {} takes no O_DIRECT writes", dir.path().display());
        return;
    }
    // The probe wrote the first block back as it was: recovery may still read it.
    assert!(contents(&path)[..BLOCK].iter().all(|b| *b == 0xAA));
    assert!(
        out.direct
            .as_ref()
            .is_some_and(|d| d.buf.raw.iter().all(|b| *b == 0))
    );
    appends_every_group_in_place(out, &path);
}

#[test]
fn a_buffered_journal_file_holds_every_frame_in_place() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (file, path) = stale_file(dir.path(), "buffered");
    appends_every_group_in_place(Appender::buffered(file), &path);
}

#[test]
fn the_buffer_keeps_the_last_partial_block_only() {
    let mut buf = Aligned::with_capacity(BLOCK).expect("aligned");
    assert_eq!(buf.raw[buf.start..].as_ptr() as usize % BLOCK, 0, "aligned start");
    buf.extend(&[1; 5000]);
    assert!(buf.room() >= 5000 + BLOCK, "grown, with room for the padding");
    assert_eq!(buf.raw[buf.start..].as_ptr() as usize % BLOCK, 0, "still aligned");
    let padded = buf.padded().to_vec();
    assert_eq!(padded.len(), 2 * BLOCK);
    assert!(padded[..5000].iter().all(|b| *b == 1) && padded[5000..].iter().all(|b| *b == 0));
    assert_eq!(buf.keep_last_block(), BLOCK);
    assert_eq!(buf.len, 5000 - BLOCK);
    assert!(buf.raw[buf.start..][..buf.len].iter().all(|b| *b == 1));
    assert!(
        buf.raw[buf.start + buf.len..].iter().all(|b| *b == 0),
        "zeros after the kept bytes"
    );
    buf.extend(&[2; 3192]);
    assert_eq!(buf.len, BLOCK);
    assert_eq!(
        buf.keep_last_block(),
        BLOCK,
        "a full block is written and not kept"
    );
    assert_eq!(buf.len, 0);
    buf.extend(&[3; 10]);
    buf.clear();
    assert!(buf.raw.iter().all(|b| *b == 0));
}
