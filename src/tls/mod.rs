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

/// `AsyncRead` and `AsyncWrite` for an enum `Plain(TcpStream) | Tls(Box<..TlsStream..>)`: each
/// call goes to the variant's stream (the upstream's [`connect::Stream`], a listener's
/// [`incoming::Conn`]).
macro_rules! plain_or_tls_io {
    ($ty:ident) => {
        impl tokio::io::AsyncRead for $ty {
            fn poll_read(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                buf: &mut tokio::io::ReadBuf<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                match self.get_mut() {
                    $ty::Plain(s) => std::pin::Pin::new(s).poll_read(cx, buf),
                    $ty::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_read(cx, buf),
                }
            }
        }

        impl tokio::io::AsyncWrite for $ty {
            fn poll_write(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                buf: &[u8],
            ) -> std::task::Poll<std::io::Result<usize>> {
                match self.get_mut() {
                    $ty::Plain(s) => std::pin::Pin::new(s).poll_write(cx, buf),
                    $ty::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_write(cx, buf),
                }
            }

            fn poll_write_vectored(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                bufs: &[std::io::IoSlice<'_>],
            ) -> std::task::Poll<std::io::Result<usize>> {
                match self.get_mut() {
                    $ty::Plain(s) => std::pin::Pin::new(s).poll_write_vectored(cx, bufs),
                    $ty::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
                }
            }

            fn is_write_vectored(&self) -> bool {
                match self {
                    $ty::Plain(s) => s.is_write_vectored(),
                    $ty::Tls(s) => s.is_write_vectored(),
                }
            }

            fn poll_flush(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                match self.get_mut() {
                    $ty::Plain(s) => std::pin::Pin::new(s).poll_flush(cx),
                    $ty::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_flush(cx),
                }
            }

            fn poll_shutdown(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                match self.get_mut() {
                    $ty::Plain(s) => std::pin::Pin::new(s).poll_shutdown(cx),
                    $ty::Tls(s) => std::pin::Pin::new(s.as_mut()).poll_shutdown(cx),
                }
            }
        }
    };
}
pub(crate) use plain_or_tls_io;

/// Marks a request that arrived on the TLS listener (a request extension), so that the proxy
/// forwards `X-Forwarded-Proto: https`.
#[derive(Debug, Clone, Copy)]
pub struct Https;

/// ring, with rustls' default cipher suites and key exchange groups.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}
