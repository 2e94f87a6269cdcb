//! Prometheus metrics, in a registry of our own (never the global one), served on the admin
//! listener. Labels come only from config names, so cardinality is bounded by the config. Handles
//! are made once per route and policy at config load, and a route's series are registered with
//! their labels on its first request (then exported, every one at 0): after that the hot path
//! increments a counter it already holds, with no label lookup or formatting, and `/metrics`
//! grows with the routes in use, not with the routes configured.

pub mod ext_proc;
pub mod rlqs;
pub mod rls;
pub mod striped;

use std::sync::{Arc, OnceLock};

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Buckets for in-gateway latencies: 50 µs to 10 s.
const LATENCY_BUCKETS: &[f64] = &[
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
];

/// Every metric the gateway exports: one registry and its families, shared by every handle.
#[derive(Debug, Clone)]
pub struct Metrics(Arc<Families>);

#[derive(Debug)]
pub struct Families {
    registry: Registry,
    decisions: IntCounterVec,
    exempt: IntCounterVec,
    requests: IntCounterVec,
    request_duration: HistogramVec,
    decision_duration: HistogramVec,
    store_errors: IntCounterVec,
    upstream_errors: IntCounterVec,
    body_timeouts: IntCounterVec,
    config_reloads: IntCounterVec,
    door_checks: IntCounterVec,
    jwt_tokens: IntCounterVec,
    /// The JWT key sources' and token cache's series (`crate::jwt::KeyMetrics`).
    jwt_keys: crate::jwt::KeyMetrics,
    deny_cache_hits: IntCounterVec,
    rls: rls::RlsMetricVecs,
    rlqs: rlqs::RlqsMetricVecs,
    in_flight: IntGaugeVec,
    delayed: IntCounterVec,
    delay_seconds: HistogramVec,
    waiting: IntGaugeVec,
    cost_charged: IntCounterVec,
    usage: UsageVecs,
    quota_units: IntCounterVec,
    upstream_requests: IntCounterVec,
    upstream_ejections: IntCounterVec,
    upstream_in_flight: IntGaugeVec,
    open_connections: IntGaugeVec,
    worker_connections: IntGaugeVec,
    goaways: IntCounterVec,
    tls_reloads: IntCounterVec,
    tls_handshake_failures: IntCounterVec,
    /// The hot path's striped handles, folded into their series by each render.
    folds: striped::Folds,
}

/// How one attempt on an upstream target ended, as counted by
/// `turnstile_upstream_requests_total{upstream, target, outcome}`. A request retried on another
/// target after a connect error counts once on each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetOutcome {
    /// A response head arrived.
    Ok,
    /// No connection could be opened (refused, unreachable, connect timeout).
    ConnectError,
    /// No response head within the upstream's `timeout`.
    Timeout,
    /// Every connection the pool may have stayed busy for `pool_timeout`.
    Busy,
    /// The exchange broke on an open connection. A failure of the client's request body is
    /// recorded under no outcome.
    Error,
}

impl TargetOutcome {
    const ALL: [TargetOutcome; 5] = [
        TargetOutcome::Ok,
        TargetOutcome::ConnectError,
        TargetOutcome::Timeout,
        TargetOutcome::Busy,
        TargetOutcome::Error,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            TargetOutcome::Ok => "ok",
            TargetOutcome::ConnectError => "connect_error",
            TargetOutcome::Timeout => "timeout",
            TargetOutcome::Busy => "busy",
            TargetOutcome::Error => "error",
        }
    }
}

/// The series of one upstream target, resolved when the config loads.
#[derive(Debug, Clone)]
pub struct TargetMetrics {
    by_outcome: striped::Counters<5>,
    pub ejections: IntCounter,
    pub in_flight: striped::Gauge,
}

impl TargetMetrics {
    pub fn record(&self, outcome: TargetOutcome) {
        self.by_outcome.inc(outcome as usize);
    }
}

/// How a deciding door (forward-auth, ext_authz) answered, as counted by
/// `turnstile_door_checks_total{door, result}`. The policies' own decisions are counted in
/// `turnstile_decisions_total`, as the gateway's are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckResult {
    Allowed,
    Limited,
    FailedOpen,
    FailedClosed,
    NoRoute,
    BadRequest,
    /// 401: `require_jwt` and no valid bearer token.
    Unauthorized,
}

