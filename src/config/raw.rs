//! The YAML vocabulary of `policies.yaml`, as written by users. Nothing here is validated beyond
//! its shape; [`super::compile`] turns it into the runtime snapshot. Every struct denies unknown
//! fields: a misspelt option is an error, never silently ignored.

use std::collections::BTreeMap;

use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    pub listen: Option<String>,
    pub admin_listen: Option<String>,
    /// A second public listener, HTTPS (`crate::tls`); `listen` keeps serving plain HTTP.
    pub listen_tls: Option<RawListenTls>,
    /// What the admin endpoints may show (`admin_listen` stays at the top level).
    #[serde(default)]
    pub admin: RawAdmin,
    #[serde(default)]
    pub client_ip: RawClientIp,
    #[serde(default)]
    pub store: RawStore,
    #[serde(default)]
    pub server: RawServer,
    #[serde(default)]
    pub upstreams: BTreeMap<String, RawUpstream>,
    #[serde(default)]
    pub routes: Vec<RawRoute>,
    /// The Envoy rate limit service (`crate::rls`).
    pub rls: Option<super::rls::settings::RawRls>,
    /// The Envoy rate limit quota service (`crate::rlqs`).
    pub rlqs: Option<super::rlqs::RawRlqs>,
    /// The ingress door (`crate::forward_auth`): forward-auth over HTTP, Envoy ext_authz.
    pub forward_auth: Option<RawForwardAuth>,
    /// Envoy's external processor (`crate::ext_proc`): admission and settlement over ext_proc.
    pub ext_proc: Option<RawExtProc>,
    /// Requests no policy of any route applies to.
    #[serde(default)]
    pub exempt: RawExempt,
    /// Bearer-token verification for `jwt:CLAIM` key parts and `require_jwt` (`crate::jwt`).
    pub jwt: Option<crate::jwt::RawJwt>,
    /// A YAML file of per-key overrides (`crate::overrides`), relative to this file.
    pub overrides: Option<String>,
    /// The request id every response carries (`crate::request_id`).
    #[serde(default)]
    pub request_id: super::observability::RawRequestId,
    /// One line per request (`crate::access_log`).
    pub access_log: Option<super::observability::RawAccessLog>,
    /// Spans exported over OTLP (`crate::otel`).
    pub tracing: Option<super::observability::RawTracing>,
}

/// `listen_tls: {listen, cert, key, client_ca, client_auth, handshake_timeout}`: files relative
/// to the config file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawListenTls {
    /// Default `0.0.0.0:8443`.
    pub listen: Option<String>,
    pub cert: String,
    pub key: String,
    pub client_ca: Option<String>,
    pub client_auth: Option<String>,
    pub handshake_timeout: Option<String>,
}

impl RawListenTls {
    /// Its TLS settings, as every other listener's `tls:` block writes them.
    pub fn tls(&self) -> RawServerTls {
        RawServerTls {
            cert: self.cert.clone(),
            key: self.key.clone(),
            client_ca: self.client_ca.clone(),
            client_auth: self.client_auth.clone(),
            handshake_timeout: self.handshake_timeout.clone(),
        }
    }
}

/// A listener's `tls:` block (`rls.tls`, `forward_auth.tls`, `admin.tls`): its certificate, and
/// for mutual TLS the CA client certificates must verify against.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServerTls {
    pub cert: String,
    pub key: String,
    pub client_ca: Option<String>,
    /// `required` (the default with `client_ca`) or `optional`.
    pub client_auth: Option<String>,
    pub handshake_timeout: Option<String>,
}

