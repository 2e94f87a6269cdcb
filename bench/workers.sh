#!/usr/bin/env bash
# Where a second worker's time goes: Turnstile with one worker and with two, and NGINX limit_req
# with two, each under the same wrk load (unpinned, as run.sh's 2-worker rows), with per request:
# CPU time (user and system, from /proc/PID/task/*/stat), context switches (voluntary: the thread
# slept, e.g. parked for want of work; involuntary: the kernel took the core away), and how the CPU
# splits over the threads. With --strace, a second load with `strace -f -c` attached counts the
# system calls per request (strace slows the server, so only the counts are read, not the rates).
# With --perf, a third load with `perf record -e cpu-clock` (a software clock: no hardware counters
# needed) attached samples where the server's CPU goes: its time a request in user space and in
# the kernel, and the functions that take most of it, in microseconds a request. Sampling slows
# the server (on a 2-vCPU guest, a single-threaded one by up to 40%), and in a guest the kernel's
# samples pile up where interrupts are enabled again (`_raw_spin_unlock_irqrestore`): read the
# ranking of the user-space functions, and take the CPU a request from the unsampled load above.
#
# Usage: bench/workers.sh [--strace] [--perf] [--turnstile BIN] [SECONDS] [CONNECTIONS]
# Needs nginx, wrk, python3 (strace for --strace; perf, Debian linux-perf, for --perf). Servers on
# free loopback ports, stopped by PID on exit.
set -euo pipefail

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$BENCH_DIR/common.sh"
STRACE=0
PERF=0
TURNSTILE_BIN=${TURNSTILE_BIN:-${CARGO_TARGET_DIR:-$REPO_DIR/target}/release/turnstile}
while [[ $# -gt 0 ]]; do
    case "$1" in
        --strace) STRACE=1; shift ;;
        --perf) PERF=1; shift ;;
        --turnstile) TURNSTILE_BIN=$2; shift 2 ;;
        *) break ;;
    esac
done
SECS=${1:-10}
CONNECTIONS=${2:-64}
[[ -x "$TURNSTILE_BIN" ]] || { echo "error: no turnstile binary at $TURNSTILE_BIN" >&2; exit 2; }
if (( PERF )) && ! command -v perf >/dev/null; then
    echo "perf: NOT MEASURED (no perf on PATH; Debian package linux-perf)" >&2
    PERF=0
fi

bench_workdir workers

# threads PID...: one line per thread of these processes and their children:
# tid utime stime voluntary_switches involuntary_switches
threads() {
    local pid p t
    for pid in "$@"; do
        for p in $pid $(ps -o pid= --ppid "$pid" 2>/dev/null); do
            for t in /proc/"$p"/task/*; do
                [[ -r "$t/stat" ]] || continue
                awk -v tid="${t##*/}" -v stat="$(sed 's/.*) //' "$t/stat")" '
                    /^voluntary_ctxt_switches/ { v = $2 } /^nonvoluntary_ctxt_switches/ { n = $2 }
                    END { split(stat, f, " "); print tid, f[12], f[13], v, n }' "$t/status"
            done
        done
    done
}

mkdir -p "$WORK/up/tmp"
UP_PORT=$(free_port)
render "$BENCH_DIR/nginx-upstream.conf.tmpl" "$WORK/up/nginx.conf" DIR="$WORK/up" PORT="$UP_PORT"
(exec nginx -p "$WORK/up" -c "$WORK/up/nginx.conf" -g 'daemon off;') >"$WORK/up/log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$UP_PORT/"

# start NAME: starts the named server, sets SERVER_PID and SERVER_PORT.
start() {
    local name=$1 dir="$WORK/$1"
    mkdir -p "$dir/tmp"
    SERVER_PORT=$(free_port)
    case "$name" in
        turnstile-w1|turnstile-w2)
            render "$BENCH_DIR/turnstile-memory.yaml.tmpl" "$dir/policies.yaml" PORT="$SERVER_PORT" \
                ADMIN_PORT="$(free_port)" UPSTREAM_PORT="$UP_PORT"
            (TURNSTILE_WORKERS=${name#turnstile-w} TURNSTILE_LOG=warn exec \
                "$TURNSTILE_BIN" run --config "$dir/policies.yaml") >"$dir/log" 2>&1 &
            ;;
        nginx-limit-req-w2)
            render "$BENCH_DIR/nginx-limit-req.conf.tmpl" "$dir/nginx.conf" DIR="$dir" \
                PORT="$SERVER_PORT" UPSTREAM_PORT="$UP_PORT" WORKERS=2 RATE=1000000000r/s \
                BURST=1000000000
            (exec nginx -p "$dir" -c "$dir/nginx.conf" -g 'daemon off;') >"$dir/log" 2>&1 &
            ;;
    esac
    SERVER_PID=$!
    PIDS+=("$SERVER_PID")
    wait_http "http://127.0.0.1:$SERVER_PORT/"
}

stop() {
    kill "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
}

