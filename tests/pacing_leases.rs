//! Waiting for a concurrency lease end to end (`on_limit: delay` on a concurrency policy,
//! `docs/algorithms.md` "Pacing"): requests that find every lease held wait in a queue and are
//! handed the leases as they are released, oldest first, never more than `limit` at the upstream;
//! past `max_delay` they are refused with `Retry-After`. On the memory store in process and on
//! three real gateway processes sharing one real Redis; then a client that goes away while it
//! waits, and SIGTERM with waiters.
//!
//! The upstream (in this process) counts the requests in flight exactly and records each
//! request's tag in arrival order.

mod support;

use std::time::{Duration, Instant};

use support::gateway::substitute;
use support::{Client, GatewayProcess, RedisServer, TestGateway, Upstream};

/// The bursts run one at a time: on 2 cores two of them would measure each other.
static TIMED: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// One route forwarding to `$UPSTREAM` with one concurrency policy on one counter for every
/// client (`key: [method]`), `policy` in flow style.
fn leased(policy: &str) -> String {
    format!(
        "upstreams:\n  up: {{ url: \"http://$UPSTREAM\" }}\nroutes:\n  - name: warm\n    \
         match: {{ path: /warm }}\n    respond: {{ status: 200 }}\n  - name: api\n    \
         match: {{ prefix: /api }}\n    upstream: up\n    policies:\n      - {{ name: c, key: [method], {policy} }}\n"
    )
}

/// Two leases; a request waits up to 5 s for one.
const TWO: &str = "concurrency: { limit: 2 }, on_limit: delay, max_delay: 5s";
const MAX_DELAY: Duration = Duration::from_millis(5000);

/// How long each request takes at the upstream, and how far apart the burst's requests are sent.
/// 200 ms apart: the order of the tickets is the order sent even when an instance of the three
/// on one Redis is scheduled late on a loaded machine (at 100 ms apart one was, and two tickets
/// were queued in the other order: the order the queue promises is the tickets').
const SLOW: Duration = Duration::from_millis(2400);
const APART: Duration = Duration::from_millis(200);

#[derive(Debug)]
struct Answer {
    status: u16,
    retry_after: Option<u64>,
    took: Duration,
}

/// Ten requests 200 ms apart, each 2.4 s at the upstream, two leases, `max_delay` 5 s:
/// requests 0 and 1 go at once; 2 and 3 get the leases 0 and 1 release at 2.4 s and 2.6 s (after
/// 2 s of waiting), 4 and 5 those 2 and 3 release (after 4 s); 6 to 9 would wait 6 s and are
/// refused when their 5 s pass, the last at 6.8 s, before the next leases come free (7.2 s).
/// 1 s of margin on each side of the bound, 400 ms before the third round. Returns the
/// answers in sending order.
async fn ten_in_a_row(urls: &[String], upstream: &Upstream) -> Vec<Answer> {
    let client = Client::new();
    // Connections first (the unlimited `/warm` route), so the burst is decided as it is sent.
    let warm: Vec<_> = (0..10)
        .map(|i| {
            let (client, url) = (
                client.clone(),
                urls[i % urls.len()].replace("/api", "/warm"),
            );
            tokio::spawn(async move { client.get(&url).await.status })
        })
        .collect();
    for task in warm {
        assert_eq!(task.await.expect("warm-up"), 200);
    }
    let started = tokio::time::Instant::now();
    let tasks: Vec<_> = (0..10)
        .map(|i| {
            let (client, url) = (client.clone(), urls[i % urls.len()].clone());
            tokio::spawn(async move {
                tokio::time::sleep_until(started + APART * i as u32).await;
                let sent = Instant::now();
                let tag = i.to_string();
                let sleep = SLOW.as_millis().to_string();
                let headers = [("x-test-tag", tag.as_str()), ("x-test-sleep-ms", &sleep)];
                let reply = client.get_with(&url, &headers).await;
                Answer {
                    status: reply.status,
                    retry_after: reply.header("retry-after").and_then(|v| v.parse().ok()),
                    took: sent.elapsed(),
                }
            })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.expect("request"));
    }
    let statuses: Vec<u16> = answers.iter().map(|a| a.status).collect();
    assert_eq!(
        statuses,
        [200, 200, 200, 200, 200, 200, 429, 429, 429, 429],
        "{answers:?}"
    );
    assert_eq!(
        upstream.peak_in_flight(),
        2,
        "never more than the limit at the upstream"
    );
    // Admitted in ticket order: the order they were sent, 100 ms apart.
    let order: Vec<String> = (0..6).map(|i| i.to_string()).collect();
    assert_eq!(upstream.tags(), order, "arrival order at the upstream");
    for (i, answer) in answers.iter().enumerate().skip(6) {
        assert!(
            answer.retry_after.is_some_and(|s| s >= 1),
            "refused {i} carries Retry-After: {answer:?}"
        );
        assert!(
            answer.took >= MAX_DELAY,
            "refused {i} waited its max_delay first: {answer:?}"
        );
    }
    answers
}

