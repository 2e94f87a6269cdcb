# bench/run.sh section "pacing": what a paced decision (`on_limit: delay`, admitted for a later
# slot) costs against an ordinary admitted one, on the in-process store and on Redis. Sourced by
# run.sh.
#
# Every round runs examples/paced_decisions once (a fresh process and store, pinned to CPU
# $CPU_PROXY; Redis, the redis section's or a throwaway one, on CPU $CPU_LOAD, FLUSHALL first):
# $PACING_SLICES alternating slices of $PACING_DECISIONS single-policy decisions per side (a tenth
# of that on Redis, one round trip each), timed one by one. Rows, per store:
#   paced-STORE      a bucket of 1 at 1000/s (Redis: 100/s), max_delay 3600s: every decision after the first is
#                    delayed (the slot found, the reservation made, its stamps in the reply)
#   admitted-STORE   a bucket that never trips
# The ratio is paced over admitted, from the medians of the slices' mean times (above 1: a paced
# decision costs more); the summary gives its median over the rounds and each round's. No target.
# PACED_BIN names a built example (a debug build checks the section quickly; its times mean
# nothing).

PACING_SLICES=${BENCH_PACING_SLICES:-10}
PACING_DECISIONS=${BENCH_PACING_DECISIONS:-20000}
PACED_BIN=${PACED_BIN:-}

section_pacing_setup() {
    if [[ -z "$PACED_BIN" ]]; then
        if (( BUILD )); then
            (cd "$REPO_DIR" && cargo build --release --example paced_decisions)
        fi
        PACED_BIN="${CARGO_TARGET_DIR:-$REPO_DIR/target}/release/examples/paced_decisions"
    fi
    [[ -x "$PACED_BIN" ]] || { echo "error: no paced_decisions at $PACED_BIN" >&2; exit 2; }
    # The redis section's server when it runs (its setup came first), else one of our own.
    if [[ -z "${REDIS_PORT:-}" ]]; then
        command -v "$REDIS_SERVER" >/dev/null || { echo "error: $REDIS_SERVER not found" >&2; exit 2; }
        start_redis
    fi
    echo "pacing: $PACED_BIN, $PACING_SLICES slices of $PACING_DECISIONS decisions a side," \
        "Redis on port $REDIS_PORT" | tee -a "$OUT/setup.txt"
    printf 'round\tstore\tadmitted_p50_ns\tadmitted_p99_ns\tpaced_p50_ns\tpaced_p99_ns\tratio\tloadavg\n' \
        >"$OUT/pacing.tsv"
}

section_pacing() {
    "$REDIS_CLI" -p "$REDIS_PORT" flushall >/dev/null
    local out load
    load=$(cut -d' ' -f1 /proc/loadavg)
    out=$(pin "$CPU_PROXY" timeout 600 "$PACED_BIN" "$PACING_SLICES" "$PACING_DECISIONS" \
        "redis://127.0.0.1:$REDIS_PORT")
    echo "$out" | sed 's/^/  pacing: /'
    # "store S admitted_p50_ns A admitted_p99_ns B paced_p50_ns C paced_p99_ns D ratio R"
    awk -v round="$ROUND" -v load="$load" '$1 == "store" {
        printf "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", round, $2, $4, $6, $8, $10, $12, load
    }' <<<"$out" >>"$OUT/pacing.tsv"
}

section_pacing_summary() {
    python3 - "$OUT/pacing.tsv" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    f = line.rstrip("\n").split("\t")
    if f[0] == "round":
        continue
    rows.setdefault(f[1], []).append(f)
print("A paced decision against an admitted one (examples/paced_decisions, medians over rounds):")
for store, rs in sorted(rows.items()):
    med = lambda i: statistics.median(float(r[i]) for r in rs)
    print(f"paced / admitted, {store}: {med(6):.2f}x the time per decision "
          f"(admitted p50 {med(2):.0f} ns, p99 {med(3):.0f} ns; paced p50 {med(4):.0f} ns, "
          f"p99 {med(5):.0f} ns; {len(rs)} rounds, load average {min(r[7] for r in rs)}-"
          f"{max(r[7] for r in rs)})")
    print("    per round: " + " ".join(r[6] for r in rs))
PY
}
