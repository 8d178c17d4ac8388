//! The checker's verdict: the clients' histories against the upstream's executions and the
//! nemesis's record.
//!
//! A key executed more than once is excused only when every execution but the last was cut
//! off by a documented crash point, a fault that hit the gateway that forwarded it while the
//! execution ran or before its outcome could be recorded (up to 1 s after the upstream
//! answered: the `complete` call, bounded by the store timeout), or, for a kill or pause,
//! while that gateway held the request before forwarding it:
//!
//! - the gateway was killed (`kill -9`) or paused (SIGSTOP) past its lease: the owner died
//!   (SPEC 4, `on_lease_expiry: retry`: after the lease a retry takes over and runs again);
//! - the gateway could not reach the store to record the outcome (or to renew its lease): the
//!   record stays in flight and the lease rule decides the retry (docs/lifecycle.md, "Owner's
//!   record update fails"). Such a duplicate needs a client that did not get the owner's
//!   response (the owner still sends it): here, an impatient client that gave up.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::workload::{Attempt, BOUND, Executions, KeyHistory, Outcome};

/// One nemesis turn: what it did, which gateways it hit (every gateway for a store-wide
/// fault), whether it was a crash of the gateway process itself (kill or pause), and when.
#[derive(Clone, Debug)]
pub struct Event {
    pub what: String,
    pub gateways: Vec<usize>,
    pub crash: bool,
    pub start: Duration,
    pub end: Duration,
}

/// How long after the upstream's answer a crash still leaves the outcome unrecorded.
const RECORD_MARGIN: Duration = Duration::from_secs(1);

#[derive(Debug, Default)]
pub struct Verdict {
    pub keys: usize,
    pub final_keys: usize,
    pub attempts: usize,
    pub ok_attempts: usize,
    pub replays: usize,
    pub exactly_once: usize,
    /// Keys executed more than once at a documented crash point, by reason.
    pub excused: BTreeMap<String, usize>,
    pub statuses: BTreeMap<String, usize>,
    pub gave_up: usize,
    pub timeouts_on_dead: usize,
    /// Attempts that overlapped no nemesis turn, and how many of them succeeded.
    pub quiet_attempts: usize,
    pub quiet_ok: usize,
    /// A few failed attempts outside the faults, to tell slow recoveries from bad luck.
    pub quiet_failures: Vec<String>,
    pub p99_ok: Duration,
    pub max_ok: Duration,
    pub executions: u64,
    /// Keys read again after the run: replays of the accepted execution, and keys whose
    /// accepted outcome was never recorded (a fault hit its owner), so the re-read ran them.
    pub rereads_replayed: usize,
    pub rereads_unrecorded: BTreeMap<String, usize>,
    /// Final-phase keys that needed a retry because every failed attempt met a recorded stall
    /// of the store itself (the PostgreSQL probe), not a fault of the gateway's making.
    pub final_retries_in_stalls: usize,
    pub violations: Vec<String>,
}

fn overlaps(a: (Duration, Duration), b: (Duration, Duration)) -> bool {
    a.0 <= b.1 && b.0 <= a.1
}

/// The kill or pause of `gateway` that overlaps `window`, if any.
fn crash(events: &[Event], gateway: usize, window: (Duration, Duration)) -> Option<&Event> {
    events
        .iter()
        .find(|e| e.crash && e.gateways.contains(&gateway) && overlaps((e.start, e.end), window))
}

/// Any fault that hit `gateway` during `window`, a crash first.
fn fault(events: &[Event], gateway: usize, window: (Duration, Duration)) -> Option<&Event> {
    crash(events, gateway, window).or_else(|| {
        events
            .iter()
            .find(|e| e.gateways.contains(&gateway) && overlaps((e.start, e.end), window))
    })
}

