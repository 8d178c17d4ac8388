#!/usr/bin/env bash
# Open-loop A/B of idemgate builds: interleaved rounds of misses at a fixed rate, for changes
# aimed at the p99 target ("p99, miss at half of peak load"), which bench/run.sh measures once
# per store and which moves between rounds by more than most changes do (docs/benchmarks-journal.md).
#
#   bench/tail.sh STORE RATE ROUNDS SECONDS BIN [BIN...]
#   bench/tail.sh embedded 12000 4 8 /tmp/idemgate-before target/release/idemgate
#   bench/tail.sh postgres 2400 3 8 nginx target/release/idemgate
#
#   STORE  memory | embedded | postgres (BENCH_PG_URL, default the machine's own `test` database;
#          each round gets a schema of its own, dropped after it)
#   RATE   requests per second, sent by `idemgate-bench rate` (bench/loadgen) over 32 connections
#   BIN    an idemgate binary, or `nginx`: the nginx `proxy_pass` peer at the same rate
#          (passthrough), the reference the target is judged against
#
# Topology as in bench/run.sh: a static nginx upstream and the load generator on CPU 0, the
# gateway on CPU 1, one catch-all `accepted` route with `scope: global`, a fresh store per round.
# Latency runs from each request's intended send time (no coordinated omission). Each round
# prints p50, p90, p99, p99.9 and max; for idemgate also the store's begin and complete latency
# (the gateway's own histograms, read from its admin port: the upper bounds of the buckets that
# hold p50 and p99), CPU microseconds per request of the gateway, whole and per thread (as
# bench/ab.sh), and for postgres of PostgreSQL's processes, then user_us and sys_us: the process's
# CPU per request in user space and in the kernel (from /proc, clock ticks). Ports 18130-18133,
# 127.0.0.1 only; everything it starts is stopped on exit.
#
# BENCH_TAIL_MODE=passthrough sends idemgate requests without a key instead of misses, so the two
# can be compared at one rate, well under both peaks (a closed loop compares each at its own).
set -euo pipefail
# One block, read whole before any of it runs: bash reads a script as it goes, so an edit to
# this file during a run (which takes minutes) would change or break the run under way.
{
cd "$(dirname "$0")/.."
# shellcheck source=bench/lib.sh
source bench/lib.sh

[[ $# -ge 5 ]] || { sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit 64; }
STORE="$1" RATE="$2" ROUNDS="$3" SECS="$4"
shift 4
case "$STORE" in memory | embedded | postgres) ;; *) echo "tail: store must be memory, embedded or postgres" >&2; exit 64 ;; esac
for bin in "$@"; do
  [[ "$bin" == nginx || -x "$bin" ]] || { echo "tail: $bin is not an executable" >&2; exit 64; }
done
PG_URL="${BENCH_PG_URL:-postgres://postgres@127.0.0.1:5432/test}"
MODE="${BENCH_TAIL_MODE:-miss}"
case "$MODE" in miss | passthrough) ;; *) echo "tail: BENCH_TAIL_MODE is miss or passthrough" >&2; exit 64 ;; esac
UP_PORT=18130 GW_PORT=18132 ADMIN_PORT=18133
SCENARIO=miss
rig_start tail "$UP_PORT" psql

LOADGEN="$(build_loadgen "$PWD")" || { echo "tail: building bench/loadgen failed" >&2; exit 1; }

SCHEMAS=()
drop_schemas() {
  for s in "${SCHEMAS[@]}"; do psql -q "$PG_URL" -c "DROP SCHEMA IF EXISTS $s CASCADE" >/dev/null 2>&1 || true; done
}
trap 'drop_schemas; rig_cleanup' EXIT

# The postmaster: its backends are its children, counted by proc_ticks (bench/lib.sh) with those
# that ended, as when a round's gateway stops and its connections close.
PG_PID=""
[[ "$STORE" == postgres ]] && PG_PID="$(pgrep -o -x postgres || true)"
pg_ticks() { if [[ -n "$PG_PID" ]]; then proc_ticks "$PG_PID"; else echo 0; fi; }

