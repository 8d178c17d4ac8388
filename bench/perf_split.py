#!/usr/bin/env python3
"""Where a row's CPU per request goes: kernel or user space, and by symbol.

    bench/perf_split.py DATA CPU_US [DATA CPU_US]
    bench/perf_split.py --report FILE CPU_US [FILE CPU_US]   (saved `perf report` text, for tests)
    bench/perf_split.py --totals DATA CPU_US                 (the first line only: bench/ab.sh)

DATA is a `perf record` of the process under test during a measured run (bench/ab.sh writes one
per row and round with BENCH_PERF_DIR), CPU_US that run's CPU microseconds per request (ab.sh's
cpu_us). Each symbol's share of the samples times CPU_US is its microseconds per request; the
shares are normalised over what the report lists, so the parts add up to CPU_US. A sampling
profile reads where the time went, not how much there was: CPU_US is the measure, perf only
splits it.

With one DATA: the kernel and user-space totals (user space split into the program, libc and
the vDSO) and the symbols with the most self time. With two: both totals, then the symbols whose
time per request differs most between them (the second minus the first), so a miss can be read
against a passthrough, or a build against another.

Standard library only, as the rest of the harness; needs `perf` unless --report is given.
"""
import re
import subprocess
import sys

LINE = re.compile(r"^\s*([\d.]+)%\s+(\S+)\s+\[(.)\]\s+(.*?)\s*$")
TOP = 25


def report_text(path, saved):
    if saved:
        with open(path, encoding="utf-8") as f:
            return f.read()
    args = ["perf", "report", "-i", path, "--no-children", "--sort", "dso,sym", "--stdio",
            "-g", "none", "--percent-limit", "0"]
    return subprocess.run(args, capture_output=True, text=True, check=True).stdout


def parse(text, cpu_us):
    """Symbol -> (part, µs per request), part being kernel, program, libc or vdso."""
    rows = []
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            pct, dso, kind, sym = float(m[1]), m[2], m[3], m[4]
            if kind == "k":
                part = "kernel"
            elif dso.startswith("libc.so"):
                part = "libc"
            elif dso == "[vdso]":
                part = "vdso"
            else:
                part = "program"
            rows.append((part, sym, pct))
    total = sum(pct for _, _, pct in rows)
    if total <= 0:
        raise SystemExit("perf_split: the report lists no samples")
    out = {}
    for part, sym, pct in rows:
        key = ("[k] " if part == "kernel" else "") + sym
        old = out.get(key, (part, 0.0))[1]
        out[key] = (part, old + pct / total * cpu_us)
    return out


def totals(split):
    by = {"kernel": 0.0, "program": 0.0, "libc": 0.0, "vdso": 0.0}
    for part, us in split.values():
        by[part] += us
    user = by["program"] + by["libc"] + by["vdso"]
    return (f"kernel_us={by['kernel']:.2f} user_us={user:.2f} program_us={by['program']:.2f} "
            f"libc_us={by['libc']:.2f} vdso_us={by['vdso']:.2f}")


def main(argv):
    saved = bool(argv) and argv[0] == "--report"
    if saved:
        argv = argv[1:]
    only_totals = bool(argv) and argv[0] == "--totals"
    if only_totals:
        argv = argv[1:]
    if len(argv) not in (2, 4):
        raise SystemExit(__doc__)
    runs = [(argv[i], float(argv[i + 1])) for i in range(0, len(argv), 2)]
    splits = [parse(report_text(path, saved), cpu) for path, cpu in runs]
    for (path, cpu), split in zip(runs, splits):
        print(f"{path}: cpu_us={cpu:.2f} {totals(split)}")
    if only_totals:
        return
    if len(splits) == 1:
        rows = sorted(splits[0].items(), key=lambda kv: -kv[1][1])[:TOP]
        for sym, (_, us) in rows:
            print(f"{us:8.3f}  {sym}")
        return
    a, b = splits
    diff = {sym: b.get(sym, (None, 0.0))[1] - a.get(sym, (None, 0.0))[1] for sym in set(a) | set(b)}
    print("second minus first, µs per request (first, second):")
    for sym in sorted(diff, key=lambda s: -abs(diff[s]))[:TOP]:
        print(f"{diff[sym]:+8.3f}  ({a.get(sym, (None, 0.0))[1]:.3f}, {b.get(sym, (None, 0.0))[1]:.3f})  {sym}")


if __name__ == "__main__":
    main(sys.argv[1:])
