//! The routes' `strip_prefix` and `rewrite` (issue 13): what the upstream sees, with captures and
//! query strings, and keys still made from the request's own path.

use crate::support::{Client, TestGateway, Upstream};

const REWRITES: &str = r#"
upstreams:
  up: { url: "http://$UPSTREAM" }
routes:
  - name: strip
    match: { path: "/api/users/{id}" }
    upstream: up
    strip_prefix: /api
  - name: rewrite
    match: { path: "/svc/{id}/{*rest}" }
    upstream: up
    rewrite: "/v2/{*rest}/by/{id}"
    policies:
      - name: per_id
        key: [path:id]
        sliding_window: { limit: 1, window: 1h }
  - name: prefix
    match: { prefix: /old }
    upstream: up
    strip_prefix: /old
"#;

async fn seen_path(client: &Client, gw: &TestGateway, path: &str) -> String {
    let reply = client.get(&gw.url(path)).await;
    assert_eq!(reply.status, 200, "{path}: {}", reply.text());
    reply.json()["path"]
        .as_str()
        .expect("echoed path")
        .to_string()
}

#[tokio::test]
async fn strip_prefix_and_rewrite_forward_the_new_path_with_the_query() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(REWRITES, up.addr).await;
    let client = Client::new();
    assert_eq!(
        seen_path(&client, &gw, "/api/users/7?x=1&y=%20").await,
        "/users/7?x=1&y=%20"
    );
    // The canonical path is what is rewritten (dot segments and repeated slashes gone).
    assert_eq!(
        seen_path(&client, &gw, "/api//users/./8/").await,
        "/users/8/"
    );
    assert_eq!(seen_path(&client, &gw, "/old").await, "/");
    assert_eq!(seen_path(&client, &gw, "/old/a/b?q").await, "/a/b?q");
    assert_eq!(
        seen_path(&client, &gw, "/svc/42/a/b%2Bc?q=1").await,
        "/v2/a/b%2Bc/by/42?q=1"
    );
}

#[tokio::test]
async fn rate_limit_keys_come_from_the_request_path_not_the_rewritten_one() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(REWRITES, up.addr).await;
    let client = Client::new();
    assert_eq!(client.get(&gw.url("/svc/42/a")).await.status, 200);
    // Another rest, same id: the same counter.
    assert_eq!(client.get(&gw.url("/svc/42/b")).await.status, 429);
    assert_eq!(client.get(&gw.url("/svc/43/a")).await.status, 200);
    assert_eq!(
        up.requests(),
        2,
        "the refused request never reached the upstream"
    );
}
