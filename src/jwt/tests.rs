use std::path::Path;

use http::{HeaderMap, HeaderValue};
use jsonwebtoken::{encode, get_current_timestamp, EncodingKey, Header};
use serde_json::json;

use super::config::{compile, OneOrMany, RawJwt};
use super::*;

const SECRET: &str = "0123456789abcdef0123456789abcdef";

fn verifier(raw: RawJwt) -> Verifier {
    compile(&raw, Path::new("policies.yaml")).expect("valid jwt block")
}

/// A verifier whose secret comes from an environment variable private to the test.
fn hs256(var: &str, raw: RawJwt) -> Verifier {
    std::env::set_var(var, SECRET);
    verifier(RawJwt {
        hs256_secret_env: Some(var.into()),
        ..raw
    })
}

fn sign(alg: Algorithm, secret: &str, claims: serde_json::Value) -> String {
    encode(
        &Header::new(alg),
        &claims,
        &EncodingKey::from_secret(secret.as_bytes()),
    )
    .unwrap()
}

fn bearer(value: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(AUTHORIZATION, HeaderValue::from_str(value).unwrap());
    headers
}

fn now() -> u64 {
    get_current_timestamp()
}

#[test]
fn a_valid_token_yields_its_claims_and_every_tampering_is_invalid() {
    let v = hs256("TURNSTILE_TEST_JWT_1", RawJwt::default());
    let token = sign(
        Algorithm::HS256,
        SECRET,
        json!({"sub": "alice", "exp": now() + 600}),
    );
    let claims = v.verify(&bearer(&format!("Bearer {token}"))).unwrap();
    assert_eq!(claims.get("sub"), Some(&b"alice"[..]));
    // The scheme is case-insensitive (RFC 9110 §11.1).
    assert!(v.verify(&bearer(&format!("bearer {token}"))).is_ok());

    let forged = sign(
        Algorithm::HS256,
        "another secret, just as long as ours",
        json!({"sub": "mallory", "exp": now() + 600}),
    );
    let expired = sign(
        Algorithm::HS256,
        SECRET,
        json!({"sub": "alice", "exp": now() - 120}),
    );
    let early = sign(
        Algorithm::HS256,
        SECRET,
        json!({"sub": "alice", "exp": now() + 600, "nbf": now() + 120}),
    );
    let no_exp = sign(Algorithm::HS256, SECRET, json!({"sub": "alice"}));
    // HS384 is not in the default `algorithms`.
    let other_alg = sign(
        Algorithm::HS384,
        SECRET,
        json!({"sub": "alice", "exp": now() + 600}),
    );
    for (name, token) in [
        ("forged", forged),
        ("expired", expired),
        ("nbf in the future", early),
        ("no exp", no_exp),
        ("algorithm not accepted", other_alg),
        ("garbage", "not.a.jwt".to_string()),
    ] {
        assert_eq!(
            v.verify(&bearer(&format!("Bearer {token}"))).unwrap_err(),
            Rejected::Invalid,
            "{name}"
        );
    }
}

#[test]
fn leeway_admits_a_token_that_just_expired() {
    let v = hs256(
        "TURNSTILE_TEST_JWT_2",
        RawJwt {
            leeway: Some("60s".into()),
            ..RawJwt::default()
        },
    );
    let token = sign(
        Algorithm::HS256,
        SECRET,
        json!({"sub": "a", "exp": now() - 10}),
    );
    assert!(v.verify(&bearer(&format!("Bearer {token}"))).is_ok());
}

#[test]
fn credentials_that_are_not_one_bearer_token() {
    let v = hs256("TURNSTILE_TEST_JWT_3", RawJwt::default());
    assert_eq!(v.verify(&HeaderMap::new()), Err(Rejected::Missing));
    assert_eq!(v.verify(&bearer("Basic YTpi")), Err(Rejected::Missing));
    assert_eq!(v.verify(&bearer("Bearer ")), Err(Rejected::Invalid));
    let token = sign(
        Algorithm::HS256,
        SECRET,
        json!({"sub": "a", "exp": now() + 600}),
    );
    let mut two = bearer(&format!("Bearer {token}"));
    two.append(
        AUTHORIZATION,
        HeaderValue::from_str(&format!("Bearer {token}")).unwrap(),
    );
    assert_eq!(v.verify(&two), Err(Rejected::Invalid));
    // A token in any spelling but exactly `Bearer SP token` is present and invalid, never absent:
    // an upstream more lenient about the spelling would still authenticate it.
    let signature_start = token.rfind('.').unwrap() + 1;
    let padded = format!("{token}==");
    let spaced_signature = format!(
        "{} {}",
        &token[..signature_start],
        &token[signature_start..]
    );
    for spelling in [
        format!("Bearer\t{token}"),
        format!("Bearer  {token}"),
        format!("Bearer {token} extra"),
        format!("Bearer {padded}"),
        format!("Bearer {spaced_signature}"),
        format!("BEARER\t{token}"),
        format!("JWT {token}"),
        format!("Token {token}"),
        format!("Bearer,{token}"),
        format!("Bearer{token}"),
    ] {
        assert_eq!(
            v.verify(&bearer(&spelling)),
            Err(Rejected::Invalid),
            "{spelling:?}"
        );
    }
    assert_eq!(
        v.verify(&bearer("Digest username=\"a\", uri=\"/x\"")),
        Err(Rejected::Missing)
    );
    // Over the size bound: refused before any parsing, even if it would verify.
    let padding = "x".repeat(MAX_TOKEN_BYTES);
    let big = sign(
        Algorithm::HS256,
        SECRET,
        json!({"sub": "a", "exp": now() + 600, "pad": padding}),
    );
    assert_eq!(
        v.verify(&bearer(&format!("Bearer {big}"))),
        Err(Rejected::Invalid)
    );
}

