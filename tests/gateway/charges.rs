//! Costs reported by the upstream that are very large (issue 33, items 2 and 12): charged exactly,
//! clamped to `max_cost`, at a cost to the store that does not grow with the units.

use std::time::{Duration, Instant};

use crate::support::gateway::one_route;
use crate::support::stores::TestStore;
use crate::support::{Client, TestGateway, Upstream, LIVENESS};

/// A response reporting a whole number too large for any integer type is charged `max_cost` (it
/// was charged the fallback, 1), and on an exact window that charge of millions of units lands at
/// once and leaves the counter answering at once, on both stores.
async fn a_cost_above_u64_on_an_exact_window_is_charged_max_cost_at_once(store: TestStore) {
    let upstream = Upstream::start().await;
    let yaml = format!(
        "{}\n{}",
        store.yaml(),
        one_route(
            "      - name: tokens\n        key: [method]\n        \
             sliding_window: { limit: 3000000, window: 1h }\n        \
             cost: { response_header: x-usage-tokens, fallback: 1, min_cost: 1 }",
        )
    );
    let gw = TestGateway::with_upstream(&yaml, upstream.addr).await;
    let c = Client::new();
    let url = gw.url("/llm");
    let reply = c
        .get_with(&url, &[("x-test-cost", "99999999999999999999999")])
        .await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.header_u64("x-ratelimit-remaining"), 2_999_999);
    // max_cost defaults to the limit: 3,000,000 in all, 1 of it taken at admission.
    let charged = || async {
        gw.metric(
            "turnstile_cost_charged_total",
            &[("route", "api"), ("policy", "tokens")],
        )
        .await
    };
    let deadline = Instant::now() + LIVENESS;
    while charged().await != 2_999_999.0 {
        assert!(
            Instant::now() < deadline,
            "charged {} instead of 2,999,999",
            charged().await
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let started = Instant::now();
    let refused = c.get(&url).await;
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "a decision after the charge took {:?}",
        started.elapsed()
    );
    assert_eq!(refused.status, 429, "{refused:?}");
    assert_eq!(refused.header_u64("x-ratelimit-remaining"), 0);
    assert!(refused.header_u64("retry-after") > 3500);
    assert_eq!(upstream.requests(), 1);
}

crate::store_matrix!(a_cost_above_u64_on_an_exact_window_is_charged_max_cost_at_once);
