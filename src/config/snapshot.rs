//! The compiled, immutable config the gateway runs on: plain data. Built once per load by
//! [`super::compile`]; it holds no connection pools and no metric handles, so `turnstile check`
//! validates a file without building either. `server.rs` attaches those resources
//! ([`crate::state::Live`]) and swaps the pair in atomically on reload; the hot path only reads it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::uri::{Authority, Scheme};
use http::{HeaderName, HeaderValue, StatusCode};

use crate::keys::{self, ClientPrefix, KeyError, KeyPart, RequestView, TrustedProxies};
use crate::limiter::Rule;
use crate::route::RouteMatch;

/// What to do with a request when the store cannot decide: a route admits it (`Open`, counted as
/// `failed_open`) or answers 503 (`Closed`, counted as `failed_closed`); routes never use `Error`.
pub use crate::limiter::FailureMode;

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

/// `server.min_body_rate`: the time the gateway spends waiting on a request body may be at most
/// `grace` plus one second per `bytes_per_second` bytes received. Time the body is not being
/// read (the upstream not taking more) does not count against the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MinBodyRate {
    pub bytes_per_second: u64,
    pub grace: Duration,
}

/// Listener-level limits.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerSettings {
    /// Request bodies past this size get 413.
    pub max_body_size: u64,
    /// The most of a JSON request body read before admission (`body:` key parts, a
    /// reservation's `max_tokens`); a larger body is forwarded unread (`docs/llm.md`).
    pub json_body_limit: u64,
    /// A client must send its whole request head within this time (slowloris).
    pub header_read_timeout: Duration,
    /// How long in-flight requests may finish after SIGTERM.
    pub shutdown_grace: Duration,
    /// A request body that sends nothing for this long is cut off (slow-body clients must not
    /// hold upstream connections).
    pub body_read_timeout: Duration,
    /// The slowest a request body may arrive (`None`: `min_body_rate: off`).
    pub min_body_rate: Option<MinBodyRate>,
    /// Open connections on the public listener; past it, new ones wait in the accept backlog.
    /// Read at start (a reload does not change it).
    pub max_connections: usize,
    /// The largest request head in bytes: bounds each connection's read buffer. Read at start.
    pub max_header_size: usize,
    /// Lower-case `Upgrade` protocol names forwarded upstream (RFC 9110 §7.8); others are
    /// stripped, so no tunnel opens past the limiter.
    pub allowed_upgrades: Vec<String>,
    /// Path normalisation before routing (`docs/normalization.md`).
    pub paths: crate::normalize::PathOptions,
    /// Request fields named with an underscore: dropped, refused or forwarded.
    pub headers_with_underscores: Underscores,
    /// The request fields the config reads (route `headers:`, `header:` key parts,
    /// `exempt.headers`), lower-case, distinct: a client's `Connection` option cannot remove
    /// them on the way upstream. Derived from the routes.
    pub read_fields: Vec<http::HeaderName>,
}

#[derive(Debug)]
pub struct Upstream {
    pub name: String,
    pub scheme: Scheme,
    /// The first of `targets`.
    pub authority: Authority,
    /// Every target in config order (one for `url:`); distinct.
    pub targets: Vec<Authority>,
    pub balance: Balance,
    /// How long a target that failed to connect is left out (passive health).
    pub eject_for: Duration,
    pub connect_timeout: Duration,
    /// Until the response head arrives; then 504.
    pub timeout: Duration,
    /// Open connections to each target at most (busy and idle together).
    pub max_connections: usize,
    /// How long a request waits for one of `max_connections` to be free; then 503.
    pub pool_timeout: Duration,
    /// How `https://` targets are verified and whom the gateway presents itself as; present
    /// exactly when the scheme is https.
    pub tls: Option<crate::tls::UpstreamTls>,
    /// The HTTP version spoken to every target.
    pub protocol: UpstreamProtocol,
}

/// Which HTTP an upstream's targets speak ([`crate::proxy::pool`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamProtocol {
    /// HTTP/1.1 on pooled kept-alive connections.
    Http1,
    /// HTTP/2 on one multiplexed connection per target: h2c with prior knowledge (RFC 9113
    /// §3.3) for `http://`, TLS with ALPN `h2` for `https://`. What gRPC needs.
    H2,
}

