//! The `jwt:` block: from YAML to a [`Verifier`], reading the secret and the JWKS file once per
//! config load or reload (a bad file fails the reload; the old config keeps serving).

use std::path::{Path, PathBuf};
use std::str::FromStr;

use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, JwkSet, PublicKeyUse};
use jsonwebtoken::{Algorithm, AlgorithmFamily, DecodingKey, DecodingKeyKind, Validation};
use serde::Deserialize;

use super::{PublicKey, Verifier};

/// `jwt:` as written in `policies.yaml`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawJwt {
    /// A file holding the HMAC secret (one trailing newline is ignored).
    pub hs256_secret_file: Option<String>,
    /// ...or the environment variable holding it.
    pub hs256_secret_env: Option<String>,
    /// A JSON Web Key Set (RFC 7517 §5) of public keys, picked by the token's `kid`.
    pub jwks_file: Option<String>,
    /// Accepted `iss` values; when set, a token must carry one of them.
    pub issuer: Option<OneOrMany>,
    /// Accepted `aud` values; when set, a token must name one of them.
    pub audience: Option<OneOrMany>,
    /// Clock skew allowed on `exp` and `nbf` (default 30s).
    pub leeway: Option<String>,
    /// Accepted `alg` values (default: HS256 with a secret, RS256 and ES256 with a JWKS).
    pub algorithms: Option<Vec<String>>,
}

/// A string, or a list of them.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    fn values(&self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s.clone()],
            OneOrMany::Many(v) => v.clone(),
        }
    }
}

/// RFC 7518 §3.2: an HMAC key must be at least as long as the hash output.
const MIN_SECRET_BYTES: usize = 32;

/// A longer leeway would let expired tokens keep naming buckets for too long.
const MAX_LEEWAY_S: u64 = 300;

type Errors = Vec<(String, String)>;

