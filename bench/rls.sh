# bench/run.sh section "rls": Turnstile's Envoy rate limit service against
# Kuadrant's Limitador, in decisions per CPU-second of the server (target >= 2x). Sourced by run.sh.
#
# Needs a limitador-server binary: LIMITADOR_BIN, or limitador-server on PATH;
# without one the row is printed as NOT MEASURED and nothing runs.
#
# Every round, for each store (memory, then Redis: the same fresh redis-server, FLUSHALL before each
# server starts) and each thread count, Turnstile and Limitador run one after the other (which goes
# first alternates by round), on free loopback ports, stopped by PID:
#   rls-turnstile-STORE-w1      TURNSTILE_WORKERS=1 (tokio's current-thread scheduler)
#   rls-limitador-STORE-w1      taskset -c to one core (Limitador has no thread setting: its gRPC
#                               service runs on actix's single-threaded main runtime and its HTTP
#                               API has one actix worker per core; pinning keeps all of it on one)
#   rls-turnstile-STORE-wdef    the default: one tokio worker per core (2 here), unpinned
#   rls-limitador-STORE-wdef    the default, unpinned
# 1-thread rows: the server on CPU $CPU_PROXY, rls_load and Redis on CPU $CPU_LOAD (unpinned with
# --layout unpinned, where Limitador is still held to one core by taskset -c ${CPU_PROXY:-0}).
#
# The same load against each: examples/rls_load.rs, domain `bench`, descriptor `user` with
# $RLS_VALUES values, $RLS_CONCURRENCY concurrent calls over $RLS_CONNECTIONS HTTP/2 connections
# for $DURATION s (warm-up $WARMUP s). The same limit in each: 20 per second per `user` value
# (Turnstile: envoyproxy/ratelimit's file format, its default sliding window; Limitador: namespace
# `bench`, max_value 20, seconds 1, variable descriptors[0]['user'], its fixed window).
#
# The server's CPU is utime + stime of its process (all threads) from /proc/PID/stat over the load
# window. A row counts only if the server decided: a probe before the load (50 calls on one key of
# domain `probe`, 20 per minute) must answer exactly 20 OK and 30 OVER_LIMIT, and the load itself
# must get no gRPC errors; otherwise the row is INVALID and has no ratio.

RLS_VALUES=${BENCH_RLS_VALUES:-1000}
RLS_CONCURRENCY=${BENCH_RLS_CONCURRENCY:-64}
RLS_CONNECTIONS=${BENCH_RLS_CONNECTIONS:-4}
RLS_STORES=${BENCH_RLS_STORES:-"memory redis"}
RLS_THREADS=${BENCH_RLS_THREADS:-"1 default"}
RLS_REDIS_POOL=${BENCH_RLS_REDIS_POOL:-${REDIS_POOL:-4}}
RLS_LOAD_BIN=${RLS_LOAD_BIN:-}
RLS_ENABLED=0

# wait_tcp PORT PID NAME: bounded wait (10 s) until PORT accepts connections while PID lives.
wait_tcp() {
    local port=$1 pid=$2 name=$3
    for _ in $(seq 1 100); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then return 0; fi
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    echo "error: $name did not listen on 127.0.0.1:$port" >&2
    return 1
}

# rls_load ADDR CPU ARGS...: the load generator (bounded in count and time), pinned like `pin`.
rls_load() {
    local addr=$1 cpu=$2; shift 2
    pin "$cpu" timeout 300 "$RLS_LOAD_BIN" --addr "$addr" "$@"
}

# field NAME LINE: the value of NAME=... in an rls_load result line.
field() { sed -n "s/.*\\b$1=\\([0-9.]*\\).*/\\1/p" <<<"$2"; }

# start_rls_server SERVER STORE THREADS: sets LAST_PID and RLS_ADDR.
start_rls_server() {
    local server=$1 store=$2 threads=$3 cpu=""
    local dir="$WORK/rls-$server-$store-w$threads"
    mkdir -p "$dir"
    local port admin public
    read -r port admin public < <(free_ports 3)
    if [[ "$store" == redis ]]; then
        "$REDIS_CLI" -p "$REDIS_PORT" flushall >/dev/null
    fi
    case "$server" in
        turnstile)
            local store_block=$'store:\n  type: memory'
            if [[ "$store" == redis ]]; then
                store_block=$'store:\n  type: redis\n  url: redis://127.0.0.1:'"$REDIS_PORT"$'\n  pool_size: '"$RLS_REDIS_POOL"$'\n  timeout: 1s'
            fi
            cat >"$dir/policies.yaml" <<YAML
