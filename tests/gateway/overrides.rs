//! Per-key overrides (issue 15): the admin API on both stores, shared through Redis between two
//! instances, the overrides file and its reload, and the admin-only surface. Windows of an hour
//! make every count exact.

use std::time::{Duration, Instant};

use http::Method;

use crate::support::client::{full, request};
use crate::support::stores::TestStore;
use crate::support::{Client, RedisServer, Reply, TestGateway};

const ROUTES: &str = r#"
routes:
  - name: api
    match: { prefix: /api }
    respond: { body: ok }
    policies:
      - { name: tenant, key: ["header:x-tenant"], sliding_window: { limit: 2, window: 1h } }
"#;

async fn admin(gw: &TestGateway, method: Method, path: &str, body: &str) -> Reply {
    let req = request(method, &gw.admin_url(path))
        .header("content-type", "application/json")
        .body(full(body.to_owned()))
        .expect("request");
    Client::new().send(req).await
}

/// Statuses of `n` requests of `tenant`.
async fn statuses(gw: &TestGateway, tenant: &str, n: usize) -> Vec<u16> {
    let c = Client::new();
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(
            c.get_with(&gw.url("/api/x"), &[("x-tenant", tenant)])
                .await
                .status,
        );
    }
    out
}

async fn an_override_raises_one_key_and_delete_restores_it(store: TestStore) {
    let gw = TestGateway::start(&store.config(ROUTES)).await;
    let put = admin(
        &gw,
        Method::PUT,
        "/overrides/api/tenant/acme",
        r#"{"limit": 5}"#,
    )
    .await;
    assert_eq!(put.status, 200, "{}", put.text());
    assert_eq!(
        statuses(&gw, "acme", 6).await,
        [200, 200, 200, 200, 200, 429]
    );
    assert_eq!(statuses(&gw, "globex", 3).await, [200, 200, 429]);

    let listed = admin(&gw, Method::GET, "/overrides", "").await.json();
    assert_eq!(listed["overrides"][0]["key"], "acme");
    assert_eq!(listed["overrides"][0]["limit"], 5);
    assert_eq!(listed["overrides"][0]["source"], "api");

    let deleted = admin(&gw, Method::DELETE, "/overrides/api/tenant/acme", "").await;
    assert_eq!(deleted.status, 204);
    // Back to the policy's limit of 2, with the 5 already counted.
    let reply = Client::new()
        .get_with(&gw.url("/api/x"), &[("x-tenant", "acme")])
        .await;
    assert_eq!(reply.status, 429);
    assert_eq!(reply.header_u64("x-ratelimit-limit"), 2);
    let again = admin(&gw, Method::DELETE, "/overrides/api/tenant/acme", "").await;
    assert_eq!(again.status, 404);
}

