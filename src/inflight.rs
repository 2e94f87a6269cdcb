//! After admission, for the inline gateway: concurrency leases held until the response ends, and
//! costs charged when the response head arrives (`docs/algorithms.md`, "Concurrency" and "Cost
//! from the response").
//!
//! A lease is a [`LeaseGuard`]: taken from [`AfterAdmission::lease`] right after the decision, it
//! lives in the request's future and then in the response body ([`ResponseBody::riding`]), so it is released
//! when the body ends, when the client goes away (hyper drops the body or the future), and when
//! the request fails after admission (the guard is dropped with the error). Release is one more
//! store call (Redis: spawned, off the client's path); a release that never happens (a crash) is
//! bounded by the lease TTL.
//!
//! A cost from token usage in the body is a [`Meter`] (`meter.rs`), which rides on the response
//! body too: it reads each data frame going by and settles when the body ends or is dropped.

mod meter;

pub use meter::Meter;

use std::sync::Arc;
use std::time::Duration;

use http::HeaderMap;
use prometheus::{IntCounter, IntGauge};

use crate::config::{ResponseCost, Route};
use crate::limiter::leases::LocalSlots;
use crate::limiter::{Check, Rule, Store, Verdict};
use crate::proxy::body::{ResponseBody, Rider};
use crate::state::{AppState, RouteResources};

/// What the inline gateway owes an admitted request: the lease its concurrency policies hold and
/// the policies whose cost comes from the response.
#[derive(Debug, Default)]
pub struct AfterAdmission {
    /// The lease the store granted.
    lease: Option<u64>,
    /// Admitted by the local fallback (the store could not decide): the lease id the store may
    /// have taken anyway, released when the request ends.
    unconfirmed: Option<u64>,
    /// This instance's count of the concurrency keys (a shared store): held until the request ends.
    local: Option<LocalSlots>,
    /// (counter key, rule) of each concurrency check holding `lease` or `local`.
    leased: Vec<(String, Rule)>,
    /// What admission took for each cost from the response.
    charges: Vec<Taken>,
    /// The store decided (and so took what admission asked): a request admitted because the
    /// store failed may have taken nothing, so its reservations are never refunded.
    decided: bool,
}

impl AfterAdmission {
    /// From an admitting `verdict`: `later` pairs the index each check was pushed at with its
    /// policy's index in `route` and the units it took.
    pub(crate) fn new(
        route: &Route,
        verdict: &mut Verdict<'_>,
        later: &[(usize, usize, u64)],
    ) -> Self {
        let mut after = AfterAdmission {
            lease: verdict.lease(),
            unconfirmed: verdict.unconfirmed_lease(),
            local: verdict.take_local(),
            decided: verdict.kind == crate::limiter::Kind::Allowed,
            ..AfterAdmission::default()
        };
        for &(i, j, taken) in later {
            let Some(policy) = route.policies.get(j) else {
                continue;
            };
            // The rule the decision used for this key (a per-key override's, say), not the
            // policy's: the charge and the lease act on the counter as admission found it.
            let Some(&rule) = verdict.rule(i) else {
                continue;
            };
            let key = verdict.key(i).to_string();
            if matches!(rule, Rule::Concurrency(_)) {
                if after.lease.is_some() || after.local.is_some() {
                    after.leased.push((key, rule));
                }
            } else if policy.response_cost.is_some() {
                after.charges.push(Taken {
                    key,
                    rule,
                    policy: j,
                    units: taken,
                    stamp: verdict.stamp(i),
                });
            }
        }
        after
    }

    /// A lease handed to the request after a wait (`admission::wait_for_lease`): `lease` on
    /// `key` under `rule`, held with the leases its decision took (under that same id,
    /// `Checks::hold_lease`), counted on this instance like them.
    pub(crate) fn hold_handed(
        &mut self,
        engine: &crate::limiter::Engine,
        lease: u64,
        key: String,
        rule: Rule,
    ) {
        self.lease = Some(lease);
        match &mut self.local {
            Some(slots) => {
                slots.take(&key, None);
            }
            None => {
                self.local = engine.local_slots().map(|mut slots| {
                    slots.take(&key, None);
                    slots
                });
            }
        }
        self.leased.push((key, rule));
    }