/// How a request picks one of its upstream's targets ([`crate::proxy::balance`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Balance {
    /// Each target in turn.
    RoundRobin,
    /// The target with the fewest requests in flight; ties in turn.
    LeastInFlight,
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
    /// Neither upstream nor respond: decided only by `forward_auth`; the inline gateway answers
    /// it with an error, since it has nowhere to send the request.
    CheckOnly,
}

/// One rate limit on a route.
#[derive(Debug)]
pub struct Policy {
    pub name: Arc<str>,
    pub key: Vec<KeyPart>,
    pub rule: Rule,
    pub cost: u64,
    /// `mode: shadow` (the policy's or its route's): decided and counted (`decision="shadow"`
    /// when it would have refused), never rejecting; invisible in the rate-limit headers.
    pub shadow: bool,
    /// `shared: true`: one counter per key value for every route that has this policy.
    pub shared: bool,
    /// `route:policy:`, the start of every counter key of this policy; `shared/policy:` for a
    /// shared one (a route name never has a `/`), the same from every route that shares it.
    key_prefix: String,
    /// `cost: {response_header: ...}`: `cost` is taken at admission, the rest after the response.
    pub response_cost: Option<ResponseCost>,
    /// The status of a refusal by a concurrency policy (`refuse_with`, 429 by default).
    pub refuse_with: StatusCode,
    /// `on_limit: delay`: the longest a request may wait for a slot, in µs, instead of being
    /// refused (`docs/algorithms.md`, "Pacing"); `None` refuses at once.
    pub max_delay_us: Option<u64>,
}

/// The cost a response reports (`docs/algorithms.md`, "Cost from the response").
#[derive(Debug, Clone, PartialEq)]
pub struct ResponseCost {
    /// Where the response reports it: a header, or token usage in the body.
    pub source: CostSource,
    /// Charged when the response reports no cost (`docs/llm.md`, "When usage is missing").
    pub fallback: u64,
    /// Taken at admission (the policy's `cost`); the response's amount is never charged below it.
    pub min_cost: u64,
    /// The most one response is charged: bounds how far one request can take the counter below 0.
    pub max_cost: u64,
    /// `reserve: true`: admission took `max_cost` (the policy's `cost` is `max_cost`), and the
    /// response's cost is settled by refunding `max_cost - total`: the counter never goes below 0.
    pub reserve: bool,
}

/// Where a response reports its cost.
#[derive(Debug, Clone, PartialEq)]
pub enum CostSource {
    /// A number in this response header, when the head arrives.
    Header(HeaderName),
    /// Token usage in the JSON body or the event stream, when the body ends.
    Usage(super::usage::UsageCost),
}

impl ResponseCost {
    /// What a response with `value` in the header costs in all (`min_cost` of it already taken):
    /// the units it reports ([`reported_units`]), or `fallback` when it reports none, clamped to
    /// `[min_cost, max_cost]`.
    pub fn total(&self, value: Option<&HeaderValue>) -> u64 {
        let reported = value
            .and_then(|v| reported_units(v.as_bytes()))
            .unwrap_or(self.fallback);
        self.clamp(reported)
    }

    /// `units` clamped to `[min_cost, max_cost]`.
    pub fn clamp(&self, units: u64) -> u64 {
        units.clamp(self.min_cost, self.max_cost.max(self.min_cost))
    }

    /// The response header that reports the cost, if it comes from one.
    pub fn header(&self) -> Option<&HeaderName> {
        match &self.source {
            CostSource::Header(name) => Some(name),
            CostSource::Usage(_) => None,
        }
    }

    /// The token usage the response body reports the cost in, if it comes from there.
    pub fn usage(&self) -> Option<&super::usage::UsageCost> {
        match &self.source {
            CostSource::Usage(usage) => Some(usage),
            CostSource::Header(_) => None,
        }
    }
}

