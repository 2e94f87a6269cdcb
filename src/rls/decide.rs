//! `ShouldRateLimit`, independent of the transport: the gRPC service and `POST /json` both call
//! [`RlsService::should_rate_limit`] with Envoy's request message and send back its response.
//!
//! Translation only. Per descriptor, in request order: find the rule (or Envoy's `limit`
//! override), drop rules that another rule of the request `replaces`, and turn the rest into
//! [`Checks`]. The [`crate::limiter::Engine`] decides them all at once (one Redis round trip),
//! merging descriptors that name the same counter, applying `rls.failure_mode` and counting the
//! per-rule statistics; its verdict becomes the descriptor statuses and the response headers.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit as PbLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as PbDuration;

use super::metrics::{CallResult, RuleMetrics};
use super::rule::{write_entries_key, Algorithm, Entry, Unit};
use super::settings::{core_rule, RlsResources, RlsSnapshot};
use crate::limiter::{Checks, Clock, Kind, Outcome, Rule as CoreRule, StoreError, Tally};
use crate::state::AppState;

/// Why a call got no rate-limit answer.
#[derive(Debug, thiserror::Error)]
pub enum RlsError {
    /// The request itself is wrong (gRPC `INVALID_ARGUMENT`, HTTP 400).
    #[error("{0}")]
    Invalid(String),
    /// The store failed and `failure_mode: error` lets Envoy decide (gRPC `UNAVAILABLE`).
    #[error("rate-limit store failed: {0}")]
    Store(#[from] crate::limiter::StoreError),
    /// The running config has no `rls:` block (it was removed by a reload).
    #[error("the rate limit service is not configured")]
    NotConfigured,
}

/// Wall-clock microseconds since the Unix epoch, never going backwards: fixed windows are
/// calendar-aligned, as in envoyproxy/ratelimit (a minute resets at :00).
#[derive(Debug, Default)]
pub struct SystemClock {
    last: AtomicU64,
}

impl Clock for SystemClock {
    fn now_us(&self) -> u64 {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
        self.last.fetch_max(now, Ordering::Relaxed).max(now)
    }
}

/// The Envoy rate limit service: the shared state's snapshot and engine, seen through Envoy's API.
#[derive(Debug, Clone)]
pub struct RlsService {
    pub state: Arc<AppState>,
    /// For fixed windows only; every other time is the store's.
    pub clock: Arc<dyn Clock>,
}

/// What one descriptor asks of the engine.
struct Limited<'a> {
    /// The config rule; `None` for Envoy's override.
    rule: Option<&'a super::rule::Rule>,
    key: String,
    core: CoreRule,
    requests_per_unit: u32,
    unit: Unit,
    shadow: bool,
    cost: u64,
    /// The end of the fixed window the counter belongs to, in epoch microseconds.
    fixed_end_us: Option<u64>,
    metrics: RuleMetrics,
}

enum Plan<'a> {
    /// No rule (unknown domain, no match, whitelisted, replaced): OK without a limit.
    Free,
    Unlimited,
    Limited(Limited<'a>),
}

impl RlsService {
    pub fn new(state: Arc<AppState>) -> Self {
        RlsService {
            state,
            clock: Arc::new(SystemClock::default()),
        }
    }

    /// Decides one request: counted once by how it ended, and answered as envoyproxy/ratelimit
    /// would.
    pub async fn should_rate_limit(
        &self,
        request: &RateLimitRequest,
    ) -> Result<RateLimitResponse, RlsError> {
        let live = self.state.live.load_full();
        let (Some(rls), Some(resources)) = (live.config.rls.as_ref(), live.rls.as_ref()) else {
            return Err(RlsError::NotConfigured);
        };
        let result = self.decide(rls, resources, request).await;
        resources.vecs.record_call(match &result {
            Ok((_, Kind::FailedOpen)) => CallResult::FailedOpen,
            Ok((_, Kind::FailedClosed)) => CallResult::FailedClosed,
            Ok((r, _)) if r.overall_code == Code::OverLimit as i32 => CallResult::OverLimit,
            Ok(_) => CallResult::Ok,
            Err(RlsError::Invalid(_)) => CallResult::Invalid,
            Err(_) => CallResult::Error,
        });
        result.map(|(response, _)| response)
    }

