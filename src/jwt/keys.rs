//! Key material: a JWK Set parsed into the keys it may verify with ([`parse_jwks`]), the HMAC
//! secret ([`secret_key`]), and the set in force ([`KeySet`]), which [`super::ring`] swaps whole
//! when a source changes. Every key has a fingerprint, so a cached verification can tell whether
//! the key that made it is still in the set ([`super::cache`]).

use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, JwkSet, PublicKeyUse};
use jsonwebtoken::{Algorithm, AlgorithmFamily, DecodingKey, DecodingKeyKind};
use sha2::{Digest, Sha256};

/// RFC 7518 §3.2: an HMAC key must be at least as long as the hash output.
pub const MIN_SECRET_BYTES: usize = 32;

/// A key and what identifies its material.
#[derive(Clone)]
pub(crate) struct Key {
    pub key: DecodingKey,
    /// The first 8 bytes of SHA-256 over the key's kind and material (and its `kid` and
    /// algorithms for a JWKS key): equal for the same key fetched or read twice.
    pub id: u64,
}

/// One JWKS entry: the algorithms it may verify are fixed at load (its `alg`, or its key type's),
/// so an RSA key is never offered a token that claims `HS256` (algorithm confusion).
#[derive(Clone)]
pub(crate) struct PublicKey {
    pub kid: Option<String>,
    pub algorithms: Vec<Algorithm>,
    pub key: Key,
}

/// The keys in force: the HMAC secret, and the public keys of `jwks_file` and `jwks_url`
/// together.
#[derive(Default)]
pub(crate) struct KeySet {
    pub hmac: Option<Key>,
    pub jwks: Vec<PublicKey>,
}

/// What looking a token's key up found.
pub(crate) enum Lookup<'s> {
    Found(&'s Key),
    /// An asymmetric token whose `kid` no key has: perhaps a key the identity provider has just
    /// published.
    UnknownKid,
    /// No key may verify it (no secret, no `kid` with several keys, a key of another type).
    None,
}

impl KeySet {
    /// The key for a token signed with `alg`: the secret for HMAC; else the JWKS key with the
    /// token's `kid` (a token without one may use the only key there is) that may verify `alg`.
    pub fn key_for(&self, alg: Algorithm, kid: Option<&str>) -> Lookup<'_> {
        if alg.family() == AlgorithmFamily::Hmac {
            return self.hmac.as_ref().map_or(Lookup::None, Lookup::Found);
        }
        match kid {
            Some(kid) => {
                let mut named = self.jwks.iter().filter(|k| k.kid.as_deref() == Some(kid));
                let Some(first) = named.next() else {
                    return Lookup::UnknownKid;
                };
                std::iter::once(first)
                    .chain(named)
                    .find(|k| k.algorithms.contains(&alg))
                    .map_or(Lookup::None, |k| Lookup::Found(&k.key))
            }
            None if self.jwks.len() == 1 => self
                .jwks
                .iter()
                .find(|k| k.algorithms.contains(&alg))
                .map_or(Lookup::None, |k| Lookup::Found(&k.key)),
            None => Lookup::None,
        }
    }

    /// Whether the key with fingerprint `id` is still in force.
    pub fn holds(&self, id: u64) -> bool {
        self.hmac.as_ref().is_some_and(|k| k.id == id) || self.jwks.iter().any(|k| k.key.id == id)
    }
}

fn fingerprint(parts: &[&[u8]]) -> u64 {
    let mut hash = Sha256::new();
    for part in parts {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part);
    }
    let digest = hash.finalize();
    u64::from_be_bytes(digest[..8].try_into().unwrap_or_default())
}

