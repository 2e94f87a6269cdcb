#!/usr/bin/env bash
# ShouldRateLimit decisions per second through Turnstile's Envoy rate limit service, on each store.
#
#   bench/rls_bench.sh                       # memory and redis, 10 s each
#   STORES=memory SECONDS_PER_RUN=5 bench/rls_bench.sh
#
# Starts a release `turnstile` (and a throwaway redis-server) on free loopback ports, drives it
# with examples/rls_load.rs (bounded in time and count), prints one line per store, and stops
# every process it started by PID, also on failure.
set -euo pipefail
cd "$(dirname "$0")/.."

SECONDS_PER_RUN=${SECONDS_PER_RUN:-10}
MAX_REQUESTS=${MAX_REQUESTS:-5000000}
CONCURRENCY=${CONCURRENCY:-64}
CONNECTIONS=${CONNECTIONS:-4}
DESCRIPTORS=${DESCRIPTORS:-1}
STORES=${STORES:-"memory redis"}
REDIS_POOL=${REDIS_POOL:-8}
REDIS_TIMEOUT=${REDIS_TIMEOUT:-250ms}
TARGET=${CARGO_TARGET_DIR:-target}

cargo build --release --quiet --bin turnstile --example rls_load

work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

mkdir -p "$work/rls"
# 1000 users at 20 per second each: at tens of thousands of calls per second, some are over.
cat > "$work/rls/bench.yaml" <<'YAML'
domain: bench
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 20}
  - key: user1
    rate_limit: {unit: second, requests_per_unit: 20}
  - key: user2
    rate_limit: {unit: second, requests_per_unit: 20}
YAML

run_store() {
  local store=$1 store_block
  case "$store" in
    memory) store_block=$'store:\n  type: memory' ;;
    redis)
      command -v redis-server >/dev/null || { echo "redis: redis-server not installed" >&2; return 1; }
      local port; port=$(free_port)
      redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
        --dir "$work" >"$work/redis.log" 2>&1 &
      pids+=($!)
      for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
      store_block=$'store:\n  type: redis\n  url: redis://127.0.0.1:'"$port"$'\n  pool_size: '"$REDIS_POOL"$'\n  timeout: '"$REDIS_TIMEOUT"
      ;;
    *) echo "unknown store $store" >&2; return 1 ;;
  esac
  cat > "$work/policies.yaml" <<YAML
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
$store_block
rls:
  listen: 127.0.0.1:0
  config: ./rls
YAML
  local out="$work/$store.out" err="$work/$store.err"
  : >"$out"
  "$TARGET/release/turnstile" run --config "$work/policies.yaml" >"$out" 2>"$err" &
  local tpid=$!
  pids+=($tpid)
  local addr=""
  for _ in $(seq 100); do
    addr=$(sed -n 's/.* rls=\([0-9.:]*\).*/\1/p' "$out")
    [ -n "$addr" ] && break
    kill -0 "$tpid" 2>/dev/null || break
    sleep 0.1
  done
  if [ -z "$addr" ]; then
    echo "$store: turnstile did not start:" >&2; cat "$err" >&2; return 1
  fi
  printf '%-7s ' "$store"
  "$TARGET/release/examples/rls_load" --addr "$addr" --domain bench --key user --values 1000 \
    --descriptors "$DESCRIPTORS" --seconds "$SECONDS_PER_RUN" --requests "$MAX_REQUESTS" \
    --concurrency "$CONCURRENCY" --connections "$CONNECTIONS"
  kill "$tpid"; wait "$tpid" 2>/dev/null || true
  if grep -q "store failed" "$err"; then
    echo "        (store errors were logged: $(grep -c 'store failed' "$err") lines)"
  fi
}

status=0
for store in $STORES; do
  run_store "$store" || status=1
done
exit $status
