# bench/run.sh section "jwt". Sourced by run.sh.
#
# jwt: what the cache of verified tokens saves on RS256-keyed requests. Two Turnstiles on the
# in-process store, one worker each, placed like the memory section's 1-worker row, measured in
# alternating slices (`run_pair`, so both see the same machine), every request carrying the same
# RS256 bearer token (2048-bit key, made here with openssl) that a `jwt:sub` policy reads:
#   turnstile-jwt-nocache-w1   bench/turnstile-jwt.yaml.tmpl with `token_cache: 0`: every request
#                              verifies the signature
#   turnstile-jwt-cache-w1     the same with `token_cache: 10000`: the first request verifies,
#                              the rest are cache hits (the repeated-token case: one client's
#                              token, reused until it expires)
# Printed as a ratio (no target): cache / no cache, throughput and p99.

section_jwt_setup() {
    add_comparison "Turnstile RS256 jwt:sub, token cache on / off, 1 worker" \
        turnstile-jwt-cache-w1 turnstile-jwt-nocache-w1 - -
    JWT_DIR="$WORK/jwt"
    mkdir -p "$JWT_DIR"
    openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$JWT_DIR/key.pem" 2>/dev/null
    # The JWK Set of the key, and a token signed with it (an hour's `exp`), by openssl's own RSA.
    JWT_TOKEN=$(python3 - "$JWT_DIR" <<'PY'
import base64, json, subprocess, sys, time
d = sys.argv[1]
b64 = lambda b: base64.urlsafe_b64encode(b).rstrip(b"=").decode()
hexn = subprocess.run(["openssl", "rsa", "-in", f"{d}/key.pem", "-noout", "-modulus"],
                      capture_output=True, text=True, check=True).stdout.strip().split("=", 1)[1]
jwk = {"kty": "RSA", "kid": "bench", "alg": "RS256", "use": "sig",
       "n": b64(bytes.fromhex(hexn)), "e": "AQAB"}
json.dump({"keys": [jwk]}, open(f"{d}/jwks.json", "w"))
head = b64(json.dumps({"alg": "RS256", "typ": "JWT", "kid": "bench"}).encode())
body = b64(json.dumps({"sub": "bench-user", "exp": int(time.time()) + 3600}).encode())
signing = f"{head}.{body}".encode()
sig = subprocess.run(["openssl", "dgst", "-sha256", "-sign", f"{d}/key.pem"], input=signing,
                     capture_output=True, check=True).stdout
print(f"{head}.{body}.{b64(sig)}")
PY
)
}

section_jwt() {
    local cpu=$CPU_PROXY
    WRK_CPU=$CPU_LOAD
    # One template name per row: start_turnstile names each server's directory after its template,
    # and a second config written into the first's directory would reload it (the file watch).
    cp "$BENCH_DIR/turnstile-jwt.yaml.tmpl" "$JWT_DIR/jwt-nocache.yaml.tmpl"
    cp "$BENCH_DIR/turnstile-jwt.yaml.tmpl" "$JWT_DIR/jwt-cache.yaml.tmpl"
    start_turnstile "$JWT_DIR/jwt-nocache.yaml.tmpl" 1 "$cpu" JWKS="$JWT_DIR/jwks.json" CACHE=0
    local off=("turnstile-jwt-nocache-w1" "http://127.0.0.1:$LAST_PORT/" "$LAST_PID")
    local off_admin=$TURNSTILE_ADMIN_PORT
    start_turnstile "$JWT_DIR/jwt-cache.yaml.tmpl" 1 "$cpu" JWKS="$JWT_DIR/jwks.json" CACHE=10000
    local on=("turnstile-jwt-cache-w1" "http://127.0.0.1:$LAST_PORT/" "$LAST_PID")
    local on_admin=$TURNSTILE_ADMIN_PORT
    # A token that does not verify would be a 401 and make the rows INVALID (non-2xx).
    local code
    code=$(curl -s -o /dev/null -w '%{http_code}' -H "authorization: Bearer $JWT_TOKEN" "${on[1]}")
    [[ "$code" == 200 ]] || { echo "error: the bench token answered $code" >&2; return 1; }
    WRK_ARGS=(-H "authorization: Bearer $JWT_TOKEN")
    if (( ROUND % 2 )); then run_pair "${off[@]}" "${on[@]}"; else run_pair "${on[@]}" "${off[@]}"; fi
    WRK_ARGS=()
    # Each row's verified tokens and cache hits: the no-cache row must show no hits, the cache row
    # one verification (the first request) and the rest hits.
    local port
    for port in "$off_admin" "$on_admin"; do
        curl -s "http://127.0.0.1:$port/metrics" | awk '/^turnstile_jwt_tokens_total\{result="valid",route="bench"\}/ {v=$2}
            /^turnstile_jwt_token_cache_total\{result="hit"\}/ {h=$2}
            END {printf "  jwt: %s valid tokens, %s cache hits\n", v, h}'
    done
    stop_pid "${on[2]}"
    stop_pid "${off[2]}"
}
