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
mod pacing;
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
  - name: gets
    match:
      path: /api/get/{id}
      methods: [GET]
    policies:
      - name: per_get
        key: [path:id]
        token_bucket: { rate: 1/h, burst: 1 }
  - name: paced
    match: { prefix: /api/paced }
    policies:
      - name: per_paced
        key: [method]
        token_bucket: { rate: 5/s, burst: 1 }
        on_limit: delay
        max_delay: 2s
  - name: this_host
    match: { host: 127.0.0.1, prefix: /api/host }
    policies:
      - name: per_host
        key: [client_ip]
        token_bucket: { rate: 1/h, burst: 1 }
"#;

/// Turnstile with [`CONFIG`] (`forward_auth.proxy` unset: `auto`), and its check listeners.
pub async fn turnstile() -> (TestGateway, SocketAddr, SocketAddr) {
    turnstile_for(None).await
}

/// Turnstile with [`CONFIG`] and `forward_auth.proxy: NAME`.
pub async fn turnstile_for(proxy: Option<&str>) -> (TestGateway, SocketAddr, SocketAddr) {
    let config = match proxy {
        Some(name) => CONFIG.replace(
            "forward_auth:\n",
            &format!("forward_auth:\n  proxy: {name}\n"),
        ),
        None => CONFIG.to_string(),
    };
    let gw = TestGateway::start(&config).await;
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

/// Every field that names the original request, as a client in front of `proxy` could add it.
const SPOOFS: &[(&str, &str)] = &[
    ("x-forwarded-uri", "/nowhere"),
    ("x-forwarded-uri", "/api/users/victim"),
    ("x-forwarded-method", "POST"),
    ("x-forwarded-host", "other.example"),
    ("x-original-uri", "/nowhere"),
    ("x-original-uri", "/api/users/victim"),
    ("x-original-method", "POST"),
    ("x-original-url", "http://other.example/nowhere"),
    ("x-original-url", "http://127.0.0.1/api/users/victim"),
];

/// A client in front of `proxy` adds each field of [`SPOOFS`] (alone, then all together) to a
/// request whose budget is spent, on a path route, a method route and a host route: none reaches
/// the upstream. Then `victim`'s budget, which only spoofed fields named, is still whole.
pub async fn spoofing(proxy: SocketAddr, upstream: &Upstream) {
    let from = std::net::IpAddr::from([127, 0, 0, 1]);
    // Spend the method route's and the host route's budgets (the users route's is spent by
    // `scenario`).
    for path in ["/api/get/1", "/api/host/1"] {
        let reply = get_from(from, proxy, path, &[]).await;
        assert_eq!(reply.status, 200, "{path}: {:?}", reply.body);
    }
    let base = upstream.requests();
    let all: Vec<(&str, &str)> = SPOOFS
        .iter()
        .copied()
        .filter(|(_, v)| !v.contains("victim"))
        .collect();
    for path in ["/api/users/alice", "/api/get/1", "/api/host/1"] {
        let sets = SPOOFS
            .iter()
            .map(std::slice::from_ref)
            .chain([all.as_slice()]);
        for spoof in sets {
            let reply = get_from(from, proxy, path, spoof).await;
            assert_ne!(
                reply.status, 200,
                "{path} with {spoof:?} escaped its limit: {:?}",
                reply.body
            );
            assert_eq!(
                upstream.requests(),
                base,
                "{path} with {spoof:?} reached the upstream"
            );
        }
    }
    let victim = get_from(from, proxy, "/api/users/victim", &[]).await;
    assert_eq!(victim.status, 200, "{:?}", victim.body);
    assert_eq!(
        echo(&victim.body)["headers"]["x-ratelimit-remaining"],
        serde_json::json!(["2"]),
        "spoofed fields spent the victim's budget"
    );
}
