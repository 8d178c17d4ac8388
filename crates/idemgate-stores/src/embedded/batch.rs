//! The writer thread as a Linux `SCHED_BATCH` thread: its wake-ups no longer preempt the thread
//! that woke it.
//!
//! A caller hands its write to the writer and goes on. With the default policy the kernel
//! switches to the freshly woken writer at once when both share a core, so the writer commits
//! one or two operations per wake-up, each commit a context switch and a futex call on the
//! requests' core. As a batch thread it runs once the callers' thread blocks or its slice ends,
//! and finds the writes that arrived meanwhile queued: one commit for all of them. On a core of
//! its own nothing changes (a wake-up on an idle core preempts nobody), and its share of the CPU
//! is the same: `SCHED_BATCH` changes wake-up preemption only, not the weight.
//!
//! The journal thread keeps the default policy: it answers callers after each sync, and as a
//! batch thread its answers waited behind the callers' thread in a duplicate storm (the slowest
//! waiter 10 to 25 ms later). Measured in docs/benchmarks-journal.md (2026-11-26, morning).
//!
//! The sync thread (`sync.rs`) is a batch thread too: its work (a checkpoint's page writes and
//! fsync) answers nobody, so it has no reason to preempt the callers' thread when it wakes.

/// Makes the calling thread a batch thread if it runs at nice 0, else leaves it as it is.
///
/// `thread-priority` sets a policy and a nice value together (`unsafe_code` is forbidden here,
/// so not the bare `sched_setscheduler`): at any other nice it would move this thread's weight
/// away from its siblings' (or fail half done), so a gateway started under `nice` keeps the
/// default policy for its writer, which only batches less. So does one whose seccomp profile
/// refuses the call.
pub(super) fn become_batch_thread() {
    #[cfg(target_os = "linux")]
    {
        use thread_priority::{
            NormalThreadSchedulePolicy, ThreadPriority, ThreadPriorityOsValue, ThreadSchedulePolicy,
            set_thread_priority_and_policy, thread_native_id,
        };
        let own = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
        if stat_field(&own, NICE) != Some("0") {
            tracing::debug!("embedded store writer not at nice 0: it keeps the default scheduling policy");
            return;
        }
        let batch = ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Batch);
        // Nice 0, the one it has.
        let nice = ThreadPriority::Os(ThreadPriorityOsValue::default());
        if let Err(e) = set_thread_priority_and_policy(thread_native_id(), nice, batch) {
            tracing::debug!(error = ?e, "could not make the embedded store writer a SCHED_BATCH thread");
        }
    }
}

/// Field numbers of `/proc/<pid>/stat` (proc(5), counted from 1).
#[cfg(target_os = "linux")]
pub(super) const NICE: usize = 19;
#[cfg(all(target_os = "linux", test))]
pub(super) const POLICY: usize = 41;

/// Field `n` of a `/proc/<pid>/stat` line. The second field, the thread's name, is in
/// parentheses and may hold spaces and parentheses, so fields are counted after its last `)`.
#[cfg(target_os = "linux")]
pub(super) fn stat_field(stat: &str, n: usize) -> Option<&str> {
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(n.checked_sub(3)?)
}
