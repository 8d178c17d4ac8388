#!/usr/bin/env bash
# Instructions per request of idemgate builds, counted by valgrind's callgrind: a measure that
# does not drift with the machine, for changes smaller than the spread between bench/ab.sh rounds.
#
#   bench/instructions.sh STORE SCENARIO SECONDS BIN [BIN...]
#   bench/instructions.sh memory replay 6 /tmp/idemgate-before target/release/idemgate
#
#   STORE     memory | embedded
#   SCENARIO  passthrough | miss | replay (1,000 keys primed first)
#   BIN       an idemgate binary, or `floor` / `hyper-floor`: the reference proxies of bench/ab.sh
#             (passthrough only)
#
# Each binary runs under callgrind on CPU 1 behind a static nginx upstream, with the gateway
# configuration of bench/run.sh. wrk (-t1 -c4, bench/idem.lua, CPU 0) warms it up for 2 s, the
# counters are zeroed, then SECONDS of wrk are counted; the line printed is the instructions of
# the whole process (every thread) over the requests served. Valgrind hashes SHA-256 in software
# (about 10k instructions per fingerprint that SHA-NI does in a few hundred), so keyed rows carry
# that much more than the machine runs. A miss's count moves by a few hundred between runs (the
# store's table grows at different moments); repeat it. Under valgrind the embedded store's
# writer and journal see a few requests per batch instead of dozens, so their share per miss is
# overstated; compare embedded builds with each other only. Ports 18110-18111, 127.0.0.1 only.
#
# BENCH_CACHE_SIM=1 also simulates the caches (`--cache-sim=yes`, the machine's sizes) and adds
# instruction-cache misses per request (first level and last level): how well a build's hot
# code packs, which PGO changes (bench/pgo.sh) and an instruction count does not show. The
# simulation sees the gateway alone, not the kernel or other processes sharing the core.
#
# BENCH_CG_DIR=DIR keeps each binary's callgrind output as DIR/N.cg.out.* (N = its place in the
# argument list, from 1), for `callgrind_annotate --inclusive=yes`.
set -euo pipefail
# One block, read whole before any of it runs: bash reads a script as it goes, so an edit to
# this file during a run (which takes minutes) would change or break the run under way.
{
# Relative to where the script was started, not to the repository it moves to.
if [[ -n "${BENCH_CG_DIR:-}" ]]; then
  mkdir -p "$BENCH_CG_DIR"
  BENCH_CG_DIR="$(cd "$BENCH_CG_DIR" && pwd)"
fi
cd "$(dirname "$0")/.."
# shellcheck source=bench/lib.sh
source bench/lib.sh

[[ $# -ge 4 ]] || { sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//'; exit 64; }
STORE="$1" SCENARIO="$2" SECS="$3"
shift 3
case "$STORE" in memory | embedded) ;; *) echo "instructions: store must be memory or embedded" >&2; exit 64 ;; esac
case "$SCENARIO" in passthrough | miss | replay) ;; *) echo "instructions: unknown scenario $SCENARIO" >&2; exit 64 ;; esac
FLOOR=""
for bin in "$@"; do
  if [[ "$bin" == floor || "$bin" == hyper-floor ]]; then
    [[ "$SCENARIO" == passthrough ]] || { echo "instructions: $bin has no $SCENARIO" >&2; exit 64; }
    [[ -n "$FLOOR" ]] || FLOOR="$(build_floor "$PWD")" || { echo "instructions: building bench/loadgen failed" >&2; exit 1; }
    continue
  fi
  [[ -x "$bin" ]] || { echo "instructions: $bin is not an executable" >&2; exit 64; }
done
UP_PORT=18110 GW_PORT=18111
CACHE_SIM=()
[[ "${BENCH_CACHE_SIM:-0}" == 1 ]] && CACHE_SIM=(--cache-sim=yes)
rig_start instructions "$UP_PORT" valgrind callgrind_control

for bin in "$@"; do
  dir="$WORK/gw-$RANDOM"
  mkdir -p "$dir"
  gw_yaml "$GW_PORT" "$UP_PORT" "$(local_store_block "$STORE" "$dir")" >"$dir/idemgate.yaml"
  cmd=("$bin" serve --config "$dir/idemgate.yaml")
  if [[ "$bin" == floor || "$bin" == hyper-floor ]]; then
    cmd=("$FLOOR" "$bin" --listen "127.0.0.1:$GW_PORT" --upstream "127.0.0.1:$UP_PORT")
  fi
  IDEMGATE_LOG=warn taskset -c 1 valgrind --tool=callgrind --callgrind-out-file="$dir/cg.out" "${CACHE_SIM[@]}" \
    "${cmd[@]}" >"$dir/log" 2>&1 &
  gw=$!
  PIDS+=("$gw")
  rig_wait "$GW_PORT" 120  # valgrind starts it slowly
  prefix="i$RANDOM"
  if [[ "$SCENARIO" == replay ]]; then
    rig_prime "$GW_PORT"
    prefix=rpool
  fi
  rig_wrk 4 2 "w$prefix" >/dev/null
  callgrind_control -z "$gw" >/dev/null 2>&1
  line="$(rig_wrk 4 "$SECS" "$prefix")"
  callgrind_control -d "$gw" >/dev/null 2>&1
  requests="$(kv "$line" requests)" errors="$(kv "$line" errors)"
  [[ -n "$requests" && "$requests" -gt 0 ]] || { echo "instructions: no result from wrk for $bin" >&2; exit 1; }
  [[ "$errors" == 0 ]] || { echo "instructions: $bin: $line" >&2; exit 1; }
  # Each dump's `events:` line names the columns of its `totals:` line (Ir first; with the
  # cache simulation also I1mr and ILmr, the instruction fetches that missed each level).
  per_request="$(awk -v n="$requests" '
    /^events:/ { for (i = 2; i <= NF; i++) name[i] = $i }
    /^totals:/ { for (i = 2; i <= NF; i++) sum[name[i]] += $i }
    END {
      printf "instructions_per_request=%d", sum["Ir"] / n
      if ("I1mr" in sum) printf " i1_misses_per_request=%.1f ll_instruction_misses_per_request=%.2f", sum["I1mr"] / n, sum["ILmr"] / n
    }' "$dir"/cg.out.*)"
  printf '%s %s %s requests=%s %s\n' "$bin" "$STORE" "$SCENARIO" "$requests" "$per_request"
  n=$((${n:-0} + 1))
  if [[ -n "${BENCH_CG_DIR:-}" ]]; then
    for f in "$dir"/cg.out.*; do cp "$f" "$BENCH_CG_DIR/$n.$(basename "$f")"; done
  fi
  kill "$gw"
  wait "$gw" 2>/dev/null || true
done
exit
}