    /// The guard of this request's lease (from the store, or the local fallback's slots),
    /// counted in `in_flight` until it is released.
    pub fn lease(&mut self, state: &Arc<AppState>, in_flight: &IntGauge) -> Option<LeaseGuard> {
        if self.leased.is_empty() {
            return None;
        }
        let local = self.local.take();
        // Renewed only when the store granted it; a fallback's slot is this instance's alone,
        // and the lease the store may have taken anyway is released, never renewed.
        let (lease, renewing) = match (self.lease, &local) {
            (Some(lease), _) => (lease, Some(renew_while_held(state, &self.leased, lease))),
            (None, Some(_)) => (self.unconfirmed.unwrap_or(0), None),
            (None, None) => return None,
        };
        in_flight.inc();
        Some(LeaseGuard {
            renewing,
            state: state.clone(),
            lease,
            leased: std::mem::take(&mut self.leased),
            local,
            in_flight: in_flight.clone(),
            released: false,
        })
    }

    /// Whether [`charge`](Self::charge) or a [`Meter`] reads the response's fields: a policy of
    /// the request charges a cost from the response.
    pub fn reads_response(&self) -> bool {
        !self.charges.is_empty()
    }

    /// The meter of the request's costs from token usage in the body (taken out of this), to be
    /// told the response head and fed its body; settled at the latest when dropped.
    pub fn meter(
        &mut self,
        state: &Arc<AppState>,
        route: &Route,
        resources: &RouteResources,
    ) -> Option<Meter> {
        let is_usage = |j: usize| {
            route
                .policies
                .get(j)
                .and_then(|p| p.response_cost.as_ref())
                .is_some_and(|rc| rc.usage().is_some())
        };
        if !self.charges.iter().any(|t| is_usage(t.policy)) {
            return None;
        }
        let (usage, header): (Vec<_>, Vec<_>) = std::mem::take(&mut self.charges)
            .into_iter()
            .partition(|t| is_usage(t.policy));
        self.charges = header;
        Meter::new(state, route, resources, usage, self.decided)
    }

    /// Charges each cost from a response header now that the head is here: the header's amount
    /// (or the fallback) less the `min_cost` admission took, or with `reserve` the `max_cost`
    /// admission took less that amount refunded. In-process at once; on Redis in a spawned task,
    /// so the client's response is not held up by the extra round trip.
    pub fn charge(
        &self,
        state: &Arc<AppState>,
        route: &Route,
        resources: &RouteResources,
        headers: &HeaderMap,
    ) {
        let mut due: Vec<(String, Rule, u64, IntCounter)> = Vec::new();
        let mut refunds: Vec<(String, Rule, u64, u64)> = Vec::new();
        for Taken {
            key,
            rule,
            policy: j,
            units: taken,
            stamp,
        } in &self.charges
        {
            let (Some(policy), Some(metrics)) =
                (route.policies.get(*j), resources.policies.get(*j))
            else {
                continue;
            };
            let Some(rc) = &policy.response_cost else {
                continue;
            };
            let Some(header) = rc.header() else {
                continue;
            };
            let total = rc.total(headers.get(header)).min(most_charged(rc, rule));
            if rc.reserve && !self.decided {
                continue;
            }
            if rc.reserve {
                let back = taken.saturating_sub(total);
                if back > 0 {
                    refunds.push((key.clone(), *rule, back, *stamp));
                }
                continue;
            }
            let extra = total.saturating_sub(rc.min_cost);
            if extra > 0 {
                due.push((key.clone(), *rule, extra, metrics.cost_charged().clone()));
            }
        }
        if due.is_empty() && refunds.is_empty() {
            return;
        }
        if let Store::Memory(store) = state.engine.store() {
            store.charge(&checks(&due));
            store.refund(&stamped(&refunds));
            due.iter().for_each(|(_, _, extra, c)| c.inc_by(*extra));
            return;
        }
        let state = state.clone();
        tokio::spawn(async move {
            if !refunds.is_empty() {
                if let Err(error) = state.engine.refund(&stamped(&refunds)).await {
                    tracing::warn!(%error, "refunding a reservation failed");
                }
            }
            if due.is_empty() {
                return;
            }
            match state.engine.charge(&checks(&due)).await {
                Ok(()) => due.iter().for_each(|(_, _, extra, c)| c.inc_by(*extra)),
                Err(error) => tracing::warn!(%error, "charging a cost from the response failed"),
            }
        });
    }
}

/// The most one request is charged on a counter decided under `rule`: `max_cost`, and never more
/// than that rule's capacity (its burst or limit), which a per-key override may set below the
/// policy's; never less than `min_cost`, which admission took already.
pub(crate) fn most_charged(rc: &ResponseCost, rule: &Rule) -> u64 {
    rc.max_cost.min(rule.limit()).max(rc.min_cost)
}

