//! The decision engine: the one function every door calls.
//!
//! A door (the inline gateway, the Envoy rate limit service, forward-auth) turns its protocol into
//! [`Checks`], calls [`Engine::decide`], and renders the [`Verdict`] in its own protocol. Everything
//! that is policy rather than protocol happens here, once:
//!
//! - duplicate keys are merged into one check, costs summed (a counter is checked once);
//! - the store is asked for one all-or-nothing decision (one Redis round trip), timed, and its
//!   failures counted by kind;
//! - a store failure becomes failed open, failed closed or an error by the caller's
//!   [`FailureMode`], and is logged at most once a second;
//! - each check's decision is counted (`turnstile_decisions_total` for gateway policies, where a
//!   shadow policy that would have refused counts as `shadow`,
//!   envoyproxy/ratelimit's statistics for Envoy descriptors) and limited keys feed the
//!   top-limited sketch;
//! - one rule picks the governing outcome (see `docs/algorithms.md`, "The governing outcome").

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::deny_cache::{DenyCache, DEFAULT_CAPACITY as DENY_CAPACITY};
use super::leases::{LocalInFlight, LocalSlots, RETRY_AFTER_US};
use super::{Check, Clock, Decision, Outcome, Rule, Store, StoreError};
use crate::metrics::rls::{Over, RuleMetrics};
use crate::metrics::{DecisionLabel, Metrics, PolicyMetrics};
use crate::top_limited::{TopLimited, DEFAULT_CAPACITY, DEFAULT_PERIOD_US};
use smallvec::SmallVec;

/// Store checks and outcomes per decision kept inline (no allocation): routes rarely have more
/// policies than this, and an Envoy call rarely more descriptors. The engine's own list of checks
/// stays a `Vec`: it is moved through the decision, and moving it inline cost more (callgrind)
/// than the allocation it saved.
pub const INLINE_CHECKS: usize = 4;

/// What a door wants when the store cannot decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureMode {
    /// Admit the request (counted as `failed_open`).
    Open,
    /// Refuse it (counted as `failed_closed`).
    Closed,
    /// Neither: hand the error to the caller (the Envoy service's `failure_mode: error`, where
    /// Envoy's own `failure_mode_deny` decides).
    Error,
}

/// Whom a check's result is counted for.
#[derive(Debug, Clone, Copy)]
pub enum Tally<'a> {
    /// A gateway policy: `turnstile_decisions_total{route, policy, decision}`, and the
    /// top-limited sketch (route, policy, the key without `prefix`) when it limits.
    Policy {
        metrics: &'a PolicyMetrics,
        route: &'a str,
        policy: &'a str,
        prefix: &'a str,
    },
    /// An Envoy descriptor: envoyproxy/ratelimit's per-rule statistics (never on failure), with
    /// its rule's `shadow_mode` and `quota_mode` (each counts its overs apart).
    Descriptor {
        stats: &'a RuleMetrics,
        shadow: bool,
        quota: bool,
    },
}

/// One check as a door asks for it.
#[derive(Debug)]
struct Item<'a> {
    key: Cow<'a, str>,
    rule: &'a Rule,
    /// This item's own cost and shadow flag (a merged check sums the costs).
    cost: u64,
    shadow: bool,
    tally: Tally<'a>,
    /// The item that carries the merged check: itself, or an earlier item with the same key.
    leader: usize,
    /// The index of the merged check in the store's decision.
    check: usize,
    /// For a leader: the merged cost and whether every merged item is shadow.
    total_cost: u64,
    all_shadow: bool,
    /// Pacing ([`Checks::pace`]): the longest this check may hold the request for a slot.
    max_delay_us: Option<u64>,
}

/// The checks of one request, in the door's order. Pushing a key already asked for merges it
/// into the earlier check (the first rule stands, costs are summed, shadow only if all are).
#[derive(Debug, Default)]
pub struct Checks<'a> {
    items: Vec<Item<'a>>,
    distinct: usize,
    /// A check's units may come back before its refusal's `retry_after` (a reservation settled
    /// by a refund): no refusal of this decision is certain enough for the deny cache.
    refundable: bool,
    /// Room to reserve at the first push: a request none of whose checks apply allocates nothing.
    capacity: usize,
    /// The lease id the concurrency checks take (0: a new one): the id of a lease the request
    /// holds already, so that all of its leases are released together ([`Checks::hold_lease`]).
    lease: u64,
    /// The caller counts the verdict itself, once it knows how the request ends
    /// ([`Checks::count_later`]).
    count_later: bool,
}