/// The units a cost header reports (`docs/algorithms.md`, "Cost from the response"), spaces and
/// tabs around it trimmed: digits, with an optional `+`, are that whole number exactly, leading
/// zeros and all, and `u64::MAX` past it; a number with a sign, a fraction or an exponent
/// (`-3`, `2.5`, `1e+20`) is read as a double and rounded up, 0 below zero and `u64::MAX` past
/// it. The caller's clamp to `[min_cost, max_cost]` follows, so a number too large for any type
/// is charged `max_cost`. `None` for anything else (empty, `0x10`, `1_000`, `NaN`, a list).
fn reported_units(value: &[u8]) -> Option<u64> {
    let ows = |c: &u8| *c == b' ' || *c == b'\t';
    let start = value.iter().position(|c| !ows(c))?;
    let end = value.iter().rposition(|c| !ows(c))? + 1;
    let value = &value[start..end];
    let digits = value.strip_prefix(b"+").unwrap_or(value);
    if !digits.is_empty() && digits.iter().all(u8::is_ascii_digit) {
        let whole = digits.iter().fold(0u64, |n, &d| {
            n.saturating_mul(10).saturating_add(u64::from(d - b'0'))
        });
        return Some(whole);
    }
    let unsigned = digits.strip_prefix(b"-").unwrap_or(digits);
    let numeric = value
        .iter()
        .all(|c| c.is_ascii_digit() || b".eE+-".contains(c));
    if !numeric
        || !unsigned
            .first()
            .is_some_and(|c| c.is_ascii_digit() || *c == b'.')
    {
        return None;
    }
    let x: f64 = std::str::from_utf8(value).ok()?.parse().ok()?;
    // `as` saturates: an infinite double (`1e400`) is u64::MAX.
    Some(if x > 0.0 { x.ceil() as u64 } else { 0 })
}

impl Policy {
    pub fn new(route: &str, name: &str, key: Vec<KeyPart>, rule: Rule, cost: u64) -> Self {
        Policy {
            name: name.into(),
            key,
            rule,
            cost,
            shadow: false,
            shared: false,
            key_prefix: format!("{route}:{name}:"),
            response_cost: None,
            refuse_with: StatusCode::TOO_MANY_REQUESTS,
            max_delay_us: None,
        }
    }

    /// Makes this policy's counters the ones every route with a shared policy of its name uses.
    pub fn share(&mut self) {
        self.shared = true;
        self.key_prefix = format!("shared/{}:", self.name);
    }

    /// `route:policy:` (`shared/policy:`): stripped from a counter key, what is left are the request's values
    /// (`user42`, `10.0.0.7|GET`), what an operator recognises in `/debug/top-limited`.
    pub fn key_prefix(&self) -> &str {
        &self.key_prefix
    }

    /// This request's counter key, or `None` when a key part is absent (the policy does not
    /// apply, as in Envoy). `Err` when the request repeats a key header or query parameter.
    /// `claims`: the request's verified token claims, for `jwt:` parts.
    pub fn counter_key(
        &self,
        req: &RequestView<'_>,
        claims: Option<&crate::jwt::Claims>,
    ) -> Result<Option<String>, KeyError> {
        let mut key = String::with_capacity(self.key_prefix.len() + 48);
        key.push_str(&self.key_prefix);
        Ok(keys::write_key(&self.key, req, claims, &mut key)?.then_some(key))
    }

    /// Whether a key part reads a token claim (the route then verifies the bearer token).
    pub fn uses_jwt(&self) -> bool {
        self.key.iter().any(|p| matches!(p, KeyPart::Jwt(_)))
    }
}

#[derive(Debug)]
pub struct Route {
    pub name: Arc<str>,
    pub matcher: RouteMatch,
    pub action: Action,
    pub policies: Vec<Policy>,
    pub failure_mode: FailureMode,
    /// The global `exempt` and the route's own, merged at load.
    pub exempt: Exempt,
    /// The `jwt:` verifier, when a policy keys on a claim or `require_jwt` is set.
    pub jwt: Option<Arc<crate::jwt::Verifier>>,
    /// `require_jwt: true`: a request without a valid bearer token gets 401.
    pub require_jwt: bool,
    /// The rate-limit fields of its responses (`rate_limit_headers`), prepared at load.
    pub rate_limit_headers: crate::rate_limit_headers::RateLimitHeaders,
    /// Its refusal of a rate-limited request (`limited_response`), compiled at load.
    pub limited_response: super::limited::LimitedResponse,
    /// `strip_prefix` or `rewrite`: the path forwarded instead of the request's.
    pub rewrite: Option<super::rewrite::PathRewrite>,
    /// `quota_endpoint`: where a client asks for its own remaining quota on this route.
    pub quota_endpoint: Option<QuotaEndpoint>,
    /// The most requests waiting for a slot at once (`max_waiting`), when a policy delays.
    pub max_waiting: usize,
}

