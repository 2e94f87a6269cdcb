//! Turnstile as a drop-in replacement for envoyproxy/ratelimit.
//!
//! - `config`: reads envoyproxy/ratelimit's YAML files (a file or a directory of them) with its
//!   exact messages, plus our extensions (`algorithm`, `token_bucket`);
//! - `tree`: compiles them into an immutable per-domain tree and looks request descriptors up in
//!   it, following envoyproxy/ratelimit's matching rules;
//! - `rule`: one compiled limit, its enforcement and the names of its counters and metrics;
//! - `read`: one file's YAML nodes into raw descriptors, checked;
//! - `glob`: wildcard values, `*` anywhere;
//! - `yaml`: a YAML tree that keeps line numbers for error messages.

pub mod config;
pub mod glob;
mod read;
pub mod rule;
pub mod tree;
mod yaml;

pub use config::RlsConfigError;
pub use rule::{Algorithm, Entry, Rule, Unit};
pub use tree::{LoadOptions, RlsConfig, RuleId};
