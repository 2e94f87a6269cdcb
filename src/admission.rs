//! Admission: routing a canonical request and asking the engine about its keys, shared by every
//! door that decides HTTP requests (the inline gateway, forward-auth, Envoy ext_authz), so each
//! one answers exactly what the gateway would for the same request.
//!
//! A door canonicalizes the request ([`crate::normalize`]), finds its route ([`route_for`]) and
//! admits it ([`admit`]); [`check`] does all three for the doors that only decide.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderValue, Request};

use crate::access_log::{Decided, Decision};
use crate::config::Route;
use crate::inflight::AfterAdmission;
use crate::keys::RequestView;
use crate::limiter::{Checks, FailureMode, Kind, Outcome, Reservation, Rule, Tally};
use crate::metrics::{DecisionLabel, RouteMetrics};
use crate::normalize;
use crate::respond::headers::MAX_POLICIES;
use crate::respond::{Limits, Refusal};
use crate::route::{Found, RequestHead};
use crate::state::{AppState, Live, RouteResources};

/// An admitted request: the outcome whose headers decorate the answer (none when no enforced
/// policy applied or the store failed open), and how the engine decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admitted {
    pub governing: Option<Outcome>,
    pub kind: Kind,
    /// What the route's rate-limit fields show (`rate_limit_headers`).
    pub limits: Limits,
}

/// How `head` is routed on `live`'s route table: the first route matching it (by index into
/// `live.config.routes`, with its path params), else whether some match it but for the method.
pub fn route_for(live: &Live, head: &RequestHead<'_>) -> Found {
    live.table.find(&live.config.routes, head)
}

/// After [`Found::OtherMethods`], the `Allow` value of the 405 (RFC 9110 §15.5.6): the methods of
/// the routes that match `head` but for its method, in config order, each once (§10.2.1).
pub fn allowed_methods(live: &Live, head: &RequestHead<'_>, from: usize) -> Option<HeaderValue> {
    let methods = live.table.allowed_methods(&live.config.routes, head, from);
    let mut allow = String::new();
    for method in methods {
        if !allow.is_empty() {
            allow.push_str(", ");
        }
        allow.push_str(method.as_str());
    }
    if allow.is_empty() {
        return None;
    }
    HeaderValue::from_str(&allow).ok()
}

/// The policies whose key parts are all present, decided together by the engine, for a door that
/// never sees the response (forward-auth, ext_authz): concurrency policies do not apply there,
/// and a cost from the response is charged up front as `max(fallback, min_cost)`.
pub async fn admit<'l>(
    state: &Arc<AppState>,
    route: &'l Route,
    resources: &'l RouteResources,
    view: &RequestView<'_>,
    note: Option<&mut Decided>,
) -> Result<Admitted, Refusal<'l>> {
    let (admitted, _, wait) = admit_with(state, route, resources, view, false, note).await?;
    // A door's answer waits for the slot as the gateway's forwarding does.
    if let Some(wait) = wait {
        Box::pin(wait.hold(route)).await?;
    }
    Ok(admitted)
}

/// [`admit`] for the inline gateway, which sees the response: concurrency policies take a lease,
/// and what must happen after admission (release it, charge the response's cost) is returned,
/// with the [`Wait`] of a request admitted for later (boxed: only such a request carries it),
/// which the gateway holds before forwarding.
pub async fn admit_inline<'l>(
    state: &Arc<AppState>,
    route: &'l Route,
    resources: &'l RouteResources,
    view: &RequestView<'_>,
    note: Option<&mut Decided>,
) -> Result<(Admitted, AfterAdmission, Option<Box<Wait>>), Refusal<'l>> {
    admit_with(state, route, resources, view, true, note).await
}

/// What [`admit_with`] gives an admitted request.
type Admission = (Admitted, AfterAdmission, Option<Box<Wait>>);

