//! Test support for the Envoy rate limit service: a Turnstile with an `rls:` block on free
//! loopback ports, a gRPC client, and calls to the admin listener. HTTP goes through
//! `tests/support`'s client, so a test binary using this module declares `mod support;` too.

#![allow(dead_code)]

use std::net::SocketAddr;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use http::Method;
use tokio::net::TcpListener;
use tonic::transport::Channel;
use turnstile::metrics::Metrics;
use turnstile::Running;

use crate::support::client::{self, Client, Reply};

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
    try_start_with(files, rls_extra, store_block)
        .await
        .unwrap_or_else(|e| panic!("start: {e}"))
}

pub async fn start(files: &[(&str, &str)], rls_extra: &str) -> Rls {
    start_with(files, rls_extra, "store:\n  type: memory").await
}

impl Rls {
    pub async fn client(&self) -> RateLimitServiceClient<Channel> {
        RateLimitServiceClient::connect(format!("http://{}", self.grpc))
            .await
            .expect("connect to the rls listener")
    }

    /// `GET`/`POST` on the admin listener: (status, body).
    pub async fn admin(&self, method: &str, path: &str, body: &str) -> (u16, String) {
        let method = Method::from_bytes(method.as_bytes()).expect("an HTTP method");
        let request = client::request(method, &format!("http://{}{path}", self.admin))
            .header("content-type", "application/json")
            .body(client::full(body.to_owned()))
            .expect("request");
        let reply = Client::new().send(request).await;
        (reply.status, reply.text())
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

/// A GET with extra headers on a fresh client.
pub async fn get(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Reply {
    Client::new()
        .get_with(&format!("http://{addr}{path}"), headers)
        .await
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
        let ready = format!("http://{}/readyz", running.admin_addr);
        if Client::new().get(&ready).await.status == 200 {
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
