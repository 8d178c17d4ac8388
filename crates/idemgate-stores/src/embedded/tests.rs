use super::*;
use idemgate_core::{Fingerprint, RecordState};

pub(super) fn req(token: LeaseToken, now: Millis) -> BeginRequest<'static> {
    BeginRequest {
        fingerprint: Fingerprint([1; 32]),
        route: "r",
        token,
        operation_id: "op",
        lease_ms: 1_000,
        retention_ms: 5_000,
        takeover: true,
        now,
    }
}

pub(super) fn open() -> (tempfile::TempDir, Arc<EmbeddedStore>) {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(EmbeddedStore::open(dir.path()).unwrap());
    (dir, store)
}

/// A store whose next commit skips its snapshot publish once the returned flag is set: callers
/// then read the snapshot before it, as they may in the moment between a commit and its publish.
pub(super) fn open_skipping_publish() -> (
    tempfile::TempDir,
    EmbeddedStore,
    Arc<std::sync::atomic::AtomicBool>,
) {
    let dir = tempfile::tempdir().unwrap();
    let skip = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let checkpoints = Checkpoints {
        skip_next_publish: Some(skip.clone()),
        ..CHECKPOINTS.clone()
    };
    let store = EmbeddedStore::open_with(dir.path(), checkpoints).unwrap();
    (dir, store, skip)
}

pub(super) const CRASH_DIR: &str = "IDEMGATE_TEST_JOURNAL_CRASH_DIR";
const ROUNDS: usize = 2;
const KEYS: usize = 60;

fn body(round: usize, i: usize) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![],
        body: Some(format!("body-{round}-{i}").into_bytes().into()),
    }
}

/// The acknowledged writes of one round: outcomes, a purge, a release and a reservation
/// that may not be taken over (`on_lease_expiry: fail`). `last_writes` is called before the
/// last two.
async fn write_round(store: &EmbeddedStore, round: usize, last_writes: impl FnOnce()) {
    for i in 0..KEYS {
        let (key, token) = (format!("r{round}-{i}"), LeaseToken::random());
        assert!(matches!(
            store.begin(&key, &req(token, 0)).await,
            Ok(Begin::Acquired { .. })
        ));
        store
            .complete(&key, token, &body(round, i), 5_000, 0)
            .await
            .unwrap();
    }
    assert!(store.purge(&format!("r{round}-5")).await.unwrap());
    let token = LeaseToken::random();
    store
        .begin(&format!("r{round}-released"), &req(token, 0))
        .await
        .unwrap();
    store.release(&format!("r{round}-released"), token).await.unwrap();
    last_writes();
    let token = LeaseToken::random();
    store
        .begin(&format!("r{round}-last"), &req(token, 0))
        .await
        .unwrap();
    store
        .complete(&format!("r{round}-last"), token, &body(round, KEYS), 5_000, 0)
        .await
        .unwrap();
    let mut fail = req(LeaseToken::random(), 0);
    fail.takeover = false;
    store.begin(&format!("r{round}-fail"), &fail).await.unwrap();
}

async fn check_round(store: &EmbeddedStore, round: usize) {
    for i in (0..=KEYS).filter(|&i| i != 5) {
        let key = if i == KEYS {
            format!("r{round}-last")
        } else {
            format!("r{round}-{i}")
        };
        match store.begin(&key, &req(LeaseToken::random(), 0)).await {
            Ok(Begin::Replay(rec)) => {
                let RecordState::Completed { response: stored, .. } = rec.state else {
                    panic!("not completed")
                };
                assert_eq!(stored, body(round, i), "round {round} key {i}");
            }
            other => panic!("round {round} key {i}: {other:?}"),
        }
    }
    assert!(
        store.get(&format!("r{round}-5"), 0).await.unwrap().is_none(),
        "purged stays purged"
    );
    assert!(
        store
            .get(&format!("r{round}-released"), 0)
            .await
            .unwrap()
            .is_none()
    );
    let mut fail = req(LeaseToken::random(), 0);
    fail.takeover = false;
    assert!(
        matches!(
            store.begin(&format!("r{round}-fail"), &fail).await,
            Ok(Begin::InFlight { .. })
        ),
        "the durable reservation survived"
    );
}

/// Opens the store in `dir` again once the dropped one's writer has stopped and let the
/// database go.
async fn reopen(dir: &std::path::Path) -> EmbeddedStore {
    once_let_go(|| EmbeddedStore::open(dir)).await
}

