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

/// decide.lua's packed batch (the gateway's call: two arguments, one reply string) decides
/// exactly as the plain batch: the same integers, stamps of microsecond timestamps and
/// fractional token counts included.
#[test]
fn a_packed_batch_answers_what_the_plain_batch_answers() {
    let redis = support::redis::RedisServer::start();
    let script =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/decide.lua"))
            .expect("decide.lua");
    let now = 1_763_900_000_123_457u64;
    // Three decisions on a bucket (fractional refill) and a window, then a quota alone.
    let decisions: Vec<(u64, Vec<[String; 6]>)> = vec![
        (now, vec![tb_args(1), sw_args(1)]),
        (now + 1_700, vec![tb_args(2), sw_args(1)]),
        (now + 2_900_001, vec![tb_args(1), sw_args(2)]),
        (now + 3_000_000, vec![q_args(now)]),
    ];
    let run = |prefix: &str, packed: bool| -> Vec<i64> {
        let mut keys = Vec::new();
        let mut words = Vec::new();
        for (at, checks) in &decisions {
            words.push(at.to_string());
            words.push(checks.len().to_string());
            for c in checks {
                keys.push(format!("{prefix}{{k}}:{}", c[0]));
                words.extend(c.iter().cloned());
            }
        }
        let mut args: Vec<String> = vec!["eval".into(), script.clone(), keys.len().to_string()];
        args.extend(keys);
        if packed {
            args.push("packed".into());
            args.push(words.join(" "));
        } else {
            args.push("batch".into());
            args.extend(words);
        }
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let reply = redis.cli(&refs);
        reply
            .iter()
            .flat_map(|line| line.split_whitespace())
            .map(|n| {
                n.parse()
                    .unwrap_or_else(|_| panic!("not an integer: {reply:?}"))
            })
            .collect()
    };
    let plain = run("plain:", false);
    let packed = run("packed:", true);
    assert_eq!(plain.len(), (1 + 7 * 2) * 3 + (1 + 7));
    assert_eq!(packed, plain);
    // Some decision refused, some admitted: the comparison covered both.
    assert!(plain.contains(&0) && plain.contains(&1));
    // "-" is Redis TIME, as "" is in the plain form.
    let timed = redis.cli(&[
        "eval",
        &script,
        "1",
        "t{k}:tb",
        "packed",
        "- 1 tb 0.5 3 0 1 0",
    ]);
    let numbers: Vec<&str> = timed.iter().flat_map(|l| l.split_whitespace()).collect();
    assert_eq!(numbers.len(), 8, "{timed:?}");
    assert_eq!(numbers[0], "1");
}

fn tb_args(cost: u64) -> [String; 6] {
    ["tb", "0.3333333333333333", "3", "0", &cost.to_string(), "0"].map(String::from)
}

fn sw_args(cost: u64) -> [String; 6] {
    ["sw", "3", "3000000", "0", &cost.to_string(), "0"].map(String::from)
}

fn q_args(now: u64) -> [String; 6] {
    let start = now - now % 86_400_000_000;
    [
        "q".to_string(),
        "2".to_string(),
        start.to_string(),
        (start + 86_400_000_000).to_string(),
        "1".to_string(),
        "1".to_string(),
    ]
}
