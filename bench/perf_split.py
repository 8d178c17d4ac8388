#!/usr/bin/env python3
"""Where a row's CPU per request goes: kernel or user space, and by symbol.

    bench/perf_split.py DATA CPU_US [DATA CPU_US]
    bench/perf_split.py --totals DATA CPU_US     (the split's fields only, for bench/ab.sh's line)
    bench/perf_split.py --report FILE CPU_US ... (saved `perf report` text instead of DATA, for tests)

DATA is a `perf record` of the process under test during a measured run (bench/ab.sh writes one
per row and round with BENCH_PERF_DIR), CPU_US that run's CPU microseconds per request (ab.sh's
cpu_us). Each symbol's share of the samples times CPU_US is its microseconds per request. A
sampling profile reads where the time went, not how much there was: CPU_US is the measure, perf
only splits it.

With one DATA: the kernel and user-space totals, user space split into libc (and libpthread),
the vDSO and the program (all other user space: the binary, ld.so, other libraries, [unknown]),
and the symbols with the most self time. With two: both totals, then the symbols whose time per
request differs most between them (the second minus the first), so a miss can be read against a
passthrough, or a build against another.

A report with no kernel samples is refused: a proxy always has kernel time, and perf drops the
kernel's samples without failing when it may not read them (kernel.perf_event_paranoid > 1 for
a user who is not root). So is one whose listed shares do not add up to 100%, which would mean
rows this script could not read.

Standard library only, as the rest of the harness; needs `perf` unless --report is given.
"""
import re
import subprocess
import sys

# "  12.34%  dso  [k] symbol": the dso may hold spaces ("memfd:x (deleted)"), the symbol too.
LINE = re.compile(r"^\s*([\d.]+)%\s+(.+?)\s+\[(.)\]\s+(.*?)\s*$")
ANY_ROW = re.compile(r"^\s*[\d.]+%")
LIBC = re.compile(r"^lib(c|pthread)[-.]")
PARTS = ("kernel", "program", "libc", "vdso")
TOP = 25


def fail(why):
    print(f"perf_split: {why}", file=sys.stderr)
    sys.exit(1)


def report_text(path, saved):
    if saved:
        with open(path, encoding="utf-8") as f:
            return f.read()
    args = ["perf", "report", "-i", path, "--no-children", "--sort", "dso,sym", "--stdio",
            "-g", "none", "--percent-limit", "0"]
    run = subprocess.run(args, capture_output=True, text=True, check=False)
    if run.returncode != 0:
        fail(f"perf report -i {path} failed:\n{run.stderr}")
    return run.stdout


def part_of(dso, kind):
    if kind == "k":
        return "kernel"
    if LIBC.match(dso):
        return "libc"
    if dso == "[vdso]":
        return "vdso"
    return "program"


def parse(text, cpu_us, name):
    """(part, symbol) -> µs per request."""
    rows = []
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            rows.append((part_of(m[2], m[3]), m[4], float(m[1])))
        elif ANY_ROW.match(line):
            fail(f"{name}: cannot read the report line {line!r}")
    total = sum(pct for _, _, pct in rows)
    if not rows or abs(total - 100.0) > 1.0:
        fail(f"{name}: the report's rows add up to {total:.1f}% of the samples, not 100%")
    if not any(part == "kernel" for part, _, _ in rows):
        fail(f"{name}: no kernel samples (perf may not read them: root or "
             "kernel.perf_event_paranoid <= 1)")
    out = {}
    for part, sym, pct in rows:
        out[(part, sym)] = out.get((part, sym), 0.0) + pct / total * cpu_us
    return out


def totals(split):
    by = dict.fromkeys(PARTS, 0.0)
    for (part, _), us in split.items():
        by[part] += us
    user = by["program"] + by["libc"] + by["vdso"]
    return (f"kernel_us={by['kernel']:.2f} user_us={user:.2f} program_us={by['program']:.2f} "
            f"libc_us={by['libc']:.2f} vdso_us={by['vdso']:.2f}")


def label(key):
    part, sym = key
    return f"[{part}] {sym}"


def main(argv):
    flags = {a for a in argv if a.startswith("--")}
    args = [a for a in argv if not a.startswith("--")]
    if flags - {"--report", "--totals"} or len(args) not in (2, 4) or (
        "--totals" in flags and len(args) != 2
    ):
        fail(__doc__)
    runs = [(args[i], float(args[i + 1])) for i in range(0, len(args), 2)]
    splits = [parse(report_text(path, "--report" in flags), cpu, path) for path, cpu in runs]
    if "--totals" in flags:
        print(totals(splits[0]))
        return
    for (path, cpu), split in zip(runs, splits):
        print(f"{path}: cpu_us={cpu:.2f} {totals(split)}")
    if len(splits) == 1:
        for key, us in sorted(splits[0].items(), key=lambda kv: -kv[1])[:TOP]:
            print(f"{us:8.3f}  {label(key)}")
        return
    a, b = splits
    diff = {key: b.get(key, 0.0) - a.get(key, 0.0) for key in set(a) | set(b)}
    print("second minus first, µs per request (first, second):")
    for key in sorted(diff, key=lambda k: (-abs(diff[k]), label(k)))[:TOP]:
        print(f"{diff[key]:+8.3f}  ({a.get(key, 0.0):.3f}, {b.get(key, 0.0):.3f})  {label(key)}")


if __name__ == "__main__":
    main(sys.argv[1:])