listen: 127.0.0.1:$public
admin_listen: 127.0.0.1:$admin
$store_block
rls:
  listen: 127.0.0.1:$port
  config: $WORK/rls-config
YAML
            local workers=1
            if [[ "$threads" == 1 ]]; then cpu=$CPU_PROXY; else workers=$(nproc); fi
            TURNSTILE_WORKERS=$workers TURNSTILE_LOG=${TURNSTILE_LOG:-warn} \
                spawn "$cpu" "$dir/server.log" "$TURNSTILE_BIN" run --config "$dir/policies.yaml"
            ;;
        limitador)
            local storage=(memory)
            [[ "$store" == redis ]] && storage=(redis "redis://127.0.0.1:$REDIS_PORT")
            [[ "$threads" == 1 ]] && cpu=${CPU_PROXY:-0}
            spawn "$cpu" "$dir/server.log" "$LIMITADOR_BIN" "$WORK/limitador-limits.yaml" \
                --rls-ip 127.0.0.1 --rls-port "$port" --http-ip 127.0.0.1 --http-port "$admin" \
                "${storage[@]}"
            ;;
    esac
    RLS_ADDR=127.0.0.1:$port
    if ! wait_tcp "$port" "$LAST_PID" "$server ($store, $threads)"; then
        cat "$dir/server.log" >&2 || true
        return 1
    fi
}

# run_rls SERVER STORE THREADS: start the server, probe it, warm it up, measure it, stop it, and
# append a row to rls.tsv.
run_rls() {
    local server=$1 store=$2 threads=$3
    local name="rls-$server-$store-w${threads/default/def}"
    local cpu_load="" valid=1
    [[ "$threads" == 1 ]] && cpu_load=$CPU_LOAD
    start_rls_server "$server" "$store" "$threads"
    local pid=$LAST_PID
    # The probe: one fresh key of 20 per minute, 50 sequential calls: exactly 20 OK, 30 over.
    local probe
    probe=$(rls_load "$RLS_ADDR" "$cpu_load" --domain probe --key user --values 1 \
        --requests 50 --seconds 30 --concurrency 1 --connections 1 || true)
    if [[ "$(field ok "$probe")" != 20 || "$(field over_limit "$probe")" != 30 ||
          "$(field errors "$probe")" != 0 ]]; then
        echo "  warning: $name: the probe expected ok=20 over_limit=30 errors=0, got: $probe" >&2
        valid=0
    fi
    rls_load "$RLS_ADDR" "$cpu_load" --domain bench --key user --values "$RLS_VALUES" \
        --seconds "$WARMUP" --requests 100000000 --concurrency "$RLS_CONCURRENCY" \
        --connections "$RLS_CONNECTIONS" >/dev/null || true
    local raw="$OUT/raw/round$ROUND-$name.txt" attempt best=-1 others a0 o0 s0 r0 t0 a1 o1 s1 r1 t1
    local secs server_ticks redis_ticks=0 kept_server=0 kept_redis=0 kept_busy=0 kept_load=""
    for attempt in $(seq 1 "$RETRIES"); do
        wait_quiet
        a0=$(all_ticks); o0=$(our_ticks); s0=$(pid_ticks "$pid"); t0=$(date +%s%N)
        r0=$([[ "$store" == redis ]] && pid_ticks "$REDIS_PID" || echo 0)
        rls_load "$RLS_ADDR" "$cpu_load" --domain bench --key user --values "$RLS_VALUES" \
            --seconds "$DURATION" --requests 100000000 --concurrency "$RLS_CONCURRENCY" \
            --connections "$RLS_CONNECTIONS" >"$raw.try" || true
        a1=$(all_ticks); o1=$(our_ticks); s1=$(pid_ticks "$pid"); t1=$(date +%s%N)
        r1=$([[ "$store" == redis ]] && pid_ticks "$REDIS_PID" || echo 0)
        secs=$(( (t1 - t0) / 1000000 ))  # ms
        (( secs > 0 )) || secs=1
        server_ticks=$((s1 - s0))
        redis_ticks=$((r1 - r0))
        others=$(( ((a1 - a0) - (o1 - o0)) * 100000 / (secs * TICKS) ))
        (( others < 0 )) && others=0
        if (( best < 0 || others < best )); then
            best=$others; kept_server=$server_ticks; kept_redis=$redis_ticks
            kept_busy=$LAST_BUSY; kept_load=$LAST_LOAD
            mv "$raw.try" "$raw"
        fi
        (( others <= MAX_OTHERS )) && break
        echo "  $name: others used ${others}% of a core during the run; retrying" >&2
    done
    rm -f "$raw.try"
    stop_pid "$pid"
    local line requests ok over errors seconds p50 p99
    line=$(cat "$raw")
    requests=$(field requests "$line"); ok=$(field ok "$line"); over=$(field over_limit "$line")
    errors=$(field errors "$line"); seconds=$(field seconds "$line")
    p50=$(field p50_us "$line"); p99=$(field p99_us "$line")
    if [[ -z "$requests" || "${errors:-1}" != 0 || $(( ${ok:-0} + ${over:-0} )) == 0 ]]; then
        echo "  warning: $name: the load got errors or no decisions: $line" >&2
        valid=0
    fi
    # Decisions are answers with a code (OK or OVER_LIMIT); errors never count.
    local decisions=$(( ${ok:-0} + ${over:-0} ))
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$ROUND" "$name" \
        "$decisions" "${ok:-0}" "${over:-0}" "${errors:-0}" "${seconds:-0}" "$kept_server" \
        "$kept_redis" "${p50:-0}" "${p99:-0}" "$valid" "$best" "$kept_busy" >>"$OUT/rls.tsv"
    awk -v n="$name" -v d="$decisions" -v s="${seconds:-0}" -v c="$kept_server" -v t="$TICKS" \
        -v ok="${ok:-0}" -v over="${over:-0}" -v e="${errors:-0}" -v r="$kept_redis" \
        -v p99="${p99:-0}" -v o="$best" -v b="$kept_busy" -v v="$valid" 'BEGIN {
        cpu = c / t; rate = (s > 0 ? d / s : 0);
        printf "  %-26s %8.0f dec/s  cpu %6.2f s  %8.0f dec/cpu-s  ok %d over %d err %d  p99 %d us%s  (others: %s%% before, %s%% during)%s\n",
            n, rate, cpu, (cpu > 0 ? d / cpu : 0), ok, over, e, p99,
            (r > 0 ? sprintf("  redis cpu %.2f s", r / t) : ""), b, o, (v ? "" : "  INVALID") }'
}

