//! The access log and request ids, end to end: one line per request on every door (the gateway,
//! `/check`, ext_authz, the Envoy service), admitted and refused; the id the client, the upstream
//! and the line share; sampling; the text format; SIGUSR1 reopening after a rename; and lines
//! dropped, counted, never waited for, when the writer's queue is full.

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use support::{Client, GatewayProcess, TestGateway, Upstream, LIVENESS};

/// The lines of the log at `path`, each parsed as JSON.
fn json_lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")))
        .collect()
}

/// Waits until the log at `path` has `n` lines (it is written off the request path).
async fn wait_lines(path: &Path, n: usize) -> Vec<String> {
    let deadline = std::time::Instant::now() + LIVENESS;
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let lines: Vec<String> = text.lines().map(str::to_string).collect();
        if lines.len() >= n {
            return lines;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{} has {} lines, not {n}:\n{text}",
            path.display(),
            lines.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn log_dir() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("access.log");
    (dir, path)
}

fn gateway_config(log: &Path, extra: &str) -> String {
    format!(
        r#"
access_log:
  output: {log}
{extra}
upstreams:
  up: {{ url: "http://$UPSTREAM" }}
routes:
  - name: api
    match: {{ prefix: /api }}
    upstream: up
    policies:
      - name: per_key
        key: ["header:x-key"]
        token_bucket: {{ rate: 1/h, burst: 1 }}
"#,
        log = log.display()
    )
}

/// The SHA-256 digest a line shows of a counter key: `sha256:` and 12 hex digits.
fn digest(key: &str) -> String {
    use sha2::Digest;
    let hex: String = sha2::Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("sha256:{}", &hex[..12])
}

#[tokio::test]
async fn the_gateway_writes_one_line_per_request_with_the_id_the_client_and_upstream_see() {
    let upstream = Upstream::start().await;
    let (_dir, log) = log_dir();
    let gw = TestGateway::with_upstream(&gateway_config(&log, ""), upstream.addr).await;
    let client = Client::new();
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let admitted = client
        .get_with(
            &gw.url("/api/a/../b?q=1"),
            &[
                ("x-key", "k1"),
                ("traceparent", traceparent),
                ("tracestate", "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"),
            ],
        )
        .await;
    assert_eq!(admitted.status, 200);
    // W3C trace context goes upstream as it came.
    let seen = &admitted.json()["headers"];
    assert_eq!(seen["traceparent"], serde_json::json!([traceparent]));
    assert_eq!(
        seen["tracestate"],
        serde_json::json!(["congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"])
    );
    let id = admitted.header("x-request-id").expect("an id").to_string();
    assert_eq!(id.len(), 36, "a UUID: {id}");
    // The upstream got the same id (its echo lists the headers it received).
    assert_eq!(
        admitted.json()["headers"]["x-request-id"],
        serde_json::json!([id])
    );
    // The peer (127.0.0.1) is no trusted proxy: the id it sends is replaced.
    let refused = client
        .get_with(
            &gw.url("/api/b"),
            &[("x-key", "k1"), ("x-request-id", "mine")],
        )
        .await;
    assert_eq!(refused.status, 429);
    let refused_id = refused.header("x-request-id").expect("an id").to_string();
    assert_ne!(refused_id, "mine");
    assert_eq!(refused.json()["request_id"], refused_id.as_str());
    let missing = client.get(&gw.url("/nowhere")).await;
    assert_eq!(missing.status, 404);
    assert!(missing.header("x-request-id").is_some());
    let public = gw.public.to_string();
    gw.shutdown().await;

    let lines = json_lines(&log);
    assert_eq!(lines.len(), 3, "{lines:?}");
    let first = &lines[0];
    assert_eq!(first["door"], "gateway");
    assert_eq!(first["request_id"], id.as_str());
    assert_eq!(first["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(first["client_ip"], "127.0.0.1");
    assert_eq!(first["method"], "GET");
    assert_eq!(first["path"], "/api/b", "canonical");
    assert_eq!(first["host"], public.as_str());
    assert_eq!(first["route"], "api");
    assert_eq!(first["status"], 200);
    assert_eq!(first["decision"], "allowed");
    assert_eq!(first["policy"], "per_key");
    assert_eq!(first["key"], digest("api:per_key:k1"));
    assert_eq!(first["upstream"], "up");
    assert!(first["upstream_ms"].as_f64().is_some(), "{first}");
    assert!(first["duration_ms"].as_f64().unwrap() >= first["upstream_ms"].as_f64().unwrap());
    // Counted as the body went out, not read off its head.
    assert_eq!(first["bytes_out"], admitted.body.len() as u64, "{first}");
    assert!(first["time"].as_str().unwrap().ends_with('Z'), "{first}");
    let second = &lines[1];
    assert_eq!(second["request_id"], refused_id.as_str());
    assert_eq!(second["status"], 429);
    assert_eq!(second["decision"], "limited");
    assert_eq!(second["policy"], "per_key");
    assert_eq!(second["upstream"], Value::Null);
    assert_eq!(second["trace_id"], Value::Null);
    let third = &lines[2];
    assert_eq!(third["status"], 404);
    assert_eq!(third["decision"], "none");
    assert_eq!(third["route"], Value::Null);
    assert_eq!(upstream.requests(), 1);
}

#[tokio::test]
async fn a_trusted_proxy_keeps_its_request_id_and_shadow_and_exempt_are_named() {
    let upstream = Upstream::start().await;
    let (_dir, log) = log_dir();
    let yaml = format!(
        r#"
access_log: {{ output: {log}, show_key_values: true }}
client_ip: {{ trusted_proxies: [127.0.0.1] }}
exempt: {{ headers: {{ x-internal: "yes" }} }}
upstreams:
  up: {{ url: "http://$UPSTREAM" }}
routes:
  - name: api
    upstream: up
    policies:
      - name: trial
        mode: shadow
        key: ["header:x-key"]
        token_bucket: {{ rate: 1/h, burst: 1 }}
"#,
        log = log.display()
    );
    let gw = TestGateway::with_upstream(&yaml, upstream.addr).await;
    let client = Client::new();
    for (id, extra) in [("req-1", None), ("req-2", None), ("req-3", Some("yes"))] {
        let mut headers = vec![("x-key", "k"), ("x-request-id", id)];
        headers.extend(extra.map(|v| ("x-internal", v)));
        let reply = client.get_with(&gw.url("/x"), &headers).await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("x-request-id"), Some(id));
        assert_eq!(
            reply.json()["headers"]["x-request-id"],
            serde_json::json!([id])
        );
    }
    gw.shutdown().await;
    let lines = json_lines(&log);
    let got: Vec<(&str, &str, &str)> = lines
        .iter()
        .map(|l| {
            (
                l["request_id"].as_str().unwrap(),
                l["decision"].as_str().unwrap(),
                l["key"].as_str().unwrap_or("-"),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            ("req-1", "allowed", "-"),
            ("req-2", "shadow", "api:trial:k"),
            ("req-3", "exempt", "-"),
        ]
    );
}

/// A request admitted for a later slot (`on_limit: delay`) is `delayed`, with its wait in
/// `delay_ms` (within the duration); one admitted at once is `allowed` with no delay.
#[tokio::test]
async fn a_delayed_request_is_logged_as_delayed_with_its_wait() {
    let upstream = Upstream::start().await;
    let (_dir, log) = log_dir();
    let yaml = format!(
        r#"
access_log: {{ output: {log} }}
upstreams:
  up: {{ url: "http://$UPSTREAM" }}
routes:
  - name: api
    upstream: up
    policies:
      - name: paced
        key: ["header:x-key"]
        token_bucket: {{ rate: 2/s, burst: 1 }}
        on_limit: delay
        max_delay: 2s
"#,
        log = log.display()
    );
    let gw = TestGateway::with_upstream(&yaml, upstream.addr).await;
    let client = Client::new();
    let started = std::time::Instant::now();
    for _ in 0..2 {
        let reply = client.get_with(&gw.url("/x"), &[("x-key", "k")]).await;
        assert_eq!(reply.status, 200);
    }
    // The second waited for its slot, 500 ms after the first's decision.
    let elapsed = started.elapsed();
    gw.shutdown().await;
    let lines = json_lines(&log);
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0]["decision"], "allowed");
    assert_eq!(lines[0]["delay_ms"], Value::Null);
    let delayed = &lines[1];
    assert_eq!(delayed["decision"], "delayed", "{delayed}");
    assert_eq!(delayed["status"], 200);
    assert_eq!(delayed["policy"], "paced");
    let delay = delayed["delay_ms"].as_f64().expect("delay_ms");
    // Its slot is 500 ms after the first decision, less the time the first request took.
    assert!(
        delay > 0.0 && delay <= 500.0 && elapsed.as_secs_f64() * 1000.0 >= delay,
        "{delayed}"
    );
    assert!(
        delayed["duration_ms"].as_f64().unwrap() >= delay,
        "{delayed}"
    );
    assert_eq!(upstream.requests(), 2);
}

#[tokio::test]
async fn sampling_keeps_every_refusal_and_none_of_the_admitted_in_the_text_format() {
    let upstream = Upstream::start().await;
    let (_dir, log) = log_dir();
    let extra = "  format: text\n  fields: [status, decision, path, policy, request_id]\n  sample: { admitted: 0, refused: 1 }";
    let gw = TestGateway::with_upstream(&gateway_config(&log, extra), upstream.addr).await;
    let client = Client::new();
    let mut statuses = Vec::new();
    for _ in 0..4 {
        let reply = client.get_with(&gw.url("/api/x"), &[("x-key", "s")]).await;
        statuses.push((
            reply.status,
            reply.header("x-request-id").unwrap().to_string(),
        ));
    }
    gw.shutdown().await;
    assert_eq!(
        statuses.iter().map(|s| s.0).collect::<Vec<_>>(),
        [200, 429, 429, 429]
    );
    let text = std::fs::read_to_string(&log).unwrap();
    let want: String = statuses[1..]
        .iter()
        .map(|(_, id)| format!("429 limited /api/x per_key {id}\n"))
        .collect();
    assert_eq!(text, want);
}

#[tokio::test]
async fn the_ingress_doors_and_the_envoy_service_write_lines_too() {
    let (_dir, log) = log_dir();
    let yaml = format!(
        r#"
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
access_log:
  output: {log}
  fields: [door, status, decision, route, policy, request_id, path, client_ip]
forward_auth: {{ listen: 127.0.0.1:0, grpc_listen: 127.0.0.1:0 }}
rls: {{ listen: 127.0.0.1:0, config: ./rls }}
routes:
  - name: api
    match: {{ prefix: /api }}
    policies:
      - name: per_key
        key: ["header:x-key"]
        token_bucket: {{ rate: 1/h, burst: 1 }}
"#,
        log = log.display()
    );
    let rls_config = "domain: shop\ndescriptors:\n  - key: user\n    rate_limit: { unit: hour, requests_per_unit: 1 }\n";
    let gw = TestGateway::with_files(&yaml, &[("rls/shop.yaml", rls_config)]).await;
    let check = gw.running().forward_auth_addr.expect("check listener");
    let grpc = gw.running().ext_authz_addr.expect("ext_authz listener");
    let url = format!("http://{check}/check");
    let call = [
        ("x-forwarded-uri", "/api/a"),
        ("x-forwarded-method", "GET"),
        ("x-forwarded-host", "api.example"),
        ("x-key", "c"),
    ];
    let client = Client::new();
    let allowed = client.get_with(&url, &call).await;
    assert_eq!(allowed.status, 200);
    let check_id = allowed.header("x-request-id").expect("an id").to_string();
    let refused = client.get_with(&url, &call).await;
    assert_eq!(refused.status, 429);
    assert_eq!(
        refused.json()["request_id"],
        refused.header("x-request-id").unwrap()
    );
    // ext_authz: Envoy's own id is kept; another key, so a fresh counter.
    let envoy_id = [("x-key", "e"), ("x-request-id", "envoy-1")];
    let ok = support::ext_authz::check(grpc, "/api/e", &envoy_id).await;
    assert_eq!(ok.status.as_ref().map(|s| s.code), Some(0));
    let denied = support::ext_authz::check(grpc, "/api/e", &envoy_id).await;
    assert_eq!(denied.status.as_ref().map(|s| s.code), Some(8));
    let rls = gw.rls.expect("rls listener");
    let mut rls_client =
        envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient::connect(format!("http://{rls}"))
            .await
            .expect("connect");
    for _ in 0..2 {
        let descriptors = vec![support::rls::descriptor(&[("user", "u")])];
        support::rls::call(&mut rls_client, support::rls::request("shop", descriptors)).await;
    }
    gw.shutdown().await;

    let lines = json_lines(&log);
    let got: Vec<String> = lines
        .iter()
        .map(|l| {
            let field = |name: &str| match &l[name] {
                Value::String(s) => s.clone(),
                Value::Null => "-".to_string(),
                other => other.to_string(),
            };
            format!(
                "{} {} {} {} {} {}",
                field("door"),
                field("status"),
                field("decision"),
                field("route"),
                field("path"),
                field("client_ip")
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            "check 200 allowed api /api/a 127.0.0.1",
            "check 429 limited api /api/a 127.0.0.1",
            "ext_authz 200 allowed api /api/e 192.0.2.7",
            "ext_authz 429 limited api /api/e 192.0.2.7",
            "rls 200 allowed shop - -",
            "rls 429 limited shop - -",
        ]
    );
    assert_eq!(lines[0]["request_id"], check_id.as_str());
    assert_eq!(lines[2]["request_id"], "envoy-1");
    assert_eq!(lines[3]["request_id"], "envoy-1");
    assert_eq!(lines[1]["policy"], "per_key");
}

#[tokio::test]
async fn sigusr1_reopens_the_log_after_logrotate_renamed_it() {
    let (dir, log) = log_dir();
    let yaml = format!(
        r#"
access_log: {{ output: {log}, fields: [path, status] }}
routes:
  - name: hello
    respond: {{ status: 200, body: "hi" }}
"#,
        log = log.display()
    );
    let gw = GatewayProcess::spawn(&yaml).await;
    let client = Client::new();
    assert_eq!(client.get(&gw.url("/before")).await.status, 200);
    wait_lines(&log, 1).await;
    let rotated = dir.path().join("access.log.1");
    std::fs::rename(&log, &rotated).unwrap();
    // Until the signal, lines go on into the renamed file (the open one).
    assert_eq!(client.get(&gw.url("/renamed")).await.status, 200);
    wait_lines(&rotated, 2).await;
    gw.signal("USR1");
    let deadline = std::time::Instant::now() + LIVENESS;
    while !log.exists() {
        assert!(std::time::Instant::now() < deadline, "not reopened");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(client.get(&gw.url("/after")).await.status, 200);
    assert_eq!(
        wait_lines(&log, 1).await,
        [r#"{"path":"/after","status":200}"#]
    );
    assert_eq!(
        wait_lines(&rotated, 2).await,
        [
            r#"{"path":"/before","status":200}"#,
            r#"{"path":"/renamed","status":200}"#
        ]
    );
}

/// A writer that cannot write (a pipe nobody reads yet) fills the queue; requests go on being
/// answered at once, and every line that found no room is counted: read + dropped = sent.
#[tokio::test]
async fn a_full_queue_drops_and_counts_lines_and_never_holds_up_a_request() {
    let (_dir, log) = log_dir();
    let made = std::process::Command::new("mkfifo")
        .arg(&log)
        .status()
        .expect("mkfifo");
    assert!(made.success());
    // Opened for reading first (opening a pipe waits for its other end), read only later.
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let reader_path = log.clone();
    let reader = std::thread::spawn(move || {
        use std::io::Read;
        let mut pipe = std::fs::File::open(reader_path).expect("open the pipe");
        go_rx.recv().expect("go");
        let mut text = String::new();
        pipe.read_to_string(&mut text).expect("read the pipe");
        text
    });
    let yaml = r#"
access_log: { output: PIPE, buffer: 4 }
routes:
  - name: hello
    respond: { status: 200, body: "hi" }
"#
    .replace("PIPE", &log.display().to_string());
    let gw = TestGateway::start(&yaml).await;
    let client = Client::new();
    const SENT: usize = 2000;
    let started = std::time::Instant::now();
    for _ in 0..SENT {
        assert_eq!(client.get(&gw.url("/x")).await.status, 200);
    }
    let dropped = gw.metric("turnstile_access_log_dropped_total", &[]).await as usize;
    assert!(
        dropped > 0,
        "a pipe buffer of 64 KiB holds far fewer than {SENT} lines"
    );
    assert!(started.elapsed() < LIVENESS, "requests waited for the log");
    go_tx.send(()).unwrap();
    // Shutdown writes what was queued and closes the pipe: the reader sees its end.
    gw.shutdown().await;
    let text = reader.join().expect("reader");
    let read = text.lines().count();
    assert_eq!(read + dropped, SENT, "read {read}, dropped {dropped}");
}
