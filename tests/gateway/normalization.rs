//! Issue 9's rate-limit bypasses, on the real binary in front of a real NGINX: however a client
//! spells the path, the host or a key value, exactly the limit's allowance reaches the upstream
//! (counted in NGINX's access log), and what NGINX receives is the canonical spelling.

use std::time::{Duration, Instant};

use crate::support::client::{raw_connect, read_head};
use crate::support::nginx::{AccessLine, Nginx};
use crate::support::process::{check, config_file};
use crate::support::GatewayProcess;

/// Answers every request itself, so the access log counts what got through.
const NGINX_OK: &str = r#"location / { return 200 "nginx $uri\n"; }"#;

/// A limited route per item, and an unlimited catch-all behind it: what a request that skips a
/// route falls through to.
fn config(nginx: &Nginx, server: &str) -> String {
    format!(
        r#"
server: {{ {server} }}
client_ip: {{ trusted_proxies: [127.0.0.1] }}
upstreams:
  nginx: {{ url: "{url}" }}
routes:
  - name: internal
    match: {{ prefix: /metrics }}
    respond: {{ status: 403, body: internal }}
  - name: users
    match: {{ path: "/api/users/{{user_id}}", host: api.example }}
    upstream: nginx
    policies:
      - {{ name: per_user, key: [path:user_id], token_bucket: {{ rate: 1/h, burst: 3 }} }}
  - name: search
    match: {{ path: /search, host: api.example }}
    upstream: nginx
    policies:
      - {{ name: per_query, key: ["query:user id"], token_bucket: {{ rate: 1/h, burst: 3 }} }}
  - name: keyed
    match: {{ prefix: /keyed/ }}
    upstream: nginx
    policies:
      - {{ name: per_key, key: [header:x-key], token_bucket: {{ rate: 1/h, burst: 3 }} }}
      - {{ name: per_q, key: [query:k], token_bucket: {{ rate: 1/h, burst: 3 }} }}
  - name: per_client
    match: {{ prefix: /client/ }}
    upstream: nginx
    policies:
      - {{ name: per_ip, key: [client_ip], token_bucket: {{ rate: 1/h, burst: 3 }} }}
  - name: rest
    match: {{ prefix: / }}
    upstream: nginx
"#,
        url = nginx.base_url()
    )
}

/// Sends `head` (a request head without the final empty line) on a fresh connection; returns the
/// status.
async fn send_raw(gw: &GatewayProcess, head: &str) -> u16 {
    let request = format!("{head}\r\nConnection: close\r\n\r\n");
    let mut stream = raw_connect(gw.public, request.as_bytes()).await;
    let (head, _) = read_head(&mut stream).await;
    head.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not a response: {head:?}"))
}

/// `GET TARGET` with `Host: HOST` and extra header lines.
async fn get(gw: &GatewayProcess, target: &str, host: &str, extra: &[&str]) -> u16 {
    let mut head = format!("GET {target} HTTP/1.1\r\nHost: {host}");
    for line in extra {
        head.push_str("\r\n");
        head.push_str(line);
    }
    send_raw(gw, &head).await
}

/// NGINX's access log once it holds `want` lines (or the liveness deadline passes), after a
/// pause that lets a late extra line show.
async fn access_log(nginx: &Nginx, want: usize) -> Vec<AccessLine> {
    let deadline = Instant::now() + crate::support::LIVENESS;
    while nginx.access_log().len() < want && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    nginx.access_log()
}

async fn start(server: &str) -> (Nginx, GatewayProcess) {
    let nginx = Nginx::start(NGINX_OK);
    let gw = GatewayProcess::spawn(&config(&nginx, server)).await;
    (nginx, gw)
}

