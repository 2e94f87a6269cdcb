//! Validation: from the raw YAML shape to the runtime [`Snapshot`]. Every problem is collected with
//! the field path it belongs to, so one `turnstile check` run reports all of them.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::uri::{Authority, Scheme};
use http::{HeaderName, HeaderValue, Method, StatusCode, Uri};
use ipnet::IpNet;

use super::raw::*;
use super::rewrite::{PathRewrite, RouteShape};
use super::snapshot::*;
use super::units::{parse_duration, parse_rate, parse_size};
use crate::config::limited::LimitedResponse;
use crate::keys::{ClientPrefix, KeyPart, TrustedProxies};
use crate::limiter::calendar::Per;
use crate::limiter::redis::{check_target, parse_node, Auth, Target};
use crate::limiter::{Quota, Rule, SlidingWindow, TokenBucket};
use crate::normalize::{EscapedSlashes, PathOptions, PathParameters};
use crate::rate_limit_headers::MAX_POLICIES;
use crate::rate_limit_headers::{HeaderMode, RateLimitHeaders};
use crate::route::RouteMatch;

#[path = "inflight.rs"]
mod inflight;

/// A problem at a field path such as `routes[1].policies[0].token_bucket.rate`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    pub path: String,
    pub message: String,
}

struct Errors(Vec<FieldError>, Vec<FieldError>);

impl Errors {
    /// Records a warning: valid, but probably not what was meant.
    fn warn(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.1.push(FieldError {
            path: path.into(),
            message: message.into(),
        });
    }

    fn add(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(FieldError {
            path: path.into(),
            message: message.into(),
        });
    }

    /// Records a parse result's error and returns its value.
    fn take<T>(&mut self, path: impl Into<String>, result: Result<T, String>) -> Option<T> {
        result.map_err(|e| self.add(path, e)).ok()
    }
}

const NAME_HELP: &str = "names are 1-64 letters, digits, `_` or `-`";

/// A snapshot, and its warnings with their field paths (see [`Snapshot::warnings`]).
pub fn compile(
    raw: RawConfig,
    source: &Path,
) -> Result<(Snapshot, Vec<FieldError>), Vec<FieldError>> {
    let mut errors = Errors(Vec::new(), Vec::new());
    let e = &mut errors;

    let listen = socket_addr(e, "listen", raw.listen.as_deref().unwrap_or("0.0.0.0:8080"));
    let admin_listen = socket_addr(
        e,
        "admin_listen",
        raw.admin_listen.as_deref().unwrap_or("127.0.0.1:9901"),
    );
    if listen.is_some() && listen == admin_listen && listen.is_some_and(|a| a.port() != 0) {
        e.add(
            "admin_listen",
            "must differ from `listen`: the admin endpoints never share the public listener",
        );
    }

    let listen_tls = raw
        .listen_tls
        .as_ref()
        .and_then(|t| listen_tls(e, t, source, [listen, admin_listen]));

    let mut nets = Vec::new();
    for (i, text) in raw.client_ip.trusted_proxies.iter().enumerate() {
        nets.extend(e.take(format!("client_ip.trusted_proxies[{i}]"), ip_net(text)));
    }

    let global_exempt = exempt(e, "exempt", &raw.exempt);
    let client_prefix = client_prefix(e, &raw.client_ip);
    let (store, failure_mode) = store_settings(e, &raw.store);
    let mut server = server_settings(e, &raw.server);
    // Keys are read here, once per load or reload, never per request.
    let jwt = raw.jwt.as_ref().and_then(|j| {
        crate::jwt::config::compile(j, source)
            .map_err(|errs| errs.into_iter().for_each(|(path, msg)| e.add(path, msg)))
            .ok()
            .map(Arc::new)
    });
    let response_defaults = response_defaults(e, &raw.server);

    // An upstream that fails validation is still *defined*: its own error is reported once, and
    // the routes that name it must not add a false "not defined" on top.
    let upstreams: HashMap<String, Option<Arc<Upstream>>> = raw
        .upstreams
        .iter()
        .map(|(name, up)| (name.clone(), upstream(e, name, up, source).map(Arc::new)))
        .collect();

    let mut routes = Vec::new();
    let mut seen = HashMap::new();
    for (i, raw_route) in raw.routes.iter().enumerate() {
        let path = format!("routes[{i}]");
        if let Some(first) = seen.insert(raw_route.name.clone(), i) {
            e.add(
                format!("{path}.name"),
                format!(
                    "`{}` is already the name of routes[{first}]",
                    raw_route.name
                ),
            );
        }
        let jwt = (&jwt, raw.jwt.is_some());
        if let Some(mut route) = route(e, &path, raw_route, &upstreams, failure_mode, jwt) {
            let own = exempt(e, &format!("{path}.exempt"), &raw_route.exempt);
            route.exempt = Exempt {
                client_ips: [global_exempt.client_ips.clone(), own.client_ips].concat(),
                headers: [global_exempt.headers.clone(), own.headers].concat(),
            };
            route_responses(e, &path, raw_route, &mut route, &response_defaults);
            routes.push(route);
        }
    }

    shared_policies(e, &raw.routes);
    server.read_fields = read_fields(&routes);
    if server.headers_with_underscores != Underscores::Allow {
        unreachable_underscore_fields(e, &routes);
    }

    // An empty, comment-only or truncated file parses as a config with no routes: serving it
    // would answer 404 to everything and drop every limit, so it must not pass `check` or a
    // reload. The Envoy service alone (`rls:`) needs no routes: its descriptors are its rules.
    if raw.routes.is_empty() && raw.rls.is_none() {
        e.add(
            "routes",
            "no routes: every request would get 404 and no limit would apply; define at least one \
             route (only a file that configures `rls:` may have none)",
        );
    }

    let rls = raw.rls.as_ref().and_then(|r| {
        super::rls::settings::compile(r, source)
            .map_err(|errs| errs.into_iter().for_each(|(path, msg)| e.add(path, msg)))
            .ok()
    });

    let forward_auth = raw
        .forward_auth
        .as_ref()
        .and_then(|f| forward_auth(e, f, listen, admin_listen));

    match (listen, admin_listen, errors.0.is_empty()) {
        (Some(listen), Some(admin_listen), true) => Ok((
            Snapshot {
                source: source.to_path_buf(),
                source_info: super::SourceInfo::default(),
                listen,
                admin_listen,
                listen_tls,
                admin: AdminSettings {
                    show_key_values: raw.admin.show_key_values.unwrap_or(false),
                },
                trusted_proxies: TrustedProxies::new(nets),
                client_prefix,
                store,
                failure_mode,
                server,
                routes,
                rls,
                forward_auth,
                overrides_file: raw.overrides.as_ref().map(|file| match source.parent() {
                    Some(dir) => dir.join(file),
                    None => file.into(),
                }),
                overrides: Vec::new(),
                overrides_sha256: None,
                warnings: Vec::new(),
            },
            errors.1,
        )),
        _ => Err(errors.0),
    }
}

