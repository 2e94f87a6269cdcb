//! The public TLS listener's certificate: served from memory, replaced when its files change.
//!
//! Every handshake asks [`Resolver`] for the certificate, which is one atomic load; a reload
//! swaps in the new one, so handshakes after it present the new certificate while established
//! connections, whose handshake is over, carry on untouched (nothing is dropped). The files are
//! watched as the config file is ([`crate::watch::ConfigWatcher`]: directory events, symlink
//! chains such as a Kubernetes Secret volume, a content poll as a safety net). A new certificate
//! and key that do not load (unreadable, not PEM, not a pair) leave the old ones serving; the
//! failure is logged and counted in `turnstile_tls_certificate_reloads_total{result="error"}`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use prometheus::{IntCounter, IntCounterVec, Opts};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::ServerConfig;
use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tokio_rustls::TlsAcceptor;

use crate::metrics::Metrics;
use crate::watch::ConfigWatcher;

/// A certificate and its key are often replaced one after the other: after a change that does
/// not load, wait this long for the other file before calling the reload failed.
const SETTLE: Duration = Duration::from_secs(2);

/// `listen_tls:`, validated: its certificate and key were loaded and matched at config load.
#[derive(Debug, Clone)]
pub struct ListenerTls {
    pub listen: SocketAddr,
    /// PEM certificate chain, leaf first.
    pub cert: PathBuf,
    /// PEM private key of the leaf.
    pub key: PathBuf,
    /// The whole TLS handshake must be over within this time, or the connection is closed.
    pub handshake_timeout: Duration,
    /// What the files held at load.
    pub loaded: Arc<CertifiedKey>,
}

impl PartialEq for ListenerTls {
    /// The settings, not the certificate: new content is picked up without a restart.
    fn eq(&self, other: &Self) -> bool {
        (self.listen, &self.cert, &self.key, self.handshake_timeout)
            == (
                other.listen,
                &other.cert,
                &other.key,
                other.handshake_timeout,
            )
    }
}

/// Hands every handshake the current certificate.
#[derive(Debug)]
struct Resolver(ArcSwap<CertifiedKey>);

impl ResolvesServerCert for Resolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.load_full())
    }
}

/// The TLS side of the public TLS listener.
pub struct ServerTls {
    acceptor: TlsAcceptor,
    resolver: Arc<Resolver>,
    settings: ListenerTls,
    reload_ok: IntCounter,
    reload_error: IntCounter,
    pub(crate) handshake_timeouts: IntCounter,
    pub(crate) handshake_errors: IntCounter,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// ALPN offers h2 first, then HTTP/1.1 (RFC 7301); a client without ALPN gets HTTP/1.1, and
    /// one that offers only other protocols the fatal `no_application_protocol` alert (§3.2).
    pub fn new(settings: &ListenerTls, metrics: &Metrics) -> Result<ServerTls, rustls::Error> {
        let resolver = Arc::new(Resolver(ArcSwap::new(settings.loaded.clone())));
        let mut config = ServerConfig::builder_with_provider(super::provider())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_cert_resolver(resolver.clone());
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let reloads = IntCounterVec::new(
            Opts::new(
                "turnstile_tls_certificate_reloads_total",
                "Reloads of the TLS listener's certificate after its files changed, by result.",
            ),
            &["result"],
        )
        .unwrap_or_else(|e| panic!("metric turnstile_tls_certificate_reloads_total: {e}"));
        let failures = IntCounterVec::new(
            Opts::new(
                "turnstile_tls_handshake_failures_total",
                "TLS handshakes on the public TLS listener that failed, by reason.",
            ),
            &["reason"],
        )
        .unwrap_or_else(|e| panic!("metric turnstile_tls_handshake_failures_total: {e}"));
        metrics.register(Box::new(reloads.clone()));
        metrics.register(Box::new(failures.clone()));
        Ok(ServerTls {
            acceptor: TlsAcceptor::from(Arc::new(config)),
            resolver,
            settings: settings.clone(),
            reload_ok: reloads.with_label_values(&["ok"]),
            reload_error: reloads.with_label_values(&["error"]),
            handshake_timeouts: failures.with_label_values(&["timeout"]),
            handshake_errors: failures.with_label_values(&["error"]),
        })
    }

    pub fn acceptor(&self) -> &TlsAcceptor {
        &self.acceptor
    }

    pub fn handshake_timeout(&self) -> Duration {
        self.settings.handshake_timeout
    }

    /// Reads the files again; on success new handshakes present what they hold.
    pub fn reload(&self) -> Result<(), String> {
        let next = super::files::certified_key(&self.settings.cert, &self.settings.key)?;
        // Both files are watched: one replacement can wake the watch twice.
        if next.cert == self.resolver.0.load().cert {
            return Ok(());
        }
        tracing::info!(
            cert = %self.settings.cert.display(),
            sha256 = %fingerprint(&next),
            "TLS certificate reloaded"
        );
        self.resolver.0.store(next);
        self.reload_ok.inc();
        Ok(())
    }

    /// Reloads whenever the certificate or key file changes, until `shutdown`.
    pub async fn watch(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        // The files were read at config load, before this watch: nothing counts as seen, so the
        // first wake-up looks at once and an edit in between applies (a reload of what is
        // already serving changes nothing and logs nothing).
        let mut cert = ConfigWatcher::since(&self.settings.cert, None);
        let mut key = ConfigWatcher::since(&self.settings.key, None);
        loop {
            tokio::select! {
                () = cert.changed() => {}
                () = key.changed() => {}
                _ = shutdown.wait_for(|stop| *stop) => return,
            }
            // Retried while the other file keeps changing within SETTLE.
            while let Err(e) = self.reload() {
                let again = tokio::time::timeout(SETTLE, async {
                    tokio::select! {
                        () = cert.changed() => {}
                        () = key.changed() => {}
                    }
                });
                if again.await.is_err() {
                    self.reload_error.inc();
                    tracing::error!(
                        error = %e,
                        "TLS certificate reload failed; the previous certificate keeps serving"
                    );
                    break;
                }
            }
        }
    }
}

/// SHA-256 of the leaf certificate, as `openssl x509 -fingerprint -sha256` prints it (without
/// colons), to tell in the log which certificate is serving.
fn fingerprint(key: &CertifiedKey) -> String {
    key.cert
        .first()
        .map(|leaf| {
            Sha256::digest(leaf.as_ref())
                .iter()
                .map(|b| format!("{b:02X}"))
                .collect()
        })
        .unwrap_or_default()
}
