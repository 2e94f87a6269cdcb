//! `jwt:CLAIM` key parts and `require_jwt` (issue 13): tokens signed in the test, HS256 with a
//! secret file, RS256 and ES256 with keys made by `openssl` and a JWKS file written by the test.
//! A claim names a counter only once its token is verified: a forged, expired or not-yet-valid
//! token gets no bucket of its own.

use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use jsonwebtoken::{encode, get_current_timestamp, Algorithm, EncodingKey, Header};
use serde_json::json;

use crate::support::tools::run_ok;
use crate::support::{Client, TestGateway};

/// 32 bytes, as RFC 7518 §3.2 asks of an HS256 key; the file ends with a newline.
const SECRET: &str = "turnstile-test-secret-0123456789";
const OTHER_SECRET: &str = "not-the-gateway-secret-987654321";

/// Refill is one token an hour, so none comes back during a test: counts are exact.
const HS256_YAML: &str = r#"
jwt:
  hs256_secret_file: secret.key
  leeway: 5s
routes:
  - name: api
    respond: { status: 200, body: ok }
    policies:
      - { name: per_user, key: [jwt:sub], token_bucket: { rate: 1/h, burst: 3 } }
      - { name: per_tenant, key: [jwt:tenant], token_bucket: { rate: 1/h, burst: 1000 } }
      - { name: per_ip, key: [client_ip], token_bucket: { rate: 1/h, burst: 100 } }
"#;

fn now() -> u64 {
    get_current_timestamp()
}

fn hs256(secret: &str, claims: serde_json::Value) -> String {
    encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(secret.as_bytes()),
    )
    .expect("sign")
}

fn bearer(token: &str) -> Vec<(&'static str, String)> {
    vec![("authorization", format!("Bearer {token}"))]
}

