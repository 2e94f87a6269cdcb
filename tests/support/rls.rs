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

/// What a gRPC call sent as raw bytes got: `grpc-status`, `grpc-message` (from the trailers, or
/// from the headers of a trailers-only answer) and the response message's bytes.
pub struct RawAnswer {
    pub status: Option<String>,
    pub message: Option<String>,
    pub body: Vec<u8>,
}

/// `ShouldRateLimit` with `message` as the request message's bytes, as they are (one
/// uncompressed gRPC frame over a fresh HTTP/2 connection): for messages a generated client
/// cannot send. The response message is returned undecoded, without its 5-byte prefix.
pub async fn raw_call(addr: SocketAddr, message: &[u8]) -> RawAnswer {
    let exchange = async {
        let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (mut send, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
        let driver = tokio::spawn(async move {
            let _ = connection.await;
        });
        let request = http::Request::builder()
            .method(Method::POST)
            .uri(format!(
                "http://{addr}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
            ))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .expect("request");
        let (response, mut stream) = send.send_request(request, false).expect("send request");
        let mut frame = vec![0u8];
        frame.extend_from_slice(&u32::try_from(message.len()).expect("len").to_be_bytes());
        frame.extend_from_slice(message);
        stream
            .send_data(bytes::Bytes::from(frame), true)
            .expect("send data");
        let (parts, mut body) = response.await.expect("response").into_parts();
        let mut data = Vec::new();
        while let Some(chunk) = body.data().await {
            let chunk = chunk.expect("response body");
            let _ = body.flow_control().release_capacity(chunk.len());
            data.extend_from_slice(&chunk);
        }
        let trailers = body.trailers().await.expect("trailers").unwrap_or_default();
        let field = |name: &str| {
            trailers
                .get(name)
                .or_else(|| parts.headers.get(name))
                .map(|v| v.to_str().expect("ASCII").to_owned())
        };
        let answer = RawAnswer {
            status: field("grpc-status"),
            message: field("grpc-message"),
            body: data.get(5..).unwrap_or_default().to_vec(),
        };
        driver.abort();
        answer
    };
    tokio::time::timeout(std::time::Duration::from_secs(30), exchange)
        .await
        .expect("raw gRPC call timed out")
}