impl Verdict {
    pub fn judge(keys: &[KeyHistory], execs: &Executions, events: &[Event], seconds: u64) -> Self {
        let mut v = Self {
            keys: keys.len(),
            executions: execs.total(),
            ..Self::default()
        };
        let mut latencies = Vec::new();
        for key in keys {
            v.judge_key(key, execs, events, &mut latencies);
        }
        latencies.sort();
        if let Some(&max) = latencies.last() {
            v.max_ok = max;
            v.p99_ok = latencies[(latencies.len() * 99 / 100).min(latencies.len() - 1)];
        }
        // A run that proves nothing is not a pass.
        let floor = usize::try_from(seconds).unwrap_or(usize::MAX).saturating_mul(3);
        if v.keys < floor {
            v.violations
                .push(format!("only {} keys written, fewer than {floor}", v.keys));
        }
        if v.quiet_ok * 2 < v.quiet_attempts {
            v.violations.push(format!(
                "most requests failed outside the faults: {} of {}",
                v.quiet_attempts - v.quiet_ok,
                v.quiet_attempts
            ));
        }
        if v.final_keys == 0 {
            v.violations.push("no key written in the final phase".to_owned());
        }
        v
    }

    fn judge_key(
        &mut self,
        key: &KeyHistory,
        execs: &Executions,
        events: &[Event],
        latencies: &mut Vec<Duration>,
    ) {
        let ns = key.namespaced();
        let mut runs = execs.of(&ns);
        runs.sort_by_key(|e| e.start);
        self.final_keys += usize::from(key.final_phase);
        for a in &key.attempts {
            self.attempts += 1;
            let quiet = !events
                .iter()
                .any(|e| overlaps((e.start, e.end), (a.start, a.end)));
            self.quiet_attempts += usize::from(quiet);
            let ok = matches!(a.outcome, Outcome::Ok { .. });
            if quiet && !ok && !matches!(a.outcome, Outcome::GaveUp) && self.quiet_failures.len() < 8 {
                self.quiet_failures.push(format!(
                    "{:.2?}..{:.2?} gateway {}: {:?}",
                    a.start, a.end, a.gateway, a.outcome
                ));
            }
            match &a.outcome {
                Outcome::Ok { exec, replayed } => {
                    self.ok_attempts += 1;
                    self.quiet_ok += usize::from(quiet);
                    self.replays += usize::from(*replayed);
                    latencies.push(a.end - a.start);
                    if !runs.iter().any(|r| r.id == *exec) {
                        self.violations.push(format!(
                            "{ns}: answered with execution {exec}, which the upstream never ran for this key"
                        ));
                    }
                }
                Outcome::Foreign(body) => self
                    .violations
                    .push(format!("{ns}: attempt {} got another key's body: {body}", a.id)),
                Outcome::Status(status, slug) => {
                    *self.statuses.entry(format!("{status} {slug}")).or_default() += 1;
                    let retryable = matches!(
                        (status, slug.as_str()),
                        (503, "store-unavailable") | (409, "request-in-flight") | (502 | 504, _)
                    );
                    if !retryable {
                        self.violations
                            .push(format!("{ns}: attempt {} got {status} {slug}", a.id));
                    }
                }
                Outcome::GaveUp => self.gave_up += 1,
                Outcome::Timeout => {
                    if crash(events, a.gateway, (a.start, a.end)).is_some() {
                        self.timeouts_on_dead += 1;
                    } else {
                        self.violations.push(format!(
                            "{ns}: attempt {} on live gateway {} hung past {BOUND:?} (from {:?})",
                            a.id, a.gateway, a.start
                        ));
                    }
                }
                Outcome::Error(e) => {
                    let kind = if e.contains("Connect") {
                        "connect error"
                    } else {
                        "connection error"
                    };
                    *self.statuses.entry(kind.to_owned()).or_default() += 1;
                }
            }
        }
        if !key.done {
            self.violations
                .push(format!("{ns}: never written ({} attempts)", key.attempts.len()));
            return;
        }
        // Once healed, every key must succeed at once, unless each failed attempt met an event
        // on its gateway; after the nemesis only the store probe's stalls record such events.
        if let [failed @ .., _] = key.attempts.as_slice()
            && key.final_phase
            && !failed.is_empty()
        {
            if failed
                .iter()
                .all(|a| fault(events, a.gateway, (a.start, a.end)).is_some())
            {
                self.final_retries_in_stalls += 1;
            } else {
                self.violations.push(format!(
                    "{ns}: final phase needed {} attempts: {:?}",
                    key.attempts.len(),
                    key.attempts.iter().map(|a| &a.outcome).collect::<Vec<_>>()
                ));
            }
        }
        match runs.len() {
            0 => self.violations.push(format!("{ns}: written but never executed")),
            1 => self.exactly_once += 1,
            n => {
                let mut reasons = Vec::new();
                for (i, r) in runs[..n - 1].iter().enumerate() {
                    let attempt = key.attempts.iter().find(|a| a.id == r.attempt);
                    let reason = attempt.and_then(|a| {
                        // An execution the upstream never saw end was cut off some time before
                        // the next one took the key over; its client leaving does not end it
                        // (the gateway runs an execution to its end without its client).
                        let cut_off = a.end.max(runs[i + 1].start);
                        let end = r.end.map_or(cut_off, |e| (e + RECORD_MARGIN).max(a.end));
                        // A kill or pause counts from the moment the gateway held the request:
                        // paused between its lease check and its write to the upstream, it
                        // forwards the request as it resumes, past its lease, and the upstream
                        // sees the execution start a moment after the nemesis records the
                        // pause's end. Other faults count from the execution's start.
                        crash(events, a.gateway, (a.start.min(r.start), end))
                            .or_else(|| fault(events, a.gateway, (r.start, end)))
                    });
                    match reason {
                        Some(e) => reasons.push(e.what.clone()),
                        None => {
                            self.violations.push(format!(
                                "{ns}: executed {n} times; execution {} (attempt {}, from {:?} to {:?}) \
                                 was cut off by no fault of its gateway; attempts: {:?}",
                                r.id, r.attempt, r.start, r.end, key.attempts
                            ));
                            return;
                        }
                    }
                }
                *self
                    .excused
                    .entry(format!("{n} executions: {}", reasons.join("; ")))
                    .or_default() += 1;
            }
        }
    }

