//! An Envoy ext_authz client for the tests: one `Check` of `GET path` on `api.example` from
//! 192.0.2.7 with the given headers, as Envoy's filter sends it.

use std::net::SocketAddr;

use envoy_types::pb::envoy::config::core::v3::address::Address as Kind;
use envoy_types::pb::envoy::config::core::v3::{Address, SocketAddress};
use envoy_types::pb::envoy::service::auth::v3::attribute_context::{HttpRequest, Peer, Request};
use envoy_types::pb::envoy::service::auth::v3::authorization_client::AuthorizationClient;
use envoy_types::pb::envoy::service::auth::v3::{AttributeContext, CheckRequest, CheckResponse};

/// The whole answer to one `Check`.
pub async fn check(grpc: SocketAddr, path: &str, headers: &[(&str, &str)]) -> CheckResponse {
    check_with_metadata(grpc, path, headers, &[]).await
}

/// [`check`] with gRPC metadata on the call (Envoy's `traceparent`, for one).
pub async fn check_with_metadata(
    grpc: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    metadata: &[(&'static str, &str)],
) -> CheckResponse {
    let mut client = AuthorizationClient::connect(format!("http://{grpc}"))
        .await
        .expect("connect");
    let request = CheckRequest {
        attributes: Some(AttributeContext {
            source: Some(Peer {
                address: Some(Address {
                    address: Some(Kind::SocketAddress(SocketAddress {
                        address: "192.0.2.7".into(),
                        ..Default::default()
                    })),
                }),
                ..Default::default()
            }),
            request: Some(Request {
                http: Some(HttpRequest {
                    method: "GET".into(),
                    path: path.into(),
                    host: "api.example".into(),
                    headers: headers
                        .iter()
                        .map(|(n, v)| (n.to_string(), v.to_string()))
                        .collect(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
    };
    let mut request = tonic::Request::new(request);
    for (name, value) in metadata {
        request
            .metadata_mut()
            .insert(*name, value.parse().expect("a metadata value"));
    }
    client.check(request).await.expect("Check").into_inner()
}

/// The gRPC status code of one `Check` (0: allowed); `absent` when the answer carries none.
pub async fn code(grpc: SocketAddr, path: &str, headers: &[(&str, &str)], absent: i32) -> i32 {
    check(grpc, path, headers)
        .await
        .status
        .map_or(absent, |status| status.code)
}
