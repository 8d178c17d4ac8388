#!/usr/bin/env bash
# Heap allocations and clock reads per request of idemgate builds, counted exactly with uprobes:
# the measure behind issue 9's "no per-request allocation that can be avoided on the replay
# path", which neither req/s nor callgrind's instruction count shows on its own.
#
#   bench/allocs.sh STORE SCENARIO SECONDS BIN [BIN...]
#   bench/allocs.sh memory replay 4 /tmp/idemgate-before target/release/idemgate
#   BENCH_ALLOC_SITES=1 bench/allocs.sh memory replay 4 target/release/idemgate
#
#   STORE     memory | embedded
#   SCENARIO  passthrough | miss | replay (1,000 keys primed first)
#
# Needs root and `perf probe` (linux-perf), and a binary with its symbols (the release profile
# keeps debug info). Each binary runs on CPU 1 behind a static nginx upstream with the gateway
# configuration of bench/run.sh; wrk (-t1 -c4, bench/idem.lua, CPU 0) warms it up for 2 s, then
# uprobes on mimalloc's allocation entry points and on std's clock read (`Timespec::now`, behind
# both `Instant::now` and `SystemTime::now`) count every call of the whole process (every thread,
# background work included) over SECONDS of wrk. A uprobe costs a few microseconds, so the rate
# falls to a fraction of a normal run's; the counts per request do not depend on it.
# With BENCH_ALLOC_SITES=1 it also records where the allocations come from (perf's call graphs,
# 2 s more) and splits the count over the most frequent call sites.
# Ports 18120-18121, 127.0.0.1 only. The probes are removed on exit.
set -euo pipefail
# One block, read whole before any of it runs: bash reads a script as it goes, so an edit to
# this file during a run (which takes minutes) would change or break the run under way.
{
cd "$(dirname "$0")/.."
# shellcheck source=bench/lib.sh
source bench/lib.sh

[[ $# -ge 4 ]] || { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 64; }
STORE="$1" SCENARIO="$2" SECS="$3"
shift 3
case "$STORE" in memory | embedded) ;; *) echo "allocs: store must be memory or embedded" >&2; exit 64 ;; esac
case "$SCENARIO" in passthrough | miss | replay) ;; *) echo "allocs: unknown scenario $SCENARIO" >&2; exit 64 ;; esac
for bin in "$@"; do [[ -x "$bin" ]] || { echo "allocs: $bin is not an executable" >&2; exit 64; }; done
[[ "$(id -u)" == 0 ]] || { echo "allocs: uprobes need root" >&2; exit 69; }
UP_PORT=18120 GW_PORT=18121
rig_start allocs "$UP_PORT" perf

GROUP="idemgate_allocs_$$"
remove_probes() { perf probe -q -d "$GROUP:*" >/dev/null 2>&1 || true; }
trap 'remove_probes; rig_cleanup' EXIT

# add_probes BIN: one probe per allocation entry point the binary has, and one on the clock read.
# Prints the event list for perf.
add_probes() {
  local bin="$1" sym events=() clock symbols
  remove_probes
  # Read once into a file: `nm | grep -q` would fail under pipefail when grep stops reading.
  symbols="$WORK/symbols"
  nm "$bin" >"$symbols"
  for sym in mi_malloc mi_zalloc mi_calloc mi_realloc mi_malloc_aligned mi_zalloc_aligned \
    mi_realloc_aligned mi_malloc_aligned_at; do
    if grep -q " T $sym\$" "$symbols"; then
      perf probe -q -x "$bin" -a "$GROUP:$sym=$sym" >/dev/null 2>&1 && events+=("$GROUP:$sym")
    fi
  done
  # std's `Timespec::now` has a mangled (v0) name; perf probe takes it as it is.
  clock="$(awk '$2 ~ /^[tT]$/ && $3 ~ /4time.*8Timespec3now$/ {print $3; exit}' "$symbols")"
  if [[ -n "$clock" ]]; then
    perf probe -q -x "$bin" -a "$GROUP:clock=$clock" >/dev/null 2>&1 && events+=("$GROUP:clock")
  fi
  ((${#events[@]})) || { echo "allocs: no mimalloc symbols in $bin (built with another allocator?)" >&2; exit 1; }
  local IFS=,
  echo "${events[*]}"
}

for bin in "$@"; do
  events="$(add_probes "$bin")"
  dir="$WORK/gw-$RANDOM"
  mkdir -p "$dir"
  gw_yaml "$GW_PORT" "$UP_PORT" "$(local_store_block "$STORE" "$dir")" >"$dir/idemgate.yaml"
  IDEMGATE_LOG=warn taskset -c 1 "$bin" serve --config "$dir/idemgate.yaml" >"$dir/log" 2>&1 &
  gw=$!
  PIDS+=("$gw")
  rig_wait "$GW_PORT" 20
  prefix="a$RANDOM"
  if [[ "$SCENARIO" == replay ]]; then
    rig_prime "$GW_PORT"
    prefix=rpool
  fi
  rig_wrk 4 2 "w$prefix" >/dev/null
  # Counting starts before wrk and stops after it, so every request wrk reports is counted.
  perf stat -x, -e "$events" -p "$gw" -o "$dir/stat" &
  perf_pid=$!
  sleep 0.5
  line="$(rig_wrk 4 "$SECS" "$prefix")"
  kill -INT "$perf_pid"
  wait "$perf_pid" 2>/dev/null || true
  requests="$(kv "$line" requests)" errors="$(kv "$line" errors)"
  [[ -n "$requests" && "$requests" -gt 0 ]] || { echo "allocs: no result from wrk for $bin" >&2; exit 1; }
  [[ "$errors" == 0 ]] || { echo "allocs: $bin: $line" >&2; exit 1; }
  result="$(awk -F, -v n="$requests" -v bin="$bin" -v store="$STORE" -v sc="$SCENARIO" '
    $3 ~ /:clock$/ { clock += $1; next }
    $3 ~ /:mi_/    { allocs += $1 }
    END { printf "%s %s %s requests=%d allocations_per_request=%.2f clock_reads_per_request=%.2f\n",
            bin, store, sc, n, allocs / n, clock / n }' "$dir/stat")"
  echo "$result"
  if [[ "${BENCH_ALLOC_SITES:-0}" == 1 ]]; then
    alloc_events="$(tr , '\n' <<<"$events" | grep -v ':clock$' | paste -sd,)"
    perf record -q -o "$dir/sites.data" -e "$alloc_events" --call-graph dwarf,16384 -p "$gw" &
    rec_pid=$!
    sleep 0.5
    sites_prefix="s$prefix"
    [[ "$SCENARIO" == replay ]] && sites_prefix=rpool
    rig_wrk 4 2 "$sites_prefix" >/dev/null
    kill -INT "$rec_pid"
    wait "$rec_pid" 2>/dev/null || true
    perf script -i "$dir/sites.data" 2>/dev/null |
      python3 bench/alloc_sites.py "$(kv "$result" allocations_per_request)"
  fi
  kill "$gw"
  wait "$gw" 2>/dev/null || true
done
exit
}
