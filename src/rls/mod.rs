//! Turnstile as a drop-in replacement for envoyproxy/ratelimit.
//!
//! The config side (`config`, `tree`, `rule`, `read`, `glob`, `yaml`, `settings`) is plain data
//! and lives in [`crate::config::rls`], re-exported here; the metric families are
//! [`crate::metrics::rls`], re-exported as `metrics`.
//!
//! - `config`: reads envoyproxy/ratelimit's YAML files (a file or a directory of them) with its
//!   exact messages, plus our extensions (`algorithm`, `token_bucket`);
//! - `tree`: compiles them into an immutable per-domain tree and looks request descriptors up in
//!   it, following envoyproxy/ratelimit's matching rules;
//! - `rule`: one compiled limit, its enforcement and the names of its counters and metrics;
//! - `read`: one file's YAML nodes into raw descriptors, checked;
//! - `glob`: wildcard values, `*` anywhere;
//! - `yaml`: a YAML tree that keeps line numbers for error messages;
//! - `settings`: the `rls:` block of `policies.yaml` and the per-rule runtime state;
//! - `ask`: the request's fields, borrowed from prost's message or read in place from its bytes;
//! - `plan`: each descriptor's rule and counter (lookups, `replaces`, Envoy's override);
//! - `decide`: `ShouldRateLimit` translated to engine checks and the verdict back (one store call
//!   per request; no decision policy of its own);
//! - `grpc`, `balance`, `wire`, `json`, `metrics`: the gRPC listener and its threads, which
//!   thread serves a connection, gRPC on HTTP/2 (the rate limit and health methods),
//!   `POST /json`, per-rule counters.

mod ask;
mod balance;
pub mod decide;
pub mod grpc;
pub mod json;
mod metadata;
pub use crate::metrics::rls as metrics;
pub mod plan;
mod wire;

pub use crate::config::rls::{config, glob, rule, settings, tree};
pub use crate::state::RlsResources;
pub use config::RlsConfigError;
pub use decide::{RlsError, RlsService};
pub use rule::{Algorithm, Entry, Rule, Unit};
pub use settings::{RawRls, RlsSnapshot};
pub use tree::{LoadOptions, RlsConfig, RuleId};
