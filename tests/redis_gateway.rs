//! Gateway instances (real `turnstile` processes) sharing one real Redis: exact limits across
//! instances, immunity to gateway clock skew, and behaviour while Redis is down or stalled.

mod support;

use std::time::{Duration, Instant};

use tokio::task::JoinHandle;

use support::fleet::{burst, count, wait_ready};
use support::process::{config_file, with_free_ports};
use support::{Client, GatewayProcess, RedisServer, Reply};

fn store(redis: &RedisServer, timeout: &str, failure_mode: &str) -> String {
    format!(
        "store:\n  type: redis\n  url: {}\n  pool_size: 2\n  timeout: {timeout}\n  \
         failure_mode: {failure_mode}\n  key_prefix: \"it:\"\n",
        redis.url()
    )
}

/// A route answering 200 by itself, limited by one counter shared by every client.
fn route(name: &str, extra: &str, policy: &str) -> String {
    format!(
        "  - name: {name}\n    match: {{ path: /{name} }}\n    respond: {{ status: 200, body: \"ok\\n\" }}\n\
         {extra}    policies:\n      - name: shared\n        key: [method]\n        {policy}\n"
    )
}

fn decisions(route: &str, decision: &str) -> [(&'static str, String); 3] {
    [
        ("route", route.to_string()),
        ("policy", "shared".to_string()),
        ("decision", decision.to_string()),
    ]
}

async fn decided(gw: &GatewayProcess, route: &str, decision: &str) -> f64 {
    let labels = decisions(route, decision);
    let labels: Vec<(&str, &str)> = labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
    gw.metric("turnstile_decisions_total", &labels).await
}

async fn store_errors(gw: &GatewayProcess, kind: &str) -> f64 {
    gw.metric(
        "turnstile_store_errors_total",
        &[("store", "redis"), ("kind", kind)],
    )
    .await
}

fn header<'a>(reply: &'a Reply, name: &str) -> Option<&'a str> {
    reply.headers.get(name).and_then(|v| v.to_str().ok())
}

/// A gateway process whose clock runs `offset` ahead (libfaketime, as `faketime -f OFFSET`).
async fn spawn_skewed(yaml: &str, offset: &str) -> GatewayProcess {
    let (dir, path) = config_file(&with_free_ports(yaml));
    let preload = support::tools::libfaketime();
    let preload = preload.to_str().expect("utf-8 path");
    GatewayProcess::spawn_at(
        dir,
        path,
        &[
            ("LD_PRELOAD", preload),
            ("FAKETIME", offset),
            ("DONT_FAKE_MONOTONIC", "1"),
        ],
    )
    .await
}

fn assert_every_key_expires(redis: &RedisServer) {
    let keys = redis.keys();
    assert!(!keys.is_empty(), "the gateways wrote no keys");
    for key in keys {
        assert!(key.starts_with("it:{"), "unexpected key {key}");
        let ttl: i64 = redis.cli(&["pttl", &key])[0].parse().expect("pttl");
        assert!(ttl > 0, "key {key} has no TTL ({ttl})");
    }
}