/// `listen_tls:`: its own address (not one of the other listeners') and readable, matching
/// certificate and key files.
fn listen_tls(
    e: &mut Errors,
    raw: &RawListenTls,
    source: &Path,
    others: [Option<SocketAddr>; 2],
) -> Option<crate::tls::ListenerTls> {
    let text = raw
        .listen
        .as_deref()
        .unwrap_or(super::tls::DEFAULT_LISTEN_TLS);
    let listen = socket_addr(e, "listen_tls.listen", text)?;
    if listen.port() != 0 && others.contains(&Some(listen)) {
        e.add(
            "listen_tls.listen",
            "must differ from `listen` and `admin_listen`",
        );
    }
    let handshake_timeout = timeout_or(
        e,
        "listen_tls.handshake_timeout",
        raw.handshake_timeout.as_deref(),
        super::tls::DEFAULT_HANDSHAKE_TIMEOUT,
    );
    super::tls::listener(raw, source, listen, handshake_timeout)
        .map_err(|problems| problems.into_iter().for_each(|(p, m)| e.add(p, m)))
        .ok()
}

fn forward_auth(
    e: &mut Errors,
    raw: &RawForwardAuth,
    listen: Option<SocketAddr>,
    admin_listen: Option<SocketAddr>,
) -> Option<ForwardAuthSettings> {
    let http = raw
        .listen
        .as_deref()
        .map(|t| socket_addr(e, "forward_auth.listen", t));
    let grpc = raw
        .grpc_listen
        .as_deref()
        .map(|t| socket_addr(e, "forward_auth.grpc_listen", t));
    if http.is_none() && grpc.is_none() {
        e.add(
            "forward_auth",
            "needs `listen: IP:PORT` (the HTTP /check endpoint), `grpc_listen: IP:PORT` (Envoy \
             ext_authz), or both",
        );
    }
    let taken = [("listen", listen), ("admin_listen", admin_listen)];
    for (field, addr) in [("listen", http.flatten()), ("grpc_listen", grpc.flatten())] {
        let Some(addr) = addr.filter(|a| a.port() != 0) else {
            continue;
        };
        if let Some((other, _)) = taken.iter().find(|(_, a)| *a == Some(addr)) {
            e.add(
                format!("forward_auth.{field}"),
                format!("`{addr}` is already `{other}`: every door has its own listener"),
            );
        }
    }
    if let (Some(Some(a)), Some(Some(b))) = (http, grpc) {
        if a == b && a.port() != 0 {
            e.add(
                "forward_auth.grpc_listen",
                "must differ from `forward_auth.listen`",
            );
        }
    }
    let deny_status = match raw.deny_status {
        None => Some(http::StatusCode::TOO_MANY_REQUESTS),
        Some(code) => e.take("forward_auth.deny_status", deny_status(code)),
    };
    let proxy = match raw.proxy.as_deref() {
        None => Some(CheckProxy::Auto),
        Some(text) => CheckProxy::parse(text).or_else(|| {
            e.add(
                "forward_auth.proxy",
                format!(
                    "`{text}` is not a proxy Turnstile knows: use {}",
                    CheckProxy::NAMES
                ),
            );
            None
        }),
    };
    Some(ForwardAuthSettings {
        listen: http.flatten(),
        grpc_listen: grpc.flatten(),
        deny_status: deny_status?,
        proxy: proxy?,
    })
}

/// A refusal's status: a 4xx or 5xx (nginx's `auth_request` passes on only 401 and 403).
pub fn deny_status(code: u16) -> Result<StatusCode, String> {
    StatusCode::from_u16(code)
        .ok()
        .filter(|s| s.is_client_error() || s.is_server_error())
        .ok_or_else(|| format!("`{code}` is not a 4xx or 5xx status (e.g. 429, or 403 for nginx)"))
}

/// A CIDR range, or a single IP as its own /32 or /128.
fn ip_net(text: &str) -> Result<IpNet, String> {
    text.parse::<IpNet>()
        .or_else(|_| text.parse::<std::net::IpAddr>().map(IpNet::from))
        .map_err(|_| format!("`{text}` is not an IP address or CIDR range (e.g. 10.0.0.0/8)"))
}

fn socket_addr(e: &mut Errors, path: &str, text: &str) -> Option<SocketAddr> {
    e.take(
        path,
        text.parse().map_err(|_| {
            format!("`{text}` is not an address; expected IP:PORT (e.g. 0.0.0.0:8080)")
        }),
    )
}

fn duration_or(e: &mut Errors, path: &str, text: Option<&str>, default: Duration) -> Duration {
    text.and_then(|t| e.take(path, parse_duration(t)))
        .unwrap_or(default)
}

/// [`duration_or`] for a timeout that zero would break: every request would time out at once.
fn timeout_or(e: &mut Errors, path: &str, text: Option<&str>, default: Duration) -> Duration {
    let d = duration_or(e, path, text, default);
    if d.is_zero() {
        e.add(path, "must be more than 0ms (and at most 365d)");
        return default;
    }
    d
}

/// The most counters the memory store may be asked to hold; far above what fits in memory
/// anyway, it only keeps the arithmetic on it sane.
const MAX_KEYS_LIMIT: u64 = 1_000_000_000;

/// The longest a token bucket may take to refill from empty (`burst / rate`): 100 years.
const MAX_REFILL_S: f64 = 100.0 * 365.0 * 86_400.0;

fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn failure_mode(e: &mut Errors, path: &str, text: &str) -> Option<FailureMode> {
    match text {
        "open" => Some(FailureMode::Open),
        "closed" => Some(FailureMode::Closed),
        other => {
            e.add(
                path,
                format!("`{other}` is not a failure mode; expected `open` or `closed`"),
            );
            None
        }
    }
}

