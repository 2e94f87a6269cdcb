#!/usr/bin/env bash
# Turnstile benchmark: in one run on this machine, the same fast upstream measured direct, behind
# NGINX as a plain reverse proxy, and behind Turnstile, with wrk. Prints req/s, p50, p99 and the
# Turnstile/NGINX ratios against their targets (memory >= 1.0x NGINX with p99 <= 1.0x; Redis
# >= 1.5x NGINX + ngx_lua and >= 0.6x NGINX; a flood on Redis >= 0.9x the same flood on memory).
#
# Usage: bench/run.sh [--only SECTION[,SECTION]] [--rounds N] [--duration SECS] [--warmup SECS]
#                     [--connections N] [--workers "1 2"] [--no-build] [--turnstile BIN]
#                     [--max-busy PCT] [--max-wait SECS] [--pgo]
#                     [--layout proxy-alone|servers-together|unpinned|both] [--slices N]
# Sections: memory (Turnstile on the in-process store vs NGINX proxy vs upstream direct);
#           redis (Turnstile on Redis vs NGINX + ngx_lua vs NGINX proxy, and decisions/s vs the
#           redis-benchmark ceiling of the same EVALSHA; see bench/redis.sh);
#           tls (Turnstile's TLS listener vs NGINX with TLS, wrk over https; see bench/tls.sh);
#           flood (every request over its limit, on each store; see bench/flood.sh);
#           rls (the Envoy rate limit service against Limitador, decisions per CPU-second: printed
#           as not measured without a limitador-server binary: LIMITADOR_BIN or on PATH;
#           see bench/rls.sh);
#           rlqs (requests/s through Envoy with the rate limit quota service against Envoy with
#           the RLS and Envoy alone, with Turnstile's CPU per admitted request; see bench/rlqs.sh);
#           access_log (the memory row with the access log on, every request to a file, against
#           off; see bench/access_log.sh); tracing (the memory row with OpenTelemetry tracing at
#           100% sampling to an OTLP receiver, against off; see bench/tracing.sh); jwt (RS256-keyed
#           requests with the cache of verified tokens against without; see bench/jwt.sh); peers
#           (against NGINX limit_req, HAProxy stick tables, Envoy local_ratelimit, Traefik RateLimit
#           in memory and on Redis, and Envoy + Limitador, each limiter checked first; see
#           bench/peers.sh); hotpath (the memory row on this build against TURNSTILE_BASE_BIN, an
#           older build: what an ordinary route pays for newer features; see bench/hotpath.sh);
#           pacing (a paced decision against an admitted one, memory and Redis, printing their
#           ratio; see bench/pacing.sh).
# --pgo measures the profile-guided build bench/pgo.sh makes (about 12 minutes on 2 cores) instead
# of a plain `cargo build --release`.
#
# CPU placement (2 cores), 1-worker rows: the proxy under test (NGINX's worker, or Turnstile with
# TURNSTILE_WORKERS=1) runs on CPU $BENCH_CPU_PROXY. With --layout proxy-alone (the default) it
# has that core to itself and wrk shares CPU $BENCH_CPU_LOAD with the upstream; with
# servers-together the upstream shares the proxy's core and wrk has the other one. The "direct" row
# uses the same placement. 2-worker rows (2 NGINX workers vs 2 tokio workers) pin neither proxy
# nor wrk (the upstream stays where the layout put it). --layout unpinned pins nothing at
# all; --layout both runs the whole benchmark twice, proxy-alone then unpinned.
set -euo pipefail
ORIGINAL_ARGS=("$@")

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$BENCH_DIR/common.sh"

# ---- settings (flags override) -------------------------------------------------------------------
SECTIONS_ALL=(memory redis tls flood rls rlqs access_log tracing jwt peers hotpath pacing)
ONLY=""
ROUNDS=${BENCH_ROUNDS:-5}
DURATION=${BENCH_DURATION:-10}
WARMUP=${BENCH_WARMUP:-2}
CONNECTIONS=${BENCH_CONNECTIONS:-64}
WRK_THREADS=${BENCH_WRK_THREADS:-1}
WORKERS_LIST=${BENCH_WORKERS:-"1 2"}
BUILD=1
PGO=0
TURNSTILE_BIN=${TURNSTILE_BIN:-}
CPU_PROXY=${BENCH_CPU_PROXY:-0}
CPU_LOAD=${BENCH_CPU_LOAD:-1}
LAYOUT=${BENCH_LAYOUT:-proxy-alone}
MAX_BUSY=${BENCH_MAX_BUSY:-20}     # % of all CPUs busy (others' load) tolerated before a run
MAX_WAIT=${BENCH_MAX_WAIT:-300}    # seconds to wait for a quiet machine before running anyway
MAX_OTHERS=${BENCH_MAX_OTHERS:-3}  # % of one core others may use during a run before it is retried
RETRIES=${BENCH_RETRIES:-3}
SLICES=${BENCH_SLICES:-5}          # memory section: alternating slices per round and target
TICKS=$(getconf CLK_TCK)
WRK_ARGS=()                        # extra wrk arguments of run_pair's runs (the jwt section's token)
NGINX=${NGINX:-nginx}
WRK=${WRK:-wrk}

