//! The status page (issue 42): the page and its JSON endpoints on the admin listener, the
//! "why was I limited?" lookup (a peek: nothing consumed), and the guard that refuses what a
//! browser sends from another site (CSRF, DNS rebinding). `status_browser.rs` drives the page
//! itself in headless Chromium.

use http::Method;

use crate::support::client::{full, request};
use crate::support::stores::TestStore;
use crate::support::{Client, Reply, TestGateway};

pub const CONFIG: &str = r#"
routes:
  - name: hello
    match: { path: /hello }
    respond: { body: hi }
    policies:
      - { name: per_ip, key: [client_ip], sliding_window: { limit: 5, window: 1h } }
  - name: users
    match: { path: "/api/users/{user_id}", methods: [GET] }
    respond: { body: user }
    quota_endpoint: "/quota/users/{user_id}"
    policies:
      - { name: per_user, key: ["path:user_id"], token_bucket: { rate: 1/h, burst: 3 } }
      - name: per_tenant
        key: ["header:x-tenant", method]
        mode: shadow
        quota: { limit: 100, per: day }
"#;

async fn send(
    gw: &TestGateway,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    let mut req = request(method, &gw.admin_url(path)).header("content-type", "application/json");
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    Client::new()
        .send(req.body(full(body.to_owned())).expect("request"))
        .await
}

#[tokio::test]
async fn the_page_is_served_whole_by_the_admin_listener_with_nothing_from_elsewhere() {
    let gw = TestGateway::start(CONFIG).await;
    let c = Client::new();
    let page = c.get(&gw.admin_url("/")).await;
    assert_eq!(page.status, 200);
    assert_eq!(
        page.header("content-type"),
        Some("text/html; charset=utf-8")
    );
    let csp = page.header("content-security-policy").expect("a CSP");
    assert!(csp.starts_with("default-src 'self'"), "{csp}");
    assert!(page.text().contains("<title>Turnstile status</title>"));
    for path in ["/", "/status.css", "/status.js"] {
        let text = c.get(&gw.admin_url(path)).await.text();
        // No CDN, no external font or script: no absolute URL at all.
        for scheme in ["http:", "https:", "//fonts", "@import"] {
            assert!(!text.contains(scheme), "{path} refers to `{scheme}`");
        }
    }
    // Never on the public listener.
    assert_eq!(c.get(&gw.url("/status/routes")).await.status, 404);
    assert_eq!(c.get(&gw.url("/")).await.status, 404);
}

