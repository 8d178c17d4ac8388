#!/usr/bin/env bash
# idemgate benchmark harness. See bench/README.md.
#
#   bench/run.sh                                  # full run (~8 min + builds), rewrites docs/benchmarks.md
#   BENCH_QUICK=1 bench/run.sh                    # quick mode for development (~4 min)
#   BENCH_STORES=memory,embedded BENCH_SCENARIOS=miss,replay bench/run.sh
#   IDEMGATE_BIN=/path/idemgate BENCH_DURATION=5s bench/run.sh
#   BENCH_PGO=1 bench/run.sh                      # on the profile-guided build of bench/pgo.sh
#   BENCH_PAIRS_ROUNDS=20 bench/run.sh            # also the ratio targets from interleaved rounds
#
# Everything listens on 127.0.0.1 only; every process started here is killed by
# the EXIT trap; every wait is bounded.
set -euo pipefail
# One block, read whole before any of it runs: bash reads a script as it goes, so an edit to
# this file during a run (which takes minutes) would change or break the run under way.
{

# ---------------------------------------------------------------- settings
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=bench/lib.sh
source "$REPO/bench/lib.sh"
LUA="$REPO/bench/idem.lua"
DOC="$REPO/docs/benchmarks.md"
IMG="$REPO/docs/img/benchmarks.svg"

QUICK="${BENCH_QUICK:-0}"
if [[ "$QUICK" == 1 ]]; then
  d_dur=3s; d_warm=1s; d_growth=10k,100k; d_rate_dur=3s
else
  d_dur=8s; d_warm=2s; d_growth=10k,1m,10m; d_rate_dur=8s
fi
DURATION="${BENCH_DURATION:-$d_dur}"
WARMUP="${BENCH_WARMUP:-$d_warm}"
RATE_DURATION="${BENCH_RATE_DURATION:-$d_rate_dur}"
CONNS="${BENCH_CONNECTIONS:-32}"
THREADS=1
POOL=1000
REPEAT="${BENCH_REPEAT:-1}"  # measured runs per row; the median (by req/s) is reported
SPREAD_PCT="${BENCH_SPREAD_PCT:-15}" # with 3+ runs: a row whose runs spread wider (max-min over median) ...
EXTRA="${BENCH_EXTRA_RUNS:-2}"       # ... gets this many more runs before the median is taken
NOISE_PCT="${BENCH_NOISE_PCT:-10}" # flag a row when foreign CPU exceeds this % of one core
PEERS_ONLY="${BENCH_PEERS_ONLY:-0}"
STORES="${BENCH_STORES-memory,embedded,redis,postgres}"
[[ "$PEERS_ONLY" == 1 ]] && STORES=""
SCENARIOS="${BENCH_SCENARIOS:-passthrough,miss,replay,mixed,storm,rate,growth}"
PEERS="${BENCH_PEERS-upstream,nginx,floor,hyper-floor,express-idempotency,node-idempotency}"
GROWTH_LEVELS="${BENCH_GROWTH:-$d_growth}"
GROWTH_STORES="${BENCH_GROWTH_STORES:-memory}"
GROWTH_DURATION="${BENCH_GROWTH_DURATION:-3s}"
GROWTH_BUDGET="${BENCH_GROWTH_BUDGET:-420}"   # seconds of filling, in all, before levels are skipped
RATE_FRACTION="${BENCH_RATE_FRACTION:-0.5}"
# Open-loop pairs (idemgate, then nginx at the same rate) per store; the report takes each side's
# median p99. One pair let a single stall of 10-20 ms decide the p99 target (2026-11-26, night).
RATE_REPEAT="${BENCH_RATE_REPEAT:-$REPEAT}"
FLUSH_SECONDS="${BENCH_FLUSH_SECONDS:-10}"  # bench/flush_probe.py before a durable store's open-loop rows (0: none)
STORM_N="${BENCH_STORM_N:-1000}"
STORM_DELAY_MS="${BENCH_STORM_DELAY_MS:-200}"
REDIS_URL="${BENCH_REDIS_URL:-redis://127.0.0.1:6379/15}"
PG_URL="${BENCH_PG_URL:-postgres://postgres@127.0.0.1:5432/test}"
WRITE_DOC="${BENCH_WRITE_DOC:-1}"
NODE_DIR="${BENCH_NODE_DIR:-$HOME/.cache/idemgate/bench-node}"
NGINX_WORKERS=1          # static upstream and nginx proxy peer: one worker each
LOADGEN_CPUS="${BENCH_LOADGEN_CPUS:-0}"             # wrk / idemgate-bench
SUT_CPUS="${BENCH_SUT_CPUS:-1}"                     # the proxy under test (nginx, node or idemgate)
UPSTREAM_CPUS="${BENCH_UPSTREAM_CPUS:-$LOADGEN_CPUS}" # the static upstream
REDIS_CPUS="${BENCH_REDIS_CPUS-$LOADGEN_CPUS}"       # Redis, for the run (restored after); empty: left as it is
PIN="${BENCH_PIN:-1}"                               # 0: no taskset at all
GW_PRELOAD="${BENCH_IDEMGATE_PRELOAD:-}"             # e.g. a jemalloc .so, for allocator experiments
PROFILE="${BENCH_PROFILE:-auto}"                    # perf profile of idemgate during warm-ups
GW_LOG="${BENCH_IDEMGATE_LOG:-warn}" # idemgate log filter; warn = no per-request access log (nginx: access_log off)
# Rounds of bench/targets.sh after the run (0: none): the closed-loop ratio targets read from
# interleaved rounds, added to the report, for a VM whose drift between rows exceeds the ratios.
PAIRS_ROUNDS="${BENCH_PAIRS_ROUNDS:-0}"
PAIRS_SECONDS="${BENCH_PAIRS_SECONDS:-4}"
PGO_BUILD="${BENCH_PGO:-0}"   # 1: measure the profile-guided build of bench/pgo.sh (unless IDEMGATE_BIN is set)
export IDEMGATE_LOG="$GW_LOG" RUST_LOG="$GW_LOG"

UP_PORT=18000
PROXY_PORT=18001
GW_PORT=18002
SLOW_PORT=18003
NODE_PORT=18004
FLOOR_PORT=18005
# Row names of the reference proxies, as report.py knows them.
FLOOR_ROW="floor (tokio + httparse, reference)"
HYPER_FLOOR_ROW="hyper alone (reference)"
ORDERS_PATH=/api/v1/orders
STORM_PATH=/storm/orders
BODY='{"amount":100,"currency":"eur"}'
RUN_ID="$(od -An -N5 -tx1 /dev/urandom | tr -d ' \n')"   # in every key, prefix and schema of this run

log() { printf '[bench %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
has() { [[ ",$1," == *",$2,"* ]]; }

duration_secs() { # 10s | 2m | 1h | 10  ->  seconds
  local v="$1"
  [[ "$v" =~ ^([0-9]+)([smh]?)$ ]] || die "bad duration '$v' (use e.g. 10s, 1m)"
  case "${BASH_REMATCH[2]}" in
    m) echo $((BASH_REMATCH[1] * 60)) ;;
    h) echo $((BASH_REMATCH[1] * 3600)) ;;
    *) echo "${BASH_REMATCH[1]}" ;;
  esac
}
count_num() { # 10k | 1m | 10M | 2500 -> integer
  local v="${1,,}"
  [[ "$v" =~ ^([0-9]+)([km]?)$ ]] || die "bad count '$1' (use e.g. 10k, 1m)"
  case "${BASH_REMATCH[2]}" in
    k) echo $((BASH_REMATCH[1] * 1000)) ;;
    m) echo $((BASH_REMATCH[1] * 1000000)) ;;
    *) echo "${BASH_REMATCH[1]}" ;;
  esac
}
DUR_S="$(duration_secs "$DURATION")"
WARM_S="$(duration_secs "$WARMUP")"
RATE_S="$(duration_secs "$RATE_DURATION")"
GROWTH_S="$(duration_secs "$GROWTH_DURATION")"
[[ "$CONNS" =~ ^[0-9]+$ ]] || die "BENCH_CONNECTIONS must be a number"
[[ "$REPEAT" =~ ^[1-9][0-9]*$ ]] || die "BENCH_REPEAT must be a positive number"
[[ "$RATE_REPEAT" =~ ^[1-9][0-9]*$ ]] || die "BENCH_RATE_REPEAT must be a positive number"
[[ "$FLUSH_SECONDS" =~ ^[0-9]+$ ]] && FLUSH_SECONDS=$((10#$FLUSH_SECONDS)) || die "BENCH_FLUSH_SECONDS must be a number of seconds (0: no probe)"
[[ "$SPREAD_PCT" =~ ^[0-9]+$ && "$EXTRA" =~ ^[0-9]+$ ]] || die "BENCH_SPREAD_PCT and BENCH_EXTRA_RUNS must be whole numbers"
for s in ${STORES//,/ }; do
  case "$s" in memory|embedded|redis|postgres) ;; *) die "unknown store '$s' in BENCH_STORES" ;; esac
done
for s in ${SCENARIOS//,/ }; do
  case "$s" in passthrough|miss|replay|mixed|storm|rate|growth) ;; *) die "unknown scenario '$s' in BENCH_SCENARIOS" ;; esac
