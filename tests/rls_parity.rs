//! Parity with envoyproxy/ratelimit as it is today: its own `examples/ratelimit/config/
//! example.yaml` loads, `quota_mode` decides the overall code as it does, and `metadata` comes
//! back in `dynamic_metadata` when `rls.response_dynamic_metadata` is on. On both stores.

mod support;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{Struct, Value};
use support::rls::{call, descriptor, request, start_with};
use support::stores::TestStore;
use turnstile::rls::{LoadOptions, RlsConfig};

const OK: i32 = Code::Ok as i32;
const OVER: i32 = Code::OverLimit as i32;

fn example() -> String {
    std::fs::read_to_string(support::tools::repo_path(
        "tests/fixtures/envoy-ratelimit/example.yaml",
    ))
    .expect("the example fixture")
}

#[test]
fn upstreams_example_yaml_loads() {
    let path = support::tools::repo_path("tests/fixtures/envoy-ratelimit/example.yaml");
    let text = example();
    assert!(text.contains("quota_mode: true") && text.contains("metadata:"));
    RlsConfig::load(&path, LoadOptions::default())
        .unwrap_or_else(|e| panic!("upstream's example must load: {e}"));
}

fn codes(response: &RateLimitResponse) -> (i32, Vec<i32>) {
    (
        response.overall_code,
        response.statuses.iter().map(|s| s.code).collect(),
    )
}

fn field<'s>(s: &'s Struct, name: &str) -> &'s Value {
    s.fields
        .get(name)
        .unwrap_or_else(|| panic!("no `{name}` in {s:?}"))
}

fn text(v: &Value) -> &str {
    match &v.kind {
        Some(Kind::StringValue(s)) => s,
        other => panic!("not a string: {other:?}"),
    }
}

fn structure(v: &Value) -> &Struct {
    match &v.kind {
        Some(Kind::StructValue(s)) => s,
        other => panic!("not a struct: {other:?}"),
    }
}

/// Two quota descriptors (1/min and 2/min): OK while one of them has room, even when the other is
/// over; OVER_LIMIT once both are. The passed descriptors' `metadata` is returned.
async fn quota_descriptors_refuse_only_when_all_are_over(store: TestStore) {
    let rls = start_with(
        &[("example.yaml", &example())],
        "  response_dynamic_metadata: true\n",
        &store.yaml(),
    )
    .await;
    let mut client = rls.client().await;
    let both = || {
        request(
            "rl",
            vec![
                descriptor(&[("service", "service_1")]),
                descriptor(&[("service", "service_2")]),
            ],
        )
    };
    assert_eq!(codes(&call(&mut client, both()).await), (OK, vec![OK, OK]));

    let second = call(&mut client, both()).await;
    assert_eq!(codes(&second), (OK, vec![OVER, OK]), "one quota left: OK");
    let metadata = second.dynamic_metadata.as_ref().expect("dynamic_metadata");
    assert_eq!(text(field(metadata, "domain")), "rl");
    let Some(Kind::ListValue(descriptors)) = &field(metadata, "descriptors").kind else {
        panic!("descriptors is a list: {metadata:?}");
    };
    assert_eq!(descriptors.values.len(), 2);
    let Some(Kind::ListValue(entries)) = &field(structure(&descriptors.values[0]), "entries").kind
    else {
        panic!("entries is a list");
    };
    assert_eq!(text(&entries.values[0]), "service=service_1");
    let passed = structure(field(metadata, "metadata"));
    let service = structure(field(passed, "service_with_quota"));
    assert_eq!(
        text(field(service, "name")),
        "service_2",
        "only the descriptor that passed gives its metadata"
    );

    assert_eq!(
        codes(&call(&mut client, both()).await),
        (OVER, vec![OVER, OVER]),
        "every quota descriptor over: OVER_LIMIT"
    );
    rls.stop().await;
}

/// A descriptor not in quota mode that is over makes the answer OVER_LIMIT whatever the quota
/// descriptors say; without the setting there is no dynamic_metadata.
async fn a_limit_descriptor_over_refuses_whatever_the_quotas(store: TestStore) {
    let rls = start_with(&[("example.yaml", &example())], "", &store.yaml()).await;
    let mut client = rls.client().await;
    let limited = || descriptor(&[("foo", "z")]);
    for _ in 0..2 {
        let r = call(&mut client, request("rl", vec![limited()])).await;
        assert_eq!(codes(&r), (OK, vec![OK]));
        assert!(r.dynamic_metadata.is_none());
    }
    let mixed = call(
        &mut client,
        request(
            "rl",
            vec![descriptor(&[("service", "service_2")]), limited()],
        ),
    )
    .await;
    assert_eq!(codes(&mixed), (OVER, vec![OK, OVER]));
    // Nothing was consumed by the refused call: service_2 still has both of its requests.
    for _ in 0..2 {
        let r = call(
            &mut client,
            request("rl", vec![descriptor(&[("service", "service_2")])]),
        )
        .await;
        assert_eq!(codes(&r), (OK, vec![OK]));
    }
    rls.stop().await;
}

crate::store_matrix!(
    quota_descriptors_refuse_only_when_all_are_over,
    a_limit_descriptor_over_refuses_whatever_the_quotas,
);