section_rls_setup() {
    LIMITADOR_BIN=${LIMITADOR_BIN:-$(command -v limitador-server || true)}
    if [[ -z "${LIMITADOR_BIN:-}" || ! -x "${LIMITADOR_BIN:-}" ]]; then
        echo "rls: Turnstile RLS / Limitador, decisions per CPU-second (target >= 2x): NOT MEASURED" \
            "(no limitador-server: set LIMITADOR_BIN or put it on PATH; docs/benchmarks.md, Limitador)" |
            tee -a "$OUT/setup.txt"
        return 0
    fi
    RLS_ENABLED=1
    if [[ -z "$RLS_LOAD_BIN" ]]; then
        if (( BUILD )); then
            (cd "$REPO_DIR" && cargo build --release --example rls_load)
        fi
        RLS_LOAD_BIN="${CARGO_TARGET_DIR:-$REPO_DIR/target}/release/examples/rls_load"
    fi
    [[ -x "$RLS_LOAD_BIN" ]] || { echo "error: no rls_load at $RLS_LOAD_BIN" >&2; exit 2; }
    if [[ " $RLS_STORES " == *" redis "* && -z "${REDIS_PORT:-}" ]]; then
        for tool in "$REDIS_SERVER" "$REDIS_CLI"; do
            command -v "$tool" >/dev/null || { echo "error: $tool not found; install redis" >&2; exit 2; }
        done
        start_redis
    fi
    mkdir -p "$WORK/rls-config"
    cat >"$WORK/rls-config/bench.yaml" <<'YAML'
domain: bench
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 20}
YAML
    cat >"$WORK/rls-config/probe.yaml" <<'YAML'
domain: probe
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 20}
YAML
    cat >"$WORK/limitador-limits.yaml" <<'YAML'
- namespace: bench
  max_value: 20
  seconds: 1
  conditions: []
  variables: ["descriptors[0]['user']"]
- namespace: probe
  max_value: 20
  seconds: 60
  conditions: []
  variables: ["descriptors[0]['user']"]
