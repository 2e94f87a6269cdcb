//! The admin listener: `/metrics`, `/healthz` and `/readyz` there and only there, and decision
//! counts that match what clients saw.

use crate::support::{metric, Client, TestGateway, Upstream};

#[tokio::test]
async fn admin_endpoints_answer_on_the_admin_listener_only() {
    let gw = TestGateway::start(
        r#"
routes:
  - name: api
    match: { prefix: /api }
    respond: { body: api }
"#,
    )
    .await;
    let c = Client::new();
    for path in ["/metrics", "/healthz", "/readyz"] {
        let reply = c.get(&gw.url(path)).await;
        assert_eq!(reply.status, 404, "public {path}");
        assert_eq!(reply.json()["error"], "no_route");
    }
    let health = c.get(&gw.admin_url("/healthz")).await;
    assert_eq!((health.status, health.text().as_str()), (200, "ok\n"));
    let ready = c.get(&gw.admin_url("/readyz")).await;
    assert_eq!((ready.status, ready.text().as_str()), (200, "ready\n"));
    let metrics = c.get(&gw.admin_url("/metrics")).await;
    assert_eq!(metrics.status, 200);
    assert!(metrics
        .header("content-type")
        .unwrap()
        .starts_with("text/plain; version=0.0.4"));
    assert!(
        metrics.text().contains("\nturnstile_build_info{"),
        "{}",
        metrics.text()
    );
    // And the admin listener routes nothing to the proxy.
    assert_eq!(c.get(&gw.admin_url("/api")).await.status, 404);
}

#[tokio::test]
async fn on_the_public_listener_admin_paths_are_ordinary_requests() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(
        r#"
upstreams:
  up: { url: "http://$UPSTREAM" }
routes:
  - name: all
    upstream: up
"#,
        upstream.addr,
    )
    .await;
    let reply = Client::new().get(&gw.url("/metrics")).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.json()["path"], "/metrics", "proxied to the upstream");
    assert_eq!(upstream.requests(), 1);
}

#[tokio::test]
async fn decision_counts_match_what_clients_saw() {
    let gw = TestGateway::start(
        r#"
routes:
  - name: api
    respond: { body: ok }
    policies:
      - { name: per_ip, key: [client_ip], token_bucket: { rate: 1/h, burst: 3 } }
      - { name: per_user, key: ["header:x-user"], sliding_window: { limit: 1, window: 1h } }
  - name: other
    match: { prefix: /other }
    respond: { body: ok }
"#,
    )
    .await;
    let c = Client::new();
    let mut seen = Vec::new();
    // per_user applies to the first two only (the others have no x-user).
    seen.push(c.get_with(&gw.url("/"), &[("x-user", "u")]).await.status);
    seen.push(c.get_with(&gw.url("/"), &[("x-user", "u")]).await.status);
    for _ in 0..4 {
        seen.push(c.get(&gw.url("/")).await.status);
    }
    assert_eq!(seen, [200, 429, 200, 200, 429, 429]);

    let text = gw.metrics().await;
    let decisions = |policy: &str, decision: &str| {
        let labels = [("route", "api"), ("policy", policy), ("decision", decision)];
        metric(&text, "turnstile_decisions_total", &labels)
    };
    assert_eq!(decisions("per_ip", "allowed"), Some(4.0), "{text}");
    assert_eq!(decisions("per_ip", "limited"), Some(2.0));
    // The second request was rejected by per_user alone: per_ip allowed it (and kept its token).
    assert_eq!(decisions("per_user", "allowed"), Some(1.0));
    assert_eq!(decisions("per_user", "limited"), Some(1.0));
    for policy in ["per_ip", "per_user"] {
        for label in ["failed_open", "failed_closed"] {
            assert_eq!(decisions(policy, label), Some(0.0));
        }
    }
    let requests = |code: &str| {
        metric(
            &text,
            "turnstile_requests_total",
            &[("route", "api"), ("code", code)],
        )
    };
    assert_eq!(requests("2xx"), Some(3.0));
    assert_eq!(requests("429"), Some(3.0));
    // Routes without policies take no decisions at all.
    let other_decisions = text
        .lines()
        .filter(|l| l.starts_with("turnstile_decisions_total{"))
        .filter(|l| l.contains("route=\"other\""))
        .count();
    assert_eq!(other_decisions, 0);
}