/// A client certificate an upstream asks for (mTLS).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawClientCert {
    pub cert: String,
    pub key: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawForwardAuth {
    /// The HTTP check endpoint (`/check`).
    pub listen: Option<String>,
    /// Envoy ext_authz (`envoy.service.auth.v3.Authorization/Check`).
    pub grpc_listen: Option<String>,
    /// The status of a refusal (default 429).
    pub deny_status: Option<u16>,
    /// The proxy that calls `/check`: `nginx`, `ingress-nginx`, `traefik`, `caddy` or `auto`.
    pub proxy: Option<String>,
    /// TLS (and mutual TLS) on both of its listeners.
    pub tls: Option<RawServerTls>,
}

/// `ext_proc: {listen}`: Envoy's `ext_proc` filter (`envoy.service.ext_proc.v3.ExternalProcessor`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawExtProc {
    pub listen: String,
}

/// Requests that skip every policy: a client IP in one of `client_ips`, or one of `headers` with
/// exactly its value (ingress-nginx's `limit-whitelist`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawExempt {
    #[serde(default)]
    pub client_ips: Vec<String>,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAdmin {
    /// `/debug/top-limited` shows raw key values (API keys, user ids) instead of digests.
    pub show_key_values: Option<bool>,
    /// TLS (and mutual TLS) on `admin_listen`.
    pub tls: Option<RawServerTls>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawClientIp {
    #[serde(default)]
    pub trusted_proxies: Vec<String>,
    /// The network length that names an IPv4 client's counter (default 32).
    pub ipv4_prefix: Option<u32>,
    /// The network length that names an IPv6 client's counter (default 64).
    pub ipv6_prefix: Option<u32>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawStore {
    #[serde(rename = "type")]
    pub kind: Option<String>,
    /// memory: the most counters kept at once.
    pub max_keys: Option<u64>,
    /// redis: one server...
    pub url: Option<String>,
    /// ...or Redis Cluster seed nodes (`host:port`)...
    pub cluster: Option<Vec<String>>,
    /// ...or the master Sentinel names.
    pub sentinel: Option<RawSentinel>,
    /// Credentials of the data nodes, for `cluster` and `sentinel` (a `url` carries its own).
    pub username: Option<String>,
    pub password: Option<String>,
    pub pool_size: Option<u32>,
    pub timeout: Option<String>,
    pub failure_mode: Option<String>,
    pub key_prefix: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSentinel {
    /// The master's name in Sentinel (`sentinel monitor NAME ...`).
    pub service: String,
    /// Sentinel addresses, `host:port`.
    pub nodes: Vec<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    pub max_body_size: Option<String>,
    /// The most of a JSON request body read for `body:` key parts and a reservation's
    /// `max_tokens` (default 64KiB).
    pub json_body_limit: Option<String>,
    pub header_read_timeout: Option<String>,
    pub shutdown_grace: Option<String>,
    /// Idle time allowed between request-body chunks (`408` or an aborted upstream request).
    pub body_read_timeout: Option<String>,
    /// The slowest a request body may arrive on average, `SIZE/s` (`1KiB/s`), or `off`.
    pub min_body_rate: Option<String>,
    /// Waiting on the body for this long is free before `min_body_rate` applies.
    pub min_body_rate_grace: Option<String>,
    /// Open connections on the public listener; more wait in the accept backlog.
    pub max_connections: Option<u64>,
    /// The largest request head (HTTP/1.1) or header list (h2).
    pub max_header_size: Option<String>,
    /// `Upgrade` protocols forwarded to upstreams; any other is stripped.
    pub allowed_upgrades: Option<Vec<String>>,
    /// `drop` (default), `reject` or `allow` request fields whose name has an underscore.
    pub headers_with_underscores: Option<String>,
    /// Decode unreserved escapes and remove dot segments (default true).
    pub normalize_path: Option<bool>,
    /// Merge repeated slashes (default true).
    pub merge_slashes: Option<bool>,
    /// `reject` (default) or `keep` `%2F` and `%5C`.
    pub escaped_slashes: Option<String>,
    /// `reject` (default), `strip` or `keep` `;` path parameters.
    pub path_parameters: Option<String>,
    /// `x-ratelimit` (default), `ietf`, `both` or `none`: every route's default.
    pub rate_limit_headers: Option<String>,
    /// The refusal of a rate-limited request: every route's default.
    pub limited_response: Option<RawLimitedResponse>,
}

/// `limited_response:`: the status (4xx/5xx, default 429) and body of a refusal; without `body`,
/// the gateway's JSON. `{retry_after}`, `{policy}` and `{route}` are substituted.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimitedResponse {
    pub status: Option<u16>,
    pub body: Option<String>,
    pub content_type: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawUpstream {
    /// One target; or `targets` (exactly one of the two).
    pub url: Option<String>,
    /// Several targets, balanced (`docs/upstreams.md`).
    pub targets: Option<Vec<String>>,
    /// `round_robin` (default) or `least_in_flight`.
    pub balance: Option<String>,
    /// How long a target that failed to connect gets no requests (default 10s).
    pub eject_for: Option<String>,
    pub connect_timeout: Option<String>,
    pub timeout: Option<String>,
    /// Open connections to this upstream at most.
    pub max_connections: Option<u64>,
    /// How long a request waits for a connection when `max_connections` are busy (then 503).
    pub pool_timeout: Option<String>,
    /// `https://` only: trust only these CAs (PEM) instead of the system's.
    pub ca: Option<String>,
    /// `https://` only: the certificate the gateway presents when asked (mTLS).
    pub client_cert: Option<RawClientCert>,
    /// `https://` only: `false` accepts any certificate. Never the default.
    pub tls_verify: Option<bool>,
    /// `http1` (default) or `h2`: h2c with prior knowledge on `http://`, h2 by ALPN on
    /// `https://` (gRPC upstreams, `docs/upstreams.md`).
    pub protocol: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRoute {
    pub name: String,
    #[serde(rename = "match", default)]
    pub matcher: RawMatch,
    pub upstream: Option<String>,
    pub respond: Option<RawRespond>,
    #[serde(default)]
    pub policies: Vec<RawPolicy>,
    pub failure_mode: Option<String>,
    /// Added to the global `exempt` for this route.
    #[serde(default)]
    pub exempt: RawExempt,
    /// Answer 401 to a request without a valid bearer token (needs `jwt:`).
    pub require_jwt: Option<bool>,
    /// `enforce` (default) or `shadow`: every policy decides and counts, none rejects.
    pub mode: Option<String>,
    /// Overrides `server.rate_limit_headers`.
    pub rate_limit_headers: Option<String>,
    /// Overrides `server.limited_response`.
    pub limited_response: Option<RawLimitedResponse>,
    /// Removed from the start of the forwarded path (`/api`).
    pub strip_prefix: Option<String>,
    /// The forwarded path, from the route's captures (`/v2/{*rest}`).
    pub rewrite: Option<String>,
    /// A path pattern on the public listener where a client reads its own state of this route's
    /// policies, consuming nothing (`docs/status.md`).
    pub quota_endpoint: Option<String>,
    /// With a policy that delays (`on_limit: delay`): the most requests waiting for a slot on
    /// this route at once, on this instance; past it, a request is refused as usual. Default
    /// 1000.
    pub max_waiting: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawMatch {
    pub path: Option<String>,
    pub prefix: Option<String>,
    pub methods: Option<Vec<String>>,
    pub host: Option<String>,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRespond {
    #[serde(default = "default_status")]
    pub status: u16,
    #[serde(default)]
    pub body: String,
    pub content_type: Option<String>,
}

fn default_status() -> u16 {
    200
}

#[derive(Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPolicy {
    pub name: String,
    pub key: Vec<String>,
    pub token_bucket: Option<RawTokenBucket>,
    pub sliding_window: Option<RawSlidingWindow>,
    /// A calendar quota (`docs/algorithms.md`, "Calendar quota").
    pub quota: Option<RawQuota>,
    /// At most `limit` requests in flight per key.
    pub concurrency: Option<RawConcurrency>,
    /// Units per request: a number, or `{response_header, fallback, min_cost, max_cost}`.
    pub cost: Option<RawCost>,
    /// `enforce` (default) or `shadow`: decides and counts, never rejects.
    pub mode: Option<String>,
    /// `true`: one counter for every route that has a shared policy of this name (defined the
    /// same in each), instead of one per route.
    pub shared: Option<bool>,
    /// `refuse` (default) or `delay`: a request over the limit waits for a free slot up to
    /// `max_delay` instead of being refused (`docs/algorithms.md`, "Pacing").
    pub on_limit: Option<String>,
    /// With `on_limit: delay`: the longest a request waits (`2s`, `500ms`).
    pub max_delay: Option<String>,
}

/// `concurrency: {limit, lease_ttl, refuse_with}`.
#[derive(Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConcurrency {
    pub limit: u64,
    /// How long a lease lives if its request never ends (a crashed instance): default 60s.
    pub lease_ttl: Option<String>,
    /// The refusal's status: 429 (default) or 503.
    pub refuse_with: Option<u16>,
}

/// `cost:` either a fixed number of units or the cost the upstream reports in a response header.
#[derive(Debug, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum RawCost {
    Fixed(u64),
    Response(Box<RawResponseCost>),
}

/// `cost: {response_header: x-usage-tokens, fallback: 1, min_cost: 1, max_cost: N}`, or
/// `cost: {usage: openai, weights: {...}, reserve: true, max_cost: N}` (token usage read from the
/// response body, `docs/llm.md`).
#[derive(Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawResponseCost {
    /// The response header that reports the cost (one of this or `usage`).
    pub response_header: Option<String>,
    /// Token usage from the response body: `openai`, `anthropic`, or JSON pointers per kind.
    pub usage: Option<RawUsage>,
    /// The units one token of each kind costs (usage only; default 1 each).
    pub weights: Option<RawWeights>,
    /// `true`: admission reserves `max_cost` (or less, bounded by the request body) and the
    /// response's cost is settled by a refund of the difference into the window entry, bucket or
    /// period admission charged, so the counter never passes its limit.
    pub reserve: Option<bool>,
    /// The most of a JSON (not streamed) response body read for its usage (default 1MiB).
    pub max_body: Option<String>,
    /// Charged when the header is absent or not a whole number (default 1), or when the body
    /// reports no usage (default `max_cost`).
    pub fallback: Option<u64>,
    /// Required at admission and taken then (default 1).
    pub min_cost: Option<u64>,
    /// The most one response may be charged (default: the burst or limit).
    pub max_cost: Option<u64>,
}

/// `usage: openai | anthropic`, or `usage: {input: /ptr, output: /ptr, ...}`.
#[derive(Debug, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum RawUsage {
    Format(String),
    Pointers(RawUsagePointers),
}

/// JSON pointers (RFC 6901) to each kind of token count in a response body or stream event.
#[derive(Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawUsagePointers {
    pub input: Option<String>,
    pub output: Option<String>,
    pub cached_input: Option<String>,
    pub reasoning: Option<String>,
}

/// `weights: {input, output, cached_input, reasoning}`: units per token of each kind.
#[derive(Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawWeights {
    pub input: Option<f64>,
    pub output: Option<f64>,
    pub cached_input: Option<f64>,
    pub reasoning: Option<f64>,
}

#[derive(Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTokenBucket {
    pub rate: String,
    pub burst: u64,
}

#[derive(Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSlidingWindow {
    pub limit: u64,
    pub window: String,
    pub buckets: Option<u32>,
}

#[derive(Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawQuota {
    pub limit: u64,
    /// `day`, `week` (ISO, from Monday) or `month`.
    pub per: String,
    /// An IANA zone name (`Europe/Berlin`); default `UTC`.
    pub time_zone: Option<String>,
}