done
for s in ${PEERS//,/ }; do
  case "$s" in upstream|nginx|floor|hyper-floor|express-idempotency|node-idempotency) ;; *) die "unknown peer '$s' in BENCH_PEERS" ;; esac
done
NODE_PEERS=""
for s in express-idempotency node-idempotency; do has "$PEERS" "$s" && NODE_PEERS="$NODE_PEERS $s"; done
NEED_REDIS=0; NEED_PG=0
{ has "$STORES" redis || [[ -n "$NODE_PEERS" ]]; } && NEED_REDIS=1
has "$STORES" postgres && NEED_PG=1

# ---------------------------------------------------------------- cleanup
WORK="$(mktemp -d /tmp/idemgate-bench.XXXXXX)"
chmod 755 "$WORK"
PIDS=()
PG_SCHEMAS=()

stop_pid() { # TERM the process (and its process group if it leads one), bounded wait, then KILL
  local pid="$1" pgid i
  kill -0 "$pid" 2>/dev/null || return 0
  pgid="$(ps -o pgid= -p "$pid" 2>/dev/null | tr -d ' ' || true)"
  if [[ "$pgid" == "$pid" ]]; then kill -TERM -- "-$pid" 2>/dev/null || true
  else kill -TERM "$pid" 2>/dev/null || true; fi
  for i in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    log "pid $pid did not stop on TERM, sending KILL"
    if [[ "$pgid" == "$pid" ]]; then kill -KILL -- "-$pid" 2>/dev/null || true
    else kill -KILL "$pid" 2>/dev/null || true; fi
  fi
  wait "$pid" 2>/dev/null || true
  forget_pid "$pid"
}
forget_pid() { local p keep=(); for p in "${PIDS[@]+"${PIDS[@]}"}"; do if [[ "$p" != "$1" ]]; then keep+=("$p"); fi; done; PIDS=("${keep[@]+"${keep[@]}"}"); }

# Redis: this run's keys all contain RUN_ID (idemgate's store.prefix, node-idempotency's
# cacheKeyPrefix, and every key sent to express-idempotency, which uses the raw key).
redis_cli() { timeout 60 redis-cli -u "$REDIS_URL" "$@"; }
redis_purge() {
  ((NEED_REDIS)) || return 0
  log "redis: removed $(redis_unlink "$REDIS_URL" "*$RUN_ID*") keys of this run"
}
pg_drop_schemas() {
  local s
  for s in "${PG_SCHEMAS[@]+"${PG_SCHEMAS[@]}"}"; do
    timeout 120 psql -q "$PG_URL" -c "DROP SCHEMA IF EXISTS $s CASCADE" >/dev/null 2>&1 || log "could not drop schema $s"
  done
  PG_SCHEMAS=()
}

