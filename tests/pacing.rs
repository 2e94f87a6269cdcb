//! Pacing end to end (`on_limit: delay`, `docs/algorithms.md` "Pacing"): a burst of requests
//! sent at once is forwarded at the policy's rate, exactly the requests a slot within
//! `max_delay` admits, and the rest refused with `Retry-After`; on the memory store in process and
//! on three real gateway processes sharing one real Redis. Then the two stages of nginx's
//! `delay=N`, a client that goes away while waiting, a reload and SIGTERM with waiters.
//!
//! Spacing is measured at a real upstream in this process. The tolerance is stated with each
//! check: the machine is small and shared, so the upper bound is generous; the lower bound (the
//! upstream never sees two requests closer than the rate allows) is tight.

mod support;

use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;

use support::fleet::{burst, count};
use support::gateway::substitute;
use support::{Client, GatewayProcess, RedisServer, TestGateway, Upstream};

/// How much later than its slot a request may reach the upstream: the gateway's forwarding time
/// and timer and scheduling delays, on a loaded two-core machine with debug builds. A request
/// never reaches it before its slot (to the millisecond of the timer).
const LATE: Duration = Duration::from_millis(250);

/// The tests that time arrivals run one at a time: on 2 cores three bursts of 60 at once would
/// measure each other, not the pacing.
static TIMED: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const TIMER: Duration = Duration::from_millis(2);

/// One route forwarding to `$UPSTREAM`, one policy on one counter for every client (`key:
/// [method]`), `policy` in flow style.
fn paced(policy: &str, route_extra: &str) -> String {
    format!(
        "upstreams:\n  up: {{ url: \"http://$UPSTREAM\" }}\nroutes:\n  - name: warm\n    \
         match: {{ path: /warm }}\n    respond: {{ status: 200 }}\n  - name: api\n    \
         match: {{ prefix: /api }}\n    upstream: up\n{route_extra}    policies:\n      - {{ name: p, key: [method], {policy} }}\n"
    )
}

const TEN_A_SECOND: &str = "token_bucket: { rate: 10/s, burst: 1 }, on_limit: delay, max_delay: 3s";

/// The arrivals at the upstream, sorted.
fn arrivals(upstream: &Upstream) -> Vec<Instant> {
    let mut at = upstream.arrivals();
    at.sort();
    at
}

/// The paced arrivals (from index `immediate` on) are at their slots, one `spacing` apart: with
/// the first slot put at the earliest time consistent with every arrival (none early), each
/// arrives within [`LATE`] of its slot.
fn assert_paced(arrivals: &[Instant], immediate: usize, spacing: Duration) {
    let paced = &arrivals[immediate..];
    let slot = |k: usize| spacing * k as u32;
    let base = paced
        .iter()
        .enumerate()
        .map(|(k, &at)| at - slot(k))
        .min()
        .expect("paced arrivals");
    let late: Vec<Duration> = paced
        .iter()
        .enumerate()
        .map(|(k, &at)| at.duration_since(base + slot(k)))
        .collect();
    for (k, lateness) in late.iter().enumerate() {
        assert!(
            *lateness <= LATE,
            "paced request {k} reached the upstream {lateness:?} after its slot (all: {late:?})"
        );
    }
    // The immediate ones come before the first slot.
    for (k, &at) in arrivals[..immediate].iter().enumerate() {
        assert!(
            at <= base + TIMER + LATE,
            "immediate request {k} came after the paced ones"
        );
    }
}

fn retry_after(reply: &support::Reply) -> Option<u64> {
    reply
        .headers
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

/// Opens `n` connections first (the unlimited `/warm` route), so that a burst after it is
/// decided at once rather than as its connections are made.
async fn warm_up(client: &Client, urls: &[String], n: usize) {
    let warm: Vec<_> = (0..n)
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
}

/// `n` GETs at once on `client` (its connections warmed), round-robin over `urls`.
async fn fire(client: &Client, urls: &[String], n: usize) -> Vec<u16> {
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let (client, url) = (client.clone(), urls[i % urls.len()].clone());
            tokio::spawn(async move { client.get(&url).await.status })
        })
        .collect();
    let mut statuses = Vec::new();
    for task in tasks {
        statuses.push(task.await.expect("request"));
    }
    statuses
}