/// `note`, when given (the access log is on), learns the decision, its policy and key.
///
/// A request refused only by a concurrency policy that delays waits for a lease
/// ([`wait_for_lease`]), then is decided again without that policy: admitted, it holds the
/// lease with whatever the others took; refused, it releases the lease (which hands it on), so
/// it reserves in all of its policies or none (`docs/algorithms.md`, "Pacing").
async fn admit_with<'l>(
    state: &Arc<AppState>,
    route: &'l Route,
    resources: &'l RouteResources,
    view: &RequestView<'_>,
    inline: bool,
    note: Option<&mut Decided>,
) -> Result<Admission, Refusal<'l>> {
    let mut note = note;
    let queue = match admit_once(
        state,
        route,
        resources,
        view,
        inline,
        note.as_deref_mut(),
        None,
    )
    .await
    {
        Ok(admitted) => return Ok(admitted),
        Err(Once::Refused(refusal)) => return Err(refusal),
        Err(Once::Queue(queue)) => queue,
    };
    let started = tokio::time::Instant::now();
    let waited_for = wait_for_lease(
        state,
        resources,
        queue.key.clone(),
        queue.rule,
        queue.max_delay_us,
    )
    .await;
    let Some(held) = waited_for else {
        queue.count_refused(state, route, resources);
        return Err(queue.refusal);
    };
    let Queue {
        policy,
        place,
        outcome,
        ..
    } = *queue;
    // It holds a lease: the policy allowed it, whatever the decision now taken of the others
    // (which counts them).
    if let (Some(metrics), Some(leased)) =
        (resources.policies.get(policy), route.policies.get(policy))
    {
        metrics.record(DecisionLabel::Allowed);
        metrics.record_units(leased.cost);
    }
    let waited = started.elapsed();
    let lease = held.lease;
    let again = Held {
        policy,
        lease,
        place: Some(place),
    };
    // Dropped on a refusal here, `held` releases the lease, which hands it on.
    let (mut admitted, mut after, wait) =
        match admit_once(state, route, resources, view, inline, note, Some(again)).await {
            Ok(admitted) => admitted,
            Err(Once::Refused(refusal)) => return Err(refusal),
            Err(Once::Queue(queue)) => return Err(queue.refusal),
        };
    resources.metrics.record_delay(waited.as_secs_f64());
    let (key, rule) = held.keep();
    after.hold_handed(&state.engine, lease, key, rule);
    let waited_us = u64::try_from(waited.as_micros()).unwrap_or(u64::MAX);
    admitted.limits.delayed_us = admitted.limits.delayed_us.saturating_add(waited_us);
    if policy < MAX_POLICIES {
        admitted.limits.applied |= 1 << policy;
    }
    if admitted.governing.is_none() {
        // The lease is the only limit it passed: the policy's fields as admitted, its last lease.
        let outcome = Outcome {
            allowed: true,
            remaining: 0,
            retry_after_us: 0,
            ..outcome
        };
        admitted.governing = Some(outcome);
        admitted.limits.governing = Some((policy, outcome));
    }
    Ok((admitted, after, wait))
}

/// A lease the request holds already (handed to it after a wait): its policy is not decided
/// again, the others' concurrency checks take the same lease id, and the place among the
/// route's waiters carries over.
struct Held {
    policy: usize,
    lease: u64,
    place: Option<crate::pacing::Place>,
}

/// A refusal of [`admit_once`].
enum Once<'l> {
    Refused(Refusal<'l>),
    /// Refused only by a concurrency policy that delays, with a place to wait in.
    Queue(Box<Queue<'l>>),
}

/// What waiting for a lease needs: the refusal to answer if none comes, the policy's index, its
/// counter key and the rule the decision used, its `max_delay`, the place among the route's
/// waiters, and the policy's refused outcome.
struct Queue<'l> {
    refusal: Refusal<'l>,
    policy: usize,
    key: String,
    rule: Rule,
    max_delay_us: u64,
    place: crate::pacing::Place,
    outcome: Outcome,
    /// The decision was not counted ([`Checks::count_later`]): how each of the other policies
    /// that applied counts if no lease comes (allowed, or shadow), by policy index. With a
    /// lease, the decision taken then counts them.
    others: Vec<(usize, DecisionLabel)>,
}

