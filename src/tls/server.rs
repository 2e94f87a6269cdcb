//! The server side of TLS, one building block for every door: the public TLS listener, the Envoy
//! rate limit service, ext_authz, the forward-auth check listener and the admin listener.
//!
//! Each listener's rustls config is built from its certificate, key and (for mutual TLS) client
//! CA, and swapped whole when one of those files changes: every accept loads the current config
//! (one atomic load), so handshakes after a reload present the new certificate and verify clients
//! against the new CA, while established connections, whose handshake is over, carry on
//! untouched (nothing is dropped). The files are watched as the config file is
//! ([`crate::watch::ConfigWatcher`]: directory events, symlink chains such as a Kubernetes Secret
//! volume, a content poll as a safety net). Files that do not load (unreadable, not PEM, not a
//! pair, no CA certificate) leave the old config serving; the failure is logged and counted in
//! `turnstile_tls_certificate_reloads_total{listener, result="error"}`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use prometheus::IntCounter;
use rustls::server::WebPkiClientVerifier;
use rustls::sign::CertifiedKey;
use rustls::{RootCertStore, ServerConfig};
use rustls_pki_types::CertificateDer;
use sha2::{Digest, Sha256};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use crate::metrics::Metrics;
use crate::watch::ConfigWatcher;

/// A certificate and its key are often replaced one after the other: after a change that does
/// not load, wait this long for the other file before calling the reload failed.
const SETTLE: Duration = Duration::from_secs(2);

/// One TLS warning line per this period (a scanner fails thousands of handshakes).
static HANDSHAKE_LOG: crate::log_throttle::Throttle =
    crate::log_throttle::Throttle::new(Duration::from_secs(10));

/// Whether a client without a certificate may connect to a listener that has a client CA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    /// A client may send no certificate; one it sends must verify against the CA.
    Optional,
    /// The handshake fails without a certificate that verifies against the CA.
    Required,
}

/// The TLS of one listener, validated: its files were read, and the certificate matched to its
/// key, at config load.
#[derive(Debug, Clone)]
pub struct ServerTlsSettings {
    /// PEM certificate chain, leaf first.
    pub cert: PathBuf,
    /// PEM private key of the leaf.
    pub key: PathBuf,
    /// PEM CA bundle client certificates are verified against, and whether one is required.
    /// `None`: no client certificate is asked for.
    pub client_ca: Option<(PathBuf, ClientAuth)>,
    /// The whole TLS handshake must be over within this time, or the connection is closed.
    pub handshake_timeout: Duration,
    /// What the files held at load.
    pub loaded: Arc<Material>,
}

impl PartialEq for ServerTlsSettings {
    /// The settings, not the files' content: new content is picked up without a restart.
    fn eq(&self, other: &Self) -> bool {
        (
            &self.cert,
            &self.key,
            &self.client_ca,
            self.handshake_timeout,
        ) == (
            &other.cert,
            &other.key,
            &other.client_ca,
            other.handshake_timeout,
        )
    }
}

impl Eq for ServerTlsSettings {}

/// What a listener's files hold: its certificate with the key, and the client CA certificates.
#[derive(Debug)]
pub struct Material {
    pub key: Arc<CertifiedKey>,
    pub client_ca: Vec<CertificateDer<'static>>,
}

impl Material {
    /// Reads the files of `settings` (the certificate and key checked to be a pair).
    pub fn read(
        cert: &std::path::Path,
        key: &std::path::Path,
        client_ca: Option<&std::path::Path>,
    ) -> Result<Material, String> {
        let key = super::files::certified_key(cert, key)?;
        let client_ca = match client_ca {
            Some(ca) => super::files::certificates(ca)?,
            None => Vec::new(),
        };
        Ok(Material { key, client_ca })
    }
}

/// `listen_tls:`, validated: the public HTTPS listener's address and its TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerTls {
    pub listen: std::net::SocketAddr,
    pub tls: ServerTlsSettings,
}