/// A route's quota endpoint (`quota_endpoint: /api/users/{user_id}/quota`): `GET` or `HEAD` of
/// a path matching `matcher` (and the route's `host`, if any) is answered by the gateway with the
/// state of the route's policies for the keys the request itself names, consuming none of them.
/// Each ask takes one token from `ask`, a token bucket per client network: asking is limited too.
#[derive(Debug)]
pub struct QuotaEndpoint {
    /// The pattern as written, for the status page.
    pub path: String,
    /// Its captures are the route's own, in the same order, so the policies' `path:` parts read
    /// the same values.
    pub matcher: RouteMatch,
    /// `quota_endpoint` on `client_ip`, [`QUOTA_ASK_RATE`] per second with a burst of
    /// [`QUOTA_ASK_BURST`].
    pub ask: Policy,
}

/// The name of a quota endpoint's own policy, reserved on its route.
pub const QUOTA_ASK_POLICY: &str = "quota_endpoint";
/// The asks a client network may make per second of a route's quota endpoint, sustained.
pub const QUOTA_ASK_RATE: f64 = 1.0;
/// The asks a client network may make at once.
pub const QUOTA_ASK_BURST: u64 = 10;

impl Route {
    /// Whether admission reads the JSON request body (`server.json_body_limit` bytes at most): a
    /// policy keys on `body:`, or reserves a usage cost the body can bound (`docs/llm.md`).
    pub fn reads_body(&self) -> bool {
        self.policies.iter().any(|p| {
            p.key.iter().any(|k| matches!(k, KeyPart::Body(_)))
                || p.response_cost
                    .as_ref()
                    .is_some_and(|rc| rc.reserve && rc.usage().is_some())
        })
    }
}

impl AsRef<RouteMatch> for Route {
    fn as_ref(&self) -> &RouteMatch {
        &self.matcher
    }
}

/// Requests no policy applies to: they consume nothing and are counted as exempt. Either
/// condition suffices: the client IP (after `trusted_proxies`) in one of `client_ips`, or one of
/// `headers` present with exactly its value.
#[derive(Debug, Clone, Default)]
pub struct Exempt {
    pub client_ips: Vec<ipnet::IpNet>,
    pub headers: Vec<(http::HeaderName, HeaderValue)>,
}

impl Exempt {
    pub fn is_empty(&self) -> bool {
        self.client_ips.is_empty() && self.headers.is_empty()
    }

    pub fn matches(&self, client_ip: std::net::IpAddr, headers: &http::HeaderMap) -> bool {
        self.client_ips.iter().any(|net| net.contains(&client_ip))
            || self
                .headers
                .iter()
                .any(|(name, value)| headers.get_all(name).iter().any(|v| v == value))
    }
}

/// What the admin listener may reveal.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AdminSettings {
    /// `/debug/top-limited` lists raw key values; by default only a short digest of each, since
    /// keys can be secrets (API keys) and the admin port may be reachable by more people than
    /// should read them.
    pub show_key_values: bool,
}

/// Everything the gateway needs to serve, validated.
#[derive(Debug)]
pub struct Snapshot {
    /// The file it was loaded from, for reloads and messages.
    pub source: PathBuf,
    /// Its content's hash, load time and section digests (`/config`, reload logs).
    pub source_info: super::SourceInfo,
    /// The plain-HTTP public listener; `None` with `listen: off` (TLS only, or no public
    /// listener at all for a config that only serves other doors).
    pub listen: Option<SocketAddr>,
    pub admin_listen: SocketAddr,
    /// TLS on the admin listener, when `admin.tls` is set.
    pub admin_tls: Option<crate::tls::ServerTlsSettings>,
    /// The HTTPS public listener, when `listen_tls:` is set.
    pub listen_tls: Option<crate::tls::ListenerTls>,
    pub admin: AdminSettings,
    pub trusted_proxies: TrustedProxies,
    /// How much of the client's address a `client_ip` key part uses.
    pub client_prefix: ClientPrefix,
    pub store: StoreSettings,
    /// The store-wide default; routes may override it.
    pub failure_mode: FailureMode,
    pub server: ServerSettings,
    pub routes: Vec<Route>,
    /// The Envoy rate limit service, when `rls:` is set.
    pub rls: Option<super::rls::settings::RlsSnapshot>,
    /// The Envoy rate limit quota service, when `rlqs:` is set.
    pub rlqs: Option<super::rlqs::RlqsSettings>,
    /// The ingress door, when `forward_auth:` is set.
    pub forward_auth: Option<ForwardAuthSettings>,
    /// Envoy's external processor, when `ext_proc:` is set: its gRPC listener (read at start).
    pub ext_proc: Option<SocketAddr>,
    /// The request id read, made and returned (`request_id:`).
    pub request_id: super::observability::RequestIdSettings,
    /// One line per request, when `access_log:` is set (read at start).
    pub access_log: Option<super::observability::AccessLogSettings>,
    /// Spans exported over OTLP, when `tracing:` is set (read at start).
    pub tracing: Option<super::observability::TracingSettings>,
    /// `overrides:`, resolved against the config's directory.
    pub overrides_file: Option<PathBuf>,
    /// The overrides file's entries, validated against `routes` (`crate::overrides`).
    pub overrides: Vec<super::overrides::Override>,
    /// SHA-256 of the overrides file as it was read for `overrides`: its watcher starts from it,
    /// so an edit made after this load and before the watch still applies.
    pub overrides_sha256: Option<[u8; 32]>,
    /// What is valid but probably not meant (a check-only route): `turnstile check` prints them.
    pub warnings: Vec<super::ConfigError>,
}

