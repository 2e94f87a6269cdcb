//! Test support for the Envoy rate limit service: a Turnstile with an `rls:` block on free
//! loopback ports, a gRPC client, and plain HTTP/1.1 calls to the admin listener.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tonic::transport::Channel;
use turnstile::metrics::Metrics;
use turnstile::Running;

/// A running Turnstile whose `rls:` block reads the given envoyproxy/ratelimit files. Shut down
/// (and its temp dir removed) when dropped.
pub struct Rls {
    pub running: Option<Running>,
    pub grpc: SocketAddr,
    pub admin: SocketAddr,
    pub dir: tempfile::TempDir,
}

/// Writes `policies.yaml` (with `rls_extra` lines added to the `rls:` block and `store_block` as
/// the store) and the rls config files, then starts Turnstile on port 0 everywhere.
pub async fn start_with(files: &[(&str, &str)], rls_extra: &str, store_block: &str) -> Rls {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir(dir.path().join("rls")).expect("mkdir");
    for (name, text) in files {
        std::fs::write(dir.path().join("rls").join(name), text).expect("write rls file");
    }
    let policies = format!(
        "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\n{store_block}\nrls:\n  listen: 127.0.0.1:0\n  config: ./rls\n{rls_extra}"
    );
    let path = dir.path().join("policies.yaml");
    std::fs::write(&path, policies).expect("write policies");
    let running = start_file(&path).await;
    Rls {
        grpc: running.rls_addr.expect("rls listener"),
        admin: running.admin_addr,
        running: Some(running),
        dir,
    }
}

pub async fn start(files: &[(&str, &str)], rls_extra: &str) -> Rls {
    start_with(files, rls_extra, "store:\n  type: memory").await
}

async fn start_file(path: &Path) -> Running {
    let metrics = Metrics::new();
    let snapshot =
        turnstile::config::load(path, &metrics).unwrap_or_else(|e| panic!("config: {e}"));
    let public = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let admin = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    turnstile::start(snapshot, metrics, Some((public, admin)))
        .await
        .expect("start")
}

impl Rls {
    pub async fn client(&self) -> RateLimitServiceClient<Channel> {
        RateLimitServiceClient::connect(format!("http://{}", self.grpc))
            .await
            .expect("connect to the rls listener")
    }

    /// `GET`/`POST` on the admin listener: (status, body).
    pub async fn admin(&self, method: &str, path: &str, body: &str) -> (u16, String) {
        http(self.admin, method, path, body).await
    }

    pub async fn metrics(&self) -> String {
        self.admin("GET", "/metrics", "").await.1
    }

    pub async fn stop(mut self) {
        if let Some(r) = self.running.take() {
            r.shutdown().await;
        }
    }
}

/// One HTTP/1.1 request with `Connection: close`; enough for admin endpoints.
pub async fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut response = String::new();
    stream.read_to_string(&mut response).await.expect("read");
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    (
        status,
        if chunked {
            dechunk(body)
        } else {
            body.to_owned()
        },
    )
}

/// Decodes an HTTP/1.1 chunked body (RFC 9112 §7.1).
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if size == 0 || rest.len() < size {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].trim_start_matches("\r\n");
    }
    out
}

/// A GET with extra headers: (status, lower-cased response headers, body).
pub async fn get(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
) -> (u16, Vec<(String, String)>, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let mut request = format!("GET {path} HTTP/1.1\r\nhost: test\r\nconnection: close\r\n");
    for (k, v) in headers {
        request.push_str(&format!("{k}: {v}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut response = String::new();
    stream.read_to_string(&mut response).await.expect("read");
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    (status, headers, body.to_owned())
}

/// The first value of header `name` (lower case).
pub fn header<'h>(headers: &'h [(String, String)], name: &str) -> Option<&'h str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

/// An upstream that answers every request `200 upstream`, until the test's runtime ends.
pub async fn upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind upstream");
    let addr = listener.local_addr().expect("addr");
    let app = axum::Router::new().fallback(|| async { "upstream\n" });
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    addr
}

/// A descriptor from `key=value` pairs.
pub fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: (*k).into(),
                value: (*v).into(),
            })
            .collect(),
        ..Default::default()
    }
}

pub fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors,
        hits_addend: 0,
    }
}

pub async fn call(
    client: &mut RateLimitServiceClient<Channel>,
    request: RateLimitRequest,
) -> RateLimitResponse {
    client
        .should_rate_limit(request)
        .await
        .expect("ShouldRateLimit")
        .into_inner()
}

/// The value of a metric line starting with `prefix` (name and labels), 0 when absent.
pub fn metric(text: &str, prefix: &str) -> u64 {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

pub mod envoy;

/// A throwaway `redis-server` on a free loopback port, killed by PID on drop.
pub struct Redis {
    child: std::process::Child,
    pub port: u16,
    _dir: tempfile::TempDir,
}

impl Redis {
    pub async fn start() -> Redis {
        let dir = tempfile::tempdir().expect("tempdir");
        // redis-server cannot bind port 0: take a free one and hand it over.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let child = std::process::Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("redis-server is not installed: apt-get install redis-server");
        let redis = Redis {
            child,
            port,
            _dir: dir,
        };
        for _ in 0..100 {
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                return redis;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        panic!("redis-server did not listen on {port}");
    }

    /// Kills the server now (a store outage).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Like [`start_with`], but returns the start error instead of panicking.
pub async fn try_start_with(
    files: &[(&str, &str)],
    rls_extra: &str,
    store_block: &str,
) -> Result<Rls, String> {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir(dir.path().join("rls")).expect("mkdir");
    for (name, text) in files {
        std::fs::write(dir.path().join("rls").join(name), text).expect("write rls file");
    }
    let policies = format!(
        "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\n{store_block}\nrls:\n  listen: 127.0.0.1:0\n  config: ./rls\n{rls_extra}"
    );
    let path = dir.path().join("policies.yaml");
    std::fs::write(&path, policies).expect("write policies");
    let metrics = Metrics::new();
    let snapshot = turnstile::config::load(&path, &metrics).map_err(|e| e.to_string())?;
    let public = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let admin = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let running = turnstile::start(snapshot, metrics, Some((public, admin)))
        .await
        .map_err(|e| e.to_string())?;
    // A Redis store connects in the background: wait until it can decide.
    for _ in 0..200 {
        if http(running.admin_addr, "GET", "/readyz", "").await.0 == 200 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    Ok(Rls {
        grpc: running.rls_addr.expect("rls listener"),
        admin: running.admin_addr,
        running: Some(running),
        dir,
    })
}
