//! What the gateway answers itself (issue 13): the rate-limit fields in each `rate_limit_headers`
//! dialect (draft-ietf-httpapi-ratelimit-headers-10 parsed as Structured Fields), a route's
//! `limited_response` with its placeholders, and 405 with `Allow` when a path is routed for other
//! methods (RFC 9110 §15.5.6).

use http::Method;

use crate::support::client::{empty, request};
use crate::support::{Client, Reply, TestGateway, Upstream};

/// One member of a Structured Field List (RFC 9651 §3.1): a String item and its integer
/// parameters, in order. Panics on anything else, so a malformed field fails the test.
#[derive(Debug, PartialEq)]
struct Item {
    name: String,
    params: Vec<(String, u64)>,
}

/// Parses `"a";q=1;w=2, "b";r=3` as the draft's fields are written: a List of Strings with
/// Integer parameters.
fn sf_list(text: &str) -> Vec<Item> {
    let mut items = Vec::new();
    let mut rest = text.trim_start_matches(' ');
    while !rest.is_empty() {
        let body = rest
            .strip_prefix('"')
            .unwrap_or_else(|| panic!("not a String: {text}"));
        let close = body
            .find('"')
            .unwrap_or_else(|| panic!("unterminated: {text}"));
        let name = &body[..close];
        assert!(!name.contains('\\'), "no escapes expected: {text}");
        rest = &body[close + 1..];
        let mut params = Vec::new();
        while let Some(param) = rest.strip_prefix(';') {
            let end = param.find([';', ',']).unwrap_or(param.len());
            let (key, value) = param[..end]
                .split_once('=')
                .unwrap_or_else(|| panic!("parameter without value: {text}"));
            assert!(
                key.bytes().all(|b| b.is_ascii_lowercase()),
                "key `{key}`: {text}"
            );
            let value = value
                .parse()
                .unwrap_or_else(|_| panic!("`{value}` is not an Integer: {text}"));
            params.push((key.to_owned(), value));
            rest = &param[end..];
        }
        items.push(Item {
            name: name.to_owned(),
            params,
        });
        rest = match rest.strip_prefix(',') {
            Some(next) => next.trim_start_matches([' ', '\t']),
            None if rest.is_empty() => rest,
            None => panic!("junk after an item: {text}"),
        };
    }
    items
}

fn item(name: &str, params: &[(&str, u64)]) -> Item {
    Item {
        name: name.to_owned(),
        params: params.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect(),
    }
}

/// `per_user` (`header:x-user`, 20 a minute: q=20, w=60, one token back every 3 s) and `per_ip`
/// (a 10 s window of 100), under each dialect: the server's default (`ietf`) and three overrides.
const HEADERS_YAML: &str = r#"
server:
  rate_limit_headers: ietf
upstreams:
  up: { url: "http://$UPSTREAM" }
routes:
  - name: ietf
    upstream: up
    match: { prefix: /ietf }
    policies: &policies
      - { name: per_user, key: ["header:x-user"], token_bucket: { rate: 20/m, burst: 20 } }
      - { name: per_ip, key: [client_ip], sliding_window: { limit: 100, window: 10s } }
  - name: legacy
    upstream: up
    match: { prefix: /legacy }
    rate_limit_headers: x-ratelimit
    policies: *policies
  - name: both
    upstream: up
    match: { prefix: /both }
    rate_limit_headers: both
    policies: *policies
  - name: quiet
    upstream: up
    match: { prefix: /quiet }
    rate_limit_headers: none
    policies: *policies
  - name: tiny
    upstream: up
    match: { prefix: /tiny }
    policies:
      - { name: one, key: [client_ip], token_bucket: { rate: 1/h, burst: 1 } }
"#;

fn ietf_fields(reply: &Reply) -> (Vec<Item>, Vec<Item>) {
    let policy = reply.header("ratelimit-policy").unwrap_or_else(|| {
        panic!("no RateLimit-Policy in {:?}", reply.headers);
    });
    let limit = reply
        .header("ratelimit")
        .unwrap_or_else(|| panic!("no RateLimit in {:?}", reply.headers));
    (sf_list(policy), sf_list(limit))
}

