//! The upstream connector: TCP for `http://` targets, TCP then TLS for `https://` ones (SNI and
//! verification from the target's host, [`super::client`]). The pool ([`crate::proxy::pool`])
//! holds one per upstream and dials each target URI through it, so every target of an upstream
//! is reached the same way whatever its scheme.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Uri;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use rustls_pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;
use tower::{Service, ServiceExt};

use super::UpstreamTls;
use crate::log_throttle::Throttle;

/// One warning line per this period for failed upstream handshakes (each failed request would
/// log one otherwise).
static HANDSHAKE_LOG: Throttle = Throttle::new(std::time::Duration::from_secs(10));

/// Dials an upstream's targets. Cheap to clone.
#[derive(Clone)]
pub struct Connector {
    tcp: HttpConnector,
    tls: Option<TlsConnector>,
    /// The TLS handshake's own bound (the TCP connect has `connect_timeout` already).
    handshake_timeout: Duration,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector")
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

impl Connector {
    /// `tcp` dials; `tls` is required for `https://` targets.
    pub fn new(
        mut tcp: HttpConnector,
        tls: Option<&UpstreamTls>,
        handshake_timeout: Duration,
    ) -> Connector {
        // The scheme is this connector's business: let `HttpConnector` dial https URIs too.
        tcp.enforce_http(false);
        Connector {
            tcp,
            tls: tls.map(|t| TlsConnector::from(t.config.clone())),
            handshake_timeout,
        }
    }

    async fn connect(self, uri: Uri) -> io::Result<TokioIo<Stream>> {
        let tcp = self
            .tcp
            .clone()
            .oneshot(uri.clone())
            .await
            .map_err(io::Error::other)?
            .into_inner();
        if uri.scheme_str() != Some("https") {
            return Ok(TokioIo::new(Stream::Plain(tcp)));
        }
        let Some(tls) = self.tls else {
            return Err(io::Error::other(format!(
                "{uri}: https target without TLS settings (a bug)"
            )));
        };
        // `[::1]` in a URI is `::1` to name matching.
        let host = uri.host().unwrap_or_default();
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let name = ServerName::try_from(host.to_string())
            .map_err(|e| io::Error::other(format!("`{host}` is not a server name: {e}")))?;
        let result = tokio::time::timeout(self.handshake_timeout, tls.connect(name, tcp)).await;
        let failure = match result {
            Ok(Ok(stream)) => return Ok(TokioIo::new(Stream::Tls(Box::new(stream)))),
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {:?}", self.handshake_timeout),
        };
        if let Some(suppressed) = HANDSHAKE_LOG.allow() {
            tracing::warn!(
                upstream = %uri,
                error = %failure,
                suppressed,
                "TLS handshake with the upstream failed"
            );
        }
        Err(io::Error::other(format!(
            "TLS handshake with {uri} failed: {failure}"
        )))
    }
}

impl Service<Uri> for Connector {
    type Response = TokioIo<Stream>;
    /// An `io::Error`, as `HttpConnector`'s callers expect something to box.
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        Box::pin(self.clone().connect(uri))
    }
}

/// A connection to an upstream target, plain or TLS.
#[derive(Debug)]
pub enum Stream {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

super::plain_or_tls_io!(Stream);
