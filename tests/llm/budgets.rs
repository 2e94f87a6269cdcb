//! Token budgets on sliding windows (exact and bucketed) and calendar quotas (`docs/llm.md`,
//! "Windows and monthly quotas"): a reservation is settled by a stamped refund into the window
//! entry, bucket or period its admission charged, so each budget holds exactly the usage, on
//! both stores; the optimistic `min_cost` mode charges the rest after the response.

use std::time::{Duration, Instant};

use super::support::llm::LlmUpstream;
use super::support::stores::TestStore;
use super::support::{TestGateway, LIVENESS};
use super::{post, post_lossy, remaining, wait_settled, BUDGET, CHAT, CHAT_STREAM, RESERVE};

/// The rules a budget of [`BUDGET`] tokens can be: an hour's exact window, the same in 60
/// buckets, and a monthly quota.
const RULES: [&str; 3] = [
    "sliding_window: { limit: 1000, window: 1h }",
    "sliding_window: { limit: 1000, window: 1h, buckets: 60 }",
    "quota: { limit: 1000, per: month, time_zone: Europe/Berlin }",
];

/// One route, `openai`, whose policy `tokens` is `rule` with the usage cost `cost`; refusing when
/// the store fails, which on Redis is given 2 s (the default 50 ms fails open on a loaded machine,
/// and an admission without a decision carries no rate-limit fields).
fn budget(store: &TestStore, rule: &str, cost: &str) -> String {
    let config = store.config(&format!(
        r#"
upstreams:
  llm: {{ url: "http://$UPSTREAM" }}
routes:
  - name: openai
    upstream: llm
    failure_mode: closed
    policies:
      - name: tokens
        key: ["header:authorization"]
        {rule}
        cost: {cost}
"#
    ));
    config.replacen("  type: redis\n", "  type: redis\n  timeout: 2s\n", 1)
}

/// Each budget, reserving: a JSON body and a stream settle to their usage (26 tokens each), a
/// stream cut before its usage keeps its whole reservation, and every next admission finds the
/// budget less exactly what was settled, and its own reservation.
async fn window_and_quota_budgets_settle_to_their_usage(store: TestStore) {
    let cost = format!("{{ usage: openai, reserve: true, max_cost: {RESERVE} }}");
    for rule in RULES {
        let upstream = LlmUpstream::start();
        let gw = TestGateway::with_upstream(&budget(&store, rule, &cost), upstream.addr).await;
        let first = post(&gw, "/v1/chat/completions", CHAT, &[]).await;
        assert_eq!(first.status, 200, "{rule}: {first:?}");
        assert_eq!(first.header_u64("x-ratelimit-limit"), BUDGET, "{rule}");
        assert_eq!(
            first.header_u64("x-ratelimit-remaining"),
            BUDGET - RESERVE,
            "{rule}"
        );
        let (refunded, reserved, _, tokens) = wait_settled(&gw, "openai").await;
        assert_eq!((refunded, reserved, tokens), (74.0, 0.0, 26.0), "{rule}");
        let stream = post(&gw, "/v1/chat/completions", CHAT_STREAM, &[]).await;
        assert!(stream.text().ends_with("data: [DONE]\n\n"), "{rule}");
        wait_settled(&gw, "openai").await;
        assert_eq!(
            remaining(&gw, "/v1/chat/completions", CHAT, &[]).await,
            BUDGET - 2 * 26 - RESERVE,
            "{rule}: the budget holds exactly the usage"
        );
        let (status, _, clean) = post_lossy(
            &gw,
            "/v1/chat/completions",
            CHAT_STREAM,
            &[("x-test-mode", "cut")],
        )
        .await;
        assert_eq!((status, clean), (200, false), "{rule}");
        let (_, reserved, unreported, _) = wait_settled(&gw, "openai").await;
        assert_eq!(
            (reserved, unreported),
            (0.0, 1.0),
            "{rule}: nothing left reserved"
        );
        assert_eq!(
            remaining(&gw, "/v1/chat/completions", CHAT, &[]).await,
            BUDGET - 3 * 26 - RESERVE - RESERVE,
            "{rule}: the cut stream kept its reservation"
        );
        assert_eq!(upstream.reported().await, 4 * 26, "{rule}");
    }
}

/// The optimistic mode on each budget: admission takes `min_cost` (1), and the settlement
/// charges the rest of the usage (25) after the response, whatever the counter holds.
async fn window_and_quota_budgets_charge_after_the_response(store: TestStore) {
    for rule in RULES {
        let upstream = LlmUpstream::start();
        let gw = TestGateway::with_upstream(
            &budget(&store, rule, "{ usage: openai, min_cost: 1 }"),
            upstream.addr,
        )
        .await;
        let first = post(&gw, "/v1/chat/completions", CHAT_STREAM, &[]).await;
        assert_eq!(
            first.header_u64("x-ratelimit-remaining"),
            BUDGET - 1,
            "{rule}"
        );
        // No reservation to wait for: the charge is counted once it has landed.
        let deadline = Instant::now() + LIVENESS;
        loop {
            let text = gw.metrics().await;
            let charged = super::support::metric(
                &text,
                "turnstile_cost_charged_total",
                &[("route", "openai"), ("policy", "tokens")],
            );
            if charged == Some(25.0) {
                break;
            }
            assert!(Instant::now() < deadline, "{rule}: charged {charged:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            remaining(&gw, "/v1/chat/completions", CHAT, &[]).await,
            BUDGET - 26 - 1,
            "{rule}"
        );
    }
}

crate::store_matrix!(
    window_and_quota_budgets_settle_to_their_usage,
    window_and_quota_budgets_charge_after_the_response,
);