/// Validates `raw` and loads its keys; relative file names are relative to the config file's
/// directory (`source`). Errors carry their field path (`jwt.jwks_file`).
pub fn compile(raw: &RawJwt, source: &Path) -> Result<Verifier, Errors> {
    let mut errors = Errors::new();
    let file = |name: &str| -> PathBuf {
        match source.parent() {
            Some(dir) => dir.join(name),
            None => PathBuf::from(name),
        }
    };
    let hmac = match (&raw.hs256_secret_file, &raw.hs256_secret_env) {
        (Some(_), Some(_)) => {
            errors.push((
                "jwt.hs256_secret_env".into(),
                "give either `hs256_secret_file` or `hs256_secret_env`, not both".into(),
            ));
            None
        }
        (Some(name), None) => {
            let path = file(name);
            let secret =
                std::fs::read(&path).map_err(|e| format!("cannot read `{}`: {e}", path.display()));
            secret_key(&mut errors, "jwt.hs256_secret_file", secret)
        }
        (None, Some(var)) => {
            let secret = std::env::var_os(var)
                .map(|v| v.into_encoded_bytes())
                .ok_or_else(|| format!("the environment variable `{var}` is not set"));
            secret_key(&mut errors, "jwt.hs256_secret_env", secret)
        }
        (None, None) => None,
    };
    let jwks = match &raw.jwks_file {
        Some(name) => {
            let path = file(name);
            jwks(&path)
                .map_err(|m| errors.push(("jwt.jwks_file".into(), m)))
                .unwrap_or_default()
        }
        None => Vec::new(),
    };
    let (hmac_set, jwks_set) = (
        raw.hs256_secret_file.is_some() || raw.hs256_secret_env.is_some(),
        raw.jwks_file.is_some(),
    );
    if !hmac_set && !jwks_set {
        errors.push((
            "jwt".into(),
            "needs keys: `hs256_secret_file: FILE` or `hs256_secret_env: NAME` (HMAC), \
             `jwks_file: FILE` (RS256, ES256), or both"
                .into(),
        ));
    }

    let leeway = match raw.leeway.as_deref() {
        None => 30,
        Some(text) => match crate::units::parse_duration(text) {
            Ok(d) if d.as_secs() <= MAX_LEEWAY_S && d.subsec_nanos() == 0 => d.as_secs(),
            Ok(_) => {
                errors.push((
                    "jwt.leeway".into(),
                    format!("must be whole seconds, at most {MAX_LEEWAY_S}s"),
                ));
                0
            }
            Err(e) => {
                errors.push(("jwt.leeway".into(), e));
                0
            }
        },
    };

    let mut algorithms = Vec::new();
    match &raw.algorithms {
        None => {
            if hmac_set {
                algorithms.push(Algorithm::HS256);
            }
            if jwks_set {
                algorithms.extend([Algorithm::RS256, Algorithm::ES256]);
            }
        }
        Some(list) if list.is_empty() => {
            errors.push(("jwt.algorithms".into(), "must list at least one".into()));
        }
        Some(list) => {
            for (i, name) in list.iter().enumerate() {
                let path = format!("jwt.algorithms[{i}]");
                let Ok(alg) = Algorithm::from_str(name) else {
                    errors.push((
                        path,
                        format!(
                            "`{name}` is not a supported algorithm (HS256, HS384, HS512, RS256, \
                             RS384, RS512, PS256, PS384, PS512, ES256, ES384, EdDSA; never `none`)"
                        ),
                    ));
                    continue;
                };
                let hmac_alg = alg.family() == AlgorithmFamily::Hmac;
                if hmac_alg && !hmac_set {
                    errors.push((
                        path,
                        format!("`{name}` needs `hs256_secret_file` or `hs256_secret_env`"),
                    ));
                } else if !hmac_alg && !jwks_set {
                    errors.push((path, format!("`{name}` needs `jwks_file`")));
                } else if !algorithms.contains(&alg) {
                    algorithms.push(alg);
                }
            }
        }
    }

    let issuer = raw.issuer.as_ref().map(OneOrMany::values);
    let audience = raw.audience.as_ref().map(OneOrMany::values);
    for (field, values) in [("issuer", &issuer), ("audience", &audience)] {
        if values
            .as_ref()
            .is_some_and(|v| v.is_empty() || v.iter().any(String::is_empty))
        {
            errors.push((format!("jwt.{field}"), "must not be empty".into()));
        }
    }
    let validations = algorithms
        .iter()
        .map(|&alg| {
            let mut v = Validation::new(alg);
            v.leeway = leeway;
            v.validate_exp = true;
            v.validate_nbf = true;
            let mut required = vec!["exp"];
            match &issuer {
                Some(iss) => {
                    v.set_issuer(iss);
                    required.push("iss");
                }
                None => v.iss = None,
            }
            match &audience {
                Some(aud) => {
                    v.set_audience(aud);
                    required.push("aud");
                }
                // Without `audience`, a token's `aud` is not ours to judge.
                None => v.validate_aud = false,
            }
            v.set_required_spec_claims(&required);
            (alg, v)
        })
        .collect();

    if errors.is_empty() {
        Ok(Verifier {
            hmac,
            jwks,
            validations,
        })
    } else {
        Err(errors)
    }
}

/// The HMAC key, at least [`MIN_SECRET_BYTES`] long once one trailing newline is removed.
fn secret_key(
    errors: &mut Errors,
    path: &str,
    secret: Result<Vec<u8>, String>,
) -> Option<DecodingKey> {
    let mut secret = secret.map_err(|m| errors.push((path.into(), m))).ok()?;
    if secret.ends_with(b"\n") {
        secret.pop();
        if secret.ends_with(b"\r") {
            secret.pop();
        }
    }
    if secret.len() < MIN_SECRET_BYTES {
        errors.push((
            path.into(),
            format!(
                "the secret is {} bytes; HS256 needs at least {MIN_SECRET_BYTES} (RFC 7518 §3.2)",
                secret.len()
            ),
        ));
        return None;
    }
    Some(DecodingKey::from_secret(&secret))
}

