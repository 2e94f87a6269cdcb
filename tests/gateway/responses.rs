//! What the gateway answers itself (issue 13): the rate-limit fields in each `rate_limit_headers`
//! dialect (draft-ietf-httpapi-ratelimit-headers-11 parsed as Structured Fields), a route's
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
    /// String parameters (`qu="concurrent-requests"`).
    strings: Vec<(String, String)>,
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
        let mut strings = Vec::new();
        while let Some(param) = rest.strip_prefix(';') {
            let end = param.find([';', ',']).unwrap_or(param.len());
            let (key, value) = param[..end]
                .split_once('=')
                .unwrap_or_else(|| panic!("parameter without value: {text}"));
            assert!(
                key.bytes().all(|b| b.is_ascii_lowercase()),
                "key `{key}`: {text}"
            );
            if let Some(string) = value.strip_prefix('"').and_then(|v| v.strip_suffix('"')) {
                strings.push((key.to_owned(), string.to_owned()));
            } else {
                let value = value
                    .parse()
                    .unwrap_or_else(|_| panic!("`{value}` is not an Integer: {text}"));
                params.push((key.to_owned(), value));
            }
            rest = &param[end..];
        }
        items.push(Item {
            name: name.to_owned(),
            params,
            strings,
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
        strings: Vec::new(),
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

/// One route per algorithm, each under `rate_limit_headers: both`, also checked through `/check`.
const ALGORITHMS_YAML: &str = r#"
server:
  rate_limit_headers: both
forward_auth:
  listen: 127.0.0.1:0
upstreams:
  up: { url: "http://$UPSTREAM" }
routes:
  - name: tb
    upstream: up
    match: { prefix: /tb }
    policies:
      - { name: tb, key: ["header:x-k"], token_bucket: { rate: 6/m, burst: 2 } }
  - name: sw
    upstream: up
    match: { prefix: /sw }
    policies:
      - { name: sw, key: ["header:x-k"], sliding_window: { limit: 2, window: 30s } }
  - name: swb
    upstream: up
    match: { prefix: /bk }
    policies:
      - { name: swb, key: ["header:x-k"], sliding_window: { limit: 2, window: 30s, buckets: 3 } }
  - name: q
    upstream: up
    match: { prefix: /q }
    policies:
      - { name: q, key: ["header:x-k"], quota: { limit: 2, per: day } }
  - name: cc
    upstream: up
    match: { prefix: /cc }
    policies:
      - { name: cc, key: ["header:x-k"], concurrency: { limit: 1 } }
"#;

/// `r` and `t` of the one `RateLimit` item of `reply`.
fn r_and_t(reply: &Reply) -> (u64, u64) {
    let (_, limit) = ietf_fields(reply);
    assert_eq!(limit.len(), 1, "{limit:?}");
    assert_eq!(limit[0].params[0].0, "r", "{limit:?}");
    assert_eq!(limit[0].params[1].0, "t", "{limit:?}");
    (limit[0].params[0].1, limit[0].params[1].1)
}

/// Regression (issue 34, item 1): a refusal said `t=20` beside `Retry-After: 1`. Under draft-11,
/// `r` is the quota available and `t` the effective window; a refusal's window is its
/// `Retry-After` (§6: never earlier than the window's end). For each algorithm, the exact fields
/// of two admitted requests and a refusal, from the gateway and from `/check` alike.
#[tokio::test]
async fn ietf_fields_per_algorithm_on_admission_and_refusal_from_every_http_door() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(ALGORITHMS_YAML, upstream.addr).await;
    let check = gw.running().forward_auth_addr.expect("check listener");
    let c = Client::new();
    for door in ["gateway", "check"] {
        let key = [("x-k", door)];
        let get = |path: &'static str| {
            let c = c.clone();
            let url = match door {
                "gateway" => gw.url(path),
                _ => format!("http://{check}/check"),
            };
            async move {
                let mut headers = key.to_vec();
                if door == "check" {
                    headers.push(("x-forwarded-uri", path));
                    headers.push(("x-forwarded-method", "GET"));
                }
                c.get_with(&url, &headers).await
            }
        };
        // Token bucket, 2 at once, one back every 10 s: `t` is the time to a full bucket, and
        // on the refusal the time until one token is back.
        let policy = ietf_fields(&get("/tb").await).0;
        assert_eq!(policy, vec![item("tb", &[("q", 2), ("w", 20)])], "{door}");
        let second = get("/tb").await;
        assert_eq!(r_and_t(&second), (0, 20), "{door}");
        assert_eq!(second.header("x-ratelimit-reset"), Some("20"), "{door}");
        let refused = get("/tb").await;
        assert_eq!(refused.status, 429, "{door}");
        assert_eq!(r_and_t(&refused), (0, 10), "{door}");
        assert_eq!(refused.header_u64("retry-after"), 10, "{door}");

        // Sliding window: 2 in any 30 s; the refusal's window ends when the oldest leaves.
        let first = get("/sw").await;
        assert_eq!(r_and_t(&first), (1, 30), "{door}");
        assert_eq!(r_and_t(&get("/sw").await), (0, 30), "{door}");
        let refused = get("/sw").await;
        assert_eq!(refused.status, 429, "{door}");
        let retry = refused.header_u64("retry-after");
        assert_eq!(r_and_t(&refused), (0, retry), "{door}");
        assert!((29..=30).contains(&retry), "{door}: {retry}");

        // Bucketed: the window ends when the oldest bucket leaves, 30 to 40 s away.
        let (r, t) = r_and_t(&get("/bk").await);
        assert_eq!(r, 1, "{door}");
        assert!((30..=40).contains(&t), "{door}: {t}");
        get("/bk").await;
        let refused = get("/bk").await;
        assert_eq!(refused.status, 429, "{door}");
        let retry = refused.header_u64("retry-after");
        assert_eq!(r_and_t(&refused), (0, retry), "{door}");
        assert!((20..=40).contains(&retry), "{door}: {retry}");

        // Calendar quota: the window is the rest of the day, admitted or refused.
        let first = get("/q").await;
        let (r, t) = r_and_t(&first);
        assert_eq!(r, 1, "{door}");
        assert_eq!(
            Some(t.to_string().as_str()),
            first.header("x-ratelimit-reset")
        );
        get("/q").await;
        let refused = get("/q").await;
        assert_eq!(refused.status, 429, "{door}");
        let retry = refused.header_u64("retry-after");
        assert_eq!(r_and_t(&refused), (0, retry), "{door}");
        assert!(retry.abs_diff(t) <= 1, "{door}: {retry} against {t}");
    }

    // Concurrency (the gateway only: the doors do not hold leases): no window, so `t` is 0 when
    // admitted, and a refusal's is its `Retry-After` of 1 s.
    let key = [("x-k", "cc")];
    let reply = c.get_with(&gw.url("/cc"), &key).await;
    let (policy, _) = ietf_fields(&reply);
    assert_eq!(policy.len(), 1);
    assert_eq!(policy[0].params, vec![("q".to_owned(), 1)]);
    assert_eq!(
        policy[0].strings,
        vec![("qu".to_owned(), "concurrent-requests".to_owned())]
    );
    assert_eq!(r_and_t(&reply), (0, 0));
    let url = gw.url("/cc");
    let base = upstream.requests();
    let held = {
        let c = c.clone();
        tokio::spawn(async move {
            c.get_with(&url, &[("x-k", "cc"), ("x-test-hold-head", "1")])
                .await
                .status
        })
    };
    upstream.wait_for_requests(base + 1).await;
    let refused = c.get_with(&gw.url("/cc"), &key).await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header_u64("retry-after"), 1);
    assert_eq!(r_and_t(&refused), (0, 1));
    upstream.release(1);
    assert_eq!(held.await.expect("held request"), 200);
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
            "request_id": refused.header("x-request-id").expect("a request id"),
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
