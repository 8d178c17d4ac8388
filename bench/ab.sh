#!/usr/bin/env bash
# A/B of idemgate builds: interleaved rounds of the same closed-loop row on two or more binaries,
# with the gateway's CPU per request split by thread. For a change to the hot path, where
# bench/run.sh's full report is too slow to repeat and the machine's drift between its rows is as
# large as the change (docs/benchmarks-journal.md).
#
#   bench/ab.sh STORE SCENARIO ROUNDS SECONDS BIN [BIN...]
#   bench/ab.sh embedded miss 4 5 /tmp/idemgate-before target/release/idemgate
#
#   STORE     memory | embedded | redis (BENCH_REDIS_URL, default redis://127.0.0.1:6379/15: a
#             Redis or Valkey on this machine, pinned to CPU 0 for the run as bench/run.sh pins
#             it, its affinity given back and this run's keys removed at the end)
#   SCENARIO  passthrough | miss | replay (a pool of 1,000 keys, primed before each round)
#   BIN       an idemgate binary, or `nginx`: the nginx `proxy_pass` peer of bench/run.sh
#             (passthrough only), so the passthrough target can be read from interleaved rounds
#
#   bench/ab.sh memory passthrough 6 8 nginx target/release/idemgate
#
#             or `floor` / `hyper-floor`: the reference proxies of bench/loadgen/src/floor.rs (the
#             least a tokio proxy does per request; the same on hyper with nothing else), built
#             here with the gateway's release settings (passthrough only)
#             or STORE:SCENARIO:BIN, which overrides the first two arguments for that entry, so
#             rows of different scenarios interleave (bench/targets.sh reads the targets so)
#
# Rounds alternate the binaries' order (A B, then B A) so neither always runs first.
# Topology as in bench/run.sh: a static nginx upstream and wrk -t1 -c32 on CPU 0, the gateway on
# CPU 1, one catch-all `accepted` route with `scope: global`, a fresh store (and data directory)
# per round, a discarded 2 s warm-up, then SECONDS measured. Prints one line per round and binary:
# req/s, p50, p99, and CPU microseconds per request of the whole process and of each of its
# threads (user + system, from /proc), so a change that moves work between threads shows, then
# the whole process's user and system CPU per request (proc_user_us, proc_sys_us; clock ticks of
# 10 ms from /proc, so without a profiler's own cost: on a VM where sampling is costly, the split
# to read).
# Ports 18100-18102, all on 127.0.0.1; everything it starts is stopped on exit.
#
# BENCH_PERF_DIR=DIR also samples the process under test with `perf record -e cpu-clock -F 2999`
# (no call graph) for each measured run, into DIR/ROUND-ENTRY-NAME-STORE-SCENARIO.data (ENTRY:
# its place in the arguments, from 1; DIR relative to the repository), and adds to its line how
# its CPU per request splits between the kernel and user space (kernel_us, user_us, and user
# space as program_us, libc_us, vdso_us; bench/perf_split.py, which also lists the symbols or
# compares two recordings), and perf=FILE. Needs root or kernel.perf_event_paranoid <= 1 (perf
# would otherwise drop the kernel's samples). The profiler costs the row a few percent of CPU;
# read those rounds against each other, not against rounds without it.
set -euo pipefail
# One block, read whole before any of it runs: bash reads a script as it goes, so an edit to
# this file during a run (which takes minutes) would change or break the run under way.
{
cd "$(dirname "$0")/.."
# shellcheck source=bench/lib.sh
source bench/lib.sh

[[ $# -ge 5 ]] || { sed -n '2,40p' "$0" | sed 's/^# \{0,1\}//'; exit 64; }
STORE="$1" SCENARIO="$2" ROUNDS="$3" SECS="$4"
shift 4
case "$STORE" in memory | embedded | redis) ;; *) echo "ab: store must be memory, embedded or redis" >&2; exit 64 ;; esac
case "$SCENARIO" in passthrough | miss | replay) ;; *) echo "ab: unknown scenario $SCENARIO" >&2; exit 64 ;; esac
DEFAULT_STORE="$STORE" DEFAULT_SCENARIO="$SCENARIO"
PERF_DIR="${BENCH_PERF_DIR:-}"
if [[ -n "$PERF_DIR" ]]; then
  command -v perf >/dev/null || { echo "ab: BENCH_PERF_DIR needs perf (apt-get install linux-perf)" >&2; exit 64; }
  if ((EUID != 0)) && (($(cat /proc/sys/kernel/perf_event_paranoid) > 1)); then
    echo "ab: BENCH_PERF_DIR needs root or kernel.perf_event_paranoid <= 1 to sample the kernel" >&2
    exit 64
  fi
  mkdir -p "$PERF_DIR"
fi

# entry SPEC: sets STORE, SCENARIO and bin from an argument, BIN or STORE:SCENARIO:BIN (only
# valid names match, so every entry's store and scenario are valid).
entry() {
  STORE="$DEFAULT_STORE" SCENARIO="$DEFAULT_SCENARIO" bin="$1"
  if [[ "$1" =~ ^(memory|embedded|redis):(passthrough|miss|replay):(.+)$ ]]; then
    STORE="${BASH_REMATCH[1]}" SCENARIO="${BASH_REMATCH[2]}" bin="${BASH_REMATCH[3]}"
  fi
}