impl Queue<'_> {
    /// No lease came: the request counts as its first decision refused it, once per policy.
    fn count_refused(&self, state: &AppState, route: &Route, resources: &RouteResources) {
        for &(p, label) in &self.others {
            if let Some(metrics) = resources.policies.get(p) {
                metrics.record(label);
            }
        }
        if let (Some(metrics), Some(policy)) = (
            resources.policies.get(self.policy),
            route.policies.get(self.policy),
        ) {
            metrics.record(DecisionLabel::Limited);
            let value = self
                .key
                .strip_prefix(policy.key_prefix())
                .unwrap_or(&self.key);
            state
                .engine
                .top_limited()
                .record(&route.name, &policy.name, value);
        }
    }
}

/// One decision of the request's policies (all but a `held` one).
async fn admit_once<'l>(
    state: &Arc<AppState>,
    route: &'l Route,
    resources: &'l RouteResources,
    view: &RequestView<'_>,
    inline: bool,
    note: Option<&mut Decided>,
    held: Option<Held>,
) -> Result<Admission, Once<'l>> {
    let refused = Once::Refused;
    resources.register_metrics();
    // The bearer token is verified at most once, before any claim names a counter, however many
    // policies read claims; routes that read none never look at it. `require_jwt` is
    // authentication, not a limit: it holds for exempt requests too.
    let verify = || {
        let jwt = route.jwt.as_ref()?;
        let result = jwt.verify(view.headers);
        let counted = result.as_ref().map(|_| ()).map_err(|rejected| *rejected);
        resources.metrics.record_jwt(counted);
        Some(result)
    };
    let mut note = note;
    if let Some(note) = note.as_deref_mut() {
        note.route = Some(route.name.clone());
    }
    let mut verified = None;
    if route.require_jwt {
        match verify() {
            Some(Ok(claims)) => verified = Some(claims),
            Some(Err(rejected)) => {
                return Err(refused(Refusal::Unauthorized {
                    route: &route.name,
                    missing: rejected == crate::jwt::Rejected::Missing,
                }))
            }
            None => {}
        }
    }
    // An exempt request skips every policy and consumes nothing (`exempt:`).
    if !route.exempt.is_empty() && route.exempt.matches(view.client_ip, view.headers) {
        resources.metrics.record_exempt();
        if let Some(note) = note.as_mut() {
            note.decision = Decision::Exempt;
        }
        let admitted = Admitted {
            governing: None,
            kind: Kind::Allowed,
            limits: Limits::default(),
        };
        return Ok((admitted, AfterAdmission::default(), None));
    }
    if !route.require_jwt {
        verified = match verify() {
            Some(Ok(claims)) => Some(claims),
            // A token that is there but does not verify is refused where an enforced policy keys
            // on a claim: treated as absent, it would escape that policy while an upstream more
            // lenient about its spelling still authenticates it.
            Some(Err(crate::jwt::Rejected::Invalid))
                if route.policies.iter().any(|p| p.uses_jwt() && !p.shadow) =>
            {
                return Err(refused(Refusal::Unauthorized {
                    route: &route.name,
                    missing: false,
                }));
            }
            Some(Err(_)) | None => None,
        };
    }
    let claims = verified.as_deref();
    // Per-key overrides: a local copy, never a store call (`crate::overrides`). Declared before
    // the checks that borrow from it, so it outlives them.
    let overrides = state.overrides.active();
    let mut checks = Checks::with_capacity(route.policies.len());
    // A place among the route's waiters, taken before deciding so that a reservation is only
    // made for a request that can wait for it; with none left, a policy that delays admits
    // only what needs no wait (`docs/algorithms.md`, "Pacing").
    let (place, held) = match held {
        Some(Held {
            policy,
            lease,
            place,
        }) => (place, Some((policy, lease))),
        None if route.policies.iter().any(|p| p.max_delay_us.is_some()) => {
            (state.waiters.enter(&route.name, route.max_waiting), None)
        }
        None => (None, None),
    };
    if let Some((_, lease)) = held {
        checks.hold_lease(lease);
    }
    // The route's policy index of each pushed check, and the enforced ones that applied.
    let mut pushed = [0u8; MAX_POLICIES];
    let mut applied = 0u64;
    // (pushed index, policy index, units taken) of the checks that need something after
    // admission.
    let mut later: Vec<(usize, usize, u64)> = Vec::new();
    for (p, (policy, metrics)) in route.policies.iter().zip(&resources.policies).enumerate() {
        let concurrency = matches!(policy.rule, Rule::Concurrency(_));
        if concurrency && !inline {
            continue;
        }
        if held.is_some_and(|(h, _)| h == p) {
            // Its lease is held: decided already.
            if p < MAX_POLICIES {
                applied |= 1 << p;
            }
            continue;
        }
        // A key header or query parameter sent twice is ambiguous: 400.
        let key = policy
            .counter_key(view, claims)
            .map_err(|e| refused(Refusal::BadRequest(e.to_string())))?;
        if let Some(key) = key {
            let tally = Tally::Policy {
                metrics,
                route: &route.name,
                policy: &policy.name,
                prefix: policy.key_prefix(),
            };
            let rule = overrides.rule(&key).unwrap_or(&policy.rule);
            let cost = match &policy.response_cost {
                Some(rc) if !inline => rc.total(None).min(crate::inflight::most_charged(rc, rule)),
                // At most `max_cost`, less when the request body bounds it.
                Some(rc) if rc.reserve => crate::usage::request::reservation(rc, view.body),
                _ => policy.cost,
            };
            if inline && policy.response_cost.as_ref().is_some_and(|rc| rc.reserve) {
                checks.refundable();
            }
            let i = checks.push(key, rule, cost, policy.shadow, tally);
            // A concurrency policy's wait is for a lease, after the decision (`wait_for_lease`).
            if let Some(max) = policy.max_delay_us.filter(|_| !concurrency) {
                checks.pace(i, if place.is_some() { max } else { 0 });
            }
            if let Some(slot) = pushed.get_mut(i) {
                *slot = p as u8;
            }
            if !policy.shadow && p < MAX_POLICIES {
                applied |= 1 << p;
            }
            if inline && (concurrency || policy.response_cost.is_some()) {
                later.push((i, p, cost));
            }
        }
    }
    // Only shadow policies applied: nothing may reject, the store's failure included.
    let failure_mode = if applied == 0 {
        FailureMode::Open
    } else {
        route.failure_mode
    };
    let pushed_len = checks.len();
    // A request that may wait for a lease is counted once it is known whether it waits.
    let may_queue = inline
        && held.is_none()
        && place.is_some()
        && route
            .policies
            .iter()
            .any(|p| matches!(p.rule, Rule::Concurrency(_)) && p.max_delay_us.is_some());
    if may_queue {
        checks.count_later();
    }
    let store_began = note.is_some().then(std::time::SystemTime::now);
    let mut verdict = state.engine.decide(checks, failure_mode).await;
    let store_call = store_began.map(|began| (began, std::time::SystemTime::now()));
    let delay = verdict.delay();
    let reservation = verdict.reservation();
    // A shadow policy that would have refused consumed nothing: no lease to hold or release, no
    // response cost to charge.
    later.retain(|&(i, p, _)| {
        !route.policies.get(p).is_some_and(|policy| policy.shadow)
            || verdict.outcome(i).is_some_and(|o| o.allowed)
    });
    let after = if later.is_empty() || !verdict.admits() {
        AfterAdmission::default()
    } else {
        AfterAdmission::new(route, &mut verdict, &later)
    };
    let policy_of = |i: usize| pushed.get(i).map(|&p| usize::from(p));
    // Limited: the engine's choice (an enforced refusal). Admitted: the enforced check with the
    // least remaining, the first on a tie; shadow policies are invisible to clients.
    let governing = match verdict.kind {
        Kind::Limited => verdict.governing().map(|(i, o)| (i, *o)),
        _ => (0..pushed_len)
            .filter(|&i| policy_of(i).is_some_and(|p| applied & (1 << p) != 0))
            .filter_map(|i| verdict.outcome(i).map(|o| (i, *o)))
            .min_by_key(|(_, o)| o.remaining),
    };
    let limits = Limits {
        governing: governing.and_then(|(i, o)| Some((policy_of(i)?, o))),
        applied,
        delayed_us: u64::try_from(delay.as_micros()).unwrap_or(u64::MAX),
    };
    if let Some(note) = note {
        let pushed = &pushed[..pushed_len.min(MAX_POLICIES)];
        *note = decided(route, &verdict, governing.map(|(i, _)| i), pushed);
        note.store_call = store_call;
    }
    // Refused only by a concurrency policy that delays: the request may wait for a lease.
    let queue_on = match (&place, held) {
        (Some(_), None) if inline && verdict.kind == Kind::Limited => {
            waits_for_lease(route, &verdict, pushed_len, policy_of)
        }
        _ => None,
    };
    if may_queue && queue_on.is_none() {
        state.engine.count_verdict(&verdict);
    }
    match (verdict.kind, governing) {
        (Kind::Limited, Some((_, outcome))) => Err(Refusal::RateLimited {
            route: &route.name,
            // The route's own name (the verdict's borrows end with the overrides' guard).
            policy: limits
                .governing
                .and_then(|(p, _)| route.policies.get(p))
                .map_or("", |p| &p.name),
            outcome,
            limits,
            headers: &route.rate_limit_headers,
            response: &route.limited_response,
        })
        .map_err(|refusal| match (queue_on, place) {
            (Some((i, p, max_delay_us, rule)), Some(place)) => Once::Queue(Box::new(Queue {
                refusal,
                policy: p,
                key: verdict.key(i).to_string(),
                rule,
                max_delay_us,
                place,
                outcome: verdict.outcome(i).copied().unwrap_or(outcome),
                // Every other enforced check allowed (`waits_for_lease`); a shadow one may not.
                others: (0..pushed_len)
                    .filter(|&j| j != i)
                    .filter_map(|j| {
                        let p = policy_of(j)?;
                        let shadow = route.policies.get(p)?.shadow;
                        let allowed = verdict.outcome(j)?.allowed;
                        Some((
                            p,
                            if shadow && !allowed {
                                DecisionLabel::Shadow
                            } else {
                                DecisionLabel::Allowed
                            },
                        ))
                    })
                    .collect(),
            })),
            _ => Once::Refused(refusal),
        }),
        // (A limited verdict always has an enforced refusal to govern; routes never use `Error`.)
        (Kind::FailedClosed | Kind::Failed | Kind::Limited, _) => {
            Err(refused(Refusal::StoreUnavailable(&route.name)))
        }
        (kind @ (Kind::Allowed | Kind::FailedOpen), governing) => {
            let wait = reservation.map(|r| Wait::new(state, resources, delay, r, place, limits));
            let admitted = Admitted {
                governing: governing.map(|(_, o)| o),
                kind,
                limits,
            };
            Ok((admitted, after, wait))
        }
    }
}

