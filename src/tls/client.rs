//! How the gateway verifies and authenticates itself to `https://` upstreams: one rustls client
//! config per upstream, built at config load (so `turnstile check` reads every file it names).
//!
//! - Trust: the system's CA certificates (rustls-native-certs: `/etc/ssl/certs`, or
//!   `SSL_CERT_FILE`/`SSL_CERT_DIR`), read once per process; or only the CAs of `ca: FILE`.
//! - The server's name is checked against the target's host (a DNS name, sent as SNI, or an IP
//!   address, matched against the certificate's IP SANs).
//! - `client_cert: {cert, key}` is presented when the upstream asks (mTLS).
//! - `tls_verify: false` accepts any certificate (the handshake's signatures are still checked):
//!   for a test upstream only, never a default, and logged as a warning at every load.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use rustls_pki_types::{CertificateDer, ServerName, UnixTime};

use super::files;

/// What `ca`, `client_cert` and `tls_verify` of one upstream compile to.
#[derive(Debug, Clone)]
pub struct UpstreamTls {
    pub config: Arc<ClientConfig>,
}

/// The parts of an upstream's TLS settings, paths already resolved.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options<'a> {
    pub ca: Option<&'a Path>,
    pub client_cert: Option<(&'a Path, &'a Path)>,
    pub verify: bool,
}

/// A problem with one field: its name under the upstream (`ca`, `client_cert.key`) and why.
pub type FieldProblem = (&'static str, String);

impl UpstreamTls {
    pub fn new(options: Options<'_>) -> Result<UpstreamTls, FieldProblem> {
        let provider = super::provider();
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| ("url", e.to_string()))?;
        let builder = if options.verify {
            let roots = match options.ca {
                Some(ca) => {
                    let mut roots = RootCertStore::empty();
                    for cert in files::certificates(ca).map_err(|e| ("ca", e))? {
                        roots.add(cert).map_err(|e| {
                            (
                                "ca",
                                format!("`{}`: not a CA certificate: {e}", ca.display()),
                            )
                        })?;
                    }
                    Arc::new(roots)
                }
                None => system_roots().map_err(|e| ("url", e))?,
            };
            builder.with_root_certificates(roots)
        } else {
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
        };
        let mut config = match options.client_cert {
            Some((cert, key)) => {
                let chain = files::certificates(cert).map_err(|e| ("client_cert.cert", e))?;
                let der = files::private_key(key).map_err(|e| ("client_cert.key", e))?;
                // Loaded together so that a key not matching its certificate is an error here,
                // not a handshake the upstream refuses later.
                files::certified_key(cert, key).map_err(|e| ("client_cert", e))?;
                builder
                    .with_client_auth_cert(chain, der)
                    .map_err(|e| ("client_cert", e.to_string()))?
            }
            None => builder.with_no_client_auth(),
        };
        // The pool speaks HTTP/1.1 to upstreams.
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(UpstreamTls {
            config: Arc::new(config),
        })
    }
}

/// The system's CA certificates, read once; an error when there are none.
fn system_roots() -> Result<Arc<RootCertStore>, String> {
    static ROOTS: OnceLock<Result<Arc<RootCertStore>, String>> = OnceLock::new();
    ROOTS
        .get_or_init(|| {
            let found = rustls_native_certs::load_native_certs();
            let mut roots = RootCertStore::empty();
            let (added, _ignored) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                let why = found
                    .errors
                    .first()
                    .map(|e| format!(": {e}"))
                    .unwrap_or_default();
                return Err(format!(
                    "no system CA certificates found{why}; install ca-certificates or give `ca:`"
                ));
            }
            Ok(Arc::new(roots))
        })
        .clone()
}

/// `tls_verify: false`: any certificate for any name.
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
