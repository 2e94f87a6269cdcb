//! Turnstile: an HTTP rate-limit gateway.
//!
//! Doors open onto one decision engine ([`limiter::Engine`]); each door only translates its
//! protocol into checks and the engine's verdict back:
//!
//! - the inline gateway ([`gateway`], [`proxy`]): route a request, extract its keys, decide, then
//!   forward it or answer `429`;
//! - the Envoy rate limit service ([`rls`]), which reads envoyproxy/ratelimit's config files and
//!   reduces `ShouldRateLimit` to the same checks;
//! - the Envoy rate limit quota service ([`rlqs`]): each proxy enforces locally the token bucket
//!   it is assigned; the shares of each budget are decided by [`limiter::quota`];
//! - the ingress door ([`forward_auth`]): nginx `auth_request`, ingress-nginx, Traefik and Caddy
//!   forward-auth over HTTP, and Envoy ext_authz over gRPC, answered by the gateway's own
//!   routing and keys ([`admission`]);
//! - Envoy's external processor ([`ext_proc`]): the request through Envoy admitted as the
//!   gateway admits it, and its response read as it streams by, to settle LLM token budgets.
//!
//! The tree follows the data; `tests/layers.rs` (`cargo test --test layers`) fails on any import
//! cycle between these modules:
//!
//! - [`config`]: `policies.yaml` is parsed ([`config::raw`]) and validated into an immutable
//!   [`config::Snapshot`] of plain data ([`config::compile`]): no pools, no metric handles, so
//!   `turnstile check` builds neither. It also holds the compiled pieces the runtime reads: a
//!   route's refusal ([`config::limited`]), its path rewrite ([`config::rewrite`]), the overrides
//!   file and its validation ([`config::overrides`]) and the Envoy service's config files and
//!   descriptor tree ([`config::rls`]). Besides the pure modules below, it names only the
//!   limiter's rule types and [`tls`]'s certificate loading: nothing of the request runtime or
//!   the doors;
//! - below it, pure modules: [`units`] (durations, rates, sizes as written), [`normalize`] (every
//!   request rewritten into one canonical spelling, path and host, before anything reads it),
//!   [`route`] and [`keys`] (which route a request belongs to and which counters it touches, as
//!   pure functions compiled at load), [`jwt`] (bearer tokens verified before a claim becomes a
//!   key part, against a key set swapped whole: key files watched, `jwks_url` fetched in the
//!   background; a cache of verified tokens), [`rate_limit_headers`] (a route's
//!   rate-limit fields: the plan compiled with the config and its writer), [`usage`] (token
//!   usage read from LLM response bodies and event streams as they go by, and the request
//!   body's bound on a reservation);
//! - [`limiter`]: the algorithm spec ([`limiter::algorithm`]), the stores that keep counters, and
//!   the [`limiter::Engine`] whose `decide` every door calls: it merges duplicate keys, applies
//!   the failure mode, counts decisions and picks the governing outcome; with the [`clock`] it
//!   reads, the [`top_limited`] sketch it feeds and the [`metrics`] (Prometheus registry and
//!   pre-resolved handles) it counts in;
//! - [`tls`]: rustls for every listener that serves TLS (the HTTPS listener, the Envoy service,
//!   ext_authz, forward-auth and admin; certificates and client CAs reloaded as their files
//!   change) and for `https://` upstreams, with [`client_cert`] (a verified client certificate's
//!   subject and names, which `client_cert:` key parts read) below it and [`keys`];
//! - the request runtime: [`proxy`] (forwarding, the upstream pool, streaming bodies, which carry
//!   a [`proxy::body::Rider`] to their end without knowing what it is);
//!   [`respond`] (every response the gateway writes itself, refusals included); [`overrides`]
//!   (the per-key overrides in force, from the file and the admin API, shared through Redis,
//!   applied by [`admission`] from a local copy); [`state`]: what every listener shares
//!   ([`state::AppState`]): the snapshot with its runtime resources attached ([`state::Live`],
//!   swapped whole on reload), the engine, the metrics and the overrides, with the task keeping
//!   them current; [`inflight`] (concurrency leases riding on the response body, and response
//!   costs after admission: usage costs settled by a meter riding on the body as it ends);
//!   [`pacing`] (the waiting room of requests admitted for a later slot, bounded per route);
//! - [`request_id`] (the id a request is known by, kept or made) and [`access_log`] (the record
//!   a door fills per request, queued to a writer thread that formats and writes it), and
//!   [`otel`] (a request's spans, exported over OTLP off the request path), below admission and
//!   the doors;
//! - [`admission`]: route a canonical request and admit it through the engine (every door);
//!   [`quota`]: the same keys peeked without consuming (a route's quota endpoint, the status
//!   page's lookup); the doors: [`gateway`], [`forward_auth`], [`ext_proc`], [`rls`], [`rlqs`];
//! - [`admin`]: metrics, health, the overrides API and the status page (`admin/status.html`,
//!   embedded) on a separate listener; [`listener`]: the public listener and the bounds on each
//!   connection;
//! - [`server`]: start-up, the one reload path and graceful shutdown, whose background tasks one
//!   [`shutdown::Shutdown`] owns and awaits; [`watch`] applies edits of
//!   the config file (Kubernetes ConfigMap swaps included) without a signal; [`log_throttle`]:
//!   one warning line per period for repeated events;
//! - [`workers`]: with several workers, one single-threaded runtime per worker thread, on which
//!   each accepted connection lives its whole life;
//! - [`probe`]: `turnstile healthcheck`, for images without a shell;
//! - [`import`]: `turnstile import ingress-nginx`, Ingress manifests to a policies file.

#![forbid(unsafe_code)]

pub mod access_log;
pub mod admin;
pub mod admission;
pub mod client_cert;
pub mod clock;
pub mod config;
pub mod ext_proc;
pub mod forward_auth;
pub mod gateway;
pub mod import;
pub mod inflight;
pub mod jwt;
pub mod keys;
pub mod limiter;
pub mod listener;
pub mod log_throttle;
pub mod metrics;
pub mod normalize;
pub mod now;
pub mod otel;
pub mod overrides;
pub mod pacing;
pub mod probe;
pub mod proxy;
pub mod quota;
pub mod rate_limit_headers;
pub mod request_id;
pub mod respond;
pub mod rlqs;
pub mod rls;
pub mod route;
pub mod server;
pub mod shutdown;
pub mod state;
pub mod tls;
pub mod top_limited;
pub mod units;
pub mod usage;
pub mod watch;
pub mod workers;

pub use server::{start, Running};