#[tokio::test]
async fn regression_path_spellings_bypassed_the_user_limit() {
    let (nginx, gw) = start("").await;
    let spellings = [
        "/api/users/1",
        "//api/users/1",
        "/api/users/1/",
        "/api//users/1",
        "/api/./users/1",
        "/api/x/../users/1",
        "/%61pi/users/1",
        "/api/users/%31",
        "/api/users/1?x=%61",
        "/api/%2E%2e/api/users/1/",
    ];
    let mut statuses = Vec::new();
    for target in spellings {
        statuses.push(get(&gw, target, "api.example", &[]).await);
    }
    let log = access_log(&nginx, 3).await;
    assert_eq!(
        statuses,
        [200, 200, 200, 429, 429, 429, 429, 429, 429, 429],
        "{spellings:?}"
    );
    assert_eq!(log.len(), 3, "exactly the burst reaches NGINX: {log:?}");
    // What NGINX receives is the normalised path; the trailing slash is the client's own.
    let received: Vec<&str> = log.iter().map(|l| l.request_uri.as_str()).collect();
    assert_eq!(received, ["/api/users/1", "/api/users/1", "/api/users/1/"]);
}

#[tokio::test]
async fn regression_a_prefix_was_escaped_with_dot_segments() {
    let (nginx, gw) = start("").await;
    for target in [
        "/api/../metrics",
        "/api/%2e%2E/metrics",
        "//api/./../metrics/x",
    ] {
        assert_eq!(get(&gw, target, "api.example", &[]).await, 403, "{target}");
    }
    for target in [
        "/api/..%2Fmetrics",
        "/api/..%5cmetrics",
        "/../metrics",
        "/a%zz",
    ] {
        assert_eq!(get(&gw, target, "api.example", &[]).await, 400, "{target}");
    }
    assert_eq!(get(&gw, "/other", "api.example", &[]).await, 200);
    let log = access_log(&nginx, 1).await;
    assert_eq!(log.len(), 1, "only /other reaches NGINX: {log:?}");
}

#[tokio::test]
async fn escaped_slashes_are_kept_encoded_when_configured() {
    let (nginx, gw) = start("escaped_slashes: keep").await;
    for target in [
        "/api/users/a%2fb",
        "/api/users/a%2Fb/",
        "/api/./users/a%2Fb",
    ] {
        assert_eq!(get(&gw, target, "api.example", &[]).await, 200, "{target}");
    }
    assert_eq!(get(&gw, "/api/users/a%2Fb", "api.example", &[]).await, 429);
    let log = access_log(&nginx, 3).await;
    let received: Vec<&str> = log.iter().map(|l| l.request_uri.as_str()).collect();
    assert_eq!(
        received,
        ["/api/users/a%2Fb", "/api/users/a%2Fb/", "/api/users/a%2Fb"]
    );
}

#[tokio::test]
async fn raw_paths_are_forwarded_when_normalisation_is_off() {
    let (nginx, gw) = start("normalize_path: false, merge_slashes: false").await;
    // Not the `users` route any more: the operator chose raw paths.
    assert_eq!(get(&gw, "//x/./%61", "api.example", &[]).await, 200);
    let log = access_log(&nginx, 1).await;
    assert_eq!(log.len(), 1);
    assert_eq!(log[0].request_uri, "//x/./%61");
}

/// `;` path parameters, raw or encoded, in every place Tomcat, Jetty or Spring would cut them off.
const PATH_PARAMETER_SPELLINGS: &[&str] = &[
    "/api/users/carol;",
    "/api/users/carol;x=1",
    "/api/users/carol;jsessionid=0123ABCD",
    "/api/users/carol;/",
    "/api;x/users/carol",
    "/api/users;/carol",
    "/x/..;/metrics",
    "/x/y/..;/..;/metrics",
    "/x/.;/metrics",
    "/x/..;jsessionid=1/metrics",
    "/;/metrics",
    "/api/users/carol%3B",
    "/api/users/carol%3bx=1",
    "/x/..%3B/metrics",
];

