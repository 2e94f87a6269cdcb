//! Envoy's ext_authz filter (gRPC) with the shipped example bootstrap.

use crate::support::envoy::Envoy;
use crate::support::Upstream;

/// The example with the test's addresses: admin and listener on free ports (port 0), Turnstile's
/// ext_authz listener and the upstream where they really are.
pub(crate) fn bootstrap(grpc: std::net::SocketAddr, upstream: std::net::SocketAddr) -> String {
    crate::example("envoy-ext-authz.yaml", grpc, upstream)
        .replace("port_value: 9901", "port_value: 0")
        .replace(
            "address: 0.0.0.0, port_value: 10000",
            "address: 127.0.0.1, port_value: 0",
        )
        .replace("port_value: 8083", &format!("port_value: {}", grpc.port()))
        .replace(
            "port_value: 3000",
            &format!("port_value: {}", upstream.port()),
        )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_ext_authz_admits_the_burst_then_denies_with_429() {
    let (gw, _, grpc) = crate::turnstile().await;
    let upstream = Upstream::start().await;
    let envoy = Envoy::start(&bootstrap(grpc, upstream.addr)).await;
    crate::scenario(envoy.listener, &upstream).await;

    // The denied response carries the gateway's body and headers.
    let client = crate::support::Client::new();
    let refused = client
        .get(&format!("http://{}/api/users/alice", envoy.listener))
        .await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.headers["x-ratelimit-remaining"], "0");
    let body: serde_json::Value = serde_json::from_slice(&refused.body).expect("JSON body");
    assert_eq!(body["error"], "rate_limited");
    assert_eq!(body["policy"], "per_user");
    let labels = [("door", "ext_authz"), ("result", "limited")];
    assert_eq!(gw.metric("turnstile_door_checks_total", &labels).await, 3.0);
}
