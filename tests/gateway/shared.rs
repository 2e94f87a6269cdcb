//! Shared policies (issue 34, item 3): a policy with `shared: true` counts on one counter for
//! every route that has it, decided with the route's other policies in one decision (one Redis
//! round trip), overridden, shadowed and reported as any policy. Windows of an hour make every
//! count exact. Run on both stores.

use http::Method;

use crate::support::client::{full, request};
use crate::support::stores::TestStore;
use crate::support::{metric, Client, TestGateway};

/// `a` and `b` share `per_user` (5 an hour per `x-user`); `a` also has its own `a_only` (3 an
/// hour), which `b` does not have.
const YAML: &str = r#"
routes:
  - name: a
    match: { prefix: /a }
    respond: { body: a }
    policies:
      - { name: per_user, shared: true, key: ["header:x-user"], sliding_window: { limit: 5, window: 1h } }
      - { name: a_only, key: ["header:x-user"], sliding_window: { limit: 3, window: 1h } }
  - name: b
    match: { prefix: /b }
    respond: { body: b }
    policies:
      - { name: per_user, shared: true, key: ["header:x-user"], sliding_window: { limit: 5, window: 1h } }
"#;

/// Statuses of `n` requests of `user` to `path`.
async fn statuses(gw: &TestGateway, path: &str, user: &str, n: usize) -> Vec<u16> {
    let c = Client::new();
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(c.get_with(&gw.url(path), &[("x-user", user)]).await.status);
    }
    out
}