impl<'a> Checks<'a> {
    /// Room for `n` checks, reserved only once the first one is pushed.
    pub fn with_capacity(n: usize) -> Self {
        Checks {
            items: Vec::new(),
            distinct: 0,
            refundable: false,
            capacity: n,
            lease: 0,
            count_later: false,
        }
    }

    /// The decision is not counted in the decision metrics: the caller counts its verdict with
    /// [`Engine::count_verdict`], or counts how the request ended otherwise. A request refused
    /// only by a concurrency policy that delays is decided again once it holds a lease, and one
    /// request must count once per policy.
    pub fn count_later(&mut self) {
        self.count_later = true;
    }

    /// The request holds lease `lease` already (handed to it after a wait,
    /// [`Engine::enqueue`]): its concurrency checks take that same id.
    pub fn hold_lease(&mut self, lease: u64) {
        self.lease = lease;
    }

    /// Adds a check; returns its index, by which the verdict reports its outcome.
    pub fn push(
        &mut self,
        key: impl Into<Cow<'a, str>>,
        rule: &'a Rule,
        cost: u64,
        shadow: bool,
        tally: Tally<'a>,
    ) -> usize {
        let key = key.into();
        if self.items.capacity() == 0 {
            self.items.reserve_exact(self.capacity.max(1));
        }
        let index = self.items.len();
        let earlier = self
            .items
            .iter_mut()
            .enumerate()
            .find(|(i, item)| item.leader == *i && item.key == key);
        let (leader, check) = match earlier {
            Some((j, first)) => {
                first.total_cost = first.total_cost.saturating_add(cost);
                first.all_shadow &= shadow;
                (j, first.check)
            }
            None => {
                self.distinct += 1;
                (index, self.distinct - 1)
            }
        };
        self.items.push(Item {
            key,
            rule,
            cost,
            shadow,
            tally,
            leader,
            check,
            total_cost: cost,
            all_shadow: shadow,
            max_delay_us: None,
        });
        index
    }

    /// Lets the check pushed at `index` hold the request up to `max_delay_us` for a slot instead
    /// of refusing it (`on_limit: delay`, [`super::pacing`]). On a merged check the first pushed
    /// stands, as its rule does; a shadow check never delays. Its refusals are not cached: a
    /// waiter that goes away gives its slot back.
    pub fn pace(&mut self, index: usize, max_delay_us: u64) {
        if let Some(item) = self.items.get_mut(index) {
            if item.leader == index && !item.shadow {
                item.max_delay_us = Some(max_delay_us);
                self.refundable = true;
            }
        }
    }

    /// Whether any check may delay the request.
    pub fn paces(&self) -> bool {
        self.items.iter().any(|i| i.max_delay_us.is_some())
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Marks the decision as one whose refusals the deny cache must not keep: a check of it
    /// reserves units that a refund may give back at any time (`reserve: true`).
    pub fn refundable(&mut self) {
        self.refundable = true;
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The store's view: one check per distinct key, in order of first appearance.
    fn store_checks(&self) -> SmallVec<[Check<'_>; INLINE_CHECKS]> {
        let mut checks = SmallVec::with_capacity(self.distinct);
        for (i, item) in self.items.iter().enumerate() {
            if item.leader == i {
                checks.push(Check {
                    key: &item.key,
                    rule: item.rule,
                    cost: item.total_cost,
                    shadow: item.all_shadow,
                    max_delay_us: item.max_delay_us.filter(|_| !item.all_shadow),
                });
            }
        }
        checks
    }
}

/// How a request's decision ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Every enforced check allowed (also when there was nothing to check).
    Allowed,
    /// An enforced check refused: nothing was consumed.
    Limited,
    /// The store failed and the failure mode admits.
    FailedOpen,
    /// The store failed and the failure mode refuses.
    FailedClosed,
    /// The store failed and the failure mode hands the error to the caller.
    Failed,
}

/// The engine's answer, rendered by each door in its own protocol.
#[derive(Debug)]
pub struct Verdict<'a> {
    pub kind: Kind,
    checks: Checks<'a>,
    /// One outcome per distinct check; empty when the store failed.
    decision: Decision,
    error: Option<StoreError>,
    /// The lease id the concurrency checks took (0: none asked for).
    lease: u64,
    /// This instance's count of the request's concurrency keys (shared stores only): the lease
    /// the store granted, or the slot the fallback granted when it could not decide.
    local: Option<LocalSlots>,
    /// Decided by the local fallback (`Engine::fall_back`), not by the store.
    fallback: bool,
}

