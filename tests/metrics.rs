//! The metrics tell the truth: after a known set of requests, `/metrics` on the admin listener
//! holds exactly the counts of what was sent, allowed and limited, and no series keyed by request
//! values.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A gateway on loopback port 0 with this config (listen addresses are supplied).
struct Gateway {
    running: Option<turnstile::Running>,
    _dir: tempfile::TempDir,
}

impl Gateway {
    async fn start(routes_yaml: &str) -> Gateway {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("policies.yaml");
        std::fs::write(
            &path,
            format!("listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\n{routes_yaml}"),
        )
        .expect("write");
        let metrics = turnstile::metrics::Metrics::new();
        let snapshot = turnstile::config::load(&path, &metrics).expect("config loads");
        let public = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let admin = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let running = turnstile::start(snapshot, metrics, Some((public, admin)))
            .await
            .expect("start");
        Gateway {
            running: Some(running),
            _dir: dir,
        }
    }

    fn public(&self) -> SocketAddr {
        self.running.as_ref().expect("running").public_addr
    }

    async fn get(&self, path: &str) -> u16 {
        get(self.public(), path).await.0
    }

    async fn metrics(&self) -> Scrape {
        let (status, body) = get(
            self.running.as_ref().expect("running").admin_addr,
            "/metrics",
        )
        .await;
        assert_eq!(status, 200);
        Scrape(body)
    }

    async fn stop(mut self) {
        if let Some(running) = self.running.take() {
            running.shutdown().await;
        }
    }
}

/// One request on a fresh connection: (status, body).
async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .expect("write");
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut response))
        .await
        .expect("response within 10s")
        .expect("read");
    let response = String::from_utf8_lossy(&response).into_owned();
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status line");
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// The text exposition format, read back.
struct Scrape(String);

impl Scrape {
    /// The value of the sample `name` whose labels are exactly `labels` (in any order).
    fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.0
            .lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|line| {
                let (series, value) = line.rsplit_once(' ')?;
                let (metric, label_text) = match series.split_once('{') {
                    Some((m, rest)) => (m, rest.strip_suffix('}')?),
                    None => (series, ""),
                };
                if metric != name {
                    return None;
                }
                let mut found: Vec<(&str, &str)> = label_text
                    .split(',')
                    .filter(|p| !p.is_empty())
                    .filter_map(|p| {
                        let (k, v) = p.split_once('=')?;
                        Some((k, v.trim_matches('"')))
                    })
                    .collect();
                let mut want = labels.to_vec();
                found.sort_unstable();
                want.sort_unstable();
                (found == want).then(|| value.parse().ok())?
            })
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
    let gw = Gateway::start(USERS).await;
    let before = gw.metrics().await;
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

    let m = gw.metrics().await;
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
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_are_counted_exactly() {
    let gw = Gateway::start(USERS).await;
    let public = gw.public();
    let tasks: Vec<_> = (0..200)
        .map(|_| tokio::spawn(async move { get(public, "/api/users/carol").await.0 }))
        .collect();
    let mut statuses = Vec::new();
    for task in tasks {
        statuses.push(task.await.expect("task"));
    }
    let allowed = statuses.iter().filter(|&&s| s == 200).count();
    let limited = statuses.iter().filter(|&&s| s == 429).count();
    assert_eq!((allowed, limited), (5, 195), "statuses: {statuses:?}");

    let m = gw.metrics().await;
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
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_request_counts_limited_only_for_the_policy_that_rejected_it() {
    let gw = Gateway::start(
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
    let m = gw.metrics().await;
    assert_eq!(m.decisions("search", "tight", "allowed"), 2.0);
    assert_eq!(m.decisions("search", "tight", "limited"), 3.0);
    // The loose policy allowed all five; the three rejected requests consumed nothing from it.
    assert_eq!(m.decisions("search", "loose", "allowed"), 5.0);
    assert_eq!(m.decisions("search", "loose", "limited"), 0.0);
    assert_eq!(m.requests("search", "429"), 3.0);
    gw.stop().await;
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
    let gw = Gateway::start(&format!(
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
    let m = gw.metrics().await;
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
    gw.stop().await;
    drop(silent);
}
