//! Shared helpers of the integration tests: the gateway under test (in-process or as the real
//! binary), the Envoy rate limit service under test and a real Envoy, an in-process upstream, a
//! client, real NGINX, Traefik, Caddy, Prometheus and Redis servers, headless Chromium over the
//! DevTools protocol (`chromium`), the store matrix, the external tools, and the
//! one Prometheus text reader ([`metric`]).
//!
//! Every helper owns what it starts and stops it on drop, also when the test panics. Timeouts here
//! are for liveness only (a hung test fails instead of hanging CI); they are generous because the
//! machine is small and shared. Assertions about counts are exact.
//!
//! Use it from a test file with `mod support;` (or `#[path = "../support/mod.rs"] mod support;`
//! from a test directory's `main.rs`).

// Each test binary uses its own subset of these helpers.
#![allow(dead_code, unused_imports)]

pub mod chromium;
pub mod client;
pub mod dashboard;
pub mod envoy;
pub mod ext_authz;
pub mod fleet;
pub mod gateway;
pub mod grpc;
pub mod ingress;
pub mod llm;
pub mod nginx;
pub mod otlp;
pub mod process;
pub mod prometheus;
pub mod redis;
pub mod rlqs;
pub mod rls;
pub mod stores;
pub mod tls;
pub mod tools;
pub mod upstream;

use std::time::Duration;

pub use client::{Client, Reply};
pub use gateway::TestGateway;
pub use nginx::Nginx;
pub use process::GatewayProcess;
pub use redis::RedisServer;
pub use upstream::Upstream;

/// The longest any single step of a test may take before the test fails.
pub const LIVENESS: Duration = Duration::from_secs(30);

/// The value of the sample `name{labels}` in Prometheus text format, `None` when absent. Labels
/// may be given in any order; the sample must have exactly these labels.
pub fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (metric_name, rest) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.strip_suffix('}')?),
                None => (series, ""),
            };
            if metric_name != name {
                return None;
            }
            let mut found: Vec<(&str, &str)> = rest
                .split(',')
                .filter(|pair| !pair.is_empty())
                .filter_map(|pair| {
                    let (k, v) = pair.split_once('=')?;
                    Some((k, v.trim_matches('"')))
                })
                .collect();
            let mut want = labels.to_vec();
            found.sort_unstable();
            want.sort_unstable();
            (found == want).then(|| value.parse().ok()).flatten()
        })
}
