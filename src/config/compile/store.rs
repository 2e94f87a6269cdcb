//! `store:`: the memory store or a Redis target, and the failure mode.

use std::time::Duration;

use super::{failure_mode, timeout_or, Errors};
use crate::config::raw::*;
use crate::config::snapshot::*;
use crate::limiter::redis::{check_target, parse_node, Auth, Target};

/// The most counters the memory store may be asked to hold; far above what fits in memory
/// anyway, it only keeps the arithmetic on it sane.
const MAX_KEYS_LIMIT: u64 = 1_000_000_000;

pub(super) fn store_settings(e: &mut Errors, raw: &RawStore) -> (StoreSettings, FailureMode) {
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