#[tokio::test]
async fn routes_come_in_match_order_with_their_policies_and_exact_decision_counts() {
    let gw = TestGateway::start(CONFIG).await;
    let c = Client::new();
    let statuses: Vec<u16> = {
        let mut out = Vec::new();
        for _ in 0..7 {
            out.push(c.get(&gw.url("/hello")).await.status);
        }
        out
    };
    assert_eq!(statuses, [200, 200, 200, 200, 200, 429, 429]);
    let routes = c.get(&gw.admin_url("/status/routes")).await.json();
    let routes = routes["routes"].as_array().expect("routes");
    let names: Vec<&str> = routes.iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["hello", "users"]);
    assert_eq!(routes[0]["match"], "path /hello");
    assert_eq!(routes[1]["match"], "path /api/users/{user_id}, methods GET");
    assert_eq!(routes[1]["quota_endpoint"], "/quota/users/{user_id}");
    let hello = &routes[0]["policies"][0];
    assert_eq!(hello["name"], "per_ip");
    assert_eq!(hello["algorithm"], "sliding_window");
    assert_eq!(hello["limit"], "5 per 3600s");
    assert_eq!(hello["key"], serde_json::json!(["client_ip"]));
    assert_eq!(hello["mode"], "enforce");
    assert_eq!(hello["decisions"]["allowed"], 5);
    assert_eq!(hello["decisions"]["limited"], 2);
    let users = &routes[1]["policies"];
    assert_eq!(users[0]["algorithm"], "token_bucket");
    assert_eq!(users[0]["key"], serde_json::json!(["path:user_id"]));
    assert_eq!(
        users[1]["key"],
        serde_json::json!(["header:x-tenant", "method"])
    );
    assert_eq!(users[1]["mode"], "shadow");
    assert_eq!(users[1]["algorithm"], "quota");

    let instance = c.get(&gw.admin_url("/status/instance")).await.json();
    assert_eq!(instance["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(instance["store"]["type"], "memory");
    assert_eq!(instance["store"]["ready"], true);
    let config = c.get(&gw.admin_url("/config")).await.json();
    assert_eq!(instance["config"]["sha256"], config["sha256"]);
    assert!(instance["last_reload"]["error"].is_null());
}

#[tokio::test]
async fn a_failed_reload_shows_its_error_with_file_and_line() {
    let gw = TestGateway::start(CONFIG).await;
    let bad = CONFIG.replace("limit: 5, window: 1h", "limit: 0, window: 1h");
    assert!(gw.reload_with(&bad).await.is_err());
    let instance = Client::new()
        .get(&gw.admin_url("/status/instance"))
        .await
        .json();
    let error = instance["last_reload"]["error"]
        .as_str()
        .expect("the reload's error");
    assert!(error.contains("policies.yaml:7:"), "{error}");
    assert!(error.contains("limit"), "{error}");
}

async fn the_lookup_reads_each_policy_without_consuming(store: TestStore) {
    let gw = TestGateway::start(&store.config(CONFIG)).await;
    let c = Client::new();
    for _ in 0..2 {
        assert_eq!(c.get(&gw.url("/api/users/7")).await.status, 200);
    }
    let ask = r#"{"route": "users", "keys": {"per_user": "7"}}"#;
    for _ in 0..3 {
        let peek = send(&gw, Method::POST, "/status/peek", &[], ask).await;
        assert_eq!(peek.status, 200, "{}", peek.text());
        let body = peek.json();
        let user = &body["policies"][0];
        assert_eq!(user["policy"], "per_user");
        assert_eq!(user["applies"], true);
        assert_eq!(
            (user["limit"].as_u64(), user["remaining"].as_u64()),
            (Some(3), Some(1))
        );
        // Two tokens at 1/h: two hours to full.
        assert_eq!(user["reset_seconds"], 7200);
        assert_eq!(user["next_allowed"], true);
        assert_eq!(body["policies"][1]["applies"], false, "no key value given");
    }
    // The lookups consumed nothing: one request left, then refused.
    assert_eq!(c.get(&gw.url("/api/users/7")).await.status, 200);
    assert_eq!(c.get(&gw.url("/api/users/7")).await.status, 429);
    let peek = send(&gw, Method::POST, "/status/peek", &[], ask)
        .await
        .json();
    let user = &peek["policies"][0];
    assert_eq!(
        (user["remaining"].as_u64(), user["next_allowed"].as_bool()),
        (Some(0), Some(false))
    );
    assert_eq!(user["retry_after_seconds"], 3600);
    assert_eq!(
        gw.metric(
            "turnstile_decisions_total",
            &[
                ("route", "users"),
                ("policy", "per_user"),
                ("decision", "allowed")
            ]
        )
        .await,
        3.0
    );

    let two_parts = r#"{"route": "users", "keys": {"per_tenant": "acme|GET"}}"#;
    let tenant = send(&gw, Method::POST, "/status/peek", &[], two_parts)
        .await
        .json();
    assert_eq!(tenant["policies"][1]["remaining"], 100);
    assert_eq!(tenant["policies"][1]["mode"], "shadow");
    for (body, status, says) in [
        (r#"{"route": "nope", "keys": {}}"#, 404, "no route `nope`"),
        (
            r#"{"route": "users", "keys": {"nope": "1"}}"#,
            404,
            "no policy `nope`",
        ),
        (
            r#"{"route": "users", "keys": {"per_tenant": "acme"}}"#,
            400,
            "keys on 2 parts",
        ),
        (
            r#"{"route": "users", "keys": {"per_user": "a b"}}"#,
            400,
            "a%20b",
        ),
        (r#"{"route": "users"}"#, 400, "keys"),
    ] {
        let reply = send(&gw, Method::POST, "/status/peek", &[], body).await;
        assert_eq!(reply.status, status, "{body}: {}", reply.text());
        assert!(reply.text().contains(says), "{body}: {}", reply.text());
    }
}

crate::store_matrix!(the_lookup_reads_each_policy_without_consuming);

#[tokio::test]
async fn a_cross_site_write_is_refused_and_the_api_still_answers_its_clients() {
    let gw = TestGateway::start(CONFIG).await;
    let own = format!("http://{}", gw.admin);
    let path = "/overrides/hello/per_ip/127.0.0.1";
    let body = r#"{"limit": 50}"#;
    // A form posted from another site (a browser sends Origin and Sec-Fetch-Site with it).
    let form = request(Method::POST, &gw.admin_url(path))
        .header("content-type", "application/x-www-form-urlencoded")
        .header("origin", "http://evil.example")
        .header("sec-fetch-site", "cross-site")
        .body(full("limit=50"))
        .expect("request");
    let reply = Client::new().send(form).await;
    assert_eq!(reply.status, 403, "{}", reply.text());
    assert_eq!(reply.json()["error"], "cross_site");
    for headers in [
        vec![
            ("origin", "http://evil.example"),
            ("sec-fetch-site", "cross-site"),
        ],
        // Another port of the same host is another origin (same-site, not same-origin).
        vec![
            ("origin", "http://127.0.0.1:1"),
            ("sec-fetch-site", "same-site"),
        ],
        vec![("origin", "null")],
        vec![("sec-fetch-site", "cross-site")],
    ] {
        let reply = send(&gw, Method::PUT, path, &headers, body).await;
        assert_eq!(reply.status, 403, "{headers:?}: {}", reply.text());
        let reply = send(&gw, Method::DELETE, path, &headers, "").await;
        assert_eq!(reply.status, 403, "{headers:?}");
    }
    // DNS rebinding: a browser reaching the listener under another name, even "same-origin".
    let rebound = send(
        &gw,
        Method::GET,
        "/overrides",
        &[("host", "evil.example"), ("sec-fetch-site", "same-origin")],
        "",
    )
    .await;
    assert_eq!(rebound.status, 403, "{}", rebound.text());
    let listed = Client::new().get(&gw.admin_url("/overrides")).await.json();
    assert_eq!(
        listed["overrides"],
        serde_json::json!([]),
        "nothing was set"
    );

    // The page itself (same origin), and curl (no browser fields), may write.
    let same = [("origin", own.as_str()), ("sec-fetch-site", "same-origin")];
    assert_eq!(send(&gw, Method::PUT, path, &same, body).await.status, 200);
    assert_eq!(send(&gw, Method::DELETE, path, &same, "").await.status, 204);
    assert_eq!(send(&gw, Method::PUT, path, &[], body).await.status, 200);
    assert_eq!(send(&gw, Method::DELETE, path, &[], "").await.status, 204);
    // A browser by IP or localhost reads the page.
    let page = Client::new()
        .get_with(
            &gw.admin_url("/"),
            &[("sec-fetch-site", "none"), ("host", "localhost")],
        )
        .await;
    assert_eq!(page.status, 200);
}
