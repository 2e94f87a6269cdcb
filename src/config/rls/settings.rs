//! The `rls:` block of `policies.yaml`, and the runtime form of the Envoy service it enables:
//! the descriptor tree plus, per rule, the decision-core rule (plain data, [`RlsSnapshot`]), and
//! the metric handles attached beside it (`crate::rls::RlsResources`), all built once per (re)load and
//! swapped with the rest of the snapshot.
//!
//! ```yaml
//! rls:
//!   listen: 0.0.0.0:8081
//!   config: ./ratelimit-config   # a file, or a directory of *.yaml; relative to this file
//!   response_headers: false      # true: RateLimit-Limit/-Remaining/-Reset in response_headers_to_add
//!   failure_mode: error          # error (a gRPC error: Envoy's failure_mode_deny decides) | open | closed
//!   tls: {cert: tls.crt, key: tls.key, client_ca: ca.crt}   # optional: TLS, mutual with client_ca
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::rule::Algorithm;
use super::tree::{LoadOptions, RlsConfig, RuleId};
use crate::limiter::{FailureMode, Rule as CoreRule, SlidingWindow, TokenBucket};

/// The `rls:` block as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRls {
    pub listen: String,
    pub config: String,
    #[serde(default)]
    pub response_headers: bool,
    /// envoyproxy/ratelimit's `RESPONSE_DYNAMIC_METADATA`: the response's `dynamic_metadata`
    /// names the domain, the descriptors, `hitsAddend` and the passed descriptors' `metadata`.
    #[serde(default)]
    pub response_dynamic_metadata: bool,
    pub failure_mode: Option<String>,
    /// TLS (and mutual TLS) on the gRPC listener.
    pub tls: Option<crate::config::raw::RawServerTls>,
}

/// One rule of the tree, ready for the decision core.
#[derive(Debug)]
pub(crate) struct Enforced {
    /// `None` for an unlimited rule, which never reaches the store.
    pub(crate) core: Option<CoreRule>,
    /// `Some(window)` for `algorithm: fixed_window`: the counter key names the epoch-aligned
    /// window, and the core counts it with a one-bucket window (see `decide.rs`).
    pub(crate) fixed_window_us: Option<u64>,
}

/// The Envoy rate limit service's part of a snapshot.
#[derive(Debug)]
pub struct RlsSnapshot {
    pub listen: SocketAddr,
    /// TLS on the listener, when `rls.tls` is set.
    pub tls: Option<crate::tls::ServerTlsSettings>,
    /// The envoyproxy/ratelimit config it was read from, resolved against `policies.yaml`.
    pub config_path: PathBuf,
    pub response_headers: bool,
    pub response_dynamic_metadata: bool,
    /// What the service answers when the store cannot decide: `Error` is a gRPC `UNAVAILABLE`
    /// (Envoy's own `failure_mode_deny` decides, admitting by default); `Open` is `OK` for every
    /// descriptor; `Closed` is `OVER_LIMIT` for every descriptor that has a limit.
    pub failure_mode: FailureMode,
    pub tree: RlsConfig,
    pub(crate) enforced: Vec<Enforced>,
}

impl RlsSnapshot {
    pub(crate) fn enforced(&self, id: RuleId) -> Option<&Enforced> {
        self.enforced.get(id.0 as usize)
    }
}

/// The decision-core rule for an algorithm (`None`: unlimited), and the fixed window's width.
pub(crate) fn core_rule(algorithm: &Algorithm) -> (Option<CoreRule>, Option<u64>) {
    let micros = |d: std::time::Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
    match *algorithm {
        Algorithm::Unlimited => (None, None),
        Algorithm::SlidingWindow { limit, window } => (
            Some(CoreRule::SlidingWindow(SlidingWindow {
                limit: limit.into(),
                window_us: micros(window),
                buckets: 0,
            })),
            None,
        ),
        // One bucket as wide as the window, on a counter keyed by the window's index: within one
        // key's life the core's N+1 = 2 buckets hold every hit of that window and nothing else.
        Algorithm::FixedWindow { limit, window } => (
            Some(CoreRule::SlidingWindow(SlidingWindow {
                limit: limit.into(),
                window_us: micros(window),
                buckets: 1,
            })),
            Some(micros(window)),
        ),
        Algorithm::TokenBucket {
            rate_per_sec,
            burst,
        } => (
            Some(CoreRule::TokenBucket(TokenBucket {
                rate: rate_per_sec,
                burst: burst.into(),
            })),
            None,
        ),
    }
}

/// Validates the block and loads the envoyproxy/ratelimit files it names. Errors are
/// `(field path, message)` pairs in `policies.yaml`.
pub fn compile(raw: &RawRls, source: &Path) -> Result<RlsSnapshot, Vec<(String, String)>> {
    let mut errors = Vec::new();
    let listen = raw.listen.parse::<SocketAddr>().map_err(|_| {
        let message = format!(
            "`{}` is not an address; expected IP:PORT (e.g. 0.0.0.0:8081)",
            raw.listen
        );
        errors.push(("rls.listen".to_owned(), message));
    });
    let failure_mode = match raw.failure_mode.as_deref().unwrap_or("error") {
        "error" => FailureMode::Error,
        "open" => FailureMode::Open,
        "closed" => FailureMode::Closed,
        other => {
            let message =
                format!("`{other}` is not a failure mode; expected `error`, `open` or `closed`");
            errors.push(("rls.failure_mode".to_owned(), message));
            FailureMode::Error
        }
    };
    let tls = match raw.tls.as_ref() {
        None => None,
        Some(t) => match crate::config::tls::server(t, "rls.tls", source) {
            Ok(tls) => Some(tls),
            Err(problems) => {
                errors.extend(problems);
                None
            }
        },
    };
    let config_path = match source.parent() {
        Some(dir) => dir.join(&raw.config),
        None => PathBuf::from(&raw.config),
    };
    let tree = RlsConfig::load(&config_path, LoadOptions::default())
        .map_err(|e| errors.push(("rls.config".to_owned(), e.to_string())));
    match (listen, tree) {
        (Ok(listen), Ok(tree)) if errors.is_empty() => {
            let enforced = tree
                .rules()
                .iter()
                .map(|rule| {
                    let (core, fixed_window_us) = core_rule(&rule.algorithm);
                    Enforced {
                        core,
                        fixed_window_us,
                    }
                })
                .collect();
            Ok(RlsSnapshot {
                listen,
                tls,
                config_path,
                response_headers: raw.response_headers,
                response_dynamic_metadata: raw.response_dynamic_metadata,
                failure_mode,
                tree,
                enforced,
            })
        }
        _ => Err(errors),
    }
}
