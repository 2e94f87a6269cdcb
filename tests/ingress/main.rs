//! Integration tests of the ingress door (issue 12): forward-auth over HTTP and Envoy ext_authz,
//! called directly and through real proxies (NGINX, Traefik, Caddy, Envoy) started on free
//! loopback ports in front of an in-test upstream. The proxies run the shipped examples of
//! `deploy/ingress/`, which `docs/ingress.md` shows verbatim.

#[path = "../support/mod.rs"]
mod support;

mod caddy;
mod direct;
mod docs;
mod envoy;
mod nginx;
mod traefik;

use std::net::SocketAddr;

use support::client::get_from;
use support::ingress::OTHER_CLIENT;
use support::{Client, TestGateway, Upstream};

/// Check-only routes: `users` keyed by a path parameter, `per_client` by the client's address.
/// Refill is one token an hour, so none comes back during a test. The proxies reach Turnstile
/// from 127.0.0.1, which is trusted; the test's "other client" is 127.0.0.2, which is not.
pub const CONFIG: &str = r#"
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
client_ip:
  trusted_proxies: [127.0.0.1/32]
forward_auth:
  listen: 127.0.0.1:0
  grpc_listen: 127.0.0.1:0
routes:
  - name: users
    match:
      path: /api/users/{user_id}
    policies:
      - name: per_user
        key: [path:user_id]
        token_bucket: { rate: 1/h, burst: 3 }
  - name: clients
    match: { prefix: /api/client }
    policies:
      - name: per_client
        key: [client_ip]
        token_bucket: { rate: 1/h, burst: 3 }
"#;

/// Turnstile with [`CONFIG`], and its check listeners.
pub async fn turnstile() -> (TestGateway, SocketAddr, SocketAddr) {
    let gw = TestGateway::start(CONFIG).await;
    let http = gw.running().forward_auth_addr.expect("forward_auth.listen");
    let grpc = gw
        .running()
        .ext_authz_addr
        .expect("forward_auth.grpc_listen");
    (gw, http, grpc)
}

/// A shipped example with the placeholder addresses replaced: Turnstile's check listener
/// (`127.0.0.1:8082`, `port_value: 8083` for gRPC) and the application (`127.0.0.1:3000`).
pub fn example(name: &str, check: SocketAddr, upstream: SocketAddr) -> String {
    std::fs::read_to_string(support::tools::repo_path(&format!("deploy/ingress/{name}")))
        .unwrap_or_else(|e| panic!("deploy/ingress/{name}: {e}"))
        .replace("127.0.0.1:8082", &check.to_string())
        .replace("127.0.0.1:3000", &upstream.to_string())
}

fn echo(body: &[u8]) -> serde_json::Value {
    serde_json::from_slice(body).unwrap_or_else(|e| {
        panic!(
            "not the upstream's echo ({e}): {}",
            String::from_utf8_lossy(body)
        )
    })
}

/// What every proxy must do in front of Turnstile and `upstream`, through `proxy`:
///
/// - a burst of 3 on one key admits exactly 3, each reaching the upstream with
///   `X-RateLimit-Remaining` 2, 1, 0; the 4th gets 429 with `Retry-After`;
/// - another key has its own bucket;
/// - a client that is not trusted (127.0.0.2) cannot mint new `client_ip` keys by sending its
///   own `X-Forwarded-For`.
pub async fn scenario(proxy: SocketAddr, upstream: &Upstream) {
    let client = Client::new();
    let base = upstream.requests();
    let url = |path: &str| format!("http://{proxy}{path}");
    for remaining in ["2", "1", "0"] {
        let reply = client.get(&url("/api/users/alice")).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        let seen = echo(&reply.body);
        assert_eq!(seen["path"], "/api/users/alice");
        assert_eq!(
            seen["headers"]["x-ratelimit-remaining"],
            serde_json::json!([remaining]),
            "the upstream gets the decision's headers: {seen}"
        );
        assert_eq!(
            seen["headers"]["x-ratelimit-limit"],
            serde_json::json!(["3"])
        );
    }
    let refused = client.get(&url("/api/users/alice")).await;
    assert_eq!(refused.status, 429, "{:?}", refused.body);
    let retry: u64 = refused
        .headers
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .expect("a numeric Retry-After");
    assert!((1..=3600).contains(&retry), "Retry-After {retry}");
    assert_eq!(
        upstream.requests() - base,
        3,
        "exactly the admitted requests"
    );

    let other = client.get(&url("/api/users/bob")).await;
    assert_eq!(other.status, 200, "another key has its own bucket");
    assert_eq!(
        echo(&other.body)["headers"]["x-ratelimit-remaining"],
        serde_json::json!(["2"])
    );
    assert_eq!(upstream.requests() - base, 4);

    for i in 0..3 {
        let spoof = format!("10.9.0.{i}");
        let reply = get_from(
            OTHER_CLIENT,
            proxy,
            "/api/client/x",
            &[("x-forwarded-for", spoof.as_str())],
        )
        .await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
    }
    let spoofed = get_from(
        OTHER_CLIENT,
        proxy,
        "/api/client/x",
        &[("x-forwarded-for", "10.9.0.99")],
    )
    .await;
    assert_eq!(
        spoofed.status, 429,
        "a new X-Forwarded-For from an untrusted client is the same client"
    );
    assert_eq!(upstream.requests() - base, 7);
}