/// 60 requests at once at 10/s with `max_delay: 3s`: the first passes, the others are paced
/// 100 ms apart up to 3 s after their decision, and the rest are refused at once with
/// `Retry-After`. Exactly what the policy admits: every slot that was within 3 s of a request's
/// decision went to a request (the last admitted waited more than 2.9 s, so none refused could
/// have had an earlier one), none was given past 3 s, and only the admitted reach the upstream.
/// When the 60 are decided within 100 ms, that is 1 + 30; a slower burst (a loaded machine) is
/// decided over a longer time, and each 100 ms of it frees one more slot.
async fn sixty_at_once(urls: &[String], upstream: &Upstream) -> usize {
    let client = Client::new();
    warm_up(&client, urls, 60).await;
    let started = Instant::now();
    let tasks: Vec<_> = (0..60)
        .map(|i| {
            let (client, url) = (client.clone(), urls[i % urls.len()].clone());
            tokio::spawn(async move {
                let reply = client.get(&url).await;
                let waited: Option<f64> = reply
                    .header("turnstile-delay")
                    .map(|v| v.parse().expect("seconds"));
                (reply.status, retry_after(&reply), waited, started.elapsed())
            })
        })
        .collect();
    let (mut admitted, mut refused, mut delays) = (0, 0, Vec::new());
    for task in tasks {
        let (status, retry, waited, took) = task.await.expect("request");
        match status {
            200 => {
                admitted += 1;
                delays.extend(waited);
            }
            429 => {
                refused += 1;
                assert!(
                    retry.is_some_and(|s| s >= 1),
                    "a refusal without Retry-After"
                );
                assert!(took < Duration::from_secs(2), "a refusal waited {took:?}");
            }
            other => panic!("unexpected status {other}"),
        }
    }
    println!(
        "{admitted} admitted, {refused} refused, decided over {:?}",
        started.elapsed()
    );
    assert_eq!(admitted + refused, 60);
    assert!(
        admitted >= 31,
        "{admitted}: 1 at once + 30 slots within 3 s at least"
    );
    assert_eq!(
        delays.len(),
        admitted - 1,
        "every request but the first waited"
    );
    let longest = delays.iter().copied().fold(0.0, f64::max);
    assert!(
        longest <= 3.0,
        "a request waited {longest} s, past max_delay"
    );
    assert!(
        longest > 2.9,
        "the queue stopped at {longest} s: a slot within 3 s went unused"
    );
    assert_eq!(
        upstream.requests(),
        admitted,
        "only the admitted reach the upstream"
    );
    admitted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store_paces_sixty_requests_at_ten_a_second() {
    let _timed = TIMED.lock().await;
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(&paced(TEN_A_SECOND, ""), upstream.addr).await;
    let admitted = sixty_at_once(&[gw.url("/api")], &upstream).await;
    assert_paced(&arrivals(&upstream), 1, Duration::from_millis(100));
    assert_eq!(
        gw.metric("turnstile_delayed_requests_total", &[("route", "api")])
            .await,
        (admitted - 1) as f64
    );
    assert_eq!(
        gw.metric("turnstile_waiting_requests", &[("route", "api")])
            .await,
        0.0
    );
    let text = gw.metrics().await;
    let count = support::metric(&text, "turnstile_delay_seconds_count", &[("route", "api")]);
    assert_eq!(count, Some((admitted - 1) as f64));
}

/// nginx's `burst=B delay=N`: the first N + 1 of a burst at once, the rest paced. Here a bucket
/// of 5 at 10/s with `max_delay: 1s`: 5 at once, 10 paced, 15 refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_stages_pass_the_burst_at_once_and_pace_the_rest() {
    let _timed = TIMED.lock().await;
    let upstream = Upstream::start().await;
    let policy = "token_bucket: { rate: 10/s, burst: 5 }, on_limit: delay, max_delay: 1s";
    let gw = TestGateway::with_upstream(&paced(policy, ""), upstream.addr).await;
    let client = Client::new();
    warm_up(&client, &[gw.url("/api")], 30).await;
    let statuses = fire(&client, &[gw.url("/api")], 30).await;
    assert_eq!((count(&statuses, 200), count(&statuses, 429)), (15, 15));
    let arrivals = arrivals(&upstream);
    for (k, at) in arrivals.iter().take(5).enumerate() {
        let after = at.duration_since(arrivals[0]);
        assert!(
            after <= LATE,
            "request {k} of the burst came {after:?} after the first"
        );
    }
    assert_paced(&arrivals, 5, Duration::from_millis(100));
}