usage() { sed -n '2,32p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --only) ONLY="$2"; shift 2 ;;
        --rounds) ROUNDS="$2"; shift 2 ;;
        --duration) DURATION="$2"; shift 2 ;;
        --warmup) WARMUP="$2"; shift 2 ;;
        --connections) CONNECTIONS="$2"; shift 2 ;;
        --workers) WORKERS_LIST="$2"; shift 2 ;;
        --no-build) BUILD=0; shift ;;
        --pgo) PGO=1; shift ;;
        --turnstile) TURNSTILE_BIN="$2"; BUILD=0; shift 2 ;;
        --max-busy) MAX_BUSY="$2"; shift 2 ;;
        --max-wait) MAX_WAIT="$2"; shift 2 ;;
        --layout) LAYOUT="$2"; shift 2 ;;
        --slices) SLICES="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done

if [[ -n "$ONLY" ]]; then
    IFS=',' read -r -a SECTIONS <<<"$ONLY"
else
    SECTIONS=("${SECTIONS_ALL[@]}")
fi

# ---- process bookkeeping: everything we start is stopped by PID on exit --------------------------
# bench/common.sh: PIDS, $WORK and the exit trap that stops them; free_port, free_ports, render
# and wait_http are its too.
bench_workdir bench

stop_pid() {
    local pid=$1
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    local kept=()
    for p in "${PIDS[@]}"; do [[ "$p" == "$pid" ]] || kept+=("$p"); done
    PIDS=("${kept[@]}")
}

# pin CPU CMD...: run a command in the foreground, pinned to CPU (unpinned when CPU is empty).
pin() {
    local cpu=$1; shift
    if [[ -n "$cpu" ]]; then taskset -c "$cpu" "$@"; else "$@"; fi
}

# spawn CPU LOG CMD...: start a server in the background, pinned like `pin`, output to LOG. The
# subshell execs (taskset execs too), so LAST_PID is the server's own PID and `kill` reaches it.
spawn() {
    local cpu=$1 log=$2; shift 2
    if [[ -n "$cpu" ]]; then
        (exec taskset -c "$cpu" "$@") >"$log" 2>&1 &
    else
        (exec "$@") >"$log" 2>&1 &
    fi
    LAST_PID=$!
    PIDS+=("$LAST_PID")
}