echo "load: wrk -t1 -c$CONNECTIONS -d${SECS}s, unpinned; loadavg $(cut -d' ' -f1-3 /proc/loadavg)"
echo "turnstile: $TURNSTILE_BIN ($(git -C "$REPO_DIR" rev-parse --short HEAD 2>/dev/null || echo '?'))"
for name in turnstile-w1 turnstile-w2 nginx-limit-req-w2; do
    start "$name"
    wrk -t1 -c"$CONNECTIONS" -d2s "http://127.0.0.1:$SERVER_PORT/" >/dev/null
    threads "$SERVER_PID" >"$WORK/before"
    wrk -t1 -c"$CONNECTIONS" -d"${SECS}s" "http://127.0.0.1:$SERVER_PORT/" >"$WORK/wrk.txt"
    threads "$SERVER_PID" >"$WORK/after"
    python3 - "$name" "$WORK/before" "$WORK/after" "$WORK/wrk.txt" "$(getconf CLK_TCK)" <<'PY'
import re, sys
name, before, after, wrk, ticks = sys.argv[1:]
ticks = float(ticks)
def load(path):
    return {l.split()[0]: list(map(int, l.split()[1:])) for l in open(path) if l.strip()}
b, a = load(before), load(after)
text = open(wrk).read()
requests = int(re.search(r"(\d+) requests in", text).group(1))
rps = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))
rows = []
for tid, (u, s, v, n) in a.items():
    u0, s0, v0, n0 = b.get(tid, [0, 0, 0, 0])
    rows.append((tid, u - u0, s - s0, v - v0, n - n0))
busy = [r for r in rows if r[1] + r[2] > 0]
cpu_us = sum(r[1] + r[2] for r in rows) / ticks * 1e6 / requests
user_us = sum(r[1] for r in rows) / ticks * 1e6 / requests
vol = sum(r[3] for r in rows) / requests
inv = sum(r[4] for r in rows) / requests
split = " ".join(f"{(r[1] + r[2]) / ticks * 1e6 / requests:.1f}" for r in sorted(busy, key=lambda r: -(r[1] + r[2])))
print(f"{name:<20} {rps:>9.0f} req/s  cpu {cpu_us:5.1f} us a request (user {user_us:4.1f})  "
      f"switches a request: voluntary {vol:.3f}, involuntary {inv:.3f}  busy threads (us a request): {split}")
PY
    # The server's processes (its own, and NGINX's workers), for strace and perf to attach to.
    local_pids=("$SERVER_PID" $(ps -o pid= --ppid "$SERVER_PID" 2>/dev/null || true))
    if (( STRACE )); then
        # Attached to the running server (all its threads, and NGINX's worker processes), then
        # detached with SIGINT, which makes strace print its counts; the server stays ours.
        strace_args=()
        for p in "${local_pids[@]}"; do strace_args+=(-p "$p"); done
        strace -f -c -o "$WORK/$name.strace" "${strace_args[@]}" 2>/dev/null &
        STRACE_PID=$!
        sleep 1
        wrk -t1 -c"$CONNECTIONS" -d"${SECS}s" "http://127.0.0.1:$SERVER_PORT/" >"$WORK/wrk.txt"
        kill -INT "$STRACE_PID" 2>/dev/null || true
        wait "$STRACE_PID" 2>/dev/null || true
        python3 - "$name" "$WORK/$name.strace" "$WORK/wrk.txt" <<'PY'
import re, sys
name, trace, wrk = sys.argv[1:]
requests = int(re.search(r"(\d+) requests in", open(wrk).read()).group(1))
calls = {}
for line in open(trace):
    f = line.split()
    if len(f) >= 5 and f[0][0].isdigit() and f[-1] != "total":
        calls[f[-1]] = int(f[3])
top = sorted(calls.items(), key=lambda kv: -kv[1])[:8]
print(f"{name:<20} system calls a request under strace ({requests} requests): "
      + ", ".join(f"{k} {v / requests:.3f}" for k, v in top))
PY
    fi
    if (( PERF )); then
        perf record -F 999 -e cpu-clock -p "$(IFS=,; echo "${local_pids[*]}")" \
            -o "$WORK/$name.perf" -- sleep "$SECS" >/dev/null 2>&1 &
        PERF_PID=$!
        wrk -t1 -c"$CONNECTIONS" -d"${SECS}s" "http://127.0.0.1:$SERVER_PORT/" >"$WORK/wrk.txt"
        wait "$PERF_PID" 2>/dev/null || true
        perf report -i "$WORK/$name.perf" --stdio -n --no-children --sort dso,sym 2>/dev/null \
            >"$WORK/$name.perf.txt" || true
        python3 - "$name" "$WORK/$name.perf.txt" "$WORK/wrk.txt" <<'PY'
import re, sys
name, report, wrk = sys.argv[1:]
requests = int(re.search(r"(\d+) requests in", open(wrk).read()).group(1))
us = 1e6 / 999 / requests  # one sample's share of a request, in microseconds
rows, kernel, user = [], 0.0, 0.0
for line in open(report):
    m = re.match(r"\s*[\d.]+%\s+(\d+)\s+(\S+)\s+\[(.)\]\s+(.*)", line)
    if not m:
        continue
    t = int(m.group(1)) * us
    if m.group(3) == "k":
        kernel += t
    else:
        user += t
    rows.append((t, m.group(3), m.group(4).strip()[:80]))
print(f"{name:<20} sampled ({requests} requests): {user + kernel:.1f} us a request = "
      f"{user:.1f} user + {kernel:.1f} kernel; the most:")
for t, kind, sym in sorted(rows, reverse=True)[:12]:
    print(f"    {t:6.2f} us  [{kind}] {sym}")
PY
    fi
    stop
done
