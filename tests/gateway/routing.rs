//! Route matching: path patterns, `{*rest}`, prefixes, methods, host, headers, order, and the 404
//! for requests no route takes.

use crate::support::{metric, Client, TestGateway};

const ROUTES: &str = r#"
routes:
  - name: users
    match: { path: "/api/users/{user_id}" }
    respond: { body: users }
  - name: files
    match: { path: "/files/{*rest}" }
    respond: { body: files }
  - name: static
    match: { prefix: /static/ }
    respond: { body: static }
"#;

async fn body_or_status(client: &Client, url: &str) -> String {
    let reply = client.get(url).await;
    match reply.status {
        200 => reply.text(),
        other => other.to_string(),
    }
}

#[tokio::test]
async fn path_patterns_catch_all_and_prefix() {
    let gw = TestGateway::start(ROUTES).await;
    let client = Client::new();
    let cases = [
        ("/api/users/42", "users"),
        ("/api/users/42?x=1", "users"),
        ("/api/users/42/posts", "404"),
        ("/api/users/", "404"),
        ("/api/users", "404"),
        ("/api/userz/42", "404"),
        ("/files/a/b/c", "files"),
        ("/files/", "files"),
        ("/files", "files"),
        ("/filesystem", "404"),
        ("/static/css/site.css", "static"),
        ("/static/", "static"),
        ("/static", "404"),
        ("/", "404"),
    ];
    for (path, want) in cases {
        assert_eq!(body_or_status(&client, &gw.url(path)).await, want, "{path}");
    }
}

#[tokio::test]
async fn methods_host_and_headers_narrow_a_route() {
    let gw = TestGateway::start(
        r#"
routes:
  - name: writes
    match: { prefix: /, methods: [POST, put] }
    respond: { body: writes }
  - name: tenant
    match: { prefix: /, headers: { x-tenant: acme } }
    respond: { body: tenant }
  - name: api-host
    match: { prefix: /, host: api.example.com }
    respond: { body: api-host }
"#,
    )
    .await;
    let client = Client::new();
    let url = gw.url("/x");
    let send = |method: &str, headers: &[(&str, &str)]| {
        let mut builder = crate::support::client::request(method.parse().unwrap(), &url);
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        let req = builder.body(crate::support::client::empty()).unwrap();
        let client = client.clone();
        async move {
            let reply = client.send(req).await;
            match reply.status {
                200 => reply.text(),
                other => other.to_string(),
            }
        }
    };
    // `writes` takes every path for POST and PUT, so any other method that no other route takes
    // is a 405 (with `Allow: POST, PUT`), not a 404 (RFC 9110 §15.5.6).
    assert_eq!(send("GET", &[]).await, "405");
    assert_eq!(send("POST", &[]).await, "writes");
    assert_eq!(send("PUT", &[]).await, "writes");
    assert_eq!(send("DELETE", &[]).await, "405");
    assert_eq!(send("GET", &[("x-tenant", "acme")]).await, "tenant");
    assert_eq!(send("GET", &[("x-tenant", "Acme")]).await, "405");
    assert_eq!(send("GET", &[("x-tenant", "acme2")]).await, "405");
    assert_eq!(
        send("GET", &[("host", "api.example.com")]).await,
        "api-host"
    );
    assert_eq!(
        send("GET", &[("host", "API.Example.COM:8443")]).await,
        "api-host"
    );
    assert_eq!(send("GET", &[("host", "www.example.com")]).await, "405");
    assert_eq!(
        send("GET", &[("host", "api.example.com.evil")]).await,
        "405"
    );
    // Conditions combine with the first route that holds: a POST with the header is a write.
    assert_eq!(send("POST", &[("x-tenant", "acme")]).await, "writes");
}

#[tokio::test]
async fn the_first_matching_route_wins() {
    let gw = TestGateway::start(
        r#"
routes:
  - name: broad
    match: { prefix: /a }
    respond: { body: broad }
  - name: narrow
    match: { path: /a/b }
    respond: { body: narrow }
  - name: everything
    respond: { body: everything }
"#,
    )
    .await;
    let client = Client::new();
    assert_eq!(body_or_status(&client, &gw.url("/a/b")).await, "broad");
    assert_eq!(body_or_status(&client, &gw.url("/b")).await, "everything");
}

#[tokio::test]
async fn a_request_no_route_takes_gets_a_json_404() {
    let gw = TestGateway::start(ROUTES).await;
    let reply = Client::new().get(&gw.url("/nowhere")).await;
    assert_eq!(reply.status, 404);
    assert_eq!(reply.header("content-type"), Some("application/json"));
    assert_eq!(reply.json()["error"], "no_route");
    assert!(reply.header("x-ratelimit-limit").is_none());
    let metrics = gw.metrics().await;
    assert_eq!(
        metric(
            &metrics,
            "turnstile_requests_total",
            &[("route", "unmatched"), ("code", "4xx")]
        ),
        Some(1.0)
    );
}

/// With 10,000 routes, a 30 KB path without a slash was tested against every route twice (for the
/// 404, then for a 405), each test scanning the whole path: about 40 ms of CPU per request in a
/// debug build, so twenty of them took most of a second. Indexed by the first segment, no route
/// can match it and none is tested. (A wall-clock bound, far above what the routing now costs and
/// below what it cost, loose enough for a loaded 2-core machine; `route::tests` bounds the same
/// exactly, with a count of routes tested.)
#[tokio::test]
async fn regression_a_long_path_without_a_slash_cost_every_route_twice() {
    let mut yaml = String::from("server:\n  max_header_size: 64KiB\nroutes:\n");
    for i in 0..10_000 {
        yaml.push_str(&format!(
            "  - name: svc{i}\n    match: {{ path: \"/svc{i}/items/{{id}}\", methods: [GET] }}\n    respond: {{ body: svc{i} }}\n"
        ));
    }
    let gw = TestGateway::start(&yaml).await;
    let client = Client::new();
    let long = format!("/{}", "a".repeat(30_000));
    // Warm the connection and the page cache of the test binary.
    assert_eq!(client.get(&gw.url(&long)).await.status, 404);
    let started = std::time::Instant::now();
    for _ in 0..20 {
        assert_eq!(client.get(&gw.url(&long)).await.status, 404);
    }
    let elapsed = started.elapsed();
    assert!(
        elapsed < std::time::Duration::from_millis(800),
        "20 long unmatched paths took {elapsed:?}"
    );
    // The routes still answer, the last one included, and a 405 is still told from a 404.
    assert_eq!(
        body_or_status(&client, &gw.url("/svc9999/items/1")).await,
        "svc9999"
    );
    assert_eq!(
        body_or_status(&client, &gw.url("/svc0/items/1/")).await,
        "svc0"
    );
    let reply = client
        .send(
            http::Request::post(gw.url("/svc9999/items/1"))
                .body(crate::support::client::empty())
                .expect("request"),
        )
        .await;
    assert_eq!(reply.status, 405);
    assert_eq!(reply.headers["allow"], "GET");
    assert_eq!(
        gw.metric(
            "turnstile_requests_total",
            &[("route", "unmatched"), ("code", "4xx")]
        )
        .await,
        22.0
    );
}
