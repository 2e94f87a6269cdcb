#!/usr/bin/env bash
# A profile-guided (PGO) release build of Turnstile, in three steps:
#   1. an instrumented build (rustc -Cprofile-generate), every crate included;
#   2. that binary serving the loads a gateway serves, each for --seconds: GETs (the lean HTTP/1.1
#      path) and POSTs (hyper's path) forwarded on the memory store and on Redis, with one and two
#      workers; a flood of 429s on each store; Envoy rate-limit calls (examples/rls_load) on each
#      store. Loopback only, every load bounded in time, every server stopped by PID;
#   3. the optimised build (rustc -Cprofile-use) from the merged profile.
# LLVM then keeps the hot path together and moves what the loads never ran out of its way: fewer
# instructions and far fewer instruction-cache misses per request (docs/benchmarks.md). Code the loads never ran (TLS, HTTP/2 from clients, the admin API, forward-auth)
# is laid out as cold: correct, and possibly slower than in a plain build.
#
# Usage: bench/pgo.sh [--seconds N]      (default 3 per load)
# The optimised binary is ${CARGO_TARGET_DIR:-target}/pgo/<host triple>/release/turnstile; its path
# is the last line printed. Needs cargo, the llvm-tools rustup component (added when missing),
# nginx (the upstream), wrk, redis-server and python3 (free ports); bench/run.sh --pgo runs this.
set -euo pipefail

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$BENCH_DIR/common.sh"
SECONDS_PER_LOAD=3
while [[ $# -gt 0 ]]; do
    case "$1" in
        --seconds) SECONDS_PER_LOAD="$2"; shift 2 ;;
        *) sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
    esac
done
for tool in cargo rustc nginx wrk redis-server python3 curl; do
    command -v "$tool" >/dev/null || { echo "pgo: $tool is needed" >&2; exit 2; }
done

HOST=$(rustc -vV | sed -n 's/^host: //p')
PROFDATA="$(rustc --print sysroot)/lib/rustlib/$HOST/bin/llvm-profdata"
if [[ ! -x "$PROFDATA" ]]; then
    rustup component add llvm-tools >&2
fi
[[ -x "$PROFDATA" ]] || { echo "pgo: no llvm-profdata at $PROFDATA" >&2; exit 2; }

TARGET_DIR=${CARGO_TARGET_DIR:-$REPO_DIR/target}
bench_workdir pgo

# --target limits RUSTFLAGS to the binary's crates: build scripts and proc macros are neither
# instrumented nor optimised with a profile of their own.
build() {
    local dir=$1 flags=$2
    shift 2
    (cd "$REPO_DIR" && CARGO_TARGET_DIR="$TARGET_DIR/$dir" RUSTFLAGS="$flags" CARGO_INCREMENTAL=0 \
        cargo build --release --locked --target "$HOST" "$@" >&2)
}

# start LOG CMD...: a server in the background, its PID in LAST_PID.
start() {
    local log=$1
    shift
    "$@" >"$log" 2>&1 &
    LAST_PID=$!
    PIDS+=("$LAST_PID")
}

# wait_answer URL PID: until URL answers (any status), or fail if PID exits first or 10 s pass.
wait_answer() {
    local i
    for i in $(seq 1 100); do
        curl -s -o /dev/null --max-time 1 "$1" && return 0
        kill -0 "$2" 2>/dev/null || break
        sleep 0.1
    done
    echo "pgo: nothing answered at $1" >&2
    return 1
}

# stop PID: SIGTERM and wait; an instrumented binary writes its profile as it exits.
stop() {
    kill -TERM "$1"
    wait "$1" || { echo "pgo: process $1 did not exit cleanly" >&2; return 1; }
}

echo "pgo: 1/3 instrumented build" >&2
RAW="$WORK/profiles"
# The binary alone: an example would bring the dev-dependencies' features into the build, and a
# profile of differently featured crates does not match the optimised build's functions.
build pgo-train "-Cprofile-generate=$RAW" --bin turnstile
TRAIN_BIN="$TARGET_DIR/pgo-train/$HOST/release/turnstile"
# The load generator is not trained: a plain release build, where bench/rls.sh builds it too.
(cd "$REPO_DIR" && cargo build --release --locked --example rls_load >&2)
RLS_LOAD="$TARGET_DIR/release/examples/rls_load"