impl CheckResult {
    const ALL: [CheckResult; 7] = [
        CheckResult::Allowed,
        CheckResult::Limited,
        CheckResult::FailedOpen,
        CheckResult::FailedClosed,
        CheckResult::NoRoute,
        CheckResult::BadRequest,
        CheckResult::Unauthorized,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            CheckResult::Allowed => "allowed",
            CheckResult::Limited => "limited",
            CheckResult::FailedOpen => "failed_open",
            CheckResult::FailedClosed => "failed_closed",
            CheckResult::NoRoute => "no_route",
            CheckResult::BadRequest => "bad_request",
            CheckResult::Unauthorized => "unauthorized",
        }
    }
}

/// The answer counters of one door, resolved when its listener starts.
#[derive(Debug, Clone)]
pub struct DoorMetrics {
    by_result: [IntCounter; 7],
}

impl DoorMetrics {
    pub fn record(&self, result: CheckResult) {
        self.by_result[result as usize].inc();
    }
}

/// How a policy's part in a decision ended, as counted by `turnstile_decisions_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecisionLabel {
    Allowed,
    Limited,
    FailedOpen,
    FailedClosed,
    /// A shadow policy (`mode: shadow`) that would have refused: the request went on.
    Shadow,
}

impl DecisionLabel {
    const ALL: [DecisionLabel; 5] = [
        DecisionLabel::Allowed,
        DecisionLabel::Limited,
        DecisionLabel::FailedOpen,
        DecisionLabel::FailedClosed,
        DecisionLabel::Shadow,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DecisionLabel::Allowed => "allowed",
            DecisionLabel::Limited => "limited",
            DecisionLabel::FailedOpen => "failed_open",
            DecisionLabel::FailedClosed => "failed_closed",
            DecisionLabel::Shadow => "shadow",
        }
    }
}

/// The decision counters of one (route, policy). Resolved at config load, exported from the
/// first request its route admits ([`Self::register`]): a config's never-used policies add no
/// series to `/metrics`.
#[derive(Debug, Clone)]
pub struct PolicyMetrics {
    metrics: Metrics,
    route: Arc<str>,
    policy: Arc<str>,
    /// Calendar quota policies also count `turnstile_quota_used_units_total`.
    quota: bool,
    series: OnceLock<PolicySeries>,
    /// A cost from token usage: resolved on the first response settled.
    usage: OnceLock<UsageSeries>,
}

/// The token-usage families (`docs/llm.md`, "Metrics").
#[derive(Debug, Clone)]
struct UsageVecs {
    tokens: IntCounterVec,
    reserved: IntGaugeVec,
    refunded: IntCounterVec,
    unreported: IntCounterVec,
}

/// One policy's token-usage series, for [`crate::inflight`]'s settlement.
#[derive(Debug, Clone)]
pub struct UsageSeries {
    /// Tokens the responses reported, by kind: input (not cached), cached_input, output (not
    /// reasoning), reasoning.
    pub tokens: [IntCounter; 4],
    /// Units reserved at admission and not yet settled.
    pub reserved: IntGauge,
    /// Units given back by settlements.
    pub refunded: IntCounter,
    /// Responses that reported no usage (charged the fallback).
    pub unreported: IntCounter,
}

/// The `kind` label of [`UsageSeries::tokens`], in its order.
pub const TOKEN_KINDS: [&str; 4] = ["input", "cached_input", "output", "reasoning"];

#[derive(Debug, Clone)]
struct PolicySeries {
    by_label: striped::Counters<5>,
    cost_charged: IntCounter,
    quota_units: Option<IntCounter>,
}

impl PolicyMetrics {
    fn series(&self) -> &PolicySeries {
        self.series.get_or_init(|| {
            let labels = [&*self.route, &*self.policy];
            PolicySeries {
                by_label: striped::Counters::new(
                    DecisionLabel::ALL.map(|l| {
                        self.metrics.decisions.with_label_values(&[
                            labels[0],
                            labels[1],
                            l.as_str(),
                        ])
                    }),
                    &self.metrics.folds,
                ),
                cost_charged: self.metrics.cost_charged.with_label_values(&labels),
                quota_units: self
                    .quota
                    .then(|| self.metrics.quota_units.with_label_values(&labels)),
            }
        })
    }