/// Whether a limited `verdict` was refused only by a concurrency policy that delays (every other
/// enforced check allowed): that check's pushed index, its policy's index, `max_delay` and the
/// rule the decision used (a per-key override's, say).
fn waits_for_lease(
    route: &Route,
    verdict: &crate::limiter::Verdict<'_>,
    pushed: usize,
    policy_of: impl Fn(usize) -> Option<usize>,
) -> Option<(usize, usize, u64, Rule)> {
    let mut found = None;
    for i in 0..pushed {
        let Some(p) = policy_of(i) else { continue };
        let Some(policy) = route.policies.get(p) else {
            continue;
        };
        if policy.shadow || verdict.outcome(i).is_none_or(|o| o.allowed) {
            continue;
        }
        match (policy.rule, policy.max_delay_us, found) {
            (Rule::Concurrency(_), Some(max), None) => {
                let rule = verdict.rule(i).copied().unwrap_or(policy.rule);
                found = Some((i, p, max, rule));
            }
            _ => return None,
        }
    }
    found
}

/// A request waiting for a concurrency lease (`on_limit: delay` on a concurrency policy), then
/// holding the lease it was handed until [`LeaseHeld::keep`] passes it on: dropped before that
/// (its `max_delay` passed, its client went away, the gateway shuts down, the rest of its
/// decision refused), it leaves the key's queue and releases a lease handed to it, which hands
/// it on. It holds this struct, its key and the store's ticket (`docs/algorithms.md`, "Pacing").
#[derive(Debug)]
struct LeaseHeld {
    state: Arc<AppState>,
    key: String,
    rule: Rule,
    lease: u64,
    /// The ticket's name in the store's queue (empty in process, or while none is known).
    ticket: String,
    /// Nothing to leave: the store took no ticket and granted no lease, or the lease was kept.
    settled: bool,
}

