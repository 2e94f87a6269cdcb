#!/usr/bin/env bash
# The ingress door's benchmark, in one run on this machine (wrk, loopback, 1 worker each):
#   1. NGINX as a plain reverse proxy -> upstream, against NGINX + auth_request -> Turnstile's
#      /check -> upstream (the deploy/ingress recipe): what asking Turnstile costs an NGINX user;
#   2. Turnstile's forward-auth /check answering on its own, against the gateway's own respond:
#      route with the same policy: what the door costs over the inline gateway.
# Prints req/s and p99 of each, and the ratios.
#
# Usage: bench/ingress.sh [--duration SECS] [--connections N] [--turnstile BIN]
set -euo pipefail

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$BENCH_DIR/common.sh"
DURATION=10
CONNECTIONS=64
TURNSTILE_BIN=""
NGINX=${NGINX:-nginx}
WRK=${WRK:-wrk}
while [[ $# -gt 0 ]]; do
    case "$1" in
        --duration) DURATION="$2"; shift 2 ;;
        --connections) CONNECTIONS="$2"; shift 2 ;;
        --turnstile) TURNSTILE_BIN="$2"; shift 2 ;;
        *) sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2 ;;
    esac
done
if [[ -z "$TURNSTILE_BIN" ]]; then
    (cd "$REPO_DIR" && cargo build --release --quiet)
    TURNSTILE_BIN="${CARGO_TARGET_DIR:-$REPO_DIR/target}/release/turnstile"
fi

bench_workdir ingress

# nginx_start NAME TEMPLATE KEY=VALUE...: starts NGINX, its port in $STARTED (not a subshell, so
# its PID stays in PIDS for the cleanup).
nginx_start() {
    local dir="$WORK/$1" port; port=$(free_port)
    mkdir -p "$dir/tmp"
    render "$2" "$dir/nginx.conf" DIR="$dir" PORT="$port" "${@:3}"
    "$NGINX" -p "$dir" -c "$dir/nginx.conf" -e "$dir/error.log" -g 'daemon off; master_process off;' &
    PIDS+=($!)
    wait_port "$port"
    STARTED=$port
}
# run URL [wrk -H args...]: prints "REQS P99_MS"
run() {
    local url=$1; shift
    local out; out=$("$WRK" -t1 -c"$CONNECTIONS" -d"${DURATION}s" --latency "$@" "$url")
    local reqs p99
    reqs=$(awk '/^Requests\/sec/ {print $2}' <<<"$out")
    p99=$(awk '$1 == "99%" {v=$2; if (v ~ /us$/) {sub(/us/,"",v); v/=1000} else if (v ~ /ms$/) {sub(/ms/,"",v)} else if (v ~ /s$/) {sub(/s/,"",v); v*=1000}; print v}' <<<"$out")
    local non2xx; non2xx=$(awk '/Non-2xx/ {print $NF}' <<<"$out")
    [[ -z "$non2xx" ]] || { echo "non-2xx answers: $non2xx" >&2; exit 1; }
    echo "$reqs $p99"
}

nginx_start upstream "$BENCH_DIR/nginx-upstream.conf.tmpl"; upstream=$STARTED
port=$(free_port); admin=$(free_port); check=$(free_port)
render "$BENCH_DIR/turnstile-check.yaml.tmpl" "$WORK/policies.yaml" PORT="$port" ADMIN_PORT="$admin" CHECK_PORT="$check"
TURNSTILE_WORKERS=1 TURNSTILE_LOG=warn "$TURNSTILE_BIN" run --config "$WORK/policies.yaml" >"$WORK/turnstile.log" 2>&1 &
PIDS+=($!)
wait_port "$port"; wait_port "$check"
nginx_start plain "$BENCH_DIR/nginx-proxy.conf.tmpl" UPSTREAM_PORT="$upstream" WORKERS=1; plain=$STARTED
nginx_start auth "$BENCH_DIR/nginx-auth.conf.tmpl" UPSTREAM_PORT="$upstream" CHECK_PORT="$check" WORKERS=1; auth=$STARTED

read -r plain_rps plain_p99 <<<"$(run "http://127.0.0.1:$plain/api/x")"
read -r auth_rps auth_p99 <<<"$(run "http://127.0.0.1:$auth/api/x")"
read -r check_rps check_p99 <<<"$(run "http://127.0.0.1:$check/check" -H 'X-Forwarded-Uri: /api/x' -H 'X-Forwarded-Method: GET')"
read -r respond_rps respond_p99 <<<"$(run "http://127.0.0.1:$port/respond")"

printf '%-44s %12s %10s\n' "target (1 worker each, $CONNECTIONS connections, ${DURATION}s)" "req/s" "p99 ms"
printf '%-44s %12s %10s\n' "nginx plain proxy" "$plain_rps" "$plain_p99"
printf '%-44s %12s %10s\n' "nginx + auth_request -> turnstile /check" "$auth_rps" "$auth_p99"
printf '%-44s %12s %10s\n' "turnstile forward-auth /check alone" "$check_rps" "$check_p99"
printf '%-44s %12s %10s\n' "turnstile gateway respond: route" "$respond_rps" "$respond_p99"
python3 - "$plain_rps" "$auth_rps" "$check_rps" "$respond_rps" <<'PY'
import sys
plain, auth, check, respond = map(float, sys.argv[1:])
print(f"nginx+auth_request / nginx plain: {auth/plain:.2f}x throughput")
print(f"forward-auth /check / gateway respond route: {check/respond:.2f}x throughput")
PY