/// `/u/rt1;` was a fresh counter for user `rt1` on servers that strip path parameters, and
/// `/a/..;/..;/admin` reached them as `/admin` past the route that guards it.
#[tokio::test]
async fn regression_path_parameters_passed_normalisation() {
    let (nginx, gw) = start("").await;
    for target in PATH_PARAMETER_SPELLINGS {
        assert_eq!(get(&gw, target, "api.example", &[]).await, 400, "{target}");
    }
    assert_eq!(get(&gw, "/other", "api.example", &[]).await, 200);
    let log = access_log(&nginx, 1).await;
    let received: Vec<&str> = log.iter().map(|l| l.request_uri.as_str()).collect();
    assert_eq!(received, ["/other"], "no `;` reaches NGINX");
}

#[tokio::test]
async fn path_parameters_are_stripped_when_configured() {
    let (nginx, gw) = start("path_parameters: strip").await;
    // One user, one counter, whatever parameters ride on its segments.
    let mut statuses = Vec::new();
    for target in [
        "/api/users/carol;x=1",
        "/api;v=2/users/carol",
        "/api/users/carol;jsessionid=1/",
        "/api/users/carol",
    ] {
        statuses.push(get(&gw, target, "api.example", &[]).await);
    }
    assert_eq!(statuses, [200, 200, 200, 429]);
    // A `..;` segment is a `..`: it cannot walk around the route that guards `/metrics`.
    for target in ["/x/..;/metrics", "/x/y/..;/..;/metrics", "/x/.;/../metrics"] {
        assert_eq!(get(&gw, target, "api.example", &[]).await, 403, "{target}");
    }
    // Encoded, it is refused even so: the upstream might decode it before it splits.
    assert_eq!(get(&gw, "/x/..%3B/metrics", "api.example", &[]).await, 400);
    let log = access_log(&nginx, 3).await;
    let received: Vec<&str> = log.iter().map(|l| l.request_uri.as_str()).collect();
    assert_eq!(
        received,
        ["/api/users/carol", "/api/users/carol", "/api/users/carol/"]
    );
}

#[tokio::test]
async fn path_parameters_are_forwarded_when_kept() {
    let (nginx, gw) = start("path_parameters: keep").await;
    assert_eq!(get(&gw, "/a;v=1/b%3b", "api.example", &[]).await, 200);
    let log = access_log(&nginx, 1).await;
    assert_eq!(log.len(), 1);
    assert_eq!(log[0].request_uri, "/a;v=1/b%3B");
}

#[tokio::test]
async fn regression_query_key_spellings_were_separate_buckets() {
    let (nginx, gw) = start("").await;
    let spellings = [
        "/search?user+id=a+b",
        "/search?user%20id=a%20b",
        "/search?user+id=%61+b",
        "/search?x=1&user%20id=a%20%62",
        "/search/?user+id=a+b",
        "/search?%75ser+id=a+b",
    ];
    let mut statuses = Vec::new();
    for target in spellings {
        statuses.push(get(&gw, target, "api.example", &[]).await);
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429, 429], "{spellings:?}");
    let log = access_log(&nginx, 3).await;
    assert_eq!(log.len(), 3, "{log:?}");
    // The query is forwarded as sent.
    assert_eq!(log[0].args, "user+id=a+b");
}

#[tokio::test]
async fn regression_host_spellings_skipped_the_host_scoped_route() {
    let (nginx, gw) = start("").await;
    let requests = [
        // RFC 9112 §3.2.2: the absolute-form target's authority wins over Host.
        ("http://API.EXAMPLE.:80/api/users/7", "other.example"),
        ("/api/users/7", "API.Example"),
        ("/api/users/7", "api.example."),
        ("/api/users/7", "api.example:80"),
        ("/api/users/7", "Api.Example.:80"),
        ("/api/users/7", "api.example"),
        ("http://api.example/api/users/7", "other.example"),
        ("http://api.example./api/users/7", "api.example"),
    ];
    let mut statuses = Vec::new();
    for (target, host) in requests {
        statuses.push(get(&gw, target, host, &[]).await);
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429, 429, 429, 429]);
    let log = access_log(&nginx, 3).await;
    assert_eq!(log.len(), 3, "{log:?}");
    for line in &log {
        assert_eq!(
            line.http_host, "api.example",
            "the forwarded Host is canonical"
        );
    }
}

