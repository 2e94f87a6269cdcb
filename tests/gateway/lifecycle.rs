//! The gateway over time: hot reload, graceful shutdown on SIGTERM, and `turnstile check`.

use std::time::{Duration, Instant};

use crate::support::process::{check, config_file};
use crate::support::{metric, Client, GatewayProcess, TestGateway, Upstream, LIVENESS};

fn version(body: &str, burst: u64) -> String {
    format!(
        r#"
upstreams:
  up: {{ url: "http://$UPSTREAM" }}
routes:
  - name: held
    match: {{ prefix: /held }}
    upstream: up
  - name: api
    respond: {{ body: {body} }}
    policies:
      - {{ name: p, key: [client_ip], token_bucket: {{ rate: 1/h, burst: {burst} }} }}
"#
    )
}

/// Polls `url` until its body is `want` (a reload by signal has no other completion signal).
async fn eventually_body(c: &Client, url: &str, want: &str) {
    let deadline = Instant::now() + LIVENESS;
    loop {
        let reply = c.get(url).await;
        if reply.text() == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "still {:?} instead of {want:?}",
            reply.text()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn reload_swaps_the_config_and_in_flight_requests_complete() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(&version("v1", 1), upstream.addr).await;
    let c = Client::new();
    assert_eq!(c.get(&gw.url("/")).await.text(), "v1");
    assert_eq!(c.get(&gw.url("/")).await.status, 429);

    // A request in flight on the old config...
    let in_flight = tokio::spawn({
        let (c, url) = (c.clone(), gw.url("/held"));
        async move { c.get_with(&url, &[("x-test-hold-head", "1")]).await }
    });
    upstream.wait_for_requests(1).await;
    // ...while the config changes under it: `held` now answers directly.
    let next = version("v2", 3).replace(
        "upstream: up\n  - name: api",
        "respond: { body: gone }\n  - name: api",
    );
    gw.reload_with(&next).await.expect("reload");
    assert_eq!(c.get(&gw.url("/held")).await.text(), "gone");
    // Same route and policy names: the counter carries over (still empty: a larger burst grants
    // no tokens), under the new rule.
    let reply = c.get(&gw.url("/")).await;
    assert_eq!(reply.status, 429);
    assert_eq!(reply.header_u64("x-ratelimit-limit"), 3);
    let renamed = next.replace("name: p,", "name: q,");
    gw.reload_with(&renamed).await.expect("reload");
    assert_eq!(c.get(&gw.url("/")).await.text(), "v2");

    upstream.release(1);
    let reply = in_flight.await.unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(reply.json()["path"], "/held");
    let text = gw.metrics().await;
    assert_eq!(
        metric(&text, "turnstile_config_reloads_total", &[("result", "ok")]),
        Some(2.0)
    );
}

#[tokio::test]
async fn readyz_says_draining_while_in_flight_requests_finish() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(&version("v1", 1), upstream.addr).await;
    let c = Client::new();
    let readyz = gw.admin_url("/readyz");
    assert_eq!(c.get(&readyz).await.status, 200);
    let in_flight = tokio::spawn({
        let (c, url) = (c.clone(), gw.url("/held"));
        async move { c.get_with(&url, &[("x-test-hold-head", "1")]).await }
    });
    upstream.wait_for_requests(1).await;
    let stopping = tokio::spawn(gw.shutdown());
    // The admin listener outlives the public one: load balancers see "draining" while the
    // held request is still being served.
    let deadline = Instant::now() + LIVENESS;
    loop {
        let reply = c.get(&readyz).await;
        if reply.status == 503 {
            assert_eq!(reply.text(), "draining\n");
            break;
        }
        assert!(Instant::now() < deadline, "/readyz never said draining");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    upstream.release(1);
    assert_eq!(in_flight.await.unwrap().status, 200);
    tokio::time::timeout(LIVENESS, stopping)
        .await
        .expect("drained")
        .unwrap();
}

#[tokio::test]
async fn a_silent_connection_does_not_hold_up_shutdown() {
    let gw = TestGateway::start(
        "server: { header_read_timeout: 30s }\nroutes:\n  - name: r\n    respond: { body: ok }\n",
    )
    .await;
    let _silent = tokio::net::TcpStream::connect(gw.public).await.unwrap();
    // Connections are accepted in order: once a later one is answered, the silent one is in.
    assert_eq!(Client::new().get(&gw.url("/")).await.status, 200);
    let started = Instant::now();
    tokio::time::timeout(LIVENESS, gw.shutdown())
        .await
        .expect("shutdown completes");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "shutdown waited {:?} for a connection that never sent a byte",
        started.elapsed()
    );
}

