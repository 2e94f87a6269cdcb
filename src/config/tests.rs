use std::path::Path;

use super::*;

fn errors(yaml: &str) -> Vec<String> {
    match parse(yaml, Path::new("p.yaml")) {
        Ok(_) => panic!("expected errors for:\n{yaml}"),
        Err(e) => e.0.iter().map(ToString::to_string).collect(),
    }
}

const BASE: &str = "upstreams:\n  api:\n    url: http://127.0.0.1:3000\nroutes:\n";
/// A route for [`BASE`], for tests about something else: a file with no routes is an error.
const ROUTE: &str = "  - name: a\n    upstream: api\n";

#[test]
fn the_shipped_policies_file_loads() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("policies.yaml");
    let snapshot = load(&path).unwrap_or_else(|e| panic!("{e}"));
    assert!(snapshot
        .routes
        .iter()
        .any(|r| matches!(r.action, Action::Respond(_))));
}

#[test]
fn unknown_fields_are_errors_with_their_line() {
    let yaml = format!("{BASE}  - name: a\n    upstream: api\n    polices: []\n");
    let e = errors(&yaml);
    assert_eq!(e.len(), 1);
    assert!(
        e[0].starts_with("p.yaml:7:5: routes[0]: unknown field `polices`"),
        "{}",
        e[0]
    );
    assert!(
        e[0].contains("expected one of"),
        "says what is allowed: {}",
        e[0]
    );
}

#[test]
fn type_errors_name_the_field() {
    let yaml = format!("{BASE}  - name: a\n    upstream: api\n    policies:\n      - name: p\n        key: [client_ip]\n        token_bucket: {{ rate: 1/s, burst: lots }}\n");
    let e = errors(&yaml);
    assert!(e[0].starts_with("p.yaml:10:"), "{}", e[0]);
    assert!(
        e[0].contains("routes[0].policies[0].token_bucket.burst"),
        "{}",
        e[0]
    );
}

#[test]
fn semantic_errors_are_all_reported_with_positions() {
    let yaml = format!(
        "{BASE}  - name: a\n    upstream: nope\n    policies:\n      - name: p\n        key: [path:id, cookie]\n        token_bucket: {{ rate: 10/w, burst: 5 }}\n"
    );
    let e = errors(&yaml);
    let expected = [
        "p.yaml:6:15: routes[0].upstream: `nope` is not defined under `upstreams` (defined: api)",
        "p.yaml:9:15: routes[0].policies[0].key[0]: `path:id`: the route's `match.path` has no parameters; add `{id}` to it",
        "p.yaml:9:24: routes[0].policies[0].key[1]: `cookie`: key parts are client_ip, header:NAME, path:PARAM, query:NAME, method, host, jwt:CLAIM, body:FIELD (or body:/json/pointer), client_cert:FIELD",
        "p.yaml:10:31: routes[0].policies[0].token_bucket.rate: `10/w` has an unknown unit `w`; expected N/s, N/m, N/h or N/d with N > 0 (e.g. 10/s, 0.5/s, 100/m), at least one a year (0.00274/d)",
    ];
    assert_eq!(e, expected);
}

#[test]
fn conflicting_and_missing_choices_are_explained() {
    let yaml = format!("{BASE}  - name: a\n    upstream: api\n    respond: {{ status: 200 }}\n  - name: a\n    upstream: api\n    policies:\n      - name: p\n        key: [client_ip]\n");
    let e = errors(&yaml);
    assert!(
        e.iter()
            .any(|m| m.contains("routes[0]: give either `upstream` or `respond`")),
        "{e:?}"
    );
    assert!(
        e.iter()
            .any(|m| m.contains("routes[1].name: `a` is already the name of routes[0]")),
        "{e:?}"
    );
    assert!(
        e.iter()
            .any(|m| m.contains("routes[1].policies[0]: needs `token_bucket")),
        "{e:?}"
    );
}

#[test]
fn cost_above_capacity_is_rejected() {
    let yaml = format!("{BASE}  - name: a\n    upstream: api\n    policies:\n      - name: p\n        key: [client_ip]\n        cost: 6\n        sliding_window: {{ limit: 5, window: 1s }}\n");
    let e = errors(&yaml);
    assert!(
        e[0].contains("routes[0].policies[0].cost: 6 is more than the limit (5)"),
        "{e:?}"
    );
}

#[test]
fn bad_yaml_reports_the_parser_position() {
    let e = errors("routes:\n  - name: [unclosed\n");
    assert!(e[0].starts_with("p.yaml:"), "{e:?}");
    assert!(!e[0].starts_with("p.yaml:1:1:"), "a real position: {e:?}");
    assert!(
        !e[0].contains(" at line "),
        "the position is said once: {e:?}"
    );
}

#[test]
fn admin_listener_must_not_share_the_public_one() {
    let e = errors(&format!(
        "listen: 127.0.0.1:8080\nadmin_listen: 127.0.0.1:8080\n{BASE}  - name: a\n    upstream: api\n"
    ));
    assert_eq!(e, ["p.yaml:2:15: admin_listen: must differ from `listen`: the admin endpoints never share the public listener"]);
}

