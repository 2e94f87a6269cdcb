//! `exempt:`: requests from listed client IPs, or carrying a listed header value, skip every policy,
//! consume nothing and are counted in `turnstile_exempt_total` (ingress-nginx's `limit-whitelist`).

use crate::support::{metric, Client, TestGateway, Upstream};

/// The peer is 127.0.0.1, a trusted proxy, so `X-Forwarded-For` picks the client IP.
const YAML: &str = r#"
client_ip:
  trusted_proxies: [127.0.0.1]
exempt:
  headers: { x-internal: "yes" }
upstreams:
  up: { url: "http://$UPSTREAM" }
routes:
  - name: api
    upstream: up
    exempt:
      client_ips: [192.0.2.0/24]
    policies:
      - { name: per_ip, key: [client_ip], token_bucket: { rate: 1/h, burst: 2 } }
"#;

#[tokio::test]
async fn exempt_requests_skip_every_policy_consume_nothing_and_are_counted() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(YAML, upstream.addr).await;
    let c = Client::new();
    let from = |ip: &'static str| vec![("x-forwarded-for", ip)];

    // An exempt header does not spend the client's tokens: its whole burst is still there after.
    for _ in 0..3 {
        let mut headers = from("198.51.100.1");
        headers.push(("x-internal", "yes"));
        let reply = c.get_with(&gw.url("/"), &headers).await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("x-ratelimit-limit"), None, "no policy applied");
    }
    for _ in 0..2 {
        let reply = c.get_with(&gw.url("/"), &from("198.51.100.1")).await;
        assert_eq!(reply.status, 200);
    }
    assert_eq!(
        c.get_with(&gw.url("/"), &from("198.51.100.1")).await.status,
        429
    );
    // Another value of the header is not exempt.
    let wrong = [("x-forwarded-for", "198.51.100.1"), ("x-internal", "no")];
    assert_eq!(c.get_with(&gw.url("/"), &wrong).await.status, 429);

    // A client in the route's range is never limited.
    for _ in 0..10 {
        let reply = c.get_with(&gw.url("/"), &from("192.0.2.77")).await;
        assert_eq!(reply.status, 200);
    }

    let text = gw.metrics().await;
    assert_eq!(
        metric(&text, "turnstile_exempt_total", &[("route", "api")]),
        Some(13.0)
    );
    let decisions = |d: &str| {
        metric(
            &text,
            "turnstile_decisions_total",
            &[("route", "api"), ("policy", "per_ip"), ("decision", d)],
        )
    };
    assert_eq!(
        decisions("allowed"),
        Some(2.0),
        "exempt requests are not decisions"
    );
    assert_eq!(decisions("limited"), Some(2.0));
    assert_eq!(upstream.requests(), 15);
}
