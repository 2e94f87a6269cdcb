//! The `jwt:` block: from YAML to a [`Verifier`], reading the secret and the JWKS file once per
//! config load or reload (a bad file fails the reload; the old config keeps serving). The URL is
//! not fetched here: `turnstile check` reads files only; the runtime fetches it
//! ([`Verifier::activate`]).

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use jsonwebtoken::{Algorithm, AlgorithmFamily, Validation};
use serde::Deserialize;

use super::keys::{parse_jwks, secret_key, Key, Strictness};
use super::ring::{KeyRing, Loaded, Sources, UrlSource};
use super::Verifier;

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
    /// An `https://` URL serving a JWK Set, fetched in the background and refreshed.
    pub jwks_url: Option<String>,
    /// The CAs (PEM) that `jwks_url`'s certificate must chain to (default: the system's).
    pub jwks_ca: Option<String>,
    /// The refresh interval when the response has no cache headers (default 5m).
    pub jwks_refresh: Option<String>,
    /// Cache headers are clamped to at least this; also the least time from a fetch to a
    /// refetch an unknown `kid` asks for (default 30s).
    pub jwks_refresh_min: Option<String>,
    /// ...and to at most this (default 1h).
    pub jwks_refresh_max: Option<String>,
    /// One fetch's bound, connect to last byte (default 5s).
    pub jwks_timeout: Option<String>,
    /// Verified tokens kept, so a repeated token skips its signature check (default 10000; 0:
    /// off).
    pub token_cache: Option<u64>,
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

/// A longer leeway would let expired tokens keep naming buckets for too long.
const MAX_LEEWAY_S: u64 = 300;

/// `token_cache` when not given.
pub const DEFAULT_TOKEN_CACHE: u64 = 10_000;
/// The most `token_cache` may be: at the bound per entry of [`super::cache::ENTRY_BYTES`] and
/// the claims, about 1 GiB.
const MAX_TOKEN_CACHE: u64 = 1_000_000;

type Errors = Vec<(String, String)>;

/// Builds the TLS client config for `jwks_url` from `jwks_ca` (the config layer lends
/// `crate::tls`'s upstream client code); its error says why.
pub type TlsBuilder<'a> = &'a dyn Fn(Option<&Path>) -> Result<Arc<rustls::ClientConfig>, String>;

/// What the rest of the config tells the `jwt:` block.
pub struct Context<'a> {
    /// The claims the policies read (`jwt:CLAIM` key parts): only these are kept per token.
    /// `None` keeps every claim.
    pub claims: Option<Vec<Box<str>>>,
    pub tls: TlsBuilder<'a>,
}

/// [`compile_with`] with every claim kept and no TLS (so no `jwks_url`): for tests.
pub fn compile(raw: &RawJwt, source: &Path) -> Result<Verifier, Errors> {
    let no_tls = |_: Option<&Path>| Err("no TLS client in this context".to_string());
    compile_with(
        raw,
        source,
        &Context {
            claims: None,
            tls: &no_tls,
        },
    )
}

/// Validates `raw` and loads its files' keys; relative file names are relative to the config
/// file's directory (`source`). Errors carry their field path (`jwt.jwks_file`).
pub fn compile_with(
    raw: &RawJwt,
    source: &Path,
    context: &Context<'_>,
) -> Result<Verifier, Errors> {
    let mut errors = Errors::new();
    let file = |name: &str| -> PathBuf {
        match source.parent() {
            Some(dir) => dir.join(name),
            None => PathBuf::from(name),
        }
    };
    let mut secret_seen = None;
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
            secret_seen = secret.as_deref().ok().map(crate::watch::digest);
            secret_or_error(&mut errors, "jwt.hs256_secret_file", secret)
        }
        (None, Some(var)) => {
            let secret = std::env::var_os(var)
                .map(|v| v.into_encoded_bytes())
                .ok_or_else(|| format!("the environment variable `{var}` is not set"));
            secret_or_error(&mut errors, "jwt.hs256_secret_env", secret)
        }
        (None, None) => None,
    };
    let mut jwks_seen = None;
    let jwks = match &raw.jwks_file {
        Some(name) => {
            let path = file(name);
            let read = std::fs::read_to_string(&path)
                .map_err(|e| format!("cannot read `{}`: {e}", path.display()));
            jwks_seen = read
                .as_deref()
                .ok()
                .map(|t| crate::watch::digest(t.as_bytes()));
            read.and_then(|text| parse_jwks(&text, &path.display().to_string(), Strictness::Refuse))
                .map_err(|m| errors.push(("jwt.jwks_file".into(), m)))
                .unwrap_or_default()
        }
        None => Vec::new(),
    };
    let jwks_url = url_source(&mut errors, raw, &file, context);
    let (hmac_set, jwks_set) = (
        raw.hs256_secret_file.is_some() || raw.hs256_secret_env.is_some(),
        raw.jwks_file.is_some() || raw.jwks_url.is_some(),
    );
    if !hmac_set && !jwks_set {
        errors.push((
            "jwt".into(),
            "needs keys: `hs256_secret_file: FILE` or `hs256_secret_env: NAME` (HMAC), \
             `jwks_file: FILE` or `jwks_url: URL` (RS256, ES256), or both"
                .into(),
        ));
    }
    let token_cache = match raw.token_cache {
        None => DEFAULT_TOKEN_CACHE,
        Some(n) if n <= MAX_TOKEN_CACHE => n,
        Some(_) => {
            errors.push((
                "jwt.token_cache".into(),
                format!("at most {MAX_TOKEN_CACHE} entries (0 turns the cache off)"),
            ));
            0
        }
    };

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
                    errors.push((path, format!("`{name}` needs `jwks_file` or `jwks_url`")));
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
        let sources = Sources {
            hs256_secret_file: raw.hs256_secret_file.as_deref().map(file),
            hs256_secret_env: raw.hs256_secret_env.clone(),
            jwks_file: raw.jwks_file.as_deref().map(file),
            jwks_url,
        };
        let loaded = Loaded {
            hmac,
            file: jwks,
            secret_seen,
            jwks_seen,
        };
        Ok(Verifier {
            validations,
            leeway,
            keep: context.claims.clone().map(Vec::into_boxed_slice),
            cache: super::cache::TokenCache::new(token_cache as usize),
            ring: Arc::new(KeyRing::new(sources, loaded)),
            carried: OnceLock::new(),
        })
    } else {
        Err(errors)
    }
}

