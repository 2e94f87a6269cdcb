//! The check endpoint called directly: the header contracts of each proxy family, `?deny_status`,
//! the client address, the failure modes, metrics, and the check-only route on the inline
//! gateway.

use std::net::SocketAddr;

use crate::support::client::get_from;
use crate::support::ingress::OTHER_CLIENT;
use crate::support::{Client, RedisServer, Reply, TestGateway};

async fn call(check: SocketAddr, query: &str, headers: &[(&str, &str)]) -> Reply {
    Client::new()
        .get_with(&format!("http://{check}/check{query}"), headers)
        .await
}

fn header<'r>(reply: &'r Reply, name: &str) -> &'r str {
    reply
        .headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_else(|| panic!("no {name} in {:?}", reply.headers))
}

/// Traefik and Caddy (`X-Forwarded-*`), nginx (`X-Original-Method`/`-URI` and `Host`) and
/// ingress-nginx (`X-Original-URL`) name the same request: one counter, one answer each.
#[tokio::test]
async fn every_proxy_family_names_the_same_request_and_counter() {
    let (_gw, check, _) = crate::turnstile().await;
    let traefik = call(
        check,
        "",
        &[
            ("x-forwarded-method", "POST"),
            ("x-forwarded-uri", "/api/users/carol?page=2"),
            ("x-forwarded-host", "shop.example"),
        ],
    )
    .await;
    assert_eq!(traefik.status, 200);
    assert!(traefik.body.is_empty(), "an allowed check has no body");
    assert_eq!(header(&traefik, "x-ratelimit-limit"), "3");
    assert_eq!(header(&traefik, "x-ratelimit-remaining"), "2");
    assert!(header(&traefik, "x-ratelimit-reset").parse::<u64>().is_ok());

    let nginx = call(
        check,
        "",
        &[
            ("x-original-method", "GET"),
            ("x-original-uri", "/api/users/carol"),
        ],
    )
    .await;
    assert_eq!(nginx.status, 200);
    assert_eq!(header(&nginx, "x-ratelimit-remaining"), "1");

    let ingress_nginx = call(
        check,
        "",
        &[("x-original-url", "https://shop.example/api/users/carol?x=1")],
    )
    .await;
    assert_eq!(ingress_nginx.status, 200);
    assert_eq!(header(&ingress_nginx, "x-ratelimit-remaining"), "0");

    let refused = call(check, "", &[("x-forwarded-uri", "/api/users/carol")]).await;
    assert_eq!(refused.status, 429);
    assert_eq!(header(&refused, "x-ratelimit-remaining"), "0");
    let retry: u64 = header(&refused, "retry-after").parse().expect("seconds");
    assert!(retry >= 1);
    assert_eq!(header(&refused, "content-type"), "application/json");
    let body: serde_json::Value = serde_json::from_slice(&refused.body).expect("JSON");
    assert_eq!(
        body,
        serde_json::json!({
            "error": "rate_limited",
            "route": "users",
            "policy": "per_user",
            "retry_after_seconds": retry,
            "request_id": header(&refused, "x-request-id"),
        }),
        "the gateway's own 429 body"
    );
}

/// `?deny_status=403` for nginx; the configured `deny_status` otherwise; a bad one is a 400.
#[tokio::test]
async fn deny_status_comes_from_the_call_or_the_config() {
    let yaml = crate::CONFIG.replace(
        "  grpc_listen: 127.0.0.1:0\n",
        "  grpc_listen: 127.0.0.1:0\n  deny_status: 403\n",
    );
    let gw = TestGateway::start(&yaml).await;
    let check = gw.running().forward_auth_addr.expect("check listener");
    let target = [("x-original-uri", "/api/users/dora")];
    for _ in 0..3 {
        assert_eq!(call(check, "?deny_status=401", &target).await.status, 200);
    }
    let configured = call(check, "", &target).await;
    assert_eq!(configured.status, 403);
    assert!(configured.headers.contains_key("retry-after"));
    let asked = call(check, "?deny_status=429", &target).await;
    assert_eq!(asked.status, 429);
    let nginx = call(check, "?x=1&deny_status=401", &target).await;
    assert_eq!(nginx.status, 401);
    for bad in ["?deny_status=200", "?deny_status=abc", "?deny_status=99999"] {
        let reply = call(check, bad, &target).await;
        assert_eq!(reply.status, 400, "{bad}");
        let body: serde_json::Value = serde_json::from_slice(&reply.body).expect("JSON");
        assert_eq!(body["error"], "bad_request");
    }
}