/// Renews the lease every half of its (shortest) TTL until aborted by the guard's release, so a
/// request running longer than `lease_ttl` keeps counting; only a dead instance stops renewing.
fn renew_while_held(
    state: &Arc<AppState>,
    leased: &[(String, Rule)],
    lease: u64,
) -> tokio::task::JoinHandle<()> {
    let ttl_us = leased
        .iter()
        .filter_map(|(_, rule)| match rule {
            Rule::Concurrency(cc) => Some(cc.lease_ttl_us),
            _ => None,
        })
        .min()
        .unwrap_or(u64::MAX / 4);
    let period = Duration::from_micros((ttl_us / 2).max(500));
    let due: Vec<(String, Rule, u64, ())> =
        leased.iter().map(|(k, r)| (k.clone(), *r, 1, ())).collect();
    let state = state.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        loop {
            tick.tick().await;
            if let Err(error) = state.engine.store().renew(&checks(&due), lease).await {
                tracing::debug!(%error, "renewing a concurrency lease failed");
            }
        }
    })
}

/// What admission took for one cost from the response: the counter and the rule it was decided
/// under, the policy's index in the route, the units, and the stamp a refund of them names.
#[derive(Debug)]
pub(crate) struct Taken {
    pub key: String,
    pub rule: Rule,
    pub policy: usize,
    pub units: u64,
    pub stamp: u64,
}

/// Refunds of (key, rule, units, stamp), as the store takes them.
fn stamped(due: &[(String, Rule, u64, u64)]) -> Vec<(Check<'_>, u64)> {
    due.iter()
        .map(|(key, rule, cost, stamp)| {
            let check = Check {
                key,
                rule,
                cost: *cost,
                shadow: false,
                max_delay_us: None,
            };
            (check, *stamp)
        })
        .collect()
}

fn checks<'a, T>(due: &'a [(String, Rule, u64, T)]) -> Vec<Check<'a>> {
    due.iter()
        .map(|(key, rule, cost, _)| Check {
            key,
            rule,
            cost: *cost,
            shadow: false,
            max_delay_us: None,
        })
        .collect()
}

/// A held concurrency lease; released once, on [`LeaseGuard::release`] or on drop.
#[derive(Debug)]
pub struct LeaseGuard {
    state: Arc<AppState>,
    /// The store's lease id to release (0: none).
    lease: u64,
    leased: Vec<(String, Rule)>,
    /// This instance's count of the keys, given back on release.
    local: Option<LocalSlots>,
    in_flight: IntGauge,
    released: bool,
    /// The task renewing the lease while the request runs.
    renewing: Option<tokio::task::JoinHandle<()>>,
}

impl LeaseGuard {
    /// Gives the lease back: in-process at once, on Redis in a spawned task.
    pub fn release(&mut self) {
        if std::mem::replace(&mut self.released, true) {
            return;
        }
        self.in_flight.dec();
        if let Some(renewing) = self.renewing.take() {
            renewing.abort();
        }
        drop(self.local.take());
        let leased = std::mem::take(&mut self.leased);
        let lease = self.lease;
        if lease == 0 {
            return;
        }
        let to_checks = |leased: &[(String, Rule)]| -> Vec<(String, Rule, u64, ())> {
            leased.iter().map(|(k, r)| (k.clone(), *r, 1, ())).collect()
        };
        if let Store::Memory(store) = self.state.engine.store() {
            let _handed = store.release(&checks(&to_checks(&leased)), lease);
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime (shutdown): the lease expires by its TTL.
            return;
        };
        let state = self.state.clone();
        runtime.spawn(async move {
            let due = to_checks(&leased);
            state.engine.release(&checks(&due), lease).await;
        });
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        self.release();
    }
}

/// A lease rides on the response body ([`ResponseBody::riding`]): given back when the body
/// ends, or dropped with it when the client goes away.
impl Rider for LeaseGuard {
    fn ended(&mut self, _complete: bool) {
        self.release();
    }
}

/// The response for `refusal` on `route`: a concurrency policy's refusal carries its
/// `refuse_with` status (503 if so configured; 429 and its headers otherwise).
pub fn refusal(
    route: &Route,
    refusal: &crate::respond::Refusal<'_>,
    request_id: Option<&http::HeaderValue>,
) -> http::Response<ResponseBody> {
    let mut response = crate::respond::refusal_for(refusal, request_id);
    if let crate::respond::Refusal::RateLimited { policy, .. } = refusal {
        let status = route
            .policies
            .iter()
            .find(|p| &*p.name == *policy)
            .map(|p| p.refuse_with);
        if let Some(status) = status.filter(|s| *s != http::StatusCode::TOO_MANY_REQUESTS) {
            *response.status_mut() = status;
        }
    }
    response
}
