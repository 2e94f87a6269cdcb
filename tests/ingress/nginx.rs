//! NGINX `auth_request` (Debian `nginx-light`) with the shipped recipe: `?deny_status=403`,
//! `auth_request_set`, `error_page 403 = @ratelimited`, so the client gets a real 429.

use crate::support::{Nginx, Upstream};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_auth_request_admits_the_burst_then_gives_the_client_a_429() {
    let (_gw, check, _) = crate::turnstile_for(Some("nginx")).await;
    let upstream = Upstream::start().await;
    let nginx = Nginx::start_with(
        &crate::example("nginx-server.conf", check, upstream.addr),
        &crate::example("nginx-http.conf", check, upstream.addr),
    );
    crate::scenario(nginx.addr, &upstream).await;

    // The 429 is NGINX's own, built from the check's headers.
    let client = crate::support::Client::new();
    let refused = client
        .get(&format!("http://{}/api/users/alice", nginx.addr))
        .await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.headers["x-ratelimit-remaining"], "0");
    assert_eq!(refused.headers["x-ratelimit-limit"], "3");
    let body: serde_json::Value = serde_json::from_slice(&refused.body).expect("JSON body");
    assert_eq!(body["error"], "rate_limited");
    crate::spoofing(nginx.addr, &upstream).await;
}

/// With `forward_auth.proxy` unset, the shipped nginx recipe still lets no client field name the
/// request: the recipe clears the names it does not set, and a call that mixes two proxies' names
/// would be refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_auth_request_believes_no_client_naming_field_with_proxy_auto() {
    let (_gw, check, _) = crate::turnstile().await;
    let upstream = Upstream::start().await;
    let nginx = Nginx::start_with(
        &crate::example("nginx-server.conf", check, upstream.addr),
        &crate::example("nginx-http.conf", check, upstream.addr),
    );
    crate::scenario(nginx.addr, &upstream).await;
    crate::spoofing(nginx.addr, &upstream).await;
}