fn store_settings(e: &mut Errors, raw: &RawStore) -> (StoreSettings, FailureMode) {
    let mode = raw
        .failure_mode
        .as_deref()
        .and_then(|m| failure_mode(e, "store.failure_mode", m))
        .unwrap_or(FailureMode::Open);
    let memory_only = |e: &mut Errors, field: &str, set: bool| {
        if set {
            e.add(format!("store.{field}"), "applies to `type: redis` only");
        }
    };
    let settings = match raw.kind.as_deref().unwrap_or("memory") {
        "memory" => {
            memory_only(e, "url", raw.url.is_some());
            memory_only(e, "cluster", raw.cluster.is_some());
            memory_only(e, "sentinel", raw.sentinel.is_some());
            memory_only(e, "username", raw.username.is_some());
            memory_only(e, "password", raw.password.is_some());
            memory_only(e, "pool_size", raw.pool_size.is_some());
            memory_only(e, "timeout", raw.timeout.is_some());
            memory_only(e, "key_prefix", raw.key_prefix.is_some());
            let max_keys = raw.max_keys.unwrap_or(1_000_000);
            if !(1..=MAX_KEYS_LIMIT).contains(&max_keys) {
                e.add(
                    "store.max_keys",
                    format!("must be between 1 and {MAX_KEYS_LIMIT}"),
                );
            }
            StoreSettings::Memory {
                max_keys: max_keys as usize,
            }
        }
        "redis" => {
            if raw.max_keys.is_some() {
                e.add(
                    "store.max_keys",
                    "applies to `type: memory` only; Redis bounds memory itself (maxmemory)",
                );
            }
            let target = redis_target(e, raw);
            let pool_size = raw.pool_size.unwrap_or(4);
            if !(1..=64).contains(&pool_size) {
                e.add("store.pool_size", "must be between 1 and 64");
            }
            let timeout = timeout_or(
                e,
                "store.timeout",
                raw.timeout.as_deref(),
                Duration::from_millis(50),
            );
            StoreSettings::Redis {
                target,
                pool_size: pool_size as usize,
                timeout,
                key_prefix: match raw.key_prefix.clone() {
                    Some(prefix) if prefix.contains(['{', '}']) => {
                        e.add(
                            "store.key_prefix",
                            "must not contain `{` or `}`: the Redis Cluster hash tag that \
                             follows it must be the counter's own",
                        );
                        prefix
                    }
                    Some(prefix) => prefix,
                    None => "turnstile:".to_string(),
                },
            }
        }
        other => {
            e.add(
                "store.type",
                format!("`{other}` is not a store; expected `memory` or `redis`"),
            );
            StoreSettings::Memory { max_keys: 1 }
        }
    };
    (settings, mode)
}

/// One of `url` (or `TURNSTILE_REDIS_URL`), `cluster` and `sentinel`; `url` by default.
fn redis_target(e: &mut Errors, raw: &RawStore) -> Target {
    let auth = Auth {
        username: raw.username.clone(),
        password: raw.password.clone(),
    };
    let named = [
        ("url", raw.url.is_some()),
        ("cluster", raw.cluster.is_some()),
        ("sentinel", raw.sentinel.is_some()),
    ];
    if named.iter().filter(|(_, set)| *set).count() > 1 {
        let field = if raw.cluster.is_some() && raw.url.is_some() {
            "store.cluster"
        } else {
            "store.sentinel"
        };
        e.add(field, "set only one of `url`, `cluster` and `sentinel`");
    }
    let nodes = |e: &mut Errors, field: &str, nodes: &[String]| {
        if nodes.is_empty() {
            e.add(field, "needs at least one host:port");
        }
        for (i, node) in nodes.iter().enumerate() {
            if let Err(why) = parse_node(node) {
                e.add(format!("{field}[{i}]"), why);
            }
        }
        nodes.to_vec()
    };
    if let Some(cluster) = &raw.cluster {
        return Target::Cluster {
            nodes: nodes(e, "store.cluster", cluster),
            auth,
        };
    }
    if let Some(sentinel) = &raw.sentinel {
        if sentinel.service.is_empty() {
            e.add("store.sentinel.service", "must not be empty");
        }
        return Target::Sentinel {
            service: sentinel.service.clone(),
            nodes: nodes(e, "store.sentinel.nodes", &sentinel.nodes),
            auth,
        };
    }
    for (field, set) in [
        ("username", raw.username.is_some()),
        ("password", raw.password.is_some()),
    ] {
        if set {
            e.add(
                format!("store.{field}"),
                "applies to `cluster` and `sentinel`; a `url` carries its own credentials",
            );
        }
    }
    let from_env = std::env::var("TURNSTILE_REDIS_URL").ok();
    let url = from_env
        .clone()
        .or_else(|| raw.url.clone())
        .unwrap_or_else(|| "redis://127.0.0.1:6379".to_string());
    // Never echo the URL: it may carry a password.
    let source = if from_env.is_some() {
        " (from TURNSTILE_REDIS_URL)"
    } else {
        ""
    };
    let target = Target::Url(url);
    if let Err(why) = check_target(&target) {
        e.add("store.url", format!("{why}{source}"));
    }
    target
}

fn client_prefix(e: &mut Errors, raw: &RawClientIp) -> ClientPrefix {
    let mut prefix = ClientPrefix::default();
    let mut read = |field: &str, value: Option<u32>, max: u8, out: &mut u8| match value {
        Some(v @ 1..=128) if v <= u32::from(max) => *out = v as u8,
        Some(v) => e.add(
            format!("client_ip.{field}"),
            format!("{v} is not a prefix length; expected 1-{max}"),
        ),
        None => {}
    };
    read("ipv4_prefix", raw.ipv4_prefix, 32, &mut prefix.ipv4);
    read("ipv6_prefix", raw.ipv6_prefix, 128, &mut prefix.ipv6);
    prefix
}

fn path_options(e: &mut Errors, raw: &RawServer) -> PathOptions {
    let defaults = PathOptions::default();
    PathOptions {
        normalize_path: raw.normalize_path.unwrap_or(defaults.normalize_path),
        merge_slashes: raw.merge_slashes.unwrap_or(defaults.merge_slashes),
        escaped_slashes: match raw.escaped_slashes.as_deref() {
            None | Some("reject") => EscapedSlashes::Reject,
            Some("keep") => EscapedSlashes::Keep,
            Some(other) => {
                e.add(
                    "server.escaped_slashes",
                    format!("`{other}` is not an action; expected `reject` or `keep`"),
                );
                defaults.escaped_slashes
            }
        },
        path_parameters: match raw.path_parameters.as_deref() {
            None | Some("reject") => PathParameters::Reject,
            Some("strip") => PathParameters::Strip,
            Some("keep") => PathParameters::Keep,
            Some(other) => {
                e.add(
                    "server.path_parameters",
                    format!("`{other}` is not an action; expected `reject`, `strip` or `keep`"),
                );
                defaults.path_parameters
            }
        },
    }
}