#[test]
fn a_valid_config_compiles_to_runtime_types() {
    let yaml = format!("{BASE}  - name: a\n    match: {{ path: \"/u/{{id}}\", methods: [get] }}\n    upstream: api\n    failure_mode: closed\n    policies:\n      - name: p\n        key: [path:id]\n        sliding_window: {{ limit: 5, window: 1m, buckets: 60 }}\n");
    let s = parse(&yaml, Path::new("p.yaml")).unwrap();
    let route = &s.routes[0];
    assert_eq!(route.failure_mode, FailureMode::Closed);
    assert_eq!(
        route.policies[0].rule,
        crate::limiter::Rule::SlidingWindow(crate::limiter::SlidingWindow {
            limit: 5,
            window_us: 60_000_000,
            buckets: 60
        })
    );
    assert_eq!(route.policies[0].key, [crate::keys::KeyPart::PathParam(0)]);
}

#[test]
fn redis_settings_are_validated_without_echoing_the_url() {
    let yaml = format!(
        "store:\n  type: redis\n  url: redis://user:s3cret@127.0.0.1:notaport\n  key_prefix: \"a{{b}}:\"\n{BASE}{ROUTE}"
    );
    let e = errors(&yaml);
    assert_eq!(e.len(), 2, "{e:?}");
    assert!(
        e[0].starts_with("p.yaml:3:8: store.url: is not a valid Redis URL"),
        "{}",
        e[0]
    );
    assert!(!e[0].contains("s3cret"), "the password leaked: {}", e[0]);
    assert!(
        e[1].starts_with("p.yaml:4:15: store.key_prefix: must not contain"),
        "{}",
        e[1]
    );
}

