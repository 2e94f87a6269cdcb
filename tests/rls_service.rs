//! `ShouldRateLimit` over real gRPC (and `POST /json`) against a running Turnstile, on both stores
//! (`memory::` and `redis::`, see `support::stores`): envoyproxy/ratelimit's semantics, with exact
//! counts.

mod support;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::google::protobuf::UInt64Value;
use prost::Message;
use support::rls::{call, descriptor, raw_call, request, start, start_with};
use support::stores::TestStore;

const OK: i32 = Code::Ok as i32;
const OVER: i32 = Code::OverLimit as i32;

const CONFIG: &str = "domain: shop
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: user
    value: vip
    rate_limit: {unlimited: true}
  - key: user
    value: free
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: tenant
    descriptors:
      - key: path
        rate_limit: {unit: hour, requests_per_unit: 2, name: per_path}
  - key: tenant_wide
    rate_limit: {unit: hour, requests_per_unit: 1, name: tenant_wide}
  - key: narrow
    rate_limit: {unit: hour, requests_per_unit: 5, name: narrow, replaces: [{name: tenant_wide}]}
  - key: fixed
    rate_limit: {unit: hour, requests_per_unit: 2, algorithm: fixed_window}
  - key: bucket
    token_bucket: {unit: hour, requests_per_unit: 1, burst: 2}
  - key: half_hour
    rate_limit: {unit: minute, unit_multiplier: 30, requests_per_unit: 2}
  - key: half_hour_fixed
    rate_limit: {unit: minute, unit_multiplier: 30, requests_per_unit: 2, algorithm: fixed_window}
";

