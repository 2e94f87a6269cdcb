//! Turnstile: an HTTP rate-limit gateway.
//!
//! Three doors open onto one decision engine:
//!
//! - the inline gateway ([`gateway`], [`proxy`]): route a request, extract its keys, decide, then
//!   forward it or answer `429`;
//! - the Envoy rate limit service ([`rls`]), which reads envoyproxy/ratelimit's config files and
//!   reduces `ShouldRateLimit` to the same checks;
//! - (planned) an ingress forward-auth endpoint.
//!
//! The tree follows the data:
//!
//! - [`config`]: `policies.yaml` is parsed ([`config::raw`]), validated into an immutable
//!   [`config::Snapshot`] ([`config::compile`]) and swapped atomically on reload;
//! - [`normalize`]: every request is rewritten into one canonical spelling (path, host) before
//!   anything reads it;
//! - [`route`] and [`keys`]: which route a request belongs to and which counters it touches, as
//!   pure functions compiled at load;
//! - [`limiter`]: the algorithm spec ([`limiter::algorithm`]) and the stores that keep counters;
//!   [`limiter::Limiter::decide`] is the single entry point of every door;
//! - [`respond`]: every response the gateway writes itself;
//! - [`metrics`] and [`admin`]: Prometheus metrics and health on a separate listener;
//! - [`listener`]: the public listener and the bounds on each connection;
//! - [`server`]: start-up, hot reload and graceful shutdown; [`watch`] applies edits of the
//!   config file (Kubernetes ConfigMap swaps included) without a signal;
//! - [`probe`]: `turnstile healthcheck`, for images without a shell.

#![forbid(unsafe_code)]

pub mod admin;
pub mod config;
pub mod gateway;
pub mod keys;
pub mod limiter;
pub mod listener;
pub mod log_throttle;
pub mod metrics;
pub mod normalize;
pub mod probe;
pub mod proxy;
pub mod respond;
pub mod rls;
pub mod route;
pub mod server;
pub mod top_limited;
pub mod watch;

pub use server::{start, Running};