/// No route: nothing applies, 200 with no rate-limit headers. A call naming no request, or
/// another path than `/check`: refused.
#[tokio::test]
async fn no_route_admits_and_a_call_naming_no_request_is_a_400() {
    let (_gw, check, _) = crate::turnstile().await;
    let none = call(check, "", &[("x-forwarded-uri", "/elsewhere")]).await;
    assert_eq!(none.status, 200);
    assert!(!none.headers.contains_key("x-ratelimit-limit"));
    let missing = call(check, "", &[]).await;
    assert_eq!(missing.status, 400);
    let body = String::from_utf8_lossy(&missing.body).into_owned();
    assert!(body.contains("X-Forwarded-Uri"), "{body}");
    let absolute = call(check, "", &[("x-forwarded-uri", "http://a/api/users/x")]).await;
    assert_eq!(absolute.status, 400);
    let other = Client::new().get(&format!("http://{check}/")).await;
    assert_eq!(other.status, 404);
}

/// A `;` path parameter in the original request, raw or encoded, is refused as on the gateway: a
/// user's counter cannot be renamed with a suffix the upstream cuts off, nor `..;` step around a
/// route.
#[tokio::test]
async fn regression_path_parameters_passed_the_check() {
    let (_gw, check, _) = crate::turnstile().await;
    for uri in [
        "/api/users/carol;",
        "/api/users/carol;jsessionid=1",
        "/api/users/carol%3B",
        "/api/users/carol%3bx",
        "/api/users/x/..;/carol",
        "/api;/users/carol",
        "/api/users/.;/carol",
    ] {
        for name in ["x-forwarded-uri", "x-original-uri"] {
            let reply = call(check, "", &[(name, uri)]).await;
            assert_eq!(reply.status, 400, "{name}: {uri}");
        }
    }
    // carol's counter is untouched: the whole burst is still hers.
    let first = call(check, "", &[("x-forwarded-uri", "/api/users/carol")]).await;
    assert_eq!(first.status, 200);
    assert_eq!(header(&first, "x-ratelimit-remaining"), "2");
}

/// The original request is normalised exactly as the gateway normalises its own: dot segments,
/// doubled slashes and encoded unreserved characters all meet the same counter.
#[tokio::test]
async fn spellings_of_one_path_share_a_counter_as_on_the_gateway() {
    let (_gw, check, _) = crate::turnstile().await;
    for (uri, remaining) in [
        ("/api/users/erin", "2"),
        ("/api//users/erin", "1"),
        ("/api/x/../users/%65rin", "0"),
    ] {
        let reply = call(check, "", &[("x-forwarded-uri", uri)]).await;
        assert_eq!(reply.status, 200, "{uri}");
        assert_eq!(header(&reply, "x-ratelimit-remaining"), remaining, "{uri}");
    }
    let reply = call(check, "", &[("x-forwarded-uri", "/api/users/./erin")]).await;
    assert_eq!(reply.status, 429);
}

/// The ingress is the peer: its `X-Forwarded-For` counts only when it is trusted.
#[tokio::test]
async fn x_forwarded_for_is_believed_only_from_a_trusted_peer() {
    let (_gw, check, _) = crate::turnstile().await;
    // 127.0.0.1 is trusted: each forwarded client has its own bucket.
    for i in 0..4 {
        let client = format!("10.2.0.{i}");
        let reply = call(
            check,
            "",
            &[
                ("x-forwarded-uri", "/api/client/a"),
                ("x-forwarded-for", client.as_str()),
            ],
        )
        .await;
        assert_eq!(reply.status, 200, "{client}");
        assert_eq!(header(&reply, "x-ratelimit-remaining"), "2");
    }
    // 127.0.0.2 is not: whatever it claims, it is one client.
    let mut statuses = Vec::new();
    for i in 0..4 {
        let client = format!("10.3.0.{i}");
        let reply = get_from(
            OTHER_CLIENT,
            check,
            "/check",
            &[
                ("x-forwarded-uri", "/api/client/a"),
                ("x-forwarded-for", client.as_str()),
            ],
        )
        .await;
        statuses.push(reply.status);
    }
    assert_eq!(statuses, [200, 200, 200, 429]);
}