    /// Judges the re-reads (`workload::reread`): each must replay the execution its client
    /// accepted. A new execution is excused only when a fault hit the accepted execution's
    /// gateway before it could record the outcome (the client got the response anyway).
    pub fn judge_rereads(
        &mut self,
        keys: &[KeyHistory],
        answers: &[Option<Attempt>],
        execs: &Executions,
        events: &[Event],
    ) {
        for (key, answer) in keys.iter().zip(answers) {
            let (Some(answer), Some(last)) = (answer, key.attempts.last()) else {
                continue;
            };
            let Outcome::Ok { exec: accepted, .. } = last.outcome else {
                continue;
            };
            let ns = key.namespaced();
            match answer.outcome {
                Outcome::Ok { exec, replayed: true } if exec == accepted => self.rereads_replayed += 1,
                Outcome::Ok { exec, replayed: true } => self.violations.push(format!(
                    "{ns}: re-read replayed execution {exec}, but its client accepted {accepted}"
                )),
                Outcome::Ok { replayed: false, .. } => {
                    let run = execs.of(&ns).into_iter().find(|r| r.id == accepted);
                    let cause = run.and_then(|r| {
                        let end = r.end.map_or(last.end, |e| (e + RECORD_MARGIN).max(last.end));
                        fault(events, last.gateway, (r.start, end))
                    });
                    match cause {
                        Some(e) => *self.rereads_unrecorded.entry(e.what.clone()).or_default() += 1,
                        None => self.violations.push(format!(
                            "{ns}: completed (execution {accepted}, attempt {}) yet executed again on re-read",
                            last.id
                        )),
                    }
                }
                ref other => self.violations.push(format!("{ns}: re-read answered {other:?}")),
            }
        }
    }