async fn get(gw: &TestGateway, headers: &[(&'static str, String)]) -> crate::support::Reply {
    let headers: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
    Client::new().get_with(&gw.url("/"), &headers).await
}

async fn decisions(gw: &TestGateway, policy: &str, decision: &str) -> f64 {
    gw.metric(
        "turnstile_decisions_total",
        &[("route", "api"), ("policy", policy), ("decision", decision)],
    )
    .await
}

#[tokio::test]
async fn verified_subjects_get_exact_buckets_and_tokens_that_do_not_verify_get_401() {
    let gw = TestGateway::with_files(HS256_YAML, &[("secret.key", &format!("{SECRET}\n"))]).await;
    let exp = now() + 600;
    let alice = hs256(SECRET, json!({"sub": "alice", "tenant": 7, "exp": exp}));
    let bob = hs256(SECRET, json!({"sub": "bob", "tenant": 7, "exp": exp}));
    for token in [&alice, &bob] {
        for remaining in ["2", "1", "0"] {
            let reply = get(&gw, &bearer(token)).await;
            assert_eq!(reply.status, 200);
            assert_eq!(reply.header("x-ratelimit-limit"), Some("3"));
            assert_eq!(reply.header("x-ratelimit-remaining"), Some(remaining));
        }
        let reply = get(&gw, &bearer(token)).await;
        assert_eq!(reply.status, 429);
        assert_eq!(reply.json()["policy"], "per_user");
    }

    // A wrong signature, an expired token (past the 5 s leeway), one not valid yet, one with no
    // expiry, one too large to be read, and valid tokens spelt as a lenient upstream would still
    // read them: each is refused with 401 `invalid_token` (Envoy jwt_authn's `allow_missing`),
    // never treated as absent, which would let it escape `per_user`.
    let forged = hs256(OTHER_SECRET, json!({"sub": "mallory", "exp": exp}));
    let expired = hs256(SECRET, json!({"sub": "eve", "exp": now() - 60}));
    let early = hs256(
        SECRET,
        json!({"sub": "trudy", "exp": exp, "nbf": now() + 300}),
    );
    let eternal = hs256(SECRET, json!({"sub": "oscar"}));
    // `alice` again with a forged signature: the real alice is out of tokens, the forgery does
    // not reach her bucket either.
    let forged_alice = hs256(OTHER_SECRET, json!({"sub": "alice", "exp": exp}));
    let huge = hs256(
        SECRET,
        json!({"sub": "big", "exp": exp, "pad": "x".repeat(9000)}),
    );
    let mut invalid: Vec<Vec<(&str, String)>> =
        [&forged, &expired, &early, &eternal, &forged_alice]
            .into_iter()
            .chain([&huge])
            .map(|t| bearer(t))
            .collect();
    for spelling in [
        format!("Bearer\t{alice}"),
        format!("Bearer  {alice}"),
        format!("Bearer {alice}=="),
        format!("JWT {alice}"),
        format!("Token {alice}"),
    ] {
        invalid.push(vec![("authorization", spelling)]);
    }
    for headers in &invalid {
        let reply = get(&gw, headers).await;
        assert_eq!(reply.status, 401, "{headers:?}");
        assert_eq!(
            reply.header("www-authenticate"),
            Some("Bearer error=\"invalid_token\""),
            "{headers:?}"
        );
    }
    // No credentials, or credentials of another scheme that hold no token: the `jwt:` parts are
    // absent and only the per-IP policy applies.
    for headers in [vec![], vec![("authorization", "Basic YTpi".to_string())]] {
        let reply = get(&gw, &headers).await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("x-ratelimit-limit"), Some("100"));
    }

    assert_eq!(decisions(&gw, "per_user", "allowed").await, 6.0);
    assert_eq!(decisions(&gw, "per_user", "limited").await, 2.0);
    // The numeric `tenant` claim named one counter for both users' eight requests.
    assert_eq!(decisions(&gw, "per_tenant", "allowed").await, 8.0);
    assert_eq!(decisions(&gw, "per_ip", "allowed").await, 10.0);
}

/// Key files are watched as the config is: a rotated secret applies without a reload, and a
/// reload whose key file is gone fails and keeps the keys that are running.
#[tokio::test]
async fn a_rotated_secret_file_applies_and_old_tokens_stop_naming_buckets() {
    let gw = TestGateway::with_files(HS256_YAML, &[("secret.key", SECRET)]).await;
    let exp = now() + 600;
    let old = hs256(SECRET, json!({"sub": "carol", "exp": exp}));
    let reply = get(&gw, &bearer(&old)).await;
    assert_eq!(reply.header("x-ratelimit-limit"), Some("3"));
    assert_eq!(reply.header("x-ratelimit-remaining"), Some("2"));

    let dir = gw.config_path.parent().expect("config dir");
    std::fs::write(dir.join("secret.key"), OTHER_SECRET).expect("rotate secret");
    // Polled with another subject's token: carol's bucket is not touched until the check.
    let probe = hs256(SECRET, json!({"sub": "probe", "exp": exp}));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while get(&gw, &bearer(&probe)).await.status != 401 {
        assert!(
            std::time::Instant::now() < deadline,
            "the rotated secret did not apply"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(
        get(&gw, &bearer(&old)).await.status,
        401,
        "no longer verifies"
    );
    let new = hs256(OTHER_SECRET, json!({"sub": "carol", "exp": exp}));
    let reply = get(&gw, &bearer(&new)).await;
    assert_eq!(
        reply.header("x-ratelimit-remaining"),
        Some("1"),
        "carol's second token: refused tokens took none"
    );

    // A reload whose key file is gone fails and keeps the running keys.
    std::fs::remove_file(dir.join("secret.key")).expect("remove secret");
    let errors = gw
        .reload_with(HS256_YAML)
        .await
        .expect_err("missing key file");
    assert!(
        errors.to_string().contains("jwt.hs256_secret_file"),
        "{errors}"
    );
    let reply = get(&gw, &bearer(&new)).await;
    assert_eq!(
        reply.header("x-ratelimit-remaining"),
        Some("0"),
        "still verified"
    );
}

#[tokio::test]
async fn require_jwt_answers_401_with_a_bearer_challenge() {
    let yaml = r#"
jwt:
  hs256_secret_file: secret.key
routes:
  - name: api
    respond: { status: 200, body: ok }
    require_jwt: true
    exempt: { headers: { x-internal: "yes" } }
    policies:
      - { name: per_user, key: [jwt:sub], token_bucket: { rate: 1/h, burst: 2 } }
"#;
    let gw = TestGateway::with_files(yaml, &[("secret.key", SECRET)]).await;
    // An exemption lifts limits, not authentication.
    let internal = [("x-internal", "yes".to_string())];
    assert_eq!(get(&gw, &internal).await.status, 401);
    // RFC 6750 §3.1: no credentials, no error code.
    let none = get(&gw, &[]).await;
    assert_eq!(none.status, 401);
    assert_eq!(none.header("www-authenticate"), Some("Bearer"));
    let exp = now() + 600;
    for token in [
        hs256(OTHER_SECRET, json!({"sub": "mallory", "exp": exp})),
        hs256(SECRET, json!({"sub": "eve", "exp": now() - 60})),
        hs256(
            SECRET,
            json!({"sub": "trudy", "exp": exp, "nbf": now() + 300}),
        ),
    ] {
        let reply = get(&gw, &bearer(&token)).await;
        assert_eq!(reply.status, 401);
        assert_eq!(
            reply.header("www-authenticate"),
            Some(r#"Bearer error="invalid_token""#)
        );
        assert_eq!(reply.json()["error"], "invalid_token");
    }
    let valid = hs256(SECRET, json!({"sub": "alice", "exp": exp}));
    let statuses = [
        get(&gw, &bearer(&valid)).await.status,
        get(&gw, &bearer(&valid)).await.status,
        get(&gw, &bearer(&valid)).await.status,
    ];
    assert_eq!(statuses, [200, 200, 429]);
    let mut exempt = bearer(&valid);
    exempt.extend(internal);
    let reply = get(&gw, &exempt).await;
    assert_eq!(reply.status, 200, "verified and exempt");
    assert_eq!(reply.header("x-ratelimit-limit"), None);
    assert_eq!(decisions(&gw, "per_user", "allowed").await, 2.0);
    assert_eq!(decisions(&gw, "per_user", "limited").await, 1.0);
}

/// Keys made by openssl: two RSA keys (one in the JWKS, one an attacker's) and a P-256 key.
struct Keys {
    _dir: tempfile::TempDir,
    rsa: Vec<u8>,
    rsa_public: Vec<u8>,
    attacker_rsa: Vec<u8>,
    ec: Vec<u8>,
    jwks: String,
}

fn openssl(args: &[&str]) -> String {
    run_ok("openssl", args, "apt-get install openssl")
}

fn keys() -> &'static Keys {
    static KEYS: OnceLock<Keys> = OnceLock::new();
    KEYS.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = |name: &str| dir.path().join(name).to_string_lossy().into_owned();
        for (name, option) in [
            ("rsa.pem", "rsa_keygen_bits:2048"),
            ("attacker.pem", "rsa_keygen_bits:2048"),
        ] {
            openssl(&[
                "genpkey",
                "-algorithm",
                "RSA",
                "-pkeyopt",
                option,
                "-out",
                &path(name),
            ]);
        }
        openssl(&[
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-out",
            &path("ec.pem"),
        ]);
        openssl(&[
            "pkey",
            "-in",
            &path("rsa.pem"),
            "-pubout",
            "-out",
            &path("rsa.pub"),
        ]);
        // `Modulus=HEX`; genpkey's public exponent is 65537 (`AQAB`), checked below.
        let modulus = openssl(&["rsa", "-in", &path("rsa.pem"), "-noout", "-modulus"]);
        let modulus = hex(modulus.trim().trim_start_matches("Modulus="));
        let text = openssl(&["pkey", "-in", &path("rsa.pem"), "-noout", "-text"]);
        assert!(text.contains("publicExponent: 65537"), "{text}");
        // A P-256 SubjectPublicKeyInfo ends with the point 04 || x || y.
        let spki = Command::new("openssl")
            .args(["pkey", "-in", &path("ec.pem"), "-pubout", "-outform", "DER"])
            .output()
            .expect("openssl")
            .stdout;
        assert_eq!(spki[spki.len() - 65], 4, "uncompressed point");
        let point = &spki[spki.len() - 64..];
        let jwks = json!({"keys": [
            {"kty": "RSA", "kid": "rsa-1", "use": "sig", "alg": "RS256",
             "n": URL_SAFE_NO_PAD.encode(&modulus), "e": "AQAB"},
            {"kty": "EC", "kid": "ec-1", "crv": "P-256",
             "x": URL_SAFE_NO_PAD.encode(&point[..32]), "y": URL_SAFE_NO_PAD.encode(&point[32..])},
        ]});
        let read = |name: &str| std::fs::read(dir.path().join(name)).expect("read key");
        Keys {
            rsa: read("rsa.pem"),
            rsa_public: read("rsa.pub"),
            attacker_rsa: read("attacker.pem"),
            ec: read("ec.pem"),
            jwks: jwks.to_string(),
            _dir: dir,
        }
    })
}

fn hex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).expect("hex"))
        .collect()
}