async fn exact_counts_statuses_in_order_and_unknowns(store: TestStore) {
    let rls = start_with(&[("shop.yaml", CONFIG)], "", &store.yaml()).await;
    let mut c = rls.client().await;

    let mut codes = Vec::new();
    for _ in 0..5 {
        let r = call(
            &mut c,
            request("shop", vec![descriptor(&[("user", "alice")])]),
        )
        .await;
        codes.push(r.overall_code);
        let s = &r.statuses[0];
        let limit = s.current_limit.as_ref().expect("current_limit");
        assert_eq!((limit.requests_per_unit, limit.unit), (3, 2));
        assert!(s.duration_until_reset.is_some());
        if s.code == OVER {
            assert_eq!(s.limit_remaining, 0);
        }
    }
    assert_eq!(codes, [OK, OK, OK, OVER, OVER], "3 per minute, exactly");
    // Another value of a key-only descriptor has its own counter.
    let r = call(
        &mut c,
        request("shop", vec![descriptor(&[("user", "bob")])]),
    )
    .await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, 2));

    // Unlimited, whitelisted, unknown domain and unmatched: OK; only unlimited reports u32::MAX.
    let r = call(
        &mut c,
        request(
            "shop",
            vec![
                descriptor(&[("user", "vip")]),
                descriptor(&[("user", "free")]),
                descriptor(&[("nothing", "here")]),
                descriptor(&[("user", "alice")]),
            ],
        ),
    )
    .await;
    assert_eq!(
        r.overall_code, OVER,
        "any descriptor over makes the request over"
    );
    let codes: Vec<i32> = r.statuses.iter().map(|s| s.code).collect();
    assert_eq!(codes, [OK, OK, OK, OVER], "statuses in request order");
    assert_eq!(r.statuses[0].limit_remaining, u32::MAX);
    assert!(r.statuses[0].current_limit.is_none());
    assert!(r.statuses[1].current_limit.is_none() && r.statuses[2].current_limit.is_none());
    let r = call(
        &mut c,
        request("elsewhere", vec![descriptor(&[("user", "x")])]),
    )
    .await;
    assert_eq!(r.overall_code, OK);
    assert!(r.statuses[0].current_limit.is_none());

    // An empty domain is an error, as in envoyproxy/ratelimit.
    let err = c
        .should_rate_limit(request("", vec![descriptor(&[("user", "x")])]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    rls.stop().await;
}

async fn shadow_mode_counts_but_never_rejects(store: TestStore) {
    let rls = start_with(&[("shop.yaml", CONFIG)], "", &store.yaml()).await;
    let mut c = rls.client().await;
    for _ in 0..4 {
        let r = call(
            &mut c,
            request("shop", vec![descriptor(&[("shadow", "s")])]),
        )
        .await;
        assert_eq!(r.overall_code, OK);
    }
    let labels = [("descriptor", "shadow"), ("domain", "shop")];
    for (stat, want) in [
        ("total_hits", 4.0),
        ("within_limit", 1.0),
        ("over_limit", 3.0),
        ("shadow_mode", 3.0),
    ] {
        let name = format!("turnstile_rls_{stat}");
        assert_eq!(rls.metric(&name, &labels).await, want, "{stat}");
    }
    rls.stop().await;
}

async fn depth_replaces_and_two_descriptors_in_one_request(store: TestStore) {
    let rls = start_with(&[("shop.yaml", CONFIG)], "", &store.yaml()).await;
    let mut c = rls.client().await;
    // Nested: only at the exact depth.
    let r = call(
        &mut c,
        request("shop", vec![descriptor(&[("tenant", "t")])]),
    )
    .await;
    assert!(r.statuses[0].current_limit.is_none());
    let nested = || descriptor(&[("tenant", "t"), ("path", "/a")]);
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(
            call(&mut c, request("shop", vec![nested()]))
                .await
                .overall_code,
        );
    }
    assert_eq!(got, [OK, OK, OVER]);
    let r = call(&mut c, request("shop", vec![nested()])).await;
    assert_eq!(
        r.statuses[0].current_limit.as_ref().unwrap().name,
        "per_path"
    );

    // `narrow` replaces `tenant_wide` (1/hour) in the same request: 5 pass, not 1.
    let both = || {
        request(
            "shop",
            vec![
                descriptor(&[("tenant_wide", "t")]),
                descriptor(&[("narrow", "n")]),
            ],
        )
    };
    let mut got = Vec::new();
    for _ in 0..6 {
        got.push(call(&mut c, both()).await.overall_code);
    }
    assert_eq!(got, [OK, OK, OK, OK, OK, OVER]);
    // Alone, tenant_wide applies.
    let alone = request("shop", vec![descriptor(&[("tenant_wide", "t")])]);
    assert_eq!(call(&mut c, alone.clone()).await.overall_code, OK);
    assert_eq!(call(&mut c, alone).await.overall_code, OVER);

    // Two descriptors, both enforced, all-or-nothing: a request over on one consumes nothing.
    let pair = |a: &str, b: &str| {
        request(
            "shop",
            vec![
                descriptor(&[("tenant", a), ("path", "/p")]),
                descriptor(&[("user", b)]),
            ],
        )
    };
    assert_eq!(call(&mut c, pair("a1", "u")).await.overall_code, OK);
    assert_eq!(call(&mut c, pair("a1", "u")).await.overall_code, OK);
    let r = call(&mut c, pair("a1", "u")).await;
    assert_eq!(
        (r.overall_code, r.statuses[0].code, r.statuses[1].code),
        (OVER, OVER, OK)
    );
    assert_eq!(
        r.statuses[1].limit_remaining, 1,
        "user u: the state without this rejected request"
    );
    assert_eq!(call(&mut c, pair("a2", "u")).await.overall_code, OK);
    let r = call(&mut c, pair("a2", "u")).await;
    assert_eq!(
        (r.overall_code, r.statuses[0].code, r.statuses[1].code),
        (OVER, OK, OVER),
        "now the user limit holds the request back"
    );
    rls.stop().await;
}