/// The protocols a listener offers by ALPN (RFC 7301), in order of preference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alpn {
    /// h2, then HTTP/1.1: the public and forward-auth listeners.
    H2AndHttp1,
    /// h2 only: the gRPC listeners (gRPC needs HTTP/2).
    H2,
    /// HTTP/1.1 only: the admin listener.
    Http1,
}

impl Alpn {
    fn protocols(self) -> Vec<Vec<u8>> {
        match self {
            Alpn::H2AndHttp1 => vec![b"h2".to_vec(), b"http/1.1".to_vec()],
            Alpn::H2 => vec![b"h2".to_vec()],
            Alpn::Http1 => vec![b"http/1.1".to_vec()],
        }
    }
}

/// The TLS side of one listener.
pub struct ServerTls {
    config: ArcSwap<ServerConfig>,
    /// What `config` was built from, to tell a reload that changes nothing.
    material: ArcSwap<Material>,
    settings: ServerTlsSettings,
    alpn: Alpn,
    listener: &'static str,
    reload_ok: IntCounter,
    reload_error: IntCounter,
    pub(crate) handshake_timeouts: IntCounter,
    pub(crate) handshake_errors: IntCounter,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("listener", &self.listener)
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

/// The rustls config of `material`. A client without ALPN gets HTTP/1.1 (or h2 on a gRPC
/// listener), and one that offers only other protocols the fatal `no_application_protocol`
/// alert (RFC 7301 §3.2).
fn build(
    material: &Material,
    client_auth: Option<ClientAuth>,
    alpn: Alpn,
) -> Result<ServerConfig, String> {
    let builder = ServerConfig::builder_with_provider(super::provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let builder = match client_auth {
        None => builder.with_no_client_auth(),
        Some(auth) => {
            let mut roots = RootCertStore::empty();
            for cert in &material.client_ca {
                roots
                    .add(cert.clone())
                    .map_err(|e| format!("a client CA certificate is not usable: {e}"))?;
            }
            let verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots), super::provider());
            let verifier = match auth {
                ClientAuth::Optional => verifier.allow_unauthenticated(),
                ClientAuth::Required => verifier,
            };
            let verifier = verifier
                .build()
                .map_err(|e| format!("the client CA cannot verify clients: {e}"))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_cert_resolver(Arc::new(Fixed(material.key.clone())));
    config.alpn_protocols = alpn.protocols();
    Ok(config)
}

/// The one certificate of a config (a reload builds a new config).
#[derive(Debug)]
struct Fixed(Arc<CertifiedKey>);

impl rustls::server::ResolvesServerCert for Fixed {
    fn resolve(&self, _hello: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

/// Checks at config load that `material` makes a working config (a CA file whose certificates
/// rustls refuses is a config error, not a failure at the first handshake).
pub fn check(material: &Material, client_auth: Option<ClientAuth>) -> Result<(), String> {
    build(material, client_auth, Alpn::H2AndHttp1).map(|_| ())
}

impl ServerTls {
    /// The TLS of `listener` (its name in the metrics: `public`, `rls`, `ext_authz`,
    /// `forward_auth`, `admin`), offering `alpn`.
    pub fn new(
        settings: &ServerTlsSettings,
        listener: &'static str,
        alpn: Alpn,
        metrics: &Metrics,
    ) -> Result<ServerTls, String> {
        let client_auth = settings.client_ca.as_ref().map(|(_, auth)| *auth);
        let config = build(&settings.loaded, client_auth, alpn)?;
        Ok(ServerTls {
            config: ArcSwap::from_pointee(config),
            material: ArcSwap::new(settings.loaded.clone()),
            settings: settings.clone(),
            alpn,
            listener,
            reload_ok: metrics.tls_reloads(listener, "ok"),
            reload_error: metrics.tls_reloads(listener, "error"),
            handshake_timeouts: metrics.tls_handshake_failures(listener, "timeout"),
            handshake_errors: metrics.tls_handshake_failures(listener, "error"),
        })
    }

    /// An acceptor with the current config.
    pub fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.config.load_full())
    }

    pub fn handshake_timeout(&self) -> Duration {
        self.settings.handshake_timeout
    }

    /// Whether clients are asked for a certificate (a client CA is configured).
    pub fn asks_client_cert(&self) -> bool {
        self.settings.client_ca.is_some()
    }

    /// The handshake on `stream`, within the handshake timeout; `None` (counted, and logged at
    /// debug level, throttled) when it fails or takes too long. A client that sends no
    /// certificate where one is required, or one that does not verify, fails here.
    pub async fn handshake(&self, stream: TcpStream) -> Option<TlsStream<TcpStream>> {
        let peer = stream.peer_addr().ok();
        match tokio::time::timeout(self.handshake_timeout(), self.acceptor().accept(stream)).await {
            Ok(Ok(stream)) => Some(stream),
            Ok(Err(e)) => {
                self.handshake_errors.inc();
                if let Some(suppressed) = HANDSHAKE_LOG.allow() {
                    tracing::debug!(
                        listener = self.listener,
                        ?peer,
                        error = %e,
                        suppressed,
                        "TLS handshake failed"
                    );
                }
                None
            }
            Err(_) => {
                self.handshake_timeouts.inc();
                None
            }
        }
    }

    /// Reads the files again; on success new handshakes use what they hold.
    pub fn reload(&self) -> Result<(), String> {
        let client_ca = self.settings.client_ca.as_ref();
        let next = Material::read(
            &self.settings.cert,
            &self.settings.key,
            client_ca.map(|(path, _)| path.as_path()),
        )?;
        // Every file is watched: one replacement can wake the watch more than once.
        let current = self.material.load();
        if next.key.cert == current.key.cert && next.client_ca == current.client_ca {
            return Ok(());
        }
        let config = build(&next, client_ca.map(|(_, auth)| *auth), self.alpn)?;
        tracing::info!(
            listener = self.listener,
            cert = %self.settings.cert.display(),
            sha256 = %fingerprint(&next.key),
            client_ca_certificates = next.client_ca.len(),
            "TLS certificate reloaded"
        );
        self.config.store(Arc::new(config));
        self.material.store(Arc::new(next));
        self.reload_ok.inc();
        Ok(())
    }

    /// Reloads whenever the certificate, key or client CA file changes, until `shutdown`.
    pub async fn watch(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        // The files were read at config load, before this watch: nothing counts as seen, so the
        // first wake-up looks at once and an edit in between applies (a reload of what is
        // already serving changes nothing and logs nothing).
        let mut cert = ConfigWatcher::since(&self.settings.cert, None);
        let mut key = ConfigWatcher::since(&self.settings.key, None);
        let mut ca = self
            .settings
            .client_ca
            .as_ref()
            .map(|(path, _)| ConfigWatcher::since(path, None));
        loop {
            tokio::select! {
                () = cert.changed() => {}
                () = key.changed() => {}
                () = changed(&mut ca) => {}
                _ = shutdown.wait_for(|stop| *stop) => return,
            }
            // Retried while another file keeps changing within SETTLE.
            while let Err(e) = self.reload() {
                let again = tokio::time::timeout(SETTLE, async {
                    tokio::select! {
                        () = cert.changed() => {}
                        () = key.changed() => {}
                        () = changed(&mut ca) => {}
                    }
                });
                if again.await.is_err() {
                    self.reload_error.inc();
                    tracing::error!(
                        listener = self.listener,
                        error = %e,
                        "TLS certificate reload failed; the previous certificate keeps serving"
                    );
                    break;
                }
            }
        }
    }
}

/// A change of the watched file, or never without one.
async fn changed(watcher: &mut Option<ConfigWatcher>) {
    match watcher {
        Some(watcher) => watcher.changed().await,
        None => std::future::pending().await,
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
