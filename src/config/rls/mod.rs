//! The Envoy rate limit service's config, as data: the `rls:` block of `policies.yaml`
//! ([`settings`]) and envoyproxy/ratelimit's config files it names, read ([`config`], `read`,
//! `yaml`) and compiled into the descriptor tree ([`tree`], [`rule`], [`glob`]). The service
//! itself, which reads this tree, is [`crate::rls`] (which re-exports these modules under its
//! own name).

pub mod config;
pub mod glob;
mod read;
pub mod rule;
pub mod settings;
pub mod tree;
mod yaml;
