//! The gateway under test, in process: a config written to a temp file, listeners on loopback
//! port 0, and a plain HTTP/1.1 client that opens one connection per request.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

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