const READY: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_instances_admit_exactly_the_limit() {
    let redis = RedisServer::start();
    // Closed, with a generous timeout: a failed decision shows up as a 503, never as an extra 200.
    let config = format!(
        "{}routes:\n{}{}",
        store(&redis, "2s", "closed"),
        route("bucket", "", "token_bucket: { rate: 1/d, burst: 50 }"),
        route("window", "", "sliding_window: { limit: 40, window: 1m }"),
    );
    // One instance on a single thread (tokio's current_thread scheduler), two on work-stealing
    // pools: the store's client works the same under both.
    let mut gateways = Vec::new();
    for workers in [1, 2, 2] {
        gateways.push(GatewayProcess::spawn_with_workers(&config, workers).await);
    }
    for gw in &gateways {
        wait_ready(gw, 200, READY).await;
    }

    let urls: Vec<String> = gateways.iter().map(|g| g.url("/bucket")).collect();
    let statuses = burst(&urls, 300).await;
    assert_eq!(
        count(&statuses, 200),
        50,
        "token bucket of burst 50: {statuses:?}"
    );
    assert_eq!(
        count(&statuses, 429),
        250,
        "the rest are limited: {statuses:?}"
    );

    let urls: Vec<String> = gateways.iter().map(|g| g.url("/window")).collect();
    let statuses = burst(&urls, 300).await;
    assert_eq!(
        count(&statuses, 200),
        40,
        "sliding window of 40/min: {statuses:?}"
    );
    assert_eq!(
        count(&statuses, 429),
        260,
        "the rest are limited: {statuses:?}"
    );

    // Every instance took part in the decisions.
    for gw in &gateways {
        let total = decided(gw, "bucket", "allowed").await + decided(gw, "bucket", "limited").await;
        assert_eq!(total, 100.0, "each instance decided its 100 requests");
    }
    assert_every_key_expires(&redis);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_skewed_gateway_clock_gains_nothing() {
    let redis = RedisServer::start();
    let config = format!(
        "{}routes:\n{}{}",
        store(&redis, "2s", "closed"),
        // One token a minute: a gateway clock two minutes ahead would be worth two tokens.
        route("bucket", "", "token_bucket: { rate: 1/m, burst: 10 }"),
        route("window", "", "sliding_window: { limit: 10, window: 1m }"),
    );
    let honest = GatewayProcess::spawn(&config).await;
    let ahead = spawn_skewed(&config, "+2m").await;
    wait_ready(&honest, 200, READY).await;
    wait_ready(&ahead, 200, READY).await;

    // The skew is real: the instance's own clock (its Date header) runs two minutes ahead.
    let client = Client::new();
    let a = client.get(&honest.url("/unrouted")).await;
    let b = client.get(&ahead.url("/unrouted")).await;
    let skew = date_seconds(&b) - date_seconds(&a);
    assert!(
        (110..=130).contains(&skew),
        "faketime did not apply: skew {skew} s"
    );

    for path in ["/bucket", "/window"] {
        // Alternate instances one request at a time: with gateway clocks, each hop to the
        // instance ahead would refill (or expire) two minutes' worth.
        let mut admitted = 0;
        for i in 0..30 {
            let gw = if i % 2 == 0 { &honest } else { &ahead };
            let reply = client.get(&gw.url(path)).await;
            assert!(matches!(reply.status, 200 | 429), "{path}: {reply:?}");
            if reply.status == 200 {
                admitted += 1;
            } else {
                let retry: u64 = header(&reply, "retry-after")
                    .and_then(|v| v.parse().ok())
                    .expect("Retry-After on 429");
                assert!((1..=60).contains(&retry), "{path}: Retry-After {retry}");
            }
        }
        assert_eq!(
            admitted, 10,
            "{path}: exactly the limit across skewed instances"
        );
    }
    assert_every_key_expires(&redis);
}

/// Seconds since midnight in the reply's Date header.
fn date_seconds(reply: &Reply) -> i64 {
    // "Sat, 21 Nov 2026 11:23:26 GMT"
    let date = header(reply, "date").expect("Date header");
    let time = date.split_whitespace().nth(4).expect("time in Date");
    let parts: Vec<i64> = time
        .split(':')
        .map(|p| p.parse().expect("hh:mm:ss"))
        .collect();
    parts[0] * 3600 + parts[1] * 60 + parts[2]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_killed_then_restarted() {
    // On a single thread the outage must cost no more than on several.
    redis_killed_then_restarted_on(1).await;
    redis_killed_then_restarted_on(2).await;
}

async fn redis_killed_then_restarted_on(workers: usize) {
    let mut redis = RedisServer::start();
    let config = format!(
        "{}routes:\n{}{}{}",
        store(&redis, "50ms", "open"),
        route("open", "", "token_bucket: { rate: 1/d, burst: 1000 }"),
        route(
            "closed",
            "    failure_mode: closed\n",
            "token_bucket: { rate: 1/d, burst: 1000 }"
        ),
        route("limited", "", "token_bucket: { rate: 1/d, burst: 3 }"),
    );
    let gw = GatewayProcess::spawn_with_workers(&config, workers).await;
    wait_ready(&gw, 200, READY).await;
    let client = Client::new();
    let statuses = burst(&[gw.url("/limited")], 5).await;
    assert_eq!((count(&statuses, 200), count(&statuses, 429)), (3, 2));

    redis.kill();
    // Open route: keeps serving, each request well within the store timeout plus slack.
    for _ in 0..30 {
        let started = Instant::now();
        let reply = client.get(&gw.url("/open")).await;
        let took = started.elapsed();
        assert_eq!(reply.status, 200, "open route during the outage: {reply:?}");
        assert!(took < Duration::from_millis(250), "a request took {took:?}");
    }
    let reply = client.get(&gw.url("/closed")).await;
    assert_eq!(
        reply.status, 503,
        "closed route during the outage: {reply:?}"
    );
    assert_eq!(header(&reply, "retry-after"), Some("1"));
    wait_ready(&gw, 503, Duration::from_secs(5)).await;
    assert_eq!(decided(&gw, "open", "failed_open").await, 30.0);
    assert_eq!(decided(&gw, "closed", "failed_closed").await, 1.0);
    // Whatever the kind (a connection killed mid-reply can surface as a script error), every
    // failed decision is counted once.
    let errors = store_errors(&gw, "connection").await
        + store_errors(&gw, "timeout").await
        + store_errors(&gw, "circuit_open").await
        + store_errors(&gw, "script").await;
    assert_eq!(
        errors, 31.0,
        "every failed decision is a counted store error"
    );

    // A fresh server on the same port: no data, no scripts. Limiting resumes by itself.
    redis.restart();
    wait_ready(&gw, 200, READY).await;
    let statuses = burst(&[gw.url("/limited")], 5).await;
    assert_eq!(
        (count(&statuses, 200), count(&statuses, 429)),
        (3, 2),
        "limiting after the restart: {statuses:?}"
    );

    // The script cache emptied under a live connection: NOSCRIPT, reload, retry, no failure.
    redis.cli(&["script", "flush"]);
    let reply = client.get(&gw.url("/closed")).await;
    assert_eq!(reply.status, 200, "after SCRIPT FLUSH: {reply:?}");
    assert_every_key_expires(&redis);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stalled_redis_costs_at_most_the_timeout_then_nothing() {
    a_stalled_redis_on(1).await;
    a_stalled_redis_on(2).await;
}

async fn a_stalled_redis_on(workers: usize) {
    let redis = RedisServer::start();
    let config = format!(
        "{}routes:\n{}",
        store(&redis, "50ms", "open"),
        route("open", "", "token_bucket: { rate: 1/d, burst: 1000 }"),
    );
    let gw = GatewayProcess::spawn_with_workers(&config, workers).await;
    wait_ready(&gw, 200, READY).await;
    let client = Client::new();
    assert_eq!(client.get(&gw.url("/open")).await.status, 200);

    // SIGSTOP: the connection stays open but nothing answers.
    signal(&redis, "-STOP");
    let mut slow = 0;
    for _ in 0..20 {
        let started = Instant::now();
        let reply = client.get(&gw.url("/open")).await;
        let took = started.elapsed();
        assert_eq!(reply.status, 200);
        assert!(took < Duration::from_millis(300), "a request took {took:?}");
        if took >= Duration::from_millis(40) {
            slow += 1;
        }
    }
    signal(&redis, "-CONT");
    // The breaker opened after a handful of timeouts: the rest skipped Redis.
    assert!(
        (1..=8).contains(&slow),
        "{slow} of 20 requests waited for the timeout"
    );
    let skipped = store_errors(&gw, "circuit_open").await;
    assert!(skipped >= 10.0, "circuit_open errors: {skipped}");
    // And Redis is used again once it answers.
    let deadline = Instant::now() + READY;
    loop {
        let before = decided(&gw, "open", "allowed").await;
        client.get(&gw.url("/open")).await;
        if decided(&gw, "open", "allowed").await > before {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "Redis never used again after SIGCONT"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The store timeout of the stalled-Redis tests below.
const STALL_TIMEOUT: Duration = Duration::from_millis(400);

/// A gateway on a Redis with a 400 ms timeout (failing open) and one route, `/{name}`, that has
/// already decided once.
async fn gateway_before_a_stall(name: &str) -> (RedisServer, GatewayProcess, Client, String) {
    let redis = RedisServer::start();
    let config = format!(
        "{}routes:\n{}",
        store(&redis, "400ms", "open"),
        route(name, "", "token_bucket: { rate: 1/d, burst: 1000 }"),
    );
    let gw = GatewayProcess::spawn_with_workers(&config, 2).await;
    wait_ready(&gw, 200, READY).await;
    let client = Client::new();
    let url = gw.url(&format!("/{name}"));
    assert_eq!(client.get(&url).await.status, 200);
    (redis, gw, client, url)
}

/// `n` requests at once, each timed.
fn timed_requests(client: &Client, url: &str, n: usize) -> Vec<JoinHandle<(u16, Duration)>> {
    (0..n)
        .map(|_| {
            let (client, url) = (client.clone(), url.to_string());
            tokio::spawn(async move {
                let started = Instant::now();
                let reply = client.get(&url).await;
                (reply.status, started.elapsed())
            })
        })
        .collect()
}

/// How long each request took; every one admitted (failing open).
async fn times(tasks: Vec<JoinHandle<(u16, Duration)>>) -> Vec<Duration> {
    let mut took = Vec::new();
    for task in tasks {
        let (status, elapsed) = task.await.expect("request task");
        assert_eq!(status, 200, "failure_mode open");
        took.push(elapsed);
    }
    took
}

/// None slower than the timeout and some slack.
fn assert_each_within_the_timeout(took: &[Duration]) {
    let slowest = took.iter().max().copied().unwrap_or_default();
    assert!(
        slowest < STALL_TIMEOUT + Duration::from_millis(250),
        "a request waited {slowest:?} with a store timeout of {STALL_TIMEOUT:?}: {took:?}"
    );
}

/// Decisions queued while both calls in flight are stalled wait at most their own timeout. The
/// batch alone does not ensure it (fred's command timeout did not hold for a call sent to the
/// stalled server after earlier ones had timed out: about twice the timeout here, without a
/// timer of the decisions' own).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn decisions_queued_behind_a_stalled_redis_wait_at_most_the_timeout() {
    let (redis, _gw, client, url) = gateway_before_a_stall("queued").await;
    signal(&redis, "-STOP");
    // One call takes the first decision, the other the next few; the last wave queues behind
    // both.
    let mut tasks = timed_requests(&client, &url, 1);
    tokio::time::sleep(Duration::from_millis(10)).await;
    tasks.extend(timed_requests(&client, &url, 5));
    tokio::time::sleep(Duration::from_millis(50)).await;
    tasks.extend(timed_requests(&client, &url, 6));
    let took = times(tasks).await;
    signal(&redis, "-CONT");
    assert_each_within_the_timeout(&took);
}

/// Decisions that arrive while Redis stays stalled, wave after wave, each end by their own
/// timeout: with both calls in flight stuck past their deadlines (fred's command timeout does not
/// always end them), the decisions queued behind them are timed by the batch itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn decisions_arriving_throughout_a_redis_stall_each_wait_at_most_the_timeout() {
    let (redis, _gw, client, url) = gateway_before_a_stall("waves").await;
    signal(&redis, "-STOP");
    let mut tasks = Vec::new();
    // 24 waves of 3 over 1.2 s: three times the timeout, so calls are sent, stall and time out
    // while later decisions queue behind them.
    for _ in 0..24 {
        tasks.extend(timed_requests(&client, &url, 3));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took = times(tasks).await;
    signal(&redis, "-CONT");
    assert_each_within_the_timeout(&took);
}

/// Regression: right after start the store was still connecting, and the gateway took
/// `failed_open` decisions (no rate-limit headers, 8 admitted on a burst of 5) and logged a false
/// `redis store is unreachable`. Requests sent the moment the gateway says it listens must be
/// decided by Redis, exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn startup_while_redis_connects_admits_no_more_than_the_burst() {
    let redis = RedisServer::start();
    let config = format!(
        "{}routes:\n{}",
        store(&redis, "2s", "open"),
        route("startup", "", "token_bucket: { rate: 1/d, burst: 5 }"),
    );
    let gw = GatewayProcess::spawn(&config).await;
    // No wait for /readyz: the requests go out the moment the port is announced.
    let client = Client::new();
    let url = gw.url("/startup");
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move { client.get(&url).await })
        })
        .collect();
    let mut replies = Vec::new();
    for task in tasks {
        replies.push(task.await.expect("request task"));
    }
    let statuses: Vec<u16> = replies.iter().map(|r| r.status).collect();
    assert_eq!(
        (count(&statuses, 200), count(&statuses, 429)),
        (5, 3),
        "burst 5 at startup: {statuses:?}; log:\n{}",
        gw.log()
    );
    for reply in &replies {
        assert!(
            header(reply, "x-ratelimit-limit") == Some("5"),
            "every decision came from Redis: {reply:?}"
        );
    }
    assert_eq!(decided(&gw, "startup", "failed_open").await, 0.0);
    assert_eq!(decided(&gw, "startup", "allowed").await, 5.0);
    let log = gw.log();
    assert!(
        !log.contains("unreachable"),
        "no false unreachable warning at a normal start:\n{log}"
    );
}

/// Concurrency leases survive the instance that took them only for their TTL: two requests hold
/// both leases through instance A, A is killed with SIGKILL (nothing released), and instance B is
/// refused until the leases expire, then admitted (issue 15).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leases_of_a_killed_instance_expire_after_their_ttl() {
    const TTL: Duration = Duration::from_secs(4);
    let redis = RedisServer::start();
    let upstream = support::Upstream::start().await;
    let config = format!(
        "{}upstreams:\n  up: {{ url: \"http://{}\" }}\nroutes:\n  - name: api\n    upstream: up\n    \
         policies:\n      - name: inflight\n        key: [method]\n        \
         concurrency: {{ limit: 2, lease_ttl: 4s }}\n",
        store(&redis, "2s", "closed"),
        upstream.addr,
    );
    let mut a = GatewayProcess::spawn(&config).await;
    let b = GatewayProcess::spawn(&config).await;
    wait_ready(&a, 200, READY).await;
    wait_ready(&b, 200, READY).await;
    // wait_ready's requests went through: only the held ones below may hold leases.
    let before = upstream.requests();

    let sent = Instant::now();
    let held: Vec<_> = (0..2)
        .map(|_| {
            let url = a.url("/held");
            tokio::spawn(async move {
                Client::new()
                    .try_get_with(&url, &[("x-test-hold-head", "1")])
                    .await
            })
        })
        .collect();
    upstream.wait_for_requests(before + 2).await;
    assert_eq!(Client::new().get(&b.url("/x")).await.status, 429);

    a.signal("KILL");
    a.wait().await;
    for task in held {
        assert!(
            task.await.expect("task").is_err(),
            "a killed gateway answered"
        );
    }
    // Nothing released them: still held, until the TTL.
    if sent.elapsed() < TTL - Duration::from_millis(500) {
        assert_eq!(Client::new().get(&b.url("/x")).await.status, 429);
    }
    let deadline = Instant::now() + TTL + support::LIVENESS;
    loop {
        let status = Client::new().get(&b.url("/x")).await.status;
        if status == 200 {
            break;
        }
        assert_eq!(status, 429);
        assert!(Instant::now() < deadline, "capacity never came back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let back = sent.elapsed();
    assert!(
        back >= TTL - Duration::from_millis(50),
        "capacity came back after {back:?}, before the {TTL:?} lease TTL"
    );
    upstream.release(2);
}

/// Sends `sig` (`-STOP`, `-CONT`) to the test's Redis server by its PID.
fn signal(redis: &RedisServer, sig: &str) {
    let pid = redis.pid().expect("redis pid").to_string();
    let ok = std::process::Command::new("kill")
        .args([sig, &pid])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill {sig} {pid}");
}

/// The concurrency tests below: a limit of 5, 100 slow requests at once.
const CC_LIMIT: usize = 5;
const CC_REQUESTS: usize = 100;

/// A gateway on `redis` with the store's defaults (pool, `timeout`, `failure_mode: open`) and one
/// route, `api`, proxying to `upstream` under a concurrency limit of [`CC_LIMIT`].
async fn concurrency_gateway(redis: &RedisServer, upstream: &support::Upstream) -> GatewayProcess {
    let config = format!(
        "store:\n  type: redis\n  url: {}\n  key_prefix: \"it:\"\n\
         upstreams:\n  up: {{ url: \"http://{}\" }}\nroutes:\n  - name: api\n    upstream: up\n    \
         policies:\n      - name: shared\n        key: [method]\n        \
         concurrency: {{ limit: {CC_LIMIT} }}\n",
        redis.url(),
        upstream.addr,
    );
    let gw = GatewayProcess::spawn_with_workers(&config, 2).await;
    wait_ready(&gw, 200, READY).await;
    gw
}

/// `n` requests at once, each held `hold_ms` by the upstream; the status of each.
async fn slow_burst(gw: &GatewayProcess, n: usize, hold_ms: u64) -> Vec<u16> {
    let client = Client::new();
    let hold = hold_ms.to_string();
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (client, url, hold) = (client.clone(), gw.url("/slow"), hold.clone());
            tokio::spawn(async move {
                client
                    .get_with(&url, &[("x-test-sleep-ms", hold.as_str())])
                    .await
                    .status
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for task in tasks {
        statuses.push(task.await.expect("request task"));
    }
    statuses
}

/// Returns once Redis on `port` stops answering (`DEBUG SLEEP` has begun): a `PING` on a fresh
/// connection gets no reply within 100 ms. On a loaded machine `redis-cli` can take longer to
/// start than any fixed pause. Gives up after 2 s.
async fn wait_until_asleep(port: u16) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline {
        let Ok(mut conn) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
            continue;
        };
        if conn.write_all(b"PING\r\n").await.is_err() {
            continue;
        }
        let mut reply = [0u8; 16];
        match tokio::time::timeout(Duration::from_millis(100), conn.read(&mut reply)).await {
            Err(_) => return,
            Ok(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
    panic!("Redis on port {port} kept answering: DEBUG SLEEP did not begin");
}

/// Regression (issue 34): a route failing open admitted every request whose decision timed out,
/// with no lease, so a slow Redis let 36 requests in flight past a limit of 5. With the store's
/// defaults (`timeout: 50ms`, `failure_mode: open`), 100 slow requests at once put exactly the
/// limit in flight at the upstream while Redis is healthy, and still never more than the limit
/// (one instance: at most `limit` per instance) while `DEBUG SLEEP` keeps Redis from answering:
/// the requests then fall back to the instance's own count, as `failed_open`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slowed_redis_failing_open_keeps_a_concurrency_limit_per_instance() {
    let redis = RedisServer::start_with(support::redis::RedisOptions {
        args: vec!["--enable-debug-command".into(), "yes".into()],
        ..Default::default()
    });
    let upstream = support::Upstream::start().await;
    let gw = concurrency_gateway(&redis, &upstream).await;
    let before = upstream.requests();

    let statuses = slow_burst(&gw, CC_REQUESTS, 400).await;
    assert_eq!(
        upstream.peak_in_flight(),
        CC_LIMIT,
        "Redis healthy: in flight at the upstream; {statuses:?}"
    );
    assert_eq!(count(&statuses, 200) + count(&statuses, 429), CC_REQUESTS);
    assert_eq!(upstream.requests() - before, count(&statuses, 200));

    // Redis answers nothing for 3 s (longer than the burst and its 1 s holds); the burst starts
    // once the sleep has begun.
    let sleeper = {
        let port = redis.port.to_string();
        std::thread::spawn(move || {
            std::process::Command::new("redis-cli")
                .args(["-h", "127.0.0.1", "-p", &port, "DEBUG", "SLEEP", "3"])
                .output()
                .map(|o| o.status.success())
        })
    };
    // On a loaded machine a decision of the healthy burst can outlast the timeout and fail
    // open too: count only the stalled burst's.
    let failed_open_before = decided(&gw, "api", "failed_open").await;
    wait_until_asleep(redis.port).await;
    let sent = Instant::now();
    let statuses = slow_burst(&gw, CC_REQUESTS, 1000).await;
    let took = sent.elapsed();
    let failed_open = decided(&gw, "api", "failed_open").await - failed_open_before;
    assert!(
        sleeper.join().expect("sleeper").expect("redis-cli"),
        "DEBUG SLEEP failed"
    );
    assert!(
        took < Duration::from_millis(2500),
        "the burst outlasted the stall: {took:?}"
    );
    assert_eq!(
        upstream.peak_in_flight(),
        CC_LIMIT,
        "Redis slowed: in flight at the upstream; {statuses:?}"
    );
    assert!(count(&statuses, 200) >= CC_LIMIT, "{statuses:?}");
    assert_eq!(
        count(&statuses, 200) + count(&statuses, 429),
        CC_REQUESTS,
        "{statuses:?}"
    );
    assert_eq!(
        failed_open,
        count(&statuses, 200) as f64,
        "every request admitted during the stall failed open; {statuses:?}"
    );
    assert!(store_errors(&gw, "timeout").await >= 1.0);
}