/// A delayed request's answer says how long it waited, beside the fields it was admitted with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delayed_answer_says_how_long_it_waited() {
    let upstream = Upstream::start().await;
    let policy = "token_bucket: { rate: 4/s, burst: 1 }, on_limit: delay, max_delay: 1s";
    let gw = TestGateway::with_upstream(&paced(policy, ""), upstream.addr).await;
    let client = Client::new();
    let first = client.get(&gw.url("/api")).await;
    assert_eq!(first.status, 200);
    assert!(first.headers.get("turnstile-delay").is_none());
    let started = Instant::now();
    let second = client.get(&gw.url("/api")).await;
    let took = started.elapsed();
    assert_eq!(second.status, 200);
    let waited: f64 = second
        .header("turnstile-delay")
        .expect("Turnstile-Delay")
        .parse()
        .expect("seconds");
    assert!((0.2..=0.25).contains(&waited), "waited {waited}");
    assert!(
        took >= Duration::from_millis(200),
        "answered after {took:?}"
    );
    assert_eq!(second.header("x-ratelimit-remaining"), Some("0"));
}

/// A client that goes away while it waits: its request never reaches the upstream, its place
/// among the waiters comes back, and the latest reservation of a bucket comes back too (the
/// next request takes its slot). Checked to fail without the give-back: the next request then
/// waits a slot longer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_gives_back_its_slot() {
    let upstream = Upstream::start().await;
    let policy = "token_bucket: { rate: 2/s, burst: 1 }, on_limit: delay, max_delay: 5s";
    let gw = TestGateway::with_upstream(&paced(policy, ""), upstream.addr).await;
    let client = Client::new();
    let first_at = Instant::now();
    assert_eq!(client.get(&gw.url("/api")).await.status, 200);
    // Two waiters: 500 ms and 1 s.
    let mut middle = gw.open_request("").await;
    gw.wait_for_waiting(1.0).await;
    let last = gw.open_request("").await;
    gw.wait_for_waiting(2.0).await;
    drop(last);
    gw.wait_for_waiting(1.0).await;
    // The latest slot (1 s after the first) is free again: a new request takes it.
    let slot = 1.0 - first_at.elapsed().as_secs_f64();
    let reply = client.get(&gw.url("/api")).await;
    assert_eq!(reply.status, 200);
    let waited: f64 = reply
        .header("turnstile-delay")
        .expect("delayed")
        .parse()
        .expect("seconds");
    // Without the give-back it would wait for the next slot, 500 ms later.
    assert!(
        waited <= slot + 0.05,
        "waited {waited} s: the slot given back was {slot:.3} s away"
    );
    let mut buf = vec![0u8; 1024];
    let n = middle
        .read(&mut buf)
        .await
        .expect("the middle waiter's answer");
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    assert_eq!(
        upstream.requests(),
        3,
        "the request that went away was never forwarded"
    );
    gw.wait_for_waiting(0.0).await;
}

/// Beyond `max_waiting`, a request is refused at once as without pacing, even with slots left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_max_waiting_a_request_is_refused_at_once() {
    let upstream = Upstream::start().await;
    let policy = "token_bucket: { rate: 10/s, burst: 1 }, on_limit: delay, max_delay: 3s";
    let gw =
        TestGateway::with_upstream(&paced(policy, "    max_waiting: 3\n"), upstream.addr).await;
    let client = Client::new();
    warm_up(&client, &[gw.url("/api")], 10).await;
    let statuses = fire(&client, &[gw.url("/api")], 10).await;
    assert_eq!((count(&statuses, 200), count(&statuses, 429)), (4, 6));
}

/// A reload while requests wait: each is forwarded at the slot it reserved under the old config.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_the_waiters_slots() {
    let upstream = Upstream::start().await;
    let policy = "token_bucket: { rate: 2/s, burst: 1 }, on_limit: delay, max_delay: 5s";
    let gw = TestGateway::with_upstream(&paced(policy, ""), upstream.addr).await;
    let urls = [gw.url("/api")];
    let waiting = tokio::spawn(async move { burst(&urls, 3).await });
    gw.wait_for_waiting(2.0).await;
    let reloaded = "token_bucket: { rate: 1/s, burst: 1 }, on_limit: delay, max_delay: 5s";
    gw.reload_with(&substitute(&paced(reloaded, ""), Some(upstream.addr)))
        .await
        .expect("reload");
    let statuses = waiting.await.expect("burst");
    assert_eq!(
        count(&statuses, 200),
        3,
        "every waiter answered by its upstream"
    );
    assert_paced(&arrivals(&upstream), 1, Duration::from_millis(500));
}

