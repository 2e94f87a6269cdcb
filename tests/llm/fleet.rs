//! The key promise of `reserve: true`: many concurrent streams from several API keys, on two
//! gateway processes sharing one real Redis, against a 1,000-token budget per key. The tokens the
//! upstream reports for a key never exceed 1,000, and once demand has run the budget down, what is
//! left is less than one reservation (the documented slack, `docs/llm.md`).

use std::time::{Duration, Instant};

use http::Method;
use http_body_util::BodyExt;

use super::support::client::{full, request};
use super::support::llm::LlmUpstream;
use super::support::{Client, GatewayProcess, RedisServer, LIVENESS};

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
        token_bucket: {{ rate: 1/d, burst: {BUDGET} }}
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
    let deadline = Instant::now() + Duration::from_secs(8);
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
        // The bucket in Redis holds exactly the budget less the usage (plus the millionths of a
        // token refilled at one a day): less than one reservation. (A refusal's
        // x-ratelimit-remaining says 0, whatever is left below the cost.)
        let name = key.replace(' ', "%2520");
        let bucket = redis
            .keys()
            .into_iter()
            .find(|k| k.contains(&format!("{name}}}")))
            .expect("the key's bucket");
        let tokens: f64 = redis.cli(&["hget", &bucket, "t"])[0]
            .parse()
            .expect("tokens");
        assert_eq!(
            tokens.floor() as u64,
            BUDGET - reported,
            "{key}: the counter is exactly the usage"
        );
        assert!(tokens < RESERVE as f64, "{key}: {tokens} left");
        assert!(reported > BUDGET - RESERVE, "{key}: only {reported} used");
    }
    println!(
        "streams admitted {admitted}, refused {refused}; reported per key: {}",
        stats["by_key"]
    );
    assert!(admitted >= 3 * (BUDGET / 67), "{admitted} streams admitted");
}
