//! Calendar quotas through the gateway (issue 15), on both stores: exact counts, and `Retry-After`
//! / `X-RateLimit-Reset` that give the time to the next local midnight. The calendar math itself
//! (DST days, months, weeks) is in `tests/conformance.rs` on a hand-set clock.

use std::time::{SystemTime, UNIX_EPOCH};

use crate::support::gateway::one_route;
use crate::support::stores::TestStore;
use crate::support::{Client, TestGateway, Upstream};

/// A fixed-offset zone whose midnight is at least an hour away from now, so the test never
/// straddles a reset, and the seconds from now to its next midnight.
fn zone_far_from_midnight() -> (&'static str, u64) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let utc = now % 86_400;
    // Etc/GMT-12 is UTC+12 (POSIX signs are inverted).
    let (zone, offset) = if (3_600..82_800).contains(&utc) {
        ("UTC", 0)
    } else {
        ("Etc/GMT-12", 43_200)
    };
    let local = (now + offset) % 86_400;
    (zone, 86_400 - local)
}

async fn a_daily_quota_admits_its_limit_then_refuses_until_midnight(store: TestStore) {
    let upstream = Upstream::start().await;
    let (zone, to_midnight) = zone_far_from_midnight();
    let yaml = one_route(&format!(
        "      - {{ name: daily, key: [header:x-tenant], \
         quota: {{ limit: 3, per: day, time_zone: {zone} }} }}"
    ));
    let gw = TestGateway::with_upstream(&store.config(&yaml), upstream.addr).await;
    let c = Client::new();
    let tenant = [("x-tenant", "acme")];
    for remaining in [2, 1, 0] {
        let reply = c.get_with(&gw.url("/"), &tenant).await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header_u64("x-ratelimit-limit"), 3);
        assert_eq!(reply.header_u64("x-ratelimit-remaining"), remaining);
        let reset = reply.header_u64("x-ratelimit-reset");
        assert!(
            reset.abs_diff(to_midnight) <= 5,
            "reset {reset} s, midnight in {to_midnight} s"
        );
    }
    for _ in 0..4 {
        let reply = c.get_with(&gw.url("/"), &tenant).await;
        assert_eq!(reply.status, 429);
        let retry = reply.header_u64("retry-after");
        assert!(
            retry.abs_diff(to_midnight) <= 5,
            "Retry-After {retry} s, midnight in {to_midnight} s"
        );
    }
    // Another tenant has its own quota.
    let other = c.get_with(&gw.url("/"), &[("x-tenant", "globex")]).await;
    assert_eq!(other.status, 200);
    assert_eq!(other.header_u64("x-ratelimit-remaining"), 2);
    assert_eq!(upstream.requests(), 4, "exactly the admitted requests");
    let used = [("route", "api"), ("policy", "daily")];
    assert_eq!(
        gw.metric("turnstile_quota_used_units_total", &used).await,
        4.0,
        "units admitted, refusals excluded"
    );
}

#[test]
fn a_quota_config_names_the_bad_field() {
    let yaml = one_route(
        "      - { name: q, key: [client_ip], quota: { limit: 5, per: fortnight, \
         time_zone: Mars/Olympus } }",
    );
    let yaml = crate::support::gateway::substitute(&yaml, None);
    let errors = turnstile::config::parse(&yaml, std::path::Path::new("policies.yaml"))
        .expect_err("a bad quota must not load")
        .to_string();
    assert!(errors.contains("policies[0].quota.per"), "{errors}");
    assert!(errors.contains("fortnight"), "{errors}");
    assert!(errors.contains("policies[0].quota.time_zone"), "{errors}");
}

crate::store_matrix!(a_daily_quota_admits_its_limit_then_refuses_until_midnight,);