fn signed(alg: Algorithm, kid: Option<&str>, key: &EncodingKey, sub: &str, exp: u64) -> String {
    let mut header = Header::new(alg);
    header.kid = kid.map(str::to_string);
    encode(&header, &json!({"sub": sub, "exp": exp}), key).expect("sign")
}

#[tokio::test]
async fn rs256_and_es256_tokens_are_verified_with_the_jwks_by_kid() {
    let keys = keys();
    let yaml = r#"
jwt:
  jwks_file: keys/jwks.json
routes:
  - name: api
    respond: { status: 200, body: ok }
    policies:
      - { name: per_user, key: [jwt:sub], token_bucket: { rate: 1/h, burst: 2 } }
"#;
    let gw = TestGateway::with_files(yaml, &[("keys/jwks.json", &keys.jwks)]).await;
    let exp = now() + 600;
    let rsa = EncodingKey::from_rsa_pem(&keys.rsa).expect("rsa key");
    let ec = EncodingKey::from_ec_pem(&keys.ec).expect("ec key");
    let dave = signed(Algorithm::RS256, Some("rsa-1"), &rsa, "dave", exp);
    let erin = signed(Algorithm::ES256, Some("ec-1"), &ec, "erin", exp);
    for token in [&dave, &erin] {
        let statuses = [
            get(&gw, &bearer(token)).await.status,
            get(&gw, &bearer(token)).await.status,
            get(&gw, &bearer(token)).await.status,
        ];
        assert_eq!(statuses, [200, 200, 429]);
    }

    let attacker = EncodingKey::from_rsa_pem(&keys.attacker_rsa).expect("attacker key");
    let forgeries = [
        // Someone else's RSA key under our kid.
        signed(Algorithm::RS256, Some("rsa-1"), &attacker, "mallory", exp),
        // Algorithm confusion: HS256 with the public key as the HMAC secret.
        signed(
            Algorithm::HS256,
            Some("rsa-1"),
            &EncodingKey::from_secret(&keys.rsa_public),
            "mallory",
            exp,
        ),
        // Our EC key, but a kid that names the RSA key, and a kid that names nothing.
        signed(Algorithm::ES256, Some("rsa-1"), &ec, "mallory", exp),
        signed(Algorithm::ES256, Some("nope"), &ec, "mallory", exp),
        // No kid with two keys in the set: ambiguous.
        signed(Algorithm::RS256, None, &rsa, "mallory", exp),
        // Expired, and not valid yet.
        signed(Algorithm::RS256, Some("rsa-1"), &rsa, "eve", now() - 60),
    ];
    for token in &forgeries {
        let reply = get(&gw, &bearer(token)).await;
        assert_eq!(reply.status, 401, "no bucket: {token}");
        assert_eq!(reply.header("x-ratelimit-limit"), None, "{token}");
    }
    let mut header = Header::new(Algorithm::ES256);
    header.kid = Some("ec-1".into());
    let early = encode(
        &header,
        &json!({"sub": "trudy", "exp": exp, "nbf": now() + 300}),
        &ec,
    )
    .expect("sign");
    assert_eq!(get(&gw, &bearer(&early)).await.status, 401);

    assert_eq!(decisions(&gw, "per_user", "allowed").await, 4.0);
    assert_eq!(decisions(&gw, "per_user", "limited").await, 2.0);
}

