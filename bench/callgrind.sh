#!/usr/bin/env bash
# Instructions per proxied request, counted by callgrind: a load-independent measure of the hot
# path (wall-clock figures on a shared 2-core machine move with other people's builds; instruction
# counts do not). Runs Turnstile (memory store, never-tripping policy, 1 tokio worker) or NGINX (one
# worker process) under callgrind in front of the static NGINX upstream, collects only while wrk
# sends load, and prints Ir per request.
#
# Usage: bench/callgrind.sh [--cache] [turnstile|nginx] [SECONDS] [CONNECTIONS]
# --cache also simulates the caches and prints first-level instruction-cache misses per request
# (I1mr): the cost of a hot path spread over more code than the cache holds, which instruction
# counts do not show (docs/benchmarks.md).
# CALLGRIND_TEMPLATE=turnstile-flood-memory.yaml.tmpl counts a flood (every request a 429) instead;
# a template with "redis" in its name (turnstile-redis.yaml.tmpl, turnstile-flood-redis.yaml.tmpl)
# gets a throwaway redis-server on a free port (CALLGRIND_REDIS_POOL connections, default 4). Only
# Turnstile's instructions are counted, not Redis's.
# Writes bench/out/callgrind/<target>-<stamp>.out (open with callgrind_annotate).
set -euo pipefail

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(dirname "$BENCH_DIR")
CACHE=()
if [[ "${1:-}" == --cache ]]; then
    CACHE=(--cache-sim=yes)
    shift
fi
TARGET=${1:-turnstile}
SECONDS_LOAD=${2:-5}
CONNECTIONS=${3:-8}
TURNSTILE_BIN=${TURNSTILE_BIN:-${CARGO_TARGET_DIR:-$REPO_DIR/target}/release/turnstile}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/turnstile-callgrind.XXXXXX")
PIDS=()
cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do
        for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    done
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}
render() {
    local tmpl=$1 out=$2; shift 2
    local args=() kv
    for kv in "$@"; do args+=(-e "s|@${kv%%=*}@|${kv#*=}|g"); done
    sed "${args[@]}" "$tmpl" >"$out"
}
wait_http() {
    for _ in $(seq 1 300); do
        [[ $(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$1" || true) == 200 ]] && return 0
        sleep 0.2
    done
    echo "error: $1 did not answer 200 within 60 s" >&2
    return 1
}

OUT_DIR="$BENCH_DIR/out/callgrind"
mkdir -p "$OUT_DIR" "$WORK/up/tmp" "$WORK/px/tmp"
UP_PORT=$(free_port)
render "$BENCH_DIR/nginx-upstream.conf.tmpl" "$WORK/up/nginx.conf" DIR="$WORK/up" PORT="$UP_PORT"
(exec nginx -p "$WORK/up" -c "$WORK/up/nginx.conf" -g 'daemon off;') >"$WORK/up/log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$UP_PORT/"

REDIS_PORT=0
if [[ $TARGET == turnstile && ${CALLGRIND_TEMPLATE:-} == *redis* ]]; then
    REDIS_PORT=$(free_port)
    (exec redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
        --dir "$WORK") >"$WORK/redis.log" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 1 100); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
fi

PORT=$(free_port)
STAMP=$(date +%Y%m%d-%H%M%S)
CG_OUT="$OUT_DIR/$TARGET-$STAMP.out"
VG=(valgrind --tool=callgrind "${CACHE[@]}" --instr-atstart=no "--callgrind-out-file=$CG_OUT")
case "$TARGET" in
    turnstile)
        render "$BENCH_DIR/${CALLGRIND_TEMPLATE:-turnstile-memory.yaml.tmpl}" \
            "$WORK/px/policies.yaml" PORT="$PORT" \
            ADMIN_PORT="$(free_port)" UPSTREAM_PORT="$UP_PORT" REDIS_PORT="$REDIS_PORT" \
            POOL="${CALLGRIND_REDIS_POOL:-4}"
        (TURNSTILE_WORKERS=1 TURNSTILE_LOG=warn exec "${VG[@]}" "$TURNSTILE_BIN" run \
            --config "$WORK/px/policies.yaml") >"$WORK/px/log" 2>&1 &
        ;;
    nginx)
        render "$BENCH_DIR/nginx-proxy.conf.tmpl" "$WORK/px/nginx.conf" DIR="$WORK/px" \
            PORT="$PORT" UPSTREAM_PORT="$UP_PORT" WORKERS=1
        # One process (no master), so callgrind sees the worker's work.
        (exec "${VG[@]}" nginx -p "$WORK/px" -c "$WORK/px/nginx.conf" \
            -g 'daemon off; master_process off;') >"$WORK/px/log" 2>&1 &
        ;;
    *) echo "usage: $0 [turnstile|nginx] [SECONDS] [CONNECTIONS]" >&2; exit 2 ;;
esac
VG_PID=$!
PIDS+=("$VG_PID")
wait_http "http://127.0.0.1:$PORT/"
# Warm the pools and caches, then count only the measured load.
wrk -t1 -c"$CONNECTIONS" -d2s "http://127.0.0.1:$PORT/" >/dev/null
callgrind_control -i on "$VG_PID" >/dev/null 2>&1
wrk -t1 -c"$CONNECTIONS" -d"${SECONDS_LOAD}s" "http://127.0.0.1:$PORT/" >"$WORK/wrk.txt"
callgrind_control -i off "$VG_PID" >/dev/null 2>&1
kill "$VG_PID"
# Callgrind writes the profile as the process exits, which under valgrind can take a while.
for _ in $(seq 1 600); do
    if ! kill -0 "$VG_PID" 2>/dev/null && grep -q '^totals:' "$CG_OUT" 2>/dev/null; then break; fi
    sleep 0.1
done

REQUESTS=$(awk '/requests in/ {print $1}' "$WORK/wrk.txt")
NON2XX=$(awk '/Non-2xx/ {print $NF}' "$WORK/wrk.txt")
IR=$(awk '/^totals:/ {print $2}' "$CG_OUT")
echo "$TARGET: $REQUESTS requests (non-2xx: ${NON2XX:-0}), $IR instructions, $((IR / REQUESTS)) Ir/request"
if (( ${#CACHE[@]} )); then
    # The totals line follows the events line's order: Ir Dr Dw I1mr ...
    I1MR=$(awk '/^totals:/ {print $5}' "$CG_OUT")
    echo "$TARGET: $I1MR first-level instruction-cache misses, $((I1MR / REQUESTS)) I1mr/request"
fi
echo "profile: $CG_OUT"
