//! Key parts: each part names its own counters, and a request missing a part is not limited by
//! that policy at all. Every policy here allows one request per hour per key, so the second
//! request with the same key is the first one rejected.

use tokio::io::AsyncReadExt;

use crate::support::client::{raw_connect, read_head};
use crate::support::{Client, TestGateway};

const ONE_PER_HOUR: &str = "token_bucket: { rate: 1/h, burst: 1 }";

fn route(name: &str, matcher: &str, key: &str) -> String {
    format!(
        r#"
  - name: {name}
    match: {matcher}
    respond: {{ body: ok }}
    policies:
      - {{ name: p, key: {key}, {ONE_PER_HOUR} }}"#
    )
}

fn config() -> String {
    [
        "routes:".to_string(),
        route(
            "by-header",
            "{ prefix: /header }",
            r#"["header:x-api-key"]"#,
        ),
        route("by-path", r#"{ path: "/path/{user}" }"#, r#"["path:user"]"#),
        route("by-query", "{ prefix: /query }", r#"["query:tenant"]"#),
        route("by-method", "{ prefix: /method }", "[method]"),
        route("by-host", "{ prefix: /host }", "[host]"),
        route("by-ip", "{ prefix: /ip }", "[client_ip]"),
        route(
            "by-pair",
            "{ prefix: /pair }",
            r#"["header:x-a", "header:x-b"]"#,
        ),
    ]
    .join("")
}

/// The status of a GET with `headers`.
async fn status(client: &Client, url: &str, headers: &[(&str, &str)]) -> u16 {
    client.get_with(url, headers).await.status
}

#[tokio::test]
async fn a_header_part_counts_per_value_and_an_absent_header_is_not_limited() {
    let gw = TestGateway::start(&config()).await;
    let c = Client::new();
    let url = gw.url("/header");
    assert_eq!(status(&c, &url, &[("x-api-key", "alice")]).await, 200);
    assert_eq!(status(&c, &url, &[("x-api-key", "alice")]).await, 429);
    assert_eq!(status(&c, &url, &[("x-api-key", "bob")]).await, 200);
    for _ in 0..3 {
        let reply = c.get(&url).await;
        assert_eq!(reply.status, 200);
        assert!(
            reply.header("x-ratelimit-limit").is_none(),
            "a policy that does not apply sets no headers"
        );
    }
    let metrics = gw.metrics().await;
    let decisions = |d: &str| {
        crate::support::metric(
            &metrics,
            "turnstile_decisions_total",
            &[("route", "by-header"), ("policy", "p"), ("decision", d)],
        )
    };
    // The three requests without the header took no decision at all.
    assert_eq!(decisions("allowed"), Some(2.0));
    assert_eq!(decisions("limited"), Some(1.0));
}

#[tokio::test]
async fn a_path_part_counts_per_parameter_value() {
    let gw = TestGateway::start(&config()).await;
    let c = Client::new();
    assert_eq!(status(&c, &gw.url("/path/1"), &[]).await, 200);
    assert_eq!(status(&c, &gw.url("/path/1"), &[]).await, 429);
    assert_eq!(status(&c, &gw.url("/path/1?other=query"), &[]).await, 429);
    assert_eq!(status(&c, &gw.url("/path/2"), &[]).await, 200);
}

#[tokio::test]
async fn a_query_part_counts_per_value_and_an_absent_parameter_is_not_limited() {
    let gw = TestGateway::start(&config()).await;
    let c = Client::new();
    assert_eq!(status(&c, &gw.url("/query?tenant=a"), &[]).await, 200);
    assert_eq!(status(&c, &gw.url("/query?x=1&tenant=a"), &[]).await, 429);
    assert_eq!(status(&c, &gw.url("/query?tenant=b"), &[]).await, 200);
    // Only the exact name counts: `tenants` and `xtenant` are other parameters.
    for url in [
        "/query",
        "/query?x=1",
        "/query?tenants=a",
        "/query?xtenant=a",
    ] {
        assert_eq!(status(&c, &gw.url(url), &[]).await, 200, "{url}");
        assert_eq!(status(&c, &gw.url(url), &[]).await, 200, "{url}");
    }
}

#[tokio::test]
async fn a_method_part_counts_per_method() {
    let gw = TestGateway::start(&config()).await;
    let c = Client::new();
    let url = gw.url("/method");
    let send = |m: http::Method| {
        let req = crate::support::client::request(m, &url)
            .body(crate::support::client::empty())
            .unwrap();
        let c = c.clone();
        async move { c.send(req).await.status }
    };
    assert_eq!(send(http::Method::GET).await, 200);
    assert_eq!(send(http::Method::GET).await, 429);
    assert_eq!(send(http::Method::POST).await, 200);
    assert_eq!(send(http::Method::POST).await, 429);
    assert_eq!(send(http::Method::DELETE).await, 200);
}

#[tokio::test]
async fn a_host_part_counts_per_host_and_a_request_without_host_is_not_limited() {
    let gw = TestGateway::start(&config()).await;
    let c = Client::new();
    let url = gw.url("/host");
    assert_eq!(status(&c, &url, &[("host", "a.example")]).await, 200);
    assert_eq!(status(&c, &url, &[("host", "a.example")]).await, 429);
    assert_eq!(status(&c, &url, &[("host", "b.example")]).await, 200);
    // HTTP/1.0 may omit Host: the policy then does not apply.
    for _ in 0..2 {
        let mut stream = raw_connect(gw.public, b"GET /host HTTP/1.0\r\n\r\n").await;
        let (head, _) = read_head(&mut stream).await;
        assert!(
            head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
            "{head}"
        );
        assert!(!head.to_ascii_lowercase().contains("x-ratelimit"), "{head}");
        let mut rest = Vec::new();
        let _ = stream.read_to_end(&mut rest).await;
    }
}

#[tokio::test]
async fn a_client_ip_part_counts_the_peer_and_ignores_forwarded_for_from_untrusted_peers() {
    let gw = TestGateway::start(&config()).await;
    let c = Client::new();
    let url = gw.url("/ip");
    assert_eq!(
        status(&c, &url, &[("x-forwarded-for", "1.1.1.1")]).await,
        200
    );
    // No trusted proxies: the header is the client's word, and the peer is the same.
    assert_eq!(
        status(&c, &url, &[("x-forwarded-for", "2.2.2.2")]).await,
        429
    );
    assert_eq!(status(&c, &url, &[]).await, 429);
}

#[tokio::test]
async fn a_key_of_several_parts_applies_only_when_all_are_present() {
    let gw = TestGateway::start(&config()).await;
    let c = Client::new();
    let url = gw.url("/pair");
    assert_eq!(status(&c, &url, &[("x-a", "1"), ("x-b", "2")]).await, 200);
    assert_eq!(status(&c, &url, &[("x-a", "1"), ("x-b", "2")]).await, 429);
    assert_eq!(status(&c, &url, &[("x-a", "1"), ("x-b", "3")]).await, 200);
    for _ in 0..2 {
        assert_eq!(status(&c, &url, &[("x-a", "1")]).await, 200);
        assert_eq!(status(&c, &url, &[("x-b", "2")]).await, 200);
    }
}

#[tokio::test]
async fn key_parts_cannot_collide_through_the_separator() {
    let gw = TestGateway::start(&config()).await;
    let c = Client::new();
    let url = gw.url("/pair");
    assert_eq!(status(&c, &url, &[("x-a", "x|y"), ("x-b", "z")]).await, 200);
    assert_eq!(status(&c, &url, &[("x-a", "x"), ("x-b", "y|z")]).await, 200);
    assert_eq!(
        status(&c, &url, &[("x-a", "x%7Cy"), ("x-b", "z")]).await,
        200
    );
    assert_eq!(status(&c, &url, &[("x-a", "x|y"), ("x-b", "z")]).await, 429);
}

#[tokio::test]
async fn long_key_values_are_hashed_into_separate_counters() {
    let gw = TestGateway::start(&config()).await;
    let c = Client::new();
    let url = gw.url("/header");
    let long = |last: char| format!("{}{last}", "k".repeat(300));
    let (one, two) = (long('1'), long('2'));
    assert_eq!(status(&c, &url, &[("x-api-key", &one)]).await, 200);
    assert_eq!(status(&c, &url, &[("x-api-key", &two)]).await, 200);
    assert_eq!(status(&c, &url, &[("x-api-key", &one)]).await, 429);
    assert_eq!(status(&c, &url, &[("x-api-key", &two)]).await, 429);
    // Exactly at the bound (256 bytes) and one past it are different keys too.
    let at_bound = "b".repeat(256);
    let past_bound = "b".repeat(257);
    assert_eq!(status(&c, &url, &[("x-api-key", &at_bound)]).await, 200);
    assert_eq!(status(&c, &url, &[("x-api-key", &past_bound)]).await, 200);
    // A very long value is just another key.
    let huge = "h".repeat(16 * 1024);
    assert_eq!(status(&c, &url, &[("x-api-key", &huge)]).await, 200);
    assert_eq!(status(&c, &url, &[("x-api-key", &huge)]).await, 429);
}

#[tokio::test]
async fn client_ip_is_the_rightmost_untrusted_forwarded_for_hop_behind_trusted_proxies() {
    let yaml = format!(
        "client_ip:\n  trusted_proxies: [127.0.0.0/8, 10.0.0.0/8]\n{}",
        config()
    );
    let gw = TestGateway::start(&yaml).await;
    let c = Client::new();
    let url = gw.url("/ip");
    let xff = |v: &'static str| [("x-forwarded-for", v)];
    assert_eq!(status(&c, &url, &xff("1.1.1.1")).await, 200);
    assert_eq!(status(&c, &url, &xff("1.1.1.1")).await, 429);
    assert_eq!(status(&c, &url, &xff("2.2.2.2")).await, 200);
    // Behind two trusted hops, 1.1.1.1 is still the client; what it claims (9.9.9.9) is ignored.
    assert_eq!(
        status(&c, &url, &xff("9.9.9.9, 1.1.1.1, 10.0.0.5")).await,
        429
    );
    // The rightmost untrusted hop is the client, whatever stands left of it.
    assert_eq!(status(&c, &url, &xff("1.1.1.1, 3.3.3.3")).await, 200);
    assert_eq!(status(&c, &url, &xff("3.3.3.3")).await, 429);
    // Several header lines read as one list, the last line last.
    assert_eq!(
        status(
            &c,
            &url,
            &[
                ("x-forwarded-for", "4.4.4.4"),
                ("x-forwarded-for", "10.0.0.7")
            ]
        )
        .await,
        200
    );
    assert_eq!(status(&c, &url, &xff("4.4.4.4")).await, 429);
    // A trusted peer without the header is the client itself.
    assert_eq!(status(&c, &url, &[]).await, 200);
    assert_eq!(status(&c, &url, &[]).await, 429);
}