fn secret_or_error(
    errors: &mut Errors,
    path: &str,
    secret: Result<Vec<u8>, String>,
) -> Option<Key> {
    secret
        .and_then(secret_key)
        .map_err(|m| errors.push((path.into(), m)))
        .ok()
}

/// The least `jwks_refresh_min`: a smaller one would let a flood of unknown kids hammer the
/// identity provider.
const MIN_REFRESH_FLOOR: Duration = Duration::from_millis(100);

/// `jwks_url` and its settings, validated; the TLS client config built from `jwks_ca`.
fn url_source(
    errors: &mut Errors,
    raw: &RawJwt,
    file: &dyn Fn(&str) -> PathBuf,
    context: &Context<'_>,
) -> Option<UrlSource> {
    let settings = [
        ("jwks_ca", raw.jwks_ca.is_some()),
        ("jwks_refresh", raw.jwks_refresh.is_some()),
        ("jwks_refresh_min", raw.jwks_refresh_min.is_some()),
        ("jwks_refresh_max", raw.jwks_refresh_max.is_some()),
        ("jwks_timeout", raw.jwks_timeout.is_some()),
    ];
    let Some(text) = &raw.jwks_url else {
        for (name, _) in settings.iter().filter(|(_, set)| *set) {
            errors.push((format!("jwt.{name}"), "needs `jwks_url`".into()));
        }
        return None;
    };
    let before = errors.len();
    let url = match text.parse::<http::Uri>() {
        Ok(url)
            if url.scheme_str() == Some("https") && url.host().is_some_and(|h| !h.is_empty()) =>
        {
            Some(url)
        }
        Ok(_) => {
            errors.push((
                "jwt.jwks_url".into(),
                format!(
                    "`{text}`: must be an `https://` URL: keys fetched in the clear could be \
                     replaced on the way"
                ),
            ));
            None
        }
        Err(e) => {
            errors.push(("jwt.jwks_url".into(), format!("`{text}` is not a URL: {e}")));
            None
        }
    };
    let mut duration = |name: &str, value: &Option<String>, default: Duration| match value {
        None => default,
        Some(text) => match crate::units::parse_duration(text) {
            Ok(d) if !d.is_zero() => d,
            Ok(_) => {
                errors.push((format!("jwt.{name}"), "must be more than 0s".into()));
                default
            }
            Err(e) => {
                errors.push((format!("jwt.{name}"), e));
                default
            }
        },
    };
    let refresh = duration("jwks_refresh", &raw.jwks_refresh, Duration::from_secs(300));
    let min = duration(
        "jwks_refresh_min",
        &raw.jwks_refresh_min,
        Duration::from_secs(30),
    );
    let max = duration(
        "jwks_refresh_max",
        &raw.jwks_refresh_max,
        Duration::from_secs(3600),
    );
    let timeout = duration("jwks_timeout", &raw.jwks_timeout, Duration::from_secs(5));
    if min < MIN_REFRESH_FLOOR {
        errors.push((
            "jwt.jwks_refresh_min".into(),
            format!("must be at least {}ms", MIN_REFRESH_FLOOR.as_millis()),
        ));
    }
    if max < min {
        errors.push((
            "jwt.jwks_refresh_max".into(),
            "must be at least `jwks_refresh_min`".into(),
        ));
    }
    if !(min..=max).contains(&refresh) {
        errors.push((
            "jwt.jwks_refresh".into(),
            "must lie between `jwks_refresh_min` and `jwks_refresh_max`".into(),
        ));
    }
    let ca = raw.jwks_ca.as_deref().map(file);
    let ca_seen = match &ca {
        Some(path) => match std::fs::read(path) {
            Ok(bytes) => Some((path.clone(), crate::watch::digest(&bytes))),
            Err(e) => {
                errors.push((
                    "jwt.jwks_ca".into(),
                    format!("cannot read `{}`: {e}", path.display()),
                ));
                None
            }
        },
        None => None,
    };
    if errors.len() > before {
        return None;
    }
    let tls = (context.tls)(ca.as_deref())
        .map_err(|m| {
            let field = if ca.is_some() {
                "jwt.jwks_ca"
            } else {
                "jwt.jwks_url"
            };
            errors.push((field.into(), m));
        })
        .ok()?;
    Some(UrlSource {
        url: url?,
        ca: ca_seen,
        refresh,
        min,
        max,
        timeout,
        tls,
    })
}
