//! The limits themselves: token bucket, sliding window, all-or-nothing, and what admitted and
//! rejected responses say, on both stores (`memory::` and `redis::`, see `support::stores`). Rates of one per hour make refill negligible within a test, so counts
//! are exact; where refill is the point, bounds are computed from the measured elapsed time.

use std::time::{Duration, Instant};

use crate::support::gateway::one_route;
use crate::support::stores::TestStore;
use crate::support::{Client, TestGateway, Upstream};

async fn a_token_bucket_admits_its_burst_then_rejects_before_the_upstream(store: TestStore) {
    let upstream = Upstream::start().await;
    let yaml = one_route(
        "      - { name: per_ip, key: [client_ip], token_bucket: { rate: 1/h, burst: 3 } }",
    );
    let gw = TestGateway::with_upstream(&store.config(&yaml), upstream.addr).await;
    let c = Client::new();
    for remaining in [2, 1, 0] {
        let reply = c.get(&gw.url("/")).await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header_u64("x-ratelimit-limit"), 3);
        assert_eq!(reply.header_u64("x-ratelimit-remaining"), remaining);
    }
    for _ in 0..5 {
        assert_eq!(c.get(&gw.url("/")).await.status, 429);
    }
    assert_eq!(
        upstream.requests(),
        3,
        "rejected requests never reach the upstream"
    );
}

async fn cost_consumes_several_units(store: TestStore) {
    let gw = TestGateway::start(&store.config(
        r#"
routes:
  - name: api
    respond: { body: ok }
    policies:
      - { name: heavy, key: [client_ip], cost: 2, token_bucket: { rate: 1/h, burst: 5 } }
"#,
    ))
    .await;
    let c = Client::new();
    let first = c.get(&gw.url("/")).await;
    assert_eq!(first.header_u64("x-ratelimit-remaining"), 3);
    let second = c.get(&gw.url("/")).await;
    assert_eq!(second.header_u64("x-ratelimit-remaining"), 1);
    // One unit left, two needed.
    assert_eq!(c.get(&gw.url("/")).await.status, 429);
}