impl<'a> Verdict<'a> {
    /// The store's decision: allowed or limited, as it says.
    fn decided(
        checks: Checks<'a>,
        decision: Decision,
        lease: u64,
        local: Option<LocalSlots>,
    ) -> Self {
        Verdict {
            kind: if decision.allowed {
                Kind::Allowed
            } else {
                Kind::Limited
            },
            checks,
            decision,
            error: None,
            lease,
            local,
            fallback: false,
        }
    }
    /// Whether the request may proceed (allowed, or failed open).
    pub fn admits(&self) -> bool {
        matches!(self.kind, Kind::Allowed | Kind::FailedOpen)
    }

    /// The outcome of the check pushed at `index` (shared by merged checks); `None` when the
    /// store failed.
    pub fn outcome(&self, index: usize) -> Option<&Outcome> {
        let item = self.checks.items.get(index)?;
        self.decision.outcomes.get(item.check)
    }

    /// Whom the check pushed at `index` is counted for.
    pub fn tally(&self, index: usize) -> Option<Tally<'a>> {
        self.checks.items.get(index).map(|i| i.tally)
    }

    /// The key of the check pushed at `index`.
    pub fn key(&self, index: usize) -> &str {
        self.checks.items.get(index).map_or("", |i| &i.key)
    }

    /// The rule the store decided the check pushed at `index` under: its own, or for a merged
    /// check the first one's (the rule that stands). What happens after admission (a charge, a
    /// lease's renewal and release) uses this rule, never one derived again from the config: a
    /// per-key override or a reload may have given the counter another since.
    pub fn rule(&self, index: usize) -> Option<&'a Rule> {
        let item = self.checks.items.get(index)?;
        self.checks.items.get(item.leader).map(|leader| leader.rule)
    }

    /// What identifies the consumption of the check pushed at `index`, for a refund of it
    /// ([`super::Decision::stamps`]; 0 when the store did not decide).
    pub fn stamp(&self, index: usize) -> u64 {
        self.checks
            .items
            .get(index)
            .map_or(0, |item| self.decision.stamp(item.check))
    }

    /// The lease id this request's concurrency checks hold when it was admitted (`None`: no
    /// concurrency check, or nothing taken). Give it back with [`Engine::release`].
    pub fn lease(&self) -> Option<u64> {
        (self.lease != 0 && self.kind == Kind::Allowed).then_some(self.lease)
    }

    /// Admitted for later (pacing): how long the request must wait for its slot. Zero when it
    /// may go now, or was not admitted.
    pub fn delay(&self) -> std::time::Duration {
        if self.kind == Kind::Allowed {
            std::time::Duration::from_micros(self.decision.delay_us)
        } else {
            std::time::Duration::ZERO
        }
    }

    /// Admitted for later: what the request gives back if it goes away before its slot, owned so
    /// that a guard can give it back from anywhere (`Engine::unreserve`). `None` when the request
    /// was not delayed (it allocates nothing then).
    pub fn reservation(&self) -> Option<Reservation> {
        if self.kind != Kind::Allowed || self.decision.delay_us == 0 {
            return None;
        }
        let checks = self
            .checks
            .store_checks()
            .iter()
            .zip(&self.decision.outcomes)
            .enumerate()
            .filter(|(_, (c, o))| !c.shadow || o.allowed)
            .map(|(i, (c, _))| Reserved {
                key: c.key.into(),
                rule: *c.rule,
                cost: c.cost,
                paced: c.max_delay_us.is_some(),
                stamp: self.decision.stamp(i),
            })
            .collect::<Vec<_>>()
            .into_boxed_slice();
        Some(Reservation {
            checks,
            slot_us: self.decision.slot_us,
        })
    }

    /// Failed open by the local fallback: the lease id the store may have taken anyway (its call
    /// timed out or its connection failed after it may have run), to be released when the
    /// request ends. `None` when nothing can have reached the store.
    pub fn unconfirmed_lease(&self) -> Option<u64> {
        let sent = matches!(
            self.error,
            Some(StoreError::Timeout(_) | StoreError::Connection(_))
        );
        (self.lease != 0 && self.fallback && self.kind == Kind::FailedOpen && sent)
            .then_some(self.lease)
    }

    /// This instance's count of the request's concurrency keys, to hold until the request ends
    /// (dropping it gives the slots back).
    pub fn take_local(&mut self) -> Option<LocalSlots> {
        self.local.take()
    }

    /// The store's error, when it failed.
    pub fn error(&self) -> Option<&StoreError> {
        self.error.as_ref()
    }

    pub fn into_error(self) -> Option<StoreError> {
        self.error
    }

    /// The check that speaks for the request, as the index it was pushed at, with its outcome.
    ///
    /// Admitted: the check with the least `remaining`. Limited: among the enforced checks that
    /// refused, the one with the longest `retry_after_us`, since the request cannot succeed before
    /// it does. Ties go to the first pushed. `None` when nothing was checked or the store failed.
    pub fn governing(&self) -> Option<(usize, &Outcome)> {
        let leaders = self
            .checks
            .items
            .iter()
            .enumerate()
            .filter(|(i, item)| item.leader == *i)
            .filter_map(|(i, item)| Some((i, item, self.decision.outcomes.get(item.check)?)));
        let best = if self.kind == Kind::Limited {
            leaders
                .filter(|(_, item, o)| !o.allowed && !item.all_shadow)
                // The largest wait; on a tie, the first (`Reverse` of the index).
                .max_by_key(|&(i, _, o)| (o.retry_after_us, std::cmp::Reverse(i)))
        } else {
            // `min_by_key` keeps the first of equal minimums.
            leaders.min_by_key(|(_, _, o)| o.remaining)
        };
        best.map(|(i, _, o)| (i, o))
    }
}

