//! The key promise of `reserve: true`: many concurrent streams from several API keys, on two
//! gateway processes sharing one real Redis, against a 1,000-token budget per key, as a token
//! bucket, a monthly quota and an hour's sliding window. The tokens the upstream reports for a key
//! never exceed 1,000, and once demand has run the budget down, what is left is less than one
//! reservation (the documented slack, `docs/llm.md`).

use std::time::{Duration, Instant};

use http::Method;
use http_body_util::BodyExt;

use super::support::client::{full, request};
use super::support::llm::LlmUpstream;
use super::support::{Client, GatewayProcess, RedisServer, LIVENESS};

/// The kind of budget a fleet run meters.
#[derive(Clone, Copy, Debug)]
enum Budget {
    Bucket,
    MonthlyQuota,
    Window,
}

const KEYS: [&str; 3] = ["Bearer sk-a", "Bearer sk-b", "Bearer sk-c"];
const WORKERS_PER_KEY: usize = 8;
/// max_cost: what each stream reserves.
const RESERVE: u64 = 120;
const BUDGET: u64 = 1000;
/// Each stream generates 60 tokens (plus 7 of input), one event every 5 ms.
const BODY: &str = r#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_tokens":60,"messages":[{"role":"user","content":"count to twenty please"}]}"#;

