//! Concurrent decisions share script calls (`src/limiter/redis/batch.rs`), and each stays
//! all-or-nothing on its own: many concurrent requests on one store admit exactly the limit, in
//! fewer `EVALSHA` calls than decisions.

mod support;

use std::sync::Arc;
use std::time::Duration;

use turnstile::limiter::{Check, RedisStore, Rule, SlidingWindow, TokenBucket};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_decisions_share_calls_and_admit_exactly_the_limit() {
    let redis = support::redis::RedisServer::start();
    let store = Arc::new(
        RedisStore::connect(&redis.url(), 2, Duration::from_secs(5), "batch:").expect("store"),
    );
    assert!(store.wait_ready(Duration::from_secs(10)).await);
    let bucket = Rule::TokenBucket(TokenBucket {
        rate: 1.0 / 3600.0,
        burst: 50,
    });
    let window = Rule::SlidingWindow(SlidingWindow {
        limit: 30,
        window_us: 3_600_000_000,
        buckets: 0,
    });
    let calls_before = evalsha_calls(&redis);
    // 400 decisions, 100 at a time: each asks for one unit of the shared bucket and, every other
    // one, also one of the window (so a two-check decision must refuse both or consume both).
    let mut tasks = Vec::new();
    for i in 0..400u32 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let mut checks = vec![Check {
                key: "shared",
                rule: &bucket,
                cost: 1,
                shadow: false,
            }];
            if i % 2 == 0 {
                checks.push(Check {
                    key: "window",
                    rule: &window,
                    cost: 1,
                    shadow: false,
                });
            }
            let d = store.check(&checks).await.expect("a decision");
            (d.allowed, checks.len())
        }));
    }
    let mut admitted = 0;
    let mut admitted_pairs = 0;
    for t in tasks {
        let (allowed, n) = t.await.expect("task");
        admitted += u32::from(allowed);
        admitted_pairs += u32::from(allowed && n == 2);
    }
    assert_eq!(admitted, 50, "the bucket admits exactly its burst");
    assert!(
        admitted_pairs <= 30,
        "{admitted_pairs} pairs past a window of 30"
    );
    // What Redis holds agrees with the admissions: all-or-nothing per decision.
    let window_len: u32 = redis.cli(&["zcard", "batch:{window}:sw"])[0]
        .parse()
        .expect("zcard");
    assert_eq!(window_len, admitted_pairs);
    let calls = evalsha_calls(&redis) - calls_before;
    assert!(
        calls < 400,
        "400 concurrent decisions took {calls} script calls: none were batched"
    );
}

/// `EVALSHA` calls Redis has served (INFO commandstats).
fn evalsha_calls(redis: &support::redis::RedisServer) -> u64 {
    redis
        .cli(&["info", "commandstats"])
        .iter()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|l| l.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}