#[test]
fn issuer_and_audience_are_required_once_configured() {
    let v = hs256(
        "TURNSTILE_TEST_JWT_4",
        RawJwt {
            issuer: Some(OneOrMany::One("https://idp.example".into())),
            audience: Some(OneOrMany::Many(vec!["api".into(), "web".into()])),
            ..RawJwt::default()
        },
    );
    let exp = now() + 600;
    let ok = sign(
        Algorithm::HS256,
        SECRET,
        json!({"sub": "a", "exp": exp, "iss": "https://idp.example", "aud": "web"}),
    );
    assert!(v.verify(&bearer(&format!("Bearer {ok}"))).is_ok());
    for claims in [
        json!({"sub": "a", "exp": exp, "aud": "web"}),
        json!({"sub": "a", "exp": exp, "iss": "https://evil.example", "aud": "web"}),
        json!({"sub": "a", "exp": exp, "iss": "https://idp.example", "aud": "other"}),
    ] {
        let token = sign(Algorithm::HS256, SECRET, claims.clone());
        assert!(
            v.verify(&bearer(&format!("Bearer {token}"))).is_err(),
            "{claims}"
        );
    }
}

#[test]
fn claims_become_key_material_only_as_strings_and_numbers() {
    let map = serde_json::from_value(json!({
        "sub": "alice", "n": 42, "f": 1.5, "b": true, "o": {"a": 1}, "a": [1], "z": null
    }))
    .unwrap();
    let claims = Claims::from_map(&map, None);
    // Only the claims the policies read are kept.
    let kept = Claims::from_map(&map, Some(&["n".into(), "o".into()]));
    assert_eq!(kept, Claims(Box::new([("n".into(), b"42"[..].into())])));
    let text =
        |name| claim_value(&claims, name).map(|v| String::from_utf8(v.into_owned()).unwrap());
    assert_eq!(text("sub").as_deref(), Some("alice"));
    assert_eq!(text("n").as_deref(), Some("42"));
    assert_eq!(text("f").as_deref(), Some("1.5"));
    for absent in ["b", "o", "a", "z", "missing"] {
        assert_eq!(text(absent), None, "{absent}");
    }
}

#[test]
fn config_errors_name_their_field() {
    let errors = |raw: RawJwt| compile(&raw, Path::new("/nonexistent/policies.yaml")).unwrap_err();
    let fields = |raw: RawJwt| errors(raw).into_iter().map(|(f, _)| f).collect::<Vec<_>>();
    assert_eq!(fields(RawJwt::default()), ["jwt"]);
    let missing = errors(RawJwt {
        jwks_file: Some("jwks.json".into()),
        ..RawJwt::default()
    });
    assert_eq!(missing[0].0, "jwt.jwks_file");
    assert!(
        missing[0].1.contains("/nonexistent/jwks.json"),
        "{}",
        missing[0].1
    );
    std::env::set_var("TURNSTILE_TEST_JWT_SHORT", "short");
    assert_eq!(
        fields(RawJwt {
            hs256_secret_env: Some("TURNSTILE_TEST_JWT_SHORT".into()),
            ..RawJwt::default()
        }),
        ["jwt.hs256_secret_env"]
    );
    std::env::set_var("TURNSTILE_TEST_JWT_5", SECRET);
    assert_eq!(
        fields(RawJwt {
            hs256_secret_env: Some("TURNSTILE_TEST_JWT_5".into()),
            algorithms: Some(vec!["RS256".into(), "none".into()]),
            leeway: Some("1h".into()),
            ..RawJwt::default()
        }),
        ["jwt.leeway", "jwt.algorithms[0]", "jwt.algorithms[1]"]
    );
}

