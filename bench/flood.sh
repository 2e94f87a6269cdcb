# bench/run.sh section "flood". Sourced by run.sh.
#
# flood: every request over its limit (bench/turnstile-flood-*.yaml.tmpl: one token an hour), on
# each store, one worker placed like the memory section's 1-worker rows. Rows:
#   turnstile-flood-memory   429s from the in-process store
#   turnstile-flood-redis    429s from the Redis store (the deny cache answers all but the first)
# Target: turnstile-flood-redis >= 0.9x turnstile-flood-memory.

section_flood_setup() {
    if [[ -z "${REDIS_PORT:-}" ]]; then
        start_redis
    fi
    add_comparison "Turnstile flood redis / flood memory, 1 worker" \
        turnstile-flood-redis turnstile-flood-memory 0.9 inf
}

section_flood() {
    local cpu=$CPU_PROXY pid store
    WRK_CPU=$CPU_LOAD
    # One store at a time, in this round's order (`in_order`).
    for store in $(in_order memory redis); do
        if [[ "$store" == redis ]]; then
            # A fresh counter each round: the gateway must answer its first request with 200.
            "$REDIS_CLI" -p "$REDIS_PORT" eval \
                "for _, k in ipairs(redis.call('KEYS', 'flood:*')) do redis.call('DEL', k) end" 0 \
                >/dev/null
            start_turnstile "$BENCH_DIR/turnstile-flood-redis.yaml.tmpl" 1 "$cpu" \
                REDIS_PORT="$REDIS_PORT" POOL="$REDIS_POOL"
        else
            start_turnstile "$BENCH_DIR/turnstile-flood-memory.yaml.tmpl" 1 "$cpu"
        fi
        pid=$LAST_PID
        # The first request takes the only token; every later one is over the limit.
        curl -s -o /dev/null --max-time 2 "http://127.0.0.1:$LAST_PORT/" || true
        run_wrk "turnstile-flood-$store" "http://127.0.0.1:$LAST_PORT/" "$pid" 429
        stop_pid "$pid"
    done
}
