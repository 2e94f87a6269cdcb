# bench/run.sh section "access_log". Sourced by run.sh.
#
# access_log: what the access log costs the memory row. Two Turnstiles on the in-process store,
# one worker each, placed like the memory section's 1-worker row, measured in alternating slices
# (`run_pair`, so both see the same machine):
#   turnstile-nolog-w1    the memory row's config (bench/turnstile-memory.yaml.tmpl), no access log
#   turnstile-log-w1      the same with the access log on: every request, every field, JSON, to a
#                         file (bench/turnstile-access-log.yaml.tmpl)
# Target: turnstile-log-w1 >= 0.9x turnstile-nolog-w1's requests per second, p99 <= 1.1x.

section_access_log_setup() {
    add_comparison "Turnstile memory, access log on / off, 1 worker (target)" \
        turnstile-log-w1 turnstile-nolog-w1 0.9 1.1
}

section_access_log() {
    local cpu=$CPU_PROXY log="$WORK/access.log"
    WRK_CPU=$CPU_LOAD
    start_turnstile "$BENCH_DIR/turnstile-memory.yaml.tmpl" 1 "$cpu"
    local off=("turnstile-nolog-w1" "http://127.0.0.1:$LAST_PORT/" "$LAST_PID")
    start_turnstile "$BENCH_DIR/turnstile-access-log.yaml.tmpl" 1 "$cpu" LOG="$log"
    local on=("turnstile-log-w1" "http://127.0.0.1:$LAST_PORT/" "$LAST_PID")
    if (( ROUND % 2 )); then run_pair "${off[@]}" "${on[@]}"; else run_pair "${on[@]}" "${off[@]}"; fi
    echo "  access log: $(wc -l <"$log") lines, $(du -h "$log" | cut -f1)"
    stop_pid "${on[2]}"
    stop_pid "${off[2]}"
    rm -f "$log"
}
