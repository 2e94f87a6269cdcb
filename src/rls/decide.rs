//! `ShouldRateLimit`, independent of the transport: the gRPC service and `POST /json` both call
//! [`RlsService::should_rate_limit`] with Envoy's request message and send back its response.
//!
//! Translation only: the descriptors' plans ([`super::plan`]: which rule, which counter) become
//! [`Checks`]; the [`crate::limiter::Engine`] decides them all at once (one Redis round trip),
//! merging descriptors that name the same counter, applying `rls.failure_mode` and counting the
//! per-rule statistics; its verdict becomes the descriptor statuses and the response headers.

use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit as PbLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as PbDuration;

use super::ask::Ask;
use super::metrics::CallResult;
use super::plan::{plan_request, Limited, Plan};
use super::settings::RlsSnapshot;
use super::RlsResources;
use crate::access_log::{Decided, Decision, Door, Record};
use crate::limiter::{Checks, Clock, Kind, Outcome, StoreError, SystemClock, Tally};
use crate::state::AppState;

/// Why a call got no rate-limit answer.
/// The server span of one call (OpenTelemetry's RPC span name: `service/method`).
const RLS_SPAN: &str = "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

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

/// The Envoy rate limit service: the shared state's snapshot and engine, seen through Envoy's API.
#[derive(Debug, Clone)]
pub struct RlsService {
    pub state: Arc<AppState>,
    /// For fixed windows only; every other time is the store's.
    pub clock: Arc<dyn Clock>,
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
        self.answer(&Ask::of(request), None).await
    }

    /// [`Self::should_rate_limit`] on the request's fields, however they were read; the call's
    /// server span continues `traceparent` (its gRPC metadata) when tracing is on.
    pub(crate) async fn answer(
        &self,
        request: &Ask<'_>,
        traceparent: Option<&str>,
    ) -> Result<RateLimitResponse, RlsError> {
        let live = self.state.live.load();
        let (Some(rls), Some(resources)) = (live.config.rls.as_ref(), live.rls.as_ref()) else {
            return Err(RlsError::NotConfigured);
        };
        let log = &self.state.access_log;
        let mut record = log
            .is_on()
            .then(|| Box::new(Record::new(Door::Rls, std::time::SystemTime::now())));
        let mut trace = self.state.tracing.begin_from(traceparent, RLS_SPAN);
        if let Some(trace) = &mut trace {
            trace.server_attributes([
                opentelemetry::KeyValue::new("rpc.system", "grpc"),
                opentelemetry::KeyValue::new(
                    "rpc.service",
                    "envoy.service.ratelimit.v3.RateLimitService",
                ),
                opentelemetry::KeyValue::new("rpc.method", "ShouldRateLimit"),
            ]);
            trace.begin_decision();
            if let Some(record) = &mut record {
                record.trace_id = Some(trace.trace_id());
            }
        }
        let started = crate::now::read();
        let note = match (&mut record, &mut trace) {
            (Some(record), _) => Some(&mut record.decided),
            (None, Some(trace)) => Some(&mut trace.decided),
            (None, None) => None,
        };
        let result = self.decide(rls, resources, request, note).await;
        let (status, decision) = match &result {
            Ok((_, Kind::FailedOpen)) => (200, Decision::FailedOpen),
            Ok((_, Kind::FailedClosed)) => (429, Decision::FailedClosed),
            Ok((r, _)) if r.overall_code == Code::OverLimit as i32 => (429, Decision::Limited),
            Ok(_) => (200, Decision::Allowed),
            Err(RlsError::Invalid(_)) => (400, Decision::None),
            Err(_) => (503, Decision::FailedClosed),
        };
        if let Some(mut trace) = trace {
            let mut decided = match &record {
                Some(record) => record.decided.clone(),
                None => std::mem::take(&mut trace.decided),
            };
            decided.decision = decision;
            decided.route = Some(Arc::from(request.domain));
            trace.end_decision(&decided);
            trace.finish(status);
        }
        if let Some(mut record) = record {
            if log.wants(status != 200) {
                record.status = status;
                record.decided.decision = decision;
                record.decided.route = Some(Arc::from(request.domain));
                record.duration = crate::now::read().saturating_duration_since(started);
                log.submit(record);
            }
        }
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
        request: &Ask<'_>,
        note: Option<&mut Decided>,
    ) -> Result<(RateLimitResponse, Kind), RlsError> {
        let now_us = self.clock.now_us();
        let plans = plan_request(rls, resources, request, now_us)?;

        // One check per limited descriptor, in order (the engine merges repeated counters).
        let mut checks = Checks::with_capacity(plans.len());
        for plan in &plans {
            if let Plan::Limited(l) = plan {
                let quota = quota_mode(l);
                let tally = Tally::Descriptor {
                    stats: &l.metrics,
                    shadow: l.shadow,
                    quota,
                };
                // A quota descriptor over its limit does not stop the others: `respond` decides
                // the overall code from all of them.
                let shadow = l.shadow || quota;
                checks.push(l.key.as_str(), &l.core, l.cost, shadow, tally);
            }
        }
        let store_began = note.is_some().then(std::time::SystemTime::now);
        let verdict = self.state.engine.decide(checks, rls.failure_mode).await;
        let governing = verdict.governing().map(|(i, _)| i);
        if let Some(note) = note {
            note.store_call = store_began.map(|began| (began, std::time::SystemTime::now()));
            note.key = governing.map(|i| verdict.key(i).to_string());
        }
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
        let mut response = respond(rls, statuses, &plans, governing_status);
        if rls.response_dynamic_metadata {
            response.dynamic_metadata = Some(super::metadata::response_metadata(
                request,
                &plans,
                &response.statuses,
            ));
        }
        Ok((response, verdict.kind))
    }
}