    /// The request's descriptors as engine checks, and the verdict as Envoy's response.
    async fn decide(
        &self,
        rls: &RlsSnapshot,
        resources: &RlsResources,
        request: &RateLimitRequest,
    ) -> Result<(RateLimitResponse, Kind), RlsError> {
        if request.domain.is_empty() {
            return Err(RlsError::Invalid(
                "rate limit domain must not be empty".into(),
            ));
        }
        if request.descriptors.is_empty() {
            return Err(RlsError::Invalid(
                "rate limit descriptor list must not be empty".into(),
            ));
        }
        let request_hits = u64::from(request.hits_addend.max(1));
        let now_us = self.clock.now_us();
        let mut plans = Vec::with_capacity(request.descriptors.len());
        for descriptor in &request.descriptors {
            plans.push(plan(
                rls,
                resources,
                &request.domain,
                descriptor,
                request_hits,
                now_us,
            )?);
        }
        // `replaces`: a limit named by another limit of the same request does not apply.
        drop_replaced(&mut plans);

        // One check per limited descriptor, in order (the engine merges repeated counters).
        let mut checks = Checks::with_capacity(plans.len());
        for plan in &plans {
            if let Plan::Limited(l) = plan {
                let tally = Tally::Descriptor(&l.metrics);
                checks.push(l.key.as_str(), &l.core, l.cost, l.shadow, tally);
            }
        }
        let verdict = self.state.engine.decide(checks, rls.failure_mode).await;
        let governing = verdict.governing().map(|(i, _)| i);
        let mut check = 0;
        let mut governing_status = None;
        let statuses = plans
            .iter()
            .enumerate()
            .map(|(n, plan)| {
                let Plan::Limited(l) = plan else {
                    return free_status(plan);
                };
                if governing == Some(check) {
                    governing_status = Some(n);
                }
                check += 1;
                match (verdict.kind, verdict.outcome(check - 1)) {
                    (Kind::FailedClosed, _) => DescriptorStatus {
                        code: Code::OverLimit as i32,
                        current_limit: Some(current_limit(l)),
                        ..Default::default()
                    },
                    (_, Some(outcome)) => status(l, outcome, now_us),
                    // Failed open: OK, as if unlimited for this call.
                    (_, None) => DescriptorStatus {
                        code: Code::Ok as i32,
                        ..Default::default()
                    },
                }
            })
            .collect();
        if verdict.kind == Kind::Failed {
            let error = verdict.into_error().unwrap_or(StoreError::CircuitOpen);
            return Err(RlsError::Store(error));
        }
        Ok((respond(rls, statuses, governing_status), verdict.kind))
    }
}

/// The status of a descriptor the engine did not check.
fn free_status(plan: &Plan<'_>) -> DescriptorStatus {
    DescriptorStatus {
        code: Code::Ok as i32,
        limit_remaining: if matches!(plan, Plan::Unlimited) {
            u32::MAX
        } else {
            0
        },
        ..Default::default()
    }
}

fn rule_of<'a>(plan: &Plan<'a>) -> Option<&'a super::rule::Rule> {
    match plan {
        Plan::Limited(l) => l.rule,
        _ => None,
    }
}

fn drop_replaced(plans: &mut [Plan<'_>]) {
    let rule = rule_of;
    let replaced: Vec<Box<str>> = plans
        .iter()
        .filter_map(rule)
        .flat_map(|r| r.replaces.iter().cloned())
        .collect();
    if replaced.is_empty() {
        return;
    }
    for plan in plans.iter_mut() {
        let name = rule(plan).and_then(|r| r.name.as_deref());
        if name.is_some_and(|n| replaced.iter().any(|r| &**r == n)) {
            *plan = Plan::Free;
        }
    }
}

/// Finds the rule of one descriptor (or takes Envoy's override) and names its counter.
fn plan<'a>(
    rls: &'a RlsSnapshot,
    resources: &RlsResources,
    domain: &str,
    descriptor: &RateLimitDescriptor,
    request_hits: u64,
    now_us: u64,
) -> Result<Plan<'a>, RlsError> {
    if !rls.tree.has_domain(domain) {
        return Ok(Plan::Free);
    }
    let entries: Vec<Entry<'_>> = descriptor
        .entries
        .iter()
        .map(|e| (e.key.as_str(), e.value.as_str()))
        .collect();
    let cost = descriptor.hits_addend.map_or(request_hits, |h| h.value);
    let mut key = String::with_capacity(64);
    key.push_str("rls|");
    if let Some(over) = &descriptor.limit {
        // Envoy's per-route override: never shadowed, named by the request's values.
        let Some(unit) = Unit::from_proto(over.unit) else {
            return Err(RlsError::Invalid(format!(
                "descriptor limit has an unknown unit ({})",
                over.unit
            )));
        };
        let algorithm = Algorithm::SlidingWindow {
            limit: over.requests_per_unit,
            window: unit.duration(),
        };
        let (Some(core), _) = core_rule(&algorithm) else {
            return Ok(Plan::Free);
        };
        // Its own namespace (`rls|=|`): an override never shares state with a config rule.
        key.push_str("=|");
        write_entries_key(domain, &entries, &mut key);
        key.push('|');
        key.push_str(unit.name());
        return Ok(Plan::Limited(Limited {
            rule: None,
            key,
            core,
            requests_per_unit: over.requests_per_unit,
            unit,
            shadow: false,
            cost,
            fixed_end_us: None,
            metrics: resources.vecs.rule(domain, &override_label(&entries)),
        }));
    }
    let Some((id, rule)) = rls.tree.lookup(domain, &entries) else {
        return Ok(Plan::Free);
    };
    let Some(enforced) = rls.enforced(id) else {
        return Ok(Plan::Free);
    };
    let (Some(core), Some(unit)) = (enforced.core, rule.unit) else {
        return Ok(Plan::Unlimited);
    };
    rule.write_counter_key(&entries, &mut key);
    let fixed_end_us = enforced.fixed_window_us.filter(|w| *w > 0).map(|w| {
        let index = now_us / w;
        key.push('|');
        key.push_str(&index.to_string());
        (index + 1).saturating_mul(w)
    });
    let metrics = match resources.rule(id) {
        Some(m) => m.clone(),
        None => resources
            .vecs
            .rule(domain, &rule.metric_descriptor(&entries)),
    };
    Ok(Plan::Limited(Limited {
        rule: Some(rule),
        key,
        core,
        requests_per_unit: rule.requests_per_unit,
        unit,
        shadow: rule.shadow_mode,
        cost,
        fixed_end_us,
        metrics,
    }))
}