    /// Exports this policy's series, every one at 0, if they are not yet.
    pub fn register(&self) {
        self.series();
    }

    /// Its decisions so far by label (`allowed`, `limited`, `failed_open`, `failed_closed`,
    /// `shadow`), as `/metrics` exports them; all 0 (and nothing exported) before the first.
    pub fn counts(&self) -> [(&'static str, u64); 5] {
        let series = self.series.get();
        DecisionLabel::ALL.map(|l| {
            let n = series.map_or(0, |s| s.by_label.get(l as usize));
            (l.as_str(), n)
        })
    }

    pub fn record(&self, label: DecisionLabel) {
        self.series().by_label.inc(label as usize);
    }

    /// Units charged after responses (`cost: {response_header}`), beyond what admission took.
    pub fn cost_charged(&self) -> &IntCounter {
        &self.series().cost_charged
    }

    /// The token-usage series of this policy, exported from the first response settled.
    pub fn usage(&self) -> &UsageSeries {
        self.usage.get_or_init(|| {
            let v = &self.metrics.usage;
            let labels = [&*self.route, &*self.policy];
            UsageSeries {
                tokens: TOKEN_KINDS
                    .map(|kind| v.tokens.with_label_values(&[labels[0], labels[1], kind])),
                reserved: v.reserved.with_label_values(&labels),
                refunded: v.refunded.with_label_values(&labels),
                unreported: v.unreported.with_label_values(&labels),
            }
        })
    }

    /// Units an admitted request charged to this policy, counted for quota policies only.
    pub fn record_units(&self, units: u64) {
        if let Some(c) = &self.series().quota_units {
            c.inc_by(units);
        }
    }

    /// These counters, and the quota units of their (route, policy).
    pub fn with_quota_units(mut self) -> Self {
        self.quota = true;
        self
    }
}

/// The request counters of one route. Resolved at config load, exported from the route's first
/// request ([`Self::register`]; every one at 0 then): a config's never-used routes add no series
/// to `/metrics`, however many it has.
#[derive(Debug, Clone)]
pub struct RouteMetrics {
    metrics: Metrics,
    route: Arc<str>,
    series: OnceLock<RouteSeries>,
}

#[derive(Debug, Clone)]
struct RouteSeries {
    /// 2xx, 3xx, 4xx (but 429), 429, 5xx.
    by_code: striped::Counters<5>,
    duration: striped::Observations,
    upstream_connect: IntCounter,
    upstream_timeout: IntCounter,
    upstream_busy: IntCounter,
    upstream_other: IntCounter,
    /// Request bodies cut off: idle (`body_read_timeout`), too slow (`min_body_rate`).
    body_timeouts: [IntCounter; 2],
    exempt: IntCounter,
    /// Bearer tokens verified: valid, invalid, missing (`turnstile_jwt_tokens_total`).
    jwt: [IntCounter; 3],
    in_flight: IntGauge,
    /// Pacing: requests admitted for later, their waits, and how many wait now.
    delayed: IntCounter,
    delay: Histogram,
    waiting: IntGauge,
}

/// Why a request body was cut off (408), as counted by
/// `turnstile_request_body_timeouts_total{route, reason}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyTimeout {
    /// Nothing for `server.body_read_timeout`.
    Idle,
    /// Slower than `server.min_body_rate`.
    TooSlow,
}

impl BodyTimeout {
    pub fn as_str(self) -> &'static str {
        match self {
            BodyTimeout::Idle => "idle",
            BodyTimeout::TooSlow => "too_slow",
        }
    }
}

/// Why a request to the upstream failed, as counted by `turnstile_upstream_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamErrorKind {
    Connect,
    Timeout,
    /// Every connection the upstream may have stayed busy for its `pool_timeout` (503).
    Busy,
    Other,
}