/// A delayed admission's reservation, owned: the checks that consumed (key, rule, cost) and the
/// slot every window recorded it at. [`Engine::unreserve`] gives it back.
#[derive(Debug, Clone)]
pub struct Reservation {
    checks: Box<[Reserved]>,
    slot_us: u64,
}

#[derive(Debug, Clone)]
struct Reserved {
    key: Box<str>,
    rule: Rule,
    cost: u64,
    paced: bool,
    /// Its stamp in the decision (a paced quota's is the period it counted in).
    stamp: u64,
}

impl Reservation {
    /// Bytes this reservation holds on the heap (the memory a waiter holds, `docs/algorithms.md`).
    pub fn heap_bytes(&self) -> usize {
        self.checks.len() * std::mem::size_of::<Reserved>()
            + self.checks.iter().map(|c| c.key.len()).sum::<usize>()
    }
}

/// Seconds between two logged store failures.
const LOG_EVERY_US: u64 = 1_000_000;

/// The decision engine shared by every door: the store, and what is counted about its answers.
#[derive(Debug)]
pub struct Engine {
    store: Store,
    clock: Arc<dyn Clock>,
    decision_seconds: crate::metrics::striped::Observations,
    errors: [prometheus::IntCounter; 4],
    /// Who is being limited, in bounded memory: `/debug/top-limited` on the admin listener.
    top_limited: TopLimited,
    /// When a store failure was last logged, in `clock` microseconds plus one (0: never).
    last_logged_us: AtomicU64,
    logged: AtomicU64,
    /// Refusals still certain, answered without the store (`docs/algorithms.md`, "The deny cache").
    deny: DenyCache,
    deny_hits: prometheus::IntCounter,
    /// When the deny cache is next swept of expired entries (`clock` microseconds).
    next_sweep_us: AtomicU64,
    /// Bumped by [`Engine::rules_changed`]: a refusal is cached with the generation its decision
    /// read, and replayed only in that same generation.
    rules: AtomicU64,
    /// Lease ids: this process's random start plus a sequence, so instances sharing Redis do not
    /// collide (53 bits, which Lua numbers hold exactly).
    lease_seed: u64,
    lease_seq: AtomicU64,
    /// A shared store's requests in flight on this instance, per concurrency key: what a
    /// concurrency policy falls back to when the store cannot decide. `None` in process, where
    /// the store always decides.
    local: Option<Arc<LocalInFlight>>,
}

/// How often the deny cache drops expired entries, so an idle cache costs one atomic load again.
const DENY_SWEEP_US: u64 = 1_000_000;

/// Lease ids stay below 2^53: decide.lua holds them in doubles.
const LEASE_MASK: u64 = (1 << 53) - 1;

impl Engine {
    /// `clock` times the top-limited periods and the throttle of failure logs.
    pub fn new(store: Store, clock: Arc<dyn Clock>, metrics: &Metrics) -> Self {
        Self::with_deny_cache(store, clock, metrics, DENY_CAPACITY)
    }

