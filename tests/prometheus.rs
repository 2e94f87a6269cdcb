//! The dashboard and the alerts, proven on a real Prometheus: it scrapes a running gateway that
//! serves allowed, limited, unrouted and upstream-failing traffic, and every PromQL expression of
//! `dashboards/turnstile.json` and `dashboards/alerts.yml` is run through its HTTP API.
//!
//! A second run puts the gateway on a real Redis that is killed mid-test, so the store-error and
//! fail-open/failed-closed panels and the store alerts are proven on non-zero values, not only on
//! the zero series the gateway creates at start.
//!
//! Also here: `promtool check rules` and `promtool test rules` (the alerts' unit tests).

mod support;

use std::net::{SocketAddr, TcpListener as StdListener};
use std::time::Duration;

use support::dashboard::{
    alert_expr, alert_rules, dashboard_queries, panel_query, samples, substitute, value_of,
};

use support::prometheus::{http_get, Prometheus};
use support::tools::{repo_path, run_ok};
use support::{RedisServer, TestGateway};

#[test]
fn promtool_checks_the_alert_rules() {
    run_ok(
        "promtool",
        &["check", "rules", "dashboards/alerts.yml"],
        "Debian: apt-get install prometheus",
    );
}

#[test]
fn promtool_unit_tests_of_the_alert_rules_pass() {
    run_ok(
        "promtool",
        &["test", "rules", "dashboards/alerts_test.yml"],
        "Debian: apt-get install prometheus",
    );
}

/// A loopback address where nothing listens, for an upstream that refuses connections.
fn refused_addr() -> SocketAddr {
    let listener = StdListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr")
}

/// One HTTP/1.1 GET with a fresh connection; returns the status.
fn get_status(addr: SocketAddr, path: &str) -> u16 {
    http_get(addr, path)
        .map(|(status, _)| status)
        .unwrap_or_else(|e| panic!("GET {path}: {e}"))
}