async fn hits_addend_overrides_fixed_windows_and_token_buckets(store: TestStore) {
    let rls = start_with(&[("shop.yaml", CONFIG)], "", &store.yaml()).await;
    let mut c = rls.client().await;
    // Request-level hits_addend: 0 means 1; 2 takes two units.
    let mut r = request("shop", vec![descriptor(&[("user", "h")])]);
    r.hits_addend = 2;
    assert_eq!(call(&mut c, r.clone()).await.statuses[0].limit_remaining, 1);
    // Per descriptor, 0 checks without consuming.
    let mut peek = descriptor(&[("user", "h")]);
    peek.hits_addend = Some(UInt64Value { value: 0 });
    for _ in 0..3 {
        let s = &call(&mut c, request("shop", vec![peek.clone()]))
            .await
            .statuses[0];
        assert_eq!((s.code, s.limit_remaining), (OK, 1));
    }
    assert_eq!(
        call(&mut c, r).await.overall_code,
        OVER,
        "2 more do not fit"
    );

    // Envoy's limit override replaces the config's limit for that descriptor.
    let mut over = descriptor(&[("user", "o")]);
    over.limit = Some(RateLimitOverride {
        requests_per_unit: 1,
        unit: 3,
    });
    let s = call(&mut c, request("shop", vec![over.clone()])).await;
    let limit = s.statuses[0].current_limit.clone().expect("limit");
    assert_eq!((limit.requests_per_unit, limit.unit), (1, 3));
    assert_eq!(
        call(&mut c, request("shop", vec![over])).await.overall_code,
        OVER
    );

    // Fixed window: 2 per calendar hour, reset within the hour.
    let mut got = Vec::new();
    for _ in 0..3 {
        let r = call(&mut c, request("shop", vec![descriptor(&[("fixed", "f")])])).await;
        let reset = r.statuses[0].duration_until_reset.expect("reset");
        assert!(reset.seconds <= 3600, "{reset:?}");
        got.push(r.overall_code);
    }
    assert_eq!(got, [OK, OK, OVER]);

    // Token bucket: burst 2, then empty (refills 1 per hour).
    let mut got = Vec::new();
    for _ in 0..3 {
        let r = call(
            &mut c,
            request("shop", vec![descriptor(&[("bucket", "b")])]),
        )
        .await;
        got.push(r.overall_code);
    }
    assert_eq!(got, [OK, OK, OVER]);
    rls.stop().await;
}

