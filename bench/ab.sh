#!/usr/bin/env bash
# A/B of idemgate builds: interleaved rounds of the same closed-loop row on two or more binaries,
# with the gateway's CPU per request split by thread. For a change to the hot path, where
# bench/run.sh's full report is too slow to repeat and the machine's drift between its rows is as
# large as the change (docs/benchmarks.md).
#
#   bench/ab.sh STORE SCENARIO ROUNDS SECONDS BIN [BIN...]
#   bench/ab.sh embedded miss 4 5 /tmp/idemgate-before target/release/idemgate
#
#   STORE     memory | embedded
#   SCENARIO  passthrough | miss | replay (a pool of 1,000 keys, primed before each round)
#
# Rounds alternate the binaries' order (A B, then B A) so neither always runs first.
# Topology as in bench/run.sh: a static nginx upstream and wrk -t1 -c32 on CPU 0, the gateway on
# CPU 1, one catch-all `accepted` route with `scope: global`, a fresh store (and data directory)
# per round, a discarded 2 s warm-up, then SECONDS measured. Prints one line per round and binary:
# req/s, p50, p99, and CPU microseconds per request of the whole process and of each of its
# threads (user + system, from /proc), so a change that moves work between threads shows.
# Ports 18100-18102, all on 127.0.0.1; everything it starts is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/lib.sh
source bench/lib.sh

[[ $# -ge 5 ]] || { sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 64; }
STORE="$1" SCENARIO="$2" ROUNDS="$3" SECS="$4"
shift 4
case "$STORE" in memory | embedded) ;; *) echo "ab: store must be memory or embedded" >&2; exit 64 ;; esac
case "$SCENARIO" in passthrough | miss | replay) ;; *) echo "ab: unknown scenario $SCENARIO" >&2; exit 64 ;; esac
for bin in "$@"; do [[ -x "$bin" ]] || { echo "ab: $bin is not an executable" >&2; exit 64; }; done
for tool in wrk nginx taskset curl python3; do
  command -v "$tool" >/dev/null || [[ -x "/usr/sbin/$tool" ]] || { echo "ab: $tool is needed" >&2; exit 69; }
done
NGINX="$(command -v nginx || echo /usr/sbin/nginx)"

UP_PORT=18100 GW_PORT=18102
WORK="$(mktemp -d /tmp/idemgate-ab.XXXXXX)"
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

mkdir -p "$WORK/nginx/tmp"
nginx_conf_text "$WORK/nginx" 1 "$(static_upstream "$UP_PORT")" >"$WORK/nginx/nginx.conf"
taskset -c 0 "$NGINX" -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf" -e "$WORK/nginx/error.log" &
PIDS+=($!)

wait_http() { # PORT: a POST answered within 20 s
  for _ in $(seq 1 200); do
    curl -s -o /dev/null -X POST "http://127.0.0.1:$1/x" && return 0
    sleep 0.1
  done
  echo "ab: nothing answers on port $1" >&2
  exit 1
}
wait_http "$UP_PORT"

prime() { # 1,000 completed keys rpool0..rpool999, one keep-alive connection
  python3 - "$GW_PORT" <<'EOF'
import http.client, sys
c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]))
for i in range(1000):
    c.request("POST", "/api/v1/orders", '{"amount":100,"currency":"eur"}',
              {"Idempotency-Key": f"rpool{i}", "Content-Type": "application/json"})
    r = c.getresponse(); r.read()
    assert r.status == 200, r.status
EOF
}

cpu_by_thread() { # PID: "tid name ticks" per thread
  for t in /proc/"$1"/task/*; do
    echo "$(basename "$t") $(tr ' ' _ <"$t/comm") $(awk '{print $14 + $15}' "$t/stat")"
  done | sort
}

wrk_row() { # SECONDS PREFIX -> the RESULT line of bench/idem.lua
  taskset -c 0 wrk -t1 -c32 -d"$1"s -s bench/idem.lua "http://127.0.0.1:$GW_PORT/api/v1/orders" \
    -- "$SCENARIO" "$2" 2>&1 | grep '^RESULT' || true
}

BINS=("$@")
for round in $(seq 1 "$ROUNDS"); do
  # Odd rounds run the binaries in the order given, even rounds in reverse: on a noisy machine
  # the first of a pair has been seen to run faster, for no reason of its own.
  order=("${BINS[@]}")
  if ((round % 2 == 0)); then
    order=()
    for ((i = ${#BINS[@]} - 1; i >= 0; i--)); do order+=("${BINS[$i]}"); done
  fi
  for bin in "${order[@]}"; do
    dir="$WORK/gw-$round-$RANDOM"
    mkdir -p "$dir"
    gw_yaml "$GW_PORT" "$UP_PORT" "$(local_store_block "$STORE" "$dir")" >"$dir/idemgate.yaml"
    IDEMGATE_LOG=warn taskset -c 1 "$bin" serve --config "$dir/idemgate.yaml" >"$dir/log" 2>&1 &
    gw=$!
    PIDS+=("$gw")
    wait_http "$GW_PORT"
    prefix="ab$round$RANDOM"
    [[ "$SCENARIO" == replay ]] && { prime; prefix=rpool; }
    wrk_row 2 "w$prefix" >/dev/null
    cpu_by_thread "$gw" >"$dir/t0"
    line="$(wrk_row "$SECS" "$prefix")"
    cpu_by_thread "$gw" >"$dir/t1"
    requests="$(kv "$line" requests)"
    [[ -n "$requests" && "$requests" -gt 0 ]] || { echo "ab: no result from wrk for $bin" >&2; exit 1; }
    # clock ticks are 1/100 s: ticks * 10000 / requests = microseconds per request
    threads="$(join "$dir/t0" "$dir/t1" | awk -v n="$requests" '
      { d = ($5 - $3) * 10000 / n; total += d; if (d >= 0.05) out = out sprintf(" %s=%.1f", $2, d) }
      END { printf "cpu_us=%.1f%s", total, out }')"
    printf '%s round=%s rps=%s p50_us=%s p99_us=%s errors=%s %s\n' "$bin" "$round" \
      "$(kv "$line" rps)" "$(kv "$line" p50_us)" "$(kv "$line" p99_us)" "$(kv "$line" errors)" "$threads"
    kill "$gw"
    wait "$gw" 2>/dev/null || true
  done
done