YAML
    printf 'round\tname\tdecisions\tok\tover_limit\terrors\tseconds\tserver_ticks\tredis_ticks\tp50_us\tp99_us\tvalid\tothers_during_pct\tothers_before_pct\n' \
        >"$OUT/rls.tsv"
    {
        echo "rls: limitador $("$LIMITADOR_BIN" --version 2>/dev/null | head -1) at $LIMITADOR_BIN"
        echo "rls: rls_load --values $RLS_VALUES --concurrency $RLS_CONCURRENCY" \
            "--connections $RLS_CONNECTIONS --seconds $DURATION (warm-up $WARMUP s);" \
            "stores: $RLS_STORES; threads: $RLS_THREADS; Turnstile redis pool_size $RLS_REDIS_POOL"
    } | tee -a "$OUT/setup.txt"
}

section_rls() {
    (( RLS_ENABLED )) || return 0
    local store threads servers=(turnstile limitador)
    # Alternate which server goes first, so neither gets a quieter machine by position.
    (( ROUND % 2 == 0 )) && servers=(limitador turnstile)
    for store in $RLS_STORES; do
        for threads in $RLS_THREADS; do
            run_rls "${servers[0]}" "$store" "$threads"
            run_rls "${servers[1]}" "$store" "$threads"
        done
    done
}

# The rls rows' own summary (decisions per CPU-second is not run.sh's req/s): medians over the
# rounds, the ratio of the medians against the target, and each round's own ratio.
section_rls_summary() {
    (( RLS_ENABLED )) || return 0
    python3 - "$OUT/rls.tsv" "$TICKS" <<'PY'
import statistics, sys
ticks = float(sys.argv[2])
rows = {}
for line in open(sys.argv[1]):
    f = line.rstrip("\n").split("\t")
    if f[0] == "round":
        continue
    d, secs, cpu = int(f[2]), float(f[6]), int(f[7]) / ticks
    rows.setdefault(f[1], []).append(dict(
        round=f[0], rate=d / secs if secs else 0.0, per_cpu=d / cpu if cpu else 0.0,
        cpu=cpu / secs if secs else 0.0, p99=int(f[10]), valid=f[11] == "1",
        others=int(f[12])))
print("Envoy RLS, decisions per CPU-second of the server (medians over rounds):")
print(f"{'server':<28}{'dec/s':>10}{'cpu cores':>11}{'dec/cpu-s':>12}{'p99 us':>9}{'rounds':>8}  notes")
med = {}
for name in sorted(rows):
    rs = rows[name]
    good = [r for r in rs if r["valid"]]
    bad = len(rs) - len(good)
    note = f"others <= {max(r['others'] for r in rs)}% of a core"
    if bad:
        note += f"; {bad} INVALID round(s) left out"
    if not good:
        print(f"{name:<28}{'-':>10}{'-':>11}{'-':>12}{'-':>9}{len(rs):>8}  {note}")
        continue
    m = {k: statistics.median(r[k] for r in good) for k in ("rate", "per_cpu", "cpu", "p99")}
    med[name] = (m, {r["round"]: r for r in good})
    print(f"{name:<28}{m['rate']:>10.0f}{m['cpu']:>11.2f}{m['per_cpu']:>12.0f}{m['p99']:>9.0f}"
          f"{len(rs):>8}  {note}")
print()
ok = True
for name in sorted(rows):
    if not name.startswith("rls-turnstile-"):
        continue
    peer = name.replace("rls-turnstile-", "rls-limitador-", 1)
    label = name.replace("rls-turnstile-", "")
    store, threads = label.rsplit("-w", 1)
    threads = "1 worker" if threads == "1" else "default threads"
    if name not in med or peer not in med:
        ok = False
        print(f"Turnstile RLS / Limitador, {store}, {threads}: NOT MEASURED (an INVALID server)")
        continue
    (a, ra), (b, rb) = med[name], med[peer]
    ratio = a["per_cpu"] / b["per_cpu"]
    good = ratio >= 2.0
    ok &= good
    print(f"Turnstile RLS / Limitador, {store}, {threads}: decisions per CPU-second {ratio:.2f}x "
          f"(target >= 2x): {'MEETS TARGET' if good else 'BELOW TARGET'}; "
          f"decisions/s {a['rate'] / b['rate']:.2f}x")
    pairs = [(ra[k], rb[k]) for k in sorted(ra) if k in rb]
    print("    per round: " + " ".join(f"{x['per_cpu'] / y['per_cpu']:.2f}" for x, y in pairs))
sys.exit(0 if ok else 3)
PY
}