#[tokio::test]
async fn a_bad_file_keeps_the_running_config_and_names_file_and_line() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(&version("v1", 2), upstream.addr).await;
    let c = Client::new();
    assert_eq!(c.get(&gw.url("/")).await.text(), "v1");

    let broken = version("v2", 2).replace("1/h", "1/x");
    let errors = gw
        .reload_with(&broken)
        .await
        .expect_err("a bad rate must not load");
    let text = errors.to_string();
    let path = gw.config_path.display().to_string();
    // Line 11 of the file (the YAML starts with an empty line), column of the value.
    let want = format!("{path}:11:");
    assert!(text.starts_with(&want), "{text}");
    assert!(
        text.contains("routes[1].policies[0].token_bucket.rate: `1/x`"),
        "{text}"
    );

    let syntax = gw
        .reload_with("routes:\n  - name: [unclosed\n")
        .await
        .expect_err("bad YAML");
    assert!(
        syntax.to_string().starts_with(&format!("{path}:")),
        "{syntax}"
    );

    // Still the old config, and still the old counter: one token left of two.
    let reply = c.get(&gw.url("/")).await;
    assert_eq!((reply.status, reply.text().as_str()), (200, "v1"));
    assert_eq!(c.get(&gw.url("/")).await.status, 429);
    let metrics = gw.metrics().await;
    let errors = metric(
        &metrics,
        "turnstile_config_reloads_total",
        &[("result", "error")],
    );
    assert_eq!(errors, Some(2.0));
}

#[tokio::test]
async fn sighup_reloads_the_binary_and_a_bad_file_is_logged_not_applied() {
    sighup_reloads(1).await;
    sighup_reloads(2).await;
}

