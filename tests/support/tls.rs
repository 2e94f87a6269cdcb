//! TLS material and a TLS client for tests: a CA and certificates made with `openssl` in a
//! temporary directory ([`Pki`]), and one HTTPS connection with rustls ([`TlsConn`]) that tells
//! which certificate the server presented and which protocol ALPN chose.
//!
//! Keys are EC P-256: quick to make, so each test makes its own CA.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::net::TcpStream;

use super::tools::run_ok;
use super::LIVENESS;

const INSTALL: &str = "apt-get install openssl";

/// A CA in a temporary directory, and the certificates it signs there.
pub struct Pki {
    dir: tempfile::TempDir,
    /// `ca.pem`.
    pub ca: PathBuf,
    ca_key: PathBuf,
}

/// What a leaf certificate is for (its extended key usage).
#[derive(Debug, Clone, Copy)]
pub enum Usage {
    Server,
    Client,
}

impl Pki {
    /// A new CA named `name` (its subject's CN).
    pub fn new(name: &str) -> Pki {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = dir.path().join("ca.pem");
        let ca_key = dir.path().join("ca.key");
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
            "-keyout",
            path(&ca_key),
            "-out",
            path(&ca),
        ]);
        Pki { dir, ca, ca_key }
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// `NAME.pem` and `NAME.key`: a certificate for `localhost` and `127.0.0.1` with serial
    /// `serial`, signed by this CA. Returns (certificate, key).
    pub fn leaf(&self, name: &str, serial: u32, usage: Usage) -> (PathBuf, PathBuf) {
        self.leaf_with(
            name,
            serial,
            usage,
            &format!("/CN={name}"),
            "DNS:localhost,IP:127.0.0.1",
        )
    }

    /// [`Pki::leaf`] with the subject (`openssl -subj`, `/O=Example/CN=a`) and subject
    /// alternative names (`DNS:a,URI:spiffe://b`) given.
    pub fn leaf_with(
        &self,
        name: &str,
        serial: u32,
        usage: Usage,
        subject: &str,
        san: &str,
    ) -> (PathBuf, PathBuf) {
        let cert = self.dir.path().join(format!("{name}.pem"));
        let key = self.dir.path().join(format!("{name}.key"));
        let csr = self.dir.path().join(format!("{name}.csr"));
        let ext = self.dir.path().join(format!("{name}.ext"));
        let eku = match usage {
            Usage::Server => "serverAuth",
            Usage::Client => "clientAuth",
        };
        std::fs::write(
            &ext,
            format!(
                "subjectAltName={san}\nbasicConstraints=CA:FALSE\n\
                 keyUsage=critical,digitalSignature\nextendedKeyUsage={eku}\n"
            ),
        )
        .expect("write ext");
        openssl(&[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-subj",
            subject,
            "-keyout",
            path(&key),
            "-out",
            path(&csr),
        ]);
        openssl(&[
            "x509",
            "-req",
            "-in",
            path(&csr),
            "-CA",
            path(&self.ca),
            "-CAkey",
            path(&self.ca_key),
            "-set_serial",
            &serial.to_string(),
            "-days",
            "2",
            "-extfile",
            path(&ext),
            "-out",
            path(&cert),
        ]);
        (cert, key)
    }
}

fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 temp path")
}

fn openssl(args: &[&str]) {
    run_ok("openssl", args, INSTALL);
}

/// The DER of the first certificate of a PEM file.
pub fn der(pem: &Path) -> Vec<u8> {
    CertificateDer::pem_file_iter(pem)
        .expect("read pem")
        .next()
        .expect("a certificate")
        .expect("valid pem")
        .as_ref()
        .to_vec()
}

/// A TLS connection to `addr` as `localhost`, trusting only `ca`, offering `alpn`: the handshake
/// done, nothing sent.
pub async fn handshake(
    addr: SocketAddr,
    ca: &Path,
    alpn: &[&[u8]],
) -> tokio_rustls::client::TlsStream<TcpStream> {
    try_handshake(addr, ca, alpn).await.expect("handshake")
}

/// [`handshake`], with its error when it fails.
pub async fn try_handshake(
    addr: SocketAddr,
    ca: &Path,
    alpn: &[&[u8]],
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).expect("read ca") {
        roots.add(cert.expect("ca pem")).expect("add ca");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let name = ServerName::try_from("localhost").expect("name");
    tokio::time::timeout(LIVENESS, connector.connect(name, tcp))
        .await
        .expect("handshake in time")
}

/// One HTTPS/1.1 connection, kept alive between requests.
pub struct TlsConn {
    sender: http1::SendRequest<Empty<Bytes>>,
    /// The leaf certificate the server presented (DER).
    pub peer_cert: Vec<u8>,
    /// What ALPN chose.
    pub alpn: Option<Vec<u8>>,
}

impl TlsConn {
    /// Connects to `addr` as `localhost`, trusting only `ca`, offering `alpn`.
    pub async fn connect(addr: SocketAddr, ca: &Path, alpn: &[&[u8]]) -> TlsConn {
        let stream = handshake(addr, ca, alpn).await;
        let (_, session) = stream.get_ref();
        let peer_cert = session
            .peer_certificates()
            .and_then(|c| c.first())
            .expect("a peer certificate")
            .as_ref()
            .to_vec();
        let alpn = session.alpn_protocol().map(<[u8]>::to_vec);
        let (sender, conn) = http1::handshake(TokioIo::new(stream))
            .await
            .expect("http1 handshake");
        tokio::spawn(conn);
        TlsConn {
            sender,
            peer_cert,
            alpn,
        }
    }

    /// GET `path` on this connection: (status, body).
    pub async fn get(&mut self, path: &str) -> (u16, String) {
        let req = Request::get(path)
            .header("host", "localhost")
            .body(Empty::new())
            .expect("request");
        let exchange = async {
            let response = self.sender.send_request(req).await.expect("send");
            let status = response.status().as_u16();
            let body = response.into_body().collect().await.expect("body");
            (
                status,
                String::from_utf8_lossy(&body.to_bytes()).into_owned(),
            )
        };
        tokio::time::timeout(LIVENESS, exchange)
            .await
            .expect("response in time")
    }
}