async fn json_health_and_response_headers(store: TestStore) {
    let rls = start_with(
        &[("shop.yaml", CONFIG)],
        "  response_headers: true\n",
        &store.yaml(),
    )
    .await;
    let body = r#"{"domain":"shop","descriptors":[{"entries":[{"key":"user","value":"j"}]}]}"#;
    for expected in [200, 200, 200] {
        let (status, text) = rls.admin("POST", "/json", body).await;
        assert_eq!(status, expected, "{text}");
        assert!(text.contains(r#""overallCode":"OK""#), "{text}");
        assert!(text.contains(r#""RateLimit-Limit""#), "{text}");
    }
    let (status, text) = rls.admin("POST", "/json", body).await;
    assert_eq!(status, 429, "{text}");
    assert!(text.contains(r#""code":"OVER_LIMIT""#), "{text}");
    assert!(
        text.contains(r#"{"key":"RateLimit-Remaining","value":"0"}"#),
        "{text}"
    );
    let (status, _) = rls
        .admin("POST", "/json", r#"{"domain":"shop","nope":1}"#)
        .await;
    assert_eq!(status, 400);
    let (status, _) = rls.admin("POST", "/json", "{").await;
    assert_eq!(status, 400);
    let (status, text) = rls.admin("GET", "/healthcheck", "").await;
    assert_eq!((status, text.as_str()), (200, "OK\n"));

    let channel = tonic::transport::Channel::from_shared(format!("http://{}", rls.grpc))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let reply = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "ratelimit".into(),
        })
        .await
        .expect("health check")
        .into_inner();
    assert_eq!(
        reply.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    // The listener speaks gRPC on HTTP/2 itself (src/rls/wire.rs): the whole server is healthy
    // too, an unknown service is NOT_FOUND, an unknown method UNIMPLEMENTED, as tonic answers.
    let whole = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("health check of the whole server")
        .into_inner();
    assert_eq!(
        whole.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    let unknown = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "nope".into(),
        })
        .await
        .expect_err("an unknown service");
    assert_eq!(unknown.code(), tonic::Code::NotFound);
    let watch = health
        .watch(tonic_health::pb::HealthCheckRequest {
            service: "ratelimit".into(),
        })
        .await
        .expect_err("Watch is not served");
    assert_eq!(watch.code(), tonic::Code::Unimplemented);
    rls.stop().await;
}

async fn a_reload_swaps_the_ratelimit_config_and_a_bad_one_keeps_it(store: TestStore) {
    let rls = start_with(&[("shop.yaml", CONFIG)], "", &store.yaml()).await;
    let mut c = rls.client().await;
    let limit_of = |r: &envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse| {
        r.statuses[0]
            .current_limit
            .as_ref()
            .map(|l| l.requests_per_unit)
    };
    let ask = || request("shop", vec![descriptor(&[("user", "r")])]);
    assert_eq!(limit_of(&call(&mut c, ask()).await), Some(3));

    let file = rls.dir().join("rls/shop.yaml");
    std::fs::write(
        &file,
        CONFIG.replace("requests_per_unit: 3}", "requests_per_unit: 7}"),
    )
    .expect("rewrite");
    rls.gw.running().reload().await.expect("reload");
    assert_eq!(limit_of(&call(&mut c, ask()).await), Some(7));

    std::fs::write(
        &file,
        "domain: shop\ndescriptors:\n  - key: user\n    ratelimit: {}\n",
    )
    .expect("rewrite");
    let err = rls.gw.running().reload().await.unwrap_err();
    assert!(
        err.to_string()
            .contains("shop.yaml:4: config error, unknown key 'ratelimit'"),
        "{err}"
    );
    assert_eq!(
        limit_of(&call(&mut c, ask()).await),
        Some(7),
        "the running config stays"
    );
    rls.stop().await;
}

/// Regression: a call answered by `failure_mode: open` or `closed` was counted twice in
/// `turnstile_rls_requests_total` (as `failed_*`, then again as `ok` or `over_limit`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_failure_is_answered_by_the_failure_mode_and_counted_once() {
    for (mode, code, result) in [
        ("open", OK, "failed_open"),
        ("closed", OVER, "failed_closed"),
    ] {
        let mut redis = support::RedisServer::start();
        let store = format!(
            "store:\n  type: redis\n  url: {}\n  timeout: 100ms",
            redis.url()
        );
        let extra = format!("  failure_mode: {mode}\n");
        let rls = start_with(&[("shop.yaml", CONFIG)], &extra, &store).await;
        let mut c = rls.client().await;
        redis.kill();
        for _ in 0..3 {
            let descriptors = vec![descriptor(&[("user", "u")]), descriptor(&[("user", "vip")])];
            let r = call(&mut c, request("shop", descriptors)).await;
            assert_eq!(r.overall_code, code, "{mode}");
            assert_eq!(r.statuses[0].code, code, "{mode}");
            assert_eq!(
                r.statuses[0].current_limit.is_some(),
                mode == "closed",
                "{mode}: only a refusal names its limit"
            );
            // An unlimited rule never needed the store.
            assert_eq!(r.statuses[1].code, OK, "{mode}");
            assert_eq!(r.statuses[1].limit_remaining, u32::MAX, "{mode}");
        }
        let calls = "turnstile_rls_requests_total";
        assert_eq!(
            rls.metric(calls, &[("result", result)]).await,
            3.0,
            "{mode}"
        );
        for other in ["ok", "over_limit", "error"] {
            let n = rls.metric(calls, &[("result", other)]).await;
            assert_eq!(n, 0.0, "{mode}: {other}");
        }
        let hits = [("descriptor", "user"), ("domain", "shop")];
        assert_eq!(
            rls.metric("turnstile_rls_total_hits", &hits).await,
            0.0,
            "{mode}: no rule statistics without a decision"
        );
        rls.stop().await;
    }
}

/// `unit_multiplier: 30` on `unit: minute` (issue 15): one window of 30 minutes, so the refusal
/// waits for the oldest hit to leave it (about 30 min, never a minute); Envoy is told the unit.
async fn unit_multiplier_makes_a_window_of_n_units(store: TestStore) {
    let rls = start_with(&[("shop.yaml", CONFIG)], "", &store.yaml()).await;
    let mut c = rls.client().await;
    for key in ["half_hour", "half_hour_fixed"] {
        let mut got = Vec::new();
        let mut last = None;
        for _ in 0..4 {
            let r = call(&mut c, request("shop", vec![descriptor(&[(key, "t")])])).await;
            got.push(r.overall_code);
            let limit = r.statuses[0].current_limit.clone().expect("limit");
            assert_eq!((limit.requests_per_unit, limit.unit), (2, 2), "{key}");
            last = r.statuses[0].duration_until_reset;
        }
        assert_eq!(got, [OK, OK, OVER, OVER], "{key}");
        let reset = last.expect("reset").seconds;
        assert!(reset <= 1800, "{key}: {reset} s");
        if key == "half_hour" {
            assert!(
                reset > 1700,
                "{key}: the oldest hit leaves after 30 min, not {reset} s"
            );
        }
    }
    rls.stop().await;
}

/// The gRPC door reads the request message in place (`src/rls/ask.rs`); a message as protobuf
/// allows it (unknown fields, two encodings one after the other, which merge: the last domain
/// wins, descriptors add up) is answered as prost would decode it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_fields_and_merged_messages_are_read_as_protobuf_says() {
    let rls = start(&[("shop.yaml", CONFIG)], "").await;
    let mut message = request("elsewhere", vec![descriptor(&[("user", "bob")])]).encode_to_vec();
    // Unknown fields: a varint (field 9), a group (field 10) and bytes (field 11).
    message.extend_from_slice(&[
        0x48, 0x96, 0x01, 0x53, 0x08, 0x01, 0x54, 0x5a, 0x02, 0xff, 0xfe,
    ]);
    message.extend(request("shop", vec![descriptor(&[("user", "carol")])]).encode_to_vec());
    for round in 0..4 {
        let answer = raw_call(rls.grpc, &message).await;
        assert_eq!(answer.status.as_deref(), Some("0"), "{:?}", answer.message);
        let r = RateLimitResponse::decode(&answer.body[..]).expect("a response message");
        // Both descriptors, on domain `shop` (3 a minute per user).
        assert_eq!(r.statuses.len(), 2);
        let remaining: Vec<u32> = r.statuses.iter().map(|s| s.limit_remaining).collect();
        if round < 3 {
            assert_eq!(r.overall_code, OK);
            assert_eq!(remaining, [2 - round, 2 - round]);
        } else {
            assert_eq!(r.overall_code, OVER);
        }
    }
    rls.stop().await;
}

/// A request message that is not protobuf gets prost's decoding error (gRPC `INTERNAL`), as
/// before the in-place reader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_request_message_gets_the_decoding_error() {
    let rls = start(&[("shop.yaml", CONFIG)], "").await;
    // Field 1 (`domain`, a string) sent as a varint; then a string that is not UTF-8.
    for message in [&[0x08, 0x01][..], &[0x0a, 0x02, 0xc3, 0x28][..]] {
        let answer = raw_call(rls.grpc, message).await;
        assert_eq!(answer.status.as_deref(), Some("13"));
        let text = answer.message.unwrap_or_default();
        assert!(
            text.starts_with("failed to decode the request message"),
            "{text}"
        );
        assert!(answer.body.is_empty());
    }
    rls.stop().await;
}

/// Regression: over-limit hits of `quota_mode` rules were counted in `turnstile_rls_shadow_mode`.
/// They have their own counter, `turnstile_rls_quota_mode`; `shadow_mode` counts shadow rules only.
async fn quota_mode_overs_are_counted_apart_from_shadow_mode(store: TestStore) {
    const QUOTAS: &str = "domain: q
descriptors:
  - key: q1
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: q2
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 3}
  - key: sh
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
";
    let rls = start_with(&[("q.yaml", QUOTAS)], "", &store.yaml()).await;
    let mut c = rls.client().await;
    let mut codes = Vec::new();
    for _ in 0..4 {
        let both = vec![descriptor(&[("q1", "a")]), descriptor(&[("q2", "a")])];
        codes.push(call(&mut c, request("q", both)).await.overall_code);
    }
    // OVER_LIMIT only once every quota descriptor is over.
    assert_eq!(codes, [OK, OK, OK, OVER]);
    for _ in 0..2 {
        let r = call(&mut c, request("q", vec![descriptor(&[("sh", "s")])])).await;
        assert_eq!(r.overall_code, OK);
    }
    for (key, stat, want) in [
        ("q1", "total_hits", 4.0),
        ("q1", "within_limit", 1.0),
        ("q1", "over_limit", 3.0),
        ("q1", "quota_mode", 3.0),
        ("q1", "shadow_mode", 0.0),
        ("q2", "within_limit", 3.0),
        ("q2", "over_limit", 1.0),
        ("q2", "quota_mode", 1.0),
        ("q2", "shadow_mode", 0.0),
        ("sh", "over_limit", 1.0),
        ("sh", "shadow_mode", 1.0),
        ("sh", "quota_mode", 0.0),
    ] {
        let name = format!("turnstile_rls_{stat}");
        let labels = [("descriptor", key), ("domain", "q")];
        assert_eq!(rls.metric(&name, &labels).await, want, "{key} {stat}");
    }
    rls.stop().await;
}

crate::store_matrix!(
    unit_multiplier_makes_a_window_of_n_units,
    exact_counts_statuses_in_order_and_unknowns,
    shadow_mode_counts_but_never_rejects,
    quota_mode_overs_are_counted_apart_from_shadow_mode,
    depth_replaces_and_two_descriptors_in_one_request,
    hits_addend_overrides_fixed_windows_and_token_buckets,
    json_health_and_response_headers,
    a_reload_swaps_the_ratelimit_config_and_a_bad_one_keeps_it,
);
