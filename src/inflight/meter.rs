//! Costs from token usage in the response body (`cost: {usage: ...}`, `docs/llm.md`): a
//! [`Meter`] taken right after admission reads the body as it streams to the client and settles
//! each policy once, when the body ends or when it is dropped (the client went away, the upstream
//! failed, the stream was cut), whichever comes first.
//!
//! Settling charges `total - min_cost` (the optimistic mode) or refunds `max_cost - total`
//! (`reserve: true`), where `total` is the weighted usage the body reported, else the fallback:
//! nothing a client or an upstream does leaves a reservation unsettled.

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use prometheus::{IntCounter, IntGauge};

use super::{most_charged, stamped, Taken};
use crate::config::usage::{UsageCost, UsageFormat};
use crate::config::{ResponseCost, Route};
use crate::limiter::{Check, Rule, Store};
use crate::metrics::UsageSeries;
use crate::proxy::body::Rider;
use crate::state::{AppState, RouteResources};
use crate::usage::{Framing, Reported, Scanner};

/// One policy's cost, waiting for the body's usage.
#[derive(Debug)]
struct Due {
    key: String,
    rule: Rule,
    cost: ResponseCost,
    /// What admission took: the reservation with `reserve`, else `min_cost`.
    taken: u64,
    /// What identifies admission's consumption, for the refund ([`crate::limiter::Decision`]).
    stamp: u64,
    reported: Reported,
    charged: IntCounter,
    series: UsageSeries,
}

impl Due {
    fn usage(&self) -> Option<&UsageCost> {
        self.cost.usage()
    }
}

/// The usage costs of one admitted request, settled exactly once.
#[derive(Debug)]
pub struct Meter {
    state: Arc<AppState>,
    due: Vec<Due>,
    /// Set when the response head arrives; none: no response (the upstream failed).
    scanner: Option<Scanner>,
    /// The response's status is 4xx or 5xx.
    error_status: bool,
    settled: bool,
}

impl Meter {
    /// The meter of `charges` ((key, rule, policy index) of each usage cost), reservations
    /// counted outstanding from now. Unless the store `decided` the admission, a reservation
    /// may not have been taken: nothing is refunded then (`docs/llm.md`, "When usage is missing").
    pub(super) fn new(
        state: &Arc<AppState>,
        route: &Route,
        resources: &RouteResources,
        charges: Vec<Taken>,
        decided: bool,
    ) -> Option<Meter> {
        let due: Vec<Due> = charges
            .into_iter()
            .filter_map(|t| {
                let Taken {
                    key,
                    rule,
                    policy: j,
                    units: taken,
                    stamp,
                } = t;
                let policy = route.policies.get(j)?;
                let metrics = resources.policies.get(j)?;
                let cost = policy.response_cost.clone()?;
                let series = metrics.usage().clone();
                let taken = if cost.reserve && !decided { 0 } else { taken };
                if cost.reserve {
                    series.reserved.add(gauge_units(taken));
                }
                Some(Due {
                    key,
                    rule,
                    cost,
                    taken,
                    stamp,
                    reported: Reported::default(),
                    charged: metrics.cost_charged().clone(),
                    series,
                })
            })
            .collect();
        (!due.is_empty()).then(|| Meter {
            state: state.clone(),
            due,
            scanner: None,
            error_status: false,
            settled: false,
        })
    }

    /// The response head arrived: how its body is framed, and whether it is an error.
    pub fn head(&mut self, status: StatusCode, headers: &HeaderMap) {
        self.error_status = status.is_client_error() || status.is_server_error();
        let framing = Framing::of(
            headers
                .get(http::header::CONTENT_TYPE)
                .map(|v| v.as_bytes()),
        );
        let max = self
            .due
            .iter()
            .filter_map(|d| d.usage().map(|u| u.max_body))
            .max()
            .unwrap_or(0);
        // The providers' formats name their counts `usage`; a pointer may point anywhere.
        let needle: Option<&'static [u8]> = self
            .due
            .iter()
            .all(|d| {
                d.usage()
                    .is_some_and(|u| !matches!(u.format, UsageFormat::Pointers(_)))
            })
            .then_some(b"\"usage\"");
        self.scanner = Some(Scanner::new(framing, max, needle));
    }

    /// The next chunk of the body, on its way to the client.
    pub fn feed(&mut self, bytes: &[u8]) {
        let Meter { scanner, due, .. } = self;
        if let Some(scanner) = scanner {
            scanner.feed(bytes, &mut |value| read_all(due, value));
        }
    }

    /// The body ended whole: a JSON body is read now, then every cost settled.
    pub fn finish(&mut self) {
        let Meter { scanner, due, .. } = self;
        if let Some(scanner) = scanner {
            scanner.finish(&mut |value| read_all(due, value));
        }
        self.settle();
    }

