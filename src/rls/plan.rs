//! What each descriptor of a `ShouldRateLimit` asks, before anything is decided: per descriptor,
//! in request order, find the rule (or take Envoy's `limit` override) and name its counter, then
//! drop the rules that another rule of the request `replaces`. Pure lookups in the snapshot;
//! [`super::decide`] hands the result to the engine.

use std::borrow::Cow;

use super::ask::{Ask, AskDescriptor};
use super::decide::RlsError;
use super::metrics::RuleMetrics;
use super::rule::{write_entries_key, Algorithm, Entry, Unit};
use super::settings::{core_rule, RlsSnapshot};
use super::RlsResources;
use crate::limiter::Rule as CoreRule;

/// What one descriptor asks of the engine.
pub(crate) struct Limited<'a> {
    /// The config rule; `None` for Envoy's override.
    pub(crate) rule: Option<&'a super::rule::Rule>,
    pub(crate) key: String,
    pub(crate) core: CoreRule,
    pub(crate) requests_per_unit: u32,
    pub(crate) unit: Unit,
    pub(crate) shadow: bool,
    pub(crate) cost: u64,
    /// The end of the fixed window the counter belongs to, in epoch microseconds.
    pub(crate) fixed_end_us: Option<u64>,
    /// Borrowed from the snapshot's resources when the label needs no request value, so a call
    /// clones no counter handles (each clone is an atomic on a line every worker shares).
    pub(crate) metrics: Cow<'a, RuleMetrics>,
}

pub(crate) enum Plan<'a> {
    /// No rule (unknown domain, no match, whitelisted, replaced): OK without a limit.
    Free,
    Unlimited,
    Limited(Limited<'a>),
}

/// The plans of a request's descriptors, in order, `replaces` applied. An empty domain or
/// descriptor list is invalid, as in envoyproxy/ratelimit.
pub(crate) fn plan_request<'a>(
    rls: &'a RlsSnapshot,
    resources: &'a RlsResources,
    request: &Ask<'_>,
    now_us: u64,
) -> Result<Vec<Plan<'a>>, RlsError> {
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
    let mut plans = Vec::with_capacity(request.descriptors.len());
    for descriptor in &request.descriptors {
        plans.push(plan(
            rls,
            resources,
            request.domain,
            descriptor,
            request_hits,
            now_us,
        )?);
    }
    // `replaces`: a limit named by another limit of the same request does not apply.
    drop_replaced(&mut plans);
    Ok(plans)
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
    resources: &'a RlsResources,
    domain: &str,
    descriptor: &AskDescriptor<'_>,
    request_hits: u64,
    now_us: u64,
) -> Result<Plan<'a>, RlsError> {
    if !rls.tree.has_domain(domain) {
        return Ok(Plan::Free);
    }
    let entries: &[Entry<'_>] = &descriptor.entries;
    let cost = descriptor.hits_addend.unwrap_or(request_hits);
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
        write_entries_key(domain, entries, &mut key);
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
            metrics: Cow::Owned(resources.vecs.rule(domain, &override_label(entries))),
        }));
    }
    let Some((id, rule)) = rls.tree.lookup(domain, entries) else {
        return Ok(Plan::Free);
    };
    let Some(enforced) = rls.enforced(id) else {
        return Ok(Plan::Free);
    };
    let (Some(core), Some(unit)) = (enforced.core, rule.unit) else {
        return Ok(Plan::Unlimited);
    };
    rule.write_counter_key(entries, &mut key);
    let fixed_end_us = enforced.fixed_window_us.filter(|w| *w > 0).map(|w| {
        let index = now_us / w;
        key.push('|');
        key.push_str(&index.to_string());
        (index + 1).saturating_mul(w)
    });
    let metrics = match resources.rule(id) {
        Some(m) => Cow::Borrowed(m),
        None => Cow::Owned(
            resources
                .vecs
                .rule(domain, &rule.metric_descriptor(entries)),
        ),
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