/// The HMAC key, at least [`MIN_SECRET_BYTES`] long once one trailing newline is removed.
pub(crate) fn secret_key(mut secret: Vec<u8>) -> Result<Key, String> {
    if secret.ends_with(b"\n") {
        secret.pop();
        if secret.ends_with(b"\r") {
            secret.pop();
        }
    }
    if secret.len() < MIN_SECRET_BYTES {
        return Err(format!(
            "the secret is {} bytes; HS256 needs at least {MIN_SECRET_BYTES} (RFC 7518 §3.2)",
            secret.len()
        ));
    }
    Ok(Key {
        id: fingerprint(&[b"hmac", &secret]),
        key: DecodingKey::from_secret(&secret),
    })
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

fn material_id(kid: Option<&str>, algorithms: &[Algorithm], key: &DecodingKey) -> u64 {
    let algs = format!("{algorithms:?}");
    let kid = kid.unwrap_or_default().as_bytes();
    match key.kind() {
        DecodingKeyKind::RsaModulusExponent { n, e } => {
            fingerprint(&[b"rsa", kid, algs.as_bytes(), n, e])
        }
        DecodingKeyKind::SecretOrDer(der) => fingerprint(&[b"der", kid, algs.as_bytes(), der]),
    }
}

/// How strictly a set is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Strictness {
    /// `jwks_file`, written by the operator: a key Turnstile cannot use is an error.
    Refuse,
    /// `jwks_url`, published by an identity provider for many consumers: a key Turnstile cannot
    /// use (another curve, a symmetric key, no `kid` among several) is skipped.
    Skip,
}

/// The signing keys of a JWK Set (RFC 7517 §5). Encryption keys (`use: enc`) are skipped; a
/// symmetric (`kty: oct`) key is refused or skipped, since a published set holds public keys
/// only. `name` says where the set came from in errors. At least one signing key is required.
pub(crate) fn parse_jwks(
    text: &str,
    name: &str,
    strictness: Strictness,
) -> Result<Vec<PublicKey>, String> {
    let set: JwkSet =
        serde_json::from_str(text).map_err(|e| format!("`{name}` is not a JWK Set: {e}"))?;
    let at = |i: usize, m: &str| format!("`{name}`: keys[{i}]: {m}");
    let signing = |k: &jsonwebtoken::jwk::Jwk| {
        !matches!(k.common.public_key_use, Some(PublicKeyUse::Encryption))
    };
    let several = set.keys.iter().filter(|k| signing(k)).count() > 1;
    let mut keys = Vec::new();
    for (i, jwk) in set.keys.iter().enumerate() {
        if !signing(jwk) {
            continue;
        }
        match public_key(jwk, several) {
            Ok(key) => keys.push(key),
            Err(m) if strictness == Strictness::Refuse => return Err(at(i, &m)),
            Err(m) => tracing::debug!(set = name, key = i, reason = %m, "JWKS key skipped"),
        }
    }
    if keys.is_empty() {
        return Err(format!("`{name}` holds no signing keys Turnstile can use"));
    }
    Ok(keys)
}

fn public_key(jwk: &jsonwebtoken::jwk::Jwk, several: bool) -> Result<PublicKey, String> {
    let by_type: &[Algorithm] = match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => AlgorithmFamily::Rsa.algorithms(),
        AlgorithmParameters::EllipticCurve(ec) => match ec.curve {
            EllipticCurve::P256 => &[Algorithm::ES256],
            EllipticCurve::P384 => &[Algorithm::ES384],
            _ => return Err("only the P-256 and P-384 curves are supported".into()),
        },
        AlgorithmParameters::OctetKeyPair(_) => AlgorithmFamily::Ed.algorithms(),
        AlgorithmParameters::OctetKey(_) => {
            return Err(
                "a symmetric (`oct`) key: put an HMAC secret in `hs256_secret_file` instead".into(),
            )
        }
        _ => return Err("an unsupported key type".into()),
    };
    let algorithms = match jwk.common.key_algorithm {
        None => by_type.to_vec(),
        Some(named) => match Algorithm::try_from(named) {
            Ok(alg) if by_type.contains(&alg) => vec![alg],
            _ => return Err(format!("`alg: {named}` does not fit its key type")),
        },
    };
    if several && jwk.common.key_id.is_none() {
        return Err("has no `kid`: with several keys, each needs one".into());
    }
    let key = DecodingKey::from_jwk(jwk).map_err(|e| e.to_string())?;
    check_size(&key, by_type)?;
    let kid = jwk.common.key_id.clone();
    Ok(PublicKey {
        key: Key {
            id: material_id(kid.as_deref(), &algorithms, &key),
            key,
        },
        kid,
        algorithms,
    })
}
