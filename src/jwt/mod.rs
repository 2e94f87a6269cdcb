//! Verified JWT claims as key material: the `jwt:CLAIM` key parts (`docs/jwt.md`).
//!
//! A claim names a counter only after its token's signature, algorithm, expiry and not-before
//! time (and issuer and audience, when configured) have been checked: an unverified claim would
//! let anyone mint a fresh bucket per request. The keys are loaded once per config load
//! ([`config::compile`]); a request costs one signature check, made once by
//! [`crate::admission::admit`] however many policies read claims.

pub mod config;

use std::borrow::Cow;
use std::fmt;

use http::header::AUTHORIZATION;
use http::HeaderMap;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde_json::Value;

pub use config::RawJwt;

/// Longer bearer tokens are refused unread: the signature check and the JSON parse of a token
/// cost in proportion to its size, and every identity provider's tokens fit well within this.
pub const MAX_TOKEN_BYTES: usize = 8 * 1024;

/// The payload of a verified token.
pub type Claims = serde_json::Map<String, Value>;

/// Why a request has no verified claims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejected {
    /// No `Authorization: Bearer` credentials at all (RFC 6750 §3.1: the 401 then carries no
    /// error code).
    Missing,
    /// A token that is not one we accept: malformed, over [`MAX_TOKEN_BYTES`], signed with an
    /// algorithm or key we do not hold, a wrong signature, expired, not yet valid, or the wrong
    /// issuer or audience.
    Invalid,
}

/// The verification keys and rules of the `jwt:` block, built once per config load.
pub struct Verifier {
    /// The HMAC secret (`hs256_secret_file` or `hs256_secret_env`).
    hmac: Option<DecodingKey>,
    /// The public keys of `jwks_file`.
    jwks: Vec<PublicKey>,
    /// One validation per accepted algorithm, so a request allocates none.
    validations: Vec<(Algorithm, Validation)>,
}

/// One JWKS entry: the algorithms it may verify are fixed at load (its `alg`, or its key type's),
/// so an RSA key is never offered a token that claims `HS256` (algorithm confusion).
struct PublicKey {
    kid: Option<String>,
    algorithms: Vec<Algorithm>,
    key: DecodingKey,
}

impl fmt::Debug for Verifier {
    /// Key material stays out of logs and `/config`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Verifier")
            .field("hmac", &self.hmac.is_some())
            .field(
                "jwks_kids",
                &self
                    .jwks
                    .iter()
                    .map(|k| k.kid.as_deref())
                    .collect::<Vec<_>>(),
            )
            .field(
                "algorithms",
                &self.validations.iter().map(|(a, _)| a).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Verifier {
    /// The claims of the request's bearer token, once its signature and time and audience checks
    /// pass.
    pub fn verify(&self, headers: &HeaderMap) -> Result<Claims, Rejected> {
        let token = bearer_token(headers)?;
        if token.len() > MAX_TOKEN_BYTES {
            return Err(Rejected::Invalid);
        }
        let header = jsonwebtoken::decode_header(token).map_err(|_| Rejected::Invalid)?;
        let validation = self
            .validations
            .iter()
            .find_map(|(alg, v)| (*alg == header.alg).then_some(v))
            .ok_or(Rejected::Invalid)?;
        let key = self
            .key_for(header.alg, header.kid.as_deref())
            .ok_or(Rejected::Invalid)?;
        jsonwebtoken::decode::<Claims>(token, key, validation)
            .map(|data| data.claims)
            .map_err(|e| {
                tracing::debug!(error = %e, "bearer token rejected");
                Rejected::Invalid
            })
    }

    /// The key for a token signed with `alg`: the secret for HMAC; else the JWKS key with the
    /// token's `kid` (a token without one may use the only key there is) that may verify `alg`.
    fn key_for(&self, alg: Algorithm, kid: Option<&str>) -> Option<&DecodingKey> {
        if matches!(alg, Algorithm::HS256 | Algorithm::HS384 | Algorithm::HS512) {
            return self.hmac.as_ref();
        }
        let candidates = self.jwks.iter().filter(|k| k.algorithms.contains(&alg));
        match kid {
            Some(kid) => candidates
                .filter(|k| k.kid.as_deref() == Some(kid))
                .map(|k| &k.key)
                .next(),
            None if self.jwks.len() == 1 => candidates.map(|k| &k.key).next(),
            None => None,
        }
    }
}

/// The token of `Authorization: Bearer TOKEN` (RFC 6750 §2.1: the scheme, case-insensitive as
/// RFC 9110 §11.1 says, one space, then the token alone).
///
/// Credentials are `Missing` only when there are none a JWT could be read from: no
/// `Authorization` field, or another scheme (`Basic`, `Digest`, ...) whose credentials hold
/// nothing shaped like a JWT. Everything else that is not exactly the form above is `Invalid`,
/// never absent: a bearer scheme spelt with a tab, two spaces or a trailing field, a token after
/// another scheme (`JWT eyJ...`, `Token eyJ...`), two `Authorization` fields. An upstream more
/// lenient about the spelling would still authenticate such a token.
fn bearer_token(headers: &HeaderMap) -> Result<&[u8], Rejected> {
    let mut values = headers.get_all(AUTHORIZATION).iter();
    let value = values.next().ok_or(Rejected::Missing)?;
    if values.next().is_some() {
        return Err(Rejected::Invalid);
    }
    let bytes = value.as_bytes().trim_ascii();
    let scheme_len = bytes
        .iter()
        .position(|b| !b.is_ascii_alphanumeric() && !b"-._~+/".contains(b))
        .unwrap_or(bytes.len());
    let (scheme, rest) = bytes.split_at(scheme_len);
    if scheme.eq_ignore_ascii_case(b"bearer") {
        return match rest.strip_prefix(b" ") {
            Some(token) if token_chars(token) => Ok(token),
            _ => Err(Rejected::Invalid),
        };
    }
    if looks_like_jwt(bytes) {
        Err(Rejected::Invalid)
    } else {
        Err(Rejected::Missing)
    }
}

/// RFC 6750 §2.1's `b64token`: `A-Z a-z 0-9 - . _ ~ + /`, then only `=` padding.
fn token_chars(token: &[u8]) -> bool {
    let body_len = token.len() - token.iter().rev().take_while(|&&b| b == b'=').count();
    body_len > 0
        && token[..body_len]
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || b"-._~+/".contains(b))
}

/// Whether any run of token characters in `value` has the shape of a compact JWS: three or more
/// parts joined by dots.
fn looks_like_jwt(value: &[u8]) -> bool {
    value
        .split(|b| !(b.is_ascii_alphanumeric() || b"-._~+/=".contains(b)))
        .any(|word| word.iter().filter(|&&b| b == b'.').count() >= 2 && word.len() > 8)
}

/// The key material of claim `name`: a string as itself, a number as its decimal text. A missing
/// claim, `null`, a boolean, an object or an array is absent (the policy does not apply).
pub fn claim_value<'c>(claims: &'c Claims, name: &str) -> Option<Cow<'c, [u8]>> {
    match claims.get(name)? {
        Value::String(s) => Some(Cow::Borrowed(s.as_bytes())),
        Value::Number(n) => Some(Cow::Owned(n.to_string().into_bytes())),
        Value::Null | Value::Bool(_) | Value::Array(_) | Value::Object(_) => None,
    }
}

#[cfg(test)]
mod tests;
