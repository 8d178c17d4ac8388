#!/usr/bin/env python3
"""Ratio targets from interleaved rounds (bench/ab.sh lines), judged pair by pair.

A full run (bench/run.sh) measures each row once per repeat, minutes apart from the row it is
compared with; on a VM whose speed moves by a quarter between rows that decides a ratio by
chance. Here every ratio is taken within one round of bench/ab.sh, between two rows measured
seconds apart, and the target is judged on the median of those per-round ratios, by req/s and
by CPU per request (the denominator's CPU over the numerator's: the rate each would reach on
the same CPU). bench/targets.sh runs the rounds and calls this.

    pairs.py --ratio NAME NUMERATOR DENOMINATOR MIN [--ratio ...] [FILE]

NUMERATOR and DENOMINATOR are the labels bench/ab.sh printed (its arguments, e.g. `nginx` or
`embedded:replay:/tmp/idemgate`; a path with a space in it is not read). Lines that are not
ab.sh results are ignored; a label twice in one round is an error.

The verdict is settled only when the whole of a distribution-free interval of the median (order
statistics of the per-round ratios, at least 90% coverage) lies on one side of the target:
PASS or MISS. Otherwise it says "not settled" with the side the median falls on: on a VM where
two adjacent rows differ by a fifth, ten pairs can leave a ratio of 1.04 undecided.
"""

import argparse
import math
import re
import statistics
import sys

LINE = re.compile(r"^(\S+) round=(\d+) rps=([\d.]+) .*?\bcpu_us=([\d.]+)")


def median(xs):
    """The middle value; with an even count the mean of the middle two, as bench/report.py. None
    without values."""
    return statistics.median(xs) if xs else None


def interval(xs, coverage=0.90):
    """(low, high): order statistics x_(k) and x_(n+1-k) of the values, k the largest for which
    the interval covers the median with at least `coverage` whatever the distribution (the
    binomial sign-test interval); None when even the full range covers less (fewer than 5)."""
    xs = sorted(xs)
    n = len(xs)
    best = None
    cumulative = 0.0  # P(Binomial(n, 1/2) <= k - 1)
    for k in range(1, n // 2 + 1):
        cumulative += math.comb(n, k - 1) / 2**n
        if 1 - 2 * cumulative < coverage:
            break
        best = (xs[k - 1], xs[n - k])
    return best


def parse(lines):
    """{round: {label: (rps, cpu_us)}} from ab.sh's result lines."""
    rounds = {}
    for line in lines:
        m = LINE.match(line.strip())
        if not m:
            continue
        label, rnd, rps, cpu = m.group(1), int(m.group(2)), float(m.group(3)), float(m.group(4))
        row = rounds.setdefault(rnd, {})
        if label in row:
            # Two outputs pasted together, or one binary given twice: which to pair is unknown.
            sys.exit(f"pairs: {label} appears twice in round {rnd}")
        row[label] = (rps, cpu)
    return rounds


def judge(rounds, num, den, minimum):
    """Per-round ratios of NUM over DEN in rounds that measured both, and the verdicts."""
    by_rps, by_cpu = [], []
    for rnd in sorted(rounds):
        row = rounds[rnd]
        if num in row and den in row and row[num][0] > 0 and row[den][0] > 0:
            by_rps.append(row[num][0] / row[den][0])
            if row[num][1] > 0 and row[den][1] > 0:
                by_cpu.append(row[den][1] / row[num][1])
    med_rps, med_cpu = median(by_rps), median(by_cpu)
    span = interval(by_rps)
    if med_rps is None:
        verdict = "n/a"
    elif span and span[0] >= minimum:
        verdict = "PASS"
    elif span and span[1] < minimum:
        verdict = "MISS"
    else:
        verdict = "not settled (median " + ("above" if med_rps >= minimum else "below") + ")"
    return {
        "pairs": len(by_rps),
        "rps": med_rps,
        "rps_range": (min(by_rps), max(by_rps)) if by_rps else None,
        "rps_interval": span,
        "cpu": med_cpu,
        "cpu_range": (min(by_cpu), max(by_cpu)) if by_cpu else None,
        "above": sum(r >= minimum for r in by_rps),
        "verdict": verdict,
    }


def fmt(value, span):
    if value is None:
        return "-"
    return f"{value:.3f} ({span[0]:.3f}-{span[1]:.3f})"


def table(rounds, ratios):
    out = [
        "| target | min | by req/s, median of pairs (range) | 90% interval of the median "
        "| by CPU, median (range) | pairs at or above | verdict |",
        "|---|---:|---|---|---|---:|---|",
    ]
    for name, num, den, minimum in ratios:
        j = judge(rounds, num, den, minimum)
        span = j["rps_interval"]
        span = f"{span[0]:.3f}-{span[1]:.3f}" if span else "- (under 5 pairs)"
        out.append(
            f"| {name} | {minimum:g} | {fmt(j['rps'], j['rps_range'])} | {span} "
            f"| {fmt(j['cpu'], j['cpu_range'])} | {j['above']} of {j['pairs']} | {j['verdict']} |"
        )
    out += ["", "| row | req/s, median (range) | CPU per request, µs, median (range) | rounds |",
            "|---|---|---|---:|"]
    labels = []
    for rnd in sorted(rounds):
        labels += [label for label in rounds[rnd] if label not in labels]
    for label in labels:
        rps = [rounds[r][label][0] for r in rounds if label in rounds[r]]
        cpu = [rounds[r][label][1] for r in rounds if label in rounds[r]]
        out.append(
            f"| {label} | {median(rps):,.0f} ({min(rps):,.0f}-{max(rps):,.0f}) "
            f"| {median(cpu):.1f} ({min(cpu):.1f}-{max(cpu):.1f}) | {len(rps)} |"
        )
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ratio", nargs=4, action="append", required=True,
                    metavar=("NAME", "NUMERATOR", "DENOMINATOR", "MIN"))
    ap.add_argument("file", nargs="?")
    args = ap.parse_args()
    lines = open(args.file).readlines() if args.file else sys.stdin.readlines()
    rounds = parse(lines)
    if not rounds:
        sys.exit("pairs: no bench/ab.sh result lines in the input")
    ratios = [(n, a, b, float(m)) for n, a, b, m in args.ratio]
    print(table(rounds, ratios))


if __name__ == "__main__":
    main()