fn server_settings(e: &mut Errors, raw: &RawServer) -> ServerSettings {
    ServerSettings {
        paths: path_options(e, raw),
        max_body_size: raw
            .max_body_size
            .as_deref()
            .and_then(|t| e.take("server.max_body_size", parse_size(t)))
            .unwrap_or(10 << 20),
        header_read_timeout: timeout_or(
            e,
            "server.header_read_timeout",
            raw.header_read_timeout.as_deref(),
            Duration::from_secs(10),
        ),
        // 0 is allowed: stop at once, cutting in-flight requests, as an operator may want.
        shutdown_grace: duration_or(
            e,
            "server.shutdown_grace",
            raw.shutdown_grace.as_deref(),
            Duration::from_secs(30),
        ),
        body_read_timeout: timeout_or(
            e,
            "server.body_read_timeout",
            raw.body_read_timeout.as_deref(),
            DEFAULT_BODY_READ_TIMEOUT,
        ),
        min_body_rate: min_body_rate(e, raw),
        max_connections: bounded_count(
            e,
            "server.max_connections",
            raw.max_connections,
            DEFAULT_MAX_CONNECTIONS,
            1_000_000,
        ),
        max_header_size: max_header_size(e, raw.max_header_size.as_deref()),
        allowed_upgrades: allowed_upgrades(e, raw.allowed_upgrades.as_deref()),
        headers_with_underscores: headers_with_underscores(e, raw),
        // Filled in from the routes once they are compiled (`read_fields`).
        read_fields: Vec::new(),
    }
}

/// `server.min_body_rate` (`SIZE/s` or `off`) and its grace.
fn min_body_rate(e: &mut Errors, raw: &RawServer) -> Option<MinBodyRate> {
    let grace = duration_or(
        e,
        "server.min_body_rate_grace",
        raw.min_body_rate_grace.as_deref(),
        DEFAULT_MIN_BODY_RATE.grace,
    );
    let bytes_per_second = match raw.min_body_rate.as_deref().map(str::trim) {
        None => DEFAULT_MIN_BODY_RATE.bytes_per_second,
        Some("off") => return None,
        Some(text) => {
            let parsed = match text.strip_suffix("/s") {
                Some(size) => parse_size(size).and_then(|n| match n {
                    0 => Err("must be more than 0 bytes a second, or `off`".to_string()),
                    n => Ok(n),
                }),
                None => Err(format!(
                    "`{text}` is not a rate; expected a size a second (`1KiB/s`) or `off`"
                )),
            };
            e.take("server.min_body_rate", parsed)?
        }
    };
    Some(MinBodyRate {
        bytes_per_second,
        grace,
    })
}

fn headers_with_underscores(e: &mut Errors, raw: &RawServer) -> Underscores {
    match raw.headers_with_underscores.as_deref() {
        None | Some("drop") => Underscores::Drop,
        Some("reject") => Underscores::Reject,
        Some("allow") => Underscores::Allow,
        Some(other) => {
            e.add(
                "server.headers_with_underscores",
                format!("`{other}` is not an action; expected `drop`, `reject` or `allow`"),
            );
            Underscores::Drop
        }
    }
}

/// A field named with an underscore never reaches a decision unless such names are allowed:
/// a route that reads one could never match, key or exempt on it.
fn unreachable_underscore_fields(e: &mut Errors, routes: &[Route]) {
    const HELP: &str = "is named with an underscore, and such request fields are dropped or \
                        refused (`server.headers_with_underscores: allow` lets them through)";
    for (i, route) in routes.iter().enumerate() {
        for (j, policy) in route.policies.iter().enumerate() {
            for part in &policy.key {
                if let KeyPart::Header(name) = part {
                    if name.as_str().contains('_') {
                        e.add(
                            format!("routes[{i}].policies[{j}].key"),
                            format!("`header:{name}` {HELP}"),
                        );
                    }
                }
            }
        }
        for name in route.matcher.header_names() {
            if name.as_str().contains('_') {
                e.add(
                    format!("routes[{i}].match.headers"),
                    format!("`{name}` {HELP}"),
                );
            }
        }
    }
}

/// The request fields the routes read: route `headers:`, `header:` key parts and
/// `exempt.headers`, each once.
fn read_fields(routes: &[Route]) -> Vec<http::HeaderName> {
    let mut names: Vec<http::HeaderName> = Vec::new();
    for route in routes {
        let keyed = route
            .policies
            .iter()
            .flat_map(|p| &p.key)
            .filter_map(|part| match part {
                KeyPart::Header(name) => Some(name),
                _ => None,
            });
        let matched = route.matcher.header_names();
        let exempt = route.exempt.headers.iter().map(|(name, _)| name);
        for name in keyed.chain(matched).chain(exempt) {
            if !names.contains(name) {
                names.push(name.clone());
            }
        }
    }
    names
}

/// Like NGINX's `client_body_timeout` (60 s there).
const DEFAULT_BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// 1 KiB/s after 5 s of waiting: see "Slow bodies" in `docs/hardening.md`.
pub const DEFAULT_MIN_BODY_RATE: MinBodyRate = MinBodyRate {
    bytes_per_second: 1024,
    grace: Duration::from_secs(5),
};
/// With `max_header_size`, bounds the memory held by half-sent heads to about 4096 × 32 KiB.
const DEFAULT_MAX_CONNECTIONS: u64 = 4096;
/// NGINX's `large_client_header_buffers` default (4 × 8k) allows 32 KiB heads too.
const DEFAULT_MAX_HEADER_SIZE: u64 = 32 << 10;
/// The most connections per upstream, as many as the pool keeps idle.
const DEFAULT_UPSTREAM_MAX_CONNECTIONS: u64 = super::MAX_IDLE as u64;
const DEFAULT_POOL_TIMEOUT: Duration = Duration::from_secs(5);

fn bounded_count(e: &mut Errors, path: &str, value: Option<u64>, default: u64, max: u64) -> usize {
    let value = value.unwrap_or(default);
    if !(1..=max).contains(&value) {
        e.add(path, format!("must be between 1 and {max}"));
    }
    value.clamp(1, max) as usize
}

fn max_header_size(e: &mut Errors, text: Option<&str>) -> usize {
    const PATH: &str = "server.max_header_size";
    // hyper's HTTP/1 read buffer cannot be smaller than 8 KiB.
    const RANGE: std::ops::RangeInclusive<u64> = (8 << 10)..=(1 << 20);
    let size = text
        .and_then(|t| e.take(PATH, parse_size(t)))
        .unwrap_or(DEFAULT_MAX_HEADER_SIZE);
    if !RANGE.contains(&size) {
        e.add(PATH, "must be between 8KiB and 1MiB");
    }
    size.clamp(*RANGE.start(), *RANGE.end()) as usize
}