impl RouteMetrics {
    fn series(&self) -> &RouteSeries {
        self.series.get_or_init(|| {
            let (m, route) = (&self.metrics, &*self.route);
            let code = |c: &str| m.requests.with_label_values(&[route, c]);
            let upstream = |k: &str| m.upstream_errors.with_label_values(&[route, k]);
            RouteSeries {
                by_code: striped::Counters::new(
                    [
                        code("2xx"),
                        code("3xx"),
                        code("4xx"),
                        code("429"),
                        code("5xx"),
                    ],
                    &m.folds,
                ),
                duration: striped::Observations::new(
                    &m.request_duration.with_label_values(&[route]),
                    &m.folds,
                ),
                upstream_connect: upstream("connect"),
                upstream_timeout: upstream("timeout"),
                upstream_busy: upstream("busy"),
                upstream_other: upstream("other"),
                body_timeouts: [BodyTimeout::Idle, BodyTimeout::TooSlow]
                    .map(|r| m.body_timeouts.with_label_values(&[route, r.as_str()])),
                exempt: m.exempt.with_label_values(&[route]),
                jwt: ["valid", "invalid", "missing"]
                    .map(|r| m.jwt_tokens.with_label_values(&[route, r])),
                in_flight: m.in_flight.with_label_values(&[route]),
                delayed: m.delayed.with_label_values(&[route]),
                delay: m.delay_seconds.with_label_values(&[route]),
                waiting: m.waiting.with_label_values(&[route]),
            }
        })
    }

    /// Whether this route's series are exported yet.
    pub fn registered(&self) -> bool {
        self.series.get().is_some()
    }

    /// Exports this route's series, every one at 0, if they are not yet.
    pub fn register(&self) {
        self.series();
    }

    /// A request admitted for later (pacing), to wait `seconds` for its slot.
    pub fn record_delay(&self, seconds: f64) {
        let series = self.series();
        series.delayed.inc();
        series.delay.observe(seconds);
    }

    /// Requests waiting for their slot now (pacing).
    pub fn waiting(&self) -> &IntGauge {
        &self.series().waiting
    }

    /// Requests holding a concurrency lease now (admitted, response body not yet ended).
    pub fn in_flight(&self) -> &IntGauge {
        &self.series().in_flight
    }

    pub fn record_response(&self, status: u16, seconds: f64) {
        let series = self.series();
        let class = match status {
            429 => 3,
            200..=299 => 0,
            300..=399 => 1,
            400..=499 => 2,
            _ => 4,
        };
        series.by_code.inc(class);
        series.duration.observe(seconds);
    }

    /// A request that skipped every policy (`exempt:`).
    pub fn record_exempt(&self) {
        self.series().exempt.inc();
    }

    /// One bearer-token verification (at most one per request).
    pub fn record_jwt(&self, result: Result<(), crate::jwt::Rejected>) {
        let i = match result {
            Ok(()) => 0,
            Err(crate::jwt::Rejected::Invalid) => 1,
            Err(crate::jwt::Rejected::Missing) => 2,
        };
        self.series().jwt[i].inc();
    }

    /// A request body cut off, answered 408 (the upstream request aborted).
    pub fn record_body_timeout(&self, reason: BodyTimeout) {
        self.series().body_timeouts[reason as usize].inc();
    }