/// Decisions are counted in `turnstile_decisions_total` as the gateway's are, and each answer in
/// `turnstile_door_checks_total{door="forward_auth"}`.
#[tokio::test]
async fn checks_are_counted_as_decisions_and_by_door() {
    let (gw, check, _) = crate::turnstile().await;
    let target = [("x-forwarded-uri", "/api/users/fay")];
    for _ in 0..4 {
        call(check, "", &target).await;
    }
    call(check, "", &[("x-forwarded-uri", "/nowhere")]).await;
    call(check, "", &[]).await;
    let decisions = |d: &'static str| [("route", "users"), ("policy", "per_user"), ("decision", d)];
    assert_eq!(
        gw.metric("turnstile_decisions_total", &decisions("allowed"))
            .await,
        3.0
    );
    assert_eq!(
        gw.metric("turnstile_decisions_total", &decisions("limited"))
            .await,
        1.0
    );
    for (result, n) in [
        ("allowed", 3.0),
        ("limited", 1.0),
        ("no_route", 1.0),
        ("bad_request", 1.0),
        ("failed_open", 0.0),
    ] {
        let labels = [("door", "forward_auth"), ("result", result)];
        assert_eq!(
            gw.metric("turnstile_door_checks_total", &labels).await,
            n,
            "{result}"
        );
    }
}

/// Store down: a route failing open admits (200, no headers); one failing closed answers 503
/// with `Retry-After`.
#[tokio::test]
async fn store_down_follows_each_routes_failure_mode() {
    let mut redis = RedisServer::start();
    let yaml = format!(
        r#"
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
store: {{ type: redis, url: "{}", timeout: 200ms }}
forward_auth: {{ listen: 127.0.0.1:0 }}
routes:
  - name: open
    match: {{ prefix: /open }}
    failure_mode: open
    policies:
      - {{ name: p, key: [method], token_bucket: {{ rate: 1/h, burst: 3 }} }}
  - name: closed
    match: {{ prefix: /closed }}
    failure_mode: closed
    policies:
      - {{ name: p, key: [method], token_bucket: {{ rate: 1/h, burst: 3 }} }}
"#,
        redis.url()
    );
    let gw = TestGateway::start(&yaml).await;
    let check = gw.running().forward_auth_addr.expect("check listener");
    let up = call(check, "", &[("x-forwarded-uri", "/closed")]).await;
    assert_eq!(up.status, 200, "the store answers");
    redis.kill();
    let open = call(check, "", &[("x-forwarded-uri", "/open")]).await;
    assert_eq!(open.status, 200);
    assert!(!open.headers.contains_key("x-ratelimit-remaining"));
    let closed = call(check, "", &[("x-forwarded-uri", "/closed")]).await;
    assert_eq!(closed.status, 503);
    assert!(closed.headers.contains_key("retry-after"));
    let body: serde_json::Value = serde_json::from_slice(&closed.body).expect("JSON");
    assert_eq!(body["error"], "rate_limit_store_unavailable");
    let labels = |r| [("door", "forward_auth"), ("result", r)];
    assert_eq!(
        gw.metric("turnstile_door_checks_total", &labels("failed_open"))
            .await,
        1.0
    );
    assert_eq!(
        gw.metric("turnstile_door_checks_total", &labels("failed_closed"))
            .await,
        1.0
    );
}

/// A check-only route reached through the inline gateway: a clear 500, and no token spent.
#[tokio::test]
async fn the_inline_gateway_answers_a_check_only_route_with_a_500_and_spends_nothing() {
    let (gw, check, _) = crate::turnstile().await;
    let reply = Client::new().get(&gw.url("/api/users/gus")).await;
    assert_eq!(reply.status, 500);
    let body: serde_json::Value = serde_json::from_slice(&reply.body).expect("JSON");
    assert_eq!(body["error"], "check_only_route");
    assert_eq!(body["route"], "users");
    let first = call(check, "", &[("x-forwarded-uri", "/api/users/gus")]).await;
    assert_eq!(header(&first, "x-ratelimit-remaining"), "2");
}

