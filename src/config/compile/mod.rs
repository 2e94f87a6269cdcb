//! Validation: from the raw YAML shape to the runtime [`Snapshot`]. Every problem is collected with
//! the field path it belongs to, so one `turnstile check` run reports all of them.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, HeaderValue};
use ipnet::IpNet;

use super::raw::*;
use super::snapshot::*;
use super::units::parse_duration;
use crate::keys::TrustedProxies;

#[path = "../inflight.rs"]
mod inflight;

mod exempt;
mod listeners;
mod observability;
mod pacing;
mod policies;
mod responses;
mod routes;
mod server;
mod store;
mod upstreams;

pub use listeners::deny_status;
pub use server::DEFAULT_MIN_BODY_RATE;

use exempt::{client_prefix, exempt};
use listeners::{forward_auth, listen_tls, server_tls};
use policies::shared_policies;
use responses::{response_defaults, route_responses};
use routes::route;
use server::{read_fields, server_settings, unreachable_underscore_fields};
use store::store_settings;
use upstreams::upstream;

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

    // `listen: off`: no plain-HTTP public listener (Some(None)).
    let listen = match raw.listen.as_deref() {
        Some("off") => Some(None),
        text => socket_addr(e, "listen", text.unwrap_or("0.0.0.0:8080")).map(Some),
    };
    let admin_listen = socket_addr(
        e,
        "admin_listen",
        raw.admin_listen.as_deref().unwrap_or("127.0.0.1:9901"),
    );
    if listen
        .flatten()
        .is_some_and(|a| Some(a) == admin_listen && a.port() != 0)
    {
        e.add(
            "admin_listen",
            "must differ from `listen`: the admin endpoints never share the public listener",
        );
    }

    let listen_tls = raw
        .listen_tls
        .as_ref()
        .and_then(|t| listen_tls(e, t, source, [listen.flatten(), admin_listen]));
    if listen == Some(None) && raw.listen_tls.is_none() && !raw.routes.is_empty() {
        e.add(
            "listen",
            "is `off` and there is no `listen_tls:`: the routes would have no listener; add \
             `listen_tls:` (TLS only) or give `listen` an address",
        );
    }
    let admin_tls = server_tls(e, raw.admin.tls.as_ref(), "admin.tls", source);

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
        // Only the claims a policy reads are kept per token (and in the token cache).
        let mut claims: Vec<Box<str>> = (raw.routes.iter())
            .flat_map(|r| &r.policies)
            .flat_map(|p| &p.key)
            .filter_map(|k| k.strip_prefix("jwt:"))
            .map(Into::into)
            .collect();
        claims.sort();
        claims.dedup();
        // `jwks_url` is trusted as an `https://` upstream is: the system's CAs or `jwks_ca`.
        let tls = |ca: Option<&std::path::Path>| {
            crate::tls::client::UpstreamTls::new(crate::tls::client::Options {
                ca,
                client_cert: None,
                verify: true,
            })
            .map(|t| t.config)
            .map_err(|(_, m)| m)
        };
        let context = crate::jwt::config::Context {
            claims: Some(claims),
            tls: &tls,
        };
        crate::jwt::config::compile_with(j, source, &context)
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
        let ext_proc = raw.ext_proc.is_some();
        if let Some(mut route) = route(e, &path, raw_route, &upstreams, failure_mode, jwt, ext_proc)
        {
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
    let asks_client_cert = listen_tls
        .as_ref()
        .is_some_and(|t: &crate::tls::ListenerTls| t.tls.client_ca.is_some());
    if !asks_client_cert {
        client_cert_parts_unused(e, &routes);
    }
    server.read_fields = read_fields(&routes);
    if server.headers_with_underscores != Underscores::Allow {
        unreachable_underscore_fields(e, &routes);
    }

    // An empty, comment-only or truncated file parses as a config with no routes: serving it
    // would answer 404 to everything and drop every limit, so it must not pass `check` or a
    // reload. The Envoy service alone (`rls:`) needs no routes: its descriptors are its rules.
    if raw.routes.is_empty() && raw.rls.is_none() && raw.rlqs.is_none() {
        e.add(
            "routes",
            "no routes: every request would get 404 and no limit would apply; define at least one \
             route (only a file that configures `rls:` or `rlqs:` may have none)",
        );
    }

    let rls = raw.rls.as_ref().and_then(|r| {
        super::rls::settings::compile(r, source)
            .map_err(|errs| errs.into_iter().for_each(|(path, msg)| e.add(path, msg)))
            .ok()
    });

    let rlqs = raw.rlqs.as_ref().and_then(|r| {
        super::rlqs::compile(r)
            .map_err(|errs| errs.into_iter().for_each(|(path, msg)| e.add(path, msg)))
            .ok()
    });
    if raw.rlqs.is_some() {
        let reserved = super::overrides::RLQS_ROUTE;
        for (i, route) in raw.routes.iter().enumerate() {
            if route.name == reserved {
                let message = format!(
                    "`{reserved}` names the quota service's budgets in overrides \
                     (`/overrides/{reserved}/BUDGET/KEY`) when `rlqs:` is set: rename the route"
                );
                e.add(format!("routes[{i}].name"), message);
            }
        }
    }

    let request_id = observability::request_id(e, &raw.request_id);
    let access_log = raw
        .access_log
        .as_ref()
        .map(|a| observability::access_log(e, a, source));
    let tracing = raw
        .tracing
        .as_ref()
        .and_then(|t| observability::tracing(e, t));

    let forward_auth = raw
        .forward_auth
        .as_ref()
        .and_then(|f| forward_auth(e, f, listen.flatten(), admin_listen, source));

    let ext_proc = raw.ext_proc.as_ref().and_then(|x| {
        let others = [("listen", listen.flatten()), ("admin_listen", admin_listen)];
        listeners::ext_proc(e, x, others)
    });

    match (listen, admin_listen, errors.0.is_empty()) {
        (Some(listen), Some(admin_listen), true) => Ok((
            Snapshot {
                source: source.to_path_buf(),
                source_info: super::SourceInfo::default(),
                listen,
                admin_listen,
                admin_tls,
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
                rlqs,
                forward_auth,
                ext_proc,
                request_id,
                access_log,
                tracing,
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

/// Warns at every policy with a `client_cert:` key part when no listener can verify a client
/// certificate: the part would always be absent, so the policy would never apply.
fn client_cert_parts_unused(e: &mut Errors, routes: &[Route]) {
    for (i, route) in routes.iter().enumerate() {
        for (j, policy) in route.policies.iter().enumerate() {
            if policy
                .key
                .iter()
                .any(|part| matches!(part, crate::keys::KeyPart::ClientCert(_)))
            {
                e.warn(
                    format!("routes[{i}].policies[{j}].key"),
                    "names a `client_cert:` part, but `listen_tls` has no `client_ca`: no \
                     request carries a verified certificate, so this policy never applies",
                );
            }
        }
    }
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

fn bounded_count(e: &mut Errors, path: &str, value: Option<u64>, default: u64, max: u64) -> usize {
    let value = value.unwrap_or(default);
    if !(1..=max).contains(&value) {
        e.add(path, format!("must be between 1 and {max}"));
    }
    value.clamp(1, max) as usize
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