async fn sighup_reloads(workers: usize) {
    let upstream = Upstream::start().await;
    let yaml =
        |body: &str| crate::support::gateway::substitute(&version(body, 5), Some(upstream.addr));
    let mut gw = GatewayProcess::spawn_with_workers(&yaml("v1"), workers).await;
    let c = Client::new();
    assert_eq!(c.get(&gw.url("/")).await.text(), "v1");

    let with_ports = |y: &str| crate::support::process::with_free_ports(y);
    std::fs::write(&gw.config_path, with_ports(&yaml("v2"))).unwrap();
    gw.signal("HUP");
    eventually_body(&c, &gw.url("/"), "v2").await;

    std::fs::write(
        &gw.config_path,
        with_ports(&yaml("v3").replace("1/h", "1/x")),
    )
    .unwrap();
    gw.signal("HUP");
    let deadline = Instant::now() + LIVENESS;
    while !gw.log().contains("config reload failed") {
        assert!(
            Instant::now() < deadline,
            "no reload failure logged:\n{}",
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let path = gw.config_path.display().to_string();
    assert!(gw.log().contains(&format!("{path}:13:")), "{}", gw.log());
    assert_eq!(c.get(&gw.url("/")).await.text(), "v2");

    gw.signal("TERM");
    assert!(gw.wait().await.success());
}

#[tokio::test]
async fn sigterm_drains_an_in_flight_request_then_exits_zero() {
    sigterm_drains(1).await;
    sigterm_drains(2).await;
}

async fn sigterm_drains(workers: usize) {
    let upstream = Upstream::start().await;
    let yaml = crate::support::gateway::substitute(&version("v1", 5), Some(upstream.addr));
    let mut gw = GatewayProcess::spawn_with_workers(&yaml, workers).await;
    let c = Client::new();
    let in_flight = tokio::spawn({
        let (c, url) = (c.clone(), gw.url("/held"));
        async move { c.get_with(&url, &[("x-test-hold-head", "1")]).await }
    });
    upstream.wait_for_requests(1).await;
    gw.signal("TERM");

    // The listener closes: new connections are refused while the old one drains.
    let deadline = Instant::now() + LIVENESS;
    while tokio::net::TcpStream::connect(gw.public).await.is_ok() {
        assert!(Instant::now() < deadline, "still accepting after SIGTERM");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    upstream.release(1);
    let reply = in_flight.await.unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(reply.json()["path"], "/held");
    let status = gw.wait().await;
    assert!(status.success(), "{status:?}; log:\n{}", gw.log());
    assert!(gw.log().contains("draining"), "{}", gw.log());
}

#[tokio::test]
async fn sigterm_gives_up_on_stuck_requests_after_the_grace_period() {
    sigterm_gives_up(1).await;
    sigterm_gives_up(2).await;
}

async fn sigterm_gives_up(workers: usize) {
    let upstream = Upstream::start().await;
    let yaml = crate::support::gateway::substitute(
        &format!("server:\n  shutdown_grace: 300ms\n{}", version("v1", 5)),
        Some(upstream.addr),
    );
    let mut gw = GatewayProcess::spawn_with_workers(&yaml, workers).await;
    let in_flight = tokio::spawn({
        let url = gw.url("/held");
        async move {
            let req = crate::support::client::request(http::Method::GET, &url)
                .header("x-test-hold-head", "1")
                .body(crate::support::client::empty())
                .unwrap();
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<crate::support::client::ReqBody>()
                .request(req)
                .await
                .map(|r| r.status())
        }
    });
    upstream.wait_for_requests(1).await;
    let signalled = Instant::now();
    gw.signal("TERM");
    let status = gw.wait().await;
    assert!(status.success(), "{status:?}; log:\n{}", gw.log());
    assert!(signalled.elapsed() >= Duration::from_millis(300));
    // The stuck request's connection was closed without an answer.
    let outcome = tokio::time::timeout(LIVENESS, in_flight)
        .await
        .unwrap()
        .unwrap();
    assert!(outcome.is_err(), "{outcome:?}");
}

#[tokio::test]
async fn sigint_stops_an_idle_gateway_with_exit_zero() {
    let mut gw = GatewayProcess::spawn("routes:\n  - name: a\n    respond: { body: a }\n").await;
    assert_eq!(Client::new().get(&gw.url("/")).await.text(), "a");
    gw.signal("INT");
    assert!(gw.wait().await.success());
}

#[test]
fn check_accepts_a_valid_file_and_the_example() {
    let (_dir, path) = config_file("routes:\n  - name: a\n    respond: { body: a }\n");
    let (code, stdout, _) = check(&path);
    assert_eq!(code, Some(0));
    assert_eq!(stdout, format!("{}: ok (1 routes)\n", path.display()));
    let example = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("policies.yaml");
    let (code, _, stderr) = check(&example);
    assert_eq!(code, Some(0), "{stderr}");
}

/// `FILE:LINE:COL: field: message` lines on stderr, exit 1.
fn check_errors(yaml: &str) -> Vec<String> {
    let (_dir, path) = config_file(yaml);
    let (code, stdout, stderr) = check(&path);
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    let prefix = format!("{}:", path.display());
    stderr
        .lines()
        .map(|line| {
            line.strip_prefix(&prefix)
                .unwrap_or_else(|| panic!("{line:?} does not start with {prefix:?}"))
                .to_string()
        })
        .collect()
}

#[test]
fn check_reports_each_error_with_file_line_column_and_field() {
    let bad_rate = "\
upstreams:
  api: { url: \"http://127.0.0.1:3000\" }
routes:
  - name: users
    upstream: api
    policies:
      - name: per_ip
        key: [client_ip]
        token_bucket: { rate: 10/x, burst: 5 }
";
    let lines = check_errors(bad_rate);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].starts_with(
            "9:31: routes[0].policies[0].token_bucket.rate: `10/x` has an unknown unit"
        ),
        "{lines:?}"
    );

    let unknown_field = "\
routes:
  - name: users
    respond: { body: ok }
    policies:
      - name: per_ip
        key: [client_ip]
        token_bucket: { rate: 10/s, burst: 5 }
        burts: 3
";
    let lines = check_errors(unknown_field);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].starts_with("8:9: routes[0].policies[0]: unknown field `burts`"),
        "{lines:?}"
    );

    let several = "\
routes:
  - name: users
    upstream: nowhere
    policies:
      - name: per_user
        key: [\"path:user_id\"]
        sliding_window: { limit: 0, window: 1m }
";
    let lines = check_errors(several);
    assert_eq!(lines.len(), 3, "{lines:?}");
    assert!(
        lines[0].starts_with("3:15: routes[0].upstream: `nowhere`"),
        "{lines:?}"
    );
    assert!(
        lines[1].starts_with("6:15: routes[0].policies[0].key[0]: `path:user_id`"),
        "{lines:?}"
    );
    assert!(
        lines[2].starts_with("7:34: routes[0].policies[0].sliding_window.limit: must be"),
        "{lines:?}"
    );

    let not_yaml = "routes:\n  - name: users\n    respond: { body: ok\n";
    let lines = check_errors(not_yaml);
    assert_eq!(lines.len(), 1, "{lines:?}");
    // At the `{` left open, not at the end of the file where the parser gave up.
    assert!(
        lines[0].starts_with("3:14: routes[0].respond: this `{` is never closed"),
        "{lines:?}"
    );
}

/// Regression: the binary announced its addresses before installing its signal handlers, so a
/// SIGHUP or SIGTERM sent as soon as the line appeared killed it (status: signal 15, not exit 0).
#[tokio::test]
async fn a_signal_right_after_the_listening_line_is_handled() {
    for _ in 0..5 {
        let mut gw =
            GatewayProcess::spawn("routes:\n  - name: a\n    respond: { body: a }\n").await;
        gw.signal("HUP");
        assert_eq!(Client::new().get(&gw.url("/")).await.text(), "a");
        gw.signal("TERM");
        let status = gw.wait().await;
        assert_eq!(status.code(), Some(0), "{status:?}; log:\n{}", gw.log());
    }
    let mut gw = GatewayProcess::spawn("routes:\n  - name: a\n    respond: { body: a }\n").await;
    gw.signal("TERM");
    let status = gw.wait().await;
    assert_eq!(status.code(), Some(0), "{status:?}; log:\n{}", gw.log());
}

/// Regression: a reload that changed `server.header_read_timeout` (read once, by the connection
/// builder) said nothing about it needing a restart, and `reload_from` skipped the reload counter.
#[tokio::test]
async fn a_reload_names_each_changed_setting_that_needs_a_restart_and_counts_every_result() {
    let routes = "routes:\n  - name: api\n    respond: { body: ok }\n";
    let gw = TestGateway::start(routes).await;
    let changed = format!(
        "server:\n  header_read_timeout: 7s\n  max_body_size: 1KiB\n  max_connections: 77\nstore:\n  type: memory\n  max_keys: 999\n{routes}"
    );
    let pending = gw.reload_with(&changed).await.expect("reload");
    // max_body_size is read per request: it needs no restart.
    assert_eq!(
        pending,
        [
            "store",
            "server.header_read_timeout",
            "server.max_connections"
        ]
    );
    let same = gw.reload_with(&changed).await.expect("reload");
    assert!(same.is_empty(), "{same:?}");
    gw.reload_with("routes: [")
        .await
        .expect_err("bad YAML keeps the running config");
    let name = "turnstile_config_reloads_total";
    assert_eq!(gw.metric(name, &[("result", "ok")]).await, 2.0);
    assert_eq!(gw.metric(name, &[("result", "error")]).await, 1.0);
}

/// Regression (issue 9, item 7): an empty or comment-only file, as a truncated non-atomic write
/// leaves, was `ok (0 routes)`. Item 11: values that passed `check` and broke serving.
#[test]
fn check_rejects_an_empty_file_and_values_that_break_serving() {
    for empty in ["", "# nothing here yet\n"] {
        let lines = check_errors(empty);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0].starts_with("1:1: routes: no routes: every request would get 404"),
            "{lines:?}"
        );
    }
    let lines = check_errors(
        r#"
server: { header_read_timeout: 0ms }
routes:
  - name: a
    respond: { body: a }
    policies:
      - name: w
        key: [client_ip]
        sliding_window: { limit: 5, window: 18446744073709552ms }
      - name: c
        key: [client_ip]
        cost: 0
        token_bucket: { rate: 1e-30/s, burst: 5 }
"#,
    );
    let expected = [
        "2:32: server.header_read_timeout: must be more than 0ms",
        "9:45: routes[0].policies[0].sliding_window.window: `18446744073709552ms` is too long",
        "12:15: routes[0].policies[1].cost: must be at least 1",
        "13:31: routes[0].policies[1].token_bucket.rate: `1e-30/s` is too slow",
    ];
    assert_eq!(lines.len(), expected.len(), "{lines:?}");
    for (line, start) in lines.iter().zip(expected) {
        assert!(
            line.starts_with(start),
            "{line:?} should start with {start:?}"
        );
    }
}