#[tokio::test]
async fn regression_conflicting_or_repeated_hosts_are_refused() {
    let (nginx, gw) = start("").await;
    let twice = "GET /api/users/9 HTTP/1.1\r\nHost: other.example\r\nHost: api.example";
    assert_eq!(send_raw(&gw, twice).await, 400);
    assert_eq!(
        send_raw(&gw, "GET /api/users/9 HTTP/1.1").await,
        400,
        "no Host"
    );
    for host in ["api example", "api.example:http", "user@api.example"] {
        assert_eq!(get(&gw, "/api/users/9", host, &[]).await, 400, "{host}");
    }
    // HTTP/2: `:authority` and a different `host` field.
    let client = crate::support::Client::http2();
    let req = crate::support::client::request(
        http::Method::GET,
        &format!("http://{}/api/users/9", gw.public),
    )
    .header("host", "api.example")
    .body(crate::support::client::empty())
    .expect("request");
    assert_eq!(client.send(req).await.status, 400);
    let log = access_log(&nginx, 0).await;
    assert!(log.is_empty(), "{log:?}");
}

#[tokio::test]
async fn regression_a_key_header_sent_twice_was_counted_under_its_first_value() {
    let (nginx, gw) = start("").await;
    // Exhaust k1.
    for _ in 0..3 {
        assert_eq!(get(&gw, "/keyed/a", "x", &["X-Key: k1"]).await, 200);
    }
    assert_eq!(get(&gw, "/keyed/a", "x", &["X-Key: k1"]).await, 429);
    // A fresh first value used to open a new bucket, and the upstream saw both.
    for extra in [
        &["X-Key: zz", "X-Key: k1"][..],
        &["X-Key: k1", "x-key: zz"],
        &["X-Key: k1", "X-Key: k1"],
    ] {
        assert_eq!(get(&gw, "/keyed/a", "x", extra).await, 400, "{extra:?}");
    }
    for target in ["/keyed/a?k=1&k=2", "/keyed/a?k=1&%6B=2"] {
        assert_eq!(
            get(&gw, target, "x", &["X-Key: other"]).await,
            400,
            "{target}"
        );
    }
    let log = access_log(&nginx, 3).await;
    assert_eq!(log.len(), 3, "{log:?}");
}

