#!/usr/bin/env bash
# gRPC unary calls through Turnstile (`protocol: h2` upstream, the memory section's policy that
# never trips, keyed by client IP and method) against NGINX's `grpc_pass`, paired.
#
# Usage: bench/grpc.sh [--rounds N] [--slices N] [--seconds S] [--no-build]
#
# Both proxies run with one worker on CPU 0 in front of the same gRPC echo upstream
# (examples/grpc_load.rs `upstream`, a hyper h2c server answering each call with its message and
# `grpc-status: 0` trailers); the load generator (examples/grpc_load.rs `load`: unary calls, 64
# concurrent streams over 4 h2c connections) and the upstream share CPU 1. Each round measures
# the two proxies in SLICES alternating slices of SECONDS/SLICES each (A B, B A, ...), so both
# see the same phases of a machine whose speed drifts; a round's figures are its slices' merged
# calls over their time, and its p50/p99 the median of its slices'. A slice with any call not
# answered `grpc-status: 0` fails the run. Prints each round's ratio (Turnstile / NGINX) and the
# median over rounds, with the proxies' CPU per call (utime + stime from /proc/PID/stat).
# Target: throughput >= 0.8x, p99 <= 1.5x (the TLS row's: both terminate h2 and run an h2 client).
set -euo pipefail

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$BENCH_DIR/common.sh"
ROUNDS=3
SLICES=4
SECONDS_PER_ROUND=20
BUILD=1
while (($#)); do
    case $1 in
        --rounds) ROUNDS=$2; shift 2 ;;
        --slices) SLICES=$2; shift 2 ;;
        --seconds) SECONDS_PER_ROUND=$2; shift 2 ;;
        --no-build) BUILD=0; shift ;;
        *) sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2 ;;
    esac
done
SLICE=$((SECONDS_PER_ROUND / SLICES))
((SLICE >= 1)) || { echo "error: --seconds shorter than --slices" >&2; exit 2; }
TICKS=$(getconf CLK_TCK)

if ((BUILD)); then
    (cd "$REPO_DIR" && cargo build --release --bin turnstile --example grpc_load)
fi
TURNSTILE_BIN=${TURNSTILE_BIN:-$REPO_DIR/target/release/turnstile}
LOAD_BIN=${GRPC_LOAD_BIN:-$REPO_DIR/target/release/examples/grpc_load}
command -v nginx >/dev/null || { echo "error: nginx not found" >&2; exit 2; }

bench_workdir grpc

ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

# The upstream, on CPU 1.
taskset -c 1 "$LOAD_BIN" upstream >"$WORK/upstream.out" &
PIDS+=($!)
for _ in $(seq 1 100); do grep -q listening "$WORK/upstream.out" 2>/dev/null && break; sleep 0.1; done
UPSTREAM_PORT=$(awk '/listening/ {print $2}' "$WORK/upstream.out")

# NGINX, one worker on CPU 0.
NGINX_PORT=$(free_port)
mkdir -p "$WORK/nginx/tmp"
render "$BENCH_DIR/nginx-grpc.conf.tmpl" "$WORK/nginx/nginx.conf" DIR="$WORK/nginx" \
    PORT="$NGINX_PORT" UPSTREAM_PORT="$UPSTREAM_PORT"
taskset -c 0 nginx -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf" -g 'daemon off;' &
PIDS+=($!)
NGINX_PID=$!
wait_port "$NGINX_PORT"
# The worker does the work: its CPU is the master's child's.
NGINX_WORKER=$(pgrep -P "$NGINX_PID" | head -1)

# Turnstile, one worker on CPU 0.
TS_PORT=$(free_port)
TS_ADMIN=$(free_port)
render "$BENCH_DIR/turnstile-grpc.yaml.tmpl" "$WORK/policies.yaml" PORT="$TS_PORT" \
    ADMIN_PORT="$TS_ADMIN" UPSTREAM_PORT="$UPSTREAM_PORT"
TURNSTILE_WORKERS=1 TURNSTILE_LOG=warn taskset -c 0 "$TURNSTILE_BIN" run \
    --config "$WORK/policies.yaml" >"$WORK/turnstile.log" 2>&1 &
PIDS+=($!)
TS_PID=$!
wait_port "$TS_PORT"

# load NAME PORT PID SECONDS: one slice; appends "name calls seconds p50 p99 ticks" to results.
load() {
    local name=$1 port=$2 pid=$3 secs=$4 t0 t1 line
    t0=$(ticks "$pid")
    line=$(taskset -c 1 "$LOAD_BIN" load --addr "127.0.0.1:$port" --seconds "$secs" \
        --requests 100000000 --connections 4 --concurrency 64)
    t1=$(ticks "$pid")
    read -r _ calls _ secs_run _ _ _ p50 _ p99 _ not_ok _ errors <<<"$line"
    if [[ "$not_ok" != 0 || "$errors" != 0 ]]; then
        echo "error: $name: $not_ok calls not OK, $errors without an answer: $line" >&2
        exit 1
    fi
    echo "$ROUND $name $calls $secs_run $p50 $p99 $((t1 - t0))" >>"$WORK/results"
}

# Warm-up: a slice each, not counted.
ROUND=0
load nginx "$NGINX_PORT" "$NGINX_WORKER" 2
load turnstile "$TS_PORT" "$TS_PID" 2
: >"$WORK/results"
for ROUND in $(seq 1 "$ROUNDS"); do
    for k in $(seq 1 "$SLICES"); do
        if ((k % 2)); then order="nginx turnstile"; else order="turnstile nginx"; fi
        for name in $order; do
            if [[ $name == nginx ]]; then
                load nginx "$NGINX_PORT" "$NGINX_WORKER" "$SLICE"
            else
                load turnstile "$TS_PORT" "$TS_PID" "$SLICE"
            fi
        done
    done
done

python3 - "$WORK/results" "$TICKS" "$(uptime)" <<'PY'
import statistics, sys
path, ticks, uptime = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rounds = {}
for line in open(path):
    rnd, name, calls, secs, p50, p99, cpu = line.split()
    r = rounds.setdefault(int(rnd), {}).setdefault(name, {"calls": 0, "secs": 0.0, "p50": [], "p99": [], "cpu": 0})
    r["calls"] += int(calls); r["secs"] += float(secs); r["cpu"] += int(cpu)
    r["p50"].append(float(p50)); r["p99"].append(float(p99))
ratios, p99s = [], []
for rnd in sorted(rounds):
    row = {}
    for name, r in rounds[rnd].items():
        row[name] = (r["calls"] / r["secs"], statistics.median(r["p50"]), statistics.median(r["p99"]),
                     r["cpu"] / ticks / r["calls"] * 1e6)
        print(f"round {rnd} {name:9} {row[name][0]:9.0f} calls/s  p50 {row[name][1]:6.3f} ms  "
              f"p99 {row[name][2]:6.3f} ms  CPU {row[name][3]:5.1f} us a call")
    ratio = row["turnstile"][0] / row["nginx"][0]
    p99 = row["turnstile"][2] / row["nginx"][2]
    ratios.append(ratio); p99s.append(p99)
    print(f"round {rnd} turnstile/nginx {ratio:.2f}x, p99 {p99:.2f}x")
print(f"median over {len(ratios)} rounds: {statistics.median(ratios):.2f}x, p99 {statistics.median(p99s):.2f}x "
      f"(target >= 0.8x, p99 <= 1.5x); load at the end: {uptime.strip()}")
PY
