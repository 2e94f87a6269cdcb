//! The Envoy rate limit service under test: a [`TestGateway`] whose config has an `rls:` block
//! reading the given envoyproxy/ratelimit files, on free loopback ports, with a gRPC client and
//! Envoy's messages built from `key=value` pairs. Envoy itself is in [`super::envoy`].

use std::net::SocketAddr;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use http::Method;
use tonic::transport::Channel;

use super::client::{self, Client};
use super::gateway::TestGateway;

/// A running Turnstile with an `rls:` block. Shut down (and its files removed) when dropped.
pub struct Rls {
    pub gw: TestGateway,
    pub grpc: SocketAddr,
    pub admin: SocketAddr,
}

/// `policies.yaml` with `store_block` as the store and `rls_extra` lines added to the `rls:`
/// block, whose config is the directory `rls/` holding `files`.
fn policies(rls_extra: &str, store_block: &str) -> String {
    format!(
        "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\n{store_block}\nrls:\n  listen: 127.0.0.1:0\n  config: ./rls\n{rls_extra}"
    )
}

/// Starts Turnstile with the rls config `files` (in `rls/`) on the given store.
pub async fn start_with(files: &[(&str, &str)], rls_extra: &str, store_block: &str) -> Rls {
    try_start_with(files, rls_extra, store_block)
        .await
        .unwrap_or_else(|e| panic!("start: {e}"))
}

/// [`start_with`] on the in-process store.
pub async fn start(files: &[(&str, &str)], rls_extra: &str) -> Rls {
    start_with(files, rls_extra, "store:\n  type: memory").await
}

/// Like [`start_with`], but returns the start error instead of panicking.
pub async fn try_start_with(
    files: &[(&str, &str)],
    rls_extra: &str,
    store_block: &str,
) -> Result<Rls, String> {
    let files: Vec<(String, &str)> = files
        .iter()
        .map(|(name, text)| (format!("rls/{name}"), *text))
        .collect();
    let files: Vec<(&str, &str)> = files.iter().map(|(n, t)| (n.as_str(), *t)).collect();
    let gw = TestGateway::try_launch(&policies(rls_extra, store_block), None, &files).await?;
    Ok(Rls {
        grpc: gw.rls.expect("rls listener"),
        admin: gw.admin,
        gw,
    })
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

    /// The value of `name{labels}` on `/metrics`, 0 when absent.
    pub async fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.gw.metric(name, labels).await
    }

    /// The directory holding `policies.yaml` and `rls/`.
    pub fn dir(&self) -> &std::path::Path {
        self.gw
            .config_path
            .parent()
            .expect("the config's directory")
    }

    pub async fn stop(self) {
        self.gw.shutdown().await;
    }
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