    /// Charges or refunds each cost, once: from the usage reported, else `min_cost` for an
    /// error status, else the fallback.
    pub fn settle(&mut self) {
        if std::mem::replace(&mut self.settled, true) {
            return;
        }
        let mut charges: Vec<(String, Rule, u64)> = Vec::new();
        let mut refunds: Vec<(String, Rule, u64, u64)> = Vec::new();
        let mut released: Vec<(IntGauge, i64)> = Vec::new();
        for due in &mut self.due {
            let (rc, weights) = match due.usage() {
                Some(usage) => (&due.cost, usage.weights),
                None => continue,
            };
            let reported = due.reported;
            let total = if reported.complete {
                let u = reported.usage;
                let cached = u.cached_input.min(u.input);
                let reasoning = u.reasoning.min(u.output);
                for (counter, n) in due.series.tokens.iter().zip([
                    u.input - cached,
                    cached,
                    u.output - reasoning,
                    reasoning,
                ]) {
                    counter.inc_by(n);
                }
                weights.cost(&u)
            } else {
                due.series.unreported.inc();
                if self.error_status {
                    rc.min_cost
                } else {
                    rc.fallback
                }
            };
            let total = rc.clamp(total).min(most_charged(rc, &due.rule));
            if rc.reserve {
                released.push((due.series.reserved.clone(), gauge_units(due.taken)));
                let back = due.taken.saturating_sub(total);
                // More than a reservation the body bounded (its bytes do not bound every
                // token): the rest is charged, as in the optimistic mode.
                let beyond = if due.taken > 0 {
                    total.saturating_sub(due.taken)
                } else {
                    0
                };
                if back > 0 {
                    due.series.refunded.inc_by(back);
                    refunds.push((std::mem::take(&mut due.key), due.rule, back, due.stamp));
                } else if beyond > 0 {
                    due.charged.inc_by(beyond);
                    charges.push((std::mem::take(&mut due.key), due.rule, beyond));
                }
            } else {
                let extra = total.saturating_sub(rc.min_cost);
                if extra > 0 {
                    due.charged.inc_by(extra);
                    charges.push((std::mem::take(&mut due.key), due.rule, extra));
                }
            }
        }
        apply(&self.state, charges, refunds, released);
    }
}

/// A meter rides on the response body ([`crate::proxy::body::ResponseBody::riding`]): it reads
/// each data frame, and settles when the body ends (a complete JSON body is read then) or, the
/// client gone, when it is dropped with the body.
impl Rider for Meter {
    fn data(&mut self, data: &Bytes) {
        self.feed(data);
    }

    fn ended(&mut self, complete: bool) {
        if complete {
            self.finish();
        } else {
            self.settle();
        }
    }
}

impl Drop for Meter {
    fn drop(&mut self) {
        self.settle();
    }
}

fn read_all(due: &mut [Due], value: &serde_json::Value) {
    for d in due.iter_mut() {
        if let Some(usage) = d.cost.usage() {
            d.reported.read(&usage.format, value);
        }
    }
}

fn gauge_units(units: u64) -> i64 {
    i64::try_from(units).unwrap_or(i64::MAX)
}

/// The charges and refunds in the store: in-process at once; on Redis in a spawned task, off the
/// client's path (a settlement that fails is logged: the reservation then stays taken, and a
/// charge is lost, as `docs/algorithms.md` says). The reservations leave `released` (the
/// outstanding gauge) once settled in the store.
fn apply(
    state: &Arc<AppState>,
    charges: Vec<(String, Rule, u64)>,
    refunds: Vec<(String, Rule, u64, u64)>,
    released: Vec<(IntGauge, i64)>,
) {
    let release = move || released.iter().for_each(|(g, n)| g.sub(*n));
    if charges.is_empty() && refunds.is_empty() {
        release();
        return;
    }
    if let Store::Memory(store) = state.engine.store() {
        store.charge(&checks(&charges));
        store.refund(&stamped(&refunds));
        release();
        return;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        release();
        return;
    };
    let state = state.clone();
    runtime.spawn(async move {
        if !charges.is_empty() {
            if let Err(error) = state.engine.charge(&checks(&charges)).await {
                tracing::warn!(%error, "charging a cost from the response failed");
            }
        }
        if !refunds.is_empty() {
            if let Err(error) = state.engine.refund(&stamped(&refunds)).await {
                tracing::warn!(%error, "refunding a reservation failed");
            }
        }
        release();
    });
}

fn checks(due: &[(String, Rule, u64)]) -> Vec<Check<'_>> {
    due.iter()
        .map(|(key, rule, cost)| Check {
            key,
            rule,
            cost: *cost,
            shadow: false,
            max_delay_us: None,
        })
        .collect()
}