async fn bad_overrides_are_refused_with_the_reason(store: TestStore) {
    let gw = TestGateway::start(&store.config(ROUTES)).await;
    for (path, body, status, says) in [
        (
            "/overrides/nope/tenant/a",
            r#"{"limit": 5}"#,
            404,
            "no route",
        ),
        ("/overrides/api/nope/a", r#"{"limit": 5}"#, 404, "no policy"),
        (
            "/overrides/api/tenant/a",
            r#"{"limit": 0}"#,
            400,
            "at least 1",
        ),
        (
            "/overrides/api/tenant/a",
            r#"{"rate": "5/s"}"#,
            400,
            "token bucket",
        ),
        ("/overrides/api/tenant/a", r#"{"limit": -1}"#, 400, ""),
        (
            "/overrides/api/tenant/a",
            r#"{"limits": 5}"#,
            400,
            "unknown field",
        ),
    ] {
        let reply = admin(&gw, Method::PUT, path, body).await;
        assert_eq!(reply.status, status, "{path} {body}: {}", reply.text());
        assert!(
            reply.text().contains(says),
            "{path} {body}: {}",
            reply.text()
        );
    }
    let listed = admin(&gw, Method::GET, "/overrides", "").await.json();
    assert_eq!(listed["overrides"].as_array().map(Vec::len), Some(0));
}

/// The admin API exists on the admin listener only.
async fn the_public_listener_has_no_overrides_api(store: TestStore) {
    let gw = TestGateway::start(&store.config(ROUTES)).await;
    let c = Client::new();
    assert_eq!(c.get(&gw.url("/overrides")).await.status, 404);
    let req = request(Method::PUT, &gw.url("/overrides/api/tenant/acme"))
        .body(full(r#"{"limit": 100}"#))
        .expect("request");
    assert_eq!(c.send(req).await.status, 404);
    assert_eq!(statuses(&gw, "acme", 3).await, [200, 200, 429]);
}

crate::store_matrix!(
    an_override_put_then_delete_replays_no_cached_refusal,
    a_reload_a_b_a_replays_no_cached_refusal,
    an_override_that_could_never_match_is_refused_and_never_listed_active,
    an_override_raises_one_key_and_delete_restores_it,
    a_door_charges_up_front_at_most_the_overrides_burst,
    bad_overrides_are_refused_with_the_reason,
    the_public_listener_has_no_overrides_api,
);

/// Polls `gw`'s `GET /overrides` until `done` says yes; returns how long it took.
async fn until_listed(gw: &TestGateway, done: impl Fn(&serde_json::Value) -> bool) -> Duration {
    let start = Instant::now();
    loop {
        let listed = admin(gw, Method::GET, "/overrides", "").await.json();
        if done(&listed) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < crate::support::LIVENESS,
            "never applied: {listed}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_share_an_override_through_redis() {
    let redis = RedisServer::start();
    let yaml = format!("store:\n  type: redis\n  url: {}\n{ROUTES}", redis.url());
    let one = TestGateway::start(&yaml).await;
    let two = TestGateway::start(&yaml).await;

    let put = admin(
        &one,
        Method::PUT,
        "/overrides/api/tenant/acme",
        r#"{"limit": 4}"#,
    )
    .await;
    assert_eq!(put.status, 200, "{}", put.text());
    let took = until_listed(&two, |l| l["active"] == 1).await;
    eprintln!("the second instance applied the override after {took:?}");
    // One refresh interval (250 ms) and a Redis call; generous for a loaded machine.
    assert!(took < Duration::from_secs(3), "applied after {took:?}");

    // One shared counter, the override's limit on both instances.
    let mut got = Vec::new();
    for gw in [&one, &two, &one, &two, &one, &two] {
        got.extend(statuses(gw, "acme", 1).await);
    }
    assert_eq!(got, [200, 200, 200, 200, 429, 429]);

    let deleted = admin(&two, Method::DELETE, "/overrides/api/tenant/acme", "").await;
    assert_eq!(deleted.status, 204);
    let took = until_listed(&one, |l| l["active"] == 0).await;
    assert!(took < Duration::from_secs(3), "removed after {took:?}");
    let reply = Client::new()
        .get_with(&one.url("/api/x"), &[("x-tenant", "acme")])
        .await;
    assert_eq!(reply.header_u64("x-ratelimit-limit"), 2);
    // A third instance started now finds the state as it is in Redis.
    let put = admin(
        &two,
        Method::PUT,
        "/overrides/api/tenant/initech",
        r#"{"limit": 3}"#,
    )
    .await;
    assert_eq!(put.status, 200);
    let three = TestGateway::start(&yaml).await;
    assert_eq!(statuses(&three, "initech", 4).await, [200, 200, 200, 429]);
}

const WITH_FILE: &str = r#"
overrides: overrides.yaml
routes:
  - name: api
    match: { prefix: /api }
    respond: { body: ok }
    policies:
      - { name: tenant, key: ["header:x-tenant"], sliding_window: { limit: 2, window: 1h } }
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_overrides_file_applies_and_reloads_and_a_bad_one_keeps_the_last() {
    let file = "- { route: api, policy: tenant, key: acme, limit: 3 }\n";
    let gw = TestGateway::with_files(WITH_FILE, &[("overrides.yaml", file)]).await;
    assert_eq!(statuses(&gw, "acme", 4).await, [200, 200, 200, 429]);
    let path = gw.config_path.with_file_name("overrides.yaml");

    std::fs::write(
        &path,
        "- { route: api, policy: tenant, key: acme, limit: 5 }\n",
    )
    .unwrap();
    gw.running().reload().await.expect("reload");
    assert_eq!(statuses(&gw, "acme", 3).await, [200, 200, 429]);

    // An unknown policy: the reload fails at the file's line, and the last overrides stay.
    std::fs::write(
        &path,
        "- { route: api, policy: tenant, key: acme, limit: 9 }\n- { route: api, policy: nope, key: b, limit: 9 }\n",
    )
    .unwrap();
    let err = gw
        .running()
        .reload()
        .await
        .expect_err("bad overrides")
        .to_string();
    assert!(err.contains("overrides.yaml:2:"), "{err}");
    assert!(err.contains("[1].policy"), "{err}");
    assert_eq!(statuses(&gw, "acme", 1).await, [429]);

    // The API wins over the file for the same key; deleting it gives the file's back.
    let put = admin(
        &gw,
        Method::PUT,
        "/overrides/api/tenant/acme",
        r#"{"limit": 7}"#,
    )
    .await;
    assert_eq!(put.status, 200);
    assert_eq!(statuses(&gw, "acme", 3).await, [200, 200, 429]);
    let listed = admin(&gw, Method::GET, "/overrides", "").await.json();
    assert_eq!(listed["overrides"][0]["source"], "file");
    assert_eq!(listed["overrides"][1]["source"], "api");
}

/// The `PUT` script refuses a new key past the bound, atomically for every instance; replacing
/// an existing key and deleting are always possible.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_override_table_is_bounded_in_redis() {
    let redis = RedisServer::start();
    let store =
        turnstile::limiter::RedisStore::connect(&redis.url(), 1, Duration::from_secs(2), "bound:")
            .expect("store");
    assert!(store.wait_ready(crate::support::LIVENESS).await);
    for key in ["a", "b", "c"] {
        assert!(store.overrides_put(key, "{}", 3).await.expect("put"));
    }
    assert!(
        !store.overrides_put("d", "{}", 3).await.expect("put"),
        "a 4th key"
    );
    assert!(
        store.overrides_put("b", "{}", 3).await.expect("put"),
        "replacing"
    );
    assert!(store.overrides_delete("a").await.expect("delete"));
    assert!(store.overrides_put("d", "{}", 3).await.expect("put"));
    let (version, entries) = store
        .overrides_fetch(None)
        .await
        .expect("fetch")
        .expect("some");
    assert_eq!(entries.len(), 3);
    assert_eq!(version, "6", "one version per change");
    assert!(store
        .overrides_fetch(Some(&version))
        .await
        .expect("fetch")
        .is_none());
}

#[test]
fn an_overrides_file_past_the_bound_is_a_config_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut file = String::new();
    for i in 0..=turnstile::overrides::MAX_OVERRIDES {
        file.push_str(&format!(
            "- {{route: api, policy: tenant, key: k{i}, limit: 3}}\n"
        ));
    }
    std::fs::write(dir.path().join("overrides.yaml"), file).expect("write");
    let config = dir.path().join("policies.yaml");
    std::fs::write(&config, WITH_FILE).expect("write");
    let err = turnstile::config::load(&config)
        .expect_err("too many")
        .to_string();
    assert!(err.contains("10001 overrides; at most 10000"), "{err}");
}

/// One Envoy ext_authz `Check` of `GET path` with `headers`; the gRPC status code of the answer
/// (0: allowed, 8: `RESOURCE_EXHAUSTED`, over the limit).
async fn ext_authz(grpc: std::net::SocketAddr, path: &str, headers: &[(&str, &str)]) -> i32 {
    crate::support::ext_authz::code(grpc, path, headers, -1).await
}

/// Issue 33, item 3, on the doors that never see the response: the cost charged up front (the
/// `fallback`, 8) is at most the burst of the rule admission uses for the key. `tiny`, lowered
/// to a burst of 5, is charged 5 and so admitted once a day (charged 8, more than its bucket
/// holds, it was refused for ever); a key without an override is charged the whole 8 of 10.
async fn a_door_charges_up_front_at_most_the_overrides_burst(store: TestStore) {
    let yaml = store.config(
        r#"
listen: 127.0.0.1:0
admin_listen: 127.0.0.1:0
forward_auth:
  listen: 127.0.0.1:0
  grpc_listen: 127.0.0.1:0
routes:
  - name: llm
    match: { prefix: /v1 }
    respond: { status: 200 }
    policies:
      - name: tokens
        key: ["header:x-tenant"]
        token_bucket: { rate: 1/d, burst: 10 }
        cost: { response_header: x-usage-tokens, fallback: 8 }
"#,
    );
    let gw = TestGateway::start(&yaml).await;
    let put = admin(
        &gw,
        Method::PUT,
        "/overrides/llm/tokens/tiny",
        r#"{"burst": 5}"#,
    )
    .await;
    assert_eq!(put.status, 200, "{}", put.text());
    let grpc = gw.running().ext_authz_addr.expect("grpc_listen");
    let mut got = Vec::new();
    for tenant in ["tiny", "tiny", "plain", "plain"] {
        got.push(ext_authz(grpc, "/v1/chat", &[("x-tenant", tenant)]).await);
    }
    assert_eq!(got, [0, 8, 0, 8]);
}

/// Waits until the store's epoch has held still for 500 ms: a Redis store's first connections
/// each start a new epoch (refusals cached before say nothing after), which would forget cached
/// refusals for a reason other than the one a test looks at.
async fn settled(gw: &TestGateway) {
    let epoch = || gw.running().state.engine.store().epoch();
    let start = Instant::now();
    let (mut seen, mut since) = (epoch(), Instant::now());
    while since.elapsed() < Duration::from_millis(500) {
        assert!(
            start.elapsed() < crate::support::LIVENESS,
            "the epoch never settled"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        if epoch() != seen {
            (seen, since) = (epoch(), Instant::now());
        }
    }
}

/// A bucket of 1 refilled once an hour (`$RULE` is the policy's rule).
const SLOW_BUCKET: &str = r#"
routes:
  - name: api
    match: { prefix: /api }
    respond: { body: ok }
    policies:
      - { name: tenant, key: ["header:x-tenant"], $RULE }
"#;

/// Issue 33, item 4: a refusal cached under one rule is not replayed after the counter's rule
/// changed and changed back. `acme` is refused under the policy's bucket (1, refilled once an
/// hour: a cached refusal for an hour); a faster rule then refills the counter and a request
/// under it leaves one token; back under the first rule that token admits one request. Here the
/// change and the change back are an override `PUT` and `DELETE`.
async fn an_override_put_then_delete_replays_no_cached_refusal(store: TestStore) {
    let slow = "token_bucket: { rate: 1/h, burst: 1 }";
    let gw = TestGateway::start(&store.config(&SLOW_BUCKET.replace("$RULE", slow))).await;
    settled(&gw).await;
    let hits = || async {
        gw.metric(
            "turnstile_deny_cache_hits_total",
            &[("store", store.name())],
        )
        .await
    };

    // Override PUT, then DELETE.
    assert_eq!(statuses(&gw, "acme", 3).await, [200, 429, 429]);
    assert_eq!(hits().await, 1.0, "the second refusal came from the cache");
    let put = admin(
        &gw,
        Method::PUT,
        "/overrides/api/tenant/acme",
        r#"{"rate": "1000/s", "burst": 2}"#,
    )
    .await;
    assert_eq!(put.status, 200, "{}", put.text());
    tokio::time::sleep(Duration::from_millis(20)).await;
    let reply = Client::new()
        .get_with(&gw.url("/api/x"), &[("x-tenant", "acme")])
        .await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header_u64("x-ratelimit-remaining"), 1);
    let deleted = admin(&gw, Method::DELETE, "/overrides/api/tenant/acme", "").await;
    assert_eq!(deleted.status, 204);
    assert_eq!(statuses(&gw, "acme", 3).await, [200, 429, 429]);
}

/// [`an_override_put_then_delete_replays_no_cached_refusal`], the rule changed and changed back
/// by a config reload A, B, A.
async fn a_reload_a_b_a_replays_no_cached_refusal(store: TestStore) {
    let slow = "token_bucket: { rate: 1/h, burst: 1 }";
    let fast = "token_bucket: { rate: 1000/s, burst: 2 }";
    let yaml = |rule: &str| store.config(&SLOW_BUCKET.replace("$RULE", rule));
    let gw = TestGateway::start(&yaml(slow)).await;
    settled(&gw).await;
    assert_eq!(statuses(&gw, "globex", 3).await, [200, 429, 429]);
    let hits = gw
        .metric(
            "turnstile_deny_cache_hits_total",
            &[("store", store.name())],
        )
        .await;
    assert_eq!(hits, 1.0, "the second refusal came from the cache");
    std::fs::write(&gw.config_path, yaml(fast)).expect("write");
    gw.running()
        .reload()
        .await
        .expect("reload to the fast rule");
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(statuses(&gw, "globex", 1).await, [200]);
    std::fs::write(&gw.config_path, yaml(slow)).expect("write");
    gw.running().reload().await.expect("reload back");
    assert_eq!(statuses(&gw, "globex", 2).await, [200, 429]);
}

const TWO_PARTS: &str = r#"
routes:
  - name: api
    match: { prefix: /api }
    respond: { body: ok }
    policies:
      - { name: tenant, key: ["header:x-tenant", "header:x-user"], sliding_window: { limit: 2, window: 1h } }
"#;

/// Issue 33 (smaller finding): an override whose key could never be one of the policy's
/// counters is refused at `PUT` with the reason, and one that a reload leaves with the wrong
/// shape is listed `active: false` and not applied.
async fn an_override_that_could_never_match_is_refused_and_never_listed_active(store: TestStore) {
    let gw = TestGateway::start(&store.config(ROUTES)).await;
    for (key, says) in [
        (
            "acme|bob",
            "names 2 values but policy `tenant` keys on 1 part",
        ),
        ("acme%7Cbob", ""),
        ("a%20b", ""),
        ("a b", "writes that value as `a%20b`"),
        ("a%41", "writes that value as `aA`"),
        ("a{b}", "`a%7Bb%7D`"),
    ] {
        let path = format!(
            "/overrides/api/tenant/{}",
            key.replace('%', "%25").replace(' ', "%20")
        );
        let reply = admin(&gw, Method::PUT, &path, r#"{"limit": 5}"#).await;
        if says.is_empty() {
            assert_eq!(reply.status, 200, "{key}: {}", reply.text());
        } else {
            assert_eq!(reply.status, 400, "{key}: {}", reply.text());
            assert!(reply.text().contains(says), "{key}: {}", reply.text());
        }
    }
    let listed = admin(&gw, Method::GET, "/overrides", "").await.json();
    assert_eq!(listed["active"], 2, "{listed}");

    // The policy keys on two parts now: a one-part override can match nothing.
    let two = TestGateway::start(&store.config(TWO_PARTS)).await;
    let put = admin(
        &two,
        Method::PUT,
        "/overrides/api/tenant/acme|bob",
        r#"{"limit": 3}"#,
    )
    .await;
    assert_eq!(put.status, 200, "{}", put.text());
    let mut got = Vec::new();
    for _ in 0..4 {
        let reply = Client::new()
            .get_with(
                &two.url("/api/x"),
                &[("x-tenant", "acme"), ("x-user", "bob")],
            )
            .await;
        got.push(reply.status);
    }
    assert_eq!(got, [200, 200, 200, 429]);
    std::fs::write(&two.config_path, store.config(ROUTES)).expect("write");
    two.running().reload().await.expect("reload");
    let listed = admin(&two, Method::GET, "/overrides", "").await.json();
    let entry = listed["overrides"]
        .as_array()
        .and_then(|all| all.iter().find(|o| o["key"] == "acme|bob"))
        .unwrap_or_else(|| panic!("not listed: {listed}"));
    assert_eq!(entry["active"], false, "{listed}");
    // (On Redis the two instances share the first one's two overrides.)
    let others = if store.name() == "redis" { 2 } else { 0 };
    assert_eq!(listed["active"], others, "{listed}");
    let got = statuses(&two, "acme", 3).await;
    assert_eq!(got, [200, 200, 429], "the policy's limit of 2 applies");
}

/// In the overrides file, a key that could never match is a config error at its line, and a
/// reload that brings one keeps the overrides in force.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overrides_file_key_that_could_never_match_is_an_error_at_its_line() {
    let file = "- { route: api, policy: tenant, key: acme, limit: 3 }\n";
    let gw = TestGateway::with_files(WITH_FILE, &[("overrides.yaml", file)]).await;
    let path = gw.config_path.with_file_name("overrides.yaml");
    std::fs::write(
        &path,
        "- { route: api, policy: tenant, key: acme, limit: 9 }\n- { route: api, policy: tenant, key: \"a|b\", limit: 9 }\n",
    )
    .unwrap();
    let err = gw
        .running()
        .reload()
        .await
        .expect_err("a key of two parts")
        .to_string();
    assert!(err.contains("overrides.yaml:2:"), "{err}");
    assert!(err.contains("[1].key"), "{err}");
    assert!(err.contains("names 2 values"), "{err}");
    assert_eq!(statuses(&gw, "acme", 4).await, [200, 200, 200, 429]);
}