/// Forward-auth decides with the gateway's own admission, so `jwt:` keys work there unchanged.
#[tokio::test]
async fn forward_auth_keys_on_verified_claims_too() {
    let yaml = r#"
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
forward_auth:
  listen: 127.0.0.1:0
  grpc_listen: 127.0.0.1:0
jwt:
  hs256_secret_file: secret.key
routes:
  - name: api
    match: { prefix: /api }
    policies:
      - { name: per_user, key: [jwt:sub], token_bucket: { rate: 1/h, burst: 2 } }
  - name: private
    match: { prefix: /private }
    require_jwt: true
"#;
    let gw = TestGateway::with_files(yaml, &[("secret.key", SECRET)]).await;
    let check = gw.running().forward_auth_addr.expect("forward_auth.listen");
    let call = |token: String, uri: &'static str| async move {
        let auth = format!("Bearer {token}");
        Client::new()
            .get_with(
                &format!("http://{check}/check"),
                &[("x-forwarded-uri", uri), ("authorization", &auth)],
            )
            .await
    };
    let exp = now() + 600;
    let alice = hs256(SECRET, json!({"sub": "alice", "exp": exp}));
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(call(alice.clone(), "/api/x").await.status);
    }
    assert_eq!(statuses, [200, 200, 429]);
    let forged = hs256(OTHER_SECRET, json!({"sub": "mallory", "exp": exp}));
    let reply = call(forged.clone(), "/api/x").await;
    assert_eq!(reply.status, 401, "no bucket for a forgery");
    assert_eq!(reply.header("x-ratelimit-limit"), None);
    let private = call(forged, "/private").await;
    assert_eq!(private.status, 401);
    assert_eq!(
        private.header("www-authenticate"),
        Some(r#"Bearer error="invalid_token""#)
    );
    assert_eq!(call(alice.clone(), "/private").await.status, 200);
    // The forgery on `/api/x` and on `/private`.
    let labels = [("door", "forward_auth"), ("result", "unauthorized")];
    assert_eq!(gw.metric("turnstile_door_checks_total", &labels).await, 2.0);

    // Envoy ext_authz: UNAUTHENTICATED with the same 401, then OK for a valid token.
    let grpc = gw
        .running()
        .ext_authz_addr
        .expect("forward_auth.grpc_listen");
    let forged = hs256(OTHER_SECRET, json!({"sub": "mallory", "exp": exp}));
    let denied = ext_authz(grpc, "/private", &forged).await;
    assert_eq!(denied.status.as_ref().map(|s| s.code), Some(16));
    let Some(HttpResponse::DeniedResponse(denied)) = denied.http_response else {
        panic!("a denied_response: {denied:?}");
    };
    assert_eq!(denied.status.map(|s| s.code), Some(401));
    let challenge = denied
        .headers
        .iter()
        .filter_map(|h| h.header.as_ref())
        .find(|h| h.key == "www-authenticate")
        .map(|h| h.value.as_str());
    assert_eq!(challenge, Some(r#"Bearer error="invalid_token""#));
    let ok = ext_authz(grpc, "/private", &alice).await;
    assert_eq!(ok.status.as_ref().map(|s| s.code), Some(0));
    let labels = [("door", "ext_authz"), ("result", "unauthorized")];
    assert_eq!(gw.metric("turnstile_door_checks_total", &labels).await, 1.0);
}

use envoy_types::pb::envoy::service::auth::v3::check_response::HttpResponse;

/// One ext_authz `Check` of `GET path` with `Authorization: Bearer token`.
async fn ext_authz(
    grpc: std::net::SocketAddr,
    path: &str,
    token: &str,
) -> envoy_types::pb::envoy::service::auth::v3::CheckResponse {
    let auth = format!("Bearer {token}");
    crate::support::ext_authz::check(grpc, path, &[("authorization", &auth)]).await
}

/// Config errors name FILE:LINE:COL and the field.
#[test]
fn config_errors_name_the_file_line_and_field() {
    let path = Path::new("/nonexistent/policies.yaml");
    let missing_file = "\
jwt:
  hs256_secret_file: missing.key
routes:
  - name: api
    respond: { status: 200 }
";
    let errors = turnstile::config::parse(missing_file, path)
        .expect_err("missing key file")
        .to_string();
    assert!(
        errors.starts_with(
            "/nonexistent/policies.yaml:2:22: jwt.hs256_secret_file: cannot read \
             `/nonexistent/missing.key`"
        ),
        "{errors}"
    );

    let no_block = "\
routes:
  - name: api
    respond: { status: 200 }
    require_jwt: true
    policies:
      - name: per_user
        key: [client_ip, jwt:sub]
        token_bucket: { rate: 1/s, burst: 1 }
";
    let errors = turnstile::config::parse(no_block, path)
        .expect_err("jwt key without a jwt block")
        .to_string();
    let lines: Vec<&str> = errors.lines().collect();
    assert_eq!(lines.len(), 2, "{errors}");
    assert!(
        lines[0].starts_with("/nonexistent/policies.yaml:7:26: routes[0].policies[0].key[1]: `jwt:sub`: needs a top-level `jwt:` block"),
        "{errors}"
    );
    assert!(
        lines[1].starts_with("/nonexistent/policies.yaml:4:18: routes[0].require_jwt: needs a top-level `jwt:` block"),
        "{errors}"
    );
}
