//! `upstreams.*.targets`, `balance`, `eject_for`, and the routes' `strip_prefix` and `rewrite`.

use std::path::Path;
use std::time::Duration;

use super::*;
use crate::proxy::rewrite::{PathRewrite, Piece};

fn errors(yaml: &str) -> Vec<String> {
    match parse(yaml, Path::new("p.yaml")) {
        Ok(_) => panic!("expected errors for:\n{yaml}"),
        Err(e) => e.0.iter().map(ToString::to_string).collect(),
    }
}

fn upstream(snapshot: &Snapshot) -> &Upstream {
    match &snapshot.routes[0].action {
        Action::Forward(up) => up,
        other => panic!("not forwarded: {other:?}"),
    }
}

#[test]
fn targets_compile_with_their_balance_and_safe_defaults() {
    let yaml = "upstreams:\n  api:\n    targets: [http://127.0.0.1:3000, \"http://127.0.0.1:3001/\"]\n    balance: least_in_flight\n    eject_for: 2s\nroutes:\n  - name: a\n    upstream: api\n";
    let snapshot = parse(yaml, Path::new("p.yaml")).unwrap_or_else(|e| panic!("{e}"));
    let up = upstream(&snapshot);
    let targets: Vec<&str> = up.targets.iter().map(|a| a.as_str()).collect();
    assert_eq!(targets, ["127.0.0.1:3000", "127.0.0.1:3001"]);
    assert_eq!(up.balance, Balance::LeastInFlight);
    assert_eq!(up.eject_for, Duration::from_secs(2));

    let yaml = "upstreams:\n  api:\n    url: http://127.0.0.1:3000\nroutes:\n  - name: a\n    upstream: api\n";
    let snapshot = parse(yaml, Path::new("p.yaml")).unwrap_or_else(|e| panic!("{e}"));
    let up = upstream(&snapshot);
    assert_eq!(up.targets.len(), 1);
    assert_eq!(up.balance, Balance::RoundRobin);
    assert_eq!(up.eject_for, Duration::from_secs(10));
}

#[test]
fn url_and_targets_are_exclusive_and_each_target_is_located() {
    let e = errors("upstreams:\n  api:\n    url: http://127.0.0.1:3000\n    targets: [http://127.0.0.1:3001]\nroutes:\n  - name: a\n    upstream: api\n");
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(
        e[0].starts_with("p.yaml:3:")
            && e[0].contains("upstreams.api: give either `url` or `targets`"),
        "{}",
        e[0]
    );

    let e = errors(
        "upstreams:\n  api:\n    balance: random\nroutes:\n  - name: a\n    upstream: api\n",
    );
    assert!(
        e.iter()
            .any(|m| m.contains("upstreams.api.balance: `random` is not a balance")),
        "{e:?}"
    );
    assert!(
        e.iter().any(|m| m.contains("upstreams.api: needs `url:")),
        "{e:?}"
    );

    let e = errors("upstreams:\n  api:\n    targets:\n      - http://127.0.0.1:3000\n      - ftp://127.0.0.1:3001\n      - http://127.0.0.1:3000\n    eject_for: 0s\nroutes:\n  - name: a\n    upstream: api\n");
    assert_eq!(
        e,
        [
            "p.yaml:7:16: upstreams.api.eject_for: must be more than 0ms (and at most 365d)",
            "p.yaml:5:9: upstreams.api.targets[1]: `ftp://127.0.0.1:3001`: only http://HOST:PORT and https://HOST:PORT upstreams are supported",
            "p.yaml:6:9: upstreams.api.targets[2]: `http://127.0.0.1:3000` is listed twice",
        ],
    );

    let e =
        errors("upstreams:\n  api:\n    targets: []\nroutes:\n  - name: a\n    upstream: api\n");
    assert!(
        e[0].contains("upstreams.api.targets: must list at least one"),
        "{e:?}"
    );
}

