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
#   turnstile-decisions-multi          the same with two policies per decision (one EVALSHA)
#   turnstile-decisions-cluster        the same on a 3-master Redis Cluster (no replicas, the
#                                      three masters on the load CPU like the single Redis)
#   turnstile-decisions-cluster-multi  two policies in two slots: two concurrent calls
# Targets: turnstile-redis >= 1.5x nginx-lua and >= 0.6x nginx-proxy;
# turnstile-decisions >= 0.7x redis-benchmark-evalsha. The cluster rows have no target: they show
# what sharding costs one client worker.

REDIS_SERVER=${REDIS_SERVER:-redis-server}
REDIS_CLI=${REDIS_CLI:-redis-cli}
REDIS_BENCHMARK=${REDIS_BENCHMARK:-redis-benchmark}
REDIS_POOL=${BENCH_REDIS_POOL:-4}
REDIS_BENCH_REQUESTS=${BENCH_REDIS_REQUESTS:-1000000}
DECISIONS_BIN=${DECISIONS_BIN:-}
# 0 skips the rows beside the HTTP comparison (redis-benchmark, examples/redis_decisions, cluster):
# the HTTP rows alone are enough for the proxy comparisons.
REDIS_EXTRAS=${BENCH_REDIS_EXTRAS:-1}

# start_redis: a throwaway redis-server on a free port, no persistence. Sets REDIS_PORT and SHA.
start_redis() {
    local dir="$WORK/redis"
    mkdir -p "$dir"
    REDIS_PORT=$(free_port)
    spawn "$CPU_LOAD" "$dir/redis.log" "$REDIS_SERVER" --port "$REDIS_PORT" --bind 127.0.0.1 \
        --save '' --appendonly no --dir "$dir"
    REDIS_PID=$LAST_PID
    local i
    for i in $(seq 1 100); do
        "$REDIS_CLI" -p "$REDIS_PORT" ping 2>/dev/null | grep -q PONG && break
        sleep 0.1
    done
    SHA=$("$REDIS_CLI" -p "$REDIS_PORT" script load "$(cat "$REPO_DIR/scripts/decide.lua")")
    [[ "$SHA" =~ ^[0-9a-f]{40}$ ]] || { echo "error: SCRIPT LOAD failed: $SHA" >&2; return 1; }
}

# start_redis_cluster: three throwaway cluster masters on free ports (bus ports set explicitly:
# port + 10000 overflows for high ports), joined with redis-cli --cluster create. Sets
# CLUSTER_SEEDS (host:port,...) and CLUSTER_PIDS.
start_redis_cluster() {
    local dir="$WORK/redis-cluster" i port nodes=()
    CLUSTER_PIDS=()
    for i in 1 2 3; do
        mkdir -p "$dir/$i"
        port=$(free_port)
        spawn "$CPU_LOAD" "$dir/$i/redis.log" "$REDIS_SERVER" --port "$port" --bind 127.0.0.1 \
            --save '' --appendonly no --dir "$dir/$i" --cluster-enabled yes \
            --cluster-port "$(free_port)" --cluster-node-timeout 1000
        CLUSTER_PIDS+=("$LAST_PID")
        nodes+=("127.0.0.1:$port")
        local j
        for j in $(seq 1 100); do
            "$REDIS_CLI" -p "$port" ping 2>/dev/null | grep -q PONG && break
            sleep 0.1
        done
    done
    "$REDIS_CLI" --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes >"$dir/create.log"
    for i in $(seq 1 100); do
        "$REDIS_CLI" -p "${nodes[0]##*:}" cluster info | grep -q 'cluster_state:ok' && break
        sleep 0.1
    done
    CLUSTER_SEEDS=$(IFS=,; echo "${nodes[*]}")
}