/// Protocol names as `Upgrade` lists them (RFC 9110 §7.8: `token ["/" token]`), matched without
/// their version and case-insensitively.
fn allowed_upgrades(e: &mut Errors, raw: Option<&[String]>) -> Vec<String> {
    let Some(raw) = raw else {
        return vec!["websocket".to_string()];
    };
    let mut names = Vec::new();
    for (i, name) in raw.iter().enumerate() {
        let token = !name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
        if token {
            names.push(name.to_ascii_lowercase());
        } else {
            e.add(
                format!("server.allowed_upgrades[{i}]"),
                format!("`{name}` is not a protocol name (a token such as `websocket`)"),
            );
        }
    }
    names
}

fn upstream(e: &mut Errors, name: &str, raw: &RawUpstream, source: &Path) -> Option<Upstream> {
    let path = format!("upstreams.{name}");
    if !valid_name(name) {
        e.add(&path, NAME_HELP);
    }
    let connect_timeout = timeout_or(
        e,
        &format!("{path}.connect_timeout"),
        raw.connect_timeout.as_deref(),
        Duration::from_secs(1),
    );
    let timeout = timeout_or(
        e,
        &format!("{path}.timeout"),
        raw.timeout.as_deref(),
        Duration::from_secs(30),
    );
    let max_connections = bounded_count(
        e,
        &format!("{path}.max_connections"),
        raw.max_connections,
        DEFAULT_UPSTREAM_MAX_CONNECTIONS,
        65_535,
    );
    let pool_timeout = timeout_or(
        e,
        &format!("{path}.pool_timeout"),
        raw.pool_timeout.as_deref(),
        DEFAULT_POOL_TIMEOUT,
    );
    let balance = match raw.balance.as_deref() {
        None | Some("round_robin") => Balance::RoundRobin,
        Some("least_in_flight") => Balance::LeastInFlight,
        Some(other) => {
            e.add(
                format!("{path}.balance"),
                format!("`{other}` is not a balance; expected round_robin or least_in_flight"),
            );
            Balance::RoundRobin
        }
    };
    let eject_for = timeout_or(
        e,
        &format!("{path}.eject_for"),
        raw.eject_for.as_deref(),
        DEFAULT_EJECT_FOR,
    );
    let targets: Vec<(Scheme, Authority)> = match (&raw.url, &raw.targets) {
        (Some(url), None) => vec![target_url(e, &format!("{path}.url"), url)?],
        (None, Some(list)) if !list.is_empty() => {
            let mut targets: Vec<(Scheme, Authority)> = Vec::new();
            let mut ok = true;
            for (i, url) in list.iter().enumerate() {
                let tpath = format!("{path}.targets[{i}]");
                match target_url(e, &tpath, url) {
                    Some(t) if targets.iter().any(|(_, a)| *a == t.1) => {
                        e.add(tpath, format!("`{url}` is listed twice"));
                        ok = false;
                    }
                    // One scheme per upstream: its TLS settings apply to every target or none.
                    Some(t) if targets.first().is_some_and(|(first, _)| *first != t.0) => {
                        e.add(
                            tpath,
                            "every target of an upstream must use the same scheme",
                        );
                        ok = false;
                    }
                    Some(t) => targets.push(t),
                    None => ok = false,
                }
            }
            if !ok {
                return None;
            }
            targets
        }
        (None, Some(_)) => {
            e.add(
                format!("{path}.targets"),
                "must list at least one http://HOST:PORT or https://HOST:PORT",
            );
            return None;
        }
        (Some(_), Some(_)) => {
            e.add(&path, "give either `url` or `targets`, not both");
            return None;
        }
        (None, None) => {
            e.add(
                &path,
                "needs `url: http://HOST:PORT` or `targets: [http://HOST:PORT, ...]`",
            );
            return None;
        }
    };
    let scheme = targets[0].0.clone();
    let targets: Vec<Authority> = targets.into_iter().map(|(_, a)| a).collect();
    let tls = match super::tls::upstream(&path, raw, scheme == Scheme::HTTPS, source) {
        Ok((tls, warnings)) => {
            // Logged at start and on every reload, printed by `check`.
            for (p, m) in warnings {
                e.warn(p, m);
            }
            tls
        }
        Err(problems) => {
            problems.into_iter().for_each(|(p, m)| e.add(p, m));
            return None;
        }
    };
    Some(Upstream {
        name: name.to_string(),
        scheme,
        authority: targets[0].clone(),
        targets,
        balance,
        eject_for,
        connect_timeout,
        timeout,
        max_connections,
        pool_timeout,
        tls,
    })
}

/// NGINX's `fail_timeout` default: long enough not to hammer a dead target, short enough that a
/// restarted one is back soon.
const DEFAULT_EJECT_FOR: Duration = Duration::from_secs(10);

/// One target: `http://HOST:PORT` or `https://HOST:PORT`, no path (the request's own path is
/// forwarded).
fn target_url(e: &mut Errors, path: &str, url: &str) -> Option<(Scheme, Authority)> {
    let uri = match url.parse::<Uri>() {
        Ok(uri) => uri,
        Err(_) => {
            e.add(
                path,
                format!("`{url}` is not a URL; expected http://HOST:PORT or https://HOST:PORT"),
            );
            return None;
        }
    };
    let scheme = match uri.scheme_str() {
        Some("https") => Some(Scheme::HTTPS),
        Some("http") => Some(Scheme::HTTP),
        _ => None,
    };
    match (scheme, uri.authority(), uri.path()) {
        (Some(scheme), Some(authority), "" | "/") => Some((scheme, authority.clone())),
        (Some(_), Some(_), _) => {
            e.add(
                path,
                "must not have a path: the request's own path is forwarded",
            );
            None
        }
        _ => {
            e.add(
                path,
                format!(
                    "`{url}`: only http://HOST:PORT and https://HOST:PORT upstreams are supported"
                ),
            );
            None
        }
    }
}

