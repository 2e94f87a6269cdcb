# bench/run.sh section "tracing". Sourced by run.sh.
#
# tracing: what OpenTelemetry tracing at 100% sampling costs the memory row. Two Turnstiles on the
# in-process store, one worker each, placed like the memory section's 1-worker row, measured in
# alternating slices (`run_pair`, so both see the same machine):
#   turnstile-notrace-w1  the memory row's config (bench/turnstile-memory.yaml.tmpl), no tracing
#   turnstile-trace-w1    the same with `tracing: {sample_ratio: 1}`: four spans a request (server,
#                         decision, store, upstream client), exported over OTLP/gRPC to a real
#                         receiver (tests/fixtures/otlp/receiver.py, opentelemetry-proto + grpcio,
#                         spans decoded and discarded), which runs on the load generator's CPU
#                         (bench/turnstile-tracing.yaml.tmpl)
# Target: turnstile-trace-w1 >= 0.9x turnstile-notrace-w1's requests per second, p99 <= 1.1x.

section_tracing_setup() {
    add_comparison "Turnstile memory, tracing 100% / off, 1 worker (target)" \
        turnstile-trace-w1 turnstile-notrace-w1 0.9 1.1
}

section_tracing() {
    local cpu=$CPU_PROXY receiver_log="$WORK/otlp-receiver.log" otlp_port=""
    WRK_CPU=$CPU_LOAD
    spawn "$CPU_LOAD" "$receiver_log" python3 "$REPO_DIR/tests/fixtures/otlp/receiver.py" /dev/null
    local receiver=$LAST_PID
    for _ in $(seq 1 100); do
        otlp_port=$(sed -n 's/^listening \([0-9]*\)$/\1/p' "$receiver_log")
        [[ -n "$otlp_port" ]] && break
        sleep 0.1
    done
    if [[ -z "$otlp_port" ]]; then
        echo "error: the OTLP receiver did not start (pip install opentelemetry-proto grpcio)" >&2
        cat "$receiver_log" >&2
        return 1
    fi
    start_turnstile "$BENCH_DIR/turnstile-memory.yaml.tmpl" 1 "$cpu"
    local off=("turnstile-notrace-w1" "http://127.0.0.1:$LAST_PORT/" "$LAST_PID")
    start_turnstile "$BENCH_DIR/turnstile-tracing.yaml.tmpl" 1 "$cpu" OTLP_PORT="$otlp_port"
    local on=("turnstile-trace-w1" "http://127.0.0.1:$LAST_PORT/" "$LAST_PID")
    local admin=$TURNSTILE_ADMIN_PORT
    if (( ROUND % 2 )); then run_pair "${off[@]}" "${on[@]}"; else run_pair "${on[@]}" "${off[@]}"; fi
    echo "  tracing: failed span exports $(curl -s "http://127.0.0.1:$admin/metrics" \
        | awk '$1 == "turnstile_trace_export_failed_spans_total" {print $2}')"
    stop_pid "${on[2]}"
    stop_pid "${off[2]}"
    stop_pid "$receiver"
}
