use std::path::Path;

use super::*;

fn errors(yaml: &str) -> Vec<String> {
    match parse(yaml, Path::new("p.yaml"), &Metrics::new()) {
        Ok(_) => panic!("expected errors for:\n{yaml}"),
        Err(e) => e.0.iter().map(ToString::to_string).collect(),
    }
}

const BASE: &str = "upstreams:\n  api:\n    url: http://127.0.0.1:3000\nroutes:\n";

#[test]
fn the_shipped_policies_file_loads() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("policies.yaml");
    let snapshot = load(&path, &Metrics::new()).unwrap_or_else(|e| panic!("{e}"));
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
        "p.yaml:9:24: routes[0].policies[0].key[1]: `cookie`: key parts are client_ip, header:NAME, path:PARAM, query:NAME, method, host",
        "p.yaml:10:31: routes[0].policies[0].token_bucket.rate: `10/w` has an unknown unit `w`; expected N/s, N/m, N/h or N/d with N > 0 (e.g. 10/s, 0.5/s, 100/m)",
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
    let e = errors("listen: 127.0.0.1:8080\nadmin_listen: 127.0.0.1:8080\n");
    assert_eq!(e, ["p.yaml:2:15: admin_listen: must differ from `listen`: the admin endpoints never share the public listener"]);
}

#[test]
fn a_valid_config_compiles_to_runtime_types() {
    let yaml = format!("{BASE}  - name: a\n    match: {{ path: \"/u/{{id}}\", methods: [get] }}\n    upstream: api\n    failure_mode: closed\n    policies:\n      - name: p\n        key: [path:id]\n        sliding_window: {{ limit: 5, window: 1m, buckets: 60 }}\n");
    let s = parse(&yaml, Path::new("p.yaml"), &Metrics::new()).unwrap();
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
        "store:\n  type: redis\n  url: redis://user:s3cret@127.0.0.1:notaport\n  key_prefix: \"a{{b}}:\"\n{BASE}"
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
    let yaml = format!("store:\n  type: redis\n  url: rediss://user:pw@127.0.0.1:6380\n{BASE}");
    parse(&yaml, Path::new("p.yaml"), &Metrics::new()).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn a_redis_store_compiles() {
    let yaml = format!(
        "store:\n  type: redis\n  url: redis://:pw@127.0.0.1:6390/2\n  pool_size: 8\n  timeout: 20ms\n  failure_mode: closed\n  key_prefix: \"gw:\"\n{BASE}"
    );
    let snapshot =
        parse(&yaml, Path::new("p.yaml"), &Metrics::new()).unwrap_or_else(|e| panic!("{e}"));
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
fn cluster_and_sentinel_stores_compile() {
    use crate::limiter::redis::{Auth, Target};
    let yaml = format!(
        "store:\n  type: redis\n  cluster: [10.0.0.1:6379, \"[::1]:7000\"]\n  password: pw\n{BASE}"
    );
    let snapshot =
        parse(&yaml, Path::new("p.yaml"), &Metrics::new()).unwrap_or_else(|e| panic!("{e}"));
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
        "store:\n  type: redis\n  sentinel: {{ service: mymaster, nodes: [10.0.0.5:26379] }}\n{BASE}"
    );
    let snapshot =
        parse(&yaml, Path::new("p.yaml"), &Metrics::new()).unwrap_or_else(|e| panic!("{e}"));
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
        "store:\n  type: redis\n  cluster: [10.0.0.1:6379, nope]\n{BASE}"
    ));
    assert!(
        e.iter()
            .any(|e| e.contains("store.cluster[1]") && e.contains("host:port")),
        "{e:?}"
    );
    let e = errors(&format!(
        "store:\n  type: redis\n  url: redis://a\n  cluster: [a:1]\n{BASE}"
    ));
    assert!(
        e.iter()
            .any(|e| e.contains("store.cluster") && e.contains("only one")),
        "{e:?}"
    );
    let e = errors(&format!(
        "store:\n  type: redis\n  sentinel: {{ service: \"\", nodes: [] }}\n{BASE}"
    ));
    assert!(
        e.iter().any(|e| e.contains("store.sentinel.service")),
        "{e:?}"
    );
    assert!(
        e.iter().any(|e| e.contains("store.sentinel.nodes")),
        "{e:?}"
    );
    let e = errors(&format!("store:\n  type: redis\n  password: pw\n{BASE}"));
    assert!(e.iter().any(|e| e.contains("store.password")), "{e:?}");
    let e = errors(&format!("store:\n  cluster: [a:1]\n{BASE}"));
    assert!(e.iter().any(|e| e.contains("store.cluster")), "{e:?}");
}
