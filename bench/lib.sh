# Shared by bench/run.sh, bench/ab.sh and bench/instructions.sh (sourced, not run): the static
# upstream's and the gateway's configuration, so the small rigs measure the gateway exactly as the
# full report does, and the rigs' common start.

# kv "RESULT a=1 b=2" b -> 2 (empty when the field is absent)
kv() {
  local f
  for f in $1; do [[ "$f" == "$2="* ]] && { echo "${f#*=}"; return; }; done
  echo ""
}

# nginx_conf_text DIR WORKERS HTTP-BODY -> an nginx.conf on stdout whose pid, logs and temp files
# live in DIR (DIR/tmp must exist), HTTP-BODY inside its http block.
nginx_conf_text() {
  local dir="$1" workers="$2" inner="$3" user_line=""
  # as root nginx would switch workers to "nobody nobody" (no such group on Debian)
  if [[ $EUID -eq 0 ]]; then user_line="user root root;"; fi
  cat <<EOF
$user_line
worker_processes $workers;
daemon off;
master_process on;
pid $dir/nginx.pid;
error_log $dir/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  keepalive_timeout 75s;
  keepalive_requests 1000000;
  client_body_temp_path $dir/tmp/body;
  proxy_temp_path $dir/tmp/proxy;
  fastcgi_temp_path $dir/tmp/fastcgi;
  uwsgi_temp_path $dir/tmp/uwsgi;
  scgi_temp_path $dir/tmp/scgi;
$inner
}
EOF
}

# static_upstream PORT -> the http body of the static upstream: every request answered 200 with
# the benchmark's small JSON body.
static_upstream() {
  cat <<EOF
  server {
    listen 127.0.0.1:$1 backlog=4096;
    location / {
      default_type application/json;
      return 200 '{"ok":true,"id":"ord_1"}';
    }
  }
EOF
}