    /// [`Engine::new`] with a deny cache of `capacity` entries (0: none, every decision asks the
    /// store).
    pub fn with_deny_cache(
        store: Store,
        clock: Arc<dyn Clock>,
        metrics: &Metrics,
        capacity: usize,
    ) -> Self {
        let name = store.name();
        if let Store::Memory(memory) = &store {
            memory.register_metrics(metrics);
        }
        let errors = ["timeout", "connection", "script", "circuit_open"]
            .map(|kind| metrics.store_error(name, kind));
        Engine {
            deny: DenyCache::new(capacity),
            deny_hits: metrics.deny_cache_hits(name),
            next_sweep_us: AtomicU64::new(0),
            rules: AtomicU64::new(0),
            decision_seconds: metrics.decision_duration(name),
            errors,
            top_limited: TopLimited::new(clock.clone(), DEFAULT_CAPACITY, DEFAULT_PERIOD_US),
            clock,
            last_logged_us: AtomicU64::new(0),
            logged: AtomicU64::new(0),
            lease_seed: random_seed(),
            lease_seq: AtomicU64::new(0),
            local: (!matches!(store, Store::Memory(_))).then(Arc::default),
            store,
        }
    }

    /// A new lease id: never 0, unique in this process until 2^53 leases have been taken.
    fn next_lease(&self) -> u64 {
        loop {
            let seq = self.lease_seq.fetch_add(1, Ordering::Relaxed);
            let id = self.lease_seed.wrapping_add(seq) & LEASE_MASK;
            if id != 0 {
                return id;
            }
        }
    }

