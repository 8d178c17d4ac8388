#!/usr/bin/env bash
# Miss and replay req/s through idemgate -> Restate, beside Restate's ingress called directly
# with the same keys, in one run (issue 7). Prints a Markdown table.
#
#   bench/restate/run.sh                    # builds release binaries into $CARGO_TARGET_DIR
#   BENCH_DURATION=8s BENCH_CONNECTIONS=16 bench/restate/run.sh
#
# Needs wrk, unshare (root) and the Restate server (IDEMGATE_TEST_RESTATE_BIN, as installed by
# .ci/run). Restate reaches for the internet at start, so the whole run happens inside a private
# network namespace (loopback only); every process is killed on exit; every wait is bounded.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
DURATION="${BENCH_DURATION:-8s}"
WARMUP="${BENCH_WARMUP:-3s}"
CONNS="${BENCH_CONNECTIONS:-16}"
POOL="${BENCH_POOL:-500}"
RESTATE="${IDEMGATE_TEST_RESTATE_BIN:?set IDEMGATE_TEST_RESTATE_BIN to a restate-server binary}"

if [[ "${1:-}" != "--inside" ]]; then
  TARGET="${CARGO_TARGET_DIR:-$REPO/target}"
  (cd "$REPO" && cargo build --release --quiet -p idemgate -p restate-test-service)
  export IDEMGATE_BIN="$TARGET/release/idemgate" SERVICE_BIN="$TARGET/release/restate-test-service"
  exec unshare --net -- "$0" --inside
fi

ip link set lo up
TMP="$(mktemp -d)"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$TMP"; }
trap cleanup EXIT
wait_for() { # url, what
  for _ in $(seq 1 300); do curl -sf -o /dev/null "$1" && return 0; sleep 0.1; done
  echo "$2 did not come up" >&2; exit 1
}

"$RESTATE" --no-logo --node-name bench --base-dir "$TMP/restate" > "$TMP/restate.log" 2>&1 & PIDS+=($!)
"$SERVICE_BIN" 127.0.0.1:9080 > /dev/null 2>&1 & PIDS+=($!)
wait_for http://127.0.0.1:9070/health "Restate admin"
wait_for http://127.0.0.1:8080/restate/health "Restate ingress"
curl -sf -o /dev/null -X POST http://127.0.0.1:9070/deployments -H 'content-type: application/json' \
  -d '{"uri":"http://127.0.0.1:9080"}'

cat > "$TMP/idemgate.yaml" <<YAML
server:
  listen: 127.0.0.1:18002
store:
  kind: memory
upstreams:
  checkout:
    kind: restate
    url: http://127.0.0.1:8080
routes:
  - id: create
    method: POST
    path: /api/v1/checkout
    upstream: checkout
    target: Checkout/create
    policy: required
    scope: global
YAML
IDEMGATE_LOG=warn "$IDEMGATE_BIN" serve --config "$TMP/idemgate.yaml" > "$TMP/idemgate.log" 2>&1 & PIDS+=($!)
for _ in $(seq 1 100); do (exec 3<>/dev/tcp/127.0.0.1/18002) 2>/dev/null && break; sleep 0.1; done

DIRECT=http://127.0.0.1:8080/Checkout/create
GATEWAY=http://127.0.0.1:18002/api/v1/checkout
RUN="r$(date +%s)"
row() { # label, url, mode, header, prefix
  local out rps lat bad
  out="$(wrk -t1 -c"$CONNS" -d"$DURATION" -s "$HERE/keys.lua" "$2" -- "$3" "$4" "$5" "$POOL")"
  rps="$(awk '/Requests\/sec/ {print $2}' <<<"$out")"
  lat="$(awk '/Latency/ {print $2; exit}' <<<"$out")"
  bad="$(awk '/Non-2xx/ {print $NF}' <<<"$out")"
  printf '| %s | %s | %s | %s |\n' "$1" "${rps%.*}" "$lat" "${bad:-0}"
}
warm() { wrk -t1 -c"$CONNS" -d"$WARMUP" -s "$HERE/keys.lua" "$1" -- "$2" "$3" "$4" "$POOL" > /dev/null; }

echo "| path | req/s | mean latency | non-2xx |"
echo "|---|---|---|---|"
warm "$DIRECT" miss idempotency-key "t-*:*:*:$RUN-w"
row "miss: Restate ingress directly" "$DIRECT" miss idempotency-key "t-*:*:*:$RUN-md"
row "miss: idemgate -> Restate" "$GATEWAY" miss Idempotency-Key "$RUN-mg"
# Replays of the same keys: idemgate's warm-up executes the pool once (idemgate sends
# t-*:*:*:{raw} for a global route), then both paths replay those very invocations.
warm "$GATEWAY" replay Idempotency-Key "$RUN-p"
row "replay: idemgate -> Restate" "$GATEWAY" replay Idempotency-Key "$RUN-p"
row "replay: Restate ingress directly" "$DIRECT" replay idempotency-key "t-*:*:*:$RUN-p"
