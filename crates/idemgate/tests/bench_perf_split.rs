//! `bench/perf_split.py`, which turns a `perf report` of a measured run into microseconds per
//! request (bench/ab.sh with BENCH_PERF_DIR), on fixed report text: the kernel's `[k]` symbols,
//! libc (an old glibc's `libc-2.31.so` too), the vDSO and the rest of user space are told apart,
//! two runs are compared symbol by symbol, the second minus the first, and a report it cannot
//! trust (no kernel samples, rows it could not read) is refused instead of split. A split that
//! files libc under the program or the kernel, subtracts the wrong way round, or reads a report
//! without kernel samples as all user space fails here.
//!
//! Needs `python3` (standard library only, as the harness); without it the test prints that it
//! was skipped.

use std::path::Path;
use std::process::{Command, Output};

/// A passthrough's report as `perf report --sort dso,sym --stdio -g none --percent-limit 0`
/// prints it, header lines included; a dso with spaces in its name and an old glibc's libc.
const PASSTHROUGH: &str = "\
# Samples: 15K of event 'cpu-clock:ppp'
#
# Overhead  Shared Object      Symbol
# ........  .................  ......
#
    40.00%  [kernel.kallsyms]  [k] _raw_spin_unlock_irqrestore
    20.00%  idemgate           [.] hyper::proto::h1::role::parse
    12.00%  libc.so.6          [.] __memmove_avx512_unaligned_erms
    10.00%  memfd:x (deleted)  [.] 0x0000000000001234
    10.00%  libc-2.31.so       [.] __memcpy_sse2_unaligned
     8.00%  [vdso]             [.] __vdso_clock_gettime
";

/// A miss's: the same symbols, and one of the store's.
const MISS: &str = "\
    30.00%  [kernel.kallsyms]  [k] _raw_spin_unlock_irqrestore
    30.00%  idemgate           [.] hyper::proto::h1::role::parse
    20.00%  idemgate           [.] idemgate_core::memory::MemoryStore::put
    10.00%  libc.so.6          [.] __memmove_avx512_unaligned_erms
    10.00%  [vdso]             [.] __vdso_clock_gettime
";

fn run(flags: &[&str], reports: &[(&str, &str)]) -> Option<Output> {
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!("skipped: no python3");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new("python3");
    cmd.arg(Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../bench/perf_split.py"
    )))
    .arg("--report")
    .args(flags);
    for (i, (text, cpu_us)) in reports.iter().enumerate() {
        let file = dir.path().join(format!("report-{i}.txt"));
        std::fs::write(&file, text).unwrap();
        cmd.arg(file).arg(cpu_us);
    }
    Some(cmd.output().unwrap())
}

fn split(flags: &[&str], reports: &[(&str, &str)]) -> Option<String> {
    let out = run(flags, reports)?;
    assert!(
        out.status.success(),
        "perf_split.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(String::from_utf8(out.stdout).unwrap())
}

/// 20 µs per request: the kernel 40% (8.0), the program 20% + 10% (6.0), libc 12% + 10% (4.4),
/// the vDSO 8% (1.6).
const PASSTHROUGH_TOTALS: &str = "kernel_us=8.00 user_us=12.00 program_us=6.00 libc_us=4.40 vdso_us=1.60";

#[test]
fn a_run_splits_its_cpu_per_request_into_kernel_and_user_space() {
    let Some(out) = split(&[], &[(PASSTHROUGH, "20.0")]) else {
        return;
    };
    let first = out.lines().next().unwrap();
    assert!(
        first.ends_with(&format!("cpu_us=20.00 {PASSTHROUGH_TOTALS}")),
        "{out}"
    );
    assert!(
        out.contains("   8.000  [kernel] _raw_spin_unlock_irqrestore"),
        "{out}"
    );
    assert!(
        out.contains("   4.000  [program] hyper::proto::h1::role::parse"),
        "{out}"
    );
    assert!(out.contains("   2.000  [libc] __memcpy_sse2_unaligned"), "{out}");
}

#[test]
fn the_totals_are_the_fields_bench_ab_adds_to_its_line() {
    let Some(out) = split(&["--totals"], &[(PASSTHROUGH, "20.0")]) else {
        return;
    };
    assert_eq!(out, format!("{PASSTHROUGH_TOTALS}\n"));
}

#[test]
fn two_runs_compare_symbol_by_symbol_second_minus_first() {
    let Some(out) = split(&[], &[(PASSTHROUGH, "20.0"), (MISS, "25.0")]) else {
        return;
    };
    // The store's put is only in the miss: 20% of 25 µs. The kernel symbol: 7.5 - 8.0.
    for expected in [
        "  +5.000  (0.000, 5.000)  [program] idemgate_core::memory::MemoryStore::put",
        "  +3.500  (4.000, 7.500)  [program] hyper::proto::h1::role::parse",
        "  -0.500  (8.000, 7.500)  [kernel] _raw_spin_unlock_irqrestore",
    ] {
        assert!(out.contains(expected), "no {expected:?} in:\n{out}");
    }
    // The largest difference comes first.
    let first = out
        .lines()
        .skip_while(|l| !l.starts_with("second minus first"))
        .nth(1)
        .unwrap();
    assert!(first.ends_with("MemoryStore::put"), "{out}");
}

#[test]
fn a_report_it_cannot_trust_is_refused() {
    // perf without access to the kernel's samples drops them and succeeds: all user space.
    let user_only = "\
    60.00%  idemgate           [.] hyper::proto::h1::role::parse
    40.00%  libc.so.6          [.] __memmove_avx512_unaligned_erms
";
    // Rows that add up to 80%: some were not read.
    let partial = "\
    50.00%  [kernel.kallsyms]  [k] _raw_spin_unlock_irqrestore
    30.00%  idemgate           [.] hyper::proto::h1::role::parse
";
    for (report, why) in [(user_only, "no kernel samples"), (partial, "80.0%")] {
        let Some(out) = run(&["--totals"], &[(report, "10.0")]) else {
            return;
        };
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "accepted:\n{report}");
        assert!(out.stdout.is_empty(), "split anyway:\n{report}");
        assert!(stderr.contains(why), "{stderr}");
    }
}
