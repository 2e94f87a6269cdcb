//! `upstreams:`: targets, balance, timeouts, connection limits and TLS.

use std::path::Path;
use std::time::Duration;

use http::uri::{Authority, Scheme};
use http::Uri;

use super::{bounded_count, timeout_or, valid_name, Errors, NAME_HELP};
use crate::config::raw::*;
use crate::config::snapshot::*;

/// The most connections per upstream, as many as the pool keeps idle.
const DEFAULT_UPSTREAM_MAX_CONNECTIONS: u64 = crate::config::MAX_IDLE as u64;
const DEFAULT_POOL_TIMEOUT: Duration = Duration::from_secs(5);

pub(super) fn upstream(
    e: &mut Errors,
    name: &str,
    raw: &RawUpstream,
    source: &Path,
) -> Option<Upstream> {
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
    let protocol = match raw.protocol.as_deref() {
        None | Some("http1") => UpstreamProtocol::Http1,
        Some("h2") => UpstreamProtocol::H2,
        Some(other) => {
            e.add(
                format!("{path}.protocol"),
                format!("`{other}` is not a protocol; expected http1 or h2"),
            );
            UpstreamProtocol::Http1
        }
    };
    if protocol == UpstreamProtocol::H2 {
        // One multiplexed connection per target: there is no pool of connections to bound.
        for (field, set) in [
            ("max_connections", raw.max_connections.is_some()),
            ("pool_timeout", raw.pool_timeout.is_some()),
        ] {
            if set {
                e.add(
                    format!("{path}.{field}"),
                    "does not apply to `protocol: h2`, which keeps one multiplexed connection \
                     per target",
                );
            }
        }
    }
    let tls = match crate::config::tls::upstream(&path, raw, scheme == Scheme::HTTPS, source) {
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
        protocol,
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
