//! envoyproxy/ratelimit's per-rule statistics, as Prometheus counters.
//!
//! envoyproxy/ratelimit names a statistic `ratelimit.service.rate_limit.DOMAIN.KEY_PATH.STAT`; here
//! each STAT is a counter `turnstile_rls_STAT` labelled `domain` and `descriptor` (the key path,
//! e.g. `key1_value1.subkey1`; request values only where `detailed_metric`/`value_to_metric` ask).
//! Handles of rules whose label needs no request value are resolved once per config load.

use prometheus::{IntCounter, IntCounterVec, Opts, Registry};

/// The fraction of a limit past which hits count as `near_limit` (envoyproxy/ratelimit's
/// `NEAR_LIMIT_RATIO` default).
pub const NEAR_LIMIT_RATIO: f64 = 0.8;

const STATS: [(&str, &str); 6] = [
    (
        "total_hits",
        "Hits on a rule (hits_addend summed), as envoyproxy/ratelimit's total_hits.",
    ),
    ("over_limit", "Hits over a rule's limit."),
    ("near_limit", "Hits within the limit but past 80% of it."),
    ("within_limit", "Hits within the limit."),
    (
        "shadow_mode",
        "Over-limit hits of shadow_mode rules, which were answered OK.",
    ),
    (
        "quota_mode",
        "Over-limit hits of quota_mode rules (OVER_LIMIT only when every quota descriptor of \
         the request is over).",
    ),
];

/// The counter families, registered once per [`crate::metrics::Metrics`].
#[derive(Debug, Clone)]
pub struct RlsMetricVecs {
    stats: [IntCounterVec; 6],
    /// `turnstile_rls_requests_total` per [`CallResult`], resolved once: counting a call is one
    /// atomic add, not a label lookup.
    requests: [IntCounter; 6],
}

/// How one `ShouldRateLimit` call ended, as counted by `turnstile_rls_requests_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallResult {
    Ok,
    OverLimit,
    /// The store failed and `failure_mode: error` returned a gRPC error to Envoy.
    Error,
    FailedOpen,
    FailedClosed,
    Invalid,
}

impl CallResult {
    const ALL: [CallResult; 6] = [
        CallResult::Ok,
        CallResult::OverLimit,
        CallResult::Error,
        CallResult::FailedOpen,
        CallResult::FailedClosed,
        CallResult::Invalid,
    ];

    fn as_str(self) -> &'static str {
        match self {
            CallResult::Ok => "ok",
            CallResult::OverLimit => "over_limit",
            CallResult::Error => "error",
            CallResult::FailedOpen => "failed_open",
            CallResult::FailedClosed => "failed_closed",
            CallResult::Invalid => "invalid",
        }
    }
}

impl RlsMetricVecs {
    /// Creates and registers the families.
    pub fn register(registry: &Registry) -> Self {
        let vec = |name: &str, help: &str, labels: &[&str]| {
            let v = IntCounterVec::new(Opts::new(name, help), labels)
                .unwrap_or_else(|e| panic!("metric {name}: {e}"));
            registry
                .register(Box::new(v.clone()))
                .unwrap_or_else(|e| panic!("metric {name}: {e}"));
            v
        };
        RlsMetricVecs {
            stats: STATS.map(|(stat, help)| {
                vec(
                    &format!("turnstile_rls_{stat}"),
                    help,
                    &["domain", "descriptor"],
                )
            }),
            requests: {
                let requests = vec(
                    "turnstile_rls_requests_total",
                    "ShouldRateLimit calls (gRPC and /json) by result.",
                    &["result"],
                );
                CallResult::ALL.map(|r| requests.with_label_values(&[r.as_str()]))
            },
        }
    }

    /// The handles of one (domain, descriptor) label pair.
    pub fn rule(&self, domain: &str, descriptor: &str) -> RuleMetrics {
        RuleMetrics {
            counters: self
                .stats
                .clone()
                .map(|v| v.with_label_values(&[domain, descriptor])),
        }
    }

    pub fn record_call(&self, result: CallResult) {
        self.requests[result as usize].inc();
    }
}

/// The six counters of one rule.
#[derive(Debug, Clone)]
pub struct RuleMetrics {
    counters: [IntCounter; 6],
}

/// Whether a descriptor's hits were over its limit, and the modes of its rule.
#[derive(Debug, Clone, Copy)]
pub struct Over {
    pub over: bool,
    /// `shadow_mode`: over-limit hits also count in `turnstile_rls_shadow_mode`.
    pub shadow: bool,
    /// `quota_mode`: over-limit hits also count in `turnstile_rls_quota_mode`.
    pub quota: bool,
}

impl RuleMetrics {
    /// Counts `hits` against a limit of `limit`, given how many units were used after the hits
    /// (`used_after`) and whether the descriptor was over its limit. Splits the hits between
    /// within and near limit the way envoyproxy/ratelimit does.
    pub fn record(&self, hits: u64, limit: u64, used_after: u64, over: Over) {
        let [total, over_limit, near, within, shadow_mode, quota_mode] = &self.counters;
        total.inc_by(hits);
        if over.over {
            over_limit.inc_by(hits);
            if over.shadow {
                shadow_mode.inc_by(hits);
            }
            if over.quota {
                quota_mode.inc_by(hits);
            }
            return;
        }
        within.inc_by(hits);
        let threshold = (limit as f64 * NEAR_LIMIT_RATIO).floor() as u64;
        if used_after > threshold {
            let used_before = used_after.saturating_sub(hits);
            near.inc_by(used_after - used_before.max(threshold));
        }
    }
}
