//! The compiled, immutable config the gateway runs on. Built once per load by [`super::compile`]
//! and swapped atomically on reload; the hot path only reads it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::uri::{Authority, Scheme};
use http::{HeaderValue, StatusCode};

use crate::keys::{self, KeyPart, RequestView, TrustedProxies};
use crate::limiter::Rule;
use crate::metrics::{PolicyMetrics, RouteMetrics};
use crate::route::RouteMatch;

/// What to do with a request when the store cannot decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureMode {
    /// Admit it (counted as `failed_open`).
    Open,
    /// Answer 503 (counted as `failed_closed`).
    Closed,
}

#[derive(Debug, Clone, PartialEq)]
pub enum StoreSettings {
    Memory {
        max_keys: usize,
    },
    Redis {
        /// One server, a Cluster, or Sentinel's master.
        target: crate::limiter::redis::Target,
        pool_size: usize,
        timeout: Duration,
        key_prefix: String,
    },
}

/// Listener-level limits.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerSettings {
    /// Request bodies past this size get 413.
    pub max_body_size: u64,
    /// A client must send its whole request head within this time (slowloris).
    pub header_read_timeout: Duration,
    /// How long in-flight requests may finish after SIGTERM.
    pub shutdown_grace: Duration,
}

#[derive(Debug)]
pub struct Upstream {
    pub name: String,
    pub scheme: Scheme,
    pub authority: Authority,
    pub connect_timeout: Duration,
    /// Until the response head arrives; then 504.
    pub timeout: Duration,
    /// The connection pool to this upstream; rebuilt on reload, drained by in-flight requests.
    pub client: crate::proxy::UpstreamClient,
}

/// A response the gateway gives itself, as Envoy's `direct_response`.
#[derive(Debug, Clone)]
pub struct DirectResponse {
    pub status: StatusCode,
    pub body: Bytes,
    pub content_type: HeaderValue,
}

#[derive(Debug, Clone)]
pub enum Action {
    Forward(Arc<Upstream>),
    Respond(DirectResponse),
}

/// One rate limit on a route.
#[derive(Debug)]
pub struct Policy {
    pub name: Arc<str>,
    pub key: Vec<KeyPart>,
    pub rule: Rule,
    pub cost: u64,
    /// `route:policy:`, the start of every counter key of this policy.
    key_prefix: String,
    pub metrics: PolicyMetrics,
}

impl Policy {
    pub fn new(
        route: &str,
        name: &str,
        key: Vec<KeyPart>,
        rule: Rule,
        cost: u64,
        metrics: PolicyMetrics,
    ) -> Self {
        Policy {
            name: name.into(),
            key,
            rule,
            cost,
            key_prefix: format!("{route}:{name}:"),
            metrics,
        }
    }

    /// The request's values within one of this policy's counter keys (`user42`, `10.0.0.7|GET`):
    /// what an operator recognises, without the route and policy already shown beside it.
    pub fn key_value<'k>(&self, counter_key: &'k str) -> &'k str {
        counter_key
            .strip_prefix(self.key_prefix.as_str())
            .unwrap_or(counter_key)
    }

    /// This request's counter key, or `None` when a key part is absent (the policy does not
    /// apply, as in Envoy).
    pub fn counter_key(&self, req: &RequestView<'_>) -> Option<String> {
        let mut key = String::with_capacity(self.key_prefix.len() + 48);
        key.push_str(&self.key_prefix);
        keys::write_key(&self.key, req, &mut key).then_some(key)
    }
}

#[derive(Debug)]
pub struct Route {
    pub name: Arc<str>,
    pub matcher: RouteMatch,
    pub action: Action,
    pub policies: Vec<Policy>,
    pub failure_mode: FailureMode,
    pub metrics: RouteMetrics,
}

/// Everything the gateway needs to serve, validated.
#[derive(Debug)]
pub struct Snapshot {
    /// The file it was loaded from, for reloads and messages.
    pub source: PathBuf,
    /// Its content's hash, load time and section digests (`/config`, reload logs).
    pub source_info: super::SourceInfo,
    pub listen: SocketAddr,
    pub admin_listen: SocketAddr,
    pub trusted_proxies: TrustedProxies,
    pub store: StoreSettings,
    /// The store-wide default; routes may override it.
    pub failure_mode: FailureMode,
    pub server: ServerSettings,
    pub routes: Vec<Route>,
    /// The Envoy rate limit service, when `rls:` is set.
    pub rls: Option<crate::rls::RlsSnapshot>,
}