# measured RAW CMD...: like run_wrk's loop for a command that is not wrk: wait for a quiet machine,
# run CMD (its stdout to RAW), and record other people's CPU during it as a share of one core and
# Redis's own CPU; a disturbed run is retried (up to RETRIES) and the least disturbed one kept.
# Sets M_OTHERS, M_CPU, M_BUSY, M_LOAD.
measured() {
    local raw=$1; shift
    local attempt a0 o0 r0 t0 a1 o1 r1 t1 secs others cpu
    M_OTHERS=-1
    for attempt in $(seq 1 "$RETRIES"); do
        wait_quiet
        a0=$(all_ticks); o0=$(our_ticks); r0=$(pid_ticks "$REDIS_PID"); t0=$(date +%s%N)
        "$@" >"$raw.try"
        a1=$(all_ticks); o1=$(our_ticks); r1=$(pid_ticks "$REDIS_PID"); t1=$(date +%s%N)
        secs=$(( (t1 - t0) / 1000000000 )); (( secs > 0 )) || secs=1
        others=$(( ((a1 - a0) - (o1 - o0)) * 100 / (secs * TICKS) ))
        (( others < 0 )) && others=0
        cpu=$(( (r1 - r0) * 100 / (secs * TICKS) ))
        if (( M_OTHERS < 0 || others < M_OTHERS )); then
            M_OTHERS=$others; M_CPU=$cpu; M_BUSY=$LAST_BUSY; M_LOAD=$LAST_LOAD
            mv "$raw.try" "$raw"
        fi
        (( others <= MAX_OTHERS )) && break
        echo "  $(basename "$raw"): others used ${others}% of a core during the run; retrying" >&2
    done
    rm -f "$raw.try"
}

# add_row NAME RPS P50_MS P99_MS BAD: a results.tsv row (run_wrk's columns) for a measured run;
# the CPU column is Redis's.
add_row() {
    printf '%s\t%s\t%s\t%s\t%s\t%s\t0\t%s\t%s\t%s\t%s\n' "$ROUND" "$1" "$2" "$3" "$4" "$5" \
        "$M_CPU" "$M_BUSY" "$M_OTHERS" "$M_LOAD" >>"$OUT/results.tsv"
    printf '  %-22s %9s dec/s  p50 %6s ms  p99 %7s ms  redis cpu %4s%%  (others: %s%% before, %s%% during)\n' \
        "$1" "$2" "$3" "$4" "$M_CPU" "$M_BUSY" "$M_OTHERS"
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
    local raw="$OUT/raw/round$ROUND-$name.csv"
    measured "$raw" pin "$CPU_PROXY" timeout 300 "$REDIS_BENCHMARK" -h 127.0.0.1 \
        -p "$REDIS_PORT" -c "$CONNECTIONS" -P "$pipeline" -n "$REDIS_BENCH_REQUESTS" --csv "${args[@]}"
    # "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms",
    # "p99_latency_ms","max_latency_ms"
    local rps p50 p99
    read -r rps p50 p99 < <(awk -F'","' 'NR == 2 { print $2, $5, $7 }' "$raw")
    add_row "$name" "${rps:-0}" "${p50:-nan}" "${p99:-nan}" 0
}

