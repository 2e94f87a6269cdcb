//! The metrics tell the truth: after a known set of requests, `/metrics` on the admin listener
//! holds exactly the counts of what was sent, allowed and limited, and no series keyed by request
//! values.

mod support;

use support::{Client, TestGateway};

/// The text exposition format, read back.
struct Scrape(String);

impl Scrape {
    /// The value of the sample `name` whose labels are exactly `labels` (in any order).
    fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        support::metric(&self.0, name, labels)
    }

    fn must(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.value(name, labels)
            .unwrap_or_else(|| panic!("no sample {name}{labels:?} in:\n{}", self.0))
    }

    fn decisions(&self, route: &str, policy: &str, decision: &str) -> f64 {
        self.must(
            "turnstile_decisions_total",
            &[("route", route), ("policy", policy), ("decision", decision)],
        )
    }

    fn requests(&self, route: &str, code: &str) -> f64 {
        self.must(
            "turnstile_requests_total",
            &[("route", route), ("code", code)],
        )
    }

    /// The sample lines, which is the number of series exported.
    fn series(&self) -> usize {
        self.0
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .count()
    }
}

/// Scrapes the gateway's `/metrics`.
async fn scrape(gw: &TestGateway) -> Scrape {
    Scrape(gw.metrics().await)
}