#[tokio::test]
async fn each_header_mode_sends_exactly_its_fields() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(HEADERS_YAML, upstream.addr).await;
    let c = Client::new();
    let user = [("x-user", "carol")];
    let both_policies = vec![
        item("per_user", &[("q", 20), ("w", 60)]),
        item("per_ip", &[("q", 100), ("w", 10)]),
    ];

    // ietf (the server default): both policies applied; per_user (19 left) governs. A token
    // comes back within 3 s, so `t` is 3 (rounded up).
    let reply = c.get_with(&gw.url("/ietf"), &user).await;
    assert_eq!(reply.status, 200);
    let (policy, limit) = ietf_fields(&reply);
    assert_eq!(policy, both_policies);
    assert_eq!(limit, vec![item("per_user", &[("r", 19), ("t", 3)])]);
    assert_eq!(reply.header("x-ratelimit-limit"), None);

    // Without the header only per_ip applies, so only it is listed.
    let reply = c.get(&gw.url("/ietf")).await;
    let (policy, limit) = ietf_fields(&reply);
    assert_eq!(policy, vec![item("per_ip", &[("q", 100), ("w", 10)])]);
    assert_eq!(limit.len(), 1);
    assert_eq!(limit[0].name, "per_ip");
    assert_eq!(limit[0].params[0], ("r".to_owned(), 98));
    assert_eq!(limit[0].params[1].0, "t");
    assert!((1..=10).contains(&limit[0].params[1].1), "{limit:?}");

    let reply = c.get_with(&gw.url("/legacy"), &user).await;
    assert_eq!(reply.header("x-ratelimit-limit"), Some("20"));
    assert_eq!(reply.header("x-ratelimit-remaining"), Some("19"));
    assert_eq!(reply.header("x-ratelimit-reset"), Some("3"));
    assert_eq!(reply.header("ratelimit"), None);
    assert_eq!(reply.header("ratelimit-policy"), None);

    let reply = c.get_with(&gw.url("/both"), &user).await;
    assert_eq!(reply.header("x-ratelimit-remaining"), Some("19"));
    let (policy, limit) = ietf_fields(&reply);
    assert_eq!(policy, both_policies);
    assert_eq!(limit, vec![item("per_user", &[("r", 19), ("t", 3)])]);

    let reply = c.get_with(&gw.url("/quiet"), &user).await;
    assert_eq!(reply.status, 200);
    for name in [
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
        "ratelimit",
        "ratelimit-policy",
    ] {
        assert_eq!(reply.header(name), None, "{name}");
    }

    // A refusal carries the fields too, with nothing remaining, and Retry-After.
    assert_eq!(c.get(&gw.url("/tiny")).await.status, 200);
    let refused = c.get(&gw.url("/tiny")).await;
    assert_eq!(refused.status, 429);
    let (policy, limit) = ietf_fields(&refused);
    assert_eq!(policy, vec![item("one", &[("q", 1), ("w", 3600)])]);
    assert_eq!(limit[0].name, "one");
    assert_eq!(limit[0].params[0], ("r".to_owned(), 0));
    let retry = refused.header_u64("retry-after");
    assert!((3590..=3600).contains(&retry), "{retry}");
    assert_eq!(upstream.requests(), 6);
}

/// `custom` has its own refusal; `plain` takes the server's (a 503 with the JSON body).
const LIMITED_YAML: &str = r#"
server:
  limited_response: { status: 503 }
upstreams:
  up: { url: "http://$UPSTREAM" }
routes:
  - name: custom
    upstream: up
    match: { prefix: /custom }
    limited_response:
      status: 420
      content_type: text/html; charset=utf-8
      body: '<p>{policy} on {route}: come back in {retry_after} s {not json}</p>'
    policies:
      - { name: per_ip, key: [client_ip], token_bucket: { rate: 1/h, burst: 1 } }
  - name: plain
    upstream: up
    match: { prefix: /plain }
    policies:
      - { name: per_ip, key: [client_ip], token_bucket: { rate: 1/h, burst: 1 } }
"#;

#[tokio::test]
async fn limited_response_fills_its_placeholders_and_keeps_the_headers() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(LIMITED_YAML, upstream.addr).await;
    let c = Client::new();

    assert_eq!(c.get(&gw.url("/custom")).await.status, 200);
    let refused = c.get(&gw.url("/custom")).await;
    assert_eq!(refused.status, 420);
    assert_eq!(
        refused.header("content-type"),
        Some("text/html; charset=utf-8")
    );
    let retry = refused.header_u64("retry-after");
    assert!((3590..=3600).contains(&retry), "{retry}");
    assert_eq!(
        refused.text(),
        format!("<p>per_ip on custom: come back in {retry} s {{not json}}</p>")
    );
    assert_eq!(refused.header("x-ratelimit-limit"), Some("1"));
    assert_eq!(refused.header("x-ratelimit-remaining"), Some("0"));

    assert_eq!(c.get(&gw.url("/plain")).await.status, 200);
    let refused = c.get(&gw.url("/plain")).await;
    assert_eq!(refused.status, 503);
    assert_eq!(refused.header("content-type"), Some("application/json"));
    let retry = refused.header_u64("retry-after");
    assert_eq!(
        refused.json(),
        serde_json::json!({
            "error": "rate_limited",
            "route": "plain",
            "policy": "per_ip",
            "retry_after_seconds": retry,
        })
    );
    assert_eq!(upstream.requests(), 2);
}

const METHODS_YAML: &str = r#"
routes:
  - name: read
    match: { path: "/users/{id}", methods: [GET] }
    respond: { body: read }
  - name: write
    match: { path: "/users/{id}", methods: [PUT, DELETE, GET] }
    respond: { body: write }
  - name: other-host
    match: { path: "/users/{id}", methods: [PATCH], host: elsewhere.example }
    respond: { body: other }
  - name: admin
    match: { prefix: /admin, methods: [POST] }
    respond: { body: admin }
"#;

#[tokio::test]
async fn a_routed_path_with_another_method_gets_405_with_allow() {
    let gw = TestGateway::start(METHODS_YAML).await;
    let c = Client::new();
    let send = |method: Method, path: &str| {
        let req = request(method, &gw.url(path)).body(empty()).unwrap();
        c.send(req)
    };

    let reply = send(Method::POST, "/users/7").await;
    assert_eq!(reply.status, 405);
    // Every route matching the path (and host), each method once, in config order.
    assert_eq!(reply.header("allow"), Some("GET, PUT, DELETE"));
    assert_eq!(reply.json()["error"], "method_not_allowed");

    let reply = send(Method::GET, "/admin/x").await;
    assert_eq!(reply.status, 405);
    assert_eq!(reply.header("allow"), Some("POST"));

    assert_eq!(send(Method::DELETE, "/users/7").await.text(), "write");
    assert_eq!(send(Method::GET, "/users/7").await.text(), "read");
    // A path no route takes is still 404.
    let reply = send(Method::POST, "/nothing").await;
    assert_eq!(reply.status, 404);
    assert_eq!(reply.header("allow"), None);

    // Two 405s and one 404, none of them a route's.
    let unmatched = gw
        .metric(
            "turnstile_requests_total",
            &[("route", "unmatched"), ("code", "4xx")],
        )
        .await;
    assert_eq!(unmatched, 3.0);
}
