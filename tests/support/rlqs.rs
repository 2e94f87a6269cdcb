//! The rate limit quota service under test: Turnstile with an `rlqs:` block, real Envoys with
//! the `rate_limit_quota` filter pointing at it, and a paced load over several Envoys at once.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{BucketId, RateLimitQuotaUsageReports};

use super::client::Client;
use super::envoy::Envoy;
use super::gateway::TestGateway;

/// `deploy/rlqs/envoy.yaml` (shown in `docs/envoy.md`) for one proxy named `name`, on free
/// ports, in front of `upstream`: every request is in the bucket `{name: api}`.
pub fn bootstrap(upstream: SocketAddr, rlqs: SocketAddr, name: &str) -> String {
    let config = include_str!("../../deploy/rlqs/envoy.yaml");
    let swaps = [
        ("port_value: 9902", "port_value: 0".to_owned()),
        ("port_value: 10000", "port_value: 0".to_owned()),
        ("value: envoy-1", format!("value: {name}")),
        (
            "address: app, port_value: 8000",
            format!("address: 127.0.0.1, port_value: {}", upstream.port()),
        ),
        (
            "address: turnstile, port_value: 18081",
            format!("address: 127.0.0.1, port_value: {}", rlqs.port()),
        ),
    ];
    let mut text = config.to_owned();
    for (from, to) in swaps {
        assert!(text.contains(from), "deploy/rlqs/envoy.yaml lost `{from}`");
        text = text.replace(from, &to);
    }
    text
}

/// `policies.yaml` with `rlqs_block` (its own lines, at column 0) and `store_block`.
pub fn policies(rlqs_block: &str, store_block: &str) -> String {
    format!("listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\n{store_block}\n{rlqs_block}")
}

/// Starts Turnstile with `rlqs_block` on `store_block`; its quota listener's address.
pub async fn start(rlqs_block: &str, store_block: &str) -> (TestGateway, SocketAddr) {
    let gw = TestGateway::try_launch(&policies(rlqs_block, store_block), None, &[])
        .await
        .unwrap_or_else(|e| panic!("start: {e}"));
    let addr = gw.running().rlqs_addr.expect("rlqs listener");
    (gw, addr)
}

/// What one Envoy answered during a load.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub ok: u64,
    pub denied: u64,
    pub other: u64,
}

/// Sends `rates[i]` requests per second to `envoys[i]`, all at once, for `length`: paced,
/// bounded by count (rate × length) and by time (length plus a margin). Returns each Envoy's
/// counts.
pub async fn drive(envoys: &[&Envoy], rates: &[f64], length: Duration) -> Vec<Counts> {
    assert_eq!(envoys.len(), rates.len());
    let loads = envoys.iter().zip(rates).map(|(envoy, rate)| {
        let url = format!("http://{}/", envoy.listener);
        let rate = *rate;
        async move {
            let mut counts = Counts::default();
            if rate <= 0.0 {
                tokio::time::sleep(length).await;
                return counts;
            }
            let client = Client::new();
            let total = (rate * length.as_secs_f64()).round() as u64;
            let every = Duration::from_secs_f64(1.0 / rate);
            let start = tokio::time::Instant::now();
            let deadline = Instant::now() + length + Duration::from_secs(10);
            for i in 0..total {
                if Instant::now() > deadline {
                    break;
                }
                tokio::time::sleep_until(start + every.mul_f64(i as f64)).await;
                match client.try_get(&url).await.map(|r| r.status) {
                    Ok(200) => counts.ok += 1,
                    Ok(429) => counts.denied += 1,
                    _ => counts.other += 1,
                }
            }
            counts
        }
    });
    futures_util::future::join_all(loads).await
}

/// `turnstile_rlqs_share{budget, proxy}` on `gw`.
pub async fn share(gw: &TestGateway, budget: &str, proxy: &str) -> f64 {
    gw.metric(
        "turnstile_rlqs_share",
        &[("budget", budget), ("proxy", proxy)],
    )
    .await
}

/// A proxy's stream opened by hand, named `proxy`: one usage report for `{name: api}` (3
/// allowed, 1 denied), then open while the returned sender is held. Responses are read and
/// dropped.
pub async fn open_stream(
    addr: SocketAddr,
    proxy: &str,
) -> tokio::sync::mpsc::UnboundedSender<RateLimitQuotaUsageReports> {
    let mut client = RateLimitQuotaServiceClient::connect(format!("http://{addr}"))
        .await
        .expect("connect to the rlqs listener");
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let reports = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    let mut request = tonic::Request::new(reports);
    request
        .metadata_mut()
        .insert("x-turnstile-proxy", proxy.parse().expect("metadata"));
    tx.send(RateLimitQuotaUsageReports {
        domain: "edge".into(),
        bucket_quota_usages: vec![BucketQuotaUsage {
            bucket_id: Some(BucketId {
                bucket: [("name".to_owned(), "api".to_owned())].into(),
            }),
            time_elapsed: Some(Default::default()),
            num_requests_allowed: 3,
            num_requests_denied: 1,
        }],
    })
    .expect("queue the report");
    let mut responses = client
        .stream_rate_limit_quotas(request)
        .await
        .expect("open the stream")
        .into_inner();
    tokio::spawn(async move { while let Ok(Some(_)) = responses.message().await {} });
    tx
}
