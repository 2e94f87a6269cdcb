//! The gRPC side: one task per proxy stream reading its usage reports, the listener, and the
//! tick that sends what the shares decide between reports.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::{
    RateLimitQuotaService, RateLimitQuotaServiceServer,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use futures_util::Stream;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch, Notify};
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status, Streaming};

use super::{bucket_key, bucket_text, wire, RlqsService, Stream as ProxyStream};
use crate::limiter::quota::{Action, Push, Untracked, Usage};
use crate::limiter::redis::quota::LeaseRequest;
use crate::limiter::Store;
use crate::metrics::rlqs::Sent;

/// How often the tick runs (and the Redis leases are renewed).
const TICK: Duration = Duration::from_secs(1);

/// How long a round of lease renewals waits for a replica to acknowledge it (`WAIT`).
const ACK_WAIT: Duration = Duration::from_millis(500);

/// The metadata key a proxy may name itself by (`grpc_service.initial_metadata`).
const PROXY_HEADER: &str = "x-turnstile-proxy";

type Responses = Pin<Box<dyn Stream<Item = Result<RateLimitQuotaResponse, Status>> + Send>>;

#[tonic::async_trait]
impl RateLimitQuotaService for RlqsService {
    type StreamRateLimitQuotasStream = Responses;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Responses>, Status> {
        let label = proxy_label(&request);
        let mut reports = request.into_inner();
        let (tx, rx) = mpsc::unbounded_channel();
        let proxy = self.inner.next_proxy();
        self.streams().insert(
            proxy,
            ProxyStream {
                tx: tx.clone(),
                label,
            },
        );
        let metrics = self.inner.state.metrics.rlqs().clone();
        metrics.proxies.inc();
        let service = self.clone();
        let mut stop = self.inner.stop.clone();
        tokio::spawn(async move {
            loop {
                let message = tokio::select! {
                    message = reports.message() => message,
                    _ = stop.wait_for(|stop| *stop) => break,
                };
                match message {
                    Ok(Some(reports)) => service.on_reports(proxy, reports, &tx),
                    Ok(None) => break,
                    Err(e) => {
                        tracing::debug!(error = %e, "rate limit quota stream ended");
                        break;
                    }
                }
            }
            service.streams().remove(&proxy);
            service.inner.shares.disconnect(proxy);
            metrics.proxies.dec();
        });
        let responses = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        });
        Ok(Response::new(Box::pin(responses)))
    }
}

/// The stream's `proxy` label: its `x-turnstile-proxy` metadata when that is a short plain
/// name, else the peer's IP.
fn proxy_label<T>(request: &Request<T>) -> Arc<str> {
    let named = request
        .metadata()
        .get(PROXY_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|v| {
            (1..=64).contains(&v.len())
                && v.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
        });
    match named {
        Some(name) => name.into(),
        None => request
            .remote_addr()
            .map_or_else(|| "unknown".to_owned(), |a| a.ip().to_string())
            .into(),
    }
}

impl RlqsService {
    /// One usage report message: every bucket in it reported to the shares, and what they
    /// decide sent.
    fn on_reports(
        &self,
        proxy: u64,
        reports: RateLimitQuotaUsageReports,
        tx: &mpsc::UnboundedSender<Result<RateLimitQuotaResponse, Status>>,
    ) {
        let live = self.inner.state.live.load();
        let Some(settings) = live.config.rlqs.as_ref() else {
            return;
        };
        let metrics = self.inner.state.metrics.rlqs();
        metrics.reports.inc();
        let ttl_s = self.inner.shares.timing().ttl_s;
        let overrides = self.inner.state.overrides.active();
        let now = self.now_us();
        let mut pushes = Vec::new();
        let mut denied = Vec::new();
        for usage in reports.bucket_quota_usages {
            let Some(id) = usage.bucket_id else { continue };
            let key = match bucket_key(&id.bucket) {
                Ok(key) => key,
                Err(why) => {
                    tracing::debug!(why, "rate limit quota: a bucket id refused");
                    denied.push(wire::deny(id, ttl_s));
                    continue;
                }
            };
            let Some((index, rule)) = settings.rule_for(&key) else {
                denied.push(wire::deny(id, ttl_s));
                continue;
            };
            let counted = |result: &str, n: u64| {
                if n > 0 {
                    metrics
                        .reported
                        .with_label_values(&[rule.name.as_str(), result])
                        .inc_by(n);
                }
            };
            counted("allowed", usage.num_requests_allowed);
            counted("denied", usage.num_requests_denied);
            let elapsed_s = usage
                .time_elapsed
                .map_or(0, |d| u64::try_from(d.seconds).unwrap_or(0));
            let usage = Usage {
                allowed: usage.num_requests_allowed,
                denied: usage.num_requests_denied,
                elapsed_s,
            };
            // A per-key override of the budget (`/overrides/rlqs/BUDGET/KEY`): the shares apply
            // it as they apply a reload, at this report's rebalance.
            let overridden = overrides
                .has_budgets()
                .then(|| overrides.budget(&rule.name, &rule.override_key(&key)))
                .flatten();
            let budget = (overridden.unwrap_or(rule.budget), index);
            match self.inner.shares.report(proxy, &key, budget, usage, now) {
                Ok(more) => pushes.extend(more),
                Err(Untracked::Full) => denied.push(wire::deny(id, ttl_s)),
            }
        }
        self.deliver(pushes);
        if !denied.is_empty() {
            metrics.count(Sent::Denied, denied.len() as u64);
            let _ = tx.send(Ok(RateLimitQuotaResponse {
                bucket_action: denied,
            }));
        }
        // A new bucket on Redis waits for its first lease: take it now, not at the next tick.
        self.inner.wake.notify_one();
    }