/// RFC 7518 §3.3: RSA keys of 2048 bits or more; an EC point of its curve's size (a truncated
/// key would otherwise load and then fail every token).
fn check_size(key: &DecodingKey, algorithms: &[Algorithm]) -> Result<(), String> {
    match key.kind() {
        DecodingKeyKind::RsaModulusExponent { n, .. } => {
            let bits = n.iter().skip_while(|b| **b == 0).count() * 8;
            if bits < 2048 {
                return Err(format!(
                    "an RSA modulus of about {bits} bits; at least 2048 are required (RFC 7518 §3.3)"
                ));
            }
        }
        DecodingKeyKind::SecretOrDer(point) => {
            let expected = if algorithms.contains(&Algorithm::ES256) {
                Some((65, "32 bytes each for P-256"))
            } else if algorithms.contains(&Algorithm::ES384) {
                Some((97, "48 bytes each for P-384"))
            } else {
                None
            };
            if let Some((len, what)) = expected.filter(|(len, _)| point.len() != *len) {
                return Err(format!("`x` and `y` must be {what} (a {len}-byte point)"));
            }
        }
    }
    Ok(())
}

/// The signing keys of a JWKS file. Encryption keys (`use: enc`) are skipped; a symmetric key
/// (`kty: oct`) is refused, since this file is meant to hold public keys only.
fn jwks(path: &Path) -> Result<Vec<PublicKey>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
    let set: JwkSet = serde_json::from_str(&text)
        .map_err(|e| format!("`{}` is not a JWK Set: {e}", path.display()))?;
    let at = |i: usize, m: &str| format!("`{}`: keys[{i}]: {m}", path.display());
    let mut keys = Vec::new();
    for (i, jwk) in set.keys.iter().enumerate() {
        if matches!(jwk.common.public_key_use, Some(PublicKeyUse::Encryption)) {
            continue;
        }
        let by_type: &[Algorithm] =
            match &jwk.algorithm {
                AlgorithmParameters::RSA(_) => AlgorithmFamily::Rsa.algorithms(),
                AlgorithmParameters::EllipticCurve(ec) => match ec.curve {
                    EllipticCurve::P256 => &[Algorithm::ES256],
                    EllipticCurve::P384 => &[Algorithm::ES384],
                    _ => return Err(at(i, "only the P-256 and P-384 curves are supported")),
                },
                AlgorithmParameters::OctetKeyPair(_) => AlgorithmFamily::Ed.algorithms(),
                AlgorithmParameters::OctetKey(_) => return Err(at(
                    i,
                    "a symmetric (`oct`) key: put an HMAC secret in `hs256_secret_file` instead",
                )),
                _ => return Err(at(i, "an unsupported key type")),
            };
        let algorithms = match jwk.common.key_algorithm {
            None => by_type.to_vec(),
            Some(named) => match Algorithm::try_from(named) {
                Ok(alg) if by_type.contains(&alg) => vec![alg],
                _ => return Err(at(i, &format!("`alg: {named}` does not fit its key type"))),
            },
        };
        let key = DecodingKey::from_jwk(jwk).map_err(|e| at(i, &e.to_string()))?;
        check_size(&key, by_type).map_err(|m| at(i, &m))?;
        keys.push(PublicKey {
            kid: jwk.common.key_id.clone(),
            algorithms,
            key,
        });
    }
    if keys.is_empty() {
        return Err(format!("`{}` holds no signing keys", path.display()));
    }
    if keys.len() > 1 {
        let signing = |k: &&jsonwebtoken::jwk::Jwk| {
            !matches!(k.common.public_key_use, Some(PublicKeyUse::Encryption))
        };
        if let Some(i) = set
            .keys
            .iter()
            .position(|k| signing(&k) && k.common.key_id.is_none())
        {
            return Err(at(i, "has no `kid`: with several keys, each needs one"));
        }
    }
    Ok(keys)
}
