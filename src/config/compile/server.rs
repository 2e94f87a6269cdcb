//! `server:`: path normalization, body and header limits, timeouts, upgrades, and the request
//! fields the routes read.

use std::time::Duration;

use super::{bounded_count, duration_or, timeout_or, Errors};
use crate::config::raw::*;
use crate::config::snapshot::*;
use crate::config::units::parse_size;
use crate::keys::KeyPart;
use crate::normalize::{EscapedSlashes, PathOptions, PathParameters};

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

pub(super) fn server_settings(e: &mut Errors, raw: &RawServer) -> ServerSettings {
    ServerSettings {
        paths: path_options(e, raw),
        max_body_size: raw
            .max_body_size
            .as_deref()
            .and_then(|t| e.take("server.max_body_size", parse_size(t)))
            .unwrap_or(10 << 20),
        json_body_limit: raw
            .json_body_limit
            .as_deref()
            .and_then(|t| {
                e.take(
                    "server.json_body_limit",
                    parse_size(t).and_then(|n| match n {
                        1..=16_777_216 => Ok(n),
                        _ => Err(format!("`{t}`: must be 1 byte to 16MiB")),
                    }),
                )
            })
            .unwrap_or(64 << 10),
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
pub(super) fn unreachable_underscore_fields(e: &mut Errors, routes: &[Route]) {
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
pub(super) fn read_fields(routes: &[Route]) -> Vec<http::HeaderName> {
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
