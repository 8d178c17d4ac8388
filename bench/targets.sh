#!/usr/bin/env bash
# The closed-loop ratio targets of issue 9, read from interleaved rounds instead of a full run.
#
#   bench/targets.sh BIN [ROUNDS] [SECONDS]
#   bench/targets.sh target/release/idemgate 10 4
#
# On a VM whose speed moves by a quarter within minutes, a full run (bench/run.sh) compares rows
# measured minutes apart and the drift decides the ratio. Here bench/ab.sh runs six rows per round
# (ROUNDS, default 10; SECONDS each, default 4, after its 2 s warm-up; about 40 s a round), in an
# order that puts each row within one or two rows of the one it is compared with, reversed every
# other round:
#
#   embedded replay, nginx proxy_pass, memory replay, memory passthrough, memory miss, embedded miss
#
# and bench/pairs.py judges every target on the median of its per-round ratios, by req/s and by
# CPU per request. The embedded miss is compared with the memory passthrough (a passthrough does
# not touch the store). The other targets (open-loop p99, storms, Redis, growth) need the full run.
# Prints the markdown table; the raw lines are kept in $BENCH_TARGETS_OUT (default: a file in /tmp
# named in the output; $BENCH_TARGETS_NAME names them instead, for a caller that moves them).
# Ports 18100-18102, as bench/ab.sh.
set -euo pipefail
# One block, read whole before any of it runs: bash reads a script as it goes, so an edit to
# this file during a run (which takes minutes) would change or break the run under way.
{
cd "$(dirname "$0")/.."
[[ $# -ge 1 ]] || { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 64; }
BIN="$1" ROUNDS="${2:-10}" SECS="${3:-4}"
[[ -x "$BIN" ]] || { echo "targets: $BIN is not an executable" >&2; exit 64; }
OUT="${BENCH_TARGETS_OUT:-$(mktemp /tmp/idemgate-targets.XXXXXX)}"
NAME="${BENCH_TARGETS_NAME:-$OUT}"

bench/ab.sh memory passthrough "$ROUNDS" "$SECS" \
  "embedded:replay:$BIN" nginx "memory:replay:$BIN" "memory:passthrough:$BIN" \
  "memory:miss:$BIN" "embedded:miss:$BIN" | tee "$OUT" >&2

# The checkout's commit, which is the binary's only if it was built from this checkout unchanged.
echo "machine: $(nproc) CPUs, $(lscpu | sed -n 's/^Model name: *//p' | head -n1); checkout $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
echo "command: bench/targets.sh $BIN $ROUNDS $SECS (raw lines: $NAME)"
echo
python3 bench/pairs.py "$OUT" \
  --ratio "passthrough ≥ 1.0× nginx" "memory:passthrough:$BIN" nginx 1.0 \
  --ratio "memory miss ≥ 0.9× passthrough" "memory:miss:$BIN" "memory:passthrough:$BIN" 0.9 \
  --ratio "embedded miss ≥ 0.5× passthrough" "embedded:miss:$BIN" "memory:passthrough:$BIN" 0.5 \
  --ratio "memory replay ≥ 1.5× nginx" "memory:replay:$BIN" nginx 1.5 \
  --ratio "embedded replay ≥ 1.5× nginx" "embedded:replay:$BIN" nginx 1.5
exit
}
