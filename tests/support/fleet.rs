//! Driving several gateway processes at once: readiness, concurrent bursts, counting answers.
//! Shared by the tests that run instances on one store.

use std::time::{Duration, Instant};

use super::{Client, GatewayProcess};

/// Polls `/readyz` until it answers `want`, failing the test after `limit`.
pub async fn wait_ready(gw: &GatewayProcess, want: u16, limit: Duration) {
    let client = Client::new();
    let deadline = Instant::now() + limit;
    loop {
        let status = client.get(&gw.admin_url("/readyz")).await.status;
        if status == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "/readyz never answered {want} (last: {status}); log:\n{}",
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// After a failover: waits until `gw` is ready and decides again (200, not 503) on `path`, with a
/// key of its own (`x-run: probe-{i}`), failing the test after `limit`.
pub async fn decides_again(gw: &GatewayProcess, i: usize, path: &str, limit: Duration) {
    wait_ready(gw, 200, limit).await;
    let client = Client::new();
    let run = format!("probe-{i}");
    let deadline = Instant::now() + limit;
    loop {
        let status = client
            .get_with(&gw.url(path), &[("x-run", &run)])
            .await
            .status;
        if status == 200 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "instance {i} never decided again (last {status}); log:\n{}",
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Fires `total` requests at once, round-robin over `urls`; returns the status of each.
pub async fn burst(urls: &[String], total: usize) -> Vec<u16> {
    burst_with(urls, total, |_| Vec::new()).await
}

/// [`burst`] where request `i` carries the headers `headers(i)`.
pub async fn burst_with(
    urls: &[String],
    total: usize,
    headers: impl Fn(usize) -> Vec<(&'static str, String)>,
) -> Vec<u16> {
    let client = Client::new();
    let tasks: Vec<_> = (0..total)
        .map(|i| {
            let (client, url, headers) = (client.clone(), urls[i % urls.len()].clone(), headers(i));
            tokio::spawn(async move {
                let headers: Vec<(&str, &str)> =
                    headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
                client.get_with(&url, &headers).await.status
            })
        })
        .collect();
    let mut statuses = Vec::with_capacity(total);
    for task in tasks {
        statuses.push(task.await.expect("request task"));
    }
    statuses
}

pub fn count(statuses: &[u16], status: u16) -> usize {
    statuses.iter().filter(|&&s| s == status).count()
}
