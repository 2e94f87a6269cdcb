# bench/run.sh section "tls": TLS termination, Turnstile's TLS listener against NGINX with TLS, in
# the same run, one worker each (placement as the memory section's 1-worker rows). Sourced by
# run.sh, which lists `tls` in SECTIONS_ALL.
#
# Rows (wrk over https://127.0.0.1, keep-alive, so handshakes are amortised and the rows measure
# TLS record encryption plus the proxy's own work; both offer TLS 1.3 and follow the client's
# cipher order, wrk's OpenSSL's, whose first choice is AES-256-GCM):
#   nginx-tls-w1       NGINX: TLS termination, then proxy to the upstream
#   turnstile-tls-w1   Turnstile: listen_tls, the memory section's policy, then proxy
# The certificate (EC P-256, for 127.0.0.1) is made with openssl at setup and served by both.
# Target: the memory section's (throughput >= 0.8x, p99 <= 1.5x).

section_tls_setup() {
    command -v openssl >/dev/null || { echo "error: openssl not found; install it" >&2; exit 2; }
    local dir="$WORK/tls"
    mkdir -p "$dir"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
        -subj "/CN=turnstile bench" -addext "subjectAltName=IP:127.0.0.1" \
        -keyout "$dir/key.pem" -out "$dir/cert.pem" 2>/dev/null
    TLS_CERT="$dir/cert.pem"
    TLS_KEY="$dir/key.pem"
    add_comparison "Turnstile TLS / NGINX TLS, 1 worker (target)" turnstile-tls-w1 nginx-tls-w1 \
        0.8 1.5
}

section_tls() {
    local tls_port pid
    WRK_CPU=$CPU_LOAD
    tls_port=$(free_port)
    start_nginx nginx-tls-w1 "$BENCH_DIR/nginx-tls.conf.tmpl" "$CPU_PROXY" WORKERS=1 \
        UPSTREAM_PORT="$UPSTREAM_PORT" TLS_PORT="$tls_port" CERT="$TLS_CERT" KEY="$TLS_KEY"
    pid=$LAST_PID
    CURL_CA_BUNDLE=$TLS_CERT run_wrk nginx-tls-w1 "https://127.0.0.1:$tls_port/" "$pid"
    stop_pid "$pid"
    tls_port=$(free_port)
    start_turnstile "$BENCH_DIR/turnstile-tls.yaml.tmpl" 1 "$CPU_PROXY" TLS_PORT="$tls_port" \
        CERT="$TLS_CERT" KEY="$TLS_KEY"
    pid=$LAST_PID
    CURL_CA_BUNDLE=$TLS_CERT run_wrk turnstile-tls-w1 "https://127.0.0.1:$tls_port/" "$pid"
    stop_pid "$pid"
}