FLOOR=""
for spec in "$@"; do
  entry "$spec"
  if [[ "$bin" == nginx || "$bin" == floor || "$bin" == hyper-floor ]]; then
    [[ "$SCENARIO" == passthrough ]] || { echo "ab: $bin has no $SCENARIO" >&2; exit 64; }
    if [[ "$bin" != nginx && -z "$FLOOR" ]]; then
      FLOOR="$(build_floor "$PWD")" || { echo "ab: building bench/loadgen failed" >&2; exit 1; }
    fi
    continue
  fi
  [[ -x "$bin" ]] || { echo "ab: $bin is not an executable" >&2; exit 64; }
done
UP_PORT=18100 GW_PORT=18102
rig_start ab "$UP_PORT"
USES_REDIS=0
for spec in "$@"; do entry "$spec"; [[ "$STORE" == redis ]] && USES_REDIS=1; done
if ((USES_REDIS)); then
  REDIS_URL="${BENCH_REDIS_URL:-redis://127.0.0.1:6379/15}"
  # Every key of this run starts with it (the store's prefix), so they can all be removed after.
  REDIS_PREFIX="idemgate-ab-$(od -An -N5 -tx1 /dev/urandom | tr -d ' \n')"
  redis_pin "$REDIS_URL" 0 || exit 1
fi

BINS=("$@")
for round in $(seq 1 "$ROUNDS"); do
  # By index: the same entry may be given twice (an A/A run).
  mapfile -t order < <(round_order "$round" "${!BINS[@]}")
  for idx in "${order[@]}"; do
    spec="${BINS[$idx]}"
    entry "$spec"
    dir="$WORK/gw-$round-$RANDOM"
    mkdir -p "$dir"
    if [[ "$bin" == nginx ]]; then
      start_proxy_peer "$dir" "$GW_PORT" "$UP_PORT"
    elif [[ "$bin" == floor || "$bin" == hyper-floor ]]; then
      taskset -c 1 "$FLOOR" "$bin" --listen "127.0.0.1:$GW_PORT" --upstream "127.0.0.1:$UP_PORT" >"$dir/log" 2>&1 &
    else
      if [[ "$STORE" == redis ]]; then
        block="$(redis_store_block "$REDIS_URL" "$REDIS_PREFIX-$(basename "$dir")-")"
      else
        block="$(local_store_block "$STORE" "$dir")"
      fi
      gw_yaml "$GW_PORT" "$UP_PORT" "$block" >"$dir/idemgate.yaml"
      IDEMGATE_LOG=warn taskset -c 1 "$bin" serve --config "$dir/idemgate.yaml" >"$dir/log" 2>&1 &
    fi
    gw=$!
    PIDS+=("$gw")
    rig_wait "$GW_PORT" 20
    # nginx's requests are served by its worker; the master only waits.
    cpu_pid="$gw"
    if [[ "$bin" == nginx ]]; then cpu_pid="$(pgrep -P "$gw" | head -n1)"; fi
    prefix="ab$round$RANDOM"
    [[ "$SCENARIO" == replay ]] && { rig_prime "$GW_PORT"; prefix=rpool; }
    rig_wrk 32 2 "w$prefix" >/dev/null
    cpu_by_thread "$cpu_pid" >"$dir/t0"
    us0="$(proc_user_sys "$cpu_pid")"
    if [[ -n "$PERF_DIR" ]]; then
      # Named by the entry's place in the arguments too: two builds may share a file name.
      data="$PERF_DIR/$round-$((idx + 1))-$(basename "$bin")-$STORE-$SCENARIO.data"
      perf record -q -e cpu-clock -F 2999 -p "$cpu_pid" -o "$data" -- sleep "$SECS" >"$dir/perf.log" 2>&1 &
      perf_pid=$!
      PIDS+=("$perf_pid")
    fi
    line="$(rig_wrk 32 "$SECS" "$prefix")"
    cpu_by_thread "$cpu_pid" >"$dir/t1"
    us1="$(proc_user_sys "$cpu_pid")"
    requests="$(kv "$line" requests)"
    [[ -n "$requests" && "$requests" -gt 0 ]] || { echo "ab: no result from wrk for $bin" >&2; exit 1; }
    threads="$(cpu_per_request "$dir/t0" "$dir/t1" "$requests")$(user_sys_per_request "$us0" "$us1" "$requests" proc_)"
    if [[ -n "$PERF_DIR" ]]; then
      wait "$perf_pid" || { echo "ab: perf record failed for $spec:" >&2; cat "$dir/perf.log" >&2; exit 1; }
      threads+=" $(python3 bench/perf_split.py --totals "$data" "$(kv "$threads" cpu_us)") perf=$data"
    fi
    printf '%s round=%s rps=%s p50_us=%s p99_us=%s errors=%s %s\n' "$spec" "$round" \
      "$(kv "$line" rps)" "$(kv "$line" p50_us)" "$(kv "$line" p99_us)" "$(kv "$line" errors)" "$threads"
    kill "$gw"
    wait "$gw" 2>/dev/null || true
  done
done
exit
}
