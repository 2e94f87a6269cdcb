#![forbid(unsafe_code)]
//! Turnstile (placeholder root until the core lands).

pub mod rls;