# proxy_pass_peer PORT UP_PORT -> the http body of the nginx `proxy_pass` peer: keep-alive
# connections to the static upstream at UP_PORT, listening on PORT.
proxy_pass_peer() {
  cat <<EOF
  upstream app {
    server 127.0.0.1:$2;
    keepalive 64;
    keepalive_requests 1000000;
  }
  server {
    listen 127.0.0.1:$1 backlog=4096;
    location / {
      proxy_pass http://app;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }
  }
EOF
}

# gw_yaml GW_PORT UP_PORT STORE_BLOCK [SLOW_PORT] -> the gateway's YAML on stdout: a catch-all
# POST/PATCH `accepted` route with `scope: global` to the static upstream and, with SLOW_PORT, a
# `/storm/**` `required` route to the slow counting upstream ahead of it.
gw_yaml() {
  local gw_port="$1" up_port="$2" block="$3" slow_port="${4:-}"
  cat <<EOF
server:
  listen: 127.0.0.1:$gw_port
store:
$block
upstreams:
  app:
    url: http://127.0.0.1:$up_port
EOF
  if [[ -n "$slow_port" ]]; then
    cat <<EOF
  slow:
    url: http://127.0.0.1:$slow_port
    timeout: 30s
routes:
  - id: storm
    method: POST
    path: /storm/**
    upstream: slow
    policy: required
    scope: global
EOF
  else
    echo "routes:"
  fi
  cat <<EOF
  - id: all
    method: [POST, PATCH]
    path: /**
    upstream: app
    policy: accepted
    scope: global
EOF
}

# local_store_block STORE DIR -> the store block of the memory or embedded store. The memory
# store gets 12 GiB: its 512 MiB default fills up in a long miss row or the growth run.
local_store_block() {
  case "$1" in
    memory) printf '  kind: memory\n  max_bytes: 12GiB' ;;
    embedded) printf '  kind: embedded\n  path: %s/idemgate-data' "$2" ;;
    *) return 1 ;;
  esac
}

# redis_store_block URL PREFIX -> the store block of the redis store, every key under PREFIX.
redis_store_block() {
  printf '%s' "  kind: redis
  url: $1
  prefix: $2
  timeout: 5s"
}

# redis_pin URL CPUS: pins the Redis (or Valkey) server at URL, which must run on this machine,
# to CPUS, keeping its affinity in REDIS_AFFINITY and its pid in REDIS_PID for redis_unpin.
# Single-threaded and left to the scheduler, it often lands on the system under test's core
# (bench/README.md, "Fairness choices"). Fails with a message if it cannot.
redis_pin() {
  local info
  info="$(timeout 30 redis-cli -u "$1" info server 2>/dev/null | tr -d '\r')" || { echo "bench: Redis at $1 does not answer" >&2; return 1; }
  REDIS_PID="$(awk -F: '/^process_id:/ {print $2}' <<<"$info")"
  case "$(cat "/proc/$REDIS_PID/comm" 2>/dev/null)" in
    redis-server* | valkey-server*) ;;
    *) echo "bench: Redis at $1 is not a redis-server or valkey-server on this machine" >&2; return 1 ;;
  esac
  REDIS_AFFINITY="$(taskset -pc "$REDIS_PID" | awk -F': ' '{print $2}')"
  taskset -apc "$2" "$REDIS_PID" >/dev/null || { echo "bench: could not pin Redis (pid $REDIS_PID)" >&2; REDIS_AFFINITY=""; return 1; }
}

# redis_unpin: gives the server pinned by redis_pin its affinity back.
redis_unpin() {
  if [[ -n "${REDIS_AFFINITY:-}" ]]; then taskset -apc "$REDIS_AFFINITY" "$REDIS_PID" >/dev/null 2>&1 || true; fi
  REDIS_AFFINITY=""
}

# redis_unlink URL PATTERN -> how many keys matching PATTERN were removed.
redis_unlink() {
  timeout 60 redis-cli -u "$1" --scan --pattern "$2" 2>/dev/null \
    | timeout 300 xargs -r -n 500 redis-cli -u "$1" unlink 2>/dev/null \
    | awk '{ s += $1 } END { print s + 0 }' || true
}

# pg_store_block URL SCHEMA -> the store block of the postgres store, its table in SCHEMA (which
# the caller creates and drops).
pg_store_block() {
  printf '%s' "  kind: postgres
  url: $1?options=-c%20search_path%3D$2
  timeout: 5s"
}

# build_loadgen REPO [floor] -> the path of idemgate-bench: bench/loadgen (its own cargo workspace;
# dependencies tokio and httparse) built offline first, into $CARGO_TARGET_DIR (relative to REPO)
# or bench/loadgen/target. Fails if it does not build.
#
# With `floor`: the reference proxies too (`floor`, `hyper-floor`; `--features floor`), in a
# target directory of their own and with the gateway's release settings (fat LTO, one codegen
# unit) and allocator, so that a difference between them and idemgate is what each does, not
# how it was compiled.
build_loadgen() {
  local tdir="${CARGO_TARGET_DIR:-bench/loadgen/target}" args=(--release -q)
  [[ "$tdir" = /* ]] || tdir="$1/$tdir"
  if [[ "${2:-}" == floor ]]; then tdir="$tdir/floor" args+=(--features floor); fi
  (cd "$1/bench/loadgen" && export CARGO_TARGET_DIR="$tdir" &&
    if [[ "${2:-}" == floor ]]; then export CARGO_PROFILE_RELEASE_LTO=fat CARGO_PROFILE_RELEASE_CODEGEN_UNITS=1; fi &&
    { timeout 1800 cargo build "${args[@]}" --offline 2>/dev/null || timeout 1800 cargo build "${args[@]}"; }) >&2 || return 1
  echo "$tdir/release/idemgate-bench"
}

# build_floor REPO -> idemgate-bench with the reference proxies (build_loadgen REPO floor).
build_floor() {
  build_loadgen "$1" floor
}

# proc_ticks PID: utime+stime ticks of a process and its live direct children, plus
# cutime+cstime: what its children that ended and were reaped used. Without those, a PostgreSQL
# backend or autovacuum worker that exits during a run takes its CPU out of the count.
proc_ticks() {
  local t=0 p v
  v="$(awk '{ sub(/^.*\) /, ""); print $12 + $13 + $14 + $15 }' "/proc/$1/stat" 2>/dev/null || true)"
  t=$((t + ${v:-0}))
  for p in $(pgrep -P "$1" 2>/dev/null || true); do
    v="$(awk '{ sub(/^.*\) /, ""); print $12 + $13 }' "/proc/$p/stat" 2>/dev/null || true)"
    t=$((t + ${v:-0}))
  done
  echo "$t"
}

# proc_user_sys PID: "utime stime" of PID in clock ticks, every thread, exited ones included (the
# fields after the command name, which may hold spaces, as in proc_ticks).
proc_user_sys() {
  awk '{ sub(/^.*\) /, ""); print $12, $13 }' "/proc/$1/stat"
}

# user_sys_per_request "U0 S0" "U1 S1" N [PREFIX]: " PREFIXuser_us=U PREFIXsys_us=S", the user
# and system CPU per request, in microseconds, between two proc_user_sys readings over N requests
# (ticks of 10 ms).
user_sys_per_request() {
  awk -v a="$1" -v b="$2" -v n="$3" -v p="${4:-}" 'BEGIN { split(a, x); split(b, y)
    printf " %suser_us=%.1f %ssys_us=%.1f", p, (y[1] - x[1]) * 10000 / n, p, (y[2] - x[2]) * 10000 / n }'
}

# round_order ROUND ITEM...: the items, one per line, in the order given on odd rounds and
# reversed on even ones: on a noisy machine the first of a pair has been seen to run faster, for
# no reason of its own.
round_order() {
  local round="$1" i
  shift
  if ((round % 2 == 0)); then
    for ((i = $#; i > 0; i--)); do echo "${!i}"; done
  else
    printf '%s\n' "$@"
  fi
}

# start_proxy_peer DIR GW_PORT UP_PORT: the nginx `proxy_pass` peer of bench/run.sh on CPU 1,
# its files in DIR, in the background ($! is its master; its worker serves the requests).
start_proxy_peer() {
  mkdir -p "$1/tmp"
  nginx_conf_text "$1" 1 "$(proxy_pass_peer "$2" "$3")" >"$1/nginx.conf"
  taskset -c 1 "$(command -v nginx || echo /usr/sbin/nginx)" -p "$1" -e "$1/error.log" -c "$1/nginx.conf" &
}

# cpu_by_thread PID: "tid name ticks" per thread of PID (user + system clock ticks).
cpu_by_thread() {
  for t in /proc/"$1"/task/*; do
    echo "$(basename "$t") $(tr ' ' _ <"$t/comm") $(awk '{print $14 + $15}' "$t/stat")"
  done | sort
}

# cpu_per_request BEFORE AFTER REQUESTS: "cpu_us=T name=U ..." from two cpu_by_thread files, in
# microseconds per request (clock ticks are 1/100 s: ticks * 10000 / requests), whole process
# and per thread (threads under 0.05 left out).
cpu_per_request() {
  join "$1" "$2" | awk -v n="$3" '
    { d = ($5 - $3) * 10000 / n; total += d; if (d >= 0.05) out = out sprintf(" %s=%.1f", $2, d) }
    END { printf "cpu_us=%.1f%s", total, out }'
}

# The small rigs (bench/ab.sh, bench/instructions.sh, bench/allocs.sh, bench/tail.sh) start the
# same way.
#
# rig_start NAME UP_PORT [TOOL...]: checks wrk, nginx, taskset, curl, python3 and the TOOLs; makes
# $WORK (removed on exit, with every pid in $PIDS stopped) and starts the static nginx upstream on
# CPU 0 at UP_PORT, answering before it returns.
rig_start() {
  local name="$1" up_port="$2" tool
  shift 2
  for tool in wrk nginx taskset curl python3 "$@"; do
    command -v "$tool" >/dev/null || [[ -x "/usr/sbin/$tool" ]] || { echo "$name: $tool is needed" >&2; exit 69; }
  done
  RIG_NAME="$name"
  WORK="$(mktemp -d "/tmp/idemgate-$name.XXXXXX")"
  PIDS=()
  trap rig_cleanup EXIT
  mkdir -p "$WORK/nginx/tmp"
  nginx_conf_text "$WORK/nginx" 1 "$(static_upstream "$up_port")" >"$WORK/nginx/nginx.conf"
  taskset -c 0 "$(command -v nginx || echo /usr/sbin/nginx)" -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf" \
    -e "$WORK/nginx/error.log" &
  PIDS+=($!)
  rig_wait "$up_port" 20
}

rig_cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  # A rig that used Redis (bench/ab.sh with STORE redis): its keys and the server's affinity.
  if [[ -n "${REDIS_PREFIX:-}" ]]; then redis_unlink "$REDIS_URL" "$REDIS_PREFIX*" >/dev/null; fi
  redis_unpin
  rm -rf "$WORK"
}

# rig_wait PORT SECONDS: a POST to 127.0.0.1:PORT answered within SECONDS, or the rig exits.
rig_wait() {
  for _ in $(seq 1 $(($2 * 10))); do
    curl -s -o /dev/null -X POST "http://127.0.0.1:$1/x" && return 0
    sleep 0.1
  done
  echo "$RIG_NAME: nothing answers on port $1" >&2
  exit 1
}

# rig_prime PORT: the replay pool, keys rpool0..rpool999 completed over one keep-alive connection.
rig_prime() {
  python3 - "$1" <<'PY'
import http.client, sys
c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]))
for i in range(1000):
    c.request("POST", "/api/v1/orders", '{"amount":100,"currency":"eur"}',
              {"Idempotency-Key": f"rpool{i}", "Content-Type": "application/json"})
    r = c.getresponse(); r.read()
    assert r.status == 200, r.status
PY
}

# rig_wrk CONNECTIONS SECONDS PREFIX: the RESULT line of bench/idem.lua, $SCENARIO against the
# gateway at $GW_PORT, wrk on CPU 0.
rig_wrk() {
  taskset -c 0 wrk -t1 -c"$1" -d"$2"s -s bench/idem.lua "http://127.0.0.1:$GW_PORT/api/v1/orders" \
    -- "$SCENARIO" "$3" 2>&1 | grep '^RESULT' || true
}

# render_report REPO RESULTS META TMPDIR: bench/report.py's markdown and SVG of the results, as
# TMPDIR/generated.md and TMPDIR/benchmarks.svg (linked from the doc as img/benchmarks.svg).
render_report() {
  python3 "$1/bench/report.py" --results "$2" --meta "$3" --out "$4/generated.md" \
    --svg "$4/benchmarks.svg" --svg-link "img/benchmarks.svg" || return 1
  # bench/targets.sh's table, when the run made one (BENCH_PAIRS_ROUNDS), after the rest.
  if [[ -s "$4/pairs.md" ]]; then
    {
      echo
      echo "### Targets from interleaved rounds"
      echo
      echo "The closed-loop ratio targets read again by \`bench/targets.sh\` after the rows above: six rows"
      echo "per round, every ratio taken within its round, judged on the median of the per-round ratios and"
      echo "settled only when its 90% interval lies on one side of the target (bench/README.md)."
      echo
      cat "$4/pairs.md"
    } >>"$4/generated.md"
  fi
}

# write_report REPO RESULTS META TMPDIR: renders the results with bench/report.py into the
# generated part of docs/benchmarks.md (everything above the marker line is kept as it is) and
# docs/img/benchmarks.svg, and keeps the raw results and settings as bench/results/results.txt
# and meta.txt. Used by bench/run.sh after a run and by bench/render.sh to render them again.
write_report() {
  local repo="$1" results="$2" meta="$3" tmp="$4"
  local doc="$repo/docs/benchmarks.md" img="$repo/docs/img/benchmarks.svg" kept="$repo/bench/results"
  local marker='<!-- results below are generated by bench/run.sh -->'
  render_report "$repo" "$results" "$meta" "$tmp" || return 1
  mkdir -p "$(dirname "$doc")" "$(dirname "$img")" "$kept"
  if [[ -f "$doc" ]] && grep -qxF "$marker" "$doc"; then
    awk -v m="$marker" '{ print } $0 == m { exit }' "$doc" >"$tmp/doc.md"
  elif [[ -f "$doc" ]]; then
    { cat "$doc"; echo; echo "$marker"; } >"$tmp/doc.md"
  else
    { echo "# Benchmarks"; echo; echo "$marker"; } >"$tmp/doc.md"
  fi
  cat "$tmp/generated.md" >>"$tmp/doc.md"
  mv "$tmp/doc.md" "$doc"
  cp "$tmp/benchmarks.svg" "$img"
  # Copied unless they are already the kept ones (bench/render.sh).
  [[ "$results" -ef "$kept/results.txt" ]] || cp "$results" "$kept/results.txt"
  [[ "$meta" -ef "$kept/meta.txt" ]] || cp "$meta" "$kept/meta.txt"
  # The interleaved rounds' table and raw lines go with the run that made them, and a run
  # without them leaves none of an earlier run's behind.
  if [[ ! "$results" -ef "$kept/results.txt" ]]; then
    if [[ -s "$tmp/pairs.md" ]]; then
      cp "$tmp/pairs.md" "$kept/pairs.md"
      cp "$tmp/pairs-lines.txt" "$kept/pairs-lines.txt" 2>/dev/null || true
    else
      rm -f "$kept/pairs.md" "$kept/pairs-lines.txt"
    fi
  fi
}