    /// One tick: the shares' own changes and refreshes, the Redis leases, the metrics.
    async fn tick(&self) {
        let shares = &self.inner.shares;
        self.deliver(shares.tick(self.now_us()));
        if let Store::Redis(store) = self.inner.state.engine.store() {
            let timing = shares.timing();
            let lease_ms = (u64::from(timing.ttl_s) + 2) * 1000;
            let asks = shares.lease_asks(self.now_us());
            // With replicas, a renewal counts once one of them has it: a failover to a replica
            // that lacks it would hand its share out again.
            let replicated = !asks.is_empty() && store.quota_replicas().await.unwrap_or(0) > 0;
            let calls = asks.iter().map(|ask| {
                let request = LeaseRequest {
                    held: ask.held,
                    demand: ask.demand,
                    floor: ask.floor,
                    rate: ask.budget.rate,
                    lease_ms,
                    hold_ms: lease_ms,
                };
                let text = bucket_text(&ask.bucket);
                let server = &self.inner.server_id;
                async move {
                    // Read before the call: our view of the expiry is never later than Redis's.
                    let before = self.now_us();
                    let reply = store.quota_lease(&text, server, request).await;
                    (before, reply)
                }
            });
            let replies = futures_util::future::join_all(calls).await;
            let acknowledged = !replicated || store.quota_acknowledged(ACK_WAIT).await;
            let now = self.now_us();
            for (ask, (before, reply)) in asks.iter().zip(replies) {
                match reply {
                    Ok(lease) if acknowledged => {
                        let until = before + lease.ms * 1000;
                        shares.set_lease(&ask.bucket, (lease.grant, lease.rate), until, now);
                    }
                    Ok(lease) => {
                        shares.cap_lease(&ask.bucket, (lease.grant, lease.rate), now);
                        if let Some(n) = self.inner.lease_errors.allow() {
                            tracing::warn!(suppressed = n, "rate limit quota: no replica acknowledged the lease renewals; the last acknowledged leases stay in force until they end");
                        }
                    }
                    Err(e) => {
                        if let Some(n) = self.inner.lease_errors.allow() {
                            tracing::warn!(error = %e, suppressed = n, "rate limit quota: a lease could not be renewed; its proxies keep their assignments until the lease ends");
                        }
                    }
                }
            }
            self.deliver(shares.tick(self.now_us()));
        }
        self.update_metrics();
    }

    fn update_metrics(&self) {
        let metrics = self.inner.state.metrics.rlqs();
        metrics.buckets.set(self.inner.shares.buckets() as i64);
        let live = self.inner.state.live.load();
        let Some(settings) = live.config.rlqs.as_ref() else {
            return;
        };
        let labels: HashMap<u64, Arc<str>> = self
            .streams()
            .iter()
            .map(|(id, s)| (*id, s.label.clone()))
            .collect();
        let mut sums: HashMap<(usize, Arc<str>), f64> = HashMap::new();
        for view in self.inner.shares.view() {
            for (proxy, rate) in view.shares {
                let label = labels
                    .get(&proxy)
                    .cloned()
                    .unwrap_or_else(|| Arc::from("gone"));
                *sums.entry((view.rule, label)).or_default() += rate;
            }
        }
        metrics.share.reset();
        for ((rule, label), rate) in sums {
            if let Some(rule) = settings.rules.get(rule) {
                metrics
                    .share
                    .with_label_values(&[rule.name.as_str(), &label])
                    .set(rate);
            }
        }
        for rule in &settings.rules {
            metrics
                .budget
                .with_label_values(&[rule.name.as_str()])
                .set(rule.budget.rate);
        }
    }

    /// Counts what a push tells its proxy.
    pub(super) fn count(&self, push: &Push) {
        let kind = match push.action {
            Action::Assign { changed: true, .. } => Sent::Changed,
            Action::Assign { changed: false, .. } => Sent::Refreshed,
            Action::Abandon => Sent::Abandoned,
        };
        self.inner.state.metrics.rlqs().count(kind, 1);
    }
}

/// Serves the quota service on `listener` until `shutdown` changes, with its tick. Streams end
/// as shutdown begins; the proxies keep their assignments until they expire.
pub async fn serve(
    listener: TcpListener,
    service: RlqsService,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(), tonic::transport::Error> {
    let ticker = service.clone();
    let mut stop = shutdown.clone();
    let wake: Arc<Notify> = service.inner.wake.clone();
    let tick = tokio::spawn(async move {
        let mut every = tokio::time::interval(TICK);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = every.tick() => {}
                _ = wake.notified() => {}
                _ = stop.wait_for(|stop| *stop) => return,
            }
            ticker.tick().await;
        }
    });
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let stopper = service.inner.stop_tx.clone();
    let served = tonic::transport::Server::builder()
        .add_service(RateLimitQuotaServiceServer::new(service))
        .serve_with_incoming_shutdown(incoming, async move {
            let _ = shutdown.changed().await;
            // End every stream, so the graceful shutdown does not wait on them.
            let _ = stopper.send(true);
        })
        .await;
    tick.abort();
    served
}