# run_decisions [NAME TARGET POLICIES]: examples/redis_decisions on one worker; by default the
# single Redis with one policy.
run_decisions() {
    local name=${1:-turnstile-decisions} target=${2:-redis://127.0.0.1:$REDIS_PORT} policies=${3:-1}
    local raw="$OUT/raw/round$ROUND-$name.txt"
    measured "$raw" pin "$CPU_PROXY" env TURNSTILE_WORKERS=1 timeout $((DURATION + 30)) \
        "$DECISIONS_BIN" "$target" "$CONNECTIONS" "$DURATION" "$REDIS_POOL" "$policies"
    local rps p50 p99 errors slots
    read -r rps p50 p99 errors slots < <(awk '{ print $2, $4, $6, $8, $10 }' "$raw")
    add_row "$name" "${rps:-0}" "${p50:-nan}" "${p99:-nan}" "${errors:-1}"
    echo "    ($name: each decision touches ${slots:-?} slot(s))"
}

section_redis_setup() {
    for tool in "$REDIS_SERVER" "$REDIS_CLI" "$REDIS_BENCHMARK"; do
        command -v "$tool" >/dev/null || { echo "error: $tool not found; install redis" >&2; exit 2; }
    done
    [[ -e /usr/share/nginx/modules/ngx_http_lua_module.so ]] ||
        { echo "error: ngx_lua not found; install libnginx-mod-http-lua" >&2; exit 2; }
    if [[ -z "$DECISIONS_BIN" ]] && (( REDIS_EXTRAS )); then
        if (( BUILD )); then
            (cd "$REPO_DIR" && cargo build --release --example redis_decisions)
        fi
        DECISIONS_BIN="${CARGO_TARGET_DIR:-$REPO_DIR/target}/release/examples/redis_decisions"
    fi
    (( ! REDIS_EXTRAS )) || [[ -x "$DECISIONS_BIN" ]] || { echo "error: no redis_decisions at $DECISIONS_BIN" >&2; exit 2; }
    start_redis
    echo "redis: $("$REDIS_SERVER" --version | cut -d' ' -f3) on port $REDIS_PORT (CPU $CPU_LOAD)," \
        "pool_size $REDIS_POOL, decide.lua $SHA" | tee -a "$OUT/setup.txt"
    if (( REDIS_EXTRAS )); then
        start_redis_cluster
        echo "redis cluster: 3 masters at $CLUSTER_SEEDS (CPU $CPU_LOAD)" | tee -a "$OUT/setup.txt"
    fi
    local w
    for w in $WORKERS_LIST; do
        add_comparison "Turnstile redis / NGINX + ngx_lua, $w worker(s)" \
            "turnstile-redis-w$w" "nginx-lua-w$w" 1.5 inf
        add_comparison "Turnstile redis / NGINX proxy, $w worker(s)" \
            "turnstile-redis-w$w" "nginx-proxy-w$w" 0.6 inf
    done
    add_comparison "Turnstile decisions / redis-benchmark EVALSHA" \
        turnstile-decisions redis-benchmark-evalsha 0.7 inf
}

section_redis() {
    local w cpu pid
    for w in $WORKERS_LIST; do
        if [[ "$w" == 1 ]]; then cpu=$CPU_PROXY; WRK_CPU=$CPU_LOAD; else cpu=""; WRK_CPU=""; fi
        # One at a time, in this round's order (`in_order`). The plain NGINX proxy is the memory
        # section's row when that section runs too.
        local row names=(nginx-lua turnstile-redis)
        [[ " ${SECTIONS[*]} " == *" memory "* ]] || names=(nginx-proxy "${names[@]}")
        for row in $(in_order "${names[@]}"); do
            case "$row" in
                nginx-proxy) start_nginx_proxy "$w" "$cpu" ;;
                nginx-lua)
                    start_nginx "nginx-lua-w$w" "$BENCH_DIR/nginx-lua.conf.tmpl" "$cpu" \
                        WORKERS="$w" UPSTREAM_PORT="$UPSTREAM_PORT" REDIS_PORT="$REDIS_PORT" \
                        SHA="$SHA" BENCH_DIR="$BENCH_DIR" ;;
                turnstile-redis)
                    start_turnstile "$BENCH_DIR/turnstile-redis.yaml.tmpl" "$w" "$cpu" \
                        REDIS_PORT="$REDIS_PORT" POOL="$REDIS_POOL" ;;
            esac
            pid=$LAST_PID
            run_wrk "$row-w$w" "http://127.0.0.1:$LAST_PORT/" "$pid"
            stop_pid "$pid"
        done
    done
    (( REDIS_EXTRAS )) || return 0
    run_redis_benchmark redis-benchmark-evalsha 1
    run_decisions
    run_decisions turnstile-decisions-multi "redis://127.0.0.1:$REDIS_PORT" 2
    # The redis cpu column of the cluster rows is the first master's (one of three).
    local REDIS_PID=${CLUSTER_PIDS[0]}
    run_decisions turnstile-decisions-cluster "cluster:$CLUSTER_SEEDS" 1
    run_decisions turnstile-decisions-cluster-multi "cluster:$CLUSTER_SEEDS" 2
    # For scale only (no target): what Redis sustains when every connection pipelines 16 calls.
    run_redis_benchmark redis-benchmark-evalsha-p16 16
}