impl LeaseHeld {
    /// The key and rule of the lease, now owned by the request's [`AfterAdmission`].
    fn keep(mut self) -> (String, Rule) {
        self.settled = true;
        (std::mem::take(&mut self.key), self.rule)
    }
}

impl Drop for LeaseHeld {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        let (key, rule, lease) = (std::mem::take(&mut self.key), self.rule, self.lease);
        let ticket = std::mem::take(&mut self.ticket);
        if let crate::limiter::Store::Memory(store) = self.state.engine.store() {
            let check = crate::limiter::Check {
                key: &key,
                rule: &rule,
                cost: 1,
                shadow: false,
                max_delay_us: None,
            };
            let _handed = store.leave(&check, lease);
            return;
        }
        // Outside a runtime (the process ending): the ticket expires by its deadline, a lease
        // handed to it by its TTL.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let state = self.state.clone();
            runtime.spawn(async move { state.engine.leave(&key, &rule, lease, &ticket).await });
        }
    }
}

/// Waits at most `max_delay_us` for a lease on `key` under `rule` (`lease_queue`), counted in
/// `turnstile_waiting_requests`; `None` when none came in time, the store could not queue, or
/// the gateway is shutting down (the request is then refused as its decision refused it).
async fn wait_for_lease(
    state: &Arc<AppState>,
    resources: &RouteResources,
    key: String,
    rule: Rule,
    max_delay_us: u64,
) -> Option<LeaseHeld> {
    use crate::limiter::lease_queue::Enqueued;
    let lease = state.engine.new_lease();
    let mut held = LeaseHeld {
        state: state.clone(),
        key,
        rule,
        lease,
        ticket: String::new(),
        settled: false,
    };
    let enqueued = state
        .engine
        .enqueue(&held.key, &held.rule, lease, max_delay_us)
        .await;
    let mut ticket = match enqueued {
        Ok(Enqueued::Granted) => return Some(held),
        Ok(Enqueued::Queued(ticket)) => ticket,
        Ok(Enqueued::Refused) => {
            held.settled = true;
            return None;
        }
        // It may have run (a timeout): leaving releases a lease it took.
        Err(_) => return None,
    };
    held.ticket = std::mem::take(&mut ticket.name);
    let _waiting = Waiting::new(resources.metrics.waiting());
    let granted = tokio::select! {
        granted = ticket.granted() => granted,
        () = tokio::time::sleep(Duration::from_micros(max_delay_us)) => false,
        () = state.waiters.stopped() => false,
    };
    granted.then_some(held)
}