# check_ok URL NAME: the target must answer 200 "ok" (not a 429, 404 or 502 that would inflate req/s).
check_ok() {
    local url=$1 name=$2 body code
    body=$(curl -s --max-time 2 -w '\n%{http_code}' "$url" || true)
    code=${body##*$'\n'}
    body=${body%$'\n'*}
    if [[ "$code" != 200 || "$body" != ok ]]; then
        echo "error: $name answered $code '$body' at $url, expected 200 'ok'" >&2
        return 1
    fi
}

# check_status URL NAME STATUS: the target must answer STATUS (the flood rows: 429).
check_status() {
    local url=$1 name=$2 want=$3 code
    code=$(curl -s -o /dev/null --max-time 2 -w '%{http_code}' "$url" || true)
    if [[ "$code" != "$want" ]]; then
        echo "error: $name answered $code at $url, expected $want" >&2
        return 1
    fi
}

# ---- servers -------------------------------------------------------------------------------------
# Each start_* sets LAST_PID and LAST_PORT.

# start_nginx NAME TEMPLATE CPU [KEY=VALUE...]
start_nginx() {
    local name=$1 tmpl=$2 cpu=$3; shift 3
    local dir="$WORK/$name"
    mkdir -p "$dir/tmp"
    local port
    port=$(free_port)
    render "$tmpl" "$dir/nginx.conf" DIR="$dir" PORT="$port" "$@"
    spawn "$cpu" "$dir/stdout.log" "$NGINX" -p "$dir" -c "$dir/nginx.conf" -g 'daemon off;'
    LAST_PORT=$port
    if ! wait_http "http://127.0.0.1:$port/" "$name"; then
        cat "$dir/stdout.log" "$dir/error.log" >&2 2>/dev/null || true
        return 1
    fi
}

start_nginx_upstream() {
    start_nginx upstream "$BENCH_DIR/nginx-upstream.conf.tmpl" "$CPU_UPSTREAM"
    UPSTREAM_PID=$LAST_PID
    UPSTREAM_PORT=$LAST_PORT
}

# start_nginx_proxy WORKERS CPU
start_nginx_proxy() {
    local workers=$1 cpu=$2
    start_nginx "nginx-proxy-w$workers" "$BENCH_DIR/nginx-proxy.conf.tmpl" "$cpu" \
        WORKERS="$workers" UPSTREAM_PORT="$UPSTREAM_PORT"
}

# start_turnstile CONFIG_TEMPLATE WORKERS CPU [KEY=VALUE...]
start_turnstile() {
    local tmpl=$1 workers=$2 cpu=$3; shift 3
    local name
    name="turnstile-$(basename "$tmpl" .yaml.tmpl)-w$workers"
    local dir="$WORK/$name"
    mkdir -p "$dir"
    local port admin
    read -r port admin < <(free_ports 2)
    render "$tmpl" "$dir/policies.yaml" PORT="$port" ADMIN_PORT="$admin" \
        UPSTREAM_PORT="$UPSTREAM_PORT" "$@"
    TURNSTILE_WORKERS=$workers TURNSTILE_LOG=${TURNSTILE_LOG:-info} \
        spawn "$cpu" "$dir/turnstile.log" "$TURNSTILE_BIN" run --config "$dir/policies.yaml"
    LAST_PORT=$port
    TURNSTILE_ADMIN_PORT=$admin
    if ! wait_http "http://127.0.0.1:$port/" "$name"; then
        cat "$dir/turnstile.log" >&2 || true
        return 1
    fi
}

# ---- load and measurement ------------------------------------------------------------------------

# busy_pct SECS: share of all CPUs busy over SECS seconds (from /proc/stat), as an integer percent.
busy_pct() {
    local secs=${1:-1} a b
    a=$(head -1 /proc/stat)
    sleep "$secs"
    b=$(head -1 /proc/stat)
    awk -v a="$a" -v b="$b" 'BEGIN {
        n = split(a, x, " "); split(b, y, " ");
        for (i = 2; i <= n; i++) { t += y[i] - x[i]; if (i == 5 || i == 6) idle += y[i] - x[i] }
        printf "%d\n", (t > 0 ? 100 * (t - idle) / t : 0) }'
}

# wait_quiet: before a measurement our servers are idle, so CPU use now is other people's. Wait
# (bounded by MAX_WAIT) until it is under MAX_BUSY; record what it was in LAST_BUSY and LAST_LOAD.
wait_quiet() {
    local waited=0 busy
    while :; do
        busy=$(busy_pct 2)
        if (( busy <= MAX_BUSY )); then break; fi
        if (( waited >= MAX_WAIT )); then
            echo "warning: machine still ${busy}% busy after ${waited}s; measuring anyway" >&2
            break
        fi
        echo "  machine ${busy}% busy (others); waiting..." >&2
        sleep 8
        waited=$((waited + 10))
    done
    LAST_BUSY=$busy
    LAST_LOAD=$(cut -d' ' -f1-3 /proc/loadavg)
}

# to_ms VALUE: wrk latency (e.g. 512.00us, 1.23ms, 1.01s) in milliseconds.
to_ms() {
    awk -v v="$1" 'BEGIN {
        if (v ~ /us$/) { sub(/us$/, "", v); printf "%.3f", v / 1000 }
        else if (v ~ /ms$/) { sub(/ms$/, "", v); printf "%.3f", v }
        else if (v ~ /m$/) { sub(/m$/, "", v); printf "%.3f", v * 60000 }
        else if (v ~ /s$/) { sub(/s$/, "", v); printf "%.3f", v * 1000 }
        else printf "nan" }'
}

# stat_fields FILE: the fields of a /proc/PID/stat after the `(comm)` field, which may hold spaces.
stat_fields() { sed 's/.*) //' "$1" 2>/dev/null; }

# pid_ticks PID...: CPU ticks (user + system) used so far by these processes and their children
# (nginx's workers).
pid_ticks() { local total _user; read -r total _user < <(pid_ticks_split "$@"); echo "$total"; }