async fn a_token_bucket_refills_at_its_rate_and_never_faster(store: TestStore) {
    let gw = TestGateway::start(&store.config(
        r#"
routes:
  - name: api
    respond: { body: ok }
    policies:
      - { name: p, key: [client_ip], token_bucket: { rate: 10/s, burst: 2 } }
"#,
    ))
    .await;
    let c = Client::new();
    let start = Instant::now();
    let mut admitted = 0u64;
    let mut rejected = 0u64;
    // Drain the bucket and keep asking for a while (until the loop has outrun the refill at
    // least once): refill is the only source of admissions after the burst.
    while start.elapsed() < Duration::from_millis(700) || rejected == 0 {
        assert!(
            start.elapsed() < crate::support::LIVENESS,
            "never outran 10/s"
        );
        match c.get(&gw.url("/")).await.status {
            200 => admitted += 1,
            429 => rejected += 1,
            other => panic!("unexpected status {other}"),
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    let bound = 2 + (10.0 * elapsed).floor() as u64;
    assert!(admitted >= 2, "the burst is always there");
    assert!(
        admitted <= bound,
        "{admitted} admitted in {elapsed:.3}s, at most {bound}"
    );
    // At 10/s, 150 ms refills at least one token whatever the load.
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(c.get(&gw.url("/")).await.status, 200);
}

/// Polls one key until `want` admissions; returns (sent, answered) instants of each admission.
async fn admissions(c: &Client, url: &str, want: usize) -> Vec<(Instant, Instant)> {
    let deadline = Instant::now() + crate::support::LIVENESS;
    let mut admitted = Vec::new();
    while admitted.len() < want {
        assert!(
            Instant::now() < deadline,
            "only {} admissions",
            admitted.len()
        );
        let sent = Instant::now();
        let reply = c.get(url).await;
        let answered = Instant::now();
        match reply.status {
            200 => admitted.push((sent, answered)),
            429 => {
                assert!(reply.header_u64("retry-after") >= 1);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            other => panic!("unexpected status {other}"),
        }
    }
    admitted
}

async fn a_sliding_window_admits_at_most_limit_in_any_interval_of_one_window(store: TestStore) {
    let window = Duration::from_millis(400);
    for (name, extra) in [("exact", ""), ("bucketed", ", buckets: 4")] {
        let gw = TestGateway::start(&store.config(&format!(
            r#"
routes:
  - name: api
    respond: {{ body: ok }}
    policies:
      - {{ name: p, key: [client_ip], sliding_window: {{ limit: 2, window: 400ms{extra} }} }}
"#
        )))
        .await;
        let c = Client::new();
        let admitted = admissions(&c, &gw.url("/"), 7).await;
        // Admission k+2 happened at least one window after admission k: the server decided each
        // between its send and answer instants. A fixed window would let two through right after
        // a boundary, less than a window after the previous two.
        for pair in admitted.windows(3) {
            let (first_sent, _) = pair[0];
            let (_, third_answered) = pair[2];
            assert!(
                third_answered - first_sent >= window,
                "{name}: 3 admissions within {:?}",
                third_answered - first_sent
            );
        }
    }
}

async fn a_rejected_request_consumes_nothing_from_the_other_policies(store: TestStore) {
    let upstream = Upstream::start().await;
    let yaml = one_route(
        r#"      - { name: per_ip, key: [client_ip], token_bucket: { rate: 1/h, burst: 3 } }
      - { name: per_user, key: ["header:x-user"], sliding_window: { limit: 1, window: 1h } }"#,
    );
    let gw = TestGateway::with_upstream(&store.config(&yaml), upstream.addr).await;
    let c = Client::new();
    let user = |u: &'static str| [("x-user", u)];
    assert_eq!(c.get_with(&gw.url("/"), &user("u1")).await.status, 200);
    // per_user rejects these; per_ip must keep its two remaining tokens.
    for _ in 0..4 {
        let reply = c.get_with(&gw.url("/"), &user("u1")).await;
        assert_eq!(reply.status, 429);
        assert_eq!(reply.json()["policy"], "per_user");
    }
    assert_eq!(c.get_with(&gw.url("/"), &user("u2")).await.status, 200);
    assert_eq!(c.get_with(&gw.url("/"), &user("u3")).await.status, 200);
    // Now per_ip is empty; a fresh user is rejected by it, and consumes nothing of per_user.
    let reply = c.get_with(&gw.url("/"), &user("u4")).await;
    assert_eq!(reply.status, 429);
    assert_eq!(reply.json()["policy"], "per_ip");
    assert_eq!(upstream.requests(), 3);
}

async fn allowed_responses_carry_the_strictest_policy(store: TestStore) {
    let yaml = one_route(
        r#"      - { name: loose, key: [client_ip], token_bucket: { rate: 1/h, burst: 5 } }
      - { name: tight, key: [client_ip], sliding_window: { limit: 3, window: 1h } }"#,
    );
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(&store.config(&yaml), upstream.addr).await;
    let c = Client::new();
    for remaining in [2, 1, 0] {
        let reply = c.get(&gw.url("/")).await;
        assert_eq!(reply.status, 200);
        assert_eq!(
            reply.header_u64("x-ratelimit-limit"),
            3,
            "the tighter one speaks"
        );
        assert_eq!(reply.header_u64("x-ratelimit-remaining"), remaining);
        assert_eq!(reply.header_u64("x-ratelimit-reset"), 3600);
    }
    let reply = c.get(&gw.url("/")).await;
    assert_eq!(reply.status, 429);
    assert_eq!(reply.json()["policy"], "tight");
}

async fn on_a_tie_the_first_policy_in_config_order_sets_the_headers(store: TestStore) {
    let gw = TestGateway::start(&store.config(
        r#"
routes:
  - name: minute-first
    match: { prefix: /a }
    respond: { body: ok }
    policies:
      - { name: minute, key: [client_ip], sliding_window: { limit: 2, window: 1m } }
      - { name: hour, key: [client_ip], sliding_window: { limit: 2, window: 1h } }
  - name: hour-first
    match: { prefix: /b }
    respond: { body: ok }
    policies:
      - { name: hour, key: [client_ip], sliding_window: { limit: 2, window: 1h } }
      - { name: minute, key: [client_ip], sliding_window: { limit: 2, window: 1m } }
"#,
    ))
    .await;
    let c = Client::new();
    // Both have 1 remaining after the first request; the reset tells which one spoke.
    assert_eq!(
        c.get(&gw.url("/a")).await.header_u64("x-ratelimit-reset"),
        60
    );
    assert_eq!(
        c.get(&gw.url("/b")).await.header_u64("x-ratelimit-reset"),
        3600
    );
}

async fn a_rejection_is_a_json_429_saying_when_to_retry(store: TestStore) {
    let upstream = Upstream::start().await;
    let yaml = one_route(
        "      - { name: per_ip, key: [client_ip], sliding_window: { limit: 1, window: 1m } }",
    );
    let gw = TestGateway::with_upstream(&store.config(&yaml), upstream.addr).await;
    let c = Client::new();
    let start = Instant::now();
    assert_eq!(c.get(&gw.url("/")).await.status, 200);
    let reply = c.get(&gw.url("/")).await;
    let elapsed = start.elapsed().as_secs_f64();
    assert_eq!(reply.status, 429);
    assert_eq!(reply.header("content-type"), Some("application/json"));
    let body = reply.json();
    assert_eq!(body["error"], "rate_limited");
    assert_eq!(body["route"], "api");
    assert_eq!(body["policy"], "per_ip");
    let retry = reply.header_u64("retry-after");
    assert_eq!(body["retry_after_seconds"], retry);
    // The one admitted request leaves the window 60 s after it was admitted.
    let earliest = 60 - elapsed.ceil() as u64;
    assert!((earliest..=60).contains(&retry), "Retry-After {retry}");
    assert_eq!(reply.header_u64("x-ratelimit-limit"), 1);
    assert_eq!(reply.header_u64("x-ratelimit-remaining"), 0);
    let reset = reply.header_u64("x-ratelimit-reset");
    assert!(
        (earliest..=60).contains(&reset),
        "X-RateLimit-Reset {reset}"
    );
    assert_eq!(upstream.requests(), 1);
}

async fn retry_after_is_at_least_one_second(store: TestStore) {
    let gw = TestGateway::start(&store.config(
        r#"
routes:
  - name: api
    respond: { body: ok }
    policies:
      - { name: fast, key: [client_ip], token_bucket: { rate: 20/s, burst: 1 } }
"#,
    ))
    .await;
    let c = Client::new();
    // A token comes back every 50 ms; ask until one request lands inside a gap.
    for _ in 0..1000 {
        let reply = c.get(&gw.url("/")).await;
        if reply.status == 429 {
            assert_eq!(reply.header_u64("retry-after"), 1);
            assert_eq!(reply.json()["retry_after_seconds"], 1);
            assert_eq!(reply.header_u64("x-ratelimit-reset"), 1);
            return;
        }
    }
    panic!("1000 requests and not one rejected at 20/s");
}

crate::store_matrix!(
    a_token_bucket_admits_its_burst_then_rejects_before_the_upstream,
    cost_consumes_several_units,
    a_token_bucket_refills_at_its_rate_and_never_faster,
    a_sliding_window_admits_at_most_limit_in_any_interval_of_one_window,
    a_rejected_request_consumes_nothing_from_the_other_policies,
    allowed_responses_carry_the_strictest_policy,
    on_a_tie_the_first_policy_in_config_order_sets_the_headers,
    a_rejection_is_a_json_429_saying_when_to_retry,
    retry_after_is_at_least_one_second,
);

/// The in-process store's live counters, read through the running gateway.
fn store_len(gw: &TestGateway) -> (usize, u64) {
    match gw.running().state.engine.store() {
        turnstile::limiter::Store::Memory(store) => (store.len(), store.overflowed()),
        #[allow(unreachable_patterns)]
        _ => panic!("not the memory store"),
    }
}

#[tokio::test]
async fn the_memory_store_stays_within_max_keys_forgetting_only_idle_counters() {
    let gw = TestGateway::start(
        r#"
store: { type: memory, max_keys: 64 }
routes:
  - name: fast
    match: { prefix: /fast }
    respond: { body: ok }
    policies:
      - { name: p, key: ["header:x-key"], token_bucket: { rate: 1000/s, burst: 1 } }
  - name: slow
    match: { prefix: /slow }
    respond: { body: ok }
    policies:
      - { name: p, key: ["header:x-key"], token_bucket: { rate: 1/h, burst: 1 } }
"#,
    )
    .await;
    let c = Client::new();
    // A bucket refilled to full 1 ms after its request is idle: making room forgets it first.
    for i in 0..200 {
        let key = i.to_string();
        assert_eq!(
            c.get_with(&gw.url("/fast"), &[("x-key", &key)])
                .await
                .status,
            200
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let (len, overflowed) = store_len(&gw);
    assert!(len <= 64, "{len} counters");
    assert_eq!(overflowed, 0, "idle counters made room");
    // Empty buckets are not idle: the first 64 slow keys take the idle counters' places, and the
    // rest, finding no idle counter, are counted in the conservative overflow sketch (which may
    // refuse them early, never admit them past the limit).
    for i in 0..200 {
        let key = i.to_string();
        let status = c
            .get_with(&gw.url("/slow"), &[("x-key", &key)])
            .await
            .status;
        if i < 64 {
            assert_eq!(status, 200, "key {i}");
        } else {
            assert!(status == 200 || status == 429, "key {i}: {status}");
        }
    }
    let (len, overflowed) = store_len(&gw);
    assert!(len <= 64, "{len} counters");
    assert_eq!(
        overflowed,
        200 - 64,
        "one overflow decision per key past the bound"
    );
    // None of the counters in use was forgotten to make room: each is still exhausted.
    for i in 0..64 {
        let key = i.to_string();
        assert_eq!(
            c.get_with(&gw.url("/slow"), &[("x-key", &key)])
                .await
                .status,
            429,
            "key {i} was reset by the keys after it"
        );
    }
}
