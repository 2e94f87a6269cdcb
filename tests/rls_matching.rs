//! Lookups in a compiled envoyproxy/ratelimit config follow its matching rules: exact value, then
//! the first wildcard, then key only; limits only at the request's exact depth; a node with
//! neither limit nor children whitelists. Also the names of counters and metrics, and our
//! extensions (`algorithm`, `token_bucket`).

use std::time::Duration;

use turnstile::rls::{Algorithm, Entry, LoadOptions, RlsConfig, Rule, Unit};

fn config(text: &str) -> RlsConfig {
    RlsConfig::from_sources(&[("test.yaml", text)], LoadOptions::default())
        .unwrap_or_else(|e| panic!("{e}"))
}

fn error(text: &str) -> String {
    match RlsConfig::from_sources(&[("test.yaml", text)], LoadOptions::default()) {
        Ok(_) => panic!("loaded, expected an error"),
        Err(e) => e.to_string(),
    }
}

fn fixture(name: &str) -> RlsConfig {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/envoy-ratelimit-config/test-config")
        .join(name);
    RlsConfig::load(&path, LoadOptions::default()).unwrap_or_else(|e| panic!("{e}"))
}

fn find<'c>(config: &'c RlsConfig, entries: &[Entry<'_>]) -> Option<&'c Rule> {
    config.lookup("test-domain", entries).map(|(_, rule)| rule)
}

/// The (requests_per_unit, unit) a request descriptor is limited to.
fn limit(config: &RlsConfig, entries: &[Entry<'_>]) -> Option<(u32, Option<Unit>)> {
    find(config, entries).map(|r| (r.requests_per_unit, r.unit))
}

fn key(rule: &Rule, entries: &[Entry<'_>]) -> String {
    let mut out = String::new();
    rule.write_counter_key(entries, &mut out);
    out
}

#[test]
fn basic_config_matches_like_envoyproxy_ratelimit() {
    let c = fixture("basic_config.yaml");
    let (sec, min) = (Some(Unit::Second), Some(Unit::Minute));
    // A node with children but no limit of its own.
    assert_eq!(limit(&c, &[("key1", "value1")]), None);
    // Key-only default below it, and the exact override.
    assert_eq!(
        limit(&c, &[("key1", "value1"), ("subkey1", "x")]),
        Some((5, sec))
    );
    assert_eq!(
        limit(&c, &[("key1", "value1"), ("subkey1", "subvalue1")]),
        Some((10, sec))
    );
    // No deeper matches than the config.
    assert_eq!(
        limit(&c, &[("key1", "value1"), ("subkey1", "x"), ("more", "y")]),
        None
    );
    assert_eq!(limit(&c, &[("key1", "other"), ("subkey1", "x")]), None);
    assert_eq!(limit(&c, &[("key2", "anything")]), Some((20, min)));
    assert_eq!(limit(&c, &[("key2", "value2")]), Some((30, min)));
    // value3 has neither limit nor children: whitelisted, the key-only default does not apply.
    assert_eq!(limit(&c, &[("key2", "value3")]), None);
    assert_eq!(limit(&c, &[("key2", "value2"), ("sub", "x")]), None);
    assert_eq!(limit(&c, &[("key3", "x")]), Some((1, Some(Unit::Hour))));
    let key4 = find(&c, &[("key4", "x")]).expect("key4");
    assert_eq!(key4.name.as_deref(), Some("key4_rate_limit"));
    assert_eq!(
        limit(&c, &[("key5", "value5")]),
        Some((15, Some(Unit::Day)))
    );
    assert_eq!(
        limit(&c, &[("key5", "value5"), ("subkey5", "subvalue5")]),
        Some((25, Some(Unit::Day)))
    );
    assert_eq!(limit(&c, &[("key5", "value5"), ("subkey5", "other")]), None);
    let key6 = find(&c, &[("key6", "x")]).expect("key6");
    assert_eq!(key6.algorithm, Algorithm::Unlimited);
    assert_eq!(key6.unit, None);
    // Unknown domains, keys and empty descriptors match nothing.
    assert!(c.lookup("other-domain", &[("key2", "x")]).is_none());
    assert_eq!(limit(&c, &[("nokey", "x")]), None);
    assert_eq!(limit(&c, &[]), None);
}

#[test]
fn the_default_algorithm_is_an_exact_sliding_window_of_one_unit() {
    let c = fixture("basic_config.yaml");
    let rule = find(&c, &[("key2", "x")]).expect("key2");
    assert_eq!(
        rule.algorithm,
        Algorithm::SlidingWindow {
            limit: 20,
            window: Duration::from_secs(60)
        }
    );
}

#[test]
fn wildcards_match_anywhere_and_exact_values_win() {
    let c = fixture("wildcard.yaml");
    assert!(find(&c, &[("wild", "foo")]).is_some());
    assert!(find(&c, &[("wild", "foobar")]).is_some());
    assert!(find(&c, &[("wild", "fo")]).is_none());
    assert!(find(&c, &[("noWild", "foo")]).is_some());
    assert!(find(&c, &[("noWild", "foo1")]).is_none());
    assert!(find(&c, &[("noVal", "anything")]).is_some());
    assert!(find(&c, &[("midWild", "barb")]).is_some());
    assert!(find(&c, &[("midWild", "bar-x-b")]).is_some());
    assert!(find(&c, &[("midWild", "bar-x-c")]).is_none());
    assert_eq!(
        limit(&c, &[("multiWild", "foo1bar2baz")]),
        Some((10, Some(Unit::Minute)))
    );
    assert!(find(&c, &[("multiWild", "foo1baz")]).is_none());
    assert!(find(&c, &[("nestedWild", "val1"), ("wild", "goo42")]).is_some());
    assert!(find(&c, &[("nestedWild", "val1"), ("wild", "foo42")]).is_none());

    let s = fixture("share_threshold.yaml");
    assert_eq!(limit(&s, &[("file", "test1")]).map(|l| l.0), Some(50));
    assert_eq!(limit(&s, &[("file", "test2")]).map(|l| l.0), Some(100));
}

#[test]
fn the_first_wildcard_in_config_order_wins_and_key_only_comes_last() {
    let c = config(
        "domain: test-domain
descriptors:
  - key: path
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: path
    value: /api/*
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: path
    value: /api/v1*
    rate_limit: {unit: second, requests_per_unit: 2}
",
    );
    assert_eq!(
        limit(&c, &[("path", "/api/v1/users")]).map(|l| l.0),
        Some(1)
    );
    assert_eq!(limit(&c, &[("path", "/other")]).map(|l| l.0), Some(3));
}

#[test]
fn counters_are_per_distinct_value_unless_a_wildcard_shares_its_threshold() {
    let c = fixture("share_threshold.yaml");
    let a = [("files", "files/a")];
    let b = [("files", "files/b")];
    let rule = find(&c, &a).expect("files/*");
    assert_eq!(key(rule, &a), key(rule, &b), "share_threshold: one counter");

    let integration = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/envoy-ratelimit-config/integration");
    let i = RlsConfig::load(&integration, LoadOptions::default()).expect("integration");
    let a = [("files_no_share", "files_no_share/a")];
    let b = [("files_no_share", "files_no_share/b")];
    let (_, rule) = i
        .lookup("share-threshold-test", &a)
        .expect("files_no_share/*");
    assert_ne!(
        key(rule, &a),
        key(rule, &b),
        "no share_threshold: a counter per value"
    );

    // Key-only: a counter per value; the key names the domain and every entry.
    let c = fixture("basic_config.yaml");
    let x = [("key1", "value1"), ("subkey1", "x")];
    let y = [("key1", "value1"), ("subkey1", "y")];
    let rule = find(&c, &x).expect("subkey1");
    assert_ne!(key(rule, &x), key(rule, &y));
    assert_eq!(key(rule, &x), "test-domain|key1=value1|subkey1=x|sw1");
}

#[test]
fn counter_keys_escape_separators() {
    let c = config(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1}\n",
    );
    let (_, rule) = c.lookup("d", &[("k", "a|k=b")]).expect("k");
    let mut tricky = String::new();
    rule.write_counter_key(&[("k", "a|k=b")], &mut tricky);
    assert_eq!(tricky, "d|k=a\\|k\\=b|sw3600");
}

#[test]
fn metric_names_follow_detailed_metric_value_to_metric_and_share_threshold() {
    let c = fixture("basic_config.yaml");
    let e = [("key2", "v9")];
    assert_eq!(find(&c, &e).expect("key2").metric_descriptor(&e), "key2");
    let e = [("key1", "value1"), ("subkey1", "s")];
    assert_eq!(
        find(&c, &e).expect("sub").metric_descriptor(&e),
        "key1_value1.subkey1"
    );
    // detailed_metric: the request's value is named.
    let e = [("key7", "v7")];
    assert_eq!(find(&c, &e).expect("key7").metric_descriptor(&e), "key7_v7");

    let s = fixture("share_threshold.yaml");
    let e = [("service", "svc/a"), ("endpoint", "/x")];
    let rule = find(&s, &e).expect("service");
    assert_eq!(rule.metric_descriptor(&e), "service_svc/*.endpoint_/x");
    // share_threshold takes priority over value_to_metric.
    let e = [("route", "api/x"), ("method", "GET")];
    assert_eq!(
        find(&s, &e).expect("route").metric_descriptor(&e),
        "route_api/*.method"
    );
    let c = config(
        "domain: test-domain
descriptors:
  - key: tenant
    value_to_metric: true
    descriptors:
      - key: path
        rate_limit: {unit: second, requests_per_unit: 1}
",
    );
    let e = [("tenant", "acme"), ("path", "/p")];
    assert_eq!(
        find(&c, &e).expect("tenant").metric_descriptor(&e),
        "tenant_acme.path"
    );
}

#[test]
fn shadow_mode_is_per_rule() {
    let c = fixture("shadowmode_config.yaml");
    assert!(find(&c, &[("key2", "x")]).expect("key2").shadow_mode);
    assert!(!find(&c, &[("key2", "value2")]).expect("value2").shadow_mode);
    let e = [("key1", "value1"), ("subkey1", "subvalue1")];
    assert!(find(&c, &e).expect("sub").shadow_mode);
}

#[test]
fn replaces_and_names_are_kept() {
    let c = config(
        "domain: test-domain
descriptors:
  - key: a
    rate_limit: {unit: second, requests_per_unit: 1, name: wide}
  - key: b
    rate_limit: {unit: second, requests_per_unit: 9, name: narrow, replaces: [{name: wide}]}
",
    );
    let rule = find(&c, &[("b", "x")]).expect("b");
    assert_eq!(rule.name.as_deref(), Some("narrow"));
    assert_eq!(&*rule.replaces, &["wide".into()] as &[Box<str>]);
}

#[test]
fn fixed_window_for_a_domain_or_a_rule() {
    let c = config(
        "domain: test-domain
algorithm: fixed_window
descriptors:
  - key: a
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: b
    rate_limit: {unit: minute, requests_per_unit: 5, algorithm: sliding_window}
",
    );
    let window = Duration::from_secs(60);
    let fixed = Algorithm::FixedWindow { limit: 5, window };
    let sliding = Algorithm::SlidingWindow { limit: 5, window };
    assert_eq!(find(&c, &[("a", "x")]).expect("a").algorithm, fixed);
    assert_eq!(find(&c, &[("b", "x")]).expect("b").algorithm, sliding);
    let err = error("domain: d\nalgorithm: leaky\n");
    assert_eq!(
        err,
        "test.yaml:2: invalid algorithm 'leaky' (expected sliding_window or fixed_window) (field algorithm)"
    );
}

#[test]
fn token_bucket_descriptors() {
    let c = config(
        "domain: test-domain
descriptors:
  - key: a
    token_bucket: {unit: minute, requests_per_unit: 120, burst: 10, name: tb}
  - key: b
    token_bucket: {unit: second, requests_per_unit: 4}
",
    );
    let a = find(&c, &[("a", "x")]).expect("a");
    assert_eq!(
        a.algorithm,
        Algorithm::TokenBucket {
            rate_per_sec: 2.0,
            burst: 10
        }
    );
    assert_eq!((a.requests_per_unit, a.unit), (120, Some(Unit::Minute)));
    assert_eq!(a.name.as_deref(), Some("tb"));
    let b = find(&c, &[("b", "x")]).expect("b");
    assert_eq!(
        b.algorithm,
        Algorithm::TokenBucket {
            rate_per_sec: 4.0,
            burst: 4
        }
    );
    let both = "domain: d
descriptors:
  - key: a
    rate_limit: {unit: second, requests_per_unit: 1}
    token_bucket: {unit: second, requests_per_unit: 1}
";
    assert!(
        error(both).starts_with("test.yaml:5: a descriptor has either rate_limit or token_bucket")
    );
    let zero = "domain: d\ndescriptors:\n  - key: a\n    token_bucket: {unit: second, requests_per_unit: 1, burst: 0}\n";
    assert!(
        error(zero).contains("burst of at least 1"),
        "{}",
        error(zero)
    );
    let unlimited = "domain: d\ndescriptors:\n  - key: a\n    token_bucket: {unlimited: true}\n";
    assert!(error(unlimited).contains("unknown key 'unlimited'"));
}

#[test]
fn wrong_types_are_errors_with_the_field() {
    let err = error("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: -1}\n");
    assert_eq!(
        err,
        "test.yaml:4: config error, -1 is not an unsigned 32-bit integer (field descriptors[0].rate_limit.requests_per_unit)"
    );
    let err = error("domain: d\ndescriptors:\n  - key: a\n    shadow_mode: maybe\n");
    assert!(
        err.contains("expected true or false (field descriptors[0].shadow_mode)"),
        "{err}"
    );
    let err = error("domain: d\ndescriptors: {key: a}\n");
    assert!(err.contains("expected a list (field descriptors)"), "{err}");
    let err = error("domain: d\ndomain: e\n");
    assert!(
        err.starts_with("test.yaml:2: config error, duplicate key 'domain'"),
        "{err}"
    );
    // Values are strings as written, like yaml.v2 reads them.
    let c = config("domain: d\ndescriptors:\n  - key: code\n    value: 429\n    rate_limit: {unit: second, requests_per_unit: 1}\n");
    assert!(c.lookup("d", &[("code", "429")]).is_some());
}

#[test]
fn unlimited_without_a_valid_unit_loads_like_envoyproxy_ratelimit() {
    let c = config("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unlimited: true, requests_per_unit: 5}\n");
    let (_, rule) = c.lookup("d", &[("a", "x")]).expect("a");
    assert_eq!(rule.algorithm, Algorithm::Unlimited);
    let err =
        error("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {requests_per_unit: 5}\n");
    assert!(err.contains("invalid rate limit unit ''"), "{err}");
}
