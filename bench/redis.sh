# bench/run.sh section "redis": Turnstile on the Redis store against two peers in the same run,
# and its decision rate against Redis's own ceiling for the same script. Sourced by run.sh, which
# lists `redis` in SECTIONS_ALL and has `source "$BENCH_DIR/redis.sh"` before its summary.
#
# Rows, per worker count W (placement as in the memory section; Redis runs on the load CPU with
# wrk and the upstream, so both Redis clients under test get the proxy CPU to themselves):
#   nginx-proxy-wW       NGINX as a plain proxy (measured here unless the memory section runs)
#   nginx-lua-wW         NGINX + ngx_lua: one EVALSHA of scripts/decide.lua per request, then proxy
#   turnstile-redis-wW   Turnstile, store: redis, one EVALSHA per request, then proxy
# and once per round (client on the proxy CPU, Redis on the load CPU, $CONNECTIONS concurrent):
#   redis-benchmark-evalsha   redis-benchmark running the same EVALSHA: the ceiling
#   redis-benchmark-evalsha-p16  the same with 16 calls pipelined per connection (for scale)
#   turnstile-decisions       examples/redis_decisions: RedisStore::check in a loop, one tokio
#                             worker, $CONNECTIONS concurrent tasks on one pool
# Targets (issue 3): turnstile-redis >= 1.0x nginx-lua and >= 0.5x nginx-proxy;
# turnstile-decisions >= 0.7x redis-benchmark-evalsha.

REDIS_SERVER=${REDIS_SERVER:-redis-server}
REDIS_CLI=${REDIS_CLI:-redis-cli}
REDIS_BENCHMARK=${REDIS_BENCHMARK:-redis-benchmark}
REDIS_POOL=${BENCH_REDIS_POOL:-4}
REDIS_BENCH_REQUESTS=${BENCH_REDIS_REQUESTS:-1000000}
DECISIONS_BIN=${DECISIONS_BIN:-}

# start_redis: a throwaway redis-server on a free port, no persistence. Sets REDIS_PORT and SHA.
start_redis() {
    local dir="$WORK/redis"
    mkdir -p "$dir"
    REDIS_PORT=$(free_port)
    spawn "$CPU_LOAD" "$dir/redis.log" "$REDIS_SERVER" --port "$REDIS_PORT" --bind 127.0.0.1 \
        --save '' --appendonly no --dir "$dir"
    local i
    for i in $(seq 1 100); do
        "$REDIS_CLI" -p "$REDIS_PORT" ping 2>/dev/null | grep -q PONG && break
        sleep 0.1
    done
    SHA=$("$REDIS_CLI" -p "$REDIS_PORT" script load "$(cat "$REPO_DIR/scripts/decide.lua")")
    [[ "$SHA" =~ ^[0-9a-f]{40}$ ]] || { echo "error: SCRIPT LOAD failed: $SHA" >&2; return 1; }
}

# add_row NAME RPS P50_MS P99_MS BAD: a results.tsv row for a measurement that is not wrk's.
add_row() {
    printf '%s\t%s\t%s\t%s\t%s\t%s\t0\t%s\t%s\n' "$ROUND" "$1" "$2" "$3" "$4" "$5" \
        "$LAST_BUSY" "$LAST_LOAD" >>"$OUT/results.tsv"
    printf '  %-28s %10s dec/s  p50 %8s ms  p99 %8s ms  (others busy %s%%, load %s)\n' \
        "$1" "$2" "$3" "$4" "$LAST_BUSY" "$LAST_LOAD"
}

# The same call both Redis clients make: Turnstile's key for client 127.0.0.1, one token.
evalsha_args() {
    printf '%s\n' EVALSHA "$SHA" 1 "bench:{bench:never_trips:127.0.0.1}:tb" "" tb \
        1000000000 1000000000 0 1 0
}

# run_redis_benchmark NAME PIPELINE: redis-benchmark running the EVALSHA, PIPELINE per connection.
run_redis_benchmark() {
    local name=$1 pipeline=$2 args
    mapfile -t args < <(evalsha_args)
    # The reply must be an allowed decision, or the ceiling would measure errors.
    local reply
    reply=$("$REDIS_CLI" -p "$REDIS_PORT" "${args[@]}" | head -1)
    [[ "$reply" == 1 ]] || { echo "error: EVALSHA answered '$reply'" >&2; return 1; }
    wait_quiet
    local raw="$OUT/raw/round$ROUND-$name.csv"
    pin "$CPU_PROXY" timeout 300 "$REDIS_BENCHMARK" -h 127.0.0.1 -p "$REDIS_PORT" \
        -c "$CONNECTIONS" -P "$pipeline" -n "$REDIS_BENCH_REQUESTS" --csv "${args[@]}" >"$raw"
    # "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms",
    # "p99_latency_ms","max_latency_ms"
    local rps p50 p99
    read -r rps p50 p99 < <(awk -F'","' 'NR == 2 { print $2, $5, $7 }' "$raw")
    add_row "$name" "${rps:-0}" "${p50:-nan}" "${p99:-nan}" 0
}