fn route(
    e: &mut Errors,
    path: &str,
    raw: &RawRoute,
    upstreams: &HashMap<String, Option<Arc<Upstream>>>,
    default_mode: FailureMode,
    (jwt, jwt_block): (&Option<Arc<crate::jwt::Verifier>>, bool),
) -> Option<Route> {
    if !valid_name(&raw.name) {
        e.add(format!("{path}.name"), NAME_HELP);
    }
    let (matcher, params) = route_match(e, path, &raw.matcher);
    // A bad `match` is reported once; its captures are unknown, so a rewrite is not judged.
    let rewrite = match matcher {
        Some(_) => path_rewrite(e, path, raw, &params),
        None => Some(None),
    };
    let action = match (&raw.upstream, &raw.respond) {
        (Some(name), None) => match upstreams.get(name) {
            Some(Some(up)) => Some(Action::Forward(up.clone())),
            Some(None) => None,
            None => {
                let mut known: Vec<&str> = upstreams.keys().map(String::as_str).collect();
                known.sort_unstable();
                let hint = if known.is_empty() {
                    "no upstreams are defined; add one under `upstreams:`".to_string()
                } else {
                    format!("defined: {}", known.join(", "))
                };
                e.add(
                    format!("{path}.upstream"),
                    format!("`{name}` is not defined under `upstreams` ({hint})"),
                );
                None
            }
        },
        (None, Some(respond)) => {
            direct_response(e, &format!("{path}.respond"), respond).map(Action::Respond)
        }
        (Some(_), Some(_)) => {
            e.add(path, "give either `upstream` or `respond`, not both");
            None
        }
        (None, None) => {
            e.warn(
                path,
                format!(
                    "route `{}` has neither `upstream` nor `respond`: a check-only route, decided \
                     by `forward_auth` only; the inline gateway answers it with 500",
                    raw.name
                ),
            );
            Some(Action::CheckOnly)
        }
    };
    let failure_mode = raw
        .failure_mode
        .as_deref()
        .and_then(|m| failure_mode(e, &format!("{path}.failure_mode"), m))
        .unwrap_or(default_mode);

    let mut policies = Vec::new();
    let mut names = HashMap::new();
    for (j, raw_policy) in raw.policies.iter().enumerate() {
        let ppath = format!("{path}.policies[{j}]");
        if let Some(first) = names.insert(raw_policy.name.as_str(), j) {
            e.add(
                format!("{ppath}.name"),
                format!(
                    "`{}` is already the name of policies[{first}]",
                    raw_policy.name
                ),
            );
        }
        if let Some(p) = policy(e, &ppath, &raw.name, raw_policy, &params, jwt_block) {
            inflight::check_door(e, &ppath, &p, action.as_ref());
            policies.push(p);
        }
    }
    let require_jwt = raw.require_jwt.unwrap_or(false);
    if require_jwt && !jwt_block {
        e.add(
            format!("{path}.require_jwt"),
            "needs a top-level `jwt:` block with the keys that verify tokens (docs/jwt.md)",
        );
    }
    let needs_jwt = require_jwt || policies.iter().any(Policy::uses_jwt);
    Some(Route {
        name: raw.name.as_str().into(),
        matcher: matcher?,
        action: action?,
        policies,
        failure_mode,
        exempt: Exempt::default(),
        jwt: jwt.clone().filter(|_| needs_jwt),
        require_jwt,
        rate_limit_headers: Default::default(),
        limited_response: Default::default(),
        rewrite: rewrite?,
    })
}

/// `strip_prefix` or `rewrite`, checked against the route's `match` ([`super::rewrite`]).
/// `Some(None)` when there is neither; `None` on an error.
fn path_rewrite(
    e: &mut Errors,
    path: &str,
    raw: &RawRoute,
    params: &[String],
) -> Option<Option<PathRewrite>> {
    let shape = RouteShape {
        literal_start: match (&raw.matcher.path, &raw.matcher.prefix) {
            (Some(pattern), _) => pattern.split('{').next(),
            (None, Some(prefix)) => Some(prefix.as_str()),
            (None, None) => None,
        },
        pattern: raw.matcher.path.is_some(),
        captures: params,
    };
    let (field, result) = match (&raw.strip_prefix, &raw.rewrite) {
        (None, None) => return Some(None),
        (Some(_), Some(_)) => {
            e.add(path, "give either `strip_prefix` or `rewrite`, not both");
            return None;
        }
        (Some(prefix), None) => ("strip_prefix", PathRewrite::strip_prefix(prefix, shape)),
        (None, Some(template)) => ("rewrite", PathRewrite::template(template, shape)),
    };
    if raw.upstream.is_none() {
        e.add(
            format!("{path}.{field}"),
            "only a route with an `upstream` forwards a path",
        );
        return None;
    }
    e.take(format!("{path}.{field}"), result).map(Some)
}

/// `exempt:` (global or a route's): CIDRs or single IPs, and exact header values.
fn exempt(e: &mut Errors, path: &str, raw: &RawExempt) -> Exempt {
    let mut out = Exempt::default();
    for (i, text) in raw.client_ips.iter().enumerate() {
        out.client_ips
            .extend(e.take(format!("{path}.client_ips[{i}]"), ip_net(text)));
    }
    for (name, value) in &raw.headers {
        out.headers.extend(header_pair(
            e,
            &format!("{path}.headers.{name}"),
            name,
            value,
        ));
    }
    out
}

/// A configured `NAME: VALUE` header condition, both halves checked (each error at `path`).
fn header_pair(
    e: &mut Errors,
    path: &str,
    name: &str,
    value: &str,
) -> Option<(HeaderName, HeaderValue)> {
    let n = e.take(
        path,
        HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| format!("`{name}` is not a header name")),
    );
    let v = e.take(
        path,
        HeaderValue::from_str(value).map_err(|_| format!("`{value}` is not a valid header value")),
    );
    n.zip(v)
}

fn route_match(e: &mut Errors, path: &str, raw: &RawMatch) -> (Option<RouteMatch>, Vec<String>) {
    let (matcher, params) = match (&raw.path, &raw.prefix) {
        (Some(pattern), None) => match RouteMatch::with_pattern(pattern) {
            Ok((m, names)) => (Some(m), names),
            Err(msg) => {
                e.add(format!("{path}.match.path"), msg);
                (None, Vec::new())
            }
        },
        (None, Some(prefix)) => (
            e.take(
                format!("{path}.match.prefix"),
                RouteMatch::with_prefix(prefix),
            ),
            Vec::new(),
        ),
        (None, None) => (Some(RouteMatch::default()), Vec::new()),
        (Some(_), Some(_)) => {
            e.add(
                format!("{path}.match"),
                "give either `path` or `prefix`, not both",
            );
            (None, Vec::new())
        }
    };
    let mut matcher = matcher;
    if let Some(m) = matcher.as_mut() {
        if let Some(methods) = &raw.methods {
            let mut parsed = Vec::new();
            for (k, text) in methods.iter().enumerate() {
                let upper = text.to_ascii_uppercase();
                parsed.extend(
                    e.take(
                        format!("{path}.match.methods[{k}]"),
                        Method::from_bytes(upper.as_bytes())
                            .map_err(|_| format!("`{text}` is not an HTTP method")),
                    ),
                );
            }
            m.set_methods(parsed);
        }
        if let Some(host) = &raw.host {
            m.set_host(host);
        }
        for (name, value) in &raw.headers {
            let hpath = format!("{path}.match.headers.{name}");
            if let Some((n, v)) = header_pair(e, &hpath, name, value) {
                m.add_header(n, v);
            }
        }
    }
    (matcher, params)
}

