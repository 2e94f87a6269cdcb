//! Verified JWT claims as key material: the `jwt:CLAIM` key parts (`docs/jwt.md`).
//!
//! A claim names a counter only after its token's signature, algorithm, expiry and not-before
//! time (and issuer and audience, when configured) have been checked: an unverified claim would
//! let anyone mint a fresh bucket per request. The rules are compiled once per config load
//! ([`config::compile`]); the keys live in a [`ring::KeyRing`] that the runtime keeps current
//! (key files watched, `jwks_url` fetched in the background). A request costs one signature
//! check, made once by [`crate::admission::admit`] however many policies read claims, or none
//! when the token is in the cache of verified tokens ([`cache`]).

pub mod cache;
pub mod config;
pub mod fetch;
mod keys;
pub mod ring;

use std::borrow::Cow;
use std::fmt;
use std::sync::{Arc, OnceLock};

use http::header::AUTHORIZATION;
use http::HeaderMap;
use jsonwebtoken::{Algorithm, Validation};
use serde_json::Value;
use sha2::{Digest, Sha256};

pub use config::RawJwt;
pub use ring::{KeyMetrics, KeyRing};

use keys::Lookup;

/// Longer bearer tokens are refused unread: the signature check and the JSON parse of a token
/// cost in proportion to its size, and every identity provider's tokens fit well within this.
pub const MAX_TOKEN_BYTES: usize = 8 * 1024;

/// The claims of a verified token that can be key material: top-level strings (as themselves)
/// and numbers (as their decimal text), limited to the claims the config's policies read. Other
/// claims, and `null`, booleans, objects and arrays, are not kept: as key parts they are absent.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Claims(Box<[Claim]>);

/// One kept claim: its name and its value's bytes.
type Claim = (Box<str>, Box<[u8]>);

impl Claims {
    /// The key material of `map`, only of the claims named in `keep` (all of them when `None`).
    pub fn from_map(map: &serde_json::Map<String, Value>, keep: Option<&[Box<str>]>) -> Claims {
        let wanted = |name: &str| keep.is_none_or(|k| k.iter().any(|n| &**n == name));
        Claims(
            map.iter()
                .filter(|(name, _)| wanted(name))
                .filter_map(|(name, value)| {
                    let bytes: Box<[u8]> = match value {
                        Value::String(s) => s.as_bytes().into(),
                        Value::Number(n) => n.to_string().into_bytes().into(),
                        Value::Null | Value::Bool(_) | Value::Array(_) | Value::Object(_) => {
                            return None
                        }
                    };
                    Some((name.as_str().into(), bytes))
                })
                .collect(),
        )
    }

    /// The value of claim `name`.
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        self.0.iter().find(|(n, _)| &**n == name).map(|(_, v)| &**v)
    }

    /// The bytes of every value kept (what the cache bounds).
    fn value_bytes(&self) -> usize {
        self.0.iter().map(|(_, v)| v.len()).sum()
    }
}

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

/// The verification rules of the `jwt:` block, built once per config load, and the keys they
/// verify with.
pub struct Verifier {
    /// One validation per accepted algorithm, so a request allocates none.
    validations: Vec<(Algorithm, Validation)>,
    /// Seconds of clock skew allowed on `exp` (for the cache's expiry).
    leeway: u64,
    /// The claims the config's policies read (`None`: every claim; tests).
    keep: Option<Box<[Box<str>]>>,
    cache: Option<cache::TokenCache>,
    /// The ring this load built: its keys as the files were when read.
    ring: Arc<KeyRing>,
    /// The running ring, when a reload kept the key sources ([`Verifier::activate`]).
    carried: OnceLock<Arc<KeyRing>>,
}

impl fmt::Debug for Verifier {
    /// Key material stays out of logs and `/config`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Verifier")
            .field("keys", self.ring())
            .field(
                "algorithms",
                &self.validations.iter().map(|(a, _)| a).collect::<Vec<_>>(),
            )
            .field("cache", &self.cache)
            .finish()
    }
}