cleanup() {
  local rc=$? p
  trap - EXIT INT TERM
  for p in "${PIDS[@]+"${PIDS[@]}"}"; do stop_pid "$p"; done
  redis_purge || true
  redis_unpin
  pg_drop_schemas || true
  if [[ "${BENCH_KEEP_TMP:-0}" == 1 || $rc -ne 0 ]]; then
    log "logs kept in $WORK"
  else
    rm -rf "$WORK"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# start_bg NAME CPUS CWD CMD...   -> sets LAST_PID (own session/process group)
start_bg() {
  local name="$1" cpus="$2" cwd="$3"; shift 3
  local pin=()
  if [[ -n "$cpus" ]]; then pin=(taskset -c "$cpus"); fi
  ( cd "$cwd" && exec setsid "${pin[@]+"${pin[@]}"}" "$@" ) >"$WORK/$name.out" 2>&1 </dev/null &
  LAST_PID=$!
  PIDS+=("$LAST_PID")
}

# wait_http NAME PID PORT [PATH]: poll with curl until the port answers 200 to a plain POST (20 s deadline)
wait_http() {
  local name="$1" pid="$2" port="$3" path="${4:-$ORDERS_PATH}" deadline code
  deadline=$((SECONDS + 20))
  while :; do
    if ! kill -0 "$pid" 2>/dev/null; then
      tail -n 30 "$WORK/$name.out" >&2 || true
      die "$name exited during startup"
    fi
    code="$(curl -s -o /dev/null -w '%{http_code}' --max-time 1 -X POST \
            -H 'Content-Type: application/json' --data-binary "$BODY" \
            "http://127.0.0.1:$port$path" || true)"
    [[ "$code" != "000" && -n "$code" ]] && break
    (( SECONDS < deadline )) || { tail -n 30 "$WORK/$name.out" >&2 || true; die "$name not answering on 127.0.0.1:$port after 20 s"; }
    sleep 0.1
  done
  [[ "$code" == 200 ]] || die "$name answered $code (expected 200) to a plain POST"
  log "$name ready on 127.0.0.1:$port (pid $pid)"
}

port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
wait_port_free() {
  local deadline=$((SECONDS + 10))
  until port_free "$1"; do (( SECONDS < deadline )) || die "port $1 still busy"; sleep 0.1; done
}

rss_kb() { # VmRSS of a process plus its direct children (nginx master + worker), kB
  local pid="$1" total=0 p v
  for p in "$pid" $(pgrep -P "$pid" 2>/dev/null || true); do
    v="$(awk '/^VmRSS:/ {print $2}' "/proc/$p/status" 2>/dev/null || true)"
    total=$((total + ${v:-0}))
  done
  echo "$total"
}

# ---------------------------------------------------------------- prerequisites
need_apt=()
command -v wrk >/dev/null 2>&1 || need_apt+=(wrk)
command -v nginx >/dev/null 2>&1 || [[ -x /usr/sbin/nginx ]] || need_apt+=(nginx-light)
command -v curl >/dev/null 2>&1 || need_apt+=(curl)
command -v taskset >/dev/null 2>&1 || need_apt+=(util-linux)
command -v ss >/dev/null 2>&1 || need_apt+=(iproute2)
command -v python3 >/dev/null 2>&1 || need_apt+=(python3)
((NEED_REDIS)) && { command -v redis-cli >/dev/null 2>&1 || need_apt+=(redis-tools); }
((NEED_PG)) && { command -v psql >/dev/null 2>&1 || need_apt+=(postgresql-client); }
[[ -n "$NODE_PEERS" ]] && { command -v node >/dev/null 2>&1 || die "node (>= 18) and npm are needed for the Node peers (or set BENCH_PEERS=upstream,nginx)"; }
if ((${#need_apt[@]})); then
  log "installing: ${need_apt[*]}"
  [[ $EUID -eq 0 ]] || die "need root to apt-get install ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  timeout 300 apt-get update -qq
  if ! timeout 600 apt-get install -y -qq "${need_apt[@]}" >"$WORK/apt.log" 2>&1; then
    # nginx-light is gone from newer Debian releases; fall back to nginx
    need_apt=("${need_apt[@]/nginx-light/nginx}")
    timeout 600 apt-get install -y -qq "${need_apt[@]}" >>"$WORK/apt.log" 2>&1 || { tail "$WORK/apt.log" >&2; die "apt-get install failed"; }
  fi
fi
NGINX="$(command -v nginx || echo /usr/sbin/nginx)"

if [[ "$PROFILE" == auto ]]; then
  PROFILE=0
  if command -v perf >/dev/null 2>&1 && { [[ $EUID -eq 0 ]] || (( $(cat /proc/sys/kernel/perf_event_paranoid 2>/dev/null || echo 3) <= 1 )); }; then PROFILE=1; fi
fi

NCPU="$(nproc)"
if (( NCPU < 2 )) || [[ "$PIN" != 1 ]]; then
  log "running without taskset pinning ($NCPU CPU, BENCH_PIN=$PIN)"
  LOADGEN_CPUS=""; SUT_CPUS=""; UPSTREAM_CPUS=""; REDIS_CPUS=""
fi

for p in $UP_PORT $PROXY_PORT $GW_PORT $SLOW_PORT $NODE_PORT $FLOOR_PORT; do
  port_free "$p" || die "127.0.0.1:$p is already in use"
done

if ((NEED_REDIS)); then
  [[ "$(redis_cli ping 2>/dev/null)" == PONG ]] || die "Redis at $REDIS_URL does not answer PING"
  REDIS_PID="$(redis_cli info server | tr -d '\r' | awk -F: '/^process_id:/ {print $2}')"
  # Valkey reports the Redis version it is compatible with too: its own name and version win.
  REDIS_CONF="$(redis_cli info server | tr -d '\r' | awk -F: '/^redis_version:/ {v = "Redis " $2} /^valkey_version:/ {k = "Valkey " $2} END {print (k != "" ? k : v)}'), appendonly $(redis_cli config get appendonly | tail -n1), appendfsync $(redis_cli config get appendfsync | tail -n1)"
  # Pinned to the load side for the run, as a dependency on a host of its own would be, and
  # given its affinity back at the end (redis_pin in bench/lib.sh); only a server on this machine.
  if [[ -n "$REDIS_CPUS" ]] && ! redis_pin "$REDIS_URL" "$REDIS_CPUS" 2>"$WORK/redis-pin.err"; then
    log "Redis left unpinned: $(cat "$WORK/redis-pin.err")"; REDIS_CPUS=""
  fi
fi
if ((NEED_PG)); then
  PG_VER="$(timeout 30 psql -Atq "$PG_URL" -c 'show server_version' 2>/dev/null)" || die "PostgreSQL at $PG_URL does not answer"
  PG_CONF="PostgreSQL $PG_VER, synchronous_commit $(timeout 30 psql -Atq "$PG_URL" -c 'show synchronous_commit'), fsync $(timeout 30 psql -Atq "$PG_URL" -c 'show fsync')"
  PG_PID="$(pgrep -o -x postgres || pgrep -o postgres || true)"   # the postmaster: backends are its children
fi

# ---------------------------------------------------------------- binaries
TDIR="${CARGO_TARGET_DIR:-target}"
[[ "$TDIR" = /* ]] || TDIR="$REPO/$TDIR"
IDEMGATE=""
PGO_STORES=""   # the stores bench/pgo.sh trained the measured build on, when it built it
if [[ -n "$STORES" ]]; then
  if [[ -n "${IDEMGATE_BIN:-}" ]]; then
    IDEMGATE="$IDEMGATE_BIN"
  elif [[ "$PGO_BUILD" == 1 ]]; then
    log "building idemgate with profile-guided optimisation (bench/pgo.sh)"
    # pgo.sh bounds each of its steps (builds, training) itself.
    PGO_STORES="${BENCH_PGO_STORES:-memory,embedded,redis,postgres}"
    IDEMGATE="$(BENCH_PGO_STORES="$PGO_STORES" "$REPO/bench/pgo.sh")" || die "bench/pgo.sh failed"
  else
    log "building idemgate (cargo build --release -p idemgate)"
    ( cd "$REPO" && timeout 3600 cargo build --release -p idemgate ) || die "cargo build failed"
    IDEMGATE="$TDIR/release/idemgate"
  fi
  [[ -x "$IDEMGATE" ]] || die "idemgate binary not found or not executable: $IDEMGATE"
  IDEMGATE="$(cd "$(dirname "$IDEMGATE")" && pwd)/$(basename "$IDEMGATE")"
fi
# the load tools (bench/loadgen, built by build_loadgen in bench/lib.sh)
log "building bench/loadgen (idemgate-bench)"
LOADGEN="$(build_loadgen "$REPO")" || die "building bench/loadgen failed"
# the reference proxies (passthrough only; bench/README.md, "Reference proxies")
FLOOR=""
if { has "$PEERS" floor || has "$PEERS" hyper-floor; } && has "$SCENARIOS" passthrough; then
  log "building the reference proxies (idemgate-bench --features floor)"
  # References only: a run without them still measures every target.
  FLOOR="$(build_floor "$REPO")" || { log "building the reference proxies failed; their rows are left out"; FLOOR=""; }
fi

# Node peers: installed from bench/node/package-lock.json into $NODE_DIR, outside the repository
if [[ -n "$NODE_PEERS" ]]; then
  mkdir -p "$NODE_DIR"
  if ! cmp -s "$REPO/bench/node/package-lock.json" "$NODE_DIR/package-lock.json" || [[ ! -d "$NODE_DIR/node_modules/express-idempotency" ]]; then
    log "installing the Node peers into $NODE_DIR (npm ci)"
    cp "$REPO/bench/node/package.json" "$REPO/bench/node/package-lock.json" "$NODE_DIR/"
    ( cd "$NODE_DIR" && timeout 600 npm ci --no-audit --no-fund --loglevel=error ) >"$WORK/npm.log" 2>&1 \
      || { tail -n 20 "$WORK/npm.log" >&2; die "npm ci failed"; }
  fi
  cp "$REPO/bench/node/peer.js" "$NODE_DIR/peer.js"
  NODE_VERSIONS="node $(node -v), $(cd "$NODE_DIR" && node -e 'for (const p of ["express","express-idempotency","express-idempotency-redis-adapter","@node-idempotency/core","@node-idempotency/storage-adapter-redis"]) process.stdout.write(p + " " + require(p + "/package.json").version + ", ")' | sed 's/, $//')"
fi

# ---------------------------------------------------------------- nginx configs
nginx_conf() { # NAME PORT BODY-OF-HTTP-BLOCK
  local name="$1" port="$2" inner="$3"
  mkdir -p "$WORK/$name/tmp"
  chmod -R 755 "$WORK/$name"
  nginx_conf_text "$WORK/$name" "$NGINX_WORKERS" "$inner" >"$WORK/$name/nginx.conf"
  "$NGINX" -t -q -p "$WORK/$name" -e "$WORK/$name/error.log" -c "$WORK/$name/nginx.conf" \
    || die "nginx config test failed for $name"
}

nginx_conf upstream $UP_PORT "$(static_upstream "$UP_PORT")"

nginx_conf proxy $PROXY_PORT "$(proxy_pass_peer "$PROXY_PORT" "$UP_PORT")"

start_nginx() { # NAME CPUS
  start_bg "nginx-$1" "$2" "$WORK/$1" \
    "$NGINX" -p "$WORK/$1" -e "$WORK/$1/error.log" -c "$WORK/$1/nginx.conf"
}

# ---------------------------------------------------------------- CPU accounting
# child_ticks VAR: store in VAR the CPU ticks (user+sys) of all children this
# shell has reaped so far. `times` must run in this shell, not in a $(...) subshell.
child_ticks() {
  local u s
  times >"$WORK/times"
  { read -r _ _; read -r u s; } <"$WORK/times"
  printf -v "$1" '%s' "$(awk -v u="$u" -v s="$s" '
    function sec(x) { split(x, a, "m"); sub(/s$/, "", a[2]); return a[1] * 60 + a[2] }
    BEGIN { printf "%d", (sec(u) + sec(s)) * 100 }')"
}

# Busy ticks of the whole machine, comparable with per-process utime+stime. With
# tick-based accounting (CONFIG_IRQ_TIME_ACCOUNTING unset, the usual case) an
# irq/softirq tick is charged both to /proc/stat irq/softirq and to the task it
# interrupted, so those columns belong in the sum; with IRQ time accounting they
# are charged to no task and are left out (they are mostly our loopback traffic).
IRQ_TIME_ACCT=0
if { zcat /proc/config.gz 2>/dev/null || cat "/boot/config-$(uname -r)" 2>/dev/null; } \
     | grep -q '^CONFIG_IRQ_TIME_ACCOUNTING=y'; then IRQ_TIME_ACCT=1; fi
cpu_busy_ticks() {
  awk -v irqacct="$IRQ_TIME_ACCT" '/^cpu / { print $2 + $3 + $4 + (irqacct ? 0 : $7 + $8); exit }' /proc/stat
}
# Ticks the VM's host ran something else while a CPU of ours wanted to run (steal). Nothing on
# this machine shows up for them, yet every process here ran slower meanwhile.
cpu_steal_ticks() { awk '/^cpu / { print $9 + 0; exit }' /proc/stat; }
# proc_ticks (bench/lib.sh) counts a process with its children, those that ended included: a
# PostgreSQL backend that exits during a run would otherwise read as foreign CPU.
CLK_TCK="$(getconf CLK_TCK)"
[[ "$CLK_TCK" == 100 ]] || die "CLK_TCK is $CLK_TCK, accounting assumes 100"

# Processes that belong to the measured system besides the one under test: the static upstream,
# the idle nginx peer, the slow upstream, and Redis or PostgreSQL while a row uses them.
# Their CPU is not "foreign".
OWN_PIDS=()
# own_ticks [SUT_PID]: the CPU of OWN_PIDS but the one under test (the nginx peer is both in its rows)
own_ticks() {
  local t=0 p
  for p in "${OWN_PIDS[@]+"${OWN_PIDS[@]}"}"; do [[ "$p" == "${1:-}" ]] || t=$((t + $(proc_ticks "$p"))); done
  echo "$t"
}
# foreign_begin SUT_PID / foreign_end SUT_PID LOADGEN_TICKS -> FOREIGN, STEAL and SUT_PCT (% of one
# core over the wall-clock time between the two calls). FOREIGN is the CPU this run lost: other
# processes' busy time plus the host's steal time; STEAL is the steal part alone; SUT_PCT is what
# the system under test used, LOAD_PCT how busy the load core was (empty unless it is one CPU).
uptime_ticks() { awk '{ printf "%d", $1 * 100 }' /proc/uptime; }
# load_cpu_ticks -> "busy total" ticks of the load core (LOADGEN_CPUS when it is one CPU, else empty)
load_cpu_ticks() {
  [[ "$LOADGEN_CPUS" =~ ^[0-9]+$ ]] || return 0
  awk -v c="cpu$LOADGEN_CPUS" '$1 == c { b = $2 + $3 + $4 + $7 + $8 + $9; print b, b + $5 + $6; exit }' /proc/stat
}
foreign_begin() {
  F_T0="$(uptime_ticks)"; F_BUSY0="$(cpu_busy_ticks)"; F_STEAL0="$(cpu_steal_ticks)"
  F_SUT0="$(proc_ticks "$1")"; F_OWN0="$(own_ticks "$1")"; F_LOAD0="$(load_cpu_ticks)"
}
foreign_end() {
  local busy1 steal1 sut1 own1 t1
  busy1="$(cpu_busy_ticks)"; steal1="$(cpu_steal_ticks)"; sut1="$(proc_ticks "$1")"; own1="$(own_ticks "$1")"; t1="$(uptime_ticks)"
  read -r FOREIGN STEAL SUT_PCT < <(awk -v b=$((busy1 - F_BUSY0)) -v s=$((sut1 - F_SUT0)) -v o=$((own1 - F_OWN0)) \
      -v w="$2" -v st=$((steal1 - F_STEAL0)) -v d=$((t1 - F_T0)) 'BEGIN {
        if (d < 1) d = 1; f = 100 * (b - s - o - w) / d; if (f < 0) f = 0; st = 100 * st / d
        printf "%.0f %.0f %.0f\n", f + st, st, 100 * s / d }')
  # The load core's busy share: with SUT_PCT, whether the load side set the rate (bench/report.py).
  LOAD_PCT=""
  if [[ -n "$F_LOAD0" ]]; then
    LOAD_PCT="$(awk -v a="$F_LOAD0" -v b="$(load_cpu_ticks)" 'BEGIN {
      split(a, x, " "); split(b, y, " "); t = y[2] - x[2]; if (t > 0) printf "%.0f", 100 * (y[1] - x[1]) / t }')"
  fi
}

# ---------------------------------------------------------------- load runs
# results: one line per measurement, '|'-separated, first field the kind (see bench/report.py)
RESULTS="$WORK/results.txt"
: >"$RESULTS"
META="$WORK/meta.txt"
: >"$META"
meta() { printf '%s=%s\n' "$1" "$2" >>"$META"; }

# run_tracked OUTFILE SECS CMD... : runs CMD pinned to the load CPU as a tracked background job
# (a signal interrupts `wait` and the EXIT trap stops it at once), bounded by SECS + 30 s.
# Sets TRACKED_TICKS to the CPU ticks it used.
run_tracked() {
  local out="$1" secs="$2" pin=() c0 c1 wpid rc=0; shift 2
  if [[ -n "$LOADGEN_CPUS" ]]; then pin=(taskset -c "$LOADGEN_CPUS"); fi
  child_ticks c0
  timeout -s KILL $((secs + 30)) "${pin[@]+"${pin[@]}"}" "$@" >"$out" 2>&1 </dev/null &
  wpid=$!
  PIDS+=("$wpid")
  wait "$wpid" || rc=$?
  forget_pid "$wpid"
  child_ticks c1
  TRACKED_TICKS=$((c1 - c0))
  return "$rc"
}

# run_wrk PORT MODE KEYPREFIX DURATION [CONNS] -> WRK_LINE = the RESULT line plus wrk_ticks=<CPU ticks of wrk>
run_wrk() {
  local port="$1" mode="$2" prefix="$3" dur="$4" conns="${5:-$CONNS}" secs out rc=0
  secs="$(duration_secs "$dur")"
  out="$(mktemp "$WORK/wrk-$port-$mode-XXXXXX")"
  run_tracked "$out" "$secs" wrk -t"$THREADS" -c"$conns" -d"$dur" \
    --timeout 5s -s "$LUA" "http://127.0.0.1:$port$ORDERS_PATH" -- "$mode" "$prefix" "$POOL" || rc=$?
  if ((rc != 0)); then cat "$out" >&2; die "wrk failed against port $port ($mode), exit $rc"; fi
  grep -q '^RESULT ' "$out" || { cat "$out" >&2; die "no RESULT line from wrk"; }
  WRK_LINE="$(grep -m1 '^RESULT ' "$out") wrk_ticks=$TRACKED_TICKS"
}

# run_loadgen NAME SECS ARGS... -> LG_LINE = the RESULT line of idemgate-bench
run_loadgen() {
  local name="$1" secs="$2" out rc=0; shift 2
  out="$WORK/loadgen-$name-$(date +%s%N).out"
  run_tracked "$out" "$secs" "$LOADGEN" "$@" || rc=$?
  if ((rc != 0)); then cat "$out" >&2; die "idemgate-bench $1 failed ($name), exit $rc"; fi
  grep -q '^RESULT ' "$out" || { cat "$out" >&2; die "no RESULT line from idemgate-bench ($name)"; }
  LG_LINE="$(grep -m1 '^RESULT ' "$out")"
}

nonce() { printf '%s%04d' "$(date +%s%N | cut -c8-16)" $((RANDOM % 10000)); }
keyp() { echo "k${RUN_ID}$1$(nonce)"; }   # a key prefix of this run: k<RUN_ID><letter><nonce>

# bench_row SCENARIO TARGET PORT MODE SUT_PID [KEYPREFIX]
# warm-up once, then BENCH_REPEAT measured runs; the run with the median req/s is reported.
bench_row() {
  local scenario="$1" target="$2" port="$3" mode="$4" pid="$5" prefix="${6:-}"
  local i line rss runs="$WORK/runs.txt"
  log "$scenario / $target: warm-up $WARMUP"
  local perf_pid="" pdata="$WORK/perf-$scenario-${target//[^a-z]/_}.data"
  if [[ "$PROFILE" == 1 && "$target" == idemgate* && "$mode" != mixed ]]; then
    # flat profile of the gateway during the discarded warm-up (never during a measured run)
    timeout -s KILL $((WARM_S + 20)) perf record -q -F 999 -p "$pid" -o "$pdata" -- sleep "$WARM_S" >/dev/null 2>&1 &
    perf_pid=$!; PIDS+=("$perf_pid")
  fi
  case "$mode" in miss|mixed) run_wrk "$port" "$mode" "$(keyp w)" "$WARMUP" ;; *) run_wrk "$port" "$mode" "$prefix" "$WARMUP" ;; esac
  if [[ -n "$perf_pid" ]]; then
    wait "$perf_pid" 2>/dev/null || true; forget_pid "$perf_pid"
    profile_summary "$scenario" "$target" "$pdata"
  fi
  : >"$runs"
  local total="$REPEAT"
  for ((i = 1; i <= total; i++)); do
    log "$scenario / $target: measuring $DURATION (run $i/$total)"
    foreign_begin "$pid"
    case "$mode" in miss|mixed) run_wrk "$port" "$mode" "$(keyp m)" "$DURATION" ;; *) run_wrk "$port" "$mode" "$prefix" "$DURATION" ;; esac
    line="$WRK_LINE"
    foreign_end "$pid" "${line##*wrk_ticks=}"
    rss="$(rss_kb "$pid")"
    log "  ${line#RESULT } rss_kb=$rss foreign_cpu=${FOREIGN}% (of it steal ${STEAL}%) sut_cpu=${SUT_PCT}% load_cpu=${LOAD_PCT:-?}%"
    echo "$line rss_kb=$rss foreign=$FOREIGN steal=$STEAL sut=$SUT_PCT load=$LOAD_PCT" >>"$runs"
    # A row whose first runs disagree by more than the margins the targets are judged by gets
    # a few more runs, so that its median rests on more than one lucky or unlucky run.
    if ((i == REPEAT && REPEAT >= 3 && EXTRA > 0)) && [[ "$(spread_pct "$runs")" -gt "$SPREAD_PCT" ]]; then
      total=$((REPEAT + EXTRA))
      log "  runs spread over ${SPREAD_PCT}% of their median: $EXTRA more"
    fi
  done
  # pick the median run by req/s; errors are summed over all runs
  awk -v scenario="$scenario" -v target="$target" '
    { delete r; for (i = 2; i <= NF; i++) { split($i, kv, "="); r[kv[1]] = kv[2] }
      n++; rps[n] = r["rps"] + 0; ln[n] = $0; errs += r["errors"]
      req += r["requests"]; nx += r["non2xx"]; rp += r["replayed"]; rt += r["retries"]; un += r["unexpected"]; so += r["sock_errors"] }
    END {
      for (i = 1; i <= n; i++) idx[i] = i
      for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (rps[idx[j]] < rps[idx[i]]) { t = idx[i]; idx[i] = idx[j]; idx[j] = t }
      m = idx[int((n + 1) / 2)]
      split(ln[m], f, " "); delete r; for (i = 2; i in f; i++) { split(f[i], kv, "="); r[kv[1]] = kv[2] }
      printf "row|%s|%s|%s|%s|%s|%s|%d|requests=%d non2xx=%d replayed=%d retries=%d unexpected=%d sock_errors=%d|%s|%s|%s|%s|%s|%s\n",
        scenario, target, r["rps"], r["p50_us"], r["p99_us"], r["rss_kb"], errs, req, nx, rp, rt, un, so,
        r["foreign"], rps[idx[1]], rps[idx[n]], r["steal"], r["sut"], r["load"]
    }' "$runs" >>"$RESULTS"
  LAST_RPS="$(awk -F'|' -v s="$scenario" -v t="$target" '$1 == "row" && $2 == s && $3 == t { v = $4 } END { print v + 0 }' "$RESULTS")"
}

# spread_pct RUNS-FILE -> (max - min) / median of the runs' req/s, in whole percent
spread_pct() {
  awk '{ for (i = 2; i <= NF; i++) if ($i ~ /^rps=/) { v[++n] = substr($i, 5) + 0 } }
    END {
      for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (v[j] < v[i]) { t = v[i]; v[i] = v[j]; v[j] = t }
      med = v[int((n + 1) / 2)]
      printf "%d\n", (n && med > 0) ? 100 * (v[n] - v[1]) / med : 0
    }' "$1"
}

# profile_summary SCENARIO TARGET PERF.DATA: the top symbols by self time -> prof|... lines
profile_summary() {
  local samples
  [[ -s "$3" ]] || return 0
  samples="$(timeout 60 perf report -i "$3" --stdio --no-children --sort symbol 2>/dev/null \
             | awk '/^# Samples:/ && !n { n = $3 } END { print n }' || true)"
  timeout 60 perf report -i "$3" --stdio --no-children --sort dso,symbol --percent-limit 1 2>/dev/null \
    | awk -v s="$1" -v t="$2" -v n="${samples:-?}" '
        /^#/ || NF < 4 { next }
        { pct = $1; dso = $2; $1 = ""; $2 = ""; $3 = ""; sym = $0; gsub(/^ +| +$/, "", sym); gsub(/\|/, "/", sym)
          gsub(/ +- +- *$/, "", sym); if (length(sym) > 90) sym = substr(sym, 1, 87) "..."
          if (++k <= 10) printf "prof|%s|%s|%s|%s|%s|%s\n", s, t, n, pct, dso, sym }' >>"$RESULTS" || true
  rm -f "$3"
}

# ---------------------------------------------------------------- dedup helpers
post_key() { # PORT KEY [PATH] -> prints "CODE REPLAYED(true|false)"
  local hdrs code
  hdrs="$(curl -s -D - -o /dev/null --max-time 15 -X POST \
          -H 'Content-Type: application/json' -H "Idempotency-Key: $2" \
          --data-binary "$BODY" "http://127.0.0.1:$1${3:-$ORDERS_PATH}" | tr -d '\r' || true)"
  code="$(printf '%s\n' "$hdrs" | awk 'NR==1 {print $2}')"
  if printf '%s\n' "$hdrs" | grep -qi '^idempotent-replayed: *true$'; then echo "${code:-000} true"
  else echo "${code:-000} false"; fi
}

prime_pool() { # PORT PREFIX: complete POOL keys, one keep-alive curl run
  local port="$1" prefix="$2" cfg="$WORK/prime-$1.curlrc" i ok
  : >"$cfg"
  for ((i = 0; i < POOL; i++)); do
    if ((i > 0)); then echo next >>"$cfg"; fi
    cat >>"$cfg" <<EOF
url = "http://127.0.0.1:$port$ORDERS_PATH"
header = "Content-Type: application/json"
header = "Idempotency-Key: $prefix$i"
data-binary = "{\"amount\":100,\"currency\":\"eur\"}"
output = "/dev/null"
write-out = "%{http_code}\n"
max-time = 5
EOF
  done
  ok="$(timeout 120 curl -s -K "$cfg" | grep -c '^200$' || true)"
  [[ "$ok" == "$POOL" ]] || die "priming: only $ok of $POOL keys completed with 200"
  log "primed $POOL keys (${prefix}0 .. ${prefix}$((POOL - 1)))"
}

# dedup_rows TARGET PORT PID [STORE]: the closed-loop rows of a deduplicating target; with STORE,
# nginx's passthrough row again right before the target's ("beside STORE")
dedup_rows() {
  local target="$1" port="$2" pid="$3" beside="${4:-}" r1 r2 sk pool_prefix
  # sanity: first request with a key executes, the same request again replays
  sk="$(keyp s)"
  r1="$(post_key "$port" "$sk")"; r2="$(post_key "$port" "$sk")"
  [[ "$r1" == "200 false" && "$r2" == "200 true" ]] \
    || die "$target: dedup sanity check failed (first: '$r1', second: '$r2'; expected '200 false' then '200 true')"
  if has "$SCENARIOS" passthrough; then
    # nginx again right before each idemgate passthrough row: the passthrough target compares
    # the two measured a minute apart, not nginx's first row with one measured many minutes later
    if [[ -n "$beside" ]]; then
      bench_row passthrough "nginx proxy_pass, beside $beside" $PROXY_PORT passthrough "$PROXY_PID"
    fi
    bench_row passthrough "$target" "$port" passthrough "$pid"
  fi
  if has "$SCENARIOS" miss; then bench_row miss "$target" "$port" miss "$pid"; MISS_PEAK="$LAST_RPS"; fi
  if has "$SCENARIOS" replay || [[ -n "${WANT_POOL:-}" ]]; then
    pool_prefix="$(keyp r)-"
    prime_pool "$port" "$pool_prefix"
    POOL_PREFIX="$pool_prefix"
    r1="$(post_key "$port" "${pool_prefix}0")"
    [[ "$r1" == "200 true" ]] || die "$target: replay check failed for ${pool_prefix}0: got '$r1', expected '200 true'"
    if has "$SCENARIOS" replay; then bench_row replay "$target" "$port" replay "$pid" "$pool_prefix"; fi
  fi
  if has "$SCENARIOS" mixed; then bench_row mixed "$target" "$port" mixed "$pid"; fi
}

# ---------------------------------------------------------------- idemgate
gw_config() { # STORE DIR -> writes DIR/idemgate.yaml
  local store="$1" dir="$2" block schema
  case "$store" in
    memory | embedded) block="$(local_store_block "$store" "$dir")" ;;
    redis) block="$(redis_store_block "$REDIS_URL" "idemgate-bench-$RUN_ID")" ;;
    postgres)
      schema="idemgate_bench_$RUN_ID"
      PG_SCHEMAS+=("$schema")
      timeout 60 psql -q "$PG_URL" -c "CREATE SCHEMA IF NOT EXISTS $schema" >/dev/null || die "could not create schema $schema"
      block="$(pg_store_block "$PG_URL" "$schema")" ;;
  esac
  gw_yaml "$GW_PORT" "$UP_PORT" "$block" "$SLOW_PORT" >"$dir/idemgate.yaml"
}

start_gateway() { # STORE -> GW_PID
  local store="$1" dir="$WORK/gw-$1-$(nonce)"
  mkdir -p "$dir"
  gw_config "$store" "$dir"
  start_bg "idemgate-$store" "$SUT_CPUS" "$dir" env ${GW_PRELOAD:+LD_PRELOAD="$GW_PRELOAD"} "$IDEMGATE" serve --config "$dir/idemgate.yaml"
  GW_PID=$LAST_PID
  GW_DIR="$dir"
  wait_http "idemgate ($store)" "$GW_PID" $GW_PORT
}

store_pids() { # STORE -> the store server's pid for CPU accounting
  case "$1" in redis) echo "${REDIS_PID:-}" ;; postgres) echo "${PG_PID:-}" ;; esac
}

# data segments the gateway sent to its store server: one per round trip when requests come one at a time
store_segs() { # PID PORT
  ss -tinpH state established "( dport = :$2 )" 2>/dev/null | awk -v pid="pid=$1," '
    /users:/ { mine = index($0, pid) > 0; next }
    mine { for (i = 1; i <= NF; i++) if ($i ~ /^data_segs_out:/) { split($i, a, ":"); s += a[2] } }
    END { print s + 0 }'
}

round_trips() { # STORE TARGET: sequential misses and replays, store round trips per request
  local store="$1" target="$2" port s0 s1 n m
  case "$store" in redis) port="${REDIS_URL#redis://}"; port="${port#*:}"; port="${port%%/*}" ;;
                   postgres) port="${PG_URL#postgres://}"; port="${port#*@}"; port="${port#*:}"; port="${port%%/*}" ;; esac
  s0="$(store_segs "$GW_PID" "$port")"
  run_loadgen rt-miss 5 rate --url "http://127.0.0.1:$GW_PORT$ORDERS_PATH" --rate 200 --duration 1 --warmup 0 \
    --connections 1 --mode miss --prefix "$(keyp t)"
  s1="$(store_segs "$GW_PID" "$port")"; n="$(kv "$LG_LINE" requests)"
  m="$(awk -v a=$((s1 - s0)) -v n="$n" 'BEGIN { printf "%.2f", (n > 0 ? a / n : 0) }')"
  local r="n/a"
  if [[ -n "${POOL_PREFIX:-}" ]]; then
    s0="$(store_segs "$GW_PID" "$port")"
    run_loadgen rt-replay 5 rate --url "http://127.0.0.1:$GW_PORT$ORDERS_PATH" --rate 200 --duration 1 --warmup 0 \
      --connections 1 --mode replay --prefix "$POOL_PREFIX" --pool "$POOL"
    s1="$(store_segs "$GW_PID" "$port")"; n="$(kv "$LG_LINE" requests)"
    r="$(awk -v a=$((s1 - s0)) -v n="$n" 'BEGIN { printf "%.2f", (n > 0 ? a / n : 0) }')"
  fi
  log "$target: store round trips per miss $m, per replay $r"
  echo "rt|$target|$m|$r" >>"$RESULTS"
}

storm_row() { # TARGET URL SUT_PID EXPECT_EXEC
  local target="$1" url="$2" pid="$3" e0 e1 key line
  key="$(keyp x)"
  e0="$(curl -s --max-time 5 "http://127.0.0.1:$SLOW_PORT/executions" | tr -dc 0-9)"
  foreign_begin "$pid"
  run_loadgen storm 40 storm --url "$url" --n "$STORM_N" --key "$key" --timeout 20
  line="$LG_LINE"
  foreign_end "$pid" "$TRACKED_TICKS"
  sleep 0.2
  e1="$(curl -s --max-time 5 "http://127.0.0.1:$SLOW_PORT/executions" | tr -dc 0-9)"
  log "storm / $target: ${line#RESULT } upstream_executions=$((e1 - e0))"
  echo "storm|$target|$(kv "$line" n)|$(kv "$line" ok)|$(kv "$line" fresh)|$(kv "$line" replayed)|$(kv "$line" non2xx)|$(kv "$line" sock_errors)|$(kv "$line" p50_us)|$(kv "$line" p99_us)|$(kv "$line" max_us)|$((e1 - e0))|$STORM_DELAY_MS|$FOREIGN|$(kv "$line" statuses)|$(kv "$line" burst_max_us)" >>"$RESULTS"
}

rate_row() { # STORE-TARGET LABEL PORT MODE SUT_PID RATE
  local group="$1" target="$2" port="$3" mode="$4" pid="$5" rate="$6" line
  log "rate / $target: open loop at $rate req/s for $RATE_DURATION (+1 s warm-up), $CONNS connections"
  foreign_begin "$pid"
  run_loadgen rate $((RATE_S + 15)) rate --url "http://127.0.0.1:$port$ORDERS_PATH" --rate "$rate" \
    --duration "$RATE_S" --warmup 1 --connections "$CONNS" --mode "$mode" --prefix "$(keyp o)"
  line="$LG_LINE"
  foreign_end "$pid" "$TRACKED_TICKS"
  log "  ${line#RESULT } foreign_cpu=${FOREIGN}% (of it steal ${STEAL}%)"
  echo "rate|$group|$target|$rate|$(kv "$line" rps)|$(kv "$line" p50_us)|$(kv "$line" p90_us)|$(kv "$line" p99_us)|$(kv "$line" p999_us)|$(kv "$line" max_us)|$(kv "$line" errors)|$FOREIGN|$STEAL" >>"$RESULTS"
}

# ---------------------------------------------------------------- run
START_S=$SECONDS
# pre-flight: how busy is the machine before we start? (2 s sample)
b0="$(cpu_busy_ticks)"; sleep 2; b1="$(cpu_busy_ticks)"
IDLE_LOAD=$(( (b1 - b0) / 2 ))
if (( IDLE_LOAD > NOISE_PCT )); then
  log "WARNING: the machine is already using ${IDLE_LOAD}% of a core before the benchmark starts;"
  log "         numbers will be noisy (rows with foreign CPU > ${NOISE_PCT}% are flagged)"
fi
log "run $RUN_ID; work dir $WORK; duration $DURATION (+$WARMUP warm-up), $THREADS wrk thread, $CONNS connections"
log "stores: ${STORES:-none}; scenarios: $SCENARIOS; peers: ${PEERS:-none}"
log "pinning: load generator + static upstream -> CPU ${LOADGEN_CPUS:-any}; system under test -> CPU ${SUT_CPUS:-any}"

start_nginx upstream "$UPSTREAM_CPUS"; UP_PID=$LAST_PID
wait_http upstream "$UP_PID" $UP_PORT
OWN_PIDS=("$UP_PID")
if has "$PEERS" upstream && has "$SCENARIOS" passthrough; then
  OWN_PIDS=()
  bench_row passthrough "upstream (static nginx, direct)" $UP_PORT passthrough "$UP_PID"
  OWN_PIDS=("$UP_PID")
fi

# the nginx peer stays up (idle) for the open-loop comparisons at each store's half load
PROXY_PID=""
if has "$PEERS" nginx || { has "$SCENARIOS" rate && [[ -n "$STORES" ]]; }; then
  start_nginx proxy "$SUT_CPUS"; PROXY_PID=$LAST_PID
  wait_http "nginx proxy" "$PROXY_PID" $PROXY_PORT
  if has "$PEERS" nginx && has "$SCENARIOS" passthrough; then
    bench_row passthrough "nginx proxy_pass" $PROXY_PORT passthrough "$PROXY_PID"
  fi
  OWN_PIDS+=("$PROXY_PID")
fi

# the reference proxies, right after nginx's row: what the HTTP layer alone costs
if [[ -n "$FLOOR" ]]; then
  for peer in floor hyper-floor; do
    has "$PEERS" "$peer" || continue
    name="$([[ "$peer" == floor ]] && echo "$FLOOR_ROW" || echo "$HYPER_FLOOR_ROW")"
    start_bg "$peer" "$SUT_CPUS" "$WORK" "$FLOOR" "$peer" --listen "127.0.0.1:$FLOOR_PORT" --upstream "127.0.0.1:$UP_PORT"
    FLOOR_PID=$LAST_PID
    wait_http "$peer" "$FLOOR_PID" $FLOOR_PORT
    bench_row passthrough "$name" $FLOOR_PORT passthrough "$FLOOR_PID"
    stop_pid "$FLOOR_PID"
    wait_port_free $FLOOR_PORT
  done
fi

# the slow counting upstream of the duplicate storm (load CPU)
SLOW_PID=""
if has "$SCENARIOS" storm && [[ -n "$STORES" ]]; then
  start_bg slow-upstream "$UPSTREAM_CPUS" "$WORK" "$LOADGEN" upstream --listen "127.0.0.1:$SLOW_PORT" --delay-ms "$STORM_DELAY_MS"
  SLOW_PID=$LAST_PID
  wait_http "slow upstream" "$SLOW_PID" $SLOW_PORT
  # reference: the same burst straight to the upstream (no dedup: every request executes)
  storm_row "upstream alone (no dedup)" "http://127.0.0.1:$SLOW_PORT$STORM_PATH" "$SLOW_PID"
  OWN_PIDS+=("$SLOW_PID")
fi

# Node middlewares on Redis
for peer in $NODE_PEERS; do
  start_bg "node-$peer" "$SUT_CPUS" "$NODE_DIR" node peer.js "$peer" "$NODE_PORT" "$REDIS_URL" "k${RUN_ID}n"
  NODE_PID=$LAST_PID
  wait_http "$peer" "$NODE_PID" $NODE_PORT
  saved=("${OWN_PIDS[@]}"); OWN_PIDS+=("$REDIS_PID")
  WANT_POOL="" dedup_rows "$peer (redis)" "$NODE_PORT" "$NODE_PID"
  OWN_PIDS=("${saved[@]}")
  stop_pid "$NODE_PID"
  wait_port_free $NODE_PORT
  redis_purge
done

# idemgate, one store at a time
# flush_probe STORE: the disk's own flushes, right before a durable store's open-loop rows, as
# run metadata (flush_STORE, flush_where_STORE). Their p99 waits on every slow fdatasync, which
# nginx's never does, so the report says what the disk did just before them, with the gateway
# and the database idle (bench/flush_probe.py). In the embedded store's directory; for
# PostgreSQL, whether its data directory is on that device (only a server on this machine, and a
# role allowed to read the setting, can say). A probe that fails is logged and left out; the rows
# are measured all the same.
flush_probe() {
  local store="$1" line where pgdata
  log "disk flushes before the open-loop rows of $store: bench/flush_probe.py for ${FLUSH_SECONDS} s in $WORK"
  line="$(timeout $((FLUSH_SECONDS * 3 + 30)) python3 "$REPO/bench/flush_probe.py" "$WORK" "$FLUSH_SECONDS" \
    2>"$WORK/flush-probe.err" | grep '^FLUSH ' || true)"
  if [[ -z "$line" ]]; then
    log "disk flushes: the probe failed ($(tail -n1 "$WORK/flush-probe.err" 2>/dev/null || true)); left out of the report"
    return 0
  fi
  log "$line"
  where="$(df --output=source "$WORK" 2>/dev/null | tail -n1 || echo '?') ($(df --output=fstype "$WORK" 2>/dev/null | tail -n1 || echo '?'))"
  if [[ "$store" == postgres ]]; then
    pgdata="$(timeout 30 psql -Atq "$PG_URL" -c 'show data_directory' 2>/dev/null || true)"
    if [[ -z "$pgdata" ]]; then
      where+="; where PostgreSQL's data directory is could not be read (not probed)"
    elif [[ ! -d "$pgdata" ]]; then
      where+="; PostgreSQL's data directory is not on this machine (not probed)"
    elif [[ "$(stat -c %d "$pgdata" 2>/dev/null || echo pg)" == "$(stat -c %d "$WORK" 2>/dev/null || echo work)" ]]; then
      where+="; PostgreSQL's data directory is on the same device"
    else
      where+="; PostgreSQL's data directory is on $(df --output=source "$pgdata" 2>/dev/null | tail -n1 || echo '?') (not probed)"
    fi
  fi
  meta "flush_$store" "$line"
  meta "flush_where_$store" "$where"
}

PER_STORE=""
for s in passthrough miss replay mixed storm rate; do if has "$SCENARIOS" "$s"; then PER_STORE=1; fi; done
for store in ${PER_STORE:+${STORES//,/ }}; do
  target="idemgate ($store)"
  start_gateway "$store"
  saved=("${OWN_PIDS[@]}"); sp="$(store_pids "$store")"; if [[ -n "$sp" ]]; then OWN_PIDS+=("$sp"); fi
  MISS_PEAK=0; POOL_PREFIX=""
  WANT_POOL=$([[ "$store" == redis || "$store" == postgres ]] && echo 1 || true) \
    dedup_rows "$target" $GW_PORT "$GW_PID" "$(has "$PEERS" nginx && echo "$store" || true)"
  if [[ "$store" == redis || "$store" == postgres ]]; then round_trips "$store" "$target"; fi
  if has "$SCENARIOS" storm; then
    r1="$(post_key $GW_PORT "$(keyp y)" "$STORM_PATH")"
    [[ "$r1" == "200 false" ]] || die "$target: storm route check failed: '$r1'"
    storm_row "$target" "http://127.0.0.1:$GW_PORT$STORM_PATH" "$GW_PID"
  fi
  if has "$SCENARIOS" rate; then
    if [[ "${MISS_PEAK%.*}" -gt 0 ]]; then
      rate="$(awk -v p="$MISS_PEAK" -v f="$RATE_FRACTION" 'BEGIN { printf "%d", p * f }')"
      if ((FLUSH_SECONDS > 0)) && [[ "$store" == embedded || "$store" == postgres ]]; then flush_probe "$store"; fi
      for ((i = 1; i <= RATE_REPEAT; i++)); do
        rate_row "$store" "$target" $GW_PORT miss "$GW_PID" "$rate"
        rate_row "$store" "nginx proxy_pass" $PROXY_PORT passthrough "$PROXY_PID" "$rate"
      done
    else
      log "rate: skipped for $store (needs the miss scenario for the peak)"
    fi
  fi
  log "$target: RSS $(rss_kb "$GW_PID") kB at the end$([[ "$store" == embedded ]] && echo "; store on disk $(du -sh "$GW_DIR/idemgate-data" 2>/dev/null | cut -f1)")"
  stop_pid "$GW_PID"
  OWN_PIDS=("${saved[@]}")
  wait_port_free $GW_PORT
  if [[ "$store" == redis ]]; then redis_purge; fi
  if [[ "$store" == postgres ]]; then pg_drop_schemas; fi
done

# growth: miss throughput and RSS as live records accumulate
if has "$SCENARIOS" growth && [[ -n "$STORES" ]]; then
  GROWTH_T0=$SECONDS
  for store in ${GROWTH_STORES//,/ }; do
    has "$STORES" "$store" || { log "growth: $store is not in BENCH_STORES, skipped"; continue; }
    target="idemgate ($store)"
    start_gateway "$store"
    saved=("${OWN_PIDS[@]}"); sp="$(store_pids "$store")"; if [[ -n "$sp" ]]; then OWN_PIDS+=("$sp"); fi
    records=0
    rss0="$(rss_kb "$GW_PID")"
    echo "growth|$target|0|0|0|0|$rss0|0|0|0" >>"$RESULTS"
    for lv in ${GROWTH_LEVELS//,/ }; do
      level="$(count_num "$lv")"
      add=$((level - records))
      if ((add > 0)); then
        # estimated fill time from the last fill rate; skip levels that do not fit the budget
        if [[ -n "${FILL_RPS:-}" ]] && (( $(awk -v a="$add" -v r="$FILL_RPS" -v b=$((GROWTH_BUDGET - (SECONDS - GROWTH_T0))) 'BEGIN { print (a / r > b) }') )); then
          why="filling would take about $(awk -v a="$add" -v r="$FILL_RPS" 'BEGIN { printf "%d", a / r }') s at the last fill rate ($(printf '%.0f' "$FILL_RPS") req/s), over the remaining growth budget (BENCH_GROWTH_BUDGET=$GROWTH_BUDGET s in all)"
          log "growth / $target: $lv skipped: $why"
          echo "growth-skip|$target|$level|$why" >>"$RESULTS"
          break
        fi
        # never push the machine (shared) into swap or the OOM killer: project RSS from the
        # last fill's bytes per record, allow at most 40% of MemAvailable
        avail="$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo)"
        if [[ -n "${PER_REC_B:-}" ]] && (( $(awk -v a="$add" -v p="$PER_REC_B" -v m="$avail" 'BEGIN { print (a * p / 1024 > 0.4 * m) }') )); then
          why="at the measured $(printf '%.0f' "$PER_REC_B") B per record the gateway would need about $(awk -v a="$add" -v p="$PER_REC_B" 'BEGIN { printf "%.1f", a * p / 1073741824 }') GiB more, over 40% of the machine's available memory ($(awk -v m="$avail" 'BEGIN { printf "%.1f", m / 1048576 }') GiB)"
          log "growth / $target: $lv skipped: $why"
          echo "growth-skip|$target|$level|$why" >>"$RESULTS"
          break
        fi
        rss_before_fill="$(rss_kb "$GW_PID")"
        log "growth / $target: filling $add records (to $lv)"
        run_loadgen fill $((add / 1000 + 120)) fill --url "http://127.0.0.1:$GW_PORT$ORDERS_PATH" --n "$add" \
          --connections 64 --prefix "$(keyp g)"
        (( $(kv "$LG_LINE" errors) == 0 )) || die "growth fill had errors: $LG_LINE"
        records=$((records + $(kv "$LG_LINE" fresh)))
        FILL_RPS="$(kv "$LG_LINE" rps)"
        PER_REC_B="$(awk -v r0="$rss_before_fill" -v r1="$(rss_kb "$GW_PID")" -v n="$(kv "$LG_LINE" fresh)" 'BEGIN { v = n > 0 ? (r1 - r0) * 1024 / n : 0; if (v < 64) v = 64; printf "%.0f", v }')"
        log "  ${LG_LINE#RESULT }"
      fi
      sleep 1
      rss="$(rss_kb "$GW_PID")"
      log "growth / $target: $records records, RSS $rss kB; measuring miss for $GROWTH_DURATION"
      foreign_begin "$GW_PID"
      run_wrk $GW_PORT miss "$(keyp m)" "$GROWTH_DURATION"
      line="$WRK_LINE"
      foreign_end "$GW_PID" "${line##*wrk_ticks=}"
      log "  ${line#RESULT } foreign_cpu=${FOREIGN}%"
      echo "growth|$target|$level|$records|$(kv "$line" rps)|$(kv "$line" p50_us)|$rss|$(kv "$line" p99_us)|$(kv "$line" errors)|$FOREIGN" >>"$RESULTS"
      records=$((records + $(kv "$line" requests) - $(kv "$line" errors)))
    done
    stop_pid "$GW_PID"
    OWN_PIDS=("${saved[@]}")
    wait_port_free $GW_PORT
    if [[ "$store" == redis ]]; then redis_purge; fi
    if [[ "$store" == postgres ]]; then pg_drop_schemas; fi
  done
fi
if [[ -n "$SLOW_PID" ]]; then stop_pid "$SLOW_PID"; fi
if [[ -n "$PROXY_PID" ]]; then stop_pid "$PROXY_PID"; fi
stop_pid "$UP_PID"
ELAPSED=$((SECONDS - START_S))

if [[ "$PAIRS_ROUNDS" -gt 0 && -n "${IDEMGATE:-}" ]]; then
  log "interleaved rounds: bench/targets.sh, $PAIRS_ROUNDS rounds of ${PAIRS_SECONDS}s rows"
  # About 40 s a round; bounded like every other wait here.
  # A run that writes the report keeps the raw lines as bench/results/pairs-lines.txt
  # (write_report); its table names them so.
  pairs_name="$WORK/pairs-lines.txt"
  [[ "$WRITE_DOC" != 1 ]] || pairs_name=bench/results/pairs-lines.txt
  BENCH_TARGETS_OUT="$WORK/pairs-lines.txt" BENCH_TARGETS_NAME="$pairs_name" \
    timeout -s KILL $((PAIRS_ROUNDS * (6 * (PAIRS_SECONDS + 20)) + 60)) \
    "$REPO/bench/targets.sh" "$IDEMGATE" "$PAIRS_ROUNDS" "$PAIRS_SECONDS" >"$WORK/pairs.md" 2>"$WORK/pairs.log" ||
    die "bench/targets.sh failed (see $WORK/pairs.log)"
fi
log "measurements done in ${ELAPSED} s"

# ---------------------------------------------------------------- report
rev="$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo uncommitted)"
if [[ "$rev" != uncommitted && -n "$(git -C "$REPO" status --porcelain --untracked-files=no 2>/dev/null)" ]]; then
  rev="$rev (with uncommitted changes)"
fi
cmd="bench/run.sh"
for v in BENCH_QUICK BENCH_STORES BENCH_SCENARIOS BENCH_PEERS BENCH_PEERS_ONLY BENCH_DURATION BENCH_WARMUP BENCH_RATE_DURATION \
         BENCH_RATE_FRACTION BENCH_RATE_REPEAT BENCH_CONNECTIONS BENCH_REPEAT BENCH_GROWTH BENCH_GROWTH_STORES BENCH_GROWTH_DURATION \
         BENCH_GROWTH_BUDGET BENCH_FLUSH_SECONDS BENCH_STORM_N BENCH_STORM_DELAY_MS BENCH_REDIS_URL BENCH_PG_URL BENCH_PIN BENCH_LOADGEN_CPUS \
         BENCH_UPSTREAM_CPUS BENCH_SUT_CPUS BENCH_NOISE_PCT BENCH_IDEMGATE_LOG BENCH_IDEMGATE_PRELOAD BENCH_PROFILE \
         BENCH_NODE_DIR BENCH_PGO BENCH_PGO_STORES BENCH_PAIRS_ROUNDS BENCH_PAIRS_SECONDS IDEMGATE_BIN CARGO_TARGET_DIR; do
  if [[ -n "${!v:-}" ]]; then cmd="$v=${!v} $cmd"; fi
done
meta date "$(date -u '+%Y-%m-%d %H:%M UTC')"
meta machine "$NCPU CPU, $(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo), $(awk '/MemTotal/ {printf "%.0f GiB RAM", $2 / 1048576}' /proc/meminfo); kernel $(uname -srm); $( . /etc/os-release 2>/dev/null && echo "${PRETTY_NAME:-?}" || echo '?')"
meta rev "$rev"
meta command "$cmd"
meta wrk "$(wrk -v 2>&1 | head -n1 | awk '{print $2}')"
meta nginx "$("$NGINX" -v 2>&1 | sed 's/^nginx version: //')"
meta duration "$DURATION"; meta warmup "$WARMUP"; meta conns "$CONNS"; meta pool "$POOL"; meta repeat "$REPEAT"; meta spread_pct "$SPREAD_PCT"; meta extra_runs "$EXTRA"
meta rate_duration "$RATE_DURATION"; meta rate_fraction "$RATE_FRACTION"; meta rate_repeat "$RATE_REPEAT"
meta growth_duration "$GROWTH_DURATION"; meta growth_budget "$GROWTH_BUDGET"
meta storm_n "$STORM_N"; meta storm_delay_ms "$STORM_DELAY_MS"
meta lcpu "${LOADGEN_CPUS:-unpinned}"; meta scpu "${SUT_CPUS:-unpinned}"; meta upcpu "${UPSTREAM_CPUS:-unpinned}"; meta rcpu "${REDIS_CPUS:-unpinned}"
meta noise "$NOISE_PCT"; meta idle "$IDLE_LOAD"; meta gwlog "$GW_LOG"; meta elapsed "$ELAPSED"
meta stores "$STORES"; meta scenarios "$SCENARIOS"; meta peers "$PEERS"
meta bin "${IDEMGATE:-}"
meta pgo "$PGO_STORES"
meta preload "$GW_PRELOAD"
meta binmtime "$( [[ -n "${IDEMGATE:-}" ]] && date -u -r "$IDEMGATE" '+%Y-%m-%d %H:%M UTC' || true)"
meta redis "${REDIS_CONF:-}"; meta redis_url "$REDIS_URL"
meta postgres "${PG_CONF:-}"; meta pg_url "$PG_URL"
meta flush_seconds "$FLUSH_SECONDS"
meta node "${NODE_VERSIONS:-}"
meta loadavg "$(cut -d' ' -f1-3 /proc/loadavg)"

GEN="$WORK/generated.md"  # both branches render it there
if [[ "$WRITE_DOC" == 1 ]]; then
  # The report, and the raw results beside it (bench/results/), so a change to report.py can be
  # rendered again from this run by bench/render.sh without measuring again.
  write_report "$REPO" "$RESULTS" "$META" "$WORK" || die "report generation failed"
  log "wrote $DOC, $IMG and the raw results in $REPO/bench/results/"
else
  render_report "$REPO" "$RESULTS" "$META" "$WORK" || die "report generation failed"
  cp "$RESULTS" "${BENCH_RESULTS_COPY:-/tmp/idemgate-bench-results.txt}" 2>/dev/null || true
  log "BENCH_WRITE_DOC=0: docs left alone; results copied to ${BENCH_RESULTS_COPY:-/tmp/idemgate-bench-results.txt}"
fi
cat "$GEN"
exit
}