/// SIGTERM with waiters: each is answered at once (429, `Retry-After` the rest of its wait, its
/// reservation given back), not dropped, and the process exits well before the last slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_answers_the_waiters() {
    let upstream = Upstream::start().await;
    let policy = "token_bucket: { rate: 0.5/s, burst: 1 }, on_limit: delay, max_delay: 10s";
    let yaml = format!(
        "server:\n  shutdown_grace: 20s\n{}",
        substitute(&paced(policy, ""), Some(upstream.addr))
    );
    let mut gw = GatewayProcess::spawn(&yaml).await;
    let client = Client::new();
    assert_eq!(client.get(&gw.url("/api")).await.status, 200);
    let url = gw.url("/api");
    let waiters: Vec<_> = (0..2)
        .map(|_| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move {
                let reply = client.get(&url).await;
                (reply.status, retry_after(&reply))
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
        assert!(
            retry.is_some_and(|s| (1..=4).contains(&s)),
            "Retry-After {retry:?}"
        );
    }
    let answered = signalled.elapsed();
    assert!(
        answered < Duration::from_secs(1),
        "answered {answered:?} after SIGTERM"
    );
    let status = gw.wait().await;
    assert!(status.success(), "exit {status:?}");
    assert!(
        signalled.elapsed() < Duration::from_secs(2),
        "the drain waited for the slots"
    );
    assert_eq!(upstream.requests(), 1);
}

/// Three gateway processes on one real Redis, 60 requests at once across them: one shared
/// stream, exactly as on one instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_on_one_redis_pace_one_stream() {
    let _timed = TIMED.lock().await;
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let yaml = format!(
        "store:\n  type: redis\n  url: {}\n  timeout: 2s\n  key_prefix: \"pace:\"\n{}",
        redis.url(),
        substitute(&paced(TEN_A_SECOND, ""), Some(upstream.addr))
    );
    let mut gateways = Vec::new();
    for _ in 0..3 {
        gateways.push(GatewayProcess::spawn(&yaml).await);
    }
    for gw in &gateways {
        support::fleet::wait_ready(gw, 200, Duration::from_secs(20)).await;
    }
    let urls: Vec<String> = gateways.iter().map(|g| g.url("/api")).collect();
    let admitted = sixty_at_once(&urls, &upstream).await;
    assert_paced(&arrivals(&upstream), 1, Duration::from_millis(100));
    let mut delayed = 0.0;
    for gw in &gateways {
        delayed += gw
            .metric("turnstile_delayed_requests_total", &[("route", "api")])
            .await;
    }
    assert_eq!(delayed, (admitted - 1) as f64);
    for key in redis.keys() {
        // -2: expired since it was listed; -1 would be a key that never expires.
        let ttl: i64 = redis.cli(&["pttl", &key])[0].parse().expect("pttl");
        assert!(ttl > 0 || ttl == -2, "{key} has no TTL");
    }
}