/// Two requests at once after the burst go at once: no lease and no ticket was left behind.
async fn nothing_left(urls: &[String]) {
    let client = Client::new();
    let tasks: Vec<_> = (0..2)
        .map(|i| {
            let (client, url) = (client.clone(), urls[i % urls.len()].clone());
            tokio::spawn(async move { client.get(&url).await })
        })
        .collect();
    for task in tasks {
        let reply = task.await.expect("request");
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("turnstile-delay"), None, "it did not wait");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store_hands_leases_to_waiters_in_order() {
    let _timed = TIMED.lock().await;
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(&leased(TWO), upstream.addr).await;
    let urls = [gw.url("/api")];
    ten_in_a_row(&urls, &upstream).await;
    let labels = [("route", "api")];
    assert_eq!(
        gw.metric("turnstile_delayed_requests_total", &labels).await,
        4.0
    );
    assert_eq!(gw.metric("turnstile_waiting_requests", &labels).await, 0.0);
    wait_for_in_flight(|| gw.metric("turnstile_in_flight_requests", &labels)).await;
    nothing_left(&urls).await;
}

/// Polls a gauge of requests holding leases until it is 0 (leases are released as bodies end).
async fn wait_for_in_flight<F, Fut>(read: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = f64>,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    while read().await != 0.0 {
        assert!(Instant::now() < deadline, "leases still held");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Three gateway processes on one real Redis: one queue across them, the same order and bound,
/// and nothing left in Redis afterwards (the lease ZSET and its queue are gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_on_one_redis_share_one_queue() {
    let _timed = TIMED.lock().await;
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let yaml = format!(
        "store:\n  type: redis\n  url: {}\n  timeout: 2s\n  key_prefix: \"lq:\"\n{}",
        redis.url(),
        substitute(&leased(TWO), Some(upstream.addr))
    );
    let mut gateways = Vec::new();
    for _ in 0..3 {
        gateways.push(GatewayProcess::spawn(&yaml).await);
    }
    for gw in &gateways {
        support::fleet::wait_ready(gw, 200, Duration::from_secs(20)).await;
    }
    let urls: Vec<String> = gateways.iter().map(|g| g.url("/api")).collect();
    ten_in_a_row(&urls, &upstream).await;
    let labels = [("route", "api")];
    let mut delayed = 0.0;
    let (mut allowed, mut limited) = (0.0, 0.0);
    for gw in &gateways {
        delayed += gw.metric("turnstile_delayed_requests_total", &labels).await;
        assert_eq!(gw.metric("turnstile_waiting_requests", &labels).await, 0.0);
        let decided = |decision| [("route", "api"), ("policy", "c"), ("decision", decision)];
        allowed += gw
            .metric("turnstile_decisions_total", &decided("allowed"))
            .await;
        limited += gw
            .metric("turnstile_decisions_total", &decided("limited"))
            .await;
    }
    assert_eq!(
        delayed, 4.0,
        "the four that waited, over the three instances"
    );
    // Once per request: 2 at once and 4 after a wait, 4 refused after `max_delay`.
    assert_eq!((allowed, limited), (6.0, 4.0));
    // Released in spawned calls as each response ends: gone within a moment.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left: Vec<String> = redis
            .keys()
            .into_iter()
            .filter(|k| k.contains(":cc"))
            .collect();
        if left.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "left in Redis: {left:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    nothing_left(&urls).await;
}

/// A client that goes away while it waits gives its place back: the lease released next goes
/// to the waiter behind it, the request that went away never reaches the upstream, and no lease
/// or ticket is left (a request afterwards passes without waiting).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_gives_back_its_place() {
    goes_away("").await;
}

/// The same on Redis, where the waiter leaves by a script call of its own; afterwards no lease
/// and no queue is left in Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_gives_back_its_place_on_redis() {
    let redis = RedisServer::start();
    let store = format!(
        "store:\n  type: redis\n  url: {}\n  timeout: 2s\n  key_prefix: \"gone:\"\n",
        redis.url()
    );
    goes_away(&store).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while redis.keys().iter().any(|k| k.contains(":cc")) {
        assert!(
            Instant::now() < deadline,
            "left in Redis: {:?}",
            redis.keys()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn goes_away(store: &str) {
    let upstream = Upstream::start().await;
    let policy = "concurrency: { limit: 1 }, on_limit: delay, max_delay: 5s";
    let yaml = format!("{store}{}", leased(policy));
    let gw = TestGateway::with_upstream(&yaml, upstream.addr).await;
    let client = Client::new();
    let url = gw.url("/api");
    let holding = {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move {
            let headers = [("x-test-hold-head", "1"), ("x-test-tag", "first")];
            client.get_with(&url, &headers).await.status
        })
    };
    upstream.wait_for_requests(1).await;
    let gone = gw.open_request("x-test-tag: gone\r\n").await;
    gw.wait_for_waiting(1.0).await;
    let next = {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move { client.get_with(&url, &[("x-test-tag", "next")]).await })
    };
    gw.wait_for_waiting(2.0).await;
    drop(gone);
    gw.wait_for_waiting(1.0).await;
    upstream.release(1);
    assert_eq!(holding.await.expect("first"), 200);
    let reply = tokio::time::timeout(Duration::from_secs(3), next)
        .await
        .expect("the next waiter is handed the lease at once")
        .expect("next");
    assert_eq!(reply.status, 200);
    assert!(reply.header("turnstile-delay").is_some(), "it waited");
    assert_eq!(
        upstream.tags(),
        ["first", "next"],
        "the one that went away never went on"
    );
    gw.wait_for_waiting(0.0).await;
    let labels = [("route", "api")];
    wait_for_in_flight(|| gw.metric("turnstile_in_flight_requests", &labels)).await;
    let again = client.get(&url).await;
    assert_eq!(again.status, 200);
    assert_eq!(
        again.header("turnstile-delay"),
        None,
        "no lease or ticket left"
    );
}

/// SIGTERM with waiters: each is answered at once (429 with `Retry-After`), not dropped, and
/// the request holding the lease finishes within the grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_answers_the_lease_waiters() {
    let upstream = Upstream::start().await;
    let policy = "concurrency: { limit: 1 }, on_limit: delay, max_delay: 10s";
    let yaml = format!(
        "server:\n  shutdown_grace: 20s\n{}",
        substitute(&leased(policy), Some(upstream.addr))
    );
    let mut gw = GatewayProcess::spawn(&yaml).await;
    let client = Client::new();
    let url = gw.url("/api");
    let holding = {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move {
            client
                .get_with(&url, &[("x-test-hold-head", "1")])
                .await
                .status
        })
    };
    upstream.wait_for_requests(1).await;
    let waiters: Vec<_> = (0..2)
        .map(|_| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move {
                let reply = client.get(&url).await;
                (
                    reply.status,
                    reply.header("retry-after").map(str::to_string),
                )
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while gw
        .metric("turnstile_waiting_requests", &[("route", "api")])
        .await
        != 2.0
    {
        assert!(Instant::now() < deadline, "never 2 waiting");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let signalled = Instant::now();
    gw.signal("TERM");
    for waiter in waiters {
        let (status, retry) = waiter.await.expect("waiter");
        assert_eq!(status, 429, "a waiter is answered");
        assert!(retry.is_some(), "with Retry-After");
    }
    assert!(
        signalled.elapsed() < Duration::from_secs(1),
        "answered {:?} after SIGTERM",
        signalled.elapsed()
    );
    upstream.release(1);
    assert_eq!(holding.await.expect("holder"), 200);
    let status = gw.wait().await;
    assert!(status.success(), "exit {status:?}");
    assert_eq!(upstream.requests(), 1, "no waiter reached the upstream");
}

/// The example of docs/algorithms.md's "Waiting for a lease" loads as it reads: two leases per
/// client, a wait of 5 s at most.
#[test]
fn the_documented_example_loads() {
    let page = std::fs::read_to_string(support::tools::repo_path("docs/algorithms.md"))
        .expect("docs/algorithms.md");
    let section = page
        .split("\n### ")
        .find(|s| s.starts_with("Waiting for a lease"))
        .and_then(|s| s.split("\n## ").next())
        .expect("a Waiting for a lease section");
    let blocks: Vec<&str> = section
        .split("```yaml\n")
        .skip(1)
        .filter_map(|rest| rest.split_once("```").map(|(block, _)| block))
        .collect();
    assert_eq!(blocks.len(), 1);
    let snapshot = turnstile::config::parse(blocks[0], std::path::Path::new("docs/algorithms.md"))
        .unwrap_or_else(|e| panic!("{e}"));
    let policy = &snapshot.routes[0].policies[0];
    assert_eq!(policy.rule.limit(), 2);
    assert_eq!(policy.max_delay_us, Some(5_000_000));
}

/// Regression: a request that waited for a lease was counted in `turnstile_decisions_total` by
/// both of its decisions (before and after the wait), so every other policy of its route counted
/// it twice, and the concurrency policy counted it `limited` although it was admitted. Now each
/// request counts once per policy: the ten of the burst are 10 `allowed` for a token bucket that
/// never trips, and 6 `allowed` (2 at once, 4 after a wait) and 4 `limited` (refused after
/// `max_delay`) for the concurrency policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_waits_for_a_lease_counts_once_per_policy() {
    let _timed = TIMED.lock().await;
    let upstream = Upstream::start().await;
    let yaml = leased(TWO).replace(
        "      - { name: c,",
        "      - { name: b, key: [method], token_bucket: { rate: 1000/s, burst: 1000 } }\n      - { name: c,",
    );
    let gw = TestGateway::with_upstream(&yaml, upstream.addr).await;
    ten_in_a_row(&[gw.url("/api")], &upstream).await;
    let count = |policy: &'static str, decision: &'static str| {
        let gw = &gw;
        async move {
            gw.metric(
                "turnstile_decisions_total",
                &[("route", "api"), ("policy", policy), ("decision", decision)],
            )
            .await
        }
    };
    assert_eq!(count("b", "allowed").await, 10.0);
    assert_eq!(count("b", "limited").await, 0.0);
    assert_eq!(count("c", "allowed").await, 6.0);
    assert_eq!(count("c", "limited").await, 4.0);
}