/// One request counted in `turnstile_waiting_requests` until dropped.
struct Waiting(prometheus::IntGauge);

impl Waiting {
    fn new(gauge: &prometheus::IntGauge) -> Self {
        gauge.inc();
        Waiting(gauge.clone())
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// What the access log shows of a verdict: its decision, the governing check's policy and key
/// (for an admitted request a shadow policy would have refused, that shadow policy's). `pushed`
/// holds the route's policy index of each pushed check.
fn decided(
    route: &Route,
    verdict: &crate::limiter::Verdict<'_>,
    governing: Option<usize>,
    pushed: &[u8],
) -> Decided {
    let policy_of = |i: usize| {
        pushed
            .get(i)
            .and_then(|&p| route.policies.get(usize::from(p)))
    };
    let shadowed = || {
        (0..pushed.len()).find(|&i| {
            policy_of(i).is_some_and(|p| p.shadow) && verdict.outcome(i).is_some_and(|o| !o.allowed)
        })
    };
    let delay = verdict.delay();
    let (decision, speaks) = match verdict.kind {
        Kind::Allowed => match shadowed() {
            Some(i) => (Decision::Shadow, Some(i)),
            None if !delay.is_zero() => (Decision::Delayed, governing),
            None => (Decision::Allowed, governing),
        },
        Kind::Limited => (Decision::Limited, governing),
        Kind::FailedOpen => (Decision::FailedOpen, None),
        Kind::FailedClosed | Kind::Failed => (Decision::FailedClosed, None),
    };
    Decided {
        route: Some(route.name.clone()),
        decision,
        policy: speaks.and_then(policy_of).map(|p| p.name.clone()),
        key: speaks.map(|i| verdict.key(i).to_string()),
        delay: (!delay.is_zero()).then_some(delay),
        store_call: None,
    }
}

/// What a deciding door learns about a request.
#[derive(Debug)]
pub enum Checked<'l> {
    /// No route matches: nothing applies.
    NoRoute,
    Admitted(&'l Route, Admitted),
    Refused(Refusal<'l>),
}

/// Canonicalizes `req`, routes it and admits it, as the gateway does, with `peer` as the
/// connection's address for `client_ip.trusted_proxies`. The body is never read. Also returns
/// the request counters the answer belongs to: its route's, or `unmatched`.
pub async fn check<'l, B>(
    state: &Arc<AppState>,
    live: &'l Live,
    req: &mut Request<B>,
    peer: IpAddr,
    note: Option<&mut Decided>,
) -> (Checked<'l>, &'l RouteMetrics) {
    let unmatched = &live.unmatched;
    if let Err(e) = normalize::canonicalize(req, live.config.server.paths) {
        return (
            Checked::Refused(Refusal::BadRequest(e.to_string())),
            unmatched,
        );
    }
    // A door cannot drop a field from what its proxy forwards: unless they are allowed, a field
    // named with an underscore refuses the check (`docs/hardening.md`).
    if live.config.server.headers_with_underscores != crate::proxy::headers::Underscores::Allow
        && crate::proxy::headers::has_underscore_name(req.headers())
    {
        return (
            Checked::Refused(Refusal::BadRequest(
                "a header name contains an underscore".to_string(),
            )),
            unmatched,
        );
    }
    let head = RequestHead {
        method: req.method(),
        host: normalize::host::host(req.headers()),
        path: req.uri().path(),
        headers: req.headers(),
    };
    let Found::Route(index, params) = route_for(live, &head) else {
        return (Checked::NoRoute, unmatched);
    };
    let route = &live.config.routes[index];
    let view = RequestView {
        method: req.method(),
        host: head.host,
        path: req.uri().path(),
        query: req.uri().query(),
        headers: req.headers(),
        params: &params,
        client_ip: live
            .config
            .trusted_proxies
            .client_ip(peer.to_canonical(), req.headers()),
        client_prefix: live.config.client_prefix,
        // forward-auth never sees the body: a `body:` key part is absent there; nor the
        // client's certificate (the one on this connection is the proxy's).
        body: None,
        client_cert: None,
    };
    let resources = &live.routes[index];
    let checked = match admit(state, route, resources, &view, note).await {
        Ok(admitted) => Checked::Admitted(route, admitted),
        Err(refusal) => Checked::Refused(refusal),
    };
    (checked, &resources.metrics)
}

/// A request admitted for later (`on_limit: delay`): its slot is reserved; it waits for it here,
/// holding its place among the route's waiters and counted in `turnstile_waiting_requests`.
/// Dropped before the slot (the client went away), it gives the reservation back where the
/// algorithm allows (`Engine::unreserve`). It holds the reservation's keys and this struct,
/// about 100 bytes plus its keys' length per policy (`docs/algorithms.md`, "Pacing").
#[derive(Debug)]
pub struct Wait {
    state: Arc<AppState>,
    delay: Duration,
    /// Given back on drop, unless the slot came.
    reservation: Option<Reservation>,
    _place: Option<crate::pacing::Place>,
    waiting: prometheus::IntGauge,
    limits: Limits,
}

impl Wait {
    fn new(
        state: &Arc<AppState>,
        resources: &RouteResources,
        delay: Duration,
        reservation: Reservation,
        place: Option<crate::pacing::Place>,
        limits: Limits,
    ) -> Box<Self> {
        resources.metrics.record_delay(delay.as_secs_f64());
        let waiting = resources.metrics.waiting().clone();
        waiting.inc();
        Box::new(Wait {
            state: state.clone(),
            delay,
            reservation: Some(reservation),
            _place: place,
            waiting,
            limits,
        })
    }

    /// The heap bytes this waiter holds besides itself (its reservation's keys).
    pub fn heap_bytes(&self) -> usize {
        self.reservation.as_ref().map_or(0, Reservation::heap_bytes)
    }

    /// Waits for the slot. When the gateway shuts down first, the request is answered at once:
    /// refused as its governing policy refuses, `Retry-After` the rest of its wait, and the
    /// reservation given back.
    pub async fn hold(mut self: Box<Self>, route: &Route) -> Result<(), Refusal<'_>> {
        let started = tokio::time::Instant::now();
        let waiters = self.state.waiters.clone();
        tokio::select! {
            () = tokio::time::sleep(self.delay) => {
                // Its slot: the reservation is used.
                self.reservation = None;
                Ok(())
            }
            () = waiters.stopped() => {
                let left = self.delay.saturating_sub(started.elapsed());
                Err(self.refusal(route, left))
            }
        }
    }

    fn refusal<'l>(&self, route: &'l Route, left: Duration) -> Refusal<'l> {
        let Some((p, admitted)) = self.limits.governing else {
            return Refusal::StoreUnavailable(&route.name);
        };
        let outcome = Outcome {
            allowed: false,
            retry_after_us: u64::try_from(left.as_micros()).unwrap_or(u64::MAX).max(1),
            ..admitted
        };
        Refusal::RateLimited {
            route: &route.name,
            policy: route.policies.get(p).map_or("", |p| &p.name),
            outcome,
            limits: Limits {
                governing: Some((p, outcome)),
                delayed_us: 0,
                ..self.limits
            },
            headers: &route.rate_limit_headers,
            response: &route.limited_response,
        }
    }
}

impl Drop for Wait {
    fn drop(&mut self) {
        self.waiting.dec();
        let Some(reservation) = self.reservation.take() else {
            return;
        };
        // Outside a runtime (the process ending) there is nobody left to give it to.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let state = self.state.clone();
            runtime.spawn(async move { state.engine.unreserve(&reservation).await });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What docs/algorithms.md ("Waiting for a lease") says a waiter for a lease holds besides
    /// its key: its guard, the ticket, and the in-process queue's entry.
    #[test]
    fn a_lease_waiter_holds_what_the_docs_say() {
        let guard = std::mem::size_of::<LeaseHeld>();
        let ticket = std::mem::size_of::<crate::limiter::lease_queue::Ticket>();
        let entry = std::mem::size_of::<crate::limiter::lease_queue::Waiter>();
        assert!(guard <= 104, "the guard is {guard} bytes");
        assert!(ticket <= 32, "the ticket is {ticket} bytes");
        assert!(entry <= 24, "the queue entry is {entry} bytes");
    }
}
