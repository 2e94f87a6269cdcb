#!/usr/bin/env bash
# What one decision of scripts/decide.lua costs Redis: µs per decision from Redis's own
# INFO commandstats, or with --callgrind, instructions per decision counted by callgrind (load-
# independent; build redis-server from its tag with symbols to see where they go).
#
# Usage: bench/script_cost.sh [--callgrind] [--text] [SCRIPT] [BATCH] [CALLS] [KEYS]
#   SCRIPT  default scripts/decide.lua; BATCH decisions per call (default 15); CALLS (default
#           4000, or 300 under callgrind); KEYS distinct counters the decisions cycle through
#           (default 50: no call repeats a key; 1 is one busy client, every decision on one key).
#           REDIS_SERVER names the server binary (default redis-server), pinned to CPU
#           $BENCH_CPU_LOAD (default 1) when not under callgrind.
#   --text  sends the older space-separated packed words (for a decide.lua before 2026-11-23).
set -euo pipefail
BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(dirname "$BENCH_DIR")
CALLGRIND=0
TEXT=()
while [[ $# -gt 0 && "$1" == --* ]]; do
    case "$1" in
        --callgrind) CALLGRIND=1 ;;
        --text) TEXT=(--text) ;;
        *) echo "unknown flag $1" >&2; exit 2 ;;
    esac
    shift
done
SCRIPT=${1:-$REPO_DIR/scripts/decide.lua}
BATCH=${2:-15}
CALLS=${3:-$([[ $CALLGRIND == 1 ]] && echo 300 || echo 4000)}
NKEYS=${4:-50}
REDIS_SERVER=${REDIS_SERVER:-redis-server}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/turnstile-script.XXXXXX")
PID=""
cleanup() {
    if [[ -n "$PID" ]]; then
        kill "$PID" 2>/dev/null || true
        for _ in $(seq 1 100); do kill -0 "$PID" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$PID" 2>/dev/null || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()')
SERVER=("$REDIS_SERVER" --port "$PORT" --save '' --appendonly no --dir "$WORK")
if [[ $CALLGRIND == 1 ]]; then
    (exec valgrind --tool=callgrind --compress-strings=no --compress-pos=no \
        --callgrind-out-file="$WORK/cg.%p" "${SERVER[@]}") >"$WORK/log" 2>&1 &
else
    (exec taskset -c "${BENCH_CPU_LOAD:-1}" "${SERVER[@]}") >"$WORK/log" 2>&1 &
fi
PID=$!
for _ in $(seq 1 150); do
    redis-cli -p "$PORT" ping >/dev/null 2>&1 && break
    sleep 0.2
done
LOAD=(python3 "$BENCH_DIR/script_load.py" "$PORT" "$SCRIPT")
# A first round loads the script and warms the keys; only the second is measured.
"${LOAD[@]}" "$BATCH" 50 "$NKEYS" "${TEXT[@]}" >/dev/null
if [[ $CALLGRIND == 1 ]]; then
    callgrind_control -z "$PID" >/dev/null 2>&1
    "${LOAD[@]}" "$BATCH" "$CALLS" "$NKEYS" "${TEXT[@]}"
    callgrind_control -d "$PID" >/dev/null 2>&1
    sleep 0.5
    IR=$(grep -h "^totals:" "$WORK"/cg.* | awk '{print $2}' | sort -n | tail -1)
    echo "$(basename "$SCRIPT"): $((IR / (BATCH * CALLS))) instructions per decision ($BATCH a call, $CALLS calls, $NKEYS keys)"
    mkdir -p "$BENCH_DIR/out/callgrind"
    cp "$(ls -S "$WORK"/cg.* | head -1)" "$BENCH_DIR/out/callgrind/redis-script-$(date +%Y%m%d-%H%M%S).out"
else
    "${LOAD[@]}" "$BATCH" "$CALLS" "$NKEYS" "${TEXT[@]}"
fi
