//! The proxy: what reaches the upstream, what comes back, and how failures are answered.

use crate::support::{Client, TestGateway, Upstream};

fn forward_all() -> &'static str {
    r#"
upstreams:
  up:
    url: http://$UPSTREAM
    timeout: 500ms
routes:
  - name: all
    upstream: up
"#
}

#[tokio::test]
async fn the_upstream_gets_method_path_query_and_body() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(forward_all(), upstream.addr).await;
    let client = Client::new();
    let req = crate::support::client::request(http::Method::POST, &gw.url("/a/b?c=d&e"))
        .header("x-custom", "1")
        .body(crate::support::client::full("hello"))
        .unwrap();
    let reply = client.send(req).await;
    assert_eq!(reply.status, 200);
    let echo = reply.json();
    assert_eq!(echo["method"], "POST");
    assert_eq!(echo["path"], "/a/b?c=d&e");
    assert_eq!(echo["body_len"], 5);
    assert_eq!(echo["headers"]["x-custom"][0], "1");
    assert_eq!(upstream.requests(), 1);
}
