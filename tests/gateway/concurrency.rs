//! Exact counts under concurrency: 200 requests in flight at once on one key admit exactly the
//! burst (or limit), plus at most what refills in the time they took.

use std::time::Instant;

use crate::support::gateway::{one_route, substitute};
use crate::support::{metric, Client, GatewayProcess, TestGateway, Upstream};

const REQUESTS: usize = 200;

/// Fires `REQUESTS` concurrent GETs at `url`; returns (admitted, rejected, elapsed seconds).
async fn burst_of_requests(url: &str, c: Client) -> (usize, usize, f64) {
    let started = Instant::now();
    let tasks: Vec<_> = (0..REQUESTS)
        .map(|_| {
            let (c, url) = (c.clone(), url.to_string());
            tokio::spawn(async move { c.get(&url).await.status })
        })
        .collect();
    let (mut admitted, mut rejected) = (0, 0);
    for task in tasks {
        match task.await.unwrap() {
            200 => admitted += 1,
            429 => rejected += 1,
            other => panic!("unexpected status {other}"),
        }
    }
    (admitted, rejected, started.elapsed().as_secs_f64())
}

/// One route to `$UPSTREAM` with one policy `p` keyed by client IP.
fn config(policy: &str) -> String {
    one_route(&format!(
        "      - {{ name: p, key: [client_ip], {policy} }}"
    ))
}

/// Fires the requests at `url` and checks the counts: at least the burst of 5, at most `bound`
/// of the time taken, and the upstream and the metrics (scraped from `metrics_url`) agree.
async fn check_burst(
    policy: &str,
    url: &str,
    metrics_url: &str,
    upstream: &Upstream,
    client: Client,
    bound: impl Fn(f64) -> usize,
) {
    let (admitted, rejected, elapsed) = burst_of_requests(url, client).await;
    let most = bound(elapsed);
    println!("{policy}: {admitted} admitted of {REQUESTS} in {elapsed:.3}s (at most {most})");
    assert!(
        (5..=most).contains(&admitted),
        "{admitted} admitted in {elapsed:.3}s; expected 5..={most}"
    );
    assert_eq!(admitted + rejected, REQUESTS);
    assert_eq!(
        upstream.requests(),
        admitted,
        "only admitted requests reach the upstream"
    );
    let text = Client::new().get(metrics_url).await.text();
    let count = |d: &str| {
        metric(
            &text,
            "turnstile_decisions_total",
            &[("route", "api"), ("policy", "p"), ("decision", d)],
        )
    };
    assert_eq!(count("allowed"), Some(admitted as f64));
    assert_eq!(count("limited"), Some(rejected as f64));
}

async fn run(policy: &str, client: Client, bound: impl Fn(f64) -> usize) {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(&config(policy), upstream.addr).await;
    let metrics_url = gw.admin_url("/metrics");
    check_burst(policy, &gw.url("/"), &metrics_url, &upstream, client, bound).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_concurrent_requests_on_a_burst_of_five() {
    // 2/s: the bound is 5 plus whatever refilled while the requests were in flight.
    run(
        "token_bucket: { rate: 2/s, burst: 5 }",
        Client::new(),
        |elapsed| 5 + (2.0 * elapsed).floor() as usize,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_concurrent_requests_on_a_window_of_five() {
    run(
        "sliding_window: { limit: 5, window: 1m }",
        Client::new(),
        |elapsed| 5 * (1 + (elapsed / 60.0).floor() as usize),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_concurrent_requests_on_a_bucketed_window_of_five() {
    run(
        "sliding_window: { limit: 5, window: 1m, buckets: 6 }",
        Client::new(),
        |elapsed| 5 * (1 + (elapsed / 60.0).floor() as usize),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_concurrent_h2_streams_on_a_burst_of_five() {
    // One h2c connection, 200 streams at once (the gateway allows 256 per connection).
    run(
        "token_bucket: { rate: 2/s, burst: 5 }",
        Client::http2(),
        |elapsed| 5 + (2.0 * elapsed).floor() as usize,
    )
    .await;
}

/// The binary itself, on one worker (tokio's single-threaded scheduler) and on two
/// (work-stealing): the same exact count either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_admits_exactly_the_burst_on_one_worker_and_on_two() {
    let policy = "token_bucket: { rate: 2/s, burst: 5 }";
    for workers in [1, 2] {
        let upstream = Upstream::start().await;
        let yaml = substitute(&config(policy), Some(upstream.addr));
        let gw = GatewayProcess::spawn_with_workers(&yaml, workers).await;
        let bound = |elapsed: f64| 5 + (2.0 * elapsed).floor() as usize;
        check_burst(
            policy,
            &gw.url("/"),
            &gw.admin_url("/metrics"),
            &upstream,
            Client::new(),
            bound,
        )
        .await;
    }
}
