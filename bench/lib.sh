# Shared by bench/run.sh and bench/ab.sh (sourced, not run): the gateway's configuration, so an
# A/B round measures the gateway exactly as the full report does.

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
