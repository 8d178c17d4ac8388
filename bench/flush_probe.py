#!/usr/bin/env python3
"""The disk's own flush latency: what a durable store's commit waits for at the least.

    bench/flush_probe.py DIR SECONDS [PER_SECOND]

Writes 8 KiB and calls fdatasync, PER_SECOND times a second (default 2000, of the order of a
durable store's commits in an open-loop row at half load) for SECONDS, in a file of its own under
DIR (removed after), and prints one line:

    FLUSH n=... seconds=... per_s=... p50_us=... p99_us=... p999_us=... max_us=... over10ms=... over50ms=...

A disk slower than the schedule falls behind it; the probe then stops at twice SECONDS with the
flushes it has, and `seconds` and `per_s` say what it did.

Each flush is timed from its own start, not from its slot in the schedule: one stall is one slow
sample however many flushes it delays, so the maximum and the counts over 10 and 50 ms show a
stall, the percentiles do not. A calm probe rules nothing out: the stalls come and go, and the
probe runs in a window of its own (during the rows it would load the disk they measure).

Why: a commit waits for its flush, and every commit queued behind a slow flush waits for it too,
so a disk whose flushes stall for tens or hundreds of milliseconds puts those stalls in the p99 of
every durable store (embedded, PostgreSQL) and in none of nginx's. bench/run.sh runs this before
the open-loop rows of a durable store so the report can say what the disk itself did.
"""
import math
import os
import sys
import time


def main() -> int:
    if len(sys.argv) not in (3, 4):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 64
    directory, seconds = sys.argv[1], float(sys.argv[2])
    per_second = float(sys.argv[3]) if len(sys.argv) == 4 else 2000.0
    if seconds <= 0 or per_second <= 0:
        print("flush_probe: SECONDS and PER_SECOND must be over 0", file=sys.stderr)
        return 64
    count = max(1, round(seconds * per_second))
    path = os.path.join(directory, f".flush-probe-{os.getpid()}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    block = b"\0" * 8192
    latencies = []
    try:
        start = time.perf_counter()
        for i in range(count):
            due = start + i / per_second
            now = time.perf_counter()
            if now - start >= 2 * seconds:
                break
            if due > now:
                time.sleep(due - now)
            # A WAL-like pattern: overwrite a small ring of blocks, one data sync each.
            os.pwrite(fd, block, (i % 128) * 8192)
            t = time.perf_counter()
            os.fdatasync(fd)
            latencies.append(time.perf_counter() - t)
        elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
        os.unlink(path)
    latencies.sort()
    n = len(latencies)

    def q(p: float) -> int:
        # Nearest rank: the smallest value with at least p of the samples at or below it.
        return round(latencies[max(0, math.ceil(p * n) - 1)] * 1e6)

    print(
        f"FLUSH n={n} seconds={elapsed:.1f} per_s={n / elapsed:.0f} p50_us={q(0.5)} p99_us={q(0.99)} p999_us={q(0.999)} "
        f"max_us={round(latencies[-1] * 1e6)} over10ms={sum(x > 0.01 for x in latencies)} "
        f"over50ms={sum(x > 0.05 for x in latencies)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