/// `forward_auth:`: where the ingress door listens and how it refuses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardAuthSettings {
    /// The HTTP check endpoint (nginx `auth_request`, Traefik ForwardAuth, Caddy forward_auth).
    pub listen: Option<SocketAddr>,
    /// Envoy ext_authz over gRPC.
    pub grpc_listen: Option<SocketAddr>,
    /// The status of a refusal; a call may override it with `?deny_status=`.
    pub deny_status: http::StatusCode,
    /// TLS on both listeners, when `forward_auth.tls` is set.
    pub tls: Option<crate::tls::ServerTlsSettings>,
    /// Which proxy calls `/check`, so which of its fields name the original request.
    pub proxy: CheckProxy,
}

/// `forward_auth.proxy`: the proxy in front of the HTTP check endpoint. Each proxy names the
/// original request in its own fields and passes the client's other fields through, so only the
/// named proxy's fields are believed (`crate::forward_auth::original_request`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CheckProxy {
    /// Not named: the call's fields choose, and a call that mixes two proxies' fields is refused.
    #[default]
    Auto,
    /// nginx `auth_request`: `X-Original-Method`, `X-Original-URI`, `Host`.
    Nginx,
    /// ingress-nginx `auth-url`: `X-Original-Method`, `X-Original-URL`.
    IngressNginx,
    /// Traefik ForwardAuth and Caddy `forward_auth`: `X-Forwarded-Method`, `-Uri`, `-Host`.
    Forwarded,
}

impl Snapshot {
    /// Whether the public TLS listener asks clients for certificates (`listen_tls.client_ca`):
    /// only then can a request carry one for `client_cert:` key parts.
    pub fn asks_client_cert(&self) -> bool {
        self.listen_tls
            .as_ref()
            .is_some_and(|t| t.tls.client_ca.is_some())
    }
}

impl CheckProxy {
    /// The spellings `forward_auth.proxy` takes.
    pub const NAMES: &'static str = "`nginx`, `ingress-nginx`, `traefik`, `caddy` or `auto`";

    pub fn parse(text: &str) -> Option<Self> {
        Some(match text {
            "auto" => CheckProxy::Auto,
            "nginx" => CheckProxy::Nginx,
            "ingress-nginx" => CheckProxy::IngressNginx,
            "traefik" | "caddy" => CheckProxy::Forwarded,
            _ => return None,
        })
    }

    /// How errors name it.
    pub fn name(self) -> &'static str {
        match self {
            CheckProxy::Auto => "auto",
            CheckProxy::Nginx => "nginx",
            CheckProxy::IngressNginx => "ingress-nginx",
            CheckProxy::Forwarded => "traefik",
        }
    }
}

/// What the gateway does with a request field whose name has an underscore
/// (`server.headers_with_underscores`). CGI and WSGI servers read `X_Key` and `X-Key` as the same
/// variable (`HTTP_X_KEY`), so such a name can carry a field past a decision keyed on the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Underscores {
    /// Removed before routing: neither the decision nor the upstream sees it (nginx's default).
    #[default]
    Drop,
    /// The request is refused with 400 (Envoy's `REJECT_REQUEST`).
    Reject,
    /// Kept and forwarded as sent.
    Allow,
}

/// Idle connections kept per upstream by the proxy's pool ([`crate::proxy::pool`]); more are closed
/// as they fall idle. An upstream's `max_connections` defaults to it.
pub const MAX_IDLE: usize = 1024;