    /// Gives lease `lease` back on the concurrency checks among `checks` (a request ended),
    /// handing it to the oldest waiter of its key. A failure is logged: the lease then stops
    /// counting when its TTL passes.
    pub async fn release(&self, checks: &[Check<'_>], lease: u64) {
        if let Err(error) = self.store.release(checks, lease).await {
            tracing::debug!(%error, "releasing a concurrency lease failed; it expires by its TTL");
        }
    }

    /// A new lease id, for a request about to wait for a lease ([`Engine::enqueue`]).
    pub fn new_lease(&self) -> u64 {
        self.next_lease()
    }

    /// Waits for a lease on `key` under the concurrency `rule` that refused the request
    /// ([`Store::enqueue`], `lease_queue`): granted under `lease` now, or a ticket queued for
    /// `max_delay_us` at most.
    pub async fn enqueue(
        &self,
        key: &str,
        rule: &Rule,
        lease: u64,
        max_delay_us: u64,
    ) -> Result<super::lease_queue::Enqueued, StoreError> {
        let check = lease_check(key, rule);
        self.store.enqueue(&check, lease, max_delay_us).await
    }

    /// A waiter gives up ([`Store::leave`]): its ticket (`ticket`, its name) leaves the queue
    /// and a lease handed to it is released. A failure is logged: the ticket is then skipped
    /// past its deadline, and a lease handed to it expires by its TTL.
    pub async fn leave(&self, key: &str, rule: &Rule, lease: u64, ticket: &str) {
        let check = lease_check(key, rule);
        if let Err(error) = self.store.leave(&check, lease, ticket).await {
            tracing::debug!(%error, "leaving a lease queue failed; the ticket expires");
        }
    }

    /// This instance's count of concurrency keys (a shared store), for a lease taken outside a
    /// decision (handed on after a wait): `None` in process.
    pub fn local_slots(&self) -> Option<LocalSlots> {
        self.local
            .as_ref()
            .map(|table| LocalSlots::new(table.clone()))
    }

    /// Gives back a delayed admission's reservation (its request went away before its slot). A
    /// failure is logged: the slot then stays taken, delaying later requests by at most it.
    pub async fn unreserve(&self, reservation: &Reservation) {
        let checks: SmallVec<[(Check<'_>, u64); INLINE_CHECKS]> = reservation
            .checks
            .iter()
            .map(|c| {
                let check = Check {
                    key: &c.key,
                    rule: &c.rule,
                    cost: c.cost,
                    shadow: false,
                    max_delay_us: c.paced.then_some(0),
                };
                (check, c.stamp)
            })
            .collect();
        if let Err(error) = self.store.unreserve(&checks, reservation.slot_us).await {
            tracing::debug!(%error, "giving back a paced reservation failed; its slot stays taken");
        }
    }

    /// Charges a cost known after admission (from the response), whatever the counters hold.
    pub async fn charge(&self, checks: &[Check<'_>]) -> Result<(), StoreError> {
        self.store.charge(checks).await
    }

    /// Gives back the unused part of reservations, each from the consumption its stamp names
    /// ([`Store::refund`]).
    pub async fn refund(&self, checks: &[(Check<'_>, u64)]) -> Result<(), StoreError> {
        self.store.refund(checks).await
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The rules in force may have changed (a config reload, an override set, changed or
    /// deleted): no refusal cached before is replayed after, since the counter may have been
    /// decided under another rule in between (A, then B, then A again). Called after the new
    /// rules are published; a decision that read the old rules and finishes later caches its
    /// refusal under the new generation, where only a request under that same old rule could
    /// match it, and the next change forgets it.
    pub fn rules_changed(&self) {
        self.rules.fetch_add(1, Ordering::Relaxed);
        self.deny.clear();
    }

    pub fn top_limited(&self) -> &TopLimited {
        &self.top_limited
    }

    /// Refusals the deny cache holds now (expired ones until they are swept).
    pub fn deny_cache_len(&self) -> usize {
        self.deny.len()
    }

    /// Store failures logged so far (at most one a second).
    pub fn failures_logged(&self) -> u64 {
        self.logged.load(Ordering::Relaxed)
    }

    /// Decides a request: checks every counter in one all-or-nothing store call, applies
    /// `failure_mode` if the store cannot answer, and counts the result.
    pub async fn decide<'a>(&self, checks: Checks<'a>, failure_mode: FailureMode) -> Verdict<'a> {
        if checks.is_empty() {
            return Verdict {
                kind: Kind::Allowed,
                checks,
                decision: Decision::from_outcomes(super::Outcomes::new()),
                error: None,
                lease: 0,
                local: None,
                fallback: false,
            };
        }
        // One reading: the counters' time, the deny cache's, and the start of the decision's
        // latency (`crate::now`).
        let started = crate::now::read();
        // The deny cache's epoch: the store's (it may have lost state) plus the rules'
        // generation. Both only grow, so the sum changes whenever either does and never comes
        // back to an earlier value.
        let (now, epoch) = if self.deny.is_enabled() {
            let rules = self.rules.load(Ordering::Relaxed);
            (
                self.clock.at(started),
                self.store.epoch().wrapping_add(rules),
            )
        } else {
            (0, 0)
        };
        if !self.deny.is_empty() {
            self.sweep_deny_cache(now);
            // Timed like any decision: the histogram counts every one, wherever it was taken.
            if let Some(decision) = self.cached_refusal(&checks, now, epoch) {
                self.observe_since(started);
                self.deny_hits.inc();
                let verdict = Verdict {
                    kind: Kind::Limited,
                    checks,
                    decision,
                    error: None,
                    lease: 0,
                    local: None,
                    fallback: false,
                };
                self.count(&verdict);
                return verdict;
            }
        }
        let lease = if checks
            .items
            .iter()
            .any(|i| matches!(i.rule, Rule::Concurrency(_)))
        {
            match checks.lease {
                0 => self.next_lease(),
                held => held,
            }
        } else {
            0
        };
        let result = {
            let store_checks = checks.store_checks();
            let result = self
                .store
                .check_leased_at(&store_checks, lease, started)
                .await;
            self.observe_since(started);
            if let Ok(decision) = &result {
                if !checks.refundable {
                    self.remember_refusals(&store_checks, decision, (now, epoch));
                }
            }
            result
        };
        let verdict = match result {
            Ok(decision) => {
                let local = match &self.local {
                    Some(table) if lease != 0 && decision.allowed => Some(granted(table, &checks)),
                    _ => None,
                };
                Verdict::decided(checks, decision, lease, local)
            }
            Err(error) => {
                self.store_failed(&error, failure_mode);
                match &self.local {
                    Some(table) if lease != 0 && failure_mode == FailureMode::Open => {
                        let verdict = fall_back(table, checks, error, lease);
                        self.count(&verdict);
                        return verdict;
                    }
                    _ => {}
                }
                Verdict {
                    kind: match failure_mode {
                        FailureMode::Open => Kind::FailedOpen,
                        FailureMode::Closed => Kind::FailedClosed,
                        FailureMode::Error => Kind::Failed,
                    },
                    checks,
                    decision: Decision::from_outcomes(super::Outcomes::new()),
                    error: Some(error),
                    lease: 0,
                    local: None,
                    fallback: false,
                }
            }
        };
        self.count(&verdict);
        verdict
    }

    /// The state of every check's counter, as the decision of these checks would report it
    /// were it refused, consuming and writing nothing ([`Store::peek`]). Neither counted in the
    /// decision metrics nor answered from the deny cache: a peek is not a decision. The verdict's
    /// kind says whether the checks would be admitted now (`Allowed` or `Limited`); a store
    /// that cannot answer is an error, whatever a route's failure mode.
    pub async fn peek<'a>(&self, checks: Checks<'a>) -> Result<Verdict<'a>, StoreError> {
        let decision = if checks.is_empty() {
            Decision::from_outcomes(super::Outcomes::new())
        } else {
            self.store.peek(&checks.store_checks()).await?
        };
        Ok(Verdict::decided(checks, decision, 0, None))
    }

    /// The store's answer from the deny cache, when it is certain: every distinct check has a live
    /// cached refusal at its cost or below, and at least one of them is enforced. Anything less
    /// asks the store, so shadow checks never change an enforced outcome and every check's
    /// reported outcome is one the store gave.
    fn cached_refusal(&self, checks: &Checks<'_>, now: u64, epoch: u64) -> Option<Decision> {
        let mut enforced = false;
        let mut outcomes = super::Outcomes::with_capacity(checks.distinct);
        for (i, item) in checks.items.iter().enumerate() {
            if item.leader != i {
                continue;
            }
            let cached = self
                .deny
                .lookup(&item.key, item.rule, item.total_cost, now, epoch)?;
            outcomes.push(cached);
            enforced |= !item.all_shadow;
        }
        enforced.then_some(Decision {
            allowed: false,
            outcomes,
            delay_us: 0,
            slot_us: 0,
            stamps: super::Stamps::new(),
        })
    }

    /// Records a decision's latency, from `started` to a fresh reading (which `crate::now` then
    /// shares with what the request does next).
    fn observe_since(&self, started: std::time::Instant) {
        let took = crate::now::read().saturating_duration_since(started);
        self.decision_seconds.observe(took.as_secs_f64());
    }

    /// Caches each refusal of a store decision asked at `asked` (clock, store epoch).
    fn remember_refusals(&self, checks: &[Check<'_>], decision: &Decision, asked: (u64, u64)) {
        for (check, outcome) in checks.iter().zip(&decision.outcomes) {
            // A concurrency slot comes back when a request ends, not with time: never certain.
            if !outcome.allowed && !matches!(check.rule, Rule::Concurrency(_)) {
                self.deny
                    .insert(check.key, check.rule, check.cost, outcome, asked);
            }
        }
    }

    /// At most once a second (one caller wins the race), drops the cache's expired entries.
    fn sweep_deny_cache(&self, now: u64) {
        let next = self.next_sweep_us.load(Ordering::Relaxed);
        if now >= next
            && self
                .next_sweep_us
                .compare_exchange(
                    next,
                    now.saturating_add(DENY_SWEEP_US),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            self.deny.sweep(now);
        }
    }

    fn store_failed(&self, error: &StoreError, failure_mode: FailureMode) {
        let index = match error {
            StoreError::Timeout(_) => 0,
            StoreError::Connection(_) => 1,
            StoreError::Script(_) => 2,
            StoreError::CircuitOpen => 3,
        };
        self.errors[index].inc();
        // At most one line a second, so an outage does not flood the logs.
        let now = self.clock.now_us().saturating_add(1);
        let last = self.last_logged_us.load(Ordering::Relaxed);
        if (last == 0 || now >= last.saturating_add(LOG_EVERY_US))
            && self
                .last_logged_us
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.logged.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%error, ?failure_mode, "rate-limit store failed; applying the failure mode");
        }
    }

    /// Counts the verdict of checks marked [`Checks::count_later`], as `decide` counts others.
    pub fn count_verdict(&self, verdict: &Verdict<'_>) {
        self.record(verdict);
    }

    /// Counts each check's part in the verdict, unless its caller counts it later.
    fn count(&self, verdict: &Verdict<'_>) {
        if !verdict.checks.count_later {
            self.record(verdict);
        }
    }

    fn record(&self, verdict: &Verdict<'_>) {
        for item in &verdict.checks.items {
            let outcome = verdict.decision.outcomes.get(item.check);
            match (item.tally, outcome) {
                (Tally::Policy { metrics, .. }, None) => match verdict.kind {
                    Kind::FailedOpen => metrics.record(DecisionLabel::FailedOpen),
                    Kind::FailedClosed => metrics.record(DecisionLabel::FailedClosed),
                    _ => {}
                },
                (
                    Tally::Policy {
                        metrics,
                        route,
                        policy,
                        prefix,
                    },
                    Some(o),
                ) => {
                    if verdict.fallback && !matches!(item.rule, Rule::Concurrency(_)) {
                        // The store did not decide it; the local fallback refused the request.
                        metrics.record(DecisionLabel::FailedOpen);
                    } else if item.shadow && !o.allowed {
                        // Would have refused; consumed nothing, rejected nothing.
                        metrics.record(DecisionLabel::Shadow);
                    } else if verdict.decision.allowed || o.allowed {
                        metrics.record(DecisionLabel::Allowed);
                        if verdict.decision.allowed {
                            metrics.record_units(item.cost);
                        }
                    } else {
                        metrics.record(DecisionLabel::Limited);
                        let value = item.key.strip_prefix(prefix).unwrap_or(&item.key);
                        self.top_limited.record(route, policy, value);
                    }
                }
                (
                    Tally::Descriptor {
                        stats,
                        shadow,
                        quota,
                    },
                    Some(o),
                ) => {
                    let used_after = o.limit.saturating_sub(o.remaining);
                    let over = Over {
                        over: !o.allowed,
                        shadow,
                        quota,
                    };
                    stats.record(item.cost, o.limit, used_after, over);
                }
                (Tally::Descriptor { .. }, None) => {}
            }
        }
    }
}

/// The check of a lease on `key` (one unit of `rule`).
fn lease_check<'a>(key: &'a str, rule: &'a Rule) -> Check<'a> {
    Check {
        key,
        rule,
        cost: 1,
        shadow: false,
        max_delay_us: None,
    }
}

/// Whether `item` counts against its concurrency key on this instance: an enforced concurrency
/// check of a request (a shadow one never refuses, so it is never counted locally).
fn counted_locally(item: &Item<'_>) -> Option<u64> {
    match item.rule {
        Rule::Concurrency(cc) if !item.all_shadow && item.total_cost > 0 => Some(cc.limit),
        _ => None,
    }
}

/// The store granted the request's leases: this instance counts them, whatever its count, so the
/// fallback sees them if the store stops deciding while they are held.
fn granted(table: &Arc<LocalInFlight>, checks: &Checks<'_>) -> LocalSlots {
    let mut slots = LocalSlots::new(table.clone());
    for (i, item) in checks.items.iter().enumerate() {
        if item.leader == i && counted_locally(item).is_some() {
            slots.take(&item.key, None);
        }
    }
    slots
}

/// The store could not decide a request with concurrency checks on a route failing open: each
/// enforced concurrency key admits only while this instance has fewer than `limit` requests in
/// flight on it (its own leases from the store included), so a concurrency policy is never
/// unlimited. Admitted: failed open, holding the local slots. Refused: limited by the first key
/// at its limit, with a concurrency refusal's outcome (`Retry-After: 1`); the request's other
/// checks, which the store did not decide, have placeholder outcomes that allow.
fn fall_back<'a>(
    table: &Arc<LocalInFlight>,
    checks: Checks<'a>,
    error: StoreError,
    lease: u64,
) -> Verdict<'a> {
    let mut slots = LocalSlots::new(table.clone());
    let refused = checks.items.iter().enumerate().find_map(|(i, item)| {
        let limit = counted_locally(item).filter(|_| item.leader == i)?;
        (!slots.take(&item.key, Some(limit))).then_some(item.check)
    });
    let Some(refused) = refused else {
        return Verdict {
            kind: Kind::FailedOpen,
            checks,
            decision: Decision::from_outcomes(super::Outcomes::new()),
            error: Some(error),
            lease,
            local: Some(slots),
            fallback: true,
        };
    };
    drop(slots);
    let mut outcomes = super::Outcomes::with_capacity(checks.distinct);
    for (i, item) in checks.items.iter().enumerate() {
        if item.leader != i {
            continue;
        }
        let limit = item.rule.limit();
        outcomes.push(if item.check == refused {
            Outcome {
                allowed: false,
                limit,
                remaining: 0,
                reset_us: 0,
                retry_after_us: RETRY_AFTER_US,
            }
        } else {
            Outcome {
                allowed: true,
                limit,
                remaining: limit,
                reset_us: 0,
                retry_after_us: 0,
            }
        });
    }
    Verdict {
        kind: Kind::Limited,
        checks,
        decision: Decision {
            allowed: false,
            outcomes,
            delay_us: 0,
            slot_us: 0,
            stamps: super::Stamps::new(),
        },
        error: None,
        lease: 0,
        local: None,
        fallback: true,
    }
}

#[cfg(test)]
#[path = "engine_tests.rs"]
pub(crate) mod tests;

/// A random 64-bit start for lease ids, from the standard library's per-process hash keys and the
/// time (no dependency: uniqueness across instances, not secrecy, is what matters).
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(now);
    h.write_u32(std::process::id());
    h.finish()
}
