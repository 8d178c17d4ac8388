#!/usr/bin/env bash
# Renders the kept results of the last full run again: bench/results/results.txt and meta.txt,
# which bench/run.sh keeps beside the report, through the current bench/report.py into the
# generated part of docs/benchmarks.md and docs/img/benchmarks.svg. For a change to the report
# itself; it measures nothing.
#
#   bench/render.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/lib.sh
source bench/lib.sh

[[ -f bench/results/results.txt && -f bench/results/meta.txt ]] ||
  { echo "render: no kept results in bench/results/ (a full bench/run.sh writes them)" >&2; exit 66; }
tmp="$(mktemp -d /tmp/idemgate-render.XXXXXX)"
trap 'rm -rf "$tmp"' EXIT
# The interleaved rounds' table, if the kept run made one (BENCH_PAIRS_ROUNDS).
if [[ -f bench/results/pairs.md ]]; then cp bench/results/pairs.md "$tmp/pairs.md"; fi
write_report "$PWD" bench/results/results.txt bench/results/meta.txt "$tmp"
echo "render: wrote docs/benchmarks.md and docs/img/benchmarks.svg from bench/results/"
