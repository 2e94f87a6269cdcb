# bench/run.sh section "hotpath". Sourced by run.sh.
#
# hotpath: what an ordinary route (a token bucket, no cost from the response) pays for the LLM
# metering (docs/llm.md): the memory row's config (bench/turnstile-memory.yaml.tmpl) on two
# builds, one worker each, placed like the memory section's 1-worker row, measured in alternating
# slices (`run_pair`, so both see the same machine):
#   turnstile-base-w1   TURNSTILE_BASE_BIN, a build from before the usage meter
#   turnstile-head-w1   the binary under test
# Target: turnstile-head-w1 >= 0.97x turnstile-base-w1's requests per second, p99 <= 1.05x.
# Without TURNSTILE_BASE_BIN the section measures nothing and says so.

section_hotpath_setup() {
    add_comparison "Turnstile memory, ordinary route, this build / TURNSTILE_BASE_BIN (target)" \
        turnstile-head-w1 turnstile-base-w1 0.97 1.05
}

section_hotpath() {
    if [[ -z "${TURNSTILE_BASE_BIN:-}" || ! -x "${TURNSTILE_BASE_BIN:-}" ]]; then
        echo "  hotpath: not measured (TURNSTILE_BASE_BIN names no binary)"
        return 0
    fi
    local cpu=$CPU_PROXY head_bin=$TURNSTILE_BIN
    WRK_CPU=$CPU_LOAD
    start_turnstile "$BENCH_DIR/turnstile-memory.yaml.tmpl" 1 "$cpu"
    local head=("turnstile-head-w1" "http://127.0.0.1:$LAST_PORT/" "$LAST_PID")
    # Its own copy of the template: start_turnstile names the instance's directory after it.
    cp "$BENCH_DIR/turnstile-memory.yaml.tmpl" "$WORK/turnstile-base.yaml.tmpl"
    TURNSTILE_BIN=$TURNSTILE_BASE_BIN
    start_turnstile "$WORK/turnstile-base.yaml.tmpl" 1 "$cpu"
    TURNSTILE_BIN=$head_bin
    local base=("turnstile-base-w1" "http://127.0.0.1:$LAST_PORT/" "$LAST_PID")
    if (( ROUND % 2 )); then run_pair "${base[@]}" "${head[@]}"; else run_pair "${head[@]}" "${base[@]}"; fi
    stop_pid "${head[2]}"
    stop_pid "${base[2]}"
}
