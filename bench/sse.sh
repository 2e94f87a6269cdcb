#!/usr/bin/env bash
# SSE pass-through benchmark: Chat Completions streams from the test LLM upstream
# (tests/llm/upstream.py) measured direct, behind NGINX (proxy_buffering off), behind Turnstile
# metering each stream's usage with a reservation (docs/llm.md), behind Turnstile with the same
# route and policy but no usage cost ("turnstile-plain": the proxy path without the meter) and
# behind Turnstile metering without a reservation ("turnstile-meter": the meter without the request
# body read before admission), in one run, paired round by round (bench/sse_client.py). Prints
# TTFB, the gap between events as the client gets them, events/s, each proxy's paired ratios to
# the direct connection, the metering ones' to the plain one, and the plain one's to NGINX.
#
# Usage: bench/sse.sh [--rounds N] [--streams N] [--concurrency N] [--events N] [--delay-ms N]
#                     [--turnstile BIN]
# Without --turnstile it builds target/release/turnstile. Every process it starts is stopped by
# its PID on exit.
set -euo pipefail

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$BENCH_DIR/common.sh"
TURNSTILE_BIN=${TURNSTILE_BIN:-}
NGINX=${NGINX:-nginx}
CLIENT_ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --turnstile) TURNSTILE_BIN="$2"; shift 2 ;;
    --rounds|--streams|--concurrency|--events|--delay-ms) CLIENT_ARGS+=("$1" "$2"); shift 2 ;;
    -h|--help) sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

if [[ -z "$TURNSTILE_BIN" ]]; then
  TURNSTILE_BIN=$(release_bin)
fi
bench_workdir sse

# The upstream prints its port first.
python3 "$REPO_DIR/tests/llm/upstream.py" > "$WORK/upstream.out" &
PIDS+=($!)
for _ in $(seq 1 100); do
  [[ -s "$WORK/upstream.out" ]] && break
  sleep 0.05
done
UPSTREAM_PORT=$(head -1 "$WORK/upstream.out")

NGINX_PORT=$(free_port)
mkdir -p "$WORK/nginx/tmp"
sed -e "s|@DIR@|$WORK/nginx|g" -e "s|@PORT@|$NGINX_PORT|g" -e "s|@UPSTREAM_PORT@|$UPSTREAM_PORT|g" \
  "$BENCH_DIR/nginx-sse.conf.tmpl" > "$WORK/nginx/nginx.conf"
"$NGINX" -c "$WORK/nginx/nginx.conf" -p "$WORK/nginx" -g 'daemon off;' &
PIDS+=($!)

TURNSTILE_PORT=$(free_port)
ADMIN_PORT=$(free_port)
sed -e "s|@PORT@|$TURNSTILE_PORT|g" -e "s|@ADMIN_PORT@|$ADMIN_PORT|g" \
  -e "s|@UPSTREAM_PORT@|$UPSTREAM_PORT|g" "$BENCH_DIR/turnstile-sse.yaml.tmpl" > "$WORK/turnstile.yaml"
TURNSTILE_WORKERS=1 "$TURNSTILE_BIN" run --config "$WORK/turnstile.yaml" > "$WORK/turnstile.out" 2>&1 &
PIDS+=($!)

# The same route without a usage cost (plain), and metering without a reservation (meter: no
# request body read before admission).
for variant in plain meter; do
  port=$(free_port)
  admin=$(free_port)
  sed -e "s|@PORT@|$port|g" -e "s|@ADMIN_PORT@|$admin|g" -e "s|@UPSTREAM_PORT@|$UPSTREAM_PORT|g" \
    "$BENCH_DIR/turnstile-sse-$variant.yaml.tmpl" > "$WORK/$variant.yaml"
  TURNSTILE_WORKERS=1 "$TURNSTILE_BIN" run --config "$WORK/$variant.yaml" > "$WORK/$variant.out" 2>&1 &
  PIDS+=($!)
  printf -v "${variant^^}_PORT" '%s' "$port"
done

wait_port "$UPSTREAM_PORT"
wait_port "$NGINX_PORT"
wait_port "$TURNSTILE_PORT"
wait_port "$PLAIN_PORT"
wait_port "$METER_PORT"

python3 "$BENCH_DIR/sse_client.py" \
  --target "direct=127.0.0.1:$UPSTREAM_PORT" \
  --target "nginx=127.0.0.1:$NGINX_PORT" \
  --target "turnstile=127.0.0.1:$TURNSTILE_PORT" \
  --target "turnstile-plain=127.0.0.1:$PLAIN_PORT" \
  --target "turnstile-meter=127.0.0.1:$METER_PORT" \
  --pair turnstile/turnstile-plain \
  --pair turnstile-meter/turnstile-plain \
  --pair turnstile-plain/nginx \
  "${CLIENT_ARGS[@]}"

# Turnstile settled every stream it metered: nothing is left reserved.
python3 - "$ADMIN_PORT" <<'EOF'
import sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics").read().decode()
for line in text.splitlines():
    if line.startswith(("turnstile_cost_reserved_units", "turnstile_tokens_total",
                        "turnstile_usage_unreported_total")):
        print("turnstile:", line)
EOF
