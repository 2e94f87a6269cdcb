//! Concurrency leases and cost from the response through the inline gateway (issue 15), on both
//! stores: never more than N requests in flight at the upstream, leases released when the body
//! ends or the client goes away, and the exact arithmetic of costs an upstream reports.

use std::time::{Duration, Instant};

use http::Method;

use crate::support::client::{empty, request};
use crate::support::gateway::one_route;
use crate::support::stores::TestStore;
use crate::support::{Client, TestGateway, Upstream, LIVENESS};

const LIMIT: usize = 5;
const REQUESTS: usize = 100;

fn concurrency(limit: usize, extra: &str) -> String {
    one_route(&format!(
        "      - name: inflight\n        key: [method]\n        concurrency: {{ limit: {limit}{extra} }}"
    ))
}

/// `yaml` on `store`, with a Redis timeout a loaded machine cannot exceed and the routes failing
/// closed: a decision that fails open takes no lease, so it would admit past the limit.
fn config(store: &TestStore, yaml: &str) -> String {
    let timeout = match store {
        TestStore::Redis(_) => "\n  timeout: 5s\n  failure_mode: closed",
        TestStore::Memory => "",
    };
    format!("{}{timeout}\n{yaml}", store.yaml())
}

async fn in_flight_gauge(gw: &TestGateway) -> f64 {
    gw.metric("turnstile_in_flight_requests", &[("route", "api")])
        .await
}