#[test]
fn rewrite_and_strip_prefix_compile_against_the_route() {
    let yaml = "upstreams:\n  api:\n    url: http://127.0.0.1:3000\nroutes:\n  - name: a\n    match: { path: \"/api/users/{id}/{*rest}\" }\n    upstream: api\n    rewrite: \"/v2/u/{id}/{*rest}\"\n  - name: b\n    match: { prefix: /api }\n    upstream: api\n    strip_prefix: /api\n";
    let snapshot = parse(yaml, Path::new("p.yaml")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        snapshot.routes[0].rewrite,
        Some(PathRewrite::Template(vec![
            Piece::Literal("/v2/u/".into()),
            Piece::Capture(0),
            Piece::Literal("/".into()),
            Piece::Capture(1),
        ]))
    );
    assert_eq!(
        snapshot.routes[1].rewrite,
        Some(PathRewrite::StripPrefix("/api".into()))
    );
}

#[test]
fn a_rewrite_naming_an_absent_capture_is_an_error_at_its_line() {
    let e = errors("upstreams:\n  api:\n    url: http://127.0.0.1:3000\nroutes:\n  - name: a\n    match: { path: \"/api/{id}\" }\n    upstream: api\n    rewrite: \"/v2/{*rest}\"\n");
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(
        e[0].starts_with("p.yaml:8:14: routes[0].rewrite: `/v2/{*rest}` uses `{*rest}`, which the route's `match.path` does not capture (it captures: id)"),
        "{}",
        e[0]
    );
}

#[test]
fn strip_prefix_outside_the_route_path_is_an_error_at_its_line() {
    let e = errors("upstreams:\n  api:\n    url: http://127.0.0.1:3000\nroutes:\n  - name: a\n    match: { path: \"/api/{id}\" }\n    upstream: api\n    strip_prefix: /v1\n  - name: b\n    upstream: api\n    strip_prefix: /v1\n  - name: c\n    match: { prefix: /api }\n    upstream: api\n    strip_prefix: /api\n    rewrite: /x\n");
    assert_eq!(e.len(), 3, "{e:?}");
    assert!(e[0].starts_with("p.yaml:8:19: routes[0].strip_prefix: `/v1` must be a whole-segment prefix of the route's `match.path` (`/api/`)"), "{}", e[0]);
    assert!(
        e[1].starts_with(
            "p.yaml:11:19: routes[1].strip_prefix: needs `match.path` or `match.prefix`"
        ),
        "{}",
        e[1]
    );
    assert!(
        e[2].contains("routes[2]: give either `strip_prefix` or `rewrite`"),
        "{}",
        e[2]
    );
}

#[test]
fn protocol_h2_compiles_and_refuses_pool_bounds() {
    let yaml = "upstreams:\n  api:\n    url: http://127.0.0.1:50051\n    protocol: h2\nroutes:\n  - name: a\n    upstream: api\n";
    let snapshot = parse(yaml, Path::new("p.yaml")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(upstream(&snapshot).protocol, UpstreamProtocol::H2);
    let yaml = "upstreams:\n  api:\n    url: http://127.0.0.1:3000\nroutes:\n  - name: a\n    upstream: api\n";
    let snapshot = parse(yaml, Path::new("p.yaml")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(upstream(&snapshot).protocol, UpstreamProtocol::Http1);

    let e = errors("upstreams:\n  api:\n    url: http://127.0.0.1:50051\n    protocol: h3\nroutes:\n  - name: a\n    upstream: api\n");
    assert!(
        e.iter().any(|l| l.starts_with("p.yaml:4:")
            && l.contains("upstreams.api.protocol: `h3` is not a protocol; expected http1 or h2")),
        "{e:#?}"
    );
    let e = errors("upstreams:\n  api:\n    url: http://127.0.0.1:50051\n    protocol: h2\n    max_connections: 4\nroutes:\n  - name: a\n    upstream: api\n");
    assert!(
        e.iter().any(|l| l.starts_with("p.yaml:5:")
            && l.contains("upstreams.api.max_connections: does not apply to `protocol: h2`")),
        "{e:#?}"
    );
}