# pid_ticks_split PID...: the same, then the user ticks alone: "TOTAL USER".
pid_ticks_split() {
    local total=0 user=0 pid p f
    for pid in "$@"; do
        for p in $pid $(ps -o pid= --ppid "$pid" 2>/dev/null); do
            read -r -a f < <(stat_fields "/proc/$p/stat") || continue
            [[ ${#f[@]} -gt 13 ]] && total=$((total + f[11] + f[12])) && user=$((user + f[11]))
        done
    done
    echo "$total $user"
}

# our_ticks: CPU ticks used so far by the servers we run and by the wrk runs this shell waited for.
our_ticks() {
    local total=0 pid p f
    for pid in "${PIDS[@]}"; do
        for p in $pid $(ps -o pid= --ppid "$pid" 2>/dev/null); do
            read -r -a f < <(stat_fields "/proc/$p/stat") || continue
            [[ ${#f[@]} -gt 13 ]] && total=$((total + f[11] + f[12]))
        done
    done
    read -r -a f < <(stat_fields "/proc/$$/stat")
    echo $((total + f[13] + f[14]))
}

# all_ticks: CPU ticks used so far by everything on the machine: user, nice, system, and irq and
# softirq (loopback traffic is softirq time, which the kernel also charges to the processes).
all_ticks() { awk '/^cpu / {print $2 + $3 + $4 + $7 + $8; exit}' /proc/stat; }

# run_wrk NAME URL [PID] [STATUS]: warm up, wait for a quiet machine, measure, and append a row to results.tsv.
# Other people's CPU use during the measurement (everything but our servers and wrk) is recorded
# as a share of one core; a run disturbed by more than MAX_OTHERS % is retried (up to RETRIES
# attempts) and the least disturbed attempt is kept. With PID (the server under test), its CPU use
# is recorded too: a proxy below 100% of its core is limited by something else (wrk, upstream).
# STATUS 429 (the flood rows) expects every answer to be a 429: non-2xx answers are then the point,
# not an error.
run_wrk() {
    local name=$1 url=$2 server=${3:-} status=${4:-200}
    if [[ "$status" == 200 ]]; then check_ok "$url" "$name"; else check_status "$url" "$name" "$status"; fi
    pin "$WRK_CPU" "$WRK" -t"$WRK_THREADS" -c"$CONNECTIONS" -d"${WARMUP}s" "$url" >/dev/null
    local raw="$OUT/raw/round$ROUND-$name.txt" attempt best_others=-1 others a0 o0 a1 o1 busy load
    local s0 s1 server_cpu=- best_server_cpu=-
    for attempt in $(seq 1 "$RETRIES"); do
        wait_quiet
        a0=$(all_ticks); o0=$(our_ticks); s0=$([[ -n "$server" ]] && pid_ticks "$server" || echo 0)
        pin "$WRK_CPU" "$WRK" -t"$WRK_THREADS" -c"$CONNECTIONS" -d"${DURATION}s" --latency "$url" \
            >"$raw.try"
        a1=$(all_ticks); o1=$(our_ticks); s1=$([[ -n "$server" ]] && pid_ticks "$server" || echo 0)
        [[ -n "$server" ]] && server_cpu=$(( (s1 - s0) * 100 / (DURATION * TICKS) ))
        others=$(( ((a1 - a0) - (o1 - o0)) * 100 / (DURATION * TICKS) ))
        [[ -n "${BENCH_DEBUG:-}" ]] && echo "  debug: all $((a1 - a0)) ours $((o1 - o0)) ticks" >&2
        (( others < 0 )) && others=0
        if (( best_others < 0 || others < best_others )); then
            best_others=$others
            best_server_cpu=$server_cpu
            busy=$LAST_BUSY
            load=$LAST_LOAD
            mv "$raw.try" "$raw"
        fi
        (( others <= MAX_OTHERS )) && break
        echo "  $name: others used ${others}% of a core during the run; retrying" >&2
    done
    rm -f "$raw.try"
    local rps p50 p99 non2xx errors
    rps=$(awk '/^Requests\/sec:/ {print $2}' "$raw")
    p50=$(to_ms "$(awk '$1 == "50%" {print $2}' "$raw")")
    p99=$(to_ms "$(awk '$1 == "99%" {print $2}' "$raw")")
    non2xx=$(awk '/Non-2xx or 3xx responses:/ {print $NF}' "$raw")
    [[ "$status" != 200 ]] && non2xx=0
    errors=$(awk '/Socket errors:/ {gsub(/,/, ""); print $4 + $6 + $8 + $10}' "$raw")
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$ROUND" "$name" "${rps:-0}" "$p50" \
        "$p99" "${non2xx:-0}" "${errors:-0}" "$best_server_cpu" "$busy" "$best_others" "$load" \
        >>"$OUT/results.tsv"
    printf '  %-22s %9s req/s  p50 %6s ms  p99 %7s ms  cpu %4s%%  (others: %s%% before, %s%% during)\n' \
        "$name" "${rps:-0}" "$p50" "$p99" "$best_server_cpu" "$busy" "$best_others"
    if [[ "${non2xx:-0}" != 0 || "${errors:-0}" != 0 ]]; then
        echo "  warning: $name had ${non2xx:-0} non-2xx responses and ${errors:-0} socket errors" >&2
    fi
}

# run_pair NAME_A URL_A PID_A NAME_B URL_B PID_B: two targets, both running, measured in SLICES
# alternating slices of DURATION/SLICES seconds each (A B, B A, A B, ...) after one warm-up each and
# one quiet-machine wait, so both see the same phases of a machine that speeds up and slows down
# by the second. Each target's slices are merged into one row of results.tsv: requests over
# seconds, and p50 and p99 of the merged latency histograms (bench/wrk_histogram.lua). Retried
# like run_wrk when others used the machine.
run_pair() {
    local names=("$1" "$4") urls=("$2" "$5") pids=("$3" "$6")
    local slice=$((DURATION / SLICES))
    if (( slice < 1 )); then
        echo "error: --duration $DURATION is shorter than --slices $SLICES seconds" >&2
        return 1
    fi
    local i
    for i in 0 1; do
        check_ok "${urls[$i]}" "${names[$i]}"
        pin "$WRK_CPU" "$WRK" ${WRK_ARGS[@]+"${WRK_ARGS[@]}"} -t"$WRK_THREADS" -c"$CONNECTIONS" \
            -d"${WARMUP}s" "${urls[$i]}" >/dev/null
    done
    local raw="$OUT/raw/round$ROUND-${names[0]}+${names[1]}" attempt best_others=-1 others
    local a0 o0 a1 o1 busy load k t0 t1 u0 u1 cpu_ticks=(0 0) user_ticks=(0 0) best_cpu=(- -)
    local best_user=(- -)
    for attempt in $(seq 1 "$RETRIES"); do
        wait_quiet
        rm -rf "$raw.try"; mkdir -p "$raw.try"
        cpu_ticks=(0 0)
        user_ticks=(0 0)
        a0=$(all_ticks); o0=$(our_ticks)
        for k in $(seq 1 "$SLICES"); do
            for i in $( ((k % 2)) && echo 0 1 || echo 1 0); do
                read -r t0 u0 < <(pid_ticks_split "${pids[$i]}")
                WRK_HISTOGRAM="$raw.try/${names[$i]}.$k.hist" pin "$WRK_CPU" "$WRK" \
                    ${WRK_ARGS[@]+"${WRK_ARGS[@]}"} -t"$WRK_THREADS" -c"$CONNECTIONS" -d"${slice}s" --latency \
                    -s "$BENCH_DIR/wrk_histogram.lua" "${urls[$i]}" >"$raw.try/${names[$i]}.$k.txt"
                read -r t1 u1 < <(pid_ticks_split "${pids[$i]}")
                cpu_ticks[i]=$((cpu_ticks[i] + t1 - t0))
                user_ticks[i]=$((user_ticks[i] + u1 - u0))
            done
        done
        a1=$(all_ticks); o1=$(our_ticks)
        others=$(( ((a1 - a0) - (o1 - o0)) * 100 / (2 * SLICES * slice * TICKS) ))
        (( others < 0 )) && others=0
        if (( best_others < 0 || others < best_others )); then
            best_others=$others
            for i in 0 1; do
                best_cpu[i]=$((cpu_ticks[i] * 100 / (SLICES * slice * TICKS)))
                best_user[i]=$((user_ticks[i] * 100 / (SLICES * slice * TICKS)))
            done
            busy=$LAST_BUSY
            load=$LAST_LOAD
            rm -rf "$raw"; mv "$raw.try" "$raw"
        fi
        (( others <= MAX_OTHERS )) && break
        echo "  ${names[0]}/${names[1]}: others used ${others}% of a core during the run; retrying" >&2
    done
    rm -rf "$raw.try"
    for i in 0 1; do
        python3 - "$raw" "${names[$i]}" "$ROUND" "${best_cpu[$i]}" "$busy" "$best_others" "$load" \
            "${best_user[$i]}" >>"$OUT/results.tsv" <<'PY'
import glob, sys
raw, name, rnd, cpu, busy, others, load, user = sys.argv[1:]
requests = duration = non2xx = errors = 0
hist = {}
for path in glob.glob(f"{raw}/{name}.*.hist"):
    for line in open(path):
        key, value = line.split()
        if key == "requests": requests += int(value)
        elif key == "duration_us": duration += int(value)
        elif key == "non2xx": non2xx += int(value)
        elif key == "errors": errors += int(value)
        else: hist[int(key)] = hist.get(int(key), 0) + int(value)
total = sum(hist.values())
def percentile(p):
    # wrk's own rule: the smallest latency with at least p% of the samples at or below it.
    rank, seen = max(1, round(p / 100 * total + 0.5)), 0
    for us in sorted(hist):
        seen += hist[us]
        if seen >= rank:
            return us / 1000
    return 0.0
rps = requests / (duration / 1e6) if duration else 0
print(f"{rnd}\t{name}\t{rps:.2f}\t{percentile(50):.3f}\t{percentile(99):.3f}\t{non2xx}\t{errors}"
      f"\t{cpu}\t{busy}\t{others}\t{load}\t{user}")
PY
        tail -1 "$OUT/results.tsv" | awk -F'\t' '{printf "  %-22s %9s req/s  p50 %6s ms  p99 %7s ms  cpu %4s%% (user %s%%)  (others: %s%% before, %s%% during)\n", $2, $3, $4, $5, $8, $12, $9, $10;
            if ($6 != 0 || $7 != 0) printf "  warning: %s had %s non-2xx responses and %s socket errors\n", $2, $6, $7 > "/dev/stderr"}'
    done
}

# in_order NAME...: the names in this round's order: as given in odd rounds, reversed in even
# ones. The machine drifts within a round (other tenants, the host's own load), so a row always
# measured second would carry that drift into every ratio; alternating cancels it.
in_order() {
    if (( ROUND % 2 )); then printf '%s\n' "$@"; else printf '%s\n' "$@" | tac; fi
}

# add_comparison LABEL NUMERATOR DENOMINATOR MIN_THROUGHPUT_RATIO MAX_P99_RATIO ("-": no target)
add_comparison() {
    printf '%s\t%s\t%s\t%s\t%s\n' "$@" >>"$OUT/comparisons.tsv"
}

# ---- sections ------------------------------------------------------------------------------------
# A section measures one comparison in every round. It may start servers for the whole run in
# section_NAME_setup, and is called as section_NAME once per round. New sections (Redis vs NGINX +
# ngx_lua, Envoy RLS decisions/s) add their functions here and their name to SECTIONS_ALL.

section_memory_setup() {
    local w
    for w in $WORKERS_LIST; do
        # The target is against one NGINX worker; the 2-worker row is for information.
        if [[ "$w" == 1 ]]; then
            add_comparison "Turnstile memory / NGINX proxy, 1 worker (target)" \
                turnstile-memory-w1 nginx-proxy-w1 1.0 1.0
        else
            add_comparison "Turnstile memory / NGINX proxy, $w workers" \
                "turnstile-memory-w$w" "nginx-proxy-w$w" - -
        fi
    done
}

section_memory() {
    WRK_CPU=$CPU_LOAD
    run_wrk upstream-direct "http://127.0.0.1:$UPSTREAM_PORT/" "$UPSTREAM_PID"
    local w cpu
    for w in $WORKERS_LIST; do
        if [[ "$w" == 1 ]]; then cpu=$CPU_PROXY; WRK_CPU=$CPU_LOAD; else cpu=""; WRK_CPU=""; fi
        if (( SLICES > 1 )); then
            # Both running, measured in alternating slices (`run_pair`), the round's first first.
            start_nginx_proxy "$w" "$cpu"
            local npid=$LAST_PID nport=$LAST_PORT
            start_turnstile "$BENCH_DIR/turnstile-memory.yaml.tmpl" "$w" "$cpu"
            local tpid=$LAST_PID tport=$LAST_PORT
            local a=("nginx-proxy-w$w" "http://127.0.0.1:$nport/" "$npid")
            local b=("turnstile-memory-w$w" "http://127.0.0.1:$tport/" "$tpid")
            if (( ROUND % 2 )); then run_pair "${a[@]}" "${b[@]}"; else run_pair "${b[@]}" "${a[@]}"; fi
            stop_pid "$tpid"
            stop_pid "$npid"
            continue
        fi
        # NGINX and Turnstile run one at a time, each first in every other round (`in_order`).
        local who pid
        for who in $(in_order nginx turnstile); do
            if [[ "$who" == nginx ]]; then
                start_nginx_proxy "$w" "$cpu"
                pid=$LAST_PID
                run_wrk "nginx-proxy-w$w" "http://127.0.0.1:$LAST_PORT/" "$pid"
            else
                start_turnstile "$BENCH_DIR/turnstile-memory.yaml.tmpl" "$w" "$cpu"
                pid=$LAST_PID
                run_wrk "turnstile-memory-w$w" "http://127.0.0.1:$LAST_PORT/" "$pid"
            fi
            stop_pid "$pid"
        done
    done
}

# shellcheck source=bench/redis.sh
source "$BENCH_DIR/redis.sh"
# shellcheck source=bench/tls.sh
source "$BENCH_DIR/tls.sh"
# shellcheck source=bench/flood.sh
source "$BENCH_DIR/flood.sh"
# shellcheck source=bench/rls.sh
source "$BENCH_DIR/rls.sh"
# shellcheck source=bench/rlqs.sh
source "$BENCH_DIR/rlqs.sh"
# shellcheck source=bench/access_log.sh
source "$BENCH_DIR/access_log.sh"
# shellcheck source=bench/hotpath.sh
source "$BENCH_DIR/hotpath.sh"
# shellcheck source=bench/tracing.sh
source "$BENCH_DIR/tracing.sh"
# shellcheck source=bench/jwt.sh
source "$BENCH_DIR/jwt.sh"
# shellcheck source=bench/peers.sh
source "$BENCH_DIR/peers.sh"
# shellcheck source=bench/pacing.sh
source "$BENCH_DIR/pacing.sh"

# ---- summary -------------------------------------------------------------------------------------
summarize() {
    python3 - "$OUT/results.tsv" "$OUT/comparisons.tsv" <<'PY'
import statistics, sys
rows, order = {}, []
for line in open(sys.argv[1]):
    f = line.rstrip("\n").split("\t")
    if f[0] == "round":
        continue
    name = f[1]
    if name not in rows:
        rows[name] = []
        order.append(name)
    rows[name].append(dict(round=f[0], rps=float(f[2]), p50=float(f[3]), p99=float(f[4]),
                           bad=int(f[5]) + int(f[6]), cpu=f[7], busy=int(f[8]),
                           during=int(f[9]), load=f[10]))
med = {n: {k: statistics.median(r[k] for r in rows[n]) for k in ("rps", "p50", "p99")}
       for n in order}
print(f"{'target':<30}{'req/s':>12}{'p50 ms':>10}{'p99 ms':>10}{'rounds':>8}  notes")
for n in order:
    m, rs = med[n], rows[n]
    bad = sum(r["bad"] for r in rs)
    during = max(r["during"] for r in rs)
    cpus = [int(r["cpu"]) for r in rs if r["cpu"] != "-"]
    # CPU time a request: what the server spends on each, whether or not it is the bottleneck.
    per = statistics.median(int(r["cpu"]) * 1e4 / r["rps"]
                            for r in rs if r["cpu"] != "-" and r["rps"]) if cpus else 0
    cpu = f"server cpu {statistics.median(cpus):.0f}% ({per:.1f} us a request); " if cpus else ""
    note = cpu + f"others <= {during}% of a core" + (f"; {bad} non-2xx/errors: INVALID" if bad else "")
    print(f"{n:<30}{m['rps']:>12.0f}{m['p50']:>10.3f}{m['p99']:>10.3f}{len(rs):>8}  {note}")
print()
ok = True
try:
    comps = [l.rstrip("\n").split("\t") for l in open(sys.argv[2]) if l.strip()]
except FileNotFoundError:
    comps = []
for label, num, den, min_tp, max_p99 in comps:
    if num not in med or den not in med:
        continue
    # A round measures both rows of a comparison side by side (the memory pair in alternating
    # slices), so each round's ratio cancels what the machine did during that round; the median
    # of those ratios decides. The ratio of the two rows' medians, which pairs one round's NGINX
    # with another round's Turnstile, is printed for reference.
    by_round = {r["round"]: r for r in rows[den]}
    pairs = [(r, by_round[r["round"]]) for r in rows[num] if r["round"] in by_round]
    if not pairs:
        continue
    tp = statistics.median(a["rps"] / b["rps"] for a, b in pairs)
    p99 = statistics.median(a["p99"] / b["p99"] for a, b in pairs)
    of_medians = (f"ratio of the rows' medians: throughput {med[num]['rps'] / med[den]['rps']:.2f}x, "
                  f"p99 {med[num]['p99'] / med[den]['p99']:.2f}x")
    rounds = ("    per round: throughput " + " ".join(f"{a['rps'] / b['rps']:.2f}" for a, b in pairs)
              + "; p99 " + " ".join(f"{a['p99'] / b['p99']:.2f}" for a, b in pairs))
    if min_tp == "-":
        print(f"{label}: throughput {tp:.2f}x, p99 {p99:.2f}x")
        print(rounds + "\n    " + of_medians)
        continue
    good = tp >= float(min_tp) and p99 <= float(max_p99)
    ok &= good
    print(f"{label}: throughput {tp:.2f}x (target >= {min_tp}x), "
          f"p99 {p99:.2f}x (target <= {max_p99}x): {'MEETS TARGET' if good else 'BELOW TARGET'}")
    print(rounds + "\n    " + of_medians)
sys.exit(0 if ok else 3)
PY
}

# ---- main ----------------------------------------------------------------------------------------
for s in "${SECTIONS[@]}"; do
    if ! declare -F "section_$s" >/dev/null; then
        echo "unknown section: $s (known: ${SECTIONS_ALL[*]})" >&2
        exit 2
    fi
done
for tool in "$NGINX" "$WRK" taskset curl python3; do
    command -v "$tool" >/dev/null || { echo "error: $tool not found; install it" >&2; exit 2; }
done

# Built once, before a --layout both run starts its two halves.
if (( PGO )) && [[ -z "$TURNSTILE_BIN" ]]; then
    echo "building turnstile with profile-guided optimisation (bench/pgo.sh)..."
    TURNSTILE_BIN=$("$BENCH_DIR/pgo.sh" | tail -1)
    ORIGINAL_ARGS+=(--turnstile "$TURNSTILE_BIN")
fi

case "$LAYOUT" in
    proxy-alone) CPU_UPSTREAM=$CPU_LOAD ;;
    servers-together) CPU_UPSTREAM=$CPU_PROXY ;;
    unpinned) CPU_PROXY=""; CPU_LOAD=""; CPU_UPSTREAM="" ;;
    both)
        # The same benchmark in each layout, one after the other; each prints its own summary.
        status=0
        for layout in proxy-alone unpinned; do
            echo "==== layout: $layout"
            "${BASH_SOURCE[0]}" "${ORIGINAL_ARGS[@]}" --layout "$layout" || status=$?
        done
        exit "$status"
        ;;
    *) echo "unknown layout: $LAYOUT (proxy-alone, servers-together, unpinned or both)" >&2; exit 2 ;;
