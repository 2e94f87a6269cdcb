//! Pacing through the doors (`on_limit: delay`): forward-auth delays its answer, so NGINX
//! `auth_request` and Traefik ForwardAuth forward each request at its slot instead of refusing it.
//! The `paced` route of [`crate::CONFIG`]: 5/s, burst 1, `max_delay: 2s`.

use std::time::{Duration, Instant};

use crate::support::ingress::traefik;
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