fn quota_mode(l: &Limited<'_>) -> bool {
    l.rule.is_some_and(|r| r.quota_mode)
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
/// As envoyproxy/ratelimit: OVER_LIMIT when a descriptor not in `quota_mode` is over, or when
/// there are quota descriptors and every one of them is over.
fn respond(
    rls: &RlsSnapshot,
    statuses: Vec<DescriptorStatus>,
    plans: &[Plan<'_>],
    governing: Option<usize>,
) -> RateLimitResponse {
    let is_over = |s: &DescriptorStatus| s.code == Code::OverLimit as i32;
    let quota = || {
        plans
            .iter()
            .map(|p| matches!(p, Plan::Limited(l) if quota_mode(l)))
    };
    let limit_over = statuses.iter().zip(quota()).any(|(s, q)| !q && is_over(s));
    let quotas = quota().filter(|q| *q).count();
    let quotas_over = statuses
        .iter()
        .zip(quota())
        .filter(|(s, q)| *q && is_over(s))
        .count();
    let over = limit_over || (quotas > 0 && quotas_over == quotas);
    let mut response = RateLimitResponse {
        overall_code: if over { Code::OverLimit } else { Code::Ok } as i32,
        ..Default::default()
    };
    if let Some(s) = governing
        .filter(|_| rls.response_headers)
        .map(|i| &statuses[i])
    {
        let reset_us = s.duration_until_reset.as_ref().map_or(0, |d| {
            u64::try_from(d.seconds)
                .unwrap_or(0)
                .saturating_mul(1_000_000)
                .saturating_add(u64::try_from(d.nanos).unwrap_or(0).div_ceil(1_000))
        });
        let limit = s.current_limit.as_ref().map_or(0, |l| l.requests_per_unit);
        let fields = crate::rate_limit_headers::draft03(
            u64::from(limit),
            u64::from(s.limit_remaining),
            reset_us,
        );
        response.response_headers_to_add = fields
            .into_iter()
            .map(|(key, value)| HeaderValue {
                key: key.to_owned(),
                value,
                raw_value: Vec::new(),
            })
            .collect();
    }
    response.statuses = statuses;
    response
}