echo "pgo: 2/3 training loads, ${SECONDS_PER_LOAD} s each" >&2
mkdir -p "$WORK/upstream/tmp" "$WORK/redis" "$WORK/rls"
UPSTREAM_PORT=$(free_port)
REDIS_PORT=$(free_port)
sed -e "s|@DIR@|$WORK/upstream|g" -e "s|@PORT@|$UPSTREAM_PORT|g" \
    "$BENCH_DIR/nginx-upstream.conf.tmpl" >"$WORK/upstream/nginx.conf"
start "$WORK/upstream.log" nginx -p "$WORK/upstream" -c "$WORK/upstream/nginx.conf" \
    -g 'daemon off; master_process off;'
wait_answer "http://127.0.0.1:$UPSTREAM_PORT/" "$LAST_PID"
start "$WORK/redis.log" redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' \
    --appendonly no --dir "$WORK/redis"
printf 'wrk.method = "POST"\nwrk.body = "{\\"pgo\\": true}"\nwrk.headers["Content-Type"] = "application/json"\n' \
    >"$WORK/post.lua"
cat >"$WORK/rls/train.yaml" <<'YAML'
domain: train
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 20}
YAML

# load TEMPLATE URL [WRK ARGS...]: wrk for --seconds. A profile of errors would train the wrong
# paths: every answer must be a 200 (a 429 on a flood), and no connection may fail.
load() {
    local template=$1 url=$2 out
    shift 2
    out=$(timeout 60 wrk -t1 -c50 -d"${SECONDS_PER_LOAD}s" "$@" "$url")
    grep 'Requests/sec' <<<"$out" >&2
    if grep -q 'Socket errors' <<<"$out" || { [[ $template != *flood* ]] && grep -q 'Non-2xx' <<<"$out"; }; then
        echo "pgo: the $template load failed:" >&2
        echo "$out" >&2
        return 1
    fi
}

# train TEMPLATE WORKERS: the instrumented gateway on bench/TEMPLATE.yaml.tmpl (plus an Envoy rate
# limit listener), under GETs, POSTs and rate-limit calls.
train() {
    local template=$1 workers=$2 port admin rls
    port=$(free_port); admin=$(free_port); rls=$(free_port)
    sed -e "s|@PORT@|$port|g" -e "s|@ADMIN_PORT@|$admin|g" -e "s|@UPSTREAM_PORT@|$UPSTREAM_PORT|g" \
        -e "s|@REDIS_PORT@|$REDIS_PORT|g" -e "s|@POOL@|4|g" \
        "$BENCH_DIR/$template.yaml.tmpl" >"$WORK/$template.yaml"
    printf 'rls:\n  listen: 127.0.0.1:%s\n  config: %s\n' "$rls" "$WORK/rls" >>"$WORK/$template.yaml"
    LLVM_PROFILE_FILE="$RAW/turnstile-%p.profraw" TURNSTILE_WORKERS=$workers TURNSTILE_LOG=warn \
        start "$WORK/$template-$workers.log" "$TRAIN_BIN" run --config "$WORK/$template.yaml"
    local pid=$LAST_PID
    wait_answer "http://127.0.0.1:$port/" "$pid"
    echo "pgo: $template, $workers worker(s)" >&2
    load "$template" "http://127.0.0.1:$port/"
    load "$template" "http://127.0.0.1:$port/" -s "$WORK/post.lua"
    timeout 60 "$RLS_LOAD" --addr "127.0.0.1:$rls" \
        --domain train --key user --values 1000 --seconds "$SECONDS_PER_LOAD" --requests 2000000 \
        --concurrency 64 --connections 4 | tail -1 >&2
    stop "$pid"
}
train turnstile-memory 1
train turnstile-memory 2
train turnstile-redis 1
train turnstile-redis 2
train turnstile-flood-memory 1
train turnstile-flood-redis 1

echo "pgo: 3/3 optimised build" >&2
"$PROFDATA" merge -o "$WORK/turnstile.profdata" "$RAW"/turnstile-*.profraw
build pgo "-Cprofile-use=$WORK/turnstile.profdata" --bin turnstile
echo "$TARGET_DIR/pgo/$HOST/release/turnstile"