    pub fn record_upstream_error(&self, kind: UpstreamErrorKind) {
        let series = self.series();
        match kind {
            UpstreamErrorKind::Connect => &series.upstream_connect,
            UpstreamErrorKind::Timeout => &series.upstream_timeout,
            UpstreamErrorKind::Busy => &series.upstream_busy,
            UpstreamErrorKind::Other => &series.upstream_other,
        }
        .inc();
    }
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let counter = |name: &str, help: &str, labels: &[&str]| {
            let c = IntCounterVec::new(Opts::new(name, help), labels)
                .unwrap_or_else(|e| panic!("metric {name}: {e}"));
            registry
                .register(Box::new(c.clone()))
                .unwrap_or_else(|e| panic!("metric {name}: {e}"));
            c
        };
        let histogram = |name: &str, help: &str, labels: &[&str]| {
            let opts = HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec());
            let h =
                HistogramVec::new(opts, labels).unwrap_or_else(|e| panic!("metric {name}: {e}"));
            registry
                .register(Box::new(h.clone()))
                .unwrap_or_else(|e| panic!("metric {name}: {e}"));
            h
        };
        let metrics = Families {
            decisions: counter(
                "turnstile_decisions_total",
                "Rate-limit decisions per route and policy.",
                &["route", "policy", "decision"],
            ),
            exempt: counter(
                "turnstile_exempt_total",
                "Requests that skipped every policy of their route (`exempt:`).",
                &["route"],
            ),
            requests: counter(
                "turnstile_requests_total",
                "Requests answered, by route and status class sent to the client.",
                &["route", "code"],
            ),
            request_duration: histogram(
                "turnstile_request_duration_seconds",
                "Time from request head to response head through the gateway.",
                &["route"],
            ),
            decision_duration: histogram(
                "turnstile_decision_duration_seconds",
                "Time spent deciding, store round trip included.",
                &["store"],
            ),
            store_errors: counter(
                "turnstile_store_errors_total",
                "Decisions the store could not take.",
                &["store", "kind"],
            ),
            upstream_errors: counter(
                "turnstile_upstream_errors_total",
                "Requests the upstream did not answer.",
                &["route", "kind"],
            ),
            body_timeouts: counter(
                "turnstile_request_body_timeouts_total",
                "Request bodies cut off (408): `idle` (nothing for body_read_timeout) or \
                 `too_slow` (slower than min_body_rate).",
                &["route", "reason"],
            ),
            config_reloads: counter(
                "turnstile_config_reloads_total",
                "Config reloads by result.",
                &["result"],
            ),
            door_checks: counter(
                "turnstile_door_checks_total",
                "Checks answered by a deciding door (forward_auth, ext_authz, ext_proc), by result.",
                &["door", "result"],
            ),
            jwt_tokens: counter(
                "turnstile_jwt_tokens_total",
                "Bearer tokens verified for `jwt:` keys or `require_jwt`, by route and result.",
                &["route", "result"],
            ),
            deny_cache_hits: counter(
                "turnstile_deny_cache_hits_total",
                "Decisions answered from the local deny cache, without a store round trip.",
                &["store"],
            ),
            rls: rls::RlsMetricVecs::register(&registry),
            rlqs: rlqs::RlqsMetricVecs::register(&registry),
            in_flight: {
                let opts = Opts::new(
                    "turnstile_in_flight_requests",
                    "Requests holding a concurrency lease, per route (admitted, response not ended).",
                );
                let g = IntGaugeVec::new(opts, &["route"])
                    .unwrap_or_else(|e| panic!("metric turnstile_in_flight_requests: {e}"));
                registry
                    .register(Box::new(g.clone()))
                    .unwrap_or_else(|e| panic!("metric turnstile_in_flight_requests: {e}"));
                g
            },
            delayed: counter(
                "turnstile_delayed_requests_total",
                "Requests admitted for a later slot (`on_limit: delay`), per route.",
                &["route"],
            ),
            delay_seconds: histogram(
                "turnstile_delay_seconds",
                "How long requests admitted for later were to wait for their slot, per route.",
                &["route"],
            ),
            waiting: {
                let opts = Opts::new(
                    "turnstile_waiting_requests",
                    "Requests waiting for their slot now (`on_limit: delay`), per route.",
                );
                let g = IntGaugeVec::new(opts, &["route"])
                    .unwrap_or_else(|e| panic!("metric turnstile_waiting_requests: {e}"));
                registry
                    .register(Box::new(g.clone()))
                    .unwrap_or_else(|e| panic!("metric turnstile_waiting_requests: {e}"));
                g
            },
            cost_charged: counter(
                "turnstile_cost_charged_total",
                "Units charged after the response (cost from a response header), per policy.",
                &["route", "policy"],
            ),
            usage: UsageVecs {
                tokens: counter(
                    "turnstile_tokens_total",
                    "Tokens the responses reported, per policy and kind (input, cached_input, \
                     output, reasoning; each token counted in one kind).",
                    &["route", "policy", "kind"],
                ),
                reserved: {
                    let name = "turnstile_cost_reserved_units";
                    let g = IntGaugeVec::new(
                        Opts::new(
                            name,
                            "Units reserved at admission (reserve: true) and not yet settled.",
                        ),
                        &["route", "policy"],
                    )
                    .unwrap_or_else(|e| panic!("metric {name}: {e}"));
                    registry
                        .register(Box::new(g.clone()))
                        .unwrap_or_else(|e| panic!("metric {name}: {e}"));
                    g
                },
                refunded: counter(
                    "turnstile_cost_refunded_total",
                    "Units of reservations given back when the response reported its usage.",
                    &["route", "policy"],
                ),
                unreported: counter(
                    "turnstile_usage_unreported_total",
                    "Responses that reported no token usage (cut off, malformed, too large, no \
                     usage asked for) and were charged the fallback.",
                    &["route", "policy"],
                ),
            },
            upstream_requests: counter(
                "turnstile_upstream_requests_total",
                "Attempts on each upstream target, by outcome (a connect error retried elsewhere \
                 counts on both targets).",
                &["upstream", "target", "outcome"],
            ),
            upstream_ejections: counter(
                "turnstile_upstream_ejections_total",
                "Times a target was left out for `eject_for` after failing to connect.",
                &["upstream", "target"],
            ),
            upstream_in_flight: {
                let name = "turnstile_upstream_in_flight";
                let g = IntGaugeVec::new(
                    Opts::new(
                        name,
                        "Requests on each upstream target now, until their body ends.",
                    ),
                    &["upstream", "target"],
                )
                .unwrap_or_else(|e| panic!("metric {name}: {e}"));
                registry
                    .register(Box::new(g.clone()))
                    .unwrap_or_else(|e| panic!("metric {name}: {e}"));
                g
            },
            open_connections: {
                let name = "turnstile_open_connections";
                let g = IntGaugeVec::new(
                    Opts::new(
                        name,
                        "Connections open, per listener: `public` (the gateway, TLS included), \
                         `forward_auth` (the HTTP check listener), `ext_authz` (the gRPC one) or \
                         `ext_proc` (Envoy's external processor).",
                    ),
                    &["listener"],
                )
                .unwrap_or_else(|e| panic!("metric {name}: {e}"));
                registry
                    .register(Box::new(g.clone()))
                    .unwrap_or_else(|e| panic!("metric {name}: {e}"));
                g
            },
            worker_connections: {
                let name = "turnstile_worker_connections";
                let g = IntGaugeVec::new(
                    Opts::new(
                        name,
                        "Connections of the public and forward-auth listeners open on each \
                         connection worker (with several workers only).",
                    ),
                    &["worker"],
                )
                .unwrap_or_else(|e| panic!("metric {name}: {e}"));
                registry
                    .register(Box::new(g.clone()))
                    .unwrap_or_else(|e| panic!("metric {name}: {e}"));
                g
            },
            goaways: counter(
                "turnstile_connection_goaways_total",
                "Client connections shut down for abuse, by reason.",
                &["reason"],
            ),
            tls_reloads: counter(
                "turnstile_tls_certificate_reloads_total",
                "Reloads of a TLS listener's certificate, key or client CA after its files \
                 changed, by listener and result.",
                &["listener", "result"],
            ),
            tls_handshake_failures: counter(
                "turnstile_tls_handshake_failures_total",
                "TLS handshakes that failed, by listener and reason (a client without a \
                 required certificate, or with one that does not verify, is an `error`).",
                &["listener", "reason"],
            ),
            quota_units: counter(
                "turnstile_quota_used_units_total",
                "Units admitted requests charged to calendar quota policies, all keys together.",
                &["route", "policy"],
            ),
            jwt_keys: {
                let keys = crate::jwt::KeyMetrics::new();
                for collector in keys.collectors() {
                    registry
                        .register(collector)
                        .unwrap_or_else(|e| panic!("jwt metrics: {e}"));
                }
                keys
            },
            registry,
            folds: striped::Folds::default(),
        };
        let build_info = IntGaugeVec::new(
            Opts::new("turnstile_build_info", "The running version; always 1."),
            &["version"],
        )
        .unwrap_or_else(|e| panic!("metric turnstile_build_info: {e}"));
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        let _ = metrics.registry.register(Box::new(build_info));
        Metrics(Arc::new(metrics))
    }

    /// Registers a collector owned by another module (the store, the Envoy adapter).
    pub fn register(&self, collector: Box<dyn prometheus::core::Collector>) {
        if let Err(e) = self.registry.register(collector) {
            tracing::warn!(error = %e, "metric registration failed");
        }
    }

    /// The answer counters of `door`, every series at 0 from the start.
    pub fn door(&self, door: &str) -> DoorMetrics {
        DoorMetrics {
            by_result: CheckResult::ALL
                .map(|r| self.door_checks.with_label_values(&[door, r.as_str()])),
        }
    }

    /// The open-connections gauge of one listener (`public`, `forward_auth`, `ext_authz`),
    /// exported from now.
    pub fn open_connections(&self, listener: &str) -> IntGauge {
        self.open_connections.with_label_values(&[listener])
    }

    /// The connections open on connection worker `worker` (`crate::workers`), exported from now.
    pub fn worker_connections(&self, worker: usize) -> IntGauge {
        self.worker_connections
            .with_label_values(&[worker.to_string().as_str()])
    }

    /// Certificate reloads of one TLS listener (`public`, `rls`, `ext_authz`, `forward_auth`,
    /// `admin`) with one result (`ok`, `error`), exported from now.
    pub fn tls_reloads(&self, listener: &str, result: &str) -> IntCounter {
        self.tls_reloads.with_label_values(&[listener, result])
    }

    /// Failed handshakes of one TLS listener for one reason (`timeout`, `error`).
    pub fn tls_handshake_failures(&self, listener: &str, reason: &str) -> IntCounter {
        self.tls_handshake_failures
            .with_label_values(&[listener, reason])
    }

    /// Connections shut down for abuse, for one reason (`cancelled_streams`, `rapid_reset`).
    pub fn goaways(&self, reason: &str) -> IntCounter {
        self.goaways.with_label_values(&[reason])
    }

    /// The decision counters of (`route`, `policy`), exported once registered or used.
    pub fn policy(&self, route: &str, policy: &str) -> PolicyMetrics {
        PolicyMetrics {
            metrics: self.clone(),
            route: route.into(),
            policy: policy.into(),
            quota: false,
            series: OnceLock::new(),
            usage: OnceLock::new(),
        }
    }

    /// The request counters of `route`, exported once registered or used.
    pub fn route(&self, route: &str) -> RouteMetrics {
        RouteMetrics {
            metrics: self.clone(),
            route: route.into(),
            series: OnceLock::new(),
        }
    }

    /// The series of one target of `upstream` (labels from the config only), at 0 from the start.
    pub fn target(&self, upstream: &str, target: &str) -> TargetMetrics {
        TargetMetrics {
            by_outcome: striped::Counters::new(
                TargetOutcome::ALL.map(|o| {
                    self.upstream_requests
                        .with_label_values(&[upstream, target, o.as_str()])
                }),
                &self.folds,
            ),
            ejections: self
                .upstream_ejections
                .with_label_values(&[upstream, target]),
            in_flight: striped::Gauge::new(
                self.upstream_in_flight
                    .with_label_values(&[upstream, target]),
                &self.folds,
            ),
        }
    }

    /// The Envoy rate limit service's counter families.
    pub fn rls(&self) -> &rls::RlsMetricVecs {
        &self.rls
    }

    /// The rate limit quota service's families.
    pub fn rlqs(&self) -> &rlqs::RlqsMetricVecs {
        &self.rlqs
    }

    /// The decision latency histogram of one store.
    pub fn decision_duration(&self, store: &str) -> striped::Observations {
        striped::Observations::new(
            &self.decision_duration.with_label_values(&[store]),
            &self.folds,
        )
    }

    /// Decisions of one store's engine answered by the deny cache.
    pub fn deny_cache_hits(&self, store: &str) -> IntCounter {
        self.deny_cache_hits.with_label_values(&[store])
    }

    pub fn store_error(&self, store: &str, kind: &str) -> IntCounter {
        self.store_errors.with_label_values(&[store, kind])
    }

    /// The series of the JWT key sources and the token cache, shared by every key ring.
    pub fn jwt_keys(&self) -> &crate::jwt::KeyMetrics {
        &self.jwt_keys
    }

    pub fn record_reload(&self, ok: bool) {
        self.config_reloads
            .with_label_values(&[if ok { "ok" } else { "error" }])
            .inc();
    }

    /// A gauge owned by the caller, registered here.
    pub fn gauge(&self, name: &str, help: &str) -> IntGauge {
        let gauge = IntGauge::new(name, help).unwrap_or_else(|e| panic!("metric {name}: {e}"));
        self.register(Box::new(gauge.clone()));
        gauge
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        self.folds.fold_all();
        let mut buf = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

impl std::ops::Deref for Metrics {
    type Target = Families;

    fn deref(&self) -> &Families {
        &self.0
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
