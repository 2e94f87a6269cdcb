//! The gateway under test, in process: a config written to a temp file, listeners on loopback
//! port 0.
//!
//! Two front doors onto the same thing:
//! - [`Gateway`]: the listen addresses are added for you, and a plain HTTP/1.1 client opens one
//!   connection per request ([`get`]); dropping it without `stop` leaves its tasks to the test's
//!   runtime, which ends with the test.
//! - [`TestGateway`]: the YAML is used as written, `$UPSTREAM` in it is replaced by the address of
//!   the upstream given to [`TestGateway::with_upstream`], and `reload_with` rewrites the file
//!   and re-reads it exactly as SIGHUP does. Dropping it stops the gateway (the shutdown channel
//!   closes with it) and deletes the file.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tempfile::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use turnstile::config::ConfigErrors;
use turnstile::metrics::Metrics;
use turnstile::Running;

/// A running gateway. `stop` drains it; dropping it without `stop` leaves its tasks to the
/// test's runtime, which ends with the test.
pub struct Gateway {
    running: Option<turnstile::Running>,
    _dir: tempfile::TempDir,
}

impl Gateway {
    /// Starts a gateway on `config_yaml` (everything but the listen addresses).
    pub async fn start(config_yaml: &str) -> Gateway {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("policies.yaml");
        std::fs::write(
            &path,
            format!("listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\n{config_yaml}"),
        )
        .expect("write config");
        let metrics = turnstile::metrics::Metrics::new();
        let snapshot = turnstile::config::load(&path, &metrics).expect("config loads");
        let public = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let admin = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let running = turnstile::start(snapshot, metrics, Some((public, admin)))
            .await
            .expect("start");
        Gateway {
            running: Some(running),
            _dir: dir,
        }
    }

    fn running(&self) -> &turnstile::Running {
        self.running.as_ref().expect("running")
    }

    pub fn public(&self) -> SocketAddr {
        self.running().public_addr
    }

    pub fn admin(&self) -> SocketAddr {
        self.running().admin_addr
    }

    /// The status of a GET on the public listener.
    pub async fn get(&self, path: &str) -> u16 {
        get(self.public(), path).await.0
    }

    /// A GET on the admin listener: (status, body).
    pub async fn admin_get(&self, path: &str) -> (u16, String) {
        get(self.admin(), path).await
    }

    pub async fn stop(mut self) {
        if let Some(running) = self.running.take() {
            running.shutdown().await;
        }
    }
}

/// One GET on a fresh connection: (status, body). The body is read to the connection's close, so
/// it may carry chunked framing; tests look into it, they do not parse it as HTTP.
pub async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .expect("write");
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut response))
        .await
        .expect("response within 10s")
        .expect("read");
    let response = String::from_utf8_lossy(&response).into_owned();
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status line");
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// A running in-process gateway.
#[derive(Debug)]
pub struct TestGateway {
    pub public: SocketAddr,
    pub admin: SocketAddr,
    pub config_path: PathBuf,
    upstream: Option<SocketAddr>,
    running: Option<Running>,
    _dir: TempDir,
}

/// Replaces `$UPSTREAM` with `addr` (as `http://IP:PORT`'s authority).
pub fn substitute(yaml: &str, upstream: Option<SocketAddr>) -> String {
    match upstream {
        Some(addr) => yaml.replace("$UPSTREAM", &addr.to_string()),
        None => yaml.to_string(),
    }
}

impl TestGateway {
    /// A gateway whose config needs no upstream (`respond:` routes only).
    pub async fn start(yaml: &str) -> TestGateway {
        Self::launch(yaml, None).await
    }

    /// A gateway whose config refers to `$UPSTREAM`.
    pub async fn with_upstream(yaml: &str, upstream: SocketAddr) -> TestGateway {
        Self::launch(yaml, Some(upstream)).await
    }

    async fn launch(yaml: &str, upstream: Option<SocketAddr>) -> TestGateway {
        let dir = tempfile::tempdir().expect("tempdir");
        let config_path = dir.path().join("policies.yaml");
        std::fs::write(&config_path, substitute(yaml, upstream)).expect("write config");
        let metrics = Metrics::new();
        let snapshot = turnstile::config::load(&config_path, &metrics)
            .unwrap_or_else(|e| panic!("test config does not load:\n{e}"));
        let public = TcpListener::bind("127.0.0.1:0").await.expect("bind public");
        let admin = TcpListener::bind("127.0.0.1:0").await.expect("bind admin");
        let running = turnstile::start(snapshot, metrics, Some((public, admin)))
            .await
            .expect("gateway starts");
        TestGateway {
            public: running.public_addr,
            admin: running.admin_addr,
            config_path,
            upstream,
            running: Some(running),
            _dir: dir,
        }
    }

    /// `http://PUBLIC{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.public)
    }

    /// `http://ADMIN{path}`.
    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin)
    }

    pub fn running(&self) -> &Running {
        self.running.as_ref().expect("gateway already shut down")
    }

    /// Rewrites the config file (with `$UPSTREAM` substituted) and reloads it, as SIGHUP does.
    pub fn reload_with(&self, yaml: &str) -> Result<(), ConfigErrors> {
        write_config(&self.config_path, &substitute(yaml, self.upstream));
        self.running().reload()
    }

    /// Stops accepting and drains in-flight requests, as on SIGTERM.
    pub async fn shutdown(mut self) {
        if let Some(running) = self.running.take() {
            running.shutdown().await;
        }
    }

    /// The admin listener's `/metrics` text.
    pub async fn metrics(&self) -> String {
        let response = super::client::Client::new()
            .get(&self.admin_url("/metrics"))
            .await;
        assert_eq!(response.status, 200, "/metrics: {}", response.text());
        response.text()
    }
}

fn write_config(path: &Path, text: &str) {
    std::fs::write(path, text).expect("write config");
}
