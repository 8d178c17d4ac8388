#!/usr/bin/env bash
# scratch: perf record CPU 1 during an open-loop tail.sh round. $1 store, $2 rate, $3 target (bin|nginx), $4 out
set -u
CARGO_TARGET_DIR=/work/target-bench timeout 300 bench/tail.sh "$1" "$2" 1 10 "$3" > /tmp/perfrate.$$.log 2>&1 &
p=$!
# wait for the measured part to start: loadgen running
for i in $(seq 1 100); do pgrep -f 'idemgate-bench rate' >/dev/null && break; sleep 0.2; done
sleep 3
perf record -q -C 1 -F 2999 -g -o "$4" -- sleep 4 2>/dev/null
wait $p
tail -1 /tmp/perfrate.$$.log