fn direct_response(e: &mut Errors, path: &str, raw: &RawRespond) -> Option<DirectResponse> {
    let status = e.take(
        format!("{path}.status"),
        StatusCode::from_u16(raw.status)
            .map_err(|_| format!("`{}` is not an HTTP status (100-999)", raw.status)),
    )?;
    let content_type = raw
        .content_type
        .as_deref()
        .unwrap_or("text/plain; charset=utf-8");
    let content_type = e.take(
        format!("{path}.content_type"),
        HeaderValue::from_str(content_type).map_err(|_| "not a valid header value".to_string()),
    )?;
    Some(DirectResponse {
        status,
        body: Bytes::from(raw.body.clone()),
        content_type,
    })
}

const KEY_HELP: &str =
    "key parts are client_ip, header:NAME, path:PARAM, query:NAME, method, host, jwt:CLAIM";

fn policy(
    e: &mut Errors,
    path: &str,
    route: &str,
    raw: &RawPolicy,
    params: &[String],
    jwt_block: bool,
) -> Option<Policy> {
    if !valid_name(&raw.name) {
        e.add(format!("{path}.name"), NAME_HELP);
    }
    if raw.key.is_empty() {
        e.add(
            format!("{path}.key"),
            format!("must list at least one part; {KEY_HELP}"),
        );
    }
    let mut key = Vec::new();
    for (k, text) in raw.key.iter().enumerate() {
        let part = key_part(text, params, jwt_block).map_err(|m| format!("`{text}`: {m}"));
        key.extend(e.take(format!("{path}.key[{k}]"), part));
    }
    let cost = inflight::admission_cost(raw);
    if cost == 0 {
        // A zero cost would check without ever consuming: the policy would never limit.
        e.add(
            format!("{path}.cost"),
            "must be at least 1 (and at most the burst or limit)",
        );
    }
    let rule = match (&raw.token_bucket, &raw.sliding_window) {
        _ if raw.concurrency.is_some() => inflight::concurrency(e, path, raw),
        (Some(_), _) | (_, Some(_)) if raw.quota.is_some() => {
            e.add(
                path,
                "give one of `token_bucket`, `sliding_window` or `quota`",
            );
            None
        }
        (None, None) if raw.quota.is_some() => {
            raw.quota.as_ref().and_then(|q| quota(e, path, q, cost))
        }
        (Some(tb), None) => {
            let rate = e.take(format!("{path}.token_bucket.rate"), parse_rate(&tb.rate));
            // The bucket refills from empty in burst / rate, which bounds `Reset` and
            // `Retry-After`: a century keeps them far from overflowing microseconds, and still
            // allows the "never refills during a test" buckets (`1/d`, burst 1000).
            let refill_s = rate.map_or(0.0, |r| tb.burst as f64 / r);
            if refill_s > MAX_REFILL_S * (1.0 + 1e-12) {
                e.add(
                    format!("{path}.token_bucket"),
                    format!(
                        "burst / rate is {refill_s:.0} s: the bucket must refill from empty \
                         within 100 years, 36500d (raise the rate or lower the burst)"
                    ),
                );
            }
            if tb.burst == 0 {
                e.add(format!("{path}.token_bucket.burst"), "must be at least 1");
            } else if cost > tb.burst {
                e.add(
                    format!("{path}.cost"),
                    format!(
                        "{cost} is more than the burst ({}): no request could ever pass",
                        tb.burst
                    ),
                );
            }
            rate.map(|rate| {
                Rule::TokenBucket(TokenBucket {
                    rate,
                    burst: tb.burst,
                })
            })
        }
        (None, Some(sw)) => {
            let window = e.take(
                format!("{path}.sliding_window.window"),
                parse_duration(&sw.window),
            );
            if sw.limit == 0 {
                e.add(format!("{path}.sliding_window.limit"), "must be at least 1");
            } else if cost > sw.limit {
                e.add(
                    format!("{path}.cost"),
                    format!(
                        "{cost} is more than the limit ({}): no request could ever pass",
                        sw.limit
                    ),
                );
            }
            let buckets = sw.buckets.unwrap_or(0);
            window.and_then(|window| {
                let window_us = window.as_micros() as u64;
                if window_us == 0 {
                    e.add(
                        format!("{path}.sliding_window.window"),
                        "must be more than 0ms",
                    );
                    return None;
                }
                if buckets > 0 && (!window_us.is_multiple_of(u64::from(buckets)) || buckets > 3600)
                {
                    e.add(
                        format!("{path}.sliding_window.buckets"),
                        format!("must be 1-3600 and divide the window ({window_us} µs) evenly"),
                    );
                    return None;
                }
                Some(Rule::SlidingWindow(SlidingWindow {
                    limit: sw.limit,
                    window_us,
                    buckets,
                }))
            })
        }
        (Some(_), Some(_)) => {
            e.add(
                path,
                "give either `token_bucket` or `sliding_window`, not both",
            );
            None
        }
        (None, None) => {
            e.add(
                path,
                "needs `token_bucket: {rate, burst}`, `sliding_window: {limit, window}`, \
                 `quota: {limit, per}` or `concurrency: {limit}`",
            );
            None
        }
    };
    if key.len() != raw.key.len() {
        return None;
    }
    let mut policy = Policy::new(route, &raw.name, key, rule?, cost);
    if raw.shared == Some(true) {
        policy.share();
    }
    inflight::finish(e, path, raw, &mut policy);
    Some(policy)
}