#[tokio::test]
async fn regression_ipv6_clients_were_keyed_per_address() {
    let (nginx, gw) = start("").await;
    let clients = [
        "2001:db8:1:2::1",
        "2001:db8:1:2:ffff:ffff:ffff:ffff",
        "2001:db8:1:2:dead:beef:0:7",
        "2001:db8:1:2::99",
        "[2001:db8:1:2::5]:4711",
    ];
    let mut statuses = Vec::new();
    for ip in clients {
        let xff = format!("X-Forwarded-For: {ip}");
        statuses.push(get(&gw, "/client/a", "x", &[&xff]).await);
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    // Another /64 has its own bucket; `::ffff:a.b.c.d` is the IPv4 client.
    let other = "X-Forwarded-For: 2001:db8:1:3::1";
    assert_eq!(get(&gw, "/client/a", "x", &[other]).await, 200);
    for xff in [
        "192.0.2.7",
        "::ffff:192.0.2.7",
        "192.0.2.7",
        "::ffff:c000:207",
    ] {
        let line = format!("X-Forwarded-For: {xff}");
        get(&gw, "/client/a", "x", &[&line]).await;
    }
    let log = access_log(&nginx, 7).await;
    assert_eq!(log.len(), 7, "3 + 1 + 3: {log:?}");
}

#[tokio::test]
async fn client_ip_prefixes_out_of_range_are_config_errors() {
    let yaml =
        "client_ip:\n  ipv4_prefix: 33\n  ipv6_prefix: 0\nserver:\n  escaped_slashes: decode\n\
                routes:\n  - name: r\n    respond: { body: x }\n";
    let (_dir, path) = config_file(yaml);
    let (code, _, stderr) = check(&path);
    assert_ne!(code, Some(0), "{stderr}");
    let file = path.display().to_string();
    for want in [
        format!("{file}:2:16: client_ip.ipv4_prefix: 33 is not a prefix length; expected 1-32"),
        format!("{file}:3:16: client_ip.ipv6_prefix: 0 is not a prefix length; expected 1-128"),
        format!("{file}:5:20: server.escaped_slashes: `decode` is not an action"),
    ] {
        assert!(stderr.contains(&want), "want {want:?} in:\n{stderr}");
    }
}

#[tokio::test]
async fn regression_the_shipped_policies_let_a_trailing_slash_through() {
    let nginx = Nginx::start(NGINX_OK);
    // The shipped routes, in front of NGINX, with a refill slow enough to count exactly.
    let shipped = std::fs::read_to_string(crate::support::tools::repo_path("policies.yaml"))
        .expect("read policies.yaml");
    let yaml: String = shipped
        .lines()
        .filter(|l| !l.starts_with("listen:") && !l.starts_with("admin_listen:"))
        .map(|l| l.replace("http://127.0.0.1:3000", &nginx.base_url()))
        .map(|l| l.replace("rate: 10/s, burst: 20", "rate: 1/h, burst: 20"))
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        yaml.contains("rate: 1/h, burst: 20"),
        "policies.yaml changed"
    );
    let gw = GatewayProcess::spawn(&yaml).await;
    let mut admitted = 0;
    for i in 0..40 {
        let target = if i % 2 == 0 {
            "/api/users/1/"
        } else {
            "/api/users//1"
        };
        if get(&gw, target, "localhost", &[]).await == 200 {
            admitted += 1;
        }
    }
    let log = access_log(&nginx, 20).await;
    assert_eq!(admitted, 20);
    assert_eq!(log.len(), 20, "the burst of per_user, not 40: {log:?}");
}

#[tokio::test]
async fn a_path_parameters_setting_that_is_not_an_action_is_a_config_error() {
    let yaml =
        "server:\n  path_parameters: allow\nroutes:\n  - name: r\n    respond: { body: x }\n";
    let (_dir, path) = config_file(yaml);
    let (code, _, stderr) = check(&path);
    assert_ne!(code, Some(0), "{stderr}");
    let want = format!(
        "{}:2:20: server.path_parameters: `allow` is not an action; expected `reject`, `strip` or `keep`",
        path.display()
    );
    assert!(stderr.contains(&want), "want {want:?} in:\n{stderr}");
}

/// The blocks of docs/normalization.md and docs/hardening.md that set `path_parameters` are valid
/// sections of a config.
#[tokio::test]
async fn the_documented_options_pass_check() {
    for page in ["docs/normalization.md", "docs/hardening.md"] {
        let text = std::fs::read_to_string(crate::support::tools::repo_path(page)).expect(page);
        let block = text
            .split("```yaml\n")
            .skip(1)
            .filter_map(|rest| rest.split_once("```").map(|(block, _)| block))
            .find(|block| block.contains("path_parameters:"))
            .unwrap_or_else(|| panic!("{page}: no block sets path_parameters"));
        let yaml = format!("{block}routes:\n  - name: r\n    respond: {{ body: x }}\n");
        let (_dir, path) = config_file(&yaml);
        let (code, _, stderr) = check(&path);
        assert_eq!(code, Some(0), "{page}:\n{yaml}\n{stderr}");
    }
    // The README's reference config sets it on one line of its `server:` section.
    let readme =
        std::fs::read_to_string(crate::support::tools::repo_path("README.md")).expect("README.md");
    let line = readme
        .lines()
        .find(|l| l.trim_start().starts_with("path_parameters:"))
        .expect("README.md sets path_parameters");
    let yaml = format!("server:\n{line}\nroutes:\n  - name: r\n    respond: {{ body: x }}\n");
    let (_dir, path) = config_file(&yaml);
    let (code, _, stderr) = check(&path);
    assert_eq!(code, Some(0), "README.md:\n{yaml}\n{stderr}");
}
