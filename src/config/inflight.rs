//! `concurrency:` and `cost: {response_header}` on a policy: the parts of [`super::policy`] for
//! requests in flight and costs known only from the response (`docs/algorithms.md`).

use std::time::Duration;

use http::{HeaderName, StatusCode};

use super::{parse_duration, Errors};
use crate::config::raw::{RawCost, RawPolicy};
use crate::config::snapshot::{Action, Policy, ResponseCost};
use crate::limiter::{Concurrency, Rule};

/// A lease outlives its request by at most this when the instance holding it dies.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(60);

/// The units taken at admission: the fixed `cost`, or a response cost's `min_cost` (default 1).
pub(super) fn admission_cost(raw: &RawPolicy) -> u64 {
    match &raw.cost {
        None => 1,
        Some(RawCost::Fixed(cost)) => *cost,
        Some(RawCost::Response(rc)) => rc.min_cost.unwrap_or(1),
    }
}

/// `concurrency: {limit, lease_ttl, refuse_with}` as the policy's rule.
pub(super) fn concurrency(e: &mut Errors, path: &str, raw: &RawPolicy) -> Option<Rule> {
    let cc = raw.concurrency.as_ref()?;
    if raw.token_bucket.is_some() || raw.sliding_window.is_some() {
        e.add(
            path,
            "give one of `token_bucket`, `sliding_window` or `concurrency`",
        );
        return None;
    }
    if raw.cost.is_some() {
        e.add(
            format!("{path}.cost"),
            "a concurrency policy counts requests in flight: each holds one lease, so `cost` \
             does not apply",
        );
    }
    if cc.limit == 0 {
        e.add(format!("{path}.concurrency.limit"), "must be at least 1");
    }
    if let Some(status) = cc.refuse_with {
        if status != 429 && status != 503 {
            e.add(
                format!("{path}.concurrency.refuse_with"),
                format!("`{status}`: must be 429 or 503"),
            );
        }
    }
    let ttl = match &cc.lease_ttl {
        None => Some(DEFAULT_LEASE_TTL),
        Some(text) => e.take(
            format!("{path}.concurrency.lease_ttl"),
            parse_duration(text),
        ),
    }?;
    let lease_ttl_us = ttl.as_micros() as u64;
    if lease_ttl_us < 1000 {
        e.add(
            format!("{path}.concurrency.lease_ttl"),
            "must be at least 1ms",
        );
        return None;
    }
    (cc.limit > 0).then_some(Rule::Concurrency(Concurrency {
        limit: cc.limit,
        lease_ttl_us,
    }))
}

/// The fields that only some kinds have: `refuse_with`, and a cost from the response (on a token
/// bucket or a sliding window only).
pub(super) fn finish(e: &mut Errors, path: &str, raw: &RawPolicy, policy: &mut Policy) {
    if let Some(cc) = &raw.concurrency {
        if cc.refuse_with == Some(503) {
            policy.refuse_with = StatusCode::SERVICE_UNAVAILABLE;
        }
    }
    let Some(RawCost::Response(rc)) = &raw.cost else {
        return;
    };
    let header = e.take(
        format!("{path}.cost.response_header"),
        HeaderName::from_bytes(rc.response_header.as_bytes())
            .map_err(|_| format!("`{}` is not a header name", rc.response_header)),
    );
    let limit = policy.rule.limit();
    let max_cost = rc.max_cost.unwrap_or(limit);
    if max_cost == 0 || max_cost > limit {
        e.add(
            format!("{path}.cost.max_cost"),
            format!("must be 1 to the burst or limit ({limit})"),
        );
    }
    let fallback = rc.fallback.unwrap_or(1);
    if max_cost < policy.cost {
        e.add(
            format!("{path}.cost.max_cost"),
            format!("{max_cost} is less than min_cost ({})", policy.cost),
        );
    }
    if let Some(header) = header {
        policy.response_cost = Some(ResponseCost {
            header,
            fallback,
            min_cost: policy.cost,
            max_cost,
        });
    }
}

/// A concurrency lease lives until the response ends, which only the inline gateway sees: on a
/// check-only route (decided by `forward_auth` alone) it could never be released.
pub(super) fn check_door(e: &mut Errors, path: &str, policy: &Policy, action: Option<&Action>) {
    if matches!(policy.rule, Rule::Concurrency(_)) && matches!(action, Some(Action::CheckOnly)) {
        e.add(
            format!("{path}.concurrency"),
            "a check-only route is decided by forward_auth, which never sees the response end: \
             concurrency needs `upstream` or `respond` (forward_auth does not apply concurrency \
             policies)",
        );
    }
    if policy.response_cost.is_some() && matches!(action, Some(Action::CheckOnly)) {
        e.add(
            format!("{path}.cost.response_header"),
            "a check-only route is decided by forward_auth, which never sees the response: \
             the cost can only be a number there",
        );
    }
}