/// `turnstile check` accepts the vocabulary as the issue writes it and warns about a check-only
/// route; a bad `deny_status` or a `forward_auth` with no listener is an error naming the field.
#[test]
fn check_warns_about_check_only_routes_and_names_bad_fields() {
    let good = r#"
forward_auth:
  listen: 127.0.0.1:8082
  grpc_listen: 127.0.0.1:8083
  deny_status: 429
routes:
  - name: users
    match:
      path: /api/users/{user_id}
    policies:
      - name: per_user
        key: [path:user_id]
        token_bucket: { rate: 10/s, burst: 20 }
"#;
    let (_dir, path) = crate::support::process::config_file(good);
    let (code, _out, err) = crate::support::process::check(&path);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("warning:"), "{err}");
    assert!(err.contains("check-only"), "{err}");
    assert!(
        err.contains(":7:9:"),
        "the warning names the route's line: {err}"
    );

    let bad = "forward_auth:\n  deny_status: 200\n";
    let (_dir, path) = crate::support::process::config_file(bad);
    let (code, _out, err) = crate::support::process::check(&path);
    assert_eq!(code, Some(1));
    assert!(err.contains("forward_auth.deny_status"), "{err}");
    assert!(err.contains("needs `listen"), "{err}");
}

/// Envoy ext_authz called directly: OK with the headers for the upstream (overwriting the
/// client's), then a denied response with 429, `Retry-After`, `X-RateLimit-*` and the JSON body.
/// Its connection is counted in `turnstile_open_connections{listener="ext_authz"}` while open, and
/// each answer in `turnstile_requests_total` by the status it carries (regression: neither was).
#[tokio::test]
async fn ext_authz_answers_ok_with_headers_then_denied_with_the_gateways_body() {
    use envoy_types::pb::envoy::config::core::v3::address::Address as Kind;
    use envoy_types::pb::envoy::config::core::v3::{Address, SocketAddress};
    use envoy_types::pb::envoy::service::auth::v3::attribute_context::{
        HttpRequest, Peer, Request,
    };
    use envoy_types::pb::envoy::service::auth::v3::authorization_client::AuthorizationClient;
    use envoy_types::pb::envoy::service::auth::v3::check_response::HttpResponse;
    use envoy_types::pb::envoy::service::auth::v3::{AttributeContext, CheckRequest};

    let (gw, _, grpc) = crate::turnstile().await;
    let mut client = AuthorizationClient::connect(format!("http://{grpc}"))
        .await
        .expect("connect");
    let check = || CheckRequest {
        attributes: Some(AttributeContext {
            source: Some(Peer {
                address: Some(Address {
                    address: Some(Kind::SocketAddress(SocketAddress {
                        address: "10.0.0.7".into(),
                        ..Default::default()
                    })),
                }),
                ..Default::default()
            }),
            request: Some(Request {
                http: Some(HttpRequest {
                    method: "GET".into(),
                    path: "/api/users/hal?x=1".into(),
                    host: "shop.example".into(),
                    headers: [
                        (":path".to_string(), "/ignored".to_string()),
                        ("x-ratelimit-remaining".to_string(), "999".to_string()),
                    ]
                    .into_iter()
                    .collect(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
    };
    for remaining in ["2", "1", "0"] {
        let response = client.check(check()).await.expect("Check").into_inner();
        assert_eq!(response.status.as_ref().map(|s| s.code), Some(0));
        let Some(HttpResponse::OkResponse(ok)) = response.http_response else {
            panic!("an ok_response: {response:?}");
        };
        let header = |name: &str| {
            ok.headers
                .iter()
                .filter_map(|h| h.header.as_ref())
                .find(|h| h.key == name)
                .map(|h| h.value.clone())
        };
        assert_eq!(header("x-ratelimit-remaining").as_deref(), Some(remaining));
        assert_eq!(header("x-ratelimit-limit").as_deref(), Some("3"));
        assert!(ok.headers.iter().all(|h| h.append_action == 2), "overwrite");
    }
    let response = client.check(check()).await.expect("Check").into_inner();
    assert_ne!(response.status.as_ref().map(|s| s.code), Some(0));
    let Some(HttpResponse::DeniedResponse(denied)) = response.http_response else {
        panic!("a denied_response: {response:?}");
    };
    assert_eq!(denied.status.map(|s| s.code), Some(429));
    let keys: Vec<&str> = denied
        .headers
        .iter()
        .filter_map(|h| h.header.as_ref().map(|h| h.key.as_str()))
        .collect();
    for name in ["retry-after", "x-ratelimit-remaining", "content-type"] {
        assert!(keys.contains(&name), "{name} in {keys:?}");
    }
    let body: serde_json::Value = serde_json::from_str(&denied.body).expect("JSON");
    assert_eq!(body["error"], "rate_limited");
    assert_eq!(body["route"], "users");

    wait_for_open(&gw, "ext_authz", 1.0).await;
    for (code, n) in [("2xx", 3.0), ("429", 1.0), ("4xx", 0.0)] {
        let labels = [("route", "users"), ("code", code)];
        assert_eq!(
            gw.metric("turnstile_requests_total", &labels).await,
            n,
            "{code}"
        );
    }
    drop(client);
    wait_for_open(&gw, "ext_authz", 0.0).await;
}

/// `exempt:` applies to the door as to the gateway: an exempt request is admitted without
/// consuming anything or carrying rate-limit headers.
#[tokio::test]
async fn exempt_requests_pass_the_door_without_consuming() {
    let yaml = format!(
        "{}exempt:\n  headers:\n    x-internal: \"yes\"\n",
        crate::CONFIG
    );
    let gw = TestGateway::start(&yaml).await;
    let check = gw.running().forward_auth_addr.expect("check listener");
    for _ in 0..5 {
        let reply = call(
            check,
            "",
            &[("x-forwarded-uri", "/api/users/ivy"), ("x-internal", "yes")],
        )
        .await;
        assert_eq!(reply.status, 200);
        assert!(!reply.headers.contains_key("x-ratelimit-remaining"));
    }
    let counted = call(check, "", &[("x-forwarded-uri", "/api/users/ivy")]).await;
    assert_eq!(
        header(&counted, "x-ratelimit-remaining"),
        "2",
        "nothing was consumed"
    );
}

/// The door writes the route's `rate_limit_headers` and `limited_response` as the gateway does
/// (the status stays the door's `deny_status`), counts shadow policies without refusing, and lets
/// a method no route takes through as "no route": the ingress, not the limiter, routes.
#[tokio::test]
async fn the_door_answers_in_the_routes_dialect_and_passes_a_method_mismatch() {
    let yaml = format!(
        "server:\n  rate_limit_headers: both\n  limited_response: {{ status: 503, body: 'slow: \
         {{policy}} {{retry_after}}' }}\n{}  - name: reads\n    match: {{ prefix: /api/reads, \
         methods: [GET] }}\n    policies:\n      - {{ name: per_client, key: [client_ip], \
         token_bucket: {{ rate: 1/h, burst: 2 }} }}\n      - {{ name: trial, key: [client_ip], \
         mode: shadow, token_bucket: {{ rate: 1/h, burst: 1 }} }}\n",
        crate::CONFIG
    );
    let gw = TestGateway::start(&yaml).await;
    let check = gw.running().forward_auth_addr.expect("check listener");
    let read = [
        ("x-forwarded-method", "GET"),
        ("x-forwarded-uri", "/api/reads/1"),
    ];
    for remaining in ["1", "0"] {
        let reply = call(check, "", &read).await;
        assert_eq!(reply.status, 200);
        assert_eq!(header(&reply, "x-ratelimit-remaining"), remaining);
        assert_eq!(
            header(&reply, "ratelimit-policy"),
            "\"per_client\";q=2;w=7200"
        );
        assert_eq!(
            header(&reply, "ratelimit"),
            format!(
                "\"per_client\";r={remaining};t={}",
                3600 * (2 - remaining.parse::<u64>().unwrap())
            )
        );
    }
    let refused = call(check, "", &read).await;
    assert_eq!(refused.status, 429, "the door's deny_status");
    let retry: u64 = header(&refused, "retry-after").parse().expect("seconds");
    assert_eq!(
        String::from_utf8_lossy(&refused.body),
        format!("slow: per_client {retry}")
    );
    assert_eq!(
        header(&refused, "content-type"),
        "text/plain; charset=utf-8"
    );
    assert!(header(&refused, "ratelimit").starts_with("\"per_client\";r=0;"));

    let post = [
        ("x-forwarded-method", "POST"),
        ("x-forwarded-uri", "/api/reads/1"),
    ];
    let mismatch = call(check, "", &post).await;
    assert_eq!(mismatch.status, 200, "no route: the door admits");
    assert!(!mismatch.headers.contains_key("ratelimit"));

    let text = gw.metrics().await;
    let decisions = |policy: &str, d: &str| {
        crate::support::metric(
            &text,
            "turnstile_decisions_total",
            &[("route", "reads"), ("policy", policy), ("decision", d)],
        )
    };
    assert_eq!(decisions("per_client", "allowed"), Some(2.0));
    assert_eq!(decisions("per_client", "limited"), Some(1.0));
    assert_eq!(decisions("trial", "allowed"), Some(1.0));
    assert_eq!(decisions("trial", "shadow"), Some(2.0));
}

/// forward-auth never sees the response: it does not apply concurrency policies (no lease could
/// ever be released), and charges a cost from the response as its `fallback`, up front (issue 15).
#[tokio::test]
async fn forward_auth_skips_concurrency_and_charges_the_fallback_cost() {
    let yaml = r#"
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
forward_auth: { listen: 127.0.0.1:0 }
routes:
  - name: llm
    respond: { status: 200 }
    policies:
      - { name: inflight, key: [method], concurrency: { limit: 1 } }
      - name: tokens
        key: [method]
        token_bucket: { rate: 1/d, burst: 10 }
        cost: { response_header: x-usage-tokens, fallback: 3 }
"#;
    let gw = TestGateway::start(yaml).await;
    let check = gw.running().forward_auth_addr.expect("check listener");
    for remaining in ["7", "4", "1"] {
        let reply = call(check, "", &[("x-forwarded-uri", "/v1/chat")]).await;
        assert_eq!(reply.status, 200, "a concurrency limit of 1 is not applied");
        assert_eq!(header(&reply, "x-ratelimit-remaining"), remaining);
    }
    let refused = call(check, "", &[("x-forwarded-uri", "/v1/chat")]).await;
    assert_eq!(refused.status, 429, "3 tokens needed, 1 left");
    let body: serde_json::Value = serde_json::from_slice(&refused.body).expect("JSON");
    assert_eq!(body["policy"], "tokens");
}

/// Polls `turnstile_open_connections{listener}` until it reads `want` (bounded by `LIVENESS`).
async fn wait_for_open(gw: &TestGateway, listener: &str, want: f64) {
    let deadline = std::time::Instant::now() + crate::support::LIVENESS;
    loop {
        let now = gw
            .metric("turnstile_open_connections", &[("listener", listener)])
            .await;
        if now == want {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "open connections on {listener}: {now}, expected {want}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Regression: the check listener's connections were in no `turnstile_open_connections` series
/// and its calls in no `turnstile_requests_total` series. Its connections are now counted under
/// `listener="forward_auth"`, apart from the public listener's, and each call under the route it
/// names (or `unmatched`) by the status class of its answer.
#[tokio::test]
async fn check_connections_and_calls_are_counted() {
    let (gw, check, _) = crate::turnstile().await;
    let held: Vec<tokio::net::TcpStream> = {
        let mut held = Vec::new();
        for _ in 0..2 {
            held.push(
                tokio::net::TcpStream::connect(check)
                    .await
                    .expect("connect"),
            );
        }
        held
    };
    let public = tokio::net::TcpStream::connect(gw.public)
        .await
        .expect("connect");
    wait_for_open(&gw, "forward_auth", 2.0).await;
    wait_for_open(&gw, "public", 1.0).await;
    drop(held);
    drop(public);
    wait_for_open(&gw, "forward_auth", 0.0).await;
    wait_for_open(&gw, "public", 0.0).await;

    let target = [("x-forwarded-uri", "/api/users/gil")];
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(call(check, "", &target).await.status);
    }
    assert_eq!(statuses, [200, 200, 200, 429]);
    assert_eq!(
        call(check, "", &[("x-forwarded-uri", "/nowhere")])
            .await
            .status,
        200
    );
    assert_eq!(call(check, "", &[]).await.status, 400);
    let other = Client::new()
        .get(&format!("http://{check}/elsewhere"))
        .await;
    assert_eq!(other.status, 404);
    for (route, code, n) in [
        ("users", "2xx", 3.0),
        ("users", "429", 1.0),
        ("users", "4xx", 0.0),
        ("unmatched", "2xx", 1.0),
        ("unmatched", "4xx", 2.0),
        ("unmatched", "429", 0.0),
    ] {
        assert_eq!(
            gw.metric(
                "turnstile_requests_total",
                &[("route", route), ("code", code)]
            )
            .await,
            n,
            "{route} {code}"
        );
    }
    wait_for_open(&gw, "forward_auth", 0.0).await;
}
