//! The rate limit quota service under test: Turnstile with an `rlqs:` block, real Envoys with
//! the `rate_limit_quota` filter pointing at it, and a paced load over several Envoys at once.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::Strategy;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Kind;

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
    open_recorded(addr, proxy, &[("name", "api")]).await.0
}

/// A usage report for one bucket id: `requests` in `elapsed_s` seconds, all allowed.
pub fn report(
    bucket: &[(&str, &str)],
    requests: u64,
    elapsed_s: i64,
) -> RateLimitQuotaUsageReports {
    RateLimitQuotaUsageReports {
        domain: "edge".into(),
        bucket_quota_usages: vec![BucketQuotaUsage {
            bucket_id: Some(BucketId {
                bucket: bucket
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            }),
            time_elapsed: Some(prost_types_duration(elapsed_s)),
            num_requests_allowed: requests,
            num_requests_denied: 0,
        }],
    }
}

fn prost_types_duration(seconds: i64) -> envoy_types::pb::google::protobuf::Duration {
    envoy_types::pb::google::protobuf::Duration { seconds, nanos: 0 }
}

/// Every assignment a stream received: when, and its tokens per fill (0 for `DENY_ALL`) and TTL.
pub type Received = Arc<Mutex<Vec<(Instant, u32, Duration)>>>;

/// [`open_stream`] for `bucket`, keeping every assignment received for it.
pub async fn open_recorded(
    addr: SocketAddr,
    proxy: &str,
    bucket: &[(&str, &str)],
) -> (
    tokio::sync::mpsc::UnboundedSender<RateLimitQuotaUsageReports>,
    Received,
) {
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
    let mut first = report(bucket, 3, 0);
    first.bucket_quota_usages[0].num_requests_denied = 1;
    tx.send(first).expect("queue the report");
    let mut responses = client
        .stream_rate_limit_quotas(request)
        .await
        .expect("open the stream")
        .into_inner();
    let received: Received = Arc::default();
    let log = received.clone();
    tokio::spawn(async move {
        while let Ok(Some(response)) = responses.message().await {
            let at = Instant::now();
            for action in response.bucket_action {
                if let Some(Kind::QuotaAssignmentAction(a)) = action.bucket_action {
                    let ttl = a.assignment_time_to_live.map_or(0, |d| d.seconds);
                    let tokens = match a.rate_limit_strategy.and_then(|s| s.strategy) {
                        Some(Strategy::TokenBucket(tb)) => {
                            tb.tokens_per_fill.map_or(0, |v| v.value)
                        }
                        _ => 0,
                    };
                    let ttl = Duration::from_secs(u64::try_from(ttl).unwrap_or(0));
                    log.lock().expect("log").push((at, tokens, ttl));
                }
            }
        }
    });
    (tx, received)
}

/// The most tokens per fill that the streams' assignments had in force at once: at each
/// instant, each stream's last assignment counts until its TTL ends.
pub fn most_in_force(streams: &[&Received]) -> u32 {
    let logs: Vec<Vec<(Instant, u32, Duration)>> = streams
        .iter()
        .map(|r| r.lock().expect("log").clone())
        .collect();
    let mut most = 0;
    for at in logs.iter().flatten().map(|(at, _, _)| *at) {
        let sum: u32 = logs
            .iter()
            .map(|log| {
                log.iter()
                    .rev()
                    .find(|(t, _, _)| *t <= at)
                    .filter(|(t, _, ttl)| *t + *ttl > at)
                    .map_or(0, |(_, tokens, _)| *tokens)
            })
            .sum();
        most = most.max(sum);
    }
    most
}