async fn two_routes_admit_exactly_the_shared_limit_in_total(store: TestStore) {
    let gw = TestGateway::start(&store.config(YAML)).await;
    let c = Client::new();
    // `a` stops at its own 3; `b` has the 2 left of the shared 5, and the headers say so.
    assert_eq!(statuses(&gw, "/a", "ann", 3).await, [200, 200, 200]);
    for left in [1, 0] {
        let reply = c.get_with(&gw.url("/b"), &[("x-user", "ann")]).await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("x-ratelimit-limit"), Some("5"));
        assert_eq!(reply.header_u64("x-ratelimit-remaining"), left);
    }
    let refused = c.get_with(&gw.url("/b"), &[("x-user", "ann")]).await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.json()["policy"], "per_user");
    assert_eq!(statuses(&gw, "/b", "ann", 2).await, [429, 429]);
    // Another user has the whole budget: one counter per key value, as on any policy.
    assert_eq!(
        statuses(&gw, "/b", "bob", 6).await,
        [200, 200, 200, 200, 200, 429]
    );
    assert_eq!(statuses(&gw, "/a", "bob", 1).await, [429]);

    // Each route's decisions are labelled with the route that made them.
    let text = gw.metrics().await;
    let decisions = |route, decision| {
        metric(
            &text,
            "turnstile_decisions_total",
            &[
                ("route", route),
                ("policy", "per_user"),
                ("decision", decision),
            ],
        )
        .unwrap_or(0.0)
    };
    assert_eq!(decisions("a", "allowed"), 3.0);
    assert_eq!(decisions("b", "allowed"), 7.0);
    assert_eq!(decisions("b", "limited"), 4.0);
    assert_eq!(decisions("a", "limited"), 1.0);

    // `/debug/top-limited` lists a limited key once per route, with the same key value (the
    // counter key without `shared/per_user:`).
    let (status, body) = gw.admin_get("/debug/top-limited?n=10").await;
    assert_eq!(status, 200, "{body}");
    let report: serde_json::Value = serde_json::from_str(&body).expect("json");
    let mut keys: Vec<(String, String, String, u64)> = report["current"]["keys"]
        .as_array()
        .expect("keys")
        .iter()
        .map(|k| {
            let text = |f: &str| k[f].as_str().unwrap_or_default().to_owned();
            (
                text("route"),
                text("policy"),
                text("key"),
                k["count"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    keys.sort_by(|x, y| (&x.0, x.3).cmp(&(&y.0, y.3)));
    let routes: Vec<(&str, &str, u64)> = keys
        .iter()
        .map(|(r, p, _, n)| (r.as_str(), p.as_str(), *n))
        .collect();
    assert_eq!(
        routes,
        [
            ("a", "per_user", 1),
            ("b", "per_user", 1),
            ("b", "per_user", 3)
        ]
    );
    assert_eq!(keys[0].2, keys[1].2, "bob's key, limited on `a` and on `b`");
}

async fn a_refusal_by_another_policy_consumes_nothing_from_the_shared_one(store: TestStore) {
    let gw = TestGateway::start(&store.config(YAML)).await;
    // `a_only` refuses the 4th to 6th: all or nothing, `per_user` keeps the 2 they would have
    // taken, and `b` gets them.
    assert_eq!(
        statuses(&gw, "/a", "ann", 6).await,
        [200, 200, 200, 429, 429, 429]
    );
    assert_eq!(statuses(&gw, "/b", "ann", 3).await, [200, 200, 429]);
}

async fn an_override_of_a_shared_key_applies_on_every_route(store: TestStore) {
    let gw = TestGateway::start(&store.config(YAML)).await;
    // Named through route `b`, it raises the one counter `a` uses too.
    let req = request(Method::PUT, &gw.admin_url("/overrides/b/per_user/acme"))
        .header("content-type", "application/json")
        .body(full(r#"{"limit": 7}"#))
        .expect("request");
    let put = Client::new().send(req).await;
    assert_eq!(put.status, 200, "{}", put.text());
    assert_eq!(statuses(&gw, "/a", "acme", 3).await, [200, 200, 200]);
    assert_eq!(
        statuses(&gw, "/b", "acme", 5).await,
        [200, 200, 200, 200, 429]
    );
    assert_eq!(statuses(&gw, "/a", "acme", 1).await, [429]);
    // Other keys keep the policy's 5.
    assert_eq!(
        statuses(&gw, "/b", "zed", 6).await,
        [200, 200, 200, 200, 200, 429]
    );
}

/// The overrides file names a shared policy through any of its routes, and applies to the one
/// counter; a second entry for the same counter through another route is an error at its line.
async fn the_overrides_file_sets_a_shared_key_once_through_any_route(store: TestStore) {
    let yaml = format!("overrides: overrides.yaml\n{YAML}");
    let file = "- { route: a, policy: per_user, key: acme, limit: 6 }\n";
    let gw = TestGateway::with_files(&store.config(&yaml), &[("overrides.yaml", file)]).await;
    assert_eq!(statuses(&gw, "/a", "acme", 3).await, [200, 200, 200]);
    assert_eq!(statuses(&gw, "/b", "acme", 4).await, [200, 200, 200, 429]);

    let path = gw.config_path.with_file_name("overrides.yaml");
    let twice = format!("{file}- {{ route: b, policy: per_user, key: acme, limit: 9 }}\n");
    std::fs::write(&path, twice).expect("write");
    let err = gw
        .reload_with(&store.config(&yaml))
        .await
        .expect_err("the same counter twice")
        .to_string();
    assert!(
        err.contains(
            "overrides.yaml:2:38: [1].key: overrides[0] already sets this key of shared policy \
             `per_user`"
        ),
        "{err}"
    );
}

/// A route in `mode: shadow` counts on the shared counter and never refuses; an enforcing route
/// sharing it refuses once the shared limit is reached.
async fn a_shadow_route_counts_on_the_shared_counter_without_refusing(store: TestStore) {
    let yaml = YAML.replace(
        "  - name: b\n    match: { prefix: /b }\n",
        "  - name: b\n    mode: shadow\n    match: { prefix: /b }\n",
    );
    let gw = TestGateway::start(&store.config(&yaml)).await;
    assert_eq!(
        statuses(&gw, "/b", "ann", 7).await,
        [200, 200, 200, 200, 200, 200, 200]
    );
    assert_eq!(statuses(&gw, "/a", "ann", 1).await, [429]);
    let shadow = gw
        .metric(
            "turnstile_decisions_total",
            &[
                ("route", "b"),
                ("policy", "per_user"),
                ("decision", "shadow"),
            ],
        )
        .await;
    assert_eq!(shadow, 2.0);
}

/// A reload that leaves the shared policy as it was keeps its counters, also for a route added by
/// the reload.
async fn a_reload_keeps_the_shared_counters(store: TestStore) {
    let gw = TestGateway::start(&store.config(YAML)).await;
    assert_eq!(statuses(&gw, "/b", "ann", 3).await, [200, 200, 200]);
    let more = format!(
        "{YAML}  - name: c\n    match: {{ prefix: /c }}\n    respond: {{ body: c }}\n    policies:\n      - {{ name: per_user, shared: true, key: [\"header:x-user\"], sliding_window: {{ limit: 5, window: 1h }} }}\n"
    );
    gw.reload_with(&store.config(&more))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(statuses(&gw, "/c", "ann", 3).await, [200, 200, 429]);
    assert_eq!(statuses(&gw, "/a", "ann", 1).await, [429]);
}

crate::store_matrix!(
    two_routes_admit_exactly_the_shared_limit_in_total,
    a_refusal_by_another_policy_consumes_nothing_from_the_shared_one,
    an_override_of_a_shared_key_applies_on_every_route,
    the_overrides_file_sets_a_shared_key_once_through_any_route,
    a_shadow_route_counts_on_the_shared_counter_without_refusing,
    a_reload_keeps_the_shared_counters,
);

/// The example of docs/algorithms.md's "Shared policies" loads, and its two routes use one counter
/// key for the shared policy and their own for the other.
#[test]
fn the_documented_example_loads_and_shares_one_counter() {
    let page = std::fs::read_to_string(crate::support::tools::repo_path("docs/algorithms.md"))
        .expect("docs/algorithms.md");
    let section = page
        .split("\n## ")
        .find(|s| s.starts_with("Shared policies"))
        .expect("a Shared policies section");
    let blocks: Vec<&str> = section
        .split("```yaml\n")
        .skip(1)
        .filter_map(|rest| rest.split_once("```").map(|(block, _)| block))
        .collect();
    assert_eq!(blocks.len(), 1);
    let snapshot = turnstile::config::parse(blocks[0], std::path::Path::new("docs/algorithms.md"))
        .unwrap_or_else(|e| panic!("{e}"));
    let prefix = |route: usize| snapshot.routes[route].policies[0].key_prefix().to_owned();
    assert_eq!(prefix(0), "shared/per_consumer:");
    assert_eq!(prefix(1), prefix(0));
    assert_eq!(
        snapshot.routes[0].policies[1].key_prefix(),
        "orders:orders_writes:"
    );
}