/// Every shared policy of one name must be defined the same wherever it appears: its routes count
/// on one counter, which has one limit. A difference is an error at the first field that differs,
/// in each place after the first.
fn shared_policies(e: &mut Errors, routes: &[RawRoute]) {
    let mut first: HashMap<&str, (usize, usize, &RawPolicy)> = HashMap::new();
    for (i, route) in routes.iter().enumerate() {
        for (j, p) in route.policies.iter().enumerate() {
            if p.shared != Some(true) {
                continue;
            }
            let Some(&(fi, fj, f)) = first.get(p.name.as_str()) else {
                first.insert(&p.name, (i, j, p));
                continue;
            };
            let differs = [
                ("key", p.key != f.key),
                ("token_bucket", p.token_bucket != f.token_bucket),
                ("sliding_window", p.sliding_window != f.sliding_window),
                ("quota", p.quota != f.quota),
                ("concurrency", p.concurrency != f.concurrency),
                ("cost", p.cost != f.cost),
                ("mode", p.mode != f.mode),
            ];
            if let Some((field, _)) = differs.iter().find(|(_, d)| *d) {
                e.add(
                    format!("routes[{i}].policies[{j}].{field}"),
                    format!(
                        "shared policy `{}` has another `{field}` in route `{}` \
                         (routes[{fi}].policies[{fj}]): the routes that share it count on one \
                         counter, so each must define it the same",
                        p.name, routes[fi].name
                    ),
                );
            }
        }
    }
}

/// A calendar quota: `{limit, per: day | week | month, time_zone}`.
fn quota(e: &mut Errors, path: &str, raw: &RawQuota, cost: u64) -> Option<Rule> {
    if raw.limit == 0 {
        e.add(format!("{path}.quota.limit"), "must be at least 1");
    } else if cost > raw.limit {
        e.add(
            format!("{path}.cost"),
            format!(
                "{cost} is more than the limit ({}): no request could ever pass",
                raw.limit
            ),
        );
    }
    let per = Per::parse(&raw.per);
    if per.is_none() {
        e.add(
            format!("{path}.quota.per"),
            format!("`{}`: expected day, week or month", raw.per),
        );
    }
    let zone = raw.time_zone.as_deref().unwrap_or("UTC");
    let time_zone = zone.parse::<chrono_tz::Tz>().ok();
    if time_zone.is_none() {
        e.add(
            format!("{path}.quota.time_zone"),
            format!("`{zone}` is not an IANA time zone (such as UTC or Europe/Berlin)"),
        );
    }
    Some(Rule::Quota(Quota {
        limit: raw.limit,
        per: per?,
        time_zone: time_zone?,
    }))
}

fn key_part(text: &str, params: &[String], jwt_block: bool) -> Result<KeyPart, String> {
    let (kind, arg) = text.split_once(':').unwrap_or((text, ""));
    match (kind, arg) {
        ("client_ip", "") => Ok(KeyPart::ClientIp),
        ("method", "") => Ok(KeyPart::Method),
        ("host", "") => Ok(KeyPart::Host),
        ("header", name) if !name.is_empty() => HeaderName::from_bytes(name.as_bytes())
            .map(KeyPart::Header)
            .map_err(|_| format!("`{name}` is not a header name")),
        ("query", name) if !name.is_empty() => Ok(KeyPart::Query(name.into())),
        ("jwt", _) if !jwt_block => Err(
            "needs a top-level `jwt:` block with the keys that verify tokens: an unverified \
             claim would let anyone mint a bucket (docs/jwt.md)"
                .to_string(),
        ),
        ("jwt", claim) if !claim.is_empty() => Ok(KeyPart::Jwt(claim.into())),
        ("path", name) if !name.is_empty() => match params.iter().position(|p| p == name) {
            Some(index) => Ok(KeyPart::PathParam(index)),
            None if params.is_empty() => Err(format!(
                "the route's `match.path` has no parameters; add `{{{name}}}` to it"
            )),
            None => Err(format!(
                "the route's `match.path` has no `{{{name}}}` (it has: {})",
                params.join(", ")
            )),
        },
        _ => Err(KEY_HELP.to_string()),
    }
}

/// `server.rate_limit_headers` and `server.limited_response`: what a route without its own uses.
struct ResponseDefaults {
    headers: HeaderMode,
    limited: LimitedResponse,
}

fn response_defaults(e: &mut Errors, raw: &RawServer) -> ResponseDefaults {
    ResponseDefaults {
        headers: raw
            .rate_limit_headers
            .as_deref()
            .and_then(|m| e.take("server.rate_limit_headers", HeaderMode::parse(m)))
            .unwrap_or_default(),
        limited: raw
            .limited_response
            .as_ref()
            .and_then(|r| limited_response(e, "server.limited_response", r))
            .unwrap_or_default(),
    }
}

fn limited_response(
    e: &mut Errors,
    path: &str,
    raw: &RawLimitedResponse,
) -> Option<LimitedResponse> {
    LimitedResponse::compile(raw.status, raw.body.as_deref(), raw.content_type.as_deref())
        .map_err(|problems| {
            for (field, message) in problems {
                e.add(format!("{path}.{field}"), message);
            }
        })
        .ok()
}

/// `enforce` or `shadow`: whether a route or policy only reports.
fn shadow_mode(e: &mut Errors, path: &str, text: Option<&str>) -> bool {
    match text {
        None | Some("enforce") => false,
        Some("shadow") => true,
        Some(other) => {
            e.add(
                path,
                format!("`{other}` is not a mode; expected `enforce` or `shadow`"),
            );
            false
        }
    }
}

/// A route's rollout mode and response settings: `mode` (its own and its policies'),
/// `rate_limit_headers` and `limited_response`, each defaulting to the server's.
fn route_responses(
    e: &mut Errors,
    path: &str,
    raw: &RawRoute,
    route: &mut Route,
    defaults: &ResponseDefaults,
) {
    let route_shadow = shadow_mode(e, &format!("{path}.mode"), raw.mode.as_deref());
    for (j, raw_policy) in raw.policies.iter().enumerate() {
        let shadow = shadow_mode(
            e,
            &format!("{path}.policies[{j}].mode"),
            raw_policy.mode.as_deref(),
        );
        if let Some(policy) = route
            .policies
            .iter_mut()
            .find(|p| *p.name == *raw_policy.name)
        {
            policy.shadow = route_shadow || shadow;
        }
    }
    if route.policies.len() > MAX_POLICIES {
        e.add(
            format!("{path}.policies"),
            format!("a route may have at most {MAX_POLICIES} policies"),
        );
    }
    let mode = raw
        .rate_limit_headers
        .as_deref()
        .and_then(|m| e.take(format!("{path}.rate_limit_headers"), HeaderMode::parse(m)))
        .unwrap_or(defaults.headers);
    route.rate_limit_headers = RateLimitHeaders::new(
        mode,
        route.policies.iter().map(|p| (&*p.name, &p.rule, p.shadow)),
    );
    route.limited_response = match &raw.limited_response {
        Some(own) => {
            limited_response(e, &format!("{path}.limited_response"), own).unwrap_or_default()
        }
        None => defaults.limited.clone(),
    };
}