#[test]
fn jwks_files_that_are_refused_at_load() {
    let dir = tempfile::tempdir().unwrap();
    let rsa_n = "AQ".to_string() + &"A".repeat(340); // 256 bytes: 2049 bits
    let point = "A".repeat(43); // 32 bytes
    let cases = [
        ("not json", "{", "is not a JWK Set"),
        ("empty", r#"{"keys": []}"#, "holds no signing keys"),
        (
            "symmetric",
            r#"{"keys": [{"kty": "oct", "k": "c2VjcmV0"}]}"#,
            "keys[0]: a symmetric",
        ),
        (
            "short rsa",
            r#"{"keys": [{"kty": "RSA", "n": "AQAB", "e": "AQAB"}]}"#,
            "keys[0]: an RSA modulus of about 24 bits",
        ),
        (
            "alg of another type",
            &format!(
                r#"{{"keys": [{{"kty": "EC", "crv": "P-256", "alg": "RS256", "x": "{point}", "y": "{point}"}}]}}"#
            ),
            "keys[0]: `alg: RS256` does not fit its key type",
        ),
        (
            "truncated point",
            r#"{"keys": [{"kty": "EC", "crv": "P-256", "x": "AAAA", "y": "AAAA"}]}"#,
            "keys[0]: `x` and `y` must be 32 bytes",
        ),
        (
            "two keys, one kid",
            &format!(
                r#"{{"keys": [{{"kty": "RSA", "kid": "a", "n": "{rsa_n}", "e": "AQAB"}},
                              {{"kty": "EC", "crv": "P-256", "x": "{point}", "y": "{point}"}}]}}"#
            ),
            "keys[1]: has no `kid`",
        ),
    ];
    for (name, text, expected) in cases {
        let path = dir.path().join("jwks.json");
        std::fs::write(&path, text).unwrap();
        let errors = compile(
            &RawJwt {
                jwks_file: Some("jwks.json".into()),
                ..RawJwt::default()
            },
            &dir.path().join("policies.yaml"),
        )
        .err()
        .unwrap_or_else(|| panic!("{name}: loaded"));
        assert_eq!(errors.len(), 1, "{name}: {errors:?}");
        assert_eq!(errors[0].0, "jwt.jwks_file", "{name}");
        assert!(errors[0].1.contains(expected), "{name}: {}", errors[0].1);
    }
    // The valid pair loads, and an encryption key beside them is skipped.
    let valid = format!(
        r#"{{"keys": [{{"kty": "RSA", "kid": "a", "n": "{rsa_n}", "e": "AQAB"}},
                      {{"kty": "RSA", "kid": "enc", "use": "enc", "n": "AQAB", "e": "AQAB"}},
                      {{"kty": "EC", "kid": "b", "crv": "P-256", "x": "{point}", "y": "{point}"}}]}}"#
    );
    std::fs::write(dir.path().join("jwks.json"), valid).unwrap();
    let v = compile(
        &RawJwt {
            jwks_file: Some("jwks.json".into()),
            ..RawJwt::default()
        },
        &dir.path().join("policies.yaml"),
    )
    .unwrap();
    assert_eq!(v.ring().set().jwks.len(), 2);
}

/// The cache answers only for the very bytes that verified, and only while the key that verified
/// them is in force: a rotated secret ends its tokens at once, cached or not.
#[test]
fn a_cached_token_ends_with_its_key_and_a_forgery_never_hits() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret.key");
    std::fs::write(&secret, SECRET).unwrap();
    let v = compile(
        &RawJwt {
            hs256_secret_file: Some("secret.key".into()),
            ..RawJwt::default()
        },
        &dir.path().join("policies.yaml"),
    )
    .unwrap();
    let cache = v.cache.as_ref().expect("on by default");
    let token = sign(
        Algorithm::HS256,
        SECRET,
        json!({"sub": "alice", "exp": now() + 600}),
    );
    for _ in 0..3 {
        assert!(v.verify(&bearer(&format!("Bearer {token}"))).is_ok());
    }
    assert_eq!(cache.len(), 1, "one token, one entry");
    // The same header and payload under another signature: a miss, then a failed check.
    let (signed, signature) = token.rsplit_once('.').unwrap();
    let mut forged_sig = signature.as_bytes().to_vec();
    forged_sig[0] = if forged_sig[0] == b'A' { b'B' } else { b'A' };
    let forged = format!("{signed}.{}", String::from_utf8(forged_sig).unwrap());
    assert_eq!(
        v.verify(&bearer(&format!("Bearer {forged}"))),
        Err(Rejected::Invalid)
    );
    assert_eq!(cache.len(), 1, "a forgery is never kept");

    std::fs::write(&secret, "another secret, just as long as ours").unwrap();
    v.ring().reread(ring::Source::SecretFile, &secret);
    assert_eq!(
        v.verify(&bearer(&format!("Bearer {token}"))),
        Err(Rejected::Invalid),
        "the cached token outlived its key"
    );
    // A bad new file keeps the keys in force.
    let new = sign(
        Algorithm::HS256,
        "another secret, just as long as ours",
        json!({"sub": "bob", "exp": now() + 600}),
    );
    std::fs::write(&secret, "short").unwrap();
    v.ring().reread(ring::Source::SecretFile, &secret);
    assert!(v.verify(&bearer(&format!("Bearer {new}"))).is_ok());
}
