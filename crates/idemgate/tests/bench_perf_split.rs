//! `bench/perf_split.py`, which turns a `perf report` of a measured run into microseconds per
//! request (bench/ab.sh with BENCH_PERF_DIR), on fixed report text: shares are normalised over
//! what the report lists, the kernel's `[k]` symbols and the program, libc and vDSO are told
//! apart, and two runs are compared symbol by symbol, the second minus the first. A split that
//! takes the percentages as they are, puts libc in the kernel or subtracts the wrong way round
//! fails here.
//!
//! Needs `python3` (standard library only, as the harness); without it the test prints that it
//! was skipped.

use std::path::Path;
use std::process::Command;

/// A passthrough's report as `perf report --sort dso,sym --stdio -g none` prints it, with its
/// header lines, listing 80% of the samples (the rest under the percent limit).
const PASSTHROUGH: &str = "\
# Samples: 15K of event 'cpu-clock:ppp'
#
# Overhead  Shared Object      Symbol
# ........  .................  ......
#
    40.00%  [kernel.kallsyms]  [k] _raw_spin_unlock_irqrestore
    20.00%  idemgate           [.] hyper::proto::h1::role::parse
    12.00%  libc.so.6          [.] __memmove_avx512_unaligned_erms
     8.00%  [vdso]             [.] __vdso_clock_gettime
";

/// A miss's: the same symbols and one of the store's.
const MISS: &str = "\
    30.00%  [kernel.kallsyms]  [k] _raw_spin_unlock_irqrestore
    30.00%  idemgate           [.] hyper::proto::h1::role::parse
    20.00%  idemgate           [.] idemgate_core::memory::MemoryStore::put
    10.00%  libc.so.6          [.] __memmove_avx512_unaligned_erms
    10.00%  [vdso]             [.] __vdso_clock_gettime
";

fn split(args: &[(&str, &str)]) -> Option<String> {
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
    .arg("--report");
    for (i, (text, cpu_us)) in args.iter().enumerate() {
        let file = dir.path().join(format!("report-{i}.txt"));
        std::fs::write(&file, text).unwrap();
        cmd.arg(file).arg(cpu_us);
    }
    let run = cmd.output().unwrap();
    assert!(
        run.status.success(),
        "perf_split.py failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    Some(String::from_utf8(run.stdout).unwrap())
}

#[test]
fn a_run_splits_its_cpu_per_request_by_the_shares_listed() {
    let Some(out) = split(&[(PASSTHROUGH, "16.0")]) else {
        return;
    };
    // 40/80 of 16 µs in the kernel; the program 20/80, libc 12/80 and the vDSO 8/80.
    assert!(
        out.lines()
            .next()
            .unwrap()
            .ends_with("cpu_us=16.00 kernel_us=8.00 user_us=8.00 program_us=4.00 libc_us=2.40 vdso_us=1.60"),
        "{out}"
    );
    assert!(out.contains("   8.000  [k] _raw_spin_unlock_irqrestore"), "{out}");
    assert!(out.contains("   4.000  hyper::proto::h1::role::parse"), "{out}");
}

#[test]
fn two_runs_compare_symbol_by_symbol_second_minus_first() {
    let Some(out) = split(&[(PASSTHROUGH, "16.0"), (MISS, "20.0")]) else {
        return;
    };
    // The store's put is only in the miss: 20% of 20 µs. The kernel symbol: 6.0 - 8.0.
    assert!(
        out.contains("  +4.000  (0.000, 4.000)  idemgate_core::memory::MemoryStore::put"),
        "{out}"
    );
    assert!(
        out.contains("  -2.000  (8.000, 6.000)  [k] _raw_spin_unlock_irqrestore"),
        "{out}"
    );
    assert!(
        out.contains("  +2.000  (4.000, 6.000)  hyper::proto::h1::role::parse"),
        "{out}"
    );
    // The largest difference comes first.
    let first = out
        .lines()
        .skip_while(|l| !l.starts_with("second minus first"))
        .nth(1)
        .unwrap();
    assert!(first.ends_with("MemoryStore::put"), "{out}");
}
