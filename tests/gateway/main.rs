//! Integration tests of the inline gateway (issue 2): the gateway runs in-process (or as the real
//! binary, for signals and exit codes) on free loopback ports, in front of an in-process upstream.
//!
//! One test binary, split by topic, to keep link time down on a small machine.

#[path = "../support/mod.rs"]
mod support;

/// One route forwarding everything to the test's upstream, with a 2 s upstream timeout
/// (the upstream connection tests in `lean.rs` and `pool.rs`).
const FORWARD_ALL: &str = r#"
upstreams:
  up:
    url: http://$UPSTREAM
    timeout: 2s
routes:
  - name: all
    upstream: up
"#;

mod admin;
mod charges;
mod concurrency;
mod exempt;
mod flood;
mod hardening;
mod headers;
mod inflight;
mod jwt;
mod keys;
mod lean;
mod lean_server;
mod lifecycle;
mod limits;
mod normalization;
mod overrides;
mod pool;
mod proxy;
mod quota;
mod quota_endpoint;
mod responses;
mod rewrite;
mod routing;
mod shadow;
mod shared;
mod slowloris;
mod status;
mod status_browser;
mod targets;
mod tls;
mod workers;