esac

if [[ -z "$TURNSTILE_BIN" ]]; then
    if (( BUILD )); then
        echo "building turnstile (cargo build --release)..."
        (cd "$REPO_DIR" && cargo build --release --bin turnstile)
    fi
    TURNSTILE_BIN="${CARGO_TARGET_DIR:-$REPO_DIR/target}/release/turnstile"
fi
[[ -x "$TURNSTILE_BIN" ]] || { echo "error: no turnstile binary at $TURNSTILE_BIN" >&2; exit 2; }

STAMP=$(date +%Y%m%d-%H%M%S)
OUT="$BENCH_DIR/out/$STAMP"
mkdir -p "$OUT/raw"
ln -sfn "$STAMP" "$BENCH_DIR/out/latest"
printf 'round\ttarget\treq_s\tp50_ms\tp99_ms\tnon2xx\tsocket_errors\tserver_cpu_pct\tothers_before_pct\tothers_during_pct\tloadavg\n' \
    >"$OUT/results.tsv"

{
    echo "date: $(date -Is)"
    echo "host: $(uname -srm), $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
    echo "nginx: $("$NGINX" -v 2>&1 | cut -d/ -f2)  wrk: $("$WRK" -v 2>&1 | head -1 | cut -d' ' -f2)"
    echo "turnstile: $TURNSTILE_BIN ($(git -C "$REPO_DIR" rev-parse --short HEAD 2>/dev/null || echo '?'))"
    echo "wrk: -t$WRK_THREADS -c$CONNECTIONS -d${DURATION}s (warm-up ${WARMUP}s), rounds: $ROUNDS"
    echo "placement ($LAYOUT): proxy on CPU $CPU_PROXY, upstream on CPU $CPU_UPSTREAM, wrk on CPU" \
        "$CPU_LOAD (1-worker rows); 2-worker rows unpinned; TURNSTILE_WORKERS = NGINX workers"
    echo "sections: ${SECTIONS[*]}; workers: $WORKERS_LIST"
} | tee "$OUT/setup.txt"

start_nginx_upstream
for s in "${SECTIONS[@]}"; do
    if declare -F "section_${s}_setup" >/dev/null; then "section_${s}_setup"; fi
done
for ROUND in $(seq 1 "$ROUNDS"); do
    echo "round $ROUND/$ROUNDS"
    for s in "${SECTIONS[@]}"; do "section_$s"; done
done

echo
status=0
summarize | tee "$OUT/summary.txt" || status=$?
# Sections whose rows are not req/s print their own summary (section_NAME_summary).
for s in "${SECTIONS[@]}"; do
    if declare -F "section_${s}_summary" >/dev/null; then
        echo
        "section_${s}_summary" | tee -a "$OUT/summary.txt" || status=$?
    fi
done
echo
echo "results: $OUT"
exit "$status"