#[test]
fn every_dashboard_and_alert_query_runs_on_a_real_prometheus() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");

    // An upstream that accepts connections and never answers: the gateway's timeout fires.
    let silent = StdListener::bind("127.0.0.1:0").expect("bind");
    let silent_addr = silent.local_addr().expect("addr");
    let refused = refused_addr();

    let config = format!(
        r#"
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
rlqs:
  listen: 127.0.0.1:0
  assignment_ttl: 2s
  budgets:
    - name: api
      bucket: {{ name: api }}
      token_bucket: {{ rate: 30/s, burst: 6 }}
upstreams:
  refused:
    url: http://{refused}
    connect_timeout: 500ms
  silent:
    url: http://{silent_addr}
    timeout: 200ms
routes:
  - name: users
    match:
      path: /api/users/{{user_id}}
    respond: {{ status: 200, body: "ok" }}
    policies:
      - name: per_user
        key: [path:user_id]
        token_bucket: {{ rate: 1/h, burst: 5 }}
      - name: per_ip
        key: [client_ip]
        sliding_window: {{ limit: 100000, window: 1m }}
      - name: daily
        key: [client_ip]
        quota: {{ limit: 1000000, per: day, time_zone: UTC }}
  - name: llm
    match:
      prefix: /llm
    respond:
      status: 200
      content_type: application/json
      body: '{{"usage":{{"prompt_tokens":3,"completion_tokens":4}}}}'
    policies:
      - name: tokens
        key: [client_ip]
        token_bucket: {{ rate: 1/h, burst: 1000 }}
        cost: {{ usage: openai, reserve: true, max_cost: 100 }}
  - name: broken
    match:
      prefix: /broken
    upstream: refused
  - name: slow
    match:
      prefix: /slow
    upstream: silent
"#
    );

    let gateway = runtime.block_on(TestGateway::start(&config));
    let (public, admin) = (gateway.public, gateway.admin);
    // One proxy stream reporting the quota bucket, so the quota panels have a share to show.
    let rlqs = gateway.running().rlqs_addr.expect("rlqs listener");
    let _stream = runtime.block_on(support::rlqs::open_stream(rlqs, "probe"));
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while runtime.block_on(support::rlqs::share(&gateway, "api", "probe")) == 0.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "no quota share assigned"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    let prometheus = Prometheus::start(admin, &[repo_path("dashboards/alerts.yml")]);
    // A first scrape before any traffic, so every rate has a starting sample.
    prometheus
        .wait_for_value("up{job=\"turnstile\"}", 1.0, Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("{e}\n{}", prometheus.log()));

    // 20 users, 15 requests each on a bucket of 5 with a negligible refill: exactly 5 allowed per
    // user, 10 limited.
    let (mut ok, mut limited) = (0u32, 0u32);
    for user in 0..20 {
        for _ in 0..15 {
            match get_status(public, &format!("/api/users/{user}")) {
                200 => ok += 1,
                429 => limited += 1,
                other => panic!("unexpected status {other}"),
            }
        }
    }
    assert_eq!((ok, limited), (100, 200));
    for _ in 0..4 {
        assert_eq!(get_status(public, "/broken"), 502);
    }
    // Token usage read from a JSON body (the token panels).
    for _ in 0..2 {
        assert_eq!(get_status(public, "/llm"), 200);
    }
    for _ in 0..2 {
        assert_eq!(get_status(public, "/slow/x"), 504);
    }
    for _ in 0..3 {
        assert_eq!(get_status(public, "/nowhere"), 404);
    }

    // Wait until Prometheus has scraped the final counts (and one more sample after them).
    let scraped = |expr: &str, want: f64| {
        prometheus
            .wait_for_value(expr, want, Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("{e}\n{}", prometheus.log()));
    };
    scraped("sum(turnstile_requests_total)", 311.0);
    scraped("sum(turnstile_tokens_total{route=\"llm\"})", 14.0);
    scraped(
        "sum(turnstile_requests_total{route=\"users\",code=\"429\"})",
        200.0,
    );
    scraped(
        "sum(turnstile_decisions_total{route=\"users\",policy=\"per_user\",decision=\"allowed\"})",
        100.0,
    );
    scraped(
        "sum(turnstile_decisions_total{route=\"users\",policy=\"per_user\",decision=\"limited\"})",
        200.0,
    );
    // The quota charges only admitted requests.
    scraped("sum(turnstile_quota_used_units_total)", 100.0);
    scraped(
        "sum(turnstile_upstream_errors_total{route=\"broken\",kind=\"connect\"})",
        4.0,
    );
    scraped(
        "sum(turnstile_upstream_errors_total{route=\"slow\",kind=\"timeout\"})",
        2.0,
    );
    scraped(
        "sum(turnstile_requests_total{route=\"unmatched\",code=\"4xx\"})",
        3.0,
    );
    // The memory store holds one counter per user (per_user), and one each for the client's
    // address (per_ip), its quota (daily) and its token budget (llm); the public listener has no
    // connection left open.
    scraped("sum(turnstile_memory_store_keys)", 23.0);
    scraped("sum(turnstile_memory_store_max_keys)", 1_000_000.0);
    scraped("sum(turnstile_open_connections{listener=\"public\"})", 0.0);
    std::thread::sleep(Duration::from_secs(2));

    // Every dashboard query returns data.
    let mut failures = Vec::new();
    let queries = dashboard_queries();
    assert!(
        queries.len() >= 10,
        "the dashboard has its panels: {queries:?}"
    );
    for (panel, expr) in &queries {
        let expr = substitute(expr);
        match prometheus.query(&expr) {
            Ok(result) if result.is_empty() => {
                failures.push(format!("{panel}: no data from `{expr}`"))
            }
            Ok(_) => {}
            Err(e) => failures.push(format!("{panel}: `{expr}` failed: {e}")),
        }
    }
    // The route variable's values (Grafana's label_values) include every configured route.
    let routes = prometheus
        .label_values("route", "turnstile_requests_total")
        .expect("label values");
    for route in ["users", "broken", "slow", "unmatched"] {
        if !routes.iter().any(|r| r == route) {
            failures.push(format!("route variable: {route} missing from {routes:?}"));
        }
    }

    // Every alert expression runs; on this traffic only the limited ratio of `users` fires.
    for (alert, expr) in alert_rules() {
        match prometheus.query(&expr) {
            Err(e) => failures.push(format!("alert {alert}: `{expr}` failed: {e}")),
            Ok(result) => {
                let routes: Vec<&str> = result
                    .iter()
                    .filter_map(|s| s["metric"]["route"].as_str())
                    .collect();
                match alert.as_str() {
                    "TurnstileHighLimitedRatio" if routes != ["users"] => failures.push(format!(
                        "alert {alert}: fires for {routes:?}, expected [\"users\"]"
                    )),
                    "TurnstileStoreFailingOpen" | "TurnstileStoreFailingClosed"
                        if !result.is_empty() =>
                    {
                        failures.push(format!(
                            "alert {alert}: fires with a healthy store: {result:?}"
                        ))
                    }
                    _ => {}
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} problems:\n{}",
        failures.len(),
        failures.join("\n")
    );

    drop(prometheus);
    runtime.block_on(gateway.shutdown());
    drop(silent);
}

/// Records a failure unless `value` is a positive rate.
fn positive(failures: &mut Vec<String>, what: &str, value: Option<f64>) {
    match value {
        Some(v) if v > 0.0 => {}
        other => failures.push(format!("{what}: {other:?}, expected a positive rate")),
    }
}

#[test]
fn store_failure_panels_and_alerts_show_a_redis_outage() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let mut redis = RedisServer::start();
    let route = |name: &str, extra: &str| {
        format!(
            "  - name: {name}\n    match: {{ path: /{name} }}\n    respond: {{ status: 200, body: \"ok\" }}\n\
             {extra}    policies:\n      - name: shared\n        key: [method]\n        \
             token_bucket: {{ rate: 1/d, burst: 1000 }}\n"
        )
    };
    let config = format!(
        "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nstore:\n  type: redis\n  url: {}\n  \
         pool_size: 2\n  timeout: 50ms\n  failure_mode: open\n  key_prefix: \"prom:\"\nroutes:\n{}{}",
        redis.url(),
        route("open", ""),
        route("closed", "    failure_mode: closed\n"),
    );
    let gateway = runtime.block_on(TestGateway::start(&config));
    let public = gateway.public;

    let prometheus = Prometheus::start(gateway.admin, &[repo_path("dashboards/alerts.yml")]);
    let scraped = |expr: &str, want: f64| {
        prometheus
            .wait_for_value(expr, want, Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("{e}\n{}", prometheus.log()));
    };
    scraped("up{job=\"turnstile\"}", 1.0);

    // Healthy store: every request is decided by Redis and allowed.
    for path in ["/open", "/closed"] {
        for _ in 0..5 {
            assert_eq!(get_status(public, path), 200, "{path} with Redis up");
        }
    }
    scraped(
        "sum(turnstile_decisions_total{policy=\"shared\",decision=\"allowed\"})",
        10.0,
    );
    assert_eq!(
        prometheus.scalar("sum(turnstile_store_errors_total)"),
        Some(0.0),
        "store errors with Redis up"
    );

    // Redis dies: the open route serves uncounted, the closed route refuses with 503.
    redis.kill();
    for _ in 0..20 {
        assert_eq!(get_status(public, "/open"), 200, "/open with Redis down");
    }
    for _ in 0..10 {
        assert_eq!(
            get_status(public, "/closed"),
            503,
            "/closed with Redis down"
        );
    }
    scraped(
        "sum(turnstile_decisions_total{route=\"open\",decision=\"failed_open\"})",
        20.0,
    );
    scraped(
        "sum(turnstile_decisions_total{route=\"closed\",decision=\"failed_closed\"})",
        10.0,
    );
    scraped("sum(turnstile_store_errors_total{store=\"redis\"})", 30.0);
    // One more scrape after the final counts, as in the memory-store test.
    std::thread::sleep(Duration::from_secs(2));

    let mut failures = Vec::new();

    let errors = samples(
        &prometheus,
        &panel_query("Store errors and fail-open decisions", "A"),
    );
    positive(
        &mut failures,
        &format!("store errors panel, summed over {errors:?}"),
        Some(errors.iter().map(|(_, v)| v).sum()),
    );
    for (labels, _) in &errors {
        if !labels.starts_with("kind=") || !labels.ends_with(",store=redis") {
            failures.push(format!("store errors panel: unexpected series {labels}"));
        }
    }

    let failed = samples(
        &prometheus,
        &panel_query("Store errors and fail-open decisions", "B"),
    );
    positive(
        &mut failures,
        &format!("fail-open panel, open route, of {failed:?}"),
        value_of(&failed, "decision=failed_open,route=open"),
    );
    positive(
        &mut failures,
        &format!("failed-closed panel, closed route, of {failed:?}"),
        value_of(&failed, "decision=failed_closed,route=closed"),
    );

    let stat = samples(&prometheus, &panel_query("Failed-open decisions / s", "A"));
    positive(
        &mut failures,
        &format!("failed-open stat {stat:?}"),
        value_of(&stat, ""),
    );

    // The alerts keep their `for:` clause, so this checks the expressions, not the firing state:
    // each returns exactly the route that fails that way.
    for (alert, route) in [
        ("TurnstileStoreFailingOpen", "open"),
        ("TurnstileStoreFailingClosed", "closed"),
    ] {
        let result = samples(&prometheus, &alert_expr(alert));
        let routes: Vec<&str> = result.iter().map(|(l, _)| l.as_str()).collect();
        if routes != [format!("route={route}")] {
            failures.push(format!(
                "alert {alert}: returns {result:?}, expected route={route}"
            ));
        }
        positive(
            &mut failures,
            &format!("alert {alert}"),
            value_of(&result, &format!("route={route}")),
        );
    }
    assert!(
        failures.is_empty(),
        "{} problems:\n{}\n{}",
        failures.len(),
        failures.join("\n"),
        prometheus.log()
    );

    drop(prometheus);
    runtime.block_on(gateway.shutdown());
}
