#!/usr/bin/env bash
# Routing cost: request latency with 10 routes against 10,000, quietly and while a few clients
# send paths no route can match (a 30 KB path without a slash), and the gateway's CPU per such
# request. Standalone; it starts one Turnstile per route count and talks to it on loopback only.
#
# Usage: bench/routes.sh [--turnstile BIN] [--duration SECS] [--connections N] [--no-build]
#
# Rows (p50 / p99 of wrk on the last route of the table, `GET /svcN/items/1`, a `respond:` route,
# so the table is searched to its end and nothing else is measured):
#   routes-10                 10 routes, no other load
#   routes-10000              10,000 routes, no other load
#   routes-10-longpath        10 routes, while 2 connections send the 30 KB path
#   routes-10000-longpath     10,000 routes, the same
# and, per route count, `cpu/longpath`: the gateway's CPU time (utime + stime from /proc) over the
# long-path requests it answered in one run, in microseconds per request.
set -euo pipefail

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$BENCH_DIR/common.sh"
TURNSTILE_BIN=""
DURATION=10
CONNECTIONS=16
BUILD=1
WRK=${WRK:-wrk}
TICKS=$(getconf CLK_TCK)

while [[ $# -gt 0 ]]; do
    case "$1" in
        --turnstile) TURNSTILE_BIN=$2; BUILD=0; shift 2 ;;
        --duration) DURATION=$2; shift 2 ;;
        --connections) CONNECTIONS=$2; shift 2 ;;
        --no-build) BUILD=0; shift ;;
        *) sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2 ;;
    esac
done
if [[ -z "$TURNSTILE_BIN" ]]; then
    TURNSTILE_BIN="$REPO_DIR/target/release/turnstile"
    if [[ "$BUILD" == 1 ]]; then
        (cd "$REPO_DIR" && cargo build --release --quiet)
    fi
fi

bench_workdir routes

# config ROUTES PORT ADMIN: a table of ROUTES `respond:` routes `/svcI/items/{id}`.
config() {
    local routes=$1 port=$2 admin=$3 i
    printf 'listen: 127.0.0.1:%s\nadmin_listen: 127.0.0.1:%s\nstore:\n  type: memory\n' \
        "$port" "$admin"
    printf 'server:\n  max_header_size: 64KiB\nroutes:\n'
    for ((i = 0; i < routes; i++)); do
        printf '  - name: svc%d\n    match: { path: "/svc%d/items/{id}" }\n' "$i" "$i"
        printf '    respond: { body: ok }\n'
    done
}

cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }

# wrk_run NAME URL CONNECTIONS SCRIPT: prints "requests p50_ms p99_ms".
wrk_run() {
    local url=$1 conns=$2 script=$3 out
    out=$("$WRK" -t1 -c"$conns" -d"${DURATION}s" --latency -s "$script" "$url")
    awk '
        function ms(v) { if (v ~ /us$/) return v / 1000; if (v ~ /ms$/) return v + 0; return v * 1000 }
        /^ +50%/ { p50 = ms($2) } /^ +99%/ { p99 = ms($2) }
        /requests in/ { n = $1 }
        END { printf "%d %.2f %.2f\n", n, p50, p99 }' <<<"$out"
}

LONG_LUA="$WORK/long.lua"
cat >"$LONG_LUA" <<'EOF'
wrk.path = "/" .. string.rep("a", 30000)
EOF
PLAIN_LUA="$WORK/plain.lua"
echo '-- the URL as given' >"$PLAIN_LUA"

printf '%-24s %10s %9s %9s\n' row requests p50_ms p99_ms
for routes in 10 10000; do
    read -r port admin < <(free_ports 2)
    config "$routes" "$port" "$admin" >"$WORK/routes-$routes.yaml"
    TURNSTILE_LOG=warn "$TURNSTILE_BIN" run --config "$WORK/routes-$routes.yaml" \
        >"$WORK/turnstile-$routes.log" 2>&1 &
    pid=$!
    PIDS+=("$pid")
    for _ in $(seq 1 300); do
        curl -s -o /dev/null --max-time 1 "http://127.0.0.1:$port/" && break
        sleep 0.1
    done
    url="http://127.0.0.1:$port/svc$((routes - 1))/items/1"
    [[ $(curl -s --max-time 2 "$url") == ok ]] || { echo "route svc$((routes - 1)) not served" >&2; exit 1; }

    read -r n p50 p99 < <(wrk_run "$url" "$CONNECTIONS" "$PLAIN_LUA")
    printf '%-24s %10s %9s %9s\n' "routes-$routes" "$n" "$p50" "$p99"

    # The long paths alone: the gateway's CPU per request.
    before=$(cpu_ticks "$pid")
    read -r n _ _ < <(wrk_run "http://127.0.0.1:$port/" 2 "$LONG_LUA")
    after=$(cpu_ticks "$pid")
    awk -v t=$((after - before)) -v n="$n" -v hz="$TICKS" -v r="$routes" \
        'BEGIN { printf "%-24s %10d %9.1f us CPU per request\n", "cpu/longpath-" r, n, t / hz * 1e6 / (n ? n : 1) }'

    # Both at once: normal requests while 2 connections send the long path.
    "$WRK" -t1 -c2 -d"$((DURATION + 2))s" -s "$LONG_LUA" "http://127.0.0.1:$port/" >/dev/null &
    load=$!
    sleep 1
    read -r n p50 p99 < <(wrk_run "$url" "$CONNECTIONS" "$PLAIN_LUA")
    wait "$load" || true
    printf '%-24s %10s %9s %9s\n' "routes-$routes-longpath" "$n" "$p50" "$p99"

    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
done