/// A per-second quota of 5 with `max_delay: 1s` (`docs/algorithms.md`, "Pacing"), on a real
/// gateway process and a real Redis: 15 requests at once early in a second. 5 pass at once, 5
/// are counted in the next second and reach the upstream when it starts (never before, at most
/// [`LATE`] after), 5 are refused with `Retry-After: 1`. One more request in the next second
/// finds it full (the 5 reserved count there) and waits for the second after. A round whose
/// immediate answers did not all come back within its second is run again on a fresh counter
/// (at most 3 rounds): its decisions may have crossed the boundary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_per_second_quota_paces_across_its_boundary_on_redis() {
    use std::time::{SystemTime, UNIX_EPOCH};
    let _timed = TIMED.lock().await;
    let redis = RedisServer::start();
    let upstream = Upstream::start().await;
    let policy = "quota: { limit: 5, per: second }, on_limit: delay, max_delay: 1s";
    let yaml = format!(
        "store:\n  type: redis\n  url: {}\n  timeout: 2s\n  key_prefix: \"pq:\"\n{}",
        redis.url(),
        substitute(&paced(policy, ""), Some(upstream.addr))
            .replace("key: [method]", "key: [\"header:x-run\"]")
    );
    let gw = GatewayProcess::spawn(&yaml).await;
    support::fleet::wait_ready(&gw, 200, Duration::from_secs(20)).await;
    let client = Client::new();
    let (t0, w0) = (Instant::now(), SystemTime::now());
    // Microseconds since the epoch of an instant of this process.
    let wall = move |at: Instant| {
        let since = (w0 + at.duration_since(t0)).duration_since(UNIX_EPOCH);
        since.expect("after the epoch").as_micros() as u64
    };
    const SECOND: u64 = 1_000_000;
    for round in 0..3 {
        warm_up(&client, &[gw.url("/api")], 15).await;
        // 50 ms into the next second.
        let now = wall(Instant::now());
        let start = (now / SECOND + 1) * SECOND;
        tokio::time::sleep(Duration::from_micros(start + 50_000 - now)).await;
        let run = format!("round-{round}");
        let base = upstream.arrivals().len();
        let tasks: Vec<_> = (0..15)
            .map(|_| {
                let (client, url, run) = (client.clone(), gw.url("/api"), run.clone());
                tokio::spawn(async move {
                    let reply = client.get_with(&url, &[("x-run", run.as_str())]).await;
                    (reply.status, retry_after(&reply), Instant::now())
                })
            })
            .collect();
        let mut answers = Vec::new();
        for task in tasks {
            answers.push(task.await.expect("request"));
        }
        let refused: Vec<_> = answers.iter().filter(|a| a.0 == 429).collect();
        let admitted = answers.iter().filter(|a| a.0 == 200).count();
        // The refusals answer at once: all within the burst's second, or the round is retried.
        if refused.iter().any(|a| wall(a.2) >= start + SECOND) {
            println!("round {round}: decisions crossed the second; again");
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        assert_eq!((admitted, refused.len()), (10, 5), "{answers:?}");
        assert!(
            refused.iter().all(|a| a.1 == Some(1)),
            "Retry-After: {answers:?}"
        );
        let mut at: Vec<u64> = upstream.arrivals()[base..]
            .iter()
            .map(|&i| wall(i))
            .collect();
        at.sort();
        assert_eq!(at.len(), 10);
        let next = start + SECOND;
        for (k, &t) in at.iter().enumerate() {
            if k < 5 {
                assert!(
                    t < next,
                    "request {k} of the quota came at {t}, after {next}: {at:?}"
                );
            } else {
                let late = Duration::from_micros(t.saturating_sub(next));
                assert!(
                    t + TIMER.as_micros() as u64 >= next && late <= LATE,
                    "paced request {k} came {late:?} after the next second began (never before)"
                );
            }
        }
        // In the next second, its 5 are taken: one more waits for the second after.
        let extra = client
            .get_with(&gw.url("/api"), &[("x-run", run.as_str())])
            .await;
        assert_eq!(extra.status, 200);
        let last = *upstream.arrivals().iter().max().expect("arrival");
        assert!(
            wall(last) + TIMER.as_micros() as u64 >= next + SECOND,
            "a 6th request passed in the next second: {} < {}",
            wall(last),
            next + SECOND
        );
        return;
    }
    panic!("no round's decisions stayed within one second");
}

/// The examples of docs/algorithms.md's "Pacing" load as they read: a bucket of 5 at 10/s that
/// delays up to 2 s, on a route with 500 waiters at most; a minute quota that delays up to 5 s.
#[test]
fn the_documented_example_loads() {
    let page = std::fs::read_to_string(support::tools::repo_path("docs/algorithms.md"))
        .expect("docs/algorithms.md");
    let section = page
        .split("\n## ")
        .find(|s| s.starts_with("Pacing"))
        .and_then(|s| s.split("\n### ").next())
        .expect("a Pacing section");
    let blocks: Vec<&str> = section
        .split("```yaml\n")
        .skip(1)
        .filter_map(|rest| rest.split_once("```").map(|(block, _)| block))
        .collect();
    assert_eq!(blocks.len(), 2);
    let parse = |block| {
        turnstile::config::parse(block, std::path::Path::new("docs/algorithms.md"))
            .unwrap_or_else(|e| panic!("{e}"))
    };
    let snapshot = parse(blocks[0]);
    let route = &snapshot.routes[0];
    assert_eq!(route.max_waiting, 500);
    assert_eq!(route.policies[0].max_delay_us, Some(2_000_000));
    // The quota's: a minute, waiting up to 5 s for the next.
    let quota = parse(blocks[1]);
    assert_eq!(quota.routes[0].policies[0].max_delay_us, Some(5_000_000));
    // What docs/benchmarks.md says a waiter's box holds.
    let wait = std::mem::size_of::<turnstile::admission::Wait>();
    assert!(wait < 200, "a waiter is {wait} bytes");
}
