//! Pacing through the doors (`on_limit: delay`): forward-auth and ext_authz delay their answer,
//! so NGINX `auth_request`, Traefik ForwardAuth, Caddy `forward_auth` and Envoy's ext_authz
//! filter forward each request at its slot instead of refusing it. The `paced` route of [`crate::CONFIG`]: 5/s, burst 1,
//! `max_delay: 2s`.

use std::time::{Duration, Instant};

use crate::support::envoy::Envoy;
use crate::support::ingress::{caddy, traefik};
use crate::support::{Client, Nginx, Upstream};

/// How much later than its slot a request may reach the upstream through a proxy and the check,
/// on a loaded two-core machine; never earlier than the spacing less the timer's millisecond.
const LATE: Duration = Duration::from_millis(120);

/// 5 requests at once through `proxy`: every one admitted, the first at once and the others one
/// slot (200 ms) apart at the upstream, each answer after its slot.
async fn five_at_once_are_paced(proxy: std::net::SocketAddr, upstream: &Upstream) {
    let client = Client::new();
    let base = upstream.requests();
    let started = Instant::now();
    let tasks: Vec<_> = (0..5)
        .map(|_| {
            let (client, url) = (client.clone(), format!("http://{proxy}/api/paced/x"));
            tokio::spawn(async move { (client.get(&url).await.status, started.elapsed()) })
        })
        .collect();
    let mut took = Vec::new();
    for task in tasks {
        let (status, after) = task.await.expect("request");
        assert_eq!(status, 200, "delayed, not refused");
        took.push(after);
    }
    took.sort();
    assert!(
        took[4] >= Duration::from_millis(790),
        "the last answered after {:?}",
        took[4]
    );
    assert_eq!(upstream.requests() - base, 5);
    let mut at = upstream.arrivals();
    at.sort();
    let at = &at[at.len() - 5..];
    let spacing = Duration::from_millis(200);
    let base = at
        .iter()
        .enumerate()
        .map(|(k, &t)| t - spacing * k as u32)
        .min()
        .expect("arrivals");
    for (k, &t) in at.iter().enumerate() {
        let late = t.duration_since(base + spacing * k as u32);
        assert!(late <= LATE, "request {k} came {late:?} after its slot");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_auth_request_waits_for_the_delayed_answer() {
    let (_gw, check, _) = crate::turnstile_for(Some("nginx")).await;
    let upstream = Upstream::start().await;
    let nginx = Nginx::start_with(
        &crate::example("nginx-server.conf", check, upstream.addr),
        &crate::example("nginx-http.conf", check, upstream.addr),
    );
    five_at_once_are_paced(nginx.addr, &upstream).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traefik_forward_auth_waits_for_the_delayed_answer() {
    let (_gw, check, _) = crate::turnstile_for(Some("traefik")).await;
    let upstream = Upstream::start().await;
    let proxy = traefik(
        &crate::example("traefik-dynamic.yml", check, upstream.addr),
        "/ready",
    )
    .await;
    five_at_once_are_paced(proxy.addr, &upstream).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caddy_forward_auth_waits_for_the_delayed_answer() {
    let (_gw, check, _) = crate::turnstile_for(Some("caddy")).await;
    let upstream = Upstream::start().await;
    let proxy = caddy(&crate::example("Caddyfile.site", check, upstream.addr)).await;
    five_at_once_are_paced(proxy.addr, &upstream).await;
}

/// How much later than its slot a request may reach the upstream through Envoy, which adds its
/// own filter and connection hops to the check's (never earlier than its slot).
const ENVOY_LATE: Duration = Duration::from_millis(250);

/// `n` GETs at once through `proxy` on the paced route: (status, when answered) each, sorted by
/// the time of the answer, and `upstream`'s request count before them.
async fn burst(
    proxy: std::net::SocketAddr,
    upstream: &Upstream,
    n: usize,
) -> (Vec<(u16, Duration)>, usize) {
    let client = Client::new();
    // Connections first (an unlimited path), so the burst is decided at once.
    let warm: Vec<_> = (0..n)
        .map(|_| {
            let (client, url) = (client.clone(), format!("http://{proxy}/unrouted"));
            tokio::spawn(async move { client.get(&url).await.status })
        })
        .collect();
    for task in warm {
        assert_eq!(task.await.expect("warm-up"), 200);
    }
    let base = upstream.requests();
    let started = Instant::now();
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (client, url) = (client.clone(), format!("http://{proxy}/api/paced/x"));
            tokio::spawn(async move { (client.get(&url).await.status, started.elapsed()) })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.expect("request"));
    }
    answers.sort_by_key(|&(_, at)| at);
    (answers, base)
}

/// Envoy's ext_authz filter (the shipped example, its `timeout` raised to 3 s, above
/// `max_delay`) in front of the 5/s route with `max_delay: 2s`: of 15 requests at once, the
/// first passes, 10 are held to their slots 200 ms apart (the last 2 s out) and reach the
/// upstream then, never early and at most [`ENVOY_LATE`] late; the other 4 are refused at once
/// with 429. Exactly 11 when the 15 are decided within one slot's 200 ms (the refusals' answers
/// show when the last were decided), one more for each 200 ms a slower burst took.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_ext_authz_holds_the_paced_requests_to_their_slots() {
    let (gw, _, grpc) = crate::turnstile().await;
    let upstream = Upstream::start().await;
    let bootstrap = crate::envoy::bootstrap(grpc, upstream.addr);
    assert!(
        bootstrap.contains("timeout: 1s"),
        "the example's ext_authz timeout"
    );
    let envoy = Envoy::start(&bootstrap.replace("timeout: 1s", "timeout: 3s")).await;
    let (answers, base) = burst(envoy.listener, &upstream, 15).await;
    let admitted = answers.iter().filter(|a| a.0 == 200).count();
    let refused: Vec<Duration> = answers.iter().filter(|a| a.0 == 429).map(|a| a.1).collect();
    println!("envoy ext_authz, paced: {answers:?}");
    assert_eq!(
        admitted + refused.len(),
        15,
        "only 200 and 429: {answers:?}"
    );
    // Every refusal was decided by the time it was answered: the burst's decisions took at most
    // the last refusal's answer time.
    let spread = refused.iter().max().copied().unwrap_or_default();
    let extra = (spread.as_millis() / 200) as usize;
    if extra == 0 {
        assert_eq!((admitted, refused.len()), (11, 4), "{answers:?}");
    } else {
        assert!((11..=11 + extra).contains(&admitted), "{answers:?}");
    }
    for late in &refused {
        assert!(*late < Duration::from_secs(1), "a refusal waited {late:?}");
    }
    assert_eq!(upstream.requests() - base, admitted, "exactly the admitted");
    let mut at = upstream.arrivals();
    at.sort();
    let at = &at[at.len() - admitted..];
    let spacing = Duration::from_millis(200);
    // The first slot put at the earliest time consistent with every arrival (none early).
    let first = at
        .iter()
        .enumerate()
        .map(|(k, &t)| t - spacing * k as u32)
        .min()
        .expect("arrivals");
    for (k, &t) in at.iter().enumerate() {
        let late = t.duration_since(first + spacing * k as u32);
        assert!(
            late <= ENVOY_LATE,
            "request {k} came {late:?} after its slot"
        );
    }
    // The last admitted waited for a slot close to 2 s out: none within max_delay went unused.
    let last = at[admitted - 1].duration_since(at[0]);
    assert!(
        last >= Duration::from_millis(1790) && last <= Duration::from_millis(2000) + ENVOY_LATE,
        "the last admitted came {last:?} after the first"
    );
    let delayed = gw
        .metric("turnstile_delayed_requests_total", &[("route", "paced")])
        .await;
    assert_eq!(delayed, (admitted - 1) as f64);
    let limited = [("door", "ext_authz"), ("result", "limited")];
    assert_eq!(
        gw.metric("turnstile_door_checks_total", &limited).await,
        refused.len() as f64
    );
}

/// With the example's own `timeout: 1s`, shorter than `max_delay`, Envoy gives up on a check
/// still held at 1 s and answers 403 (`status_on_error`): what docs/envoy.md warns of. The
/// requests whose slots come before the timeout pass; none is refused by the policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ext_authz_timeout_below_max_delay_fails_the_longer_waits() {
    let (_gw, _, grpc) = crate::turnstile().await;
    let upstream = Upstream::start().await;
    let envoy = Envoy::start(&crate::envoy::bootstrap(grpc, upstream.addr)).await;
    let (answers, base) = burst(envoy.listener, &upstream, 10).await;
    println!("envoy ext_authz, 1 s timeout: {answers:?}");
    let passed = answers.iter().filter(|a| a.0 == 200).count();
    let timed_out = answers.iter().filter(|a| a.0 == 403).count();
    assert_eq!(passed + timed_out, 10, "{answers:?}");
    // Slots 0, 200, ..., 800 ms are before the timeout; 1000 ms races it; 1200 ms on are after.
    assert!((4..=6).contains(&passed), "{answers:?}");
    for &(status, at) in &answers {
        if status == 403 {
            assert!(
                at >= Duration::from_millis(950),
                "a 403 before the timeout: {answers:?}"
            );
        }
    }
    assert_eq!(upstream.requests() - base, passed);
}
