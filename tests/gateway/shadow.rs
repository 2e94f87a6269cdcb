//! `mode: shadow` (issue 13): a shadow route or policy decides and counts like an enforced one,
//! never rejects, and shows in `turnstile_decisions_total{decision="shadow"}` when it would have
//! refused. A shadow policy over its limit consumes nothing, and does not undo what the enforced
//! policies of the same request consume. Run on both stores (the Redis script decides too).

use crate::support::stores::TestStore;
use crate::support::{metric, Client, TestGateway, Upstream};

/// `dark`: a whole route in shadow. `mixed`: an enforced policy of 5 and a shadow one of 2. The
/// rates (one token an hour) cannot refill during the test.
const YAML: &str = r#"
upstreams:
  up: { url: "http://$UPSTREAM" }
routes:
  - name: dark
    upstream: up
    mode: shadow
    match: { prefix: /dark }
    policies:
      - { name: per_ip, key: [client_ip], token_bucket: { rate: 1/h, burst: 2 } }
  - name: mixed
    upstream: up
    match: { prefix: /mixed }
    policies:
      - { name: enforced, key: [client_ip], token_bucket: { rate: 1/h, burst: 5 } }
      - { name: trial, key: [client_ip], mode: shadow, sliding_window: { limit: 2, window: 1h } }
"#;

async fn shadow_never_rejects_but_counts_exactly(store: TestStore) {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(&store.config(YAML), upstream.addr).await;
    let c = Client::new();

    for n in 0..6 {
        let reply = c.get(&gw.url("/dark")).await;
        assert_eq!(
            reply.status, 200,
            "dark request {n}: a shadow route never rejects"
        );
        assert_eq!(
            reply.header("x-ratelimit-limit"),
            None,
            "shadow policies are invisible to clients"
        );
    }

    // The enforced policy governs the headers and counts down alone: the shadow policy's
    // refusals (from the third request on) do not stop its consumption.
    for expect in [4, 3, 2, 1, 0] {
        let reply = c.get(&gw.url("/mixed")).await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("x-ratelimit-limit"), Some("5"));
        assert_eq!(reply.header_u64("x-ratelimit-remaining"), expect);
    }
    let refused = c.get(&gw.url("/mixed")).await;
    assert_eq!(refused.status, 429, "the enforced policy still refuses");
    assert_eq!(refused.json()["policy"], "enforced");
    assert_eq!(upstream.requests(), 11);

    let text = gw.metrics().await;
    let decisions = |route: &str, policy: &str, d: &str| {
        metric(
            &text,
            "turnstile_decisions_total",
            &[("route", route), ("policy", policy), ("decision", d)],
        )
    };
    assert_eq!(decisions("dark", "per_ip", "allowed"), Some(2.0));
    assert_eq!(decisions("dark", "per_ip", "shadow"), Some(4.0));
    assert_eq!(decisions("dark", "per_ip", "limited"), Some(0.0));
    assert_eq!(decisions("mixed", "enforced", "allowed"), Some(5.0));
    assert_eq!(decisions("mixed", "enforced", "limited"), Some(1.0));
    assert_eq!(decisions("mixed", "enforced", "shadow"), Some(0.0));
    assert_eq!(decisions("mixed", "trial", "allowed"), Some(2.0));
    assert_eq!(decisions("mixed", "trial", "shadow"), Some(4.0));
    assert_eq!(decisions("mixed", "trial", "limited"), Some(0.0));
    assert_eq!(
        metric(
            &text,
            "turnstile_requests_total",
            &[("route", "dark"), ("code", "429")]
        ),
        Some(0.0)
    );
}

crate::store_matrix!(shadow_never_rejects_but_counts_exactly);

/// A route whose applied policies are all shadow never refuses, not even when the store is down
/// and its `failure_mode` is `closed`; a route with an enforced policy still fails closed.
#[tokio::test]
async fn a_shadow_route_fails_open_even_when_closed() {
    let mut redis = crate::support::RedisServer::start();
    let yaml = format!(
        r#"
store: {{ type: redis, url: "{}", timeout: 200ms, failure_mode: closed }}
routes:
  - name: dark
    match: {{ prefix: /dark }}
    mode: shadow
    respond: {{ body: dark }}
    policies:
      - {{ name: p, key: [method], token_bucket: {{ rate: 1/h, burst: 3 }} }}
  - name: lit
    match: {{ prefix: /lit }}
    respond: {{ body: lit }}
    policies:
      - {{ name: p, key: [method], token_bucket: {{ rate: 1/h, burst: 3 }} }}
      - {{ name: q, key: [method], mode: shadow, token_bucket: {{ rate: 1/h, burst: 3 }} }}
"#,
        redis.url()
    );
    let gw = TestGateway::start(&yaml).await;
    let c = Client::new();
    assert_eq!(
        c.get(&gw.url("/dark")).await.status,
        200,
        "the store answers"
    );
    redis.kill();
    let dark = c.get(&gw.url("/dark")).await;
    assert_eq!(dark.status, 200);
    assert_eq!(dark.text(), "dark");
    assert_eq!(c.get(&gw.url("/lit")).await.status, 503);
    let text = gw.metrics().await;
    let decisions = |route: &str, policy: &str, d: &str| {
        metric(
            &text,
            "turnstile_decisions_total",
            &[("route", route), ("policy", policy), ("decision", d)],
        )
    };
    assert_eq!(decisions("dark", "p", "allowed"), Some(1.0));
    assert_eq!(decisions("dark", "p", "failed_open"), Some(1.0));
    assert_eq!(decisions("dark", "p", "failed_closed"), Some(0.0));
    assert_eq!(decisions("lit", "p", "failed_closed"), Some(1.0));
    assert_eq!(decisions("lit", "q", "failed_closed"), Some(1.0));
}
