//! The rate limit quota service's metrics (`crate::rlqs`). The `budget` label is a configured
//! budget's name (`default` for the default); `proxy` names a connected proxy stream (its
//! `x-turnstile-proxy` metadata, or its IP), so its series last as long as the proxy holds a
//! share and are removed with it.

use prometheus::{GaugeVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

/// What a bucket action told a proxy, as `turnstile_rlqs_assignments_total{kind}` counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sent {
    Changed,
    Refreshed,
    Abandoned,
    Denied,
}

/// The families, registered once per [`crate::metrics::Metrics`].
#[derive(Debug, Clone)]
pub struct RlqsMetricVecs {
    pub buckets: IntGauge,
    pub proxies: IntGauge,
    /// Usage report messages received (Envoy sends one per stream per report interval, and one
    /// when a bucket first appears).
    pub reports: IntCounter,
    /// Assignments sent: `changed` (a new token bucket), `refreshed` (the same again: its TTL
    /// extended), `abandoned`, `denied` (a bucket with no budget, or over `max_buckets`).
    assignments: [IntCounter; 4],
    /// Tokens per second assigned, per budget and proxy (summed over the budget's buckets).
    pub share: GaugeVec,
    /// The configured rate of each budget (per bucket id), tokens per second.
    pub budget: GaugeVec,
    /// Requests the proxies reported, per budget and `result` (`allowed`, `denied`).
    pub reported: IntCounterVec,
}

impl RlqsMetricVecs {
    pub fn register(registry: &Registry) -> Self {
        fn add<T: prometheus::core::Collector + Clone + 'static>(r: &Registry, c: T) -> T {
            r.register(Box::new(c.clone()))
                .unwrap_or_else(|e| panic!("rlqs metric: {e}"));
            c
        }
        let gauge = |name: &str, help: &str| {
            add(
                registry,
                IntGauge::new(name, help).unwrap_or_else(|e| panic!("metric {name}: {e}")),
            )
        };
        let assignments = add(
            registry,
            IntCounterVec::new(
                Opts::new(
                    "turnstile_rlqs_assignments_total",
                    "Bucket actions sent to proxies, by kind (changed, refreshed, abandoned, \
                     denied).",
                ),
                &["kind"],
            )
            .unwrap_or_else(|e| panic!("metric turnstile_rlqs_assignments_total: {e}")),
        );
        RlqsMetricVecs {
            buckets: gauge(
                "turnstile_rlqs_buckets",
                "Bucket ids the quota service tracks.",
            ),
            proxies: gauge(
                "turnstile_rlqs_proxies",
                "Proxy streams connected to the quota service.",
            ),
            reports: add(
                registry,
                IntCounter::new(
                    "turnstile_rlqs_reports_total",
                    "Usage report messages received from the proxies.",
                )
                .unwrap_or_else(|e| panic!("metric turnstile_rlqs_reports_total: {e}")),
            ),
            assignments: ["changed", "refreshed", "abandoned", "denied"]
                .map(|k| assignments.with_label_values(&[k])),
            share: add(
                registry,
                GaugeVec::new(
                    Opts::new(
                        "turnstile_rlqs_share",
                        "Tokens per second assigned to each proxy, per budget.",
                    ),
                    &["budget", "proxy"],
                )
                .unwrap_or_else(|e| panic!("metric turnstile_rlqs_share: {e}")),
            ),
            budget: add(
                registry,
                GaugeVec::new(
                    Opts::new(
                        "turnstile_rlqs_budget",
                        "Each budget's rate per bucket id, tokens per second.",
                    ),
                    &["budget"],
                )
                .unwrap_or_else(|e| panic!("metric turnstile_rlqs_budget: {e}")),
            ),
            reported: add(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "turnstile_rlqs_reported_total",
                        "Requests the proxies reported, per budget and result.",
                    ),
                    &["budget", "result"],
                )
                .unwrap_or_else(|e| panic!("metric turnstile_rlqs_reported_total: {e}")),
            ),
        }
    }

    pub fn count(&self, kind: Sent, n: u64) {
        self.assignments[kind as usize].inc_by(n);
    }
}