run_decisions() {
    wait_quiet
    local raw="$OUT/raw/round$ROUND-turnstile-decisions.txt"
    TOKIO_WORKER_THREADS=1 pin "$CPU_PROXY" timeout $((DURATION + 30)) "$DECISIONS_BIN" \
        "redis://127.0.0.1:$REDIS_PORT" "$CONNECTIONS" "$DURATION" "$REDIS_POOL" >"$raw"
    local rps p50 p99 errors
    read -r rps p50 p99 errors < <(awk '{ print $2, $4, $6, $8 }' "$raw")
    add_row turnstile-decisions "${rps:-0}" "${p50:-nan}" "${p99:-nan}" "${errors:-1}"
}

section_redis_setup() {
    for tool in "$REDIS_SERVER" "$REDIS_CLI" "$REDIS_BENCHMARK"; do
        command -v "$tool" >/dev/null || { echo "error: $tool not found; install redis" >&2; exit 2; }
    done
    [[ -e /usr/share/nginx/modules/ngx_http_lua_module.so ]] ||
        { echo "error: ngx_lua not found; install libnginx-mod-http-lua" >&2; exit 2; }
    if [[ -z "$DECISIONS_BIN" ]]; then
        if (( BUILD )); then
            (cd "$REPO_DIR" && cargo build --release --example redis_decisions)
        fi
        DECISIONS_BIN="${CARGO_TARGET_DIR:-$REPO_DIR/target}/release/examples/redis_decisions"
    fi
    [[ -x "$DECISIONS_BIN" ]] || { echo "error: no redis_decisions at $DECISIONS_BIN" >&2; exit 2; }
    start_redis
    echo "redis: $("$REDIS_SERVER" --version | cut -d' ' -f3) on port $REDIS_PORT (CPU $CPU_LOAD)," \
        "pool_size $REDIS_POOL, decide.lua $SHA" | tee -a "$OUT/setup.txt"
    local w
    for w in $WORKERS_LIST; do
        add_comparison "Turnstile redis / NGINX + ngx_lua, $w worker(s)" \
            "turnstile-redis-w$w" "nginx-lua-w$w" 1.0 inf
        add_comparison "Turnstile redis / NGINX proxy, $w worker(s)" \
            "turnstile-redis-w$w" "nginx-proxy-w$w" 0.5 inf
    done
    add_comparison "Turnstile decisions / redis-benchmark EVALSHA" \
        turnstile-decisions redis-benchmark-evalsha 0.7 inf
}

section_redis() {
    local w cpu pid
    for w in $WORKERS_LIST; do
        if [[ "$w" == 1 ]]; then cpu=$CPU_PROXY; WRK_CPU=$CPU_LOAD; else cpu=""; WRK_CPU=""; fi
        if [[ " ${SECTIONS[*]} " != *" memory "* ]]; then
            start_nginx_proxy "$w" "$cpu"
            pid=$LAST_PID
            run_wrk "nginx-proxy-w$w" "http://127.0.0.1:$LAST_PORT/"
            stop_pid "$pid"
        fi
        start_nginx "nginx-lua-w$w" "$BENCH_DIR/nginx-lua.conf.tmpl" "$cpu" \
            WORKERS="$w" UPSTREAM_PORT="$UPSTREAM_PORT" REDIS_PORT="$REDIS_PORT" SHA="$SHA" \
            BENCH_DIR="$BENCH_DIR"
        pid=$LAST_PID
        run_wrk "nginx-lua-w$w" "http://127.0.0.1:$LAST_PORT/"
        stop_pid "$pid"
        start_turnstile "$BENCH_DIR/turnstile-redis.yaml.tmpl" "$w" "$cpu" \
            REDIS_PORT="$REDIS_PORT" POOL="$REDIS_POOL"
        pid=$LAST_PID
        run_wrk "turnstile-redis-w$w" "http://127.0.0.1:$LAST_PORT/"
        stop_pid "$pid"
    done
    run_redis_benchmark redis-benchmark-evalsha 1
    run_decisions
    # For scale only (no target): what Redis sustains when every connection pipelines 16 calls.
    run_redis_benchmark redis-benchmark-evalsha-p16 16
}
