# bench/common.sh: what the standalone bench scripts share. Source it after `set -euo pipefail`:
#
#   BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
#   . "$BENCH_DIR/common.sh"
#   bench_workdir NAME          # $WORK, a temporary directory removed on exit
#   some_server & PIDS+=($!)    # every process started goes into PIDS; all are stopped on exit
#
# It defines REPO_DIR, WORK, PIDS and the functions below. Nothing here starts a process.

REPO_DIR=$(dirname "$BENCH_DIR")
PIDS=()
WORK=

# bench_workdir NAME: makes $WORK and installs the exit trap that stops every PID in PIDS (TERM,
# then KILL after 5 s) and removes $WORK.
bench_workdir() {
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/turnstile-$1.XXXXXX")
    trap bench_cleanup EXIT
    trap 'exit 130' INT TERM
}

bench_cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do
        for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    [[ -n "$WORK" ]] && rm -rf "$WORK"
}

# free_port: a loopback port nothing listens on now.
free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

# free_ports N: N distinct free loopback ports on one line.
free_ports() {
    python3 -c 'import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))' "$1"
}

# render TEMPLATE OUT KEY=VALUE...: OUT is TEMPLATE with every @KEY@ replaced by VALUE.
render() {
    local tmpl=$1 out=$2; shift 2
    local text kv
    text=$(cat "$tmpl")
    # Quoted, so that a value's `&` and `\` stay as they are (bash 5.2's patsub_replacement).
    for kv in "$@"; do text=${text//"@${kv%%=*}@"/"${kv#*=}"}; done
    printf '%s\n' "$text" >"$out"
}

# wait_port PORT: waits (at most 10 s) until PORT accepts connections; exits the script if not.
wait_port() {
    for _ in $(seq 1 200); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        sleep 0.05
    done
    echo "error: nothing listens on port $1" >&2
    exit 1
}

# wait_http URL [NAME]: waits (at most 10 s) until URL answers 200; NAME names it in the error.
wait_http() {
    for _ in $(seq 1 100); do
        [[ $(curl -s -o /dev/null -w '%{http_code}' --max-time 1 "$1" || true) == 200 ]] && return 0
        sleep 0.1
    done
    echo "error: ${2:-$1} did not answer 200 at $1 within 10 s" >&2
    return 1
}

# release_bin: builds target/release/turnstile (or $CARGO_TARGET_DIR's) and prints its path.
release_bin() {
    (cd "$REPO_DIR" && cargo build --release --quiet)
    echo "${CARGO_TARGET_DIR:-$REPO_DIR/target}/release/turnstile"
}