/// Waits until the gateway holds no lease (releases on Redis are spawned after the body ends).
async fn wait_released(gw: &TestGateway) {
    let deadline = Instant::now() + LIVENESS;
    while in_flight_gauge(gw).await != 0.0 {
        assert!(Instant::now() < deadline, "leases still held");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// 100 slow requests at once: the upstream, which counts its own requests in flight, never sees
/// more than the limit, and does see the limit reached; the others are refused with 429 and
/// `Retry-After: 1`; afterwards every lease is back.
async fn a_hundred_slow_requests_never_put_more_than_the_limit_in_flight(store: TestStore) {
    let upstream = Upstream::start().await;
    let gw =
        TestGateway::with_upstream(&config(&store, &concurrency(LIMIT, "")), upstream.addr).await;
    let c = Client::new();
    let url = gw.url("/slow");
    let tasks: Vec<_> = (0..REQUESTS)
        .map(|_| {
            let (c, url) = (c.clone(), url.clone());
            tokio::spawn(async move { c.get_with(&url, &[("x-test-sleep-ms", "1000")]).await })
        })
        .collect();
    let (mut admitted, mut refused) = (0, 0);
    for task in tasks {
        let reply = task.await.expect("request task");
        match reply.status {
            200 => admitted += 1,
            429 => {
                assert_eq!(reply.header("retry-after"), Some("1"), "{reply:?}");
                refused += 1;
            }
            other => panic!("unexpected status {other}"),
        }
    }
    let peak = upstream.peak_in_flight();
    assert!(
        peak <= LIMIT,
        "{peak} requests in flight at the upstream, limit {LIMIT}"
    );
    assert_eq!(peak, LIMIT, "the limit was never reached");
    assert_eq!(admitted + refused, REQUESTS);
    assert!(admitted >= LIMIT, "only {admitted} admitted");
    assert_eq!(
        upstream.requests(),
        admitted,
        "a refused request reached the upstream"
    );
    wait_released(&gw).await;
    // Every lease is back: the limit is available again, all of it at once.
    let again: Vec<_> = (0..LIMIT)
        .map(|_| {
            let (c, url) = (c.clone(), url.clone());
            tokio::spawn(async move { c.get_with(&url, &[("x-test-sleep-ms", "300")]).await })
        })
        .collect();
    for task in again {
        assert_eq!(task.await.expect("task").status, 200);
    }
}

/// A client that goes away before the response head, or in the middle of the body, releases its
/// lease: the next request is admitted.
async fn a_client_going_away_releases_its_lease(store: TestStore) {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(&config(&store, &concurrency(1, "")), upstream.addr).await;
    let url = gw.url("/held");

    // Gone before the head: the request future is dropped while the upstream holds it.
    let c = Client::new();
    let (c2, url2) = (c.clone(), url.clone());
    let waiting =
        tokio::spawn(async move { c2.get_with(&url2, &[("x-test-hold-head", "1")]).await });
    upstream.wait_for_requests(1).await;
    assert_eq!(in_flight_gauge(&gw).await, 1.0);
    assert_eq!(Client::new().get(&url).await.status, 429);
    waiting.abort();
    drop(c);
    wait_released(&gw).await;
    assert_eq!(Client::new().get(&url).await.status, 200);

    // Gone in the middle of the body: the head and a first chunk arrived, the rest never will.
    let c = Client::new();
    let streaming = c
        .head(
            request(Method::GET, &url)
                .header("x-test-stream", "1")
                .body(empty())
                .expect("request"),
        )
        .await;
    assert_eq!(streaming.status(), 200);
    assert_eq!(in_flight_gauge(&gw).await, 1.0);
    assert_eq!(Client::new().get(&url).await.status, 429);
    drop(streaming);
    drop(c);
    wait_released(&gw).await;
    assert_eq!(Client::new().get(&url).await.status, 200);
    upstream.release(2);
}

/// `refuse_with: 503` changes only the status of a concurrency refusal.
async fn refuse_with_503(store: TestStore) {
    let upstream = Upstream::start().await;
    let yaml = config(&store, &concurrency(1, ", refuse_with: 503"));
    let gw = TestGateway::with_upstream(&yaml, upstream.addr).await;
    let url = gw.url("/x");
    let (c, url2) = (Client::new(), url.clone());
    let held = tokio::spawn(async move { c.get_with(&url2, &[("x-test-hold-head", "1")]).await });
    upstream.wait_for_requests(1).await;
    let refused = Client::new().get(&url).await;
    assert_eq!(refused.status, 503);
    assert_eq!(refused.header("retry-after"), Some("1"));
    upstream.release(1);
    assert_eq!(held.await.expect("task").status, 200);
    wait_released(&gw).await;
}

/// An upstream reporting costs in `x-usage-tokens`: admission takes `min_cost` (1), the rest of
/// the reported amount is charged when the head arrives, `fallback` (5) when the header is
/// missing or not a number, at most the burst (100); the bucket goes below zero and refuses.
async fn costs_reported_by_the_upstream_are_charged_exactly(store: TestStore) {
    let upstream = Upstream::start().await;
    let yaml = config(&store, &one_route(
        "      - name: tokens\n        key: [method]\n        token_bucket: { rate: 1/d, burst: 100 }\n        \
         cost: { response_header: x-usage-tokens, fallback: 5, min_cost: 1 }",
    ));
    let gw = TestGateway::with_upstream(&yaml, upstream.addr).await;
    let c = Client::new();
    let url = gw.url("/llm");
    let charged = || async {
        gw.metric(
            "turnstile_cost_charged_total",
            &[("route", "api"), ("policy", "tokens")],
        )
        .await
    };
    // (reported, remaining at admission, charged after it so far)
    let steps: [(Option<&str>, u64, f64); 4] = [
        (Some("30"), 99, 29.0),    // 100 - 1, then - 29 = 70
        (None, 69, 33.0),          // 70 - 1, then - 4 = 65
        (Some("lots"), 64, 37.0),  // 65 - 1, then - 4 = 60
        (Some("1000"), 59, 136.0), // 60 - 1, then - 99 = -40
    ];
    for (reported, remaining, total) in steps {
        let headers: Vec<(&str, &str)> = reported.map(|v| ("x-test-cost", v)).into_iter().collect();
        let reply = c.get_with(&url, &headers).await;
        assert_eq!(reply.status, 200, "{reply:?}");
        assert_eq!(reply.header_u64("x-ratelimit-remaining"), remaining);
        let deadline = Instant::now() + LIVENESS;
        while charged().await != total {
            assert!(
                Instant::now() < deadline,
                "charge never landed: {}",
                charged().await
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    // -40 tokens: refused, for the 41 tokens a request needs at 1 a day.
    let refused = c.get(&url).await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header_u64("x-ratelimit-remaining"), 0);
    assert_eq!(refused.header_u64("retry-after"), 41 * 86_400);
    assert_eq!(upstream.requests(), 4);
}

/// A request running longer than `lease_ttl` keeps its lease: the gateway renews it every half
/// TTL while the request runs, so a second request is still refused after three TTLs.
async fn a_lease_is_renewed_while_its_request_runs(store: TestStore) {
    let upstream = Upstream::start().await;
    let yaml = config(&store, &concurrency(1, ", lease_ttl: 500ms"));
    let gw = TestGateway::with_upstream(&yaml, upstream.addr).await;
    let url = gw.url("/long");
    let (c, url2) = (Client::new(), url.clone());
    let long = tokio::spawn(async move { c.get_with(&url2, &[("x-test-hold-head", "1")]).await });
    upstream.wait_for_requests(1).await;
    let held_since = Instant::now();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        Client::new().get(&url).await.status,
        429,
        "the lease expired"
    );
    assert!(held_since.elapsed() >= Duration::from_millis(1500));
    upstream.release(1);
    assert_eq!(long.await.expect("task").status, 200);
    wait_released(&gw).await;
    assert_eq!(Client::new().get(&url).await.status, 200);
}

/// A per-key override raises one tenant's concurrency limit (`PUT /overrides/...`); the
/// others keep the policy's.
async fn an_override_raises_one_keys_concurrency(store: TestStore) {
    let upstream = Upstream::start().await;
    let yaml = config(
        &store,
        &one_route(
            "      - name: inflight\n        key: [\"header:x-tenant\"]\n        concurrency: { limit: 1 }",
        ),
    );
    let gw = TestGateway::with_upstream(&yaml, upstream.addr).await;
    let put = Client::new()
        .send(
            request(Method::PUT, &gw.admin_url("/overrides/api/inflight/acme"))
                .header("content-type", "application/json")
                .body(crate::support::client::full(r#"{"limit": 2}"#))
                .expect("request"),
        )
        .await;
    assert_eq!(put.status, 200, "{}", put.text());
    let url = gw.url("/t");
    let held: Vec<_> = (0..2)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move {
                Client::new()
                    .get_with(&url, &[("x-tenant", "acme"), ("x-test-hold-head", "1")])
                    .await
            })
        })
        .collect();
    upstream.wait_for_requests(2).await;
    let third = Client::new().get_with(&url, &[("x-tenant", "acme")]).await;
    assert_eq!(third.status, 429);
    assert_eq!(third.header_u64("x-ratelimit-limit"), 2);
    let (c, url2) = (Client::new(), url.clone());
    let globex = tokio::spawn(async move {
        c.get_with(&url2, &[("x-tenant", "globex"), ("x-test-hold-head", "1")])
            .await
    });
    upstream.wait_for_requests(3).await;
    let second = Client::new()
        .get_with(&url, &[("x-tenant", "globex")])
        .await;
    assert_eq!(second.status, 429);
    assert_eq!(second.header_u64("x-ratelimit-limit"), 1);
    upstream.release(3);
    for task in held {
        assert_eq!(task.await.expect("task").status, 200);
    }
    assert_eq!(globex.await.expect("task").status, 200);
    wait_released(&gw).await;
}

/// Issue 33, item 3: a cost from the response is charged under the rule admission used for the
/// key (its per-key override), and never more than that rule's burst. The policy's bucket is 100
/// at 1 a day, `acme` is raised to 1000 and `tiny` lowered to 5: `acme` loses exactly the units
/// reported, and `tiny` is charged at most its burst of 5, so it waits one day for one token
/// (charged under the policy's rule instead, `acme` fell to the policy's 100 and `tiny` owed 95
/// tokens: 96 days).
async fn a_response_cost_is_charged_under_the_keys_override(store: TestStore) {
    let upstream = Upstream::start().await;
    let yaml = config(
        &store,
        &one_route(
            "      - name: tokens\n        key: [\"header:x-tenant\"]\n        \
         token_bucket: { rate: 1/d, burst: 100 }\n        \
         cost: { response_header: x-usage-tokens, fallback: 1, min_cost: 1 }",
        ),
    );
    let gw = TestGateway::with_upstream(&yaml, upstream.addr).await;
    for (key, body) in [("acme", r#"{"burst": 1000}"#), ("tiny", r#"{"burst": 5}"#)] {
        let put = Client::new()
            .send(
                request(
                    Method::PUT,
                    &gw.admin_url(&format!("/overrides/api/tokens/{key}")),
                )
                .header("content-type", "application/json")
                .body(crate::support::client::full(body.to_owned()))
                .expect("request"),
            )
            .await;
        assert_eq!(put.status, 200, "{}", put.text());
    }
    let c = Client::new();
    let url = gw.url("/llm");
    let charged = || async {
        gw.metric(
            "turnstile_cost_charged_total",
            &[("route", "api"), ("policy", "tokens")],
        )
        .await
    };
    let wait_charged = |total: f64| async move {
        let deadline = Instant::now() + LIVENESS;
        while charged().await != total {
            assert!(
                Instant::now() < deadline,
                "charge never landed: {}",
                charged().await
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };

    // acme: 1000 - 1 at admission, then 1 more charged: 998; the next admission leaves 997.
    let first = c
        .get_with(&url, &[("x-tenant", "acme"), ("x-test-cost", "2")])
        .await;
    assert_eq!(first.status, 200, "{first:?}");
    assert_eq!(first.header_u64("x-ratelimit-remaining"), 999);
    assert_eq!(first.header_u64("x-ratelimit-limit"), 1000);
    wait_charged(1.0).await;
    let second = c.get_with(&url, &[("x-tenant", "acme")]).await;
    assert_eq!(second.status, 200, "{second:?}");
    assert_eq!(second.header_u64("x-ratelimit-remaining"), 997);

    // tiny: reports 1000 (max_cost is the policy's 100), charged its burst of 5 in all: 0 left,
    // and one token comes back a day later.
    let big = c
        .get_with(&url, &[("x-tenant", "tiny"), ("x-test-cost", "1000")])
        .await;
    assert_eq!(big.status, 200, "{big:?}");
    assert_eq!(big.header_u64("x-ratelimit-remaining"), 4);
    wait_charged(5.0).await;
    let refused = c.get_with(&url, &[("x-tenant", "tiny")]).await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header_u64("x-ratelimit-limit"), 5);
    assert_eq!(refused.header_u64("retry-after"), 86_400);

    // A key without an override is charged under the policy's rule, up to its max_cost of 100.
    let plain = c
        .get_with(&url, &[("x-tenant", "plain"), ("x-test-cost", "1000")])
        .await;
    assert_eq!(plain.header_u64("x-ratelimit-remaining"), 99);
    wait_charged(104.0).await;
    let after = c.get_with(&url, &[("x-tenant", "plain")]).await;
    assert_eq!(after.status, 429);
    assert_eq!(after.header_u64("retry-after"), 86_400);
    assert_eq!(upstream.requests(), 4);
}

crate::store_matrix!(
    a_response_cost_is_charged_under_the_keys_override,
    an_override_raises_one_keys_concurrency,
    a_lease_is_renewed_while_its_request_runs,
    a_hundred_slow_requests_never_put_more_than_the_limit_in_flight,
    a_client_going_away_releases_its_lease,
    refuse_with_503,
    costs_reported_by_the_upstream_are_charged_exactly,
);
