#!/usr/bin/env bash
# A profile-guided (PGO) release build of the gateway. Prints the binary's path on stdout.
#
#   bench/pgo.sh
#   BENCH_PGO_STORES=memory,embedded bench/pgo.sh     # train without Redis and PostgreSQL
#   BENCH_PGO=1 bench/run.sh                          # the benchmark on this build
#
# Three steps:
#   1. build with `-Cprofile-generate` (counters in every branch);
#   2. train: bench/run.sh's closed-loop scenarios (passthrough, miss, replay, mixed, storm) on
#      every store in BENCH_PGO_STORES (default memory,embedded,redis,postgres), short rows, no
#      peers, nothing written to docs/ (run.sh's results go to pgo/training-results.txt). Each
#      store is trained because LLVM lays out what no
#      training reached as cold code;
#   3. merge the counts with llvm-profdata and build with `-Cprofile-use`.
# Why: a request's code (hyper, tokio, the engine, a store) is spread over far more than a
# core's instruction cache holds, and PGO packs the paths requests take. See docs/benchmarks-journal.md
# for what it measured and docs/operations.md for building a release this way.
#
# The two builds live in target directories of their own under ${CARGO_TARGET_DIR:-target}/pgo:
# they differ only in RUSTFLAGS, and one shared directory would rebuild everything at each step.
# The first run compiles the gateway twice (5 to 7 minutes each on two cores); training takes
# about 100 s.
#
# llvm-profdata: $LLVM_PROFDATA, else rustup's (`rustup component add llvm-tools`), else the
# newest Debian `llvm-profdata-NN` (`apt-get install llvm-19`: LLVM 19's tool reads the raw
# profiles of rustc 1.95's LLVM 22, checked here), else an unnumbered one of LLVM 19 or newer.
# Flags already in RUSTFLAGS are kept in both builds. Training uses the bench rig (nginx, wrk,
# and Redis and PostgreSQL for those stores), as bench/run.sh does; ports as in run.sh.
set -euo pipefail
# One block, read whole before any of it runs: bash reads a script as it goes, so an edit to
# this file during a run (which takes minutes) would change or break the run under way.
{
cd "$(dirname "$0")/.."
REPO="$PWD"
STORES="${BENCH_PGO_STORES:-memory,embedded,redis,postgres}"

log() { echo "[pgo $(date -u +%H:%M:%S)] $*" >&2; }
die() { log "$*"; exit 1; }

profdata() {
  if [[ -n "${LLVM_PROFDATA:-}" ]]; then echo "$LLVM_PROFDATA"; return; fi
  local host rustup_tool
  host="$(rustc -vV | awk '/^host:/ {print $2}')"
  rustup_tool="$(rustc --print sysroot)/lib/rustlib/$host/bin/llvm-profdata"
  if [[ -x "$rustup_tool" ]]; then echo "$rustup_tool"; return; fi
  local newest major
  newest="$(compgen -c llvm-profdata- | grep -E '^llvm-profdata-[0-9]+$' | sort -t- -k3 -n | tail -n1 || true)"
  if [[ -n "$newest" && "${newest##*-}" -ge 19 ]]; then command -v "$newest"; return; fi
  # Unnumbered (Fedora, Arch, Homebrew; Debian's is its default LLVM, 14 on bookworm).
  if command -v llvm-profdata >/dev/null; then
    major="$(llvm-profdata --version 2>/dev/null | grep -oE 'version [0-9]+' | grep -oE '[0-9]+' | head -n1 || true)"
    if [[ -n "$major" && "$major" -ge 19 ]]; then command -v llvm-profdata; return; fi
  fi
  return 1
}
PROFDATA="$(profdata)" || die "no llvm-profdata (LLVM 19 or newer): rustup component add llvm-tools, or apt-get install llvm-19, or set LLVM_PROFDATA"

TDIR="${CARGO_TARGET_DIR:-target}"
[[ "$TDIR" = /* ]] || TDIR="$REPO/$TDIR"
PGO="$TDIR/pgo"
RAW="$PGO/raw"
mkdir -p "$PGO"

log "1/3 instrumented build (-Cprofile-generate)"
RUSTFLAGS="${RUSTFLAGS:+$RUSTFLAGS }-Cprofile-generate=$RAW" CARGO_TARGET_DIR="$PGO/generate" \
  timeout 3600 cargo build --release -p idemgate >&2 || die "the instrumented build failed"

log "2/3 training on $STORES with bench/run.sh"
rm -rf "$RAW"
# The gateway writes its counts when it exits; run.sh stops each one with SIGTERM, and the
# graceful shutdown ends in a normal exit. One it had to kill wrote nothing, and its store's
# code would be laid out as cold: that fails the build. (All gateways of one binary add to one
# file, so the files cannot be counted instead.) The load generator is built into the usual place.
# BENCH_PAIRS_ROUNDS=0: a caller's `BENCH_PAIRS_ROUNDS=20 BENCH_PGO=1 bench/run.sh` asks for the
# interleaved rounds on the measured build; inherited here, they ran 13 minutes on the instrumented
# one and tilted its profile towards their rows.
IDEMGATE_BIN="$PGO/generate/release/idemgate" BENCH_STORES="$STORES" \
  BENCH_SCENARIOS=passthrough,miss,replay,mixed,storm BENCH_PEERS= BENCH_REPEAT=1 \
  BENCH_DURATION=3s BENCH_WARMUP=1s BENCH_WRITE_DOC=0 BENCH_PROFILE=0 BENCH_PAIRS_ROUNDS=0 \
  BENCH_RESULTS_COPY="$PGO/training-results.txt" \
  timeout 1800 bench/run.sh >"$PGO/training.log" 2>&1 || die "training failed: see $PGO/training.log"
compgen -G "$RAW/*.profraw" >/dev/null || die "training wrote no profile into $RAW"
! grep -q 'did not stop on TERM' "$PGO/training.log" ||
  die "a trained gateway was killed before it wrote its counts: see $PGO/training.log"

log "3/3 merging with $PROFDATA, optimised build (-Cprofile-use)"
"$PROFDATA" merge -o "$PGO/merged.profdata" "$RAW"/*.profraw >&2
# Named by its content: cargo does not watch the file RUSTFLAGS names, so a new profile under
# the old name would leave the last build in place; a new name rebuilds every crate with it.
PROFILE="$PGO/merged-$(sha256sum "$PGO/merged.profdata" | cut -c1-12).profdata"
rm -f "$PGO"/merged-*.profdata
mv "$PGO/merged.profdata" "$PROFILE"
RUSTFLAGS="${RUSTFLAGS:+$RUSTFLAGS }-Cprofile-use=$PROFILE" CARGO_TARGET_DIR="$PGO/use" \
  timeout 3600 cargo build --release -p idemgate >&2 || die "the optimised build failed"
echo "$PGO/use/release/idemgate"
exit
}