# store_latency: "begin p50<=… p99<=… complete p50<=… p99<=…" from the gateway's histograms.
store_latency() {
  curl -s "http://127.0.0.1:$ADMIN_PORT/metrics" | python3 -c '
import re, sys
buckets = {}
for line in sys.stdin:
    m = re.match(r"idempotency_store_duration_seconds_bucket\{le=\"([^\"]+)\",op=\"(\w+)\"\} (\S+)", line)
    if m:
        buckets.setdefault(m[2], []).append((float("inf") if m[1] == "+Inf" else float(m[1]), float(m[3])))
out = []
for op in ("begin", "complete"):
    b = sorted(buckets.get(op, []))
    if not b or not b[-1][1]:
        continue
    def upper(q):
        return next(le for le, n in b if n >= q * b[-1][1])
    out.append(f"{op} p50<={upper(0.5) * 1000:g}ms p99<={upper(0.99) * 1000:g}ms")
print(" ".join(out))'
}

BINS=("$@")
for round in $(seq 1 "$ROUNDS"); do
  mapfile -t order < <(round_order "$round" "${BINS[@]}")
  for bin in "${order[@]}"; do
    dir="$WORK/gw-$round-$RANDOM"
    mkdir -p "$dir"
    mode="$MODE"
    if [[ "$bin" == nginx ]]; then
      mode=passthrough
      start_proxy_peer "$dir" "$GW_PORT" "$UP_PORT"
    else
      case "$STORE" in
        postgres)
          schema="idemgate_tail_$$_${round}_$RANDOM"
          SCHEMAS+=("$schema")
          psql -q "$PG_URL" -c "CREATE SCHEMA $schema" >/dev/null
          block="$(pg_store_block "$PG_URL" "$schema")" ;;
        *) block="$(local_store_block "$STORE" "$dir")" ;;
      esac
      gw_yaml "$GW_PORT" "$UP_PORT" "$block" | sed "s|^  listen: .*|&\n  admin_listen: 127.0.0.1:$ADMIN_PORT|" \
        >"$dir/idemgate.yaml"
      IDEMGATE_LOG=warn taskset -c 1 "$bin" serve --config "$dir/idemgate.yaml" >"$dir/log" 2>&1 &
    fi
    gw=$!
    PIDS+=("$gw")
    rig_wait "$GW_PORT" 20
    cpu_pid="$gw"
    if [[ "$bin" == nginx ]]; then cpu_pid="$(pgrep -P "$gw" | head -n1)"; fi
    cpu_by_thread "$cpu_pid" >"$dir/t0"
    us0="$(proc_user_sys "$cpu_pid")"
    p0="$(pg_ticks)"
    line="$(taskset -c 0 "$LOADGEN" rate --url "http://127.0.0.1:$GW_PORT/api/v1/orders" --rate "$RATE" \
      --duration "$SECS" --warmup 1 --connections 32 --mode "$mode" --prefix "tail$round$RANDOM" | grep '^RESULT' || true)"
    cpu_by_thread "$cpu_pid" >"$dir/t1"
    us1="$(proc_user_sys "$cpu_pid")"
    p1="$(pg_ticks)"
    requests="$(kv "$line" requests)"
    [[ -n "$requests" && "$requests" -gt 0 ]] || { echo "tail: no result from the load generator for $bin" >&2; exit 1; }
    # Ticks are 1/100 s and cover the warm-up second too: RATE * (SECS + 1) requests.
    sent=$((RATE * (SECS + 1)))
    extra="$(cpu_per_request "$dir/t0" "$dir/t1" "$sent")"
    if [[ "$bin" != nginx ]]; then
      [[ "$STORE" == postgres ]] && extra+=" postgres_cpu_us=$(((p1 - p0) * 10000 / sent))"
      [[ "$mode" == miss ]] && extra+=" $(store_latency)"
    fi
    # The whole process (every thread), from clock ticks of 10 ms, per request sent.
    extra+="$(user_sys_per_request "$us0" "$us1" "$sent")"
    printf '%s round=%s rps=%s p50_us=%s p90_us=%s p99_us=%s p999_us=%s max_us=%s errors=%s %s\n' "$bin" "$round" \
      "$(kv "$line" rps)" "$(kv "$line" p50_us)" "$(kv "$line" p90_us)" "$(kv "$line" p99_us)" \
      "$(kv "$line" p999_us)" "$(kv "$line" max_us)" "$(kv "$line" errors)" "$extra"
    kill "$gw"
    wait "$gw" 2>/dev/null || true
  done
done
exit
}