impl Verifier {
    /// The ring whose keys verify tokens.
    fn ring(&self) -> &Arc<KeyRing> {
        self.carried.get().unwrap_or(&self.ring)
    }

    /// The key sources as the config names them.
    pub fn sources(&self) -> &ring::Sources {
        &self.ring.sources
    }

    /// Puts this load's verifier to work, before it serves: a reload whose key sources equal
    /// `previous`'s takes over the running ring (its keys, fetches and watches go on); otherwise
    /// this load's ring starts watching its files and fetching its URL (`connect` builds the
    /// connector for it). Returns, when a first fetch was started, how it ended (its error when it failed).
    pub fn activate<C>(
        &self,
        previous: Option<&Verifier>,
        metrics: &KeyMetrics,
        connect: impl FnOnce(&ring::UrlSource) -> C,
    ) -> Option<tokio::sync::oneshot::Receiver<Result<(), String>>>
    where
        C: fetch::Connect,
    {
        if let Some(previous) = previous {
            let running = previous.ring();
            if running.sources == self.ring.sources && !Arc::ptr_eq(running, &self.ring) {
                let _ = self.carried.set(running.clone());
                return None;
            }
        }
        self.ring.start(metrics, connect)
    }

    /// The claims of the request's bearer token, once its signature and time and audience checks
    /// pass (or once it is found in the cache of tokens that passed).
    pub fn verify(&self, headers: &HeaderMap) -> Result<Arc<Claims>, Rejected> {
        let token = bearer_token(headers)?;
        if token.len() > MAX_TOKEN_BYTES {
            return Err(Rejected::Invalid);
        }
        let ring = self.ring();
        let set = ring.set();
        let metrics = ring.metrics.get();
        let cached = self.cache.as_ref().map(|cache| {
            let digest: [u8; 32] = Sha256::digest(token).into();
            (cache, digest)
        });
        let now = jsonwebtoken::get_current_timestamp();
        if let Some((cache, digest)) = &cached {
            if let Some(claims) = cache.get(digest, now, |key| set.holds(key)) {
                if let Some(m) = metrics {
                    m.hits.inc();
                }
                return Ok(claims);
            }
            if let Some(m) = metrics {
                m.misses.inc();
            }
        }
        let header = jsonwebtoken::decode_header(token).map_err(|_| Rejected::Invalid)?;
        let validation = self
            .validations
            .iter()
            .find_map(|(alg, v)| (*alg == header.alg).then_some(v))
            .ok_or(Rejected::Invalid)?;
        let key = match set.key_for(header.alg, header.kid.as_deref()) {
            Lookup::Found(key) => key,
            Lookup::UnknownKid => {
                ring.unknown_kid();
                return Err(Rejected::Invalid);
            }
            Lookup::None => return Err(Rejected::Invalid),
        };
        let data =
            jsonwebtoken::decode::<serde_json::Map<String, Value>>(token, &key.key, validation)
                .map_err(|e| {
                    tracing::debug!(error = %e, "bearer token rejected");
                    Rejected::Invalid
                })?;
        let claims = Arc::new(Claims::from_map(&data.claims, self.keep.as_deref()));
        if let Some((cache, digest)) = cached {
            let exp = data.claims.get("exp").and_then(|e| {
                e.as_u64()
                    .or_else(|| e.as_f64().filter(|f| *f >= 0.0).map(|f| f as u64))
            });
            if let Some(exp) = exp {
                if claims.value_bytes() <= cache::MAX_CACHED_CLAIM_BYTES {
                    cache.insert(
                        digest,
                        exp.saturating_add(self.leeway),
                        key.id,
                        claims.clone(),
                    );
                }
            }
        }
        Ok(claims)
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
    claims.get(name).map(Cow::Borrowed)
}

#[cfg(test)]
mod tests;
