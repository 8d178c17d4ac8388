# Shared by bench/run.sh and bench/ab.sh (sourced, not run): the static upstream's and the
# gateway's configuration, so an A/B round measures the gateway exactly as the full report does.

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