    pub fn print(&self, store: &str, events: &[Event], heal: Duration) {
        println!("checker[{store}]: nemesis turns:");
        for e in events {
            println!(
                "  {:>7.2}s..{:>7.2}s  {}",
                e.start.as_secs_f64(),
                e.end.as_secs_f64(),
                e.what
            );
        }
        println!(
            "checker[{store}]: {} keys ({} in the final phase), {} attempts, {} ok ({} replays), \
             {} upstream executions; heal took {heal:.2?}",
            self.keys, self.final_keys, self.attempts, self.ok_attempts, self.replays, self.executions
        );
        println!(
            "checker[{store}]: outside the faults {} of {} attempts ok; ok latency p99 {:.0?}, max {:.0?}; \
             {} impatient give-ups, {} timeouts on a killed or paused gateway; other answers {:?}",
            self.quiet_ok,
            self.quiet_attempts,
            self.p99_ok,
            self.max_ok,
            self.gave_up,
            self.timeouts_on_dead,
            self.statuses
        );
        for f in &self.quiet_failures {
            println!("  failed outside the faults: {f}");
        }
        if self.final_retries_in_stalls > 0 {
            println!(
                "checker[{store}]: {} final-phase keys needed a retry, each failed attempt during a \
                 stall of the store itself (listed with the turns)",
                self.final_retries_in_stalls
            );
        }
        let excused: usize = self.excused.values().sum();
        println!(
            "checker[{store}]: {} keys executed exactly once, {excused} more than once at a documented \
             crash point (on_lease_expiry: retry: the owner died, was paused past its lease, or could \
             not record the outcome while its client had given up, and a retry took over):",
            self.exactly_once
        );
        for (why, n) in &self.excused {
            println!("  {n:>4}  {why}");
        }
        let unrecorded: usize = self.rereads_unrecorded.values().sum();
        println!(
            "checker[{store}]: re-read of every key: {} replayed the accepted execution; {unrecorded} ran \
             again because a fault kept the owner from recording an outcome its client did get:",
            self.rereads_replayed
        );
        for (why, n) in &self.rereads_unrecorded {
            println!("  {n:>4}  {why}");
        }
        if self.violations.is_empty() {
            println!("checker[{store}]: PASS");
        } else {
            println!("checker[{store}]: FAIL, {} violations:", self.violations.len());
            for v in self.violations.iter().take(20) {
                println!("  {v}");
            }
        }
    }