/// A SIGHUP that finds the file emptied keeps serving the old config (and its limits).
#[tokio::test]
async fn sighup_with_an_emptied_file_keeps_the_running_config() {
    let gw = GatewayProcess::spawn("routes:\n  - name: a\n    respond: { body: a }\n").await;
    std::fs::write(&gw.config_path, "").expect("truncate the config");
    gw.signal("HUP");
    let deadline = Instant::now() + LIVENESS;
    while !gw.log().contains("config reload failed") {
        assert!(
            Instant::now() < deadline,
            "no reload failure in:\n{}",
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(gw.log().contains("routes: no routes"), "{}", gw.log());
    assert_eq!(Client::new().get(&gw.url("/")).await.text(), "a");
}

/// Issue 13: "cannot start listeners: Address already in use" did not say which of the listeners
/// (public, admin, rls, forward-auth) or which address.
#[tokio::test]
async fn regression_address_in_use_did_not_name_the_listener() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr");
    let (_dir, path) = config_file(&format!(
        "listen: 127.0.0.1:0\nadmin_listen: {addr}\nroutes:\n  - name: a\n    respond: {{ body: a }}\n"
    ));
    let run = tokio::process::Command::new(crate::support::process::BINARY)
        .args(["run", "--config"])
        .arg(&path)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(LIVENESS, run)
        .await
        .expect("exits at once")
        .expect("runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("`admin_listen` ({addr})")) && stderr.contains("in use"),
        "{stderr}"
    );
}

/// The policies of `yaml` with `rules` in place of `$A` and `$B`.
fn two_policies(a: &str, b: &str) -> String {
    r#"
routes:
  - name: api
    respond: { body: ok }
    policies:
      - { name: per_client, key: [client_ip], $A }
      - { name: per_method, key: [method], $B }
"#
    .replace("$A", a)
    .replace("$B", b)
}

/// A reload that changes how a policy counts (its algorithm, a bucketed window's shape, a
/// quota's period or zone) restarts that policy's counters, which the reload names in a warning;
/// new numbers for the same algorithm carry the counters over and are not named.
#[test]
fn a_reload_names_each_policy_whose_counters_it_restarts() {
    let parse = |yaml: &str| {
        turnstile::config::parse(yaml, std::path::Path::new("/p/policies.yaml")).expect("valid")
    };
    let tb = |burst: u64| format!("token_bucket: {{ rate: 1/s, burst: {burst} }}");
    let sw = |limit: u64, extra: &str| {
        format!("sliding_window: {{ limit: {limit}, window: 1m{extra} }}")
    };
    let q = |per: &str, tz: &str| format!("quota: {{ limit: 9, per: {per}, time_zone: {tz} }}");
    let cases: [(String, String, Option<&str>); 9] = [
        (tb(5), tb(50), None),
        (sw(5, ""), sw(50, ""), None),
        (tb(5), sw(5, ""), Some("the algorithm changed")),
        (sw(5, ""), sw(5, ", buckets: 6"), Some("exact and bucketed")),
        (sw(5, ", buckets: 6"), sw(9, ", buckets: 6"), None),
        (
            sw(5, ", buckets: 6"),
            sw(5, ", buckets: 12"),
            Some("length or buckets"),
        ),
        (q("day", "UTC"), q("day", "UTC"), None),
        (q("day", "UTC"), q("week", "UTC"), Some("period changed")),
        (
            q("day", "UTC"),
            q("day", "Europe/Paris"),
            Some("time zone changed"),
        ),
    ];
    for (a, b, why) in cases {
        let current = parse(&two_policies(&a, &tb(5)));
        let next = parse(&two_policies(&b, &tb(5)));
        let restarted = turnstile::server::restarted_counters(&current, &next);
        // What the in-process store does with the counter: one unit taken under the old rule is
        // still counted under the new one exactly when no restart is named.
        let clock = std::sync::Arc::new(turnstile::limiter::ManualClock::new(1_000_000_000));
        let store = turnstile::limiter::MemoryStore::new(clock, 100);
        let (old, new) = (
            &current.routes[0].policies[0].rule,
            &next.routes[0].policies[0].rule,
        );
        let check = |rule, cost| turnstile::limiter::Check {
            key: "k",
            rule,
            cost,
            shadow: false,
            max_delay_us: None,
        };
        assert!(store.check_leased(&[check(old, 1)], 0).allowed);
        let after = store.check_leased(&[check(new, 0)], 0).outcomes[0];
        assert_eq!(
            after.remaining == new.limit(),
            why.is_some(),
            "{a} -> {b}: {after:?}"
        );
        match why {
            None => assert!(restarted.is_empty(), "{a} -> {b}: {restarted:?}"),
            Some(why) => {
                assert_eq!(restarted.len(), 1, "{a} -> {b}: {restarted:?}");
                assert_eq!(
                    (restarted[0].0, restarted[0].1),
                    ("api", "per_client"),
                    "{a} -> {b}"
                );
                assert!(restarted[0].2.contains(why), "{a} -> {b}: {restarted:?}");
            }
        }
    }
}

/// The running binary logs the warning, naming the route and the policy.
#[tokio::test]
async fn a_reload_that_changes_a_policys_algorithm_logs_which_counters_restart() {
    let a = "token_bucket: { rate: 1/s, burst: 5 }";
    let b = "sliding_window: { limit: 5, window: 1m }";
    let mut gw = GatewayProcess::spawn(&two_policies(a, a)).await;
    let with_ports = |y: &str| crate::support::process::with_free_ports(y);
    std::fs::write(&gw.config_path, with_ports(&two_policies(b, a))).unwrap();
    gw.signal("HUP");
    let deadline = Instant::now() + LIVENESS;
    while !gw.log().contains("restarts this policy's counters") {
        assert!(
            Instant::now() < deadline,
            "no warning logged:\n{}",
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let log = gw.log();
    let line = log
        .lines()
        .find(|l| l.contains("restarts this policy's counters"))
        .unwrap_or_default();
    assert!(line.contains("per_client"), "{line}");
    assert!(line.contains("the algorithm changed"), "{line}");
    assert!(!log.contains("per_method"), "{log}");
    gw.signal("TERM");
    assert!(gw.wait().await.success());
}

/// Shutdown stops and awaits every background task the gateway owns (here the public and admin
/// listeners and the in-process store's sweeper): none is left running once it returns.
#[tokio::test]
async fn shutdown_leaves_no_background_task_running() {
    let gw = TestGateway::start(
        &version("v1", 1)
            .replace("upstreams:\n  up: { url: \"http://$UPSTREAM\" }\n", "")
            .replace(
                "  - name: held\n    match: { prefix: /held }\n    upstream: up\n",
                "",
            ),
    )
    .await;
    let c = Client::new();
    assert_eq!(c.get(&gw.url("/")).await.text(), "v1");
    let tasks = gw.running().background_tasks();
    assert_eq!(tasks.alive(), 3, "public listener, admin listener, sweeper");
    tokio::time::timeout(LIVENESS, gw.shutdown())
        .await
        .expect("shutdown completes");
    assert_eq!(tasks.alive(), 0, "a background task outlived shutdown");
}