fn current_limit(l: &Limited<'_>) -> PbLimit {
    PbLimit {
        name: l
            .rule
            .and_then(|r| r.name.as_deref())
            .unwrap_or_default()
            .to_owned(),
        requests_per_unit: l.requests_per_unit,
        unit: l.unit.proto(),
    }
}

/// The status of one checked descriptor.
fn status(l: &Limited<'_>, outcome: &Outcome, now_us: u64) -> DescriptorStatus {
    let over = !outcome.allowed;
    let until_reset_us = match l.fixed_end_us {
        Some(end) => end.saturating_sub(now_us),
        None if over => outcome.retry_after_us,
        None => outcome.reset_us,
    };
    DescriptorStatus {
        code: if over && !l.shadow {
            Code::OverLimit as i32
        } else {
            Code::Ok as i32
        },
        current_limit: Some(current_limit(l)),
        limit_remaining: if over { 0 } else { remaining(outcome) },
        duration_until_reset: Some(duration(until_reset_us)),
        quota: None,
    }
}

fn remaining(outcome: &Outcome) -> u32 {
    u32::try_from(outcome.remaining).unwrap_or(u32::MAX)
}

fn duration(us: u64) -> PbDuration {
    PbDuration {
        seconds: i64::try_from(us / 1_000_000).unwrap_or(i64::MAX),
        nanos: ((us % 1_000_000) * 1_000) as i32,
    }
}

/// The overall code, and with `response_headers` the RateLimit-* headers of the status the engine
/// chose to govern (`docs/algorithms.md`); none when the store failed.
fn respond(
    rls: &RlsSnapshot,
    statuses: Vec<DescriptorStatus>,
    governing: Option<usize>,
) -> RateLimitResponse {
    let over = statuses.iter().any(|s| s.code == Code::OverLimit as i32);
    let mut response = RateLimitResponse {
        overall_code: if over { Code::OverLimit } else { Code::Ok } as i32,
        ..Default::default()
    };
    if let Some(s) = governing
        .filter(|_| rls.response_headers)
        .map(|i| &statuses[i])
    {
        let reset = s
            .duration_until_reset
            .as_ref()
            .map_or(0, |d| d.seconds + i64::from(d.nanos > 0));
        let limit = s.current_limit.as_ref().map_or(0, |l| l.requests_per_unit);
        let header = |key: &str, value: String| HeaderValue {
            key: key.to_owned(),
            value,
            raw_value: Vec::new(),
        };
        response.response_headers_to_add = vec![
            header("RateLimit-Limit", limit.to_string()),
            header("RateLimit-Remaining", s.limit_remaining.to_string()),
            header("RateLimit-Reset", reset.to_string()),
        ];
    }
    response.statuses = statuses;
    response
}

/// envoyproxy/ratelimit's stats key of an override: every entry with its value.
fn override_label(entries: &[Entry<'_>]) -> String {
    let mut label = String::new();
    for (i, (k, v)) in entries.iter().enumerate() {
        if i > 0 {
            label.push('.');
        }
        label.push_str(k);
        if !v.is_empty() {
            label.push('_');
            label.push_str(v);
        }
    }
    label
}