#[test]
fn rediss_urls_are_accepted() {
    let yaml =
        format!("store:\n  type: redis\n  url: rediss://user:pw@127.0.0.1:6380\n{BASE}{ROUTE}");
    parse(&yaml, Path::new("p.yaml")).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn a_redis_store_compiles() {
    let yaml = format!(
        "store:\n  type: redis\n  url: redis://:pw@127.0.0.1:6390/2\n  pool_size: 8\n  timeout: 20ms\n  failure_mode: closed\n  key_prefix: \"gw:\"\n{BASE}{ROUTE}"
    );
    let snapshot = parse(&yaml, Path::new("p.yaml")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        snapshot.store,
        StoreSettings::Redis {
            target: crate::limiter::redis::Target::Url("redis://:pw@127.0.0.1:6390/2".to_string()),
            pool_size: 8,
            timeout: std::time::Duration::from_millis(20),
            key_prefix: "gw:".to_string(),
        }
    );
    assert_eq!(snapshot.failure_mode, FailureMode::Closed);
}

#[test]
fn exempt_merges_the_global_list_into_each_route_and_locates_bad_entries() {
    let yaml = format!(
        "exempt:\n  client_ips: [10.0.0.0/8]\n{BASE}  - name: a\n    upstream: api\n    exempt:\n      client_ips: [192.0.2.7]\n      headers: {{ x-internal: \"yes\" }}\n  - name: b\n    upstream: api\n"
    );
    let snapshot = parse(&yaml, Path::new("p.yaml")).unwrap_or_else(|e| panic!("{e}"));
    let ips = |r: &Route| {
        r.exempt
            .client_ips
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
    };
    assert_eq!(ips(&snapshot.routes[0]), ["10.0.0.0/8", "192.0.2.7/32"]);
    assert_eq!(snapshot.routes[0].exempt.headers.len(), 1);
    assert_eq!(ips(&snapshot.routes[1]), ["10.0.0.0/8"]);
    assert!(snapshot.routes[1].exempt.headers.is_empty());

    let bad = format!("exempt:\n  client_ips: [10.0.0.0/33]\n{BASE}  - name: a\n    upstream: api\n    exempt:\n      headers: {{ \"bad name\": x }}\n");
    let e = errors(&bad);
    assert_eq!(e.len(), 2, "{e:?}");
    assert!(e[0].starts_with("p.yaml:2:"), "{}", e[0]);
    assert!(
        e[0].contains("exempt.client_ips[0]: `10.0.0.0/33` is not an IP address"),
        "{}",
        e[0]
    );
    assert!(
        e[1].contains("routes[0].exempt.headers.bad name: `bad name` is not a header name"),
        "{}",
        e[1]
    );
}

/// One route with one policy whose body (indented eight spaces) is `policy`; the errors it gives.
fn policy_errors(policy: &str) -> Vec<String> {
    errors(&format!(
        "{BASE}  - name: a\n    upstream: api\n    policies:\n      - name: p\n        key: [client_ip]\n{policy}"
    ))
}

const NO_ROUTES: &str = "routes: no routes: every request would get 404 and no limit would apply; define at least one route (only a file that configures `rls:` or `rlqs:` may have none)";

#[test]
fn an_empty_or_comment_only_file_is_an_error() {
    // A truncated, non-atomic write leaves exactly this; serving it would drop every limit.
    for yaml in ["", "\n", "# policies.yaml\n# (nothing yet)\n", "---\n"] {
        assert_eq!(
            errors(yaml),
            [format!("p.yaml:1:1: {NO_ROUTES}")],
            "{yaml:?}"
        );
    }
}

#[test]
fn a_file_with_no_routes_is_an_error_at_routes() {
    let e = errors(&format!("{BASE}  []\n").replace("routes:\n  []", "routes: []"));
    assert_eq!(e, [format!("p.yaml:4:9: {NO_ROUTES}")]);
    let e = errors("upstreams:\n  api:\n    url: http://127.0.0.1:3000\n");
    assert_eq!(e, [format!("p.yaml:1:1: {NO_ROUTES}")]);
}

#[test]
fn the_envoy_service_alone_needs_no_routes() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir(dir.path().join("rls")).expect("mkdir");
    std::fs::write(
        dir.path().join("rls/config.yaml"),
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: { unit: second, requests_per_unit: 1 }\n",
    )
    .expect("write rls config");
    let path = dir.path().join("p.yaml");
    std::fs::write(&path, "rls:\n  listen: 127.0.0.1:0\n  config: ./rls\n").expect("write");
    match load(&path) {
        Ok(s) => assert!(s.routes.is_empty() && s.rls.is_some()),
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn a_window_that_overflows_microseconds_is_rejected() {
    // It used to wrap to about 384 µs.
    let e = policy_errors("        sliding_window: { limit: 5, window: 18446744073709552ms }\n");
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(
        e[0].starts_with("p.yaml:10:45: routes[0].policies[0].sliding_window.window: `18446744073709552ms` is too long;")
            && e[0].ends_with("at most 365d"),
        "{e:?}"
    );
    let e = policy_errors("        sliding_window: { limit: 5, window: 366d }\n");
    assert!(e[0].contains("window: `366d` is too long"), "{e:?}");
    policy_ok("        sliding_window: { limit: 5, window: 365d }\n");
}

#[test]
fn cost_zero_is_rejected() {
    let e = policy_errors("        cost: 0\n        token_bucket: { rate: 1/s, burst: 5 }\n");
    assert_eq!(
        e,
        ["p.yaml:10:15: routes[0].policies[0].cost: must be at least 1 (and at most the burst or limit)"]
    );
}

#[test]
fn a_rate_so_slow_that_retry_after_overflows_is_rejected() {
    // `1e-30/s` gave `Retry-After: 18446744073710`.
    let e = policy_errors("        token_bucket: { rate: 1e-30/s, burst: 5 }\n");
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(
        e[0].starts_with(
            "p.yaml:10:31: routes[0].policies[0].token_bucket.rate: `1e-30/s` is too slow;"
        ) && e[0].contains("at least one a year (0.00274/d)"),
        "{e:?}"
    );
    policy_ok("        token_bucket: { rate: 0.00274/d, burst: 1 }\n");
}

#[test]
fn a_bucket_that_takes_more_than_a_century_to_refill_is_rejected() {
    // One a year (the slowest rate) with a burst of 101: 101 years from empty.
    let e = policy_errors("        token_bucket: { rate: 0.00274/d, burst: 101 }\n");
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(
        e[0].starts_with("p.yaml:10:23: routes[0].policies[0].token_bucket: burst / rate is 3184817518 s: the bucket must refill from empty within 100 years"),
        "{e:?}"
    );
    policy_ok("        token_bucket: { rate: 1/d, burst: 36500 }\n");
    policy_ok("        token_bucket: { rate: 1/d, burst: 1000 }\n");
}

#[test]
fn zero_burst_and_limit_are_rejected() {
    let e = policy_errors("        token_bucket: { rate: 1/s, burst: 0 }\n");
    assert_eq!(
        e,
        ["p.yaml:10:43: routes[0].policies[0].token_bucket.burst: must be at least 1"]
    );
    let e = policy_errors("        sliding_window: { limit: 0, window: 1s }\n");
    assert_eq!(
        e,
        ["p.yaml:10:34: routes[0].policies[0].sliding_window.limit: must be at least 1"]
    );
}

#[test]
fn zero_timeouts_that_break_serving_are_rejected() {
    let yaml = "server:\n  header_read_timeout: 0ms\n  shutdown_grace: 0s\nupstreams:\n  api:\n    url: http://127.0.0.1:3000\n    connect_timeout: 0s\n    timeout: 0ms\nroutes:\n  - name: a\n    upstream: api\n";
    let e = errors(yaml);
    assert_eq!(
        e,
        [
            "p.yaml:2:24: server.header_read_timeout: must be more than 0ms (and at most 365d)",
            "p.yaml:7:22: upstreams.api.connect_timeout: must be more than 0ms (and at most 365d)",
            "p.yaml:8:14: upstreams.api.timeout: must be more than 0ms (and at most 365d)",
        ],
        "shutdown_grace: 0 is allowed (stop at once)"
    );
}

#[test]
fn overlong_durations_and_sizes_are_rejected_everywhere() {
    let yaml = format!(
        "server:\n  max_body_size: 18446744073709551615GiB\n  shutdown_grace: 18446744073709551615d\nstore:\n  max_keys: 18446744073709551615\n{BASE}  - name: a\n    upstream: api\n"
    );
    let e = errors(&yaml);
    assert_eq!(e.len(), 3, "{e:?}");
    assert!(
        e[0].starts_with("p.yaml:5:13: store.max_keys: must be between 1 and 1000000000"),
        "{e:?}"
    );
    assert!(
        e[1].starts_with(
            "p.yaml:2:18: server.max_body_size: `18446744073709551615GiB` is too large"
        ),
        "{e:?}"
    );
    assert!(
        e[2].starts_with("p.yaml:3:19: server.shutdown_grace: `18446744073709551615d` is too long"),
        "{e:?}"
    );
}

#[test]
fn admin_settings_default_to_hiding_key_values() {
    let yaml = format!("{BASE}  - name: a\n    upstream: api\n");
    let s = parse(&yaml, Path::new("p.yaml")).unwrap_or_else(|e| panic!("{e}"));
    assert!(!s.admin.show_key_values);
    let s = parse(
        &format!("admin:\n  show_key_values: true\n{yaml}"),
        Path::new("p.yaml"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(s.admin.show_key_values);
}

fn policy_ok(policy: &str) {
    let yaml = format!(
        "{BASE}  - name: a\n    upstream: api\n    policies:\n      - name: p\n        key: [client_ip]\n{policy}"
    );
    parse(&yaml, Path::new("p.yaml")).unwrap_or_else(|e| panic!("{e}"));
}

const ONE_ROUTE: &str = "routes:\n  - name: a\n    upstream: api\n";

#[test]
fn listener_and_upstream_bounds_have_safe_defaults() {
    let yaml = format!("{BASE}{}", &ONE_ROUTE["routes:\n".len()..]);
    let snapshot = parse(&yaml, Path::new("p.yaml")).unwrap_or_else(|e| panic!("{e}"));
    let server = &snapshot.server;
    assert_eq!(server.body_read_timeout, std::time::Duration::from_secs(30));
    assert_eq!(server.max_connections, 4096);
    assert_eq!(server.max_header_size, 32 * 1024);
    assert_eq!(server.allowed_upgrades, ["websocket"]);
    let Action::Forward(upstream) = &snapshot.routes[0].action else {
        panic!("forwarding route expected");
    };
    assert_eq!(upstream.max_connections, 1024);
    assert_eq!(upstream.pool_timeout, std::time::Duration::from_secs(5));
}

#[test]
fn listener_and_upstream_bounds_out_of_range_are_errors() {
    let yaml = format!(
        "server:\n  body_read_timeout: 0ms\n  max_connections: 0\n  max_header_size: 4KiB\n  \
         allowed_upgrades: [WebSocket, \"h2 c\"]\nupstreams:\n  api:\n    url: http://127.0.0.1:3000\n    \
         max_connections: 0\n    pool_timeout: 0s\n{ONE_ROUTE}"
    );
    let e = errors(&yaml);
    let expected = [
        "server.body_read_timeout: must be more than 0ms",
        "server.max_connections: must be between 1 and 1000000",
        "server.max_header_size: must be between 8KiB and 1MiB",
        "server.allowed_upgrades[1]: `h2 c` is not a protocol name",
        "upstreams.api.max_connections: must be between 1 and 65535",
        "upstreams.api.pool_timeout: must be more than 0ms",
    ];
    assert_eq!(e.len(), expected.len(), "{e:#?}");
    for want in expected {
        assert!(e.iter().any(|line| line.contains(want)), "{want} in {e:#?}");
    }
}

#[test]
fn cluster_and_sentinel_stores_compile() {
    use crate::limiter::redis::{Auth, Target};
    let yaml = format!(
        "store:\n  type: redis\n  cluster: [10.0.0.1:6379, \"[::1]:7000\"]\n  password: pw\n{BASE}{ROUTE}"
    );
    let snapshot = parse(&yaml, Path::new("p.yaml")).unwrap_or_else(|e| panic!("{e}"));
    let StoreSettings::Redis { target, .. } = snapshot.store else {
        panic!("not redis");
    };
    assert_eq!(
        target,
        Target::Cluster {
            nodes: vec!["10.0.0.1:6379".into(), "[::1]:7000".into()],
            auth: Auth {
                username: None,
                password: Some("pw".into())
            },
        }
    );
    let yaml = format!(
        "store:\n  type: redis\n  sentinel: {{ service: mymaster, nodes: [10.0.0.5:26379] }}\n{BASE}{ROUTE}"
    );
    let snapshot = parse(&yaml, Path::new("p.yaml")).unwrap_or_else(|e| panic!("{e}"));
    let StoreSettings::Redis { target, .. } = snapshot.store else {
        panic!("not redis");
    };
    assert!(
        matches!(target, Target::Sentinel { ref service, ref nodes, .. }
        if service == "mymaster" && nodes == &["10.0.0.5:26379".to_string()])
    );
}

#[test]
fn bad_cluster_and_sentinel_stores_are_errors_with_their_field() {
    let e = errors(&format!(
        "store:\n  type: redis\n  cluster: [10.0.0.1:6379, nope]\n{BASE}{ROUTE}"
    ));
    assert!(
        e.iter()
            .any(|e| e.contains("store.cluster[1]") && e.contains("host:port")),
        "{e:?}"
    );
    let e = errors(&format!(
        "store:\n  type: redis\n  url: redis://a\n  cluster: [a:1]\n{BASE}{ROUTE}"
    ));
    assert!(
        e.iter()
            .any(|e| e.contains("store.cluster") && e.contains("only one")),
        "{e:?}"
    );
    let e = errors(&format!(
        "store:\n  type: redis\n  sentinel: {{ service: \"\", nodes: [] }}\n{BASE}{ROUTE}"
    ));
    assert!(
        e.iter().any(|e| e.contains("store.sentinel.service")),
        "{e:?}"
    );
    assert!(
        e.iter().any(|e| e.contains("store.sentinel.nodes")),
        "{e:?}"
    );
    let e = errors(&format!(
        "store:\n  type: redis\n  password: pw\n{BASE}{ROUTE}"
    ));
    assert!(e.iter().any(|e| e.contains("store.password")), "{e:?}");
    let e = errors(&format!("store:\n  cluster: [a:1]\n{BASE}{ROUTE}"));
    assert!(e.iter().any(|e| e.contains("store.cluster")), "{e:?}");
}

#[test]
fn response_settings_errors_name_their_field() {
    let yaml = format!(
        "server:\n  rate_limit_headers: ietf-10\n  limited_response: {{ status: 200 }}\n{BASE}  \
         - name: a\n    upstream: api\n    mode: dry-run\n    rate_limit_headers: X-RateLimit\n    \
         limited_response: {{ body: 'wait {{retry_afer}}s' }}\n    policies:\n      - {{ name: p, \
         key: [client_ip], token_bucket: {{ rate: 1/s, burst: 1 }}, mode: audit }}\n"
    );
    let e = errors(&yaml);
    let expect = [
        "server.rate_limit_headers: `ietf-10` is not a header mode",
        "server.limited_response.status: `200` is not a refusal",
        "routes[0].mode: `dry-run` is not a mode",
        "routes[0].policies[0].mode: `audit` is not a mode",
        "routes[0].rate_limit_headers: `X-RateLimit` is not a header mode",
        "routes[0].limited_response.body: `{retry_afer}` is not a placeholder",
    ];
    for want in expect {
        assert!(e.iter().any(|m| m.contains(want)), "{want}\nin {e:#?}");
    }
    assert_eq!(e.len(), expect.len(), "{e:#?}");
}

#[test]
fn a_shadow_route_makes_every_policy_shadow_and_defaults_come_from_server() {
    let yaml = format!(
        "server:\n  rate_limit_headers: both\n  limited_response: {{ status: 503 }}\n{BASE}  \
         - name: a\n    upstream: api\n    mode: shadow\n    policies:\n      - {{ name: p, \
         key: [client_ip], token_bucket: {{ rate: 1/s, burst: 1 }} }}\n  - name: b\n    \
         upstream: api\n    rate_limit_headers: none\n    limited_response: {{ status: 429 }}\n    \
         policies:\n      - {{ name: p, key: [client_ip], token_bucket: {{ rate: 1/s, burst: 1 \
         }}, mode: shadow }}\n      - {{ name: q, key: [client_ip], token_bucket: {{ rate: 1/s, \
         burst: 1 }} }}\n"
    );
    let snapshot = parse(&yaml, Path::new("p.yaml")).unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = (&snapshot.routes[0], &snapshot.routes[1]);
    assert!(a.policies[0].shadow);
    assert_eq!(a.rate_limit_headers.mode, crate::respond::HeaderMode::Both);
    assert_eq!(a.limited_response.status, 503);
    assert!(b.policies[0].shadow && !b.policies[1].shadow);
    assert_eq!(b.rate_limit_headers.mode, crate::respond::HeaderMode::None);
    assert_eq!(b.limited_response.status, 429);
}

// Issue 13's config errors, found as a new user would.

#[test]
fn regression_a_duplicate_key_was_reported_at_1_1() {
    let yaml = format!("{BASE}  - name: a\n    upstream: api\n    upstream: api\n");
    assert_eq!(
        errors(&yaml),
        [
            "p.yaml:7:5: routes[0].upstream: given twice in one mapping (first at line 6); YAML \
          keeps one value per key, so remove one"
        ]
    );
    // In a map of names too, where serde would keep the last one silently or place it at the map.
    let yaml = format!("upstreams:\n  api:\n    url: http://127.0.0.1:1\n  api:\n    url: http://127.0.0.1:2\nroutes:\n{ROUTE}");
    let e = errors(&yaml);
    assert!(
        e[0].starts_with("p.yaml:4:3: upstreams.api: given twice"),
        "{e:?}"
    );
}

#[test]
fn regression_an_invalid_upstream_was_also_reported_as_not_defined() {
    let yaml = format!("upstreams:\n  api:\n    url: ftp://127.0.0.1:3000\nroutes:\n{ROUTE}");
    let e = errors(&yaml);
    assert_eq!(e.len(), 1, "only the real error: {e:?}");
    assert!(
        e[0].starts_with("p.yaml:3:10: upstreams.api.url: "),
        "{e:?}"
    );
}

#[test]
fn regression_a_syntax_error_pointed_at_the_end_of_the_file() {
    // The scanner gives up at the end of the file; the bracket left open is what to fix.
    let yaml =
        "upstreams:\n  api: {url: http://127.0.0.1:3000\nroutes:\n  - name: a\n    upstream: api\n";
    let e = errors(yaml);
    assert_eq!(e.len(), 1);
    assert!(
        e[0].starts_with("p.yaml:2:8: upstreams.api: this `{` is never closed: "),
        "{e:?}"
    );
    let yaml = "routes: [\n  {name: a, upstream: api}\n";
    let e = errors(yaml);
    assert!(
        e[0].starts_with("p.yaml:1:9: routes: this `[` is never closed: "),
        "{e:?}"
    );
    // Other syntax errors keep serde's own placement.
    let e = errors("routes:\n  - name: a\n   bad: [x\n  upstream: api\n");
    assert!(e[0].starts_with("p.yaml:"), "{e:?}");
}

#[test]
fn forward_auth_proxy_names_a_known_proxy_at_its_line() {
    let yaml = format!("forward_auth:\n  listen: 127.0.0.1:8082\n  proxy: haproxy\n{BASE}{ROUTE}");
    let e = errors(&yaml);
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(e[0].starts_with("p.yaml:3:"), "{}", e[0]);
    assert!(e[0].contains("forward_auth.proxy"), "{}", e[0]);
    assert!(
        e[0].contains("ingress-nginx"),
        "says what is allowed: {}",
        e[0]
    );
    for name in ["nginx", "ingress-nginx", "traefik", "caddy", "auto"] {
        let yaml =
            format!("forward_auth:\n  listen: 127.0.0.1:8082\n  proxy: {name}\n{BASE}{ROUTE}");
        let snapshot = parse(&yaml, Path::new("p.yaml")).unwrap_or_else(|e| panic!("{e}"));
        let proxy = snapshot.forward_auth.map(|f| f.proxy);
        assert_eq!(proxy, CheckProxy::parse(name), "{name}");
    }
}

#[test]
fn ext_proc_listens_on_an_address_of_its_own_named_at_its_line() {
    let yaml =
        format!("listen: 127.0.0.1:8080\next_proc:\n  listen: 127.0.0.1:8080\n{BASE}{ROUTE}");
    let e = errors(&yaml);
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(e[0].starts_with("p.yaml:3:"), "{}", e[0]);
    assert!(e[0].contains("ext_proc.listen"), "{}", e[0]);
    let e = errors(&format!("ext_proc:\n  listen: nowhere\n{BASE}{ROUTE}"));
    assert!(
        e[0].contains("ext_proc.listen") && e[0].contains("IP:PORT"),
        "{e:?}"
    );
    let e = errors(&format!("ext_proc:\n  port: 1\n{BASE}{ROUTE}"));
    assert!(e[0].contains("port"), "a misspelt field is an error: {e:?}");
    let yaml = format!("ext_proc:\n  listen: 127.0.0.1:8084\n{BASE}{ROUTE}");
    let snapshot = parse(&yaml, Path::new("p.yaml")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(snapshot.ext_proc, "127.0.0.1:8084".parse().ok());
}

/// Two routes `a` and `b`, each with one policy: `a`'s is `first`, `b`'s is `second` (flow maps).
fn two_routes(first: &str, second: &str) -> String {
    format!(
        "{BASE}  - name: a\n    upstream: api\n    policies:\n      - {first}\n  - name: b\n    upstream: api\n    match: {{ prefix: /b }}\n    policies:\n      - {second}\n"
    )
}

#[test]
fn a_shared_policy_defined_differently_is_an_error_at_the_field() {
    let one =
        "{ name: p, shared: true, key: [client_ip], sliding_window: { limit: 5, window: 1h } }";
    let snapshot =
        parse(&two_routes(one, one), Path::new("p.yaml")).unwrap_or_else(|e| panic!("{e}"));
    let (a, b) = (
        &snapshot.routes[0].policies[0],
        &snapshot.routes[1].policies[0],
    );
    assert!(a.shared && b.shared);
    assert_eq!((a.key_prefix(), b.key_prefix()), ("shared/p:", "shared/p:"));

    let limit =
        "{ name: p, shared: true, key: [client_ip], sliding_window: { limit: 6, window: 1h } }";
    assert_eq!(
        errors(&two_routes(one, limit)),
        [
            "p.yaml:13:68: routes[1].policies[0].sliding_window: shared policy `p` has another \
          `sliding_window` in route `a` (routes[0].policies[0]): the routes that share it count \
          on one counter, so each must define it the same"
        ]
    );
    let key = "{ name: p, shared: true, key: [method], sliding_window: { limit: 5, window: 1h } }";
    let e = errors(&two_routes(one, key));
    assert_eq!(e.len(), 1);
    assert!(
        e[0].starts_with("p.yaml:13:39: routes[1].policies[0].key: "),
        "{e:?}"
    );
    let algorithm =
        "{ name: p, shared: true, key: [client_ip], token_bucket: { rate: 5/h, burst: 5 } }";
    let e = errors(&two_routes(one, algorithm));
    assert!(
        e[0].starts_with("p.yaml:13:66: routes[1].policies[0].token_bucket: "),
        "{e:?}"
    );
    let cost = "{ name: p, shared: true, key: [client_ip], cost: 2, sliding_window: { limit: 5, window: 1h } }";
    let e = errors(&two_routes(one, cost));
    assert!(
        e[0].starts_with("p.yaml:13:58: routes[1].policies[0].cost: "),
        "{e:?}"
    );

    // Not shared, the same name is another counter on each route, with its own numbers.
    let own = |limit| {
        format!("{{ name: p, key: [client_ip], sliding_window: {{ limit: {limit}, window: 1h }} }}")
    };
    let snapshot =
        parse(&two_routes(&own(5), &own(6)), Path::new("p.yaml")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(snapshot.routes[1].policies[0].key_prefix(), "b:p:");
    assert!(!snapshot.routes[1].policies[0].shared);
}

#[test]
fn min_body_rate_defaults_to_1kib_a_second_after_5s_and_can_be_off() {
    let yaml = format!("{BASE}{ROUTE}");
    let s = parse(&yaml, Path::new("p.yaml")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        s.server.min_body_rate,
        Some(MinBodyRate {
            bytes_per_second: 1024,
            grace: std::time::Duration::from_secs(5),
        })
    );
    let set = format!("server:\n  min_body_rate: 4KiB/s\n  min_body_rate_grace: 0s\n{yaml}");
    let s = parse(&set, Path::new("p.yaml")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        s.server.min_body_rate,
        Some(MinBodyRate {
            bytes_per_second: 4096,
            grace: std::time::Duration::ZERO,
        })
    );
    let off = format!("server:\n  min_body_rate: off\n{yaml}");
    let s = parse(&off, Path::new("p.yaml")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(s.server.min_body_rate, None);
}

#[test]
fn a_bad_min_body_rate_is_an_error_at_its_line() {
    let yaml =
        format!("server:\n  min_body_rate: 1KiB\n  min_body_rate_grace: soon\n{BASE}{ROUTE}");
    let e = errors(&yaml);
    assert_eq!(e.len(), 2, "{e:#?}");
    assert!(
        e.iter().any(|l| l.starts_with(
            "p.yaml:2:18: server.min_body_rate: `1KiB` is not a rate; expected a size a second"
        )),
        "{e:#?}"
    );
    assert!(
        e.iter()
            .any(|l| l.starts_with("p.yaml:3:24: server.min_body_rate_grace: ")),
        "{e:#?}"
    );
    for bad in ["0B/s", "fast/s"] {
        let yaml = format!("server:\n  min_body_rate: {bad}\n{BASE}{ROUTE}");
        let e = errors(&yaml);
        assert!(
            e[0].starts_with("p.yaml:2:18: server.min_body_rate: "),
            "{bad}: {e:#?}"
        );
    }
}

#[test]
fn request_id_and_access_log_errors_name_their_fields_and_lines() {
    let yaml = format!(
        "request_id: {{ header: 'bad name', trust: everyone }}\naccess_log:\n  format: xml\n  \
         fields: [time, status, time, colour]\n  sample: {{ admitted: 1.5 }}\n  buffer: 0\n{BASE}{ROUTE}"
    );
    let e = errors(&yaml);
    let expect = [
        "p.yaml:1:23: request_id.header: `bad name` is not a header name",
        "p.yaml:1:42: request_id.trust: `everyone` is not a choice",
        "p.yaml:3:11: access_log.format: `xml` is not a format",
        "p.yaml:4:26: access_log.fields[2]: `time` is listed twice",
        "p.yaml:4:32: access_log.fields[3]: `colour` is not a field",
        "p.yaml:5:23: access_log.sample.admitted: `1.5` is not a fraction",
        "p.yaml:6:11: access_log.buffer: must be between 1 and",
    ];
    for want in expect {
        assert!(e.iter().any(|m| m.contains(want)), "{want}\nin {e:#?}");
    }
    assert_eq!(e.len(), expect.len(), "{e:#?}");
}

#[test]
fn request_ids_are_on_by_default_and_the_access_log_off() {
    let s = parse(&format!("{BASE}{ROUTE}"), Path::new("p.yaml")).unwrap();
    assert!(s.request_id.enabled);
    assert_eq!(s.request_id.header, "x-request-id");
    assert_eq!(s.access_log, None);
    let yaml =
        format!("access_log: {{ output: logs/a.log, fields: [status, key] }}\n{BASE}{ROUTE}");
    let s = parse(&yaml, Path::new("/etc/t/p.yaml")).unwrap();
    let log = s.access_log.unwrap();
    assert_eq!(
        log.output,
        observability::LogOutput::File("/etc/t/logs/a.log".into())
    );
    assert_eq!(
        log.fields,
        [
            observability::LogField::Status,
            observability::LogField::Key
        ]
    );
    assert_eq!((log.sample_admitted, log.sample_refused), (1.0, 1.0));
}

#[test]
fn tracing_errors_name_their_fields_and_lines() {
    let yaml = format!(
        "tracing:\n  otlp_endpoint: 'collector:4317'\n  sample_ratio: 2\n  service_name: ''\n{BASE}{ROUTE}"
    );
    let e = errors(&yaml);
    let expect = [
        "p.yaml:2:18: tracing.otlp_endpoint: `collector:4317` is not an `http://host:port` address",
        "p.yaml:3:17: tracing.sample_ratio: `2` is not a fraction",
        "p.yaml:4:17: tracing.service_name: must be 1 to 255 characters",
    ];
    for want in expect {
        assert!(e.iter().any(|m| m.contains(want)), "{want}\nin {e:#?}");
    }
    assert_eq!(e.len(), expect.len(), "{e:#?}");
    let e = errors(&format!(
        "tracing: {{ otlp_endpoint: 'https://c:4317' }}\n{BASE}{ROUTE}"
    ));
    assert!(
        e[0].contains("tracing.otlp_endpoint: `https://c:4317`: https is not supported"),
        "{e:#?}"
    );
    let e = errors(&format!("tracing: {{ sample_ratio: 0.5 }}\n{BASE}{ROUTE}"));
    assert!(
        e[0].contains("tracing.otlp_endpoint: is required"),
        "{e:#?}"
    );
}

#[test]
fn tracing_is_off_by_default_and_samples_every_trace_when_set() {
    let s = parse(&format!("{BASE}{ROUTE}"), Path::new("p.yaml")).unwrap();
    assert_eq!(s.tracing, None);
    let yaml = format!("tracing: {{ otlp_endpoint: 'http://127.0.0.1:4317' }}\n{BASE}{ROUTE}");
    let t = parse(&yaml, Path::new("p.yaml")).unwrap().tracing.unwrap();
    assert_eq!(t.otlp_endpoint, "http://127.0.0.1:4317/");
    assert_eq!(
        (t.sample_ratio, t.service_name.as_str()),
        (1.0, "turnstile")
    );
}

/// Pacing's settings (`on_limit: delay`, `max_delay`, `max_waiting`): each mistake names its
/// file, line and field.
#[test]
fn pacing_settings_are_checked_with_their_line() {
    let policy = |extra: &str| {
        format!(
            "{BASE}  - name: a\n    upstream: api\n    policies:\n      - name: p\n        \
             key: [client_ip]\n{extra}"
        )
    };
    let tb = "        token_bucket: { rate: 10/s, burst: 1 }\n";
    let ok = parse(
        &policy(&format!(
            "{tb}        on_limit: delay\n        max_delay: 1500ms\n"
        )),
        Path::new("p.yaml"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ok.routes[0].policies[0].max_delay_us, Some(1_500_000));
    assert_eq!(ok.routes[0].max_waiting, 1000);
    // A quota paces across its period boundary.
    let quota = parse(
        &policy("        quota: { limit: 2, per: minute }\n        on_limit: delay\n        max_delay: 5s\n"),
        Path::new("p.yaml"),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(quota.routes[0].policies[0].max_delay_us, Some(5_000_000));
    let cases = [
        (
            format!("{tb}        on_limit: wait\n"),
            "p.yaml:11:19: routes[0].policies[0].on_limit: `wait` is not an answer",
        ),
        (
            format!("{tb}        on_limit: delay\n"),
            "p.yaml:11:19: routes[0].policies[0].on_limit: `delay` needs `max_delay`",
        ),
        (
            format!("{tb}        max_delay: 1s\n"),
            "p.yaml:11:20: routes[0].policies[0].max_delay: applies only with `on_limit: delay`",
        ),
        (
            format!("{tb}        on_limit: delay\n        max_delay: 2h\n"),
            "p.yaml:12:20: routes[0].policies[0].max_delay: must be more than 0ms and at most",
        ),
        (
            "        quota: { limit: 2, per: fortnight }\n".to_string(),
            "p.yaml:10:33: routes[0].policies[0].quota.per: `fortnight`: expected second, minute, \
             hour, day, week or month",
        ),
        (
            format!(
                "{tb}        cost: {{ response_header: x-cost }}\n        on_limit: delay\n        \
                 max_delay: 1s\n"
            ),
            "p.yaml:12:19: routes[0].policies[0].on_limit: `delay` is not supported with a cost \
             from the response",
        ),
        (
            format!("{tb}        mode: shadow\n        on_limit: delay\n        max_delay: 1s\n"),
            "p.yaml:12:19: routes[0].policies[0].on_limit: a shadow policy never refuses",
        ),
    ];
    for (extra, want) in cases {
        let e = errors(&policy(&extra));
        assert!(e.iter().any(|e| e.starts_with(want)), "{want}\n got {e:?}");
    }
    // A concurrency policy waits for its lease; a route waits for one lease at most.
    let cc = "        concurrency: { limit: 2 }\n        on_limit: delay\n        max_delay: 1s\n";
    let ok = parse(&policy(cc), Path::new("p.yaml")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ok.routes[0].policies[0].max_delay_us, Some(1_000_000));
    let e = errors(&policy(&format!(
        "{cc}      - name: q\n        key: [method]\n{cc}"
    )));
    assert!(
        e.iter().any(|e| e.starts_with(
            "p.yaml:16:19: routes[0].policies[1].on_limit: a route waits for at most one"
        )),
        "{e:?}"
    );
    let e = errors(&format!(
        "{BASE}  - name: a\n    upstream: api\n    max_waiting: 5\n"
    ));
    assert!(
        e[0].starts_with("p.yaml:7:18: routes[0].max_waiting: applies only to a route with"),
        "{e:?}"
    );
}
