//! TLS with rustls (ring): every listener's certificate and optional client CA (mutual TLS),
//! reloaded when their files change ([`server`], one building block for every door), accepting
//! for servers that take a stream of connections ([`incoming`]), and connections to `https://`
//! upstreams ([`client`], [`connect`]). PEM files are read by [`files`], whose errors name the
//! file. The verified client certificate's identity is read by [`crate::client_cert`].
//!
//! The crypto provider is given explicitly (never the process default) so that another crate
//! installing its own cannot change what the gateway negotiates.

pub mod accept;
pub mod client;
pub mod connect;
pub mod files;
pub mod incoming;
pub(crate) mod prefixed;
pub mod server;

use std::sync::Arc;

use rustls::crypto::CryptoProvider;

pub use crate::client_cert::ClientCert;
pub use client::UpstreamTls;
pub use connect::Connector;
pub use server::{Alpn, ClientAuth, ListenerTls, ServerTls, ServerTlsSettings};

/// Marks a request that arrived on the TLS listener (a request extension), so that the proxy
/// forwards `X-Forwarded-Proto: https`.
#[derive(Debug, Clone, Copy)]
pub struct Https;

/// ring, with rustls' default cipher suites and key exchange groups.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}