/// What `open` opens once a dropped store's writer has stopped and let the database go.
async fn once_let_go<T, E: std::fmt::Display>(open: impl Fn() -> Result<T, E>) -> T {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match open() {
            Ok(opened) => return opened,
            Err(e) => {
                assert!(std::time::Instant::now() < deadline, "never let go: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

/// This test binary, set to run only the ignored test `test` (its path under the crate), with
/// the store in `dir` and `round` in `ROUND`: a child process to crash.
pub(super) fn child_process(
    test: &str,
    dir: &std::path::Path,
    round: Option<impl std::fmt::Display>,
) -> std::process::Command {
    let mut command = std::process::Command::new(std::env::current_exe().unwrap());
    command
        .args(["--exact", test, "--ignored", "--nocapture"])
        .env(CRASH_DIR, dir);
    if let Some(round) = round {
        command.env("ROUND", round.to_string());
    }
    command
}

/// Runs the ignored test `child` of this module in a process of its own with the store in
/// `dir`, expects it to abort, and returns what it printed.
fn run_aborting_child(child: &str, dir: &std::path::Path, round: Option<usize>) -> String {
    let out = child_process(&format!("embedded::tests::{child}"), dir, round)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&out.status),
        Some(6),
        "{child} ({round:?}) did not reach its abort: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Polls `done` until it holds; fails with `what` after 10 s.
pub(super) async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn checkpointed(store: &EmbeddedStore) -> u64 {
    let txn = store.db.begin_read().unwrap();
    let meta = txn.open_table(META).unwrap();
    meta.get(JOURNAL_SEQ).unwrap().map_or(0, |v| v.value())
}

/// The child process of `acknowledged_writes_survive_an_abort`: opens the store (replaying
/// what the rounds before it left in the journal), writes its round, and aborts, so nothing
/// runs that a crash would skip. Checkpoints come every 2 KiB, so the journal wraps several
/// times, and they stop before the round's last writes, which then exist only in the journal.
#[tokio::test]
#[ignore = "the child process of acknowledged_writes_survive_an_abort"]
async fn abort_child() {
    let dir = PathBuf::from(std::env::var(CRASH_DIR).unwrap());
    let round: usize = std::env::var("ROUND").unwrap().parse().unwrap();
    let paused = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let small = Checkpoints {
        bytes: 2048,
        every: Duration::from_secs(3600),
        paused: Some(paused.clone()),
        ..CHECKPOINTS.clone()
    };
    let store = EmbeddedStore::open_with(&dir, small).unwrap();
    let before = checkpointed(&store);
    println!("replayed {}", store.replayed_at_open());
    write_round(&store, round, || paused.store(true, Ordering::SeqCst)).await;
    println!("checkpoints {before} {}", checkpointed(&store));
    std::process::abort();
}

/// A periodic checkpoint leaves its fsync to the sync thread: outcomes go on being acknowledged
/// while it is owed, the next checkpoint makes it first if the sync thread has not, and the
/// journal alternates between its two files. Reopened, the store has every outcome.
#[tokio::test]
async fn a_checkpoint_fsync_is_owed_off_the_writer() {
    let dir = tempfile::tempdir().unwrap();
    let small = Checkpoints {
        bytes: 2048,
        every: Duration::from_secs(3600),
        ..CHECKPOINTS.clone()
    };
    let store = EmbeddedStore::open_with(dir.path(), small).unwrap();
    let file = |store: &EmbeddedStore| {
        let txn = store.db.begin_read().unwrap();
        let meta = txn.open_table(META).unwrap();
        meta.get(JOURNAL_FILE).unwrap().map_or(0, |v| v.value())
    };
    assert_eq!(file(&store), 0, "the journal starts in file 0");
    store.sync.hold(true);
    let complete = |i: usize| {
        let store = &store;
        async move {
            let (key, token) = (format!("k{i}"), LeaseToken::random());
            store.begin(&key, &req(token, 0)).await.unwrap();
            store.complete(&key, token, &body(0, i), 5_000, 0).await.unwrap();
        }
    };
    let mut i = 0;
    let first = checkpointed(&store);
    while checkpointed(&store) == first {
        complete(i).await;
        i += 1;
        assert!(i < 1_000, "no checkpoint after {i} outcomes");
    }
    // The new checkpoint is visible to readers as redb's commit returns, a moment before the
    // writer records its disk work as owed (`Control::deferring`): wait for that, bounded.
    wait_until(
        "the checkpoint's fsync was not recorded as owed within 10 s",
        || store.sync.is_owed(),
    )
    .await;
    assert_eq!(file(&store), 1, "the frames after it go to the other file");
    // Acknowledged while the checkpoint's fsync is owed (fewer than a checkpoint's worth).
    complete(i).await;
    i += 1;
    assert!(store.sync.is_owed());
    // The next checkpoint makes the owed fsync itself, then owes its own.
    let second = checkpointed(&store);
    while checkpointed(&store) == second {
        complete(i).await;
        i += 1;
        assert!(i < 2_000, "no second checkpoint after {i} outcomes");
    }
    assert_eq!(file(&store), 0, "and back to file 0");
    store.sync.hold(false);
    wait_until("the sync thread never made the owed fsync", || {
        !store.sync.is_owed()
    })
    .await;
    drop(store);
    let store = reopen(dir.path()).await;
    for k in 0..i {
        match store.begin(&format!("k{k}"), &req(LeaseToken::random(), 0)).await {
            Ok(Begin::Replay(_)) => {}
            other => panic!("outcome {k} of {i}: {other:?}"),
        }
    }
}

/// A directory written before the journal had two files (one journal, no `journal_file` in
/// the checkpoint) opens as it is: its journal is file 0, and the second file is created.
#[tokio::test]
async fn a_store_from_before_the_second_journal_file_opens() {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::open(dir.path()).unwrap();
    write_round(&store, 0, || {}).await;
    drop(store);
    // Once the writer has let the database go (its last checkpoint names a file).
    let db = once_let_go(|| Database::create(dir.path().join("records.redb"))).await;
    let txn = db.begin_write().unwrap();
    assert!(
        txn.open_table(META)
            .unwrap()
            .remove(JOURNAL_FILE)
            .unwrap()
            .is_some()
    );
    txn.commit().unwrap();
    drop(db);
    std::fs::remove_file(dir.path().join("records.journal.1")).unwrap();
    let store = reopen(dir.path()).await;
    check_round(&store, 0).await;
    write_round(&store, 1, || {}).await;
    check_round(&store, 1).await;
    assert!(dir.path().join("records.journal.1").exists());
}

/// The child process of `outcomes_acknowledged_while_a_checkpoint_is_owed_survive_an_abort`:
/// holds the sync thread, so the first periodic checkpoint's pages and fsync stay in memory,
/// acknowledges outcomes before and after it, and aborts. redb's file is then as the
/// checkpoint made at open left it, and the outcomes after the owed one are only in the
/// journal's other file.
#[tokio::test]
#[ignore = "the child process of outcomes_acknowledged_while_a_checkpoint_is_owed_survive_an_abort"]
async fn owed_abort_child() {
    let dir = PathBuf::from(std::env::var(CRASH_DIR).unwrap());
    let small = Checkpoints {
        bytes: 2048,
        every: Duration::from_secs(3600),
        ..CHECKPOINTS.clone()
    };
    let store = EmbeddedStore::open_with(&dir, small).unwrap();
    store.sync.hold(true);
    let first = checkpointed(&store);
    let mut acked = 0;
    let mut after = 0;
    while after < 3 {
        let (key, token) = (format!("k{acked}"), LeaseToken::random());
        store.begin(&key, &req(token, 0)).await.unwrap();
        store
            .complete(&key, token, &body(0, acked), 5_000, 0)
            .await
            .unwrap();
        acked += 1;
        if checkpointed(&store) != first {
            after += 1;
        }
        assert!(acked < 1_000, "no checkpoint after {acked} outcomes");
    }
    assert!(store.sync.is_owed(), "the checkpoint's work is still owed");
    println!("acked {acked}");
    std::process::abort();
}

#[test]
fn outcomes_acknowledged_while_a_checkpoint_is_owed_survive_an_abort() {
    let dir = tempfile::tempdir().unwrap();
    let stdout = run_aborting_child("owed_abort_child", dir.path(), None);
    let acked: usize = stdout
        .lines()
        .find_map(|l| l.strip_prefix("acked "))
        .expect("the child says how many it acknowledged")
        .trim()
        .parse()
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let store = EmbeddedStore::open(dir.path()).unwrap();
        assert_eq!(
            store.replayed_at_open(),
            acked,
            "every outcome since the open came from the journal, both files"
        );
        for i in 0..acked {
            match store.begin(&format!("k{i}"), &req(LeaseToken::random(), 0)).await {
                Ok(Begin::Replay(rec)) => {
                    let RecordState::Completed { response, .. } = rec.state else {
                        panic!("not completed")
                    };
                    assert_eq!(response, body(0, i), "outcome {i} of {acked}");
                }
                other => panic!("outcome {i} of {acked}: {other:?}"),
            }
        }
    });
}

/// The child process of `a_run_left_in_the_other_file_before_an_open_is_never_replayed`:
/// acknowledges four outcomes with checkpoints paused, so they exist only in file 0 of the
/// journal, and aborts.
#[tokio::test]
#[ignore = "the child process of a_run_left_in_the_other_file_before_an_open_is_never_replayed"]
async fn stale_abort_child() {
    let dir = PathBuf::from(std::env::var(CRASH_DIR).unwrap());
    let paused = Checkpoints {
        paused: Some(Arc::new(std::sync::atomic::AtomicBool::new(true))),
        ..CHECKPOINTS.clone()
    };
    let store = EmbeddedStore::open_with(&dir, paused).unwrap();
    for i in 0..4 {
        let (key, token) = (format!("fresh-{i}"), LeaseToken::random());
        store.begin(&key, &req(token, 0)).await.unwrap();
        store.complete(&key, token, &body(1, i), 5_000, 0).await.unwrap();
    }
    std::process::abort();
}

/// A run in journal file 1 from before an open (after a power loss it can start above where
/// recovery restarted the count) must not be taken for the frames that follow file 0's run
/// once the new numbers reach it: it is not of the generation the checkpoint drew.
#[test]
fn a_run_left_in_the_other_file_before_an_open_is_never_replayed() {
    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (record, seq) = rt.block_on(async {
        let store = EmbeddedStore::open(dir.path()).unwrap();
        let token = LeaseToken::random();
        store.begin("seed", &req(token, 0)).await.unwrap();
        store
            .complete("seed", token, &body(0, 0), 5_000, 0)
            .await
            .unwrap();
        drop(store);
        let store = reopen(dir.path()).await;
        let record = store.read("seed").unwrap().unwrap();
        let seq = checkpointed(&store);
        drop(store);
        drop(reopen(dir.path()).await);
        drop(once_let_go(|| Database::create(dir.path().join("records.redb"))).await);
        (record, seq)
    });
    // Numbered from just past the four frames the child will write.
    let mut stale = Vec::new();
    for n in seq + 5..=seq + 7 {
        journal::encode(&mut stale, 99, n, &format!("stale-{n}"), Some(&encode(&record)));
    }
    std::os::unix::fs::FileExt::write_all_at(
        &std::fs::OpenOptions::new()
            .write(true)
            .open(dir.path().join("records.journal.1"))
            .unwrap(),
        &stale,
        0,
    )
    .unwrap();
    run_aborting_child("stale_abort_child", dir.path(), None);
    rt.block_on(async {
        let store = EmbeddedStore::open(dir.path()).unwrap();
        assert_eq!(
            store.replayed_at_open(),
            4,
            "the child's four outcomes, nothing else"
        );
        for n in seq + 5..=seq + 7 {
            assert!(
                store.read(&format!("stale-{n}")).unwrap().is_none(),
                "stale frame {n} replayed"
            );
        }
        for i in 0..4 {
            assert!(store.read(&format!("fresh-{i}")).unwrap().is_some());
        }
    });
}

#[test]
fn acknowledged_writes_survive_an_abort() {
    let dir = tempfile::tempdir().unwrap();
    for round in 0..ROUNDS {
        let stdout = run_aborting_child("abort_child", dir.path(), Some(round));
        if round > 0 {
            assert!(
                !stdout.contains("replayed 0\n"),
                "round {round} replayed nothing: {stdout}"
            );
        }
        let wrapped = stdout
            .lines()
            .find_map(|l| l.strip_prefix("checkpoints "))
            .and_then(|l| l.split_once(' '))
            .is_some_and(|(before, after)| before.parse::<u64>().unwrap() < after.parse().unwrap());
        assert!(
            wrapped,
            "round {round} never checkpointed (so never wrapped): {stdout}"
        );
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let store = EmbeddedStore::open(dir.path()).unwrap();
        assert!(
            store.replayed_at_open() > 0,
            "the last round's writes came from the journal"
        );
        for round in 0..ROUNDS {
            check_round(&store, round).await;
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writes_share_commits() {
    let (_dir, store) = open();
    let before = store.commits();
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let store = store.clone();
            let mut durable = req(LeaseToken::random(), 0);
            durable.takeover = false;
            tokio::spawn(async move { store.begin(&format!("k{i}"), &durable).await })
        })
        .collect();
    for t in tasks {
        assert!(matches!(t.await.unwrap(), Ok(Begin::Acquired { .. })));
    }
    let (commits, syncs) = (store.commits() - before, store.durable_commits());
    assert!(
        commits < 200 && syncs < 200,
        "200 durable begins took {commits} commits and {syncs} fsyncs: no group commit"
    );
}

/// A reservation that may be taken over lives in memory only: its begin, renew and release never
/// reach redb, its outcome is one redb write, and a takeover and fencing work as in the rules.
#[tokio::test]
async fn takeable_reservations_stay_in_memory() {
    let (_dir, store) = open();
    let before = store.commits();
    let (first, second) = (LeaseToken::random(), LeaseToken::random());
    assert!(matches!(
        store.begin("a", &req(first, 0)).await,
        Ok(Begin::Acquired { .. })
    ));
    assert!(matches!(
        store.begin("a", &req(second, 10)).await,
        Ok(Begin::InFlight { .. })
    ));
    store.renew("a", first, 1_500).await.unwrap();
    assert!(
        matches!(
            store.begin("a", &req(second, 1_200)).await,
            Ok(Begin::InFlight { .. })
        ),
        "renewed in memory"
    );
    // Past the lease, the second attempt takes over; the first is fenced from then on.
    assert!(matches!(
        store.begin("a", &req(second, 1_600)).await,
        Ok(Begin::Acquired {
            took_over: true,
            generation: 2,
            ..
        })
    ));
    let ok = StoredResponse {
        status: 200,
        headers: vec![],
        body: None,
    };
    assert!(store.complete("a", first, &ok, 5_000, 1_700).await.is_err());
    assert!(store.release("a", first).await.is_err());
    assert_eq!(store.commits(), before, "nothing reached redb yet");
    assert!(store.read("a").unwrap().is_none());
    store.complete("a", second, &ok, 5_000, 1_700).await.unwrap();
    assert_eq!(store.reserved.len(), 0, "the outcome replaced the reservation");
    assert!(matches!(
        store.read("a").unwrap().map(|r| r.state),
        Some(RecordState::Completed { .. })
    ));
    assert!(matches!(
        store.begin("a", &req(first, 1_800)).await,
        Ok(Begin::Replay(_))
    ));
    store
        .complete("a", second, &ok, 5_000, 1_900)
        .await
        .expect("a retried complete is done");
    // Released, a key is free again without touching redb.
    let commits = store.commits();
    let third = LeaseToken::random();
    store.begin("b", &req(third, 0)).await.unwrap();
    store.release("b", third).await.unwrap();
    assert!(matches!(
        store.begin("b", &req(LeaseToken::random(), 1)).await,
        Ok(Begin::Acquired { .. })
    ));
    assert_eq!(store.commits(), commits);
}

/// A purge takes a reservation held in memory too, and an outcome for it is fenced.
#[tokio::test]
async fn purge_takes_a_reservation_in_memory() {
    let (_dir, store) = open();
    let token = LeaseToken::random();
    store.begin("a", &req(token, 0)).await.unwrap();
    assert!(store.get("a", 1).await.unwrap().is_some());
    assert!(store.purge("a").await.unwrap());
    assert!(store.get("a", 1).await.unwrap().is_none());
    let ok = StoredResponse {
        status: 200,
        headers: vec![],
        body: None,
    };
    assert!(store.complete("a", token, &ok, 5_000, 2).await.is_err());
    assert!(store.read("a").unwrap().is_none());
}

#[tokio::test]
async fn only_outcomes_and_untakeable_reservations_wait_for_the_disk() {
    let (_dir, store) = open();
    let before = store.durable_commits();
    let token = LeaseToken::random();
    store.begin("a", &req(token, 0)).await.unwrap();
    store.renew("a", token, 500).await.unwrap();
    assert_eq!(
        store.durable_commits(),
        before,
        "a takeable reservation needs no fsync"
    );
    let ok = StoredResponse {
        status: 200,
        headers: vec![],
        body: None,
    };
    store.complete("a", token, &ok, 5_000, 0).await.unwrap();
    assert_eq!(
        store.durable_commits(),
        before + 1,
        "a completed outcome is on disk before the answer"
    );
    let mut fail = req(LeaseToken::random(), 0);
    fail.takeover = false;
    store.begin("b", &fail).await.unwrap();
    assert_eq!(
        store.durable_commits(),
        before + 2,
        "on_lease_expiry: fail reservations are durable"
    );
}

#[tokio::test]
async fn sweep_deletes_only_what_is_due_in_batches() {
    let (_dir, store) = open();
    for i in 0..(SWEEP_BATCH + 10) {
        let token = LeaseToken::random();
        let key = format!("old{i}");
        store.begin(&key, &req(token, 0)).await.unwrap();
        store
            .complete(
                &key,
                token,
                &StoredResponse {
                    status: 200,
                    headers: vec![],
                    body: None,
                },
                5_000,
                0,
            )
            .await
            .unwrap();
    }
    store
        .begin("young", &req(LeaseToken::random(), 4_000))
        .await
        .unwrap();
    assert_eq!(
        store.sweep(6_000).await.unwrap(),
        SWEEP_BATCH,
        "one batch at a time"
    );
    assert_eq!(store.sweep(6_000).await.unwrap(), 10);
    assert_eq!(store.sweep(6_000).await.unwrap(), 0);
    assert!(
        store.get("young", 6_000).await.unwrap().is_some(),
        "live records stay"
    );
    assert!(
        store.read("old3").unwrap().is_none(),
        "expired records are gone from disk"
    );
}

#[test]
fn records_round_trip_and_unknown_formats_are_corrupt() {
    let rec = Record {
        state: idemgate_core::RecordState::InFlight {
            token: LeaseToken(7),
            lease_until: 9,
        },
        fingerprint: Fingerprint([3; 32]),
        route: "r".into(),
        operation_id: "op".into(),
        created_at: 1,
        expires_at: 2,
        generation: 1,
    };
    assert_eq!(decode(&encode(&rec)).unwrap(), rec);
    assert!(matches!(decode(&[9, 1, 2]), Err(StoreError::Corrupt(_))));
}

/// After a failed write the store stops everywhere, in-memory decisions included: a
/// reservation granted now could never record its outcome.
#[tokio::test]
async fn a_stopped_store_grants_nothing() {
    let (_dir, store) = open();
    store.journal.break_down();
    assert!(store.begin("a", &req(LeaseToken::random(), 0)).await.is_err());
    assert!(store.get("a", 0).await.is_err());
    assert!(store.ping().await.is_err(), "readiness fails too");
}

/// An owner may complete after its lease ran out; while that outcome is on its way to redb,
/// a waiter is told of a lease ahead of it, so it sleeps instead of asking again in a loop.
#[test]
fn a_completing_reservation_answers_with_a_lease_ahead() {
    let token = LeaseToken::random();
    let (_, Write::Put(record)) = rules::begin(None, &req(token, 0)) else {
        panic!("acquired")
    };
    let entry = reserved::Entry {
        record,
        state: State::Completing,
    };
    let (answer, write) = entry.begin(&req(LeaseToken::random(), 2_000));
    assert_eq!(write, Write::Keep);
    match answer {
        Begin::InFlight { lease_until, .. } => assert!(lease_until >= 3_000, "{lease_until}"),
        other => panic!("{other:?}"),
    }
}

/// A failed commit stops the store: the outcome it carried goes back to its owner's reservation,
/// nothing more is granted, and a restart finds every outcome acknowledged before.
#[tokio::test]
async fn a_failed_commit_stops_the_store_until_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let fail = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let checkpoints = Checkpoints {
        fail_next_batch: Some(fail.clone()),
        ..CHECKPOINTS.clone()
    };
    let store = EmbeddedStore::open_with(dir.path(), checkpoints).unwrap();
    let ok = StoredResponse {
        status: 201,
        headers: vec![],
        body: Some(b"done".to_vec().into()),
    };
    let token = LeaseToken::random();
    store.begin("done", &req(token, 0)).await.unwrap();
    store.complete("done", token, &ok, 5_000, 0).await.unwrap();
    let token = LeaseToken::random();
    store.begin("x", &req(token, 0)).await.unwrap();
    fail.store(true, Ordering::SeqCst);
    assert!(store.complete("x", token, &ok, 5_000, 0).await.is_err());
    assert_eq!(
        store.reserved.lock("x").get("x").map(|e| e.state),
        Some(State::Memory),
        "the reservation is its owner's again"
    );
    assert!(store.begin("y", &req(LeaseToken::random(), 0)).await.is_err());
    assert!(store.ping().await.is_err());
    drop(store);
    let store = reopen(dir.path()).await;
    match store.begin("done", &req(LeaseToken::random(), 1)).await {
        Ok(Begin::Replay(rec)) => {
            assert!(matches!(rec.state, RecordState::Completed { response, .. } if response == ok))
        }
        other => panic!("{other:?}"),
    }
    assert!(
        matches!(
            store.begin("x", &req(LeaseToken::random(), 1)).await,
            Ok(Begin::Acquired { .. })
        ),
        "a reservation in memory does not outlive the process"
    );
}

/// The answerer task hands out the replies while its runtime runs; once that runtime is gone,
/// the store's own threads answer again, so nobody waits for a task that cannot run.
#[test]
fn replies_go_through_the_answerer_and_around_it_once_its_runtime_ends() {
    let runtime = |threads: Option<usize>| {
        let mut b = match threads {
            Some(n) => {
                let mut b = tokio::runtime::Builder::new_multi_thread();
                b.worker_threads(n);
                b
            }
            None => tokio::runtime::Builder::new_current_thread(),
        };
        b.enable_all().build().unwrap()
    };
    let (_dir, store) = open();
    // A current-thread runtime runs its tasks only inside `block_on`: between calls the
    // answerer is spawned but idle.
    let answering = runtime(None);
    let _answerer = {
        let _entered = answering.enter();
        store.spawn_answerer()
    };
    let callers = runtime(Some(1));
    let miss = |key: &'static str| {
        let store = store.clone();
        async move {
            let token = LeaseToken::random();
            assert!(matches!(
                store.begin(key, &req(token, 0)).await,
                Ok(Begin::Acquired { .. })
            ));
            store.complete(key, token, &body(0, 0), 5_000, 0).await
        }
    };
    let mut first = callers.spawn(miss("a"));
    let waited =
        callers.block_on(async { tokio::time::timeout(Duration::from_millis(300), &mut first).await });
    assert!(
        waited.is_err(),
        "answered without the answerer running: {waited:?}"
    );
    answering.block_on(wait_until("the answerer never answered", || first.is_finished()));
    assert!(callers.block_on(first).unwrap().is_ok());
    drop(answering);
    let second = callers.block_on(async { tokio::time::timeout(Duration::from_secs(10), miss("b")).await });
    assert!(matches!(second, Ok(Ok(()))), "{second:?}");
}

/// A takeover decided on a snapshot that does not show the owner's late outcome yet (the moment
/// between the writer's commit and its publish) must not run the operation again: the writer
/// finds another record than the dead one it was asked to forget, and `begin` decides again, on
/// the outcome.
#[tokio::test]
async fn a_takeover_on_a_stale_snapshot_decides_again() {
    let (_dir, store, skip) = open_skipping_publish();
    // A reservation in redb (`on_lease_expiry: fail`), its lease until 1_000.
    let owner = LeaseToken::random();
    let mut durable = req(owner, 0);
    durable.takeover = false;
    assert!(matches!(
        store.begin("k", &durable).await,
        Ok(Begin::Acquired { .. })
    ));
    // Its owner completes after the lease ran out, and that commit publishes no snapshot.
    skip.store(true, Ordering::SeqCst);
    let ok = StoredResponse {
        status: 201,
        headers: vec![],
        body: Some(b"once".to_vec().into()),
    };
    store.complete("k", owner, &ok, 5_000, 1_500).await.unwrap();
    assert!(
        matches!(
            store.read("k").unwrap().map(|r| r.state),
            Some(RecordState::InFlight { .. })
        ),
        "callers still read the reservation"
    );
    // A request that may take over (the route now says `on_lease_expiry: retry`).
    match store.begin("k", &req(LeaseToken::random(), 2_000)).await {
        Ok(Begin::Replay(rec)) => {
            assert!(matches!(rec.state, RecordState::Completed { response, .. } if response == ok));
        }
        other => panic!("expected the owner's outcome, not a second execution: {other:?}"),
    }
    assert_eq!(store.reserved.len(), 0, "the takeover left nothing in memory");
}

/// The writer and the sync thread run as batch threads and the journal does not (see
/// `batch.rs`): a caller handing the writer work is not switched away from at once when they
/// share a core, nor is anyone when a checkpoint's disk work starts. The journal keeps the
/// policy it started with, the process's.
#[cfg(target_os = "linux")]
#[test]
fn the_writer_runs_as_a_batch_thread() {
    use super::batch::{NICE, POLICY, stat_field};
    const SCHED_BATCH: &str = "3";
    let process = std::fs::read_to_string("/proc/self/stat").unwrap();
    let process_nice = stat_field(&process, NICE).unwrap().to_owned();
    let process_policy = stat_field(&process, POLICY).unwrap().to_owned();
    // Under `nice` the writer keeps its policy rather than change its nice value.
    let writer_policy = if process_nice == "0" {
        SCHED_BATCH
    } else {
        &process_policy
    };
    // (name, policy, nice) of this process's store threads.
    let store_threads = || -> Vec<(String, String, String)> {
        let mut found = Vec::new();
        for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
            let name = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            let name = name.trim();
            if !["store-writer", "store-journal", "store-sync"].contains(&name) {
                continue;
            }
            let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
            let field = |n| stat_field(&stat, n).unwrap_or("?").to_owned();
            found.push((name.to_owned(), field(POLICY), field(NICE)));
        }
        found
    };
    let (_dir, _store) = open();
    // The writer sets its own policy as it starts; other tests' stores may be starting too.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let threads = store_threads();
        let names: Vec<&str> = threads.iter().map(|(n, ..)| n.as_str()).collect();
        let ready = ["store-writer", "store-journal", "store-sync"]
            .iter()
            .all(|n| names.contains(n))
            && threads.iter().all(|(name, policy, nice)| {
                let expected = if name == "store-journal" {
                    &process_policy
                } else {
                    writer_policy
                };
                policy == expected && *nice == process_nice
            });
        if ready {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "store threads (name, policy, nice): {threads:?}, process nice {process_nice}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The response `complete` is handed may share a larger buffer (the gateway hands over a body
/// as read from the upstream); what the store keeps (its reservation until the commit, redb, the
/// cache of recent outcomes) must be bytes of its own, or a record would hold that buffer alive.
/// Both ways an outcome is recorded: a reservation in memory (`on_lease_expiry: retry`) and one
/// on disk (`fail`).
#[tokio::test]
async fn a_kept_response_does_not_share_the_caller_s_buffer() {
    for takeover in [true, false] {
        let (_dir, store) = open();
        let buffer = bytes::Bytes::from(vec![7u8; 64 * 1024]);
        let response = StoredResponse {
            status: 201,
            headers: vec![("etag".into(), buffer.slice(0..4))],
            body: Some(buffer.slice(100..124)),
        };
        let token = LeaseToken::random();
        let begin = BeginRequest {
            takeover,
            ..req(token, 0)
        };
        assert!(matches!(
            store.begin("k", &begin).await,
            Ok(Begin::Acquired { .. })
        ));
        store.complete("k", token, &response, 5_000, 1).await.unwrap();
        let inside = |b: &bytes::Bytes| buffer.as_ptr_range().contains(&b.as_ptr());
        // Read twice and replayed: from redb, then from the cache of recent outcomes.
        let retry = BeginRequest {
            token: LeaseToken::random(),
            now: 3,
            ..begin.clone()
        };
        let replayed = match store.begin("k", &retry).await.unwrap() {
            Begin::Replay(record) => *record,
            other => panic!("takeover {takeover}: {other:?}"),
        };
        let read = store.get("k", 2).await.unwrap().expect("completed");
        let again = store.get("k", 2).await.unwrap().expect("completed");
        for record in [read, again, replayed] {
            let RecordState::Completed { response: kept, .. } = record.state else {
                panic!("takeover {takeover}: not completed");
            };
            assert_eq!(kept, response);
            assert!(
                !inside(kept.body.as_ref().unwrap()),
                "takeover {takeover}: the body shares the caller's buffer"
            );
            assert!(
                !inside(&kept.headers[0].1),
                "takeover {takeover}: a header shares the caller's buffer"
            );
        }
    }
}