    pub fn assert_pass(&self) {
        assert!(
            self.violations.is_empty(),
            "{:#?}",
            &self.violations[..self.violations.len().min(20)]
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::Exec;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Whether one of the verdict's violations mentions `text`.
    fn violated(v: &Verdict, text: &str) -> bool {
        v.violations.iter().any(|m| m.contains(text))
    }

    /// The event of `window` (milliseconds), if there is one.
    fn event(window: Option<(u64, u64)>, what: &str, gateways: Vec<usize>, crash: bool) -> Vec<Event> {
        window
            .map(|(start, end)| Event {
                what: what.to_owned(),
                gateways,
                crash,
                start: ms(start),
                end: ms(end),
            })
            .into_iter()
            .collect()
    }

    /// The history of CI's run on a9d71ee: gateway 1 is paused while it holds the first
    /// attempt, forwards it as it resumes (the upstream sees the start 0.7 ms after the
    /// nemesis recorded the pause's end), and answers 504 at once (its upstream timeout ran out
    /// during the pause), which releases the key; the retry on gateway 0 runs it again.
    fn paused_before_forwarding(pause: Option<(u64, u64)>) -> Verdict {
        let key = KeyHistory {
            raw: "k".to_owned(),
            final_phase: false,
            attempts: vec![
                Attempt {
                    id: "a0".to_owned(),
                    gateway: 1,
                    start: ms(2_441),
                    end: ms(5_495),
                    outcome: Outcome::Status(504, "upstream-timeout".to_owned()),
                },
                Attempt {
                    id: "a1".to_owned(),
                    gateway: 0,
                    start: ms(5_574),
                    end: ms(5_637),
                    outcome: Outcome::Ok {
                        exec: 2,
                        replayed: false,
                    },
                },
            ],
            done: true,
            body: String::new(),
            delay: String::new(),
        };
        let execs = Executions::default();
        let ns = key.namespaced();
        execs.record(
            &ns,
            Exec {
                id: 1,
                attempt: "a0".to_owned(),
                start: ms(5_488),
                end: None,
            },
        );
        execs.record(
            &ns,
            Exec {
                id: 2,
                attempt: "a1".to_owned(),
                start: ms(5_580),
                end: Some(ms(5_600)),
            },
        );
        let events = event(pause, "SIGSTOP of gateway 1 past the lease", vec![1], true);
        Verdict::judge(&[key], &execs, &events, 12)
    }

    #[test]
    fn a_pause_while_the_gateway_holds_the_request_excuses_the_execution_it_forwards_on_resuming() {
        let v = paused_before_forwarding(Some((2_440, 5_487)));
        // A one-key run also gets the run-wide complaints (too few keys, no final phase).
        assert!(!violated(&v, "k:"), "{:?}", v.violations);
        assert_eq!(v.excused.values().sum::<usize>(), 1, "{:?}", v.excused);
    }

    #[test]
    fn without_a_crash_the_same_history_is_a_violation() {
        let v = paused_before_forwarding(None);
        assert!(violated(&v, "executed 2 times"), "{:?}", v.violations);
    }

    /// CI's history on 150e277: a final-phase key whose first attempt got 503 while nothing
    /// was faulted; its retry succeeded.
    fn final_phase_retry(stall: Option<(u64, u64)>) -> Verdict {
        let attempt = |id: &str, start, end, outcome| Attempt {
            id: id.to_owned(),
            gateway: 1,
            start: ms(start),
            end: ms(end),
            outcome,
        };
        let key = KeyHistory {
            raw: "f".to_owned(),
            final_phase: true,
            attempts: vec![
                attempt(
                    "a0",
                    14_800,
                    15_310,
                    Outcome::Status(503, "store-unavailable".to_owned()),
                ),
                attempt(
                    "a1",
                    15_400,
                    15_420,
                    Outcome::Ok {
                        exec: 1,
                        replayed: false,
                    },
                ),
            ],
            done: true,
            body: String::new(),
            delay: String::new(),
        };
        let execs = Executions::default();
        execs.record(
            &key.namespaced(),
            Exec {
                id: 1,
                attempt: "a1".to_owned(),
                start: ms(15_401),
                end: Some(ms(15_410)),
            },
        );
        let what = "PostgreSQL write took 600ms (probe, direct)";
        let events = event(stall, what, vec![0, 1], false);
        Verdict::judge(&[key], &execs, &events, 12)
    }

    #[test]
    fn a_final_phase_retry_is_a_violation_on_a_healthy_store() {
        let v = final_phase_retry(None);
        assert!(
            violated(&v, "final phase needed 2 attempts"),
            "{:?}",
            v.violations
        );
        // A stall that ended before the attempt began excuses nothing either.
        let v = final_phase_retry(Some((13_000, 13_600)));
        assert!(
            violated(&v, "final phase needed 2 attempts"),
            "{:?}",
            v.violations
        );
    }

    #[test]
    fn a_final_phase_retry_during_a_stall_of_the_store_is_named_not_failed() {
        let v = final_phase_retry(Some((14_750, 15_350)));
        assert!(!violated(&v, "final phase"), "{:?}", v.violations);
        assert_eq!(v.final_retries_in_stalls, 1);
    }

    #[test]
    fn a_pause_that_ended_before_the_attempt_began_excuses_nothing() {
        let v = paused_before_forwarding(Some((1_000, 2_000)));
        assert!(violated(&v, "executed 2 times"), "{:?}", v.violations);
    }
}