const USERS: &str = r#"
routes:
  - name: users
    match:
      path: /api/users/{user_id}
    respond: { status: 200, body: "ok" }
    policies:
      - name: per_user
        key: [path:user_id]
        token_bucket: { rate: 1/h, burst: 5 }
      - name: per_key
        key: [header:x-api-key]
        sliding_window: { limit: 1000, window: 1m }
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_requests_are_counted_exactly() {
    let gw = TestGateway::start(USERS).await;
    let before = scrape(&gw).await;
    // Every series exists from startup, at 0.
    for decision in ["allowed", "limited", "failed_open", "failed_closed"] {
        assert_eq!(
            before.decisions("users", "per_user", decision),
            0.0,
            "{decision}"
        );
    }
    assert_eq!(before.requests("users", "429"), 0.0);

    // Two users, 8 requests each, on a bucket of 5 that refills once an hour.
    for user in ["alice", "bob"] {
        for _ in 0..8 {
            gw.get(&format!("/api/users/{user}")).await;
        }
    }
    assert_eq!(gw.get("/nowhere").await, 404);

    let m = scrape(&gw).await;
    assert_eq!(m.decisions("users", "per_user", "allowed"), 10.0);
    assert_eq!(m.decisions("users", "per_user", "limited"), 6.0);
    assert_eq!(m.decisions("users", "per_user", "failed_open"), 0.0);
    // per_key's key part (a header) is absent: that policy never applied.
    assert_eq!(m.decisions("users", "per_key", "allowed"), 0.0);
    assert_eq!(m.decisions("users", "per_key", "limited"), 0.0);
    assert_eq!(m.requests("users", "2xx"), 10.0);
    assert_eq!(m.requests("users", "429"), 6.0);
    assert_eq!(
        m.requests("users", "4xx"),
        0.0,
        "429 is counted apart from 4xx"
    );
    assert_eq!(m.requests("unmatched", "4xx"), 1.0);
    assert_eq!(
        m.must(
            "turnstile_request_duration_seconds_count",
            &[("route", "users")]
        ),
        16.0
    );
    assert_eq!(
        m.must(
            "turnstile_request_duration_seconds_count",
            &[("route", "unmatched")]
        ),
        1.0
    );
    assert_eq!(
        m.must(
            "turnstile_decision_duration_seconds_count",
            &[("store", "memory")]
        ),
        16.0
    );
    assert_eq!(
        m.must(
            "turnstile_store_errors_total",
            &[("store", "memory"), ("kind", "timeout")]
        ),
        0.0
    );
    assert_eq!(
        m.must(
            "turnstile_build_info",
            &[("version", env!("CARGO_PKG_VERSION"))]
        ),
        1.0
    );

    // Request values (user ids) never become labels: the set of series did not grow.
    assert_eq!(m.series(), before.series(), "series appeared with traffic");
    assert!(!m.0.contains("alice"));
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_are_counted_exactly() {
    let gw = TestGateway::start(USERS).await;
    let (client, url) = (Client::new(), gw.url("/api/users/carol"));
    let tasks: Vec<_> = (0..200)
        .map(|_| {
            let (client, url) = (client.clone(), url.clone());
            // A connection per request, as 200 clients would; none left idle for the shutdown.
            tokio::spawn(async move {
                client
                    .get_with(&url, &[("connection", "close")])
                    .await
                    .status
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for task in tasks {
        statuses.push(task.await.expect("task"));
    }
    let allowed = statuses.iter().filter(|&&s| s == 200).count();
    let limited = statuses.iter().filter(|&&s| s == 429).count();
    assert_eq!((allowed, limited), (5, 195), "statuses: {statuses:?}");

    let m = scrape(&gw).await;
    assert_eq!(m.decisions("users", "per_user", "allowed"), 5.0);
    assert_eq!(m.decisions("users", "per_user", "limited"), 195.0);
    assert_eq!(m.requests("users", "2xx"), 5.0);
    assert_eq!(m.requests("users", "429"), 195.0);
    assert_eq!(
        m.must(
            "turnstile_decision_duration_seconds_count",
            &[("store", "memory")]
        ),
        200.0
    );
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_request_counts_limited_only_for_the_policy_that_rejected_it() {
    let gw = TestGateway::start(
        r#"
routes:
  - name: search
    match:
      prefix: /search
    respond: { status: 200, body: "ok" }
    policies:
      - name: tight
        key: [client_ip]
        token_bucket: { rate: 1/h, burst: 2 }
      - name: loose
        key: [client_ip]
        sliding_window: { limit: 100, window: 1h }
"#,
    )
    .await;
    for _ in 0..5 {
        gw.get("/search").await;
    }
    let m = scrape(&gw).await;
    assert_eq!(m.decisions("search", "tight", "allowed"), 2.0);
    assert_eq!(m.decisions("search", "tight", "limited"), 3.0);
    // The loose policy allowed all five; the three rejected requests consumed nothing from it.
    assert_eq!(m.decisions("search", "loose", "allowed"), 5.0);
    assert_eq!(m.decisions("search", "loose", "limited"), 0.0);
    assert_eq!(m.requests("search", "429"), 3.0);
    gw.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_errors_are_counted_by_kind() {
    // Nothing listens on this port once the listener is dropped: connections are refused.
    let refused = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr");
    // This one accepts (the kernel completes the handshake) and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let silent_addr = silent.local_addr().expect("addr");
    let gw = TestGateway::start(&format!(
        r#"
upstreams:
  refused:
    url: http://{refused}
    connect_timeout: 500ms
  silent:
    url: http://{silent_addr}
    timeout: 200ms
routes:
  - name: broken
    match:
      prefix: /broken
    upstream: refused
  - name: slow
    match:
      prefix: /slow
    upstream: silent
"#
    ))
    .await;
    for _ in 0..3 {
        assert_eq!(gw.get("/broken").await, 502);
    }
    for _ in 0..2 {
        assert_eq!(gw.get("/slow").await, 504);
    }
    let m = scrape(&gw).await;
    let upstream = |route, kind| {
        m.must(
            "turnstile_upstream_errors_total",
            &[("route", route), ("kind", kind)],
        )
    };
    assert_eq!(upstream("broken", "connect"), 3.0);
    assert_eq!(upstream("broken", "timeout"), 0.0);
    assert_eq!(upstream("slow", "timeout"), 2.0);
    assert_eq!(upstream("slow", "connect"), 0.0);
    assert_eq!(m.requests("broken", "5xx"), 3.0);
    assert_eq!(m.requests("slow", "5xx"), 2.0);
    gw.shutdown().await;
    drop(silent);
}

/// Every series of every configured route and policy was exported at 0 from startup: 10,000
/// routes made `/metrics` 25 MB before a single request. Now a route's series appear on its first
/// request, so the page grows with the routes in use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regression_metrics_exported_every_configured_route_at_zero() {
    let mut yaml = String::from("routes:\n");
    for i in 0..10_000 {
        yaml.push_str(&format!(
            "  - name: svc{i}\n    match: {{ path: \"/svc{i}/items/{{id}}\" }}\n    respond: {{ body: ok }}\n    policies:\n      - {{ name: per_ip, key: [client_ip], token_bucket: {{ rate: 10/s, burst: 10 }} }}\n"
        ));
    }
    let gw = TestGateway::start(&yaml).await;
    let idle = scrape(&gw).await;
    assert!(
        idle.0.len() < 20_000,
        "idle /metrics is {} bytes",
        idle.0.len()
    );
    assert!(!idle.0.contains("route=\"svc"));
    for i in [0, 42, 9_999] {
        assert_eq!(gw.get(&format!("/svc{i}/items/1")).await, 200);
    }
    let used = scrape(&gw).await;
    for i in [0, 42, 9_999] {
        let route = format!("svc{i}");
        assert_eq!(used.requests(&route, "2xx"), 1.0);
        assert_eq!(used.requests(&route, "429"), 0.0);
        assert_eq!(used.decisions(&route, "per_ip", "allowed"), 1.0);
        assert_eq!(used.decisions(&route, "per_ip", "limited"), 0.0);
    }
    // Three routes' worth: each exports the same series.
    let per_route = (used.series() - idle.series()) / 3;
    assert_eq!(used.series(), idle.series() + 3 * per_route);
    assert!(!used.0.contains("route=\"svc1\""));
    assert!(used.0.len() < 30_000, "/metrics is {} bytes", used.0.len());
    gw.shutdown().await;
}

/// Regression: the memory store exported neither how many counters it held nor how many checks
/// its overflow sketch decided. A store of 4 keys, every counter in use: 4 keys, and each new key
/// after them decided in the sketch (refused or not, it counts once per check).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store_keys_and_overflow_checks_are_exported() {
    let gw = TestGateway::start(
        r#"
store: { type: memory, max_keys: 4 }
routes:
  - name: users
    match:
      path: /u/{user}
    respond: { status: 200, body: "ok" }
    policies:
      - name: per_user
        key: [path:user]
        token_bucket: { rate: 1/h, burst: 5 }
"#,
    )
    .await;
    let m = scrape(&gw).await;
    assert_eq!(m.must("turnstile_memory_store_keys", &[]), 0.0);
    assert_eq!(m.must("turnstile_memory_store_max_keys", &[]), 4.0);
    assert_eq!(
        m.must("turnstile_memory_store_overflow_checks_total", &[]),
        0.0
    );
    // Four users fill the store; a second request of one of them adds no counter.
    for user in ["a", "b", "c", "d", "a"] {
        assert_eq!(gw.get(&format!("/u/{user}")).await, 200);
    }
    let m = scrape(&gw).await;
    assert_eq!(m.must("turnstile_memory_store_keys", &[]), 4.0);
    assert_eq!(
        m.must("turnstile_memory_store_overflow_checks_total", &[]),
        0.0
    );
    // No counter is idle (each bucket refills in hours): three new users go to the sketch.
    for user in ["e", "f", "g"] {
        gw.get(&format!("/u/{user}")).await;
    }
    let m = scrape(&gw).await;
    assert_eq!(m.must("turnstile_memory_store_keys", &[]), 4.0);
    assert_eq!(
        m.must("turnstile_memory_store_overflow_checks_total", &[]),
        3.0
    );
    assert_eq!(m.decisions("users", "per_user", "allowed"), 8.0);
    gw.shutdown().await;
}