/// One stream; its status and whether its body ended cleanly.
async fn stream(client: &Client, url: &str, key: &str) -> u16 {
    let req = request(Method::POST, url)
        .header("authorization", key)
        .header("content-type", "application/json")
        .header("x-test-output-tokens", "60")
        .header("x-test-delay-ms", "5")
        .body(full(BODY))
        .expect("request");
    let response = client.head(req).await;
    let status = response.status().as_u16();
    let mut body = response.into_body();
    while let Some(frame) = body.frame().await {
        frame.expect("the stream ends cleanly");
    }
    status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_on_two_instances_never_exceed_the_budget() {
    fleet(Budget::Bucket).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_on_two_instances_never_exceed_a_monthly_quota() {
    fleet(Budget::MonthlyQuota).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_on_two_instances_never_exceed_a_window_budget() {
    fleet(Budget::Window).await;
}

/// The units `key`'s counter holds in Redis, read from its layout (`docs/redis.md`, Keys).
fn used_in_redis(redis: &RedisServer, budget: Budget, key: &str) -> u64 {
    let name = key.replace(' ', "%2520");
    let counter = redis
        .keys()
        .into_iter()
        .find(|k| k.contains(&format!("{name}}}")))
        .expect("the key's counter");
    match budget {
        Budget::Bucket => {
            // The budget less the tokens (plus the millionths refilled at one a day).
            let tokens: f64 = redis.cli(&["hget", &counter, "t"])[0]
                .parse()
                .expect("tokens");
            BUDGET - tokens.floor() as u64
        }
        Budget::MonthlyQuota => redis.cli(&["hget", &counter, "n"])[0]
            .parse()
            .expect("units used"),
        Budget::Window => {
            // The newest member counts the units up to it; "n" is scored -(base + 1).
            let members = redis.cli(&["zrange", &counter, "0", "-1", "withscores"]);
            let base: i64 = members[1].parse().expect("the base's score");
            let newest = &members[members.len() - 2];
            let cum: u64 = newest
                .rsplit('#')
                .next()
                .and_then(|c| c.parse().ok())
                .expect("a member's count");
            cum - (-base - 1) as u64
        }
    }
}

async fn fleet(budget: Budget) {
    let rule = match budget {
        Budget::Bucket => format!("token_bucket: {{ rate: 1/d, burst: {BUDGET} }}"),
        Budget::MonthlyQuota => format!("quota: {{ limit: {BUDGET}, per: month }}"),
        Budget::Window => format!("sliding_window: {{ limit: {BUDGET}, window: 1h }}"),
    };
    let redis = RedisServer::start();
    let upstream = LlmUpstream::start();
    let yaml = format!(
        r#"
store: {{ type: redis, url: "{}", timeout: 2s }}
upstreams:
  llm: {{ url: "http://{}" }}
routes:
  - name: openai
    upstream: llm
    failure_mode: closed         # a store failure refuses: nothing is admitted unmetered
    policies:
      - name: tokens
        key: ["header:authorization"]
        {rule}
        cost: {{ usage: openai, reserve: true, max_cost: {RESERVE} }}
"#,
        redis.url(),
        upstream.addr
    );
    let a = GatewayProcess::spawn(&yaml).await;
    let b = GatewayProcess::spawn(&yaml).await;
    super::support::fleet::wait_ready(&a, 200, LIVENESS).await;
    super::support::fleet::wait_ready(&b, 200, LIVENESS).await;
    let urls = [a.url("/v1/chat/completions"), b.url("/v1/chat/completions")];
    // Every worker streams until its deadline; a refused one retries shortly after, so the budget
    // is run down to less than one reservation once the others' refunds have landed.
    let deadline = Instant::now() + Duration::from_secs(6);
    let mut tasks = Vec::new();
    for (k, key) in KEYS.iter().enumerate() {
        for w in 0..WORKERS_PER_KEY {
            let url = urls[(k + w) % 2].clone();
            let key = key.to_string();
            tasks.push(tokio::spawn(async move {
                let client = Client::new();
                let (mut admitted, mut refused) = (0u64, 0u64);
                for _ in 0..2000 {
                    if Instant::now() > deadline {
                        break;
                    }
                    match stream(&client, &url, &key).await {
                        200 => admitted += 1,
                        429 | 503 => {
                            refused += 1;
                            tokio::time::sleep(Duration::from_millis(25)).await;
                        }
                        other => panic!("status {other}"),
                    }
                }
                (admitted, refused)
            }));
        }
    }
    let (mut admitted, mut refused) = (0, 0);
    for task in tasks {
        let (a, r) = task.await.expect("worker");
        admitted += a;
        refused += r;
    }
    // Settled on both instances: nothing reserved.
    for gw in [&a, &b] {
        let deadline = Instant::now() + LIVENESS;
        while gw
            .metric(
                "turnstile_cost_reserved_units",
                &[("route", "openai"), ("policy", "tokens")],
            )
            .await
            != 0.0
        {
            assert!(Instant::now() < deadline, "reservations never settled");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let stats = upstream.stats().await;
    let client = Client::new();
    for key in KEYS {
        let reported = stats["by_key"][key].as_u64().unwrap_or(0);
        assert!(
            reported <= BUDGET,
            "{key}: the upstream reported {reported} tokens of a {BUDGET} budget ({stats})"
        );
        // What is left is less than one reservation: a last stream is refused on either
        // instance, and the budget was used to within RESERVE - 1 tokens.
        for url in &urls {
            let probe = client
                .send(
                    request(Method::POST, url)
                        .header("authorization", key)
                        .body(full(BODY))
                        .expect("request"),
                )
                .await;
            assert_eq!(probe.status, 429, "{key}: {reported} used, {probe:?}");
        }
        // The counter in Redis holds exactly the usage: less than one reservation is left.
        // (A refusal's x-ratelimit-remaining says 0, whatever is left below the cost.)
        let used = used_in_redis(&redis, budget, key);
        assert_eq!(
            used, reported,
            "{key}: the counter is exactly the usage ({budget:?})"
        );
        assert!(BUDGET - used < RESERVE, "{key}: {} left", BUDGET - used);
        assert!(reported > BUDGET - RESERVE, "{key}: only {reported} used");
    }
    println!(
        "{budget:?}: streams admitted {admitted}, refused {refused}; reported per key: {}",
        stats["by_key"]
    );
    assert!(admitted >= 3 * (BUDGET / 67), "{admitted} streams admitted");
}
