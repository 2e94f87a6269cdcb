//! The in-process store: the default for a single instance.
//!
//! Counters live in a fixed number of shards, each a hash table behind its own mutex, so unrelated
//! keys rarely contend. A decision locks the shards it touches in ascending order (no deadlock),
//! evaluates every check, and consumes only when all allow.
//!
//! `max_keys` bounds memory whatever the traffic, without ever forgetting a counter that still
//! holds information: a full bucket or an empty window is all a new counter would be, so only
//! such idle counters are dropped (by the sweeper, and when a shard is full). Each shard keeps a
//! queue of its counters ordered by when each becomes idle (a lower bound, corrected lazily), so
//! finding one is a peek, not a scan. When none is idle, a new key is counted in the shard's
//! [`overflow`] sketch, which only over-counts: a flood of new keys can neither reset nor raise
//! the allowance of a counter that is in use, and cannot get past a limit itself.
//! `docs/algorithms.md` ("Memory bound") has the argument.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicUsize, Ordering};

use hashbrown::{DefaultHashBuilder, HashTable};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use super::algorithm::{BucketPlan, BucketState, QuotaCount, QuotaPlan, WindowBuckets, WindowLog};
use super::engine::INLINE_CHECKS;
use super::lease_queue::{self, Enqueued, Ticket, Waiter};
use super::leases::{LeasePlan, Leases};
use super::pacing;
use super::{Check, Clock, Decision, Outcome, Rule};
use prometheus::{IntCounter, IntGauge};
use smallvec::SmallVec;

#[path = "overflow.rs"]
mod overflow;
use overflow::Overflow;

/// The most shards; small stores get fewer so that `max_keys` is an exact bound.
const MAX_SHARDS: usize = 64;
/// Counters per shard below which a store uses fewer shards.
const MIN_KEYS_PER_SHARD: usize = 256;
/// Queue entries a full shard examines for one new key before counting it in the overflow: the
/// bound on the work one request can cause (the queue is corrected lazily, so work is amortised).
const MAX_QUEUE_STEPS: usize = 16;
/// Overflow cells per row: one per counter a shard holds, within these bounds.
const OVERFLOW_WIDTH: (usize, usize) = (64, 1 << 16);

#[derive(Debug)]
enum State {
    Bucket(BucketState),
    Log(WindowLog),
    Buckets(WindowBuckets),
    Leases(Leases),
    Quota(QuotaCount),
}

#[derive(Debug)]
struct Entry {
    key: Box<str>,
    hash: u64,
    /// The rule last applied, so the sweeper can tell whether the state is idle.
    rule: Rule,
    state: State,
}

impl Entry {
    fn new(key: &str, hash: u64, rule: &Rule, now: u64) -> Self {
        Entry {
            key: key.into(),
            hash,
            rule: *rule,
            state: State::fresh(rule, now),
        }
    }

    fn is_idle(&self, now: u64) -> bool {
        match (&self.state, &self.rule) {
            (State::Bucket(s), Rule::TokenBucket(tb)) => s.is_idle(tb, now),
            (State::Log(s), Rule::SlidingWindow(sw)) => s.is_idle(sw, now),
            (State::Buckets(s), Rule::SlidingWindow(sw)) => s.is_idle(sw, now),
            (State::Leases(s), Rule::Concurrency(_)) => s.is_idle(now),
            (State::Quota(s), Rule::Quota(_)) => s.is_idle(now),
            _ => true,
        }
    }

    /// When the counter is idle if nothing more is consumed.
    fn idle_at(&self) -> u64 {
        match (&self.state, &self.rule) {
            (State::Bucket(s), Rule::TokenBucket(tb)) => s.idle_at(tb),
            (State::Log(s), Rule::SlidingWindow(sw)) => s.idle_at(sw),
            (State::Buckets(s), Rule::SlidingWindow(sw)) => s.idle_at(sw),
            (State::Leases(s), Rule::Concurrency(_)) => s.idle_at(),
            (State::Quota(s), Rule::Quota(_)) => s.idle_at(),
            _ => 0,
        }
    }

    /// Starts a counter that the overflow sketch says owes `debt_us`: at most the allowance that
    /// debt leaves, so moving from the sketch into the table never raises a key's allowance.
    fn charge(&mut self, debt_us: f64, now: u64) {
        let (unit_us, limit) = overflow::unit(&self.rule);
        let units = (debt_us / unit_us).ceil().min(limit as f64);
        match (&mut self.state, &self.rule) {
            (State::Bucket(s), Rule::TokenBucket(tb)) => {
                s.tokens = (tb.burst as f64 - debt_us / unit_us).max(0.0);
            }
            (State::Log(s), Rule::SlidingWindow(sw)) => {
                let (at, _) = s.evaluate(sw, now, 0);
                s.consume(at, units as u64);
            }
            (State::Buckets(s), Rule::SlidingWindow(sw)) => {
                let (current, _) = s.evaluate(sw, now, 0);
                s.consume(current, units as u64);
            }
            (State::Quota(s), Rule::Quota(q)) => {
                let (plan, _) = s.evaluate(q, now, 0);
                s.commit(&QuotaPlan {
                    cost: units as u64,
                    ..plan
                });
            }
            _ => {}
        }
    }
}

impl State {
    fn fresh(rule: &Rule, now: u64) -> Self {
        match rule {
            Rule::TokenBucket(tb) => State::Bucket(BucketState::full(tb, now)),
            Rule::SlidingWindow(sw) if sw.buckets == 0 => State::Log(WindowLog::default()),
            Rule::SlidingWindow(_) => State::Buckets(WindowBuckets::default()),
            Rule::Concurrency(_) => State::Leases(Leases::default()),
            Rule::Quota(_) => State::Quota(QuotaCount::default()),
        }
    }
}

/// What phase one learned about a check, kept until phase two commits it.
enum Pending {
    Bucket(BucketState),
    Log(u64),
    Buckets(u64),
    Leases(LeasePlan),
    Quota(QuotaPlan),
    /// Counted in the overflow sketch: the debt (µs) the key owes once committed.
    Overflow(f64),
}

impl Pending {
    /// What identifies the consumption for a refund, as decide.lua's reply stamps it: the time
    /// an exact window writes at, a bucketed window's bucket, a quota's period start, the lease
    /// (0 for a bucket, which needs none, and for the overflow sketch, which refunds nothing).
    fn stamp(&self, lease: u64) -> u64 {
        match self {
            Pending::Log(at) => *at,
            Pending::Buckets(current) => *current,
            Pending::Quota(plan) => plan.period.start,
            Pending::Leases(_) => lease,
            Pending::Bucket(_) | Pending::Overflow(_) => 0,
        }
    }
}

/// One shard: its counters, the queue of when each becomes idle, and its overflow sketch.
#[derive(Debug)]
struct Shard {
    table: HashTable<Entry>,
    /// (idle at, key hash), soonest first. An entry's time is a lower bound: consuming makes
    /// it stale, and it is corrected when it reaches the front. Entries of removed counters are
    /// skipped there; the queue is rebuilt when they pile up, and on every sweep.
    idle_queue: BinaryHeap<Reverse<(u64, u64)>>,
    overflow: Overflow,
}

impl Shard {
    fn new(overflow_width: usize) -> Self {
        Shard {
            table: HashTable::new(),
            idle_queue: BinaryHeap::new(),
            overflow: Overflow::new(overflow_width),
        }
    }

    fn rebuild_queue(&mut self) {
        let items: Vec<_> = self
            .table
            .iter()
            .map(|e| Reverse((e.idle_at(), e.hash)))
            .collect();
        self.idle_queue = BinaryHeap::from(items);
    }
}

/// Counters in this process's memory.
#[derive(Debug)]
pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    hasher: DefaultHashBuilder,
    clock: Arc<dyn Clock>,
    keys_per_shard: usize,
    /// The exported series (registered by [`MemoryStore::register_metrics`]): moved only when a
    /// counter is created or dropped, and on the overflow path, never on a plain decision.
    gauges: StoreGauges,
    /// Requests waiting for a lease, per concurrency key, oldest first (`lease_queue`). Locked
    /// after a shard, never before; a release looks only while `queued` is not 0.
    queues: Mutex<HashMap<Box<str>, VecDeque<Waiter>>>,
    queued: AtomicUsize,
}

#[derive(Debug)]
struct StoreGauges {
    /// `turnstile_memory_store_keys`: counters held, idle ones included until dropped.
    keys: IntGauge,
    /// `turnstile_memory_store_max_keys`: the bound the shards share (`store.max_keys`, rounded
    /// down to a multiple of the shard count).
    max_keys: IntGauge,
    /// `turnstile_memory_store_overflow_checks_total`: checks decided by the overflow sketch.
    overflowed: IntCounter,
}

impl StoreGauges {
    fn new(max_keys: usize) -> Self {
        let gauge = |name: &str, help: &str| {
            IntGauge::new(name, help).unwrap_or_else(|e| panic!("metric {name}: {e}"))
        };
        let max = gauge(
            "turnstile_memory_store_max_keys",
            "Counters the memory store may hold (store.max_keys, rounded down to whole shards).",
        );
        max.set(i64::try_from(max_keys).unwrap_or(i64::MAX));
        let name = "turnstile_memory_store_overflow_checks_total";
        StoreGauges {
            keys: gauge(
                "turnstile_memory_store_keys",
                "Counters the memory store holds now, idle ones included until dropped.",
            ),
            max_keys: max,
            overflowed: IntCounter::new(
                name,
                "Checks the memory store decided in its overflow sketch: no room for a new \
                 counter, every one in use.",
            )
            .unwrap_or_else(|e| panic!("metric {name}: {e}")),
        }
    }
}

impl MemoryStore {
    /// `max_keys` bounds the number of counters; past it, idle counters make room, and keys that
    /// find none are counted in a fixed-size sketch that only over-counts.
    pub fn new(clock: Arc<dyn Clock>, max_keys: usize) -> Self {
        let max_keys = max_keys.max(1);
        let shards = (max_keys / MIN_KEYS_PER_SHARD).clamp(1, MAX_SHARDS);
        // Rounded down: the shards together never hold more than `max_keys`.
        let keys_per_shard = max_keys / shards;
        let width = keys_per_shard.clamp(OVERFLOW_WIDTH.0, OVERFLOW_WIDTH.1);
        MemoryStore {
            shards: (0..shards).map(|_| Mutex::new(Shard::new(width))).collect(),
            hasher: DefaultHashBuilder::default(),
            clock,
            keys_per_shard,
            gauges: StoreGauges::new(keys_per_shard * shards),
            queues: Mutex::default(),
            queued: AtomicUsize::new(0),
        }
    }

    /// Exports the store's key gauge, its bound and its overflow counter in `metrics`.
    pub fn register_metrics(&self, metrics: &crate::metrics::Metrics) {
        let g = &self.gauges;
        metrics.register(Box::new(g.keys.clone()));
        metrics.register(Box::new(g.max_keys.clone()));
        metrics.register(Box::new(g.overflowed.clone()));
    }

    /// Checks decided by the overflow sketch because the store was full of counters in use.
    pub fn overflowed(&self) -> u64 {
        self.gauges.overflowed.get()
    }

    /// Counters held, as `turnstile_memory_store_keys` exports it (no lock taken).
    pub fn keys(&self) -> u64 {
        u64::try_from(self.gauges.keys.get()).unwrap_or(0)
    }

    /// Live counters, idle ones included until the next sweep.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).table.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of the fixed structures (overflow sketches), for the memory bound's tests.
    pub fn overflow_bytes(&self) -> usize {
        self.shards
            .iter()
            .map(|s| lock(s).overflow.memory_bytes())
            .sum()
    }

    /// Checks all; consumes only if all allow (shadow checks aside, see [`Check::shadow`]).
    pub fn check(&self, checks: &[Check<'_>]) -> Decision {
        self.check_leased(checks, 0)
    }

    /// [`MemoryStore::check`], a concurrency check that commits taking lease `lease`.
    pub fn check_leased(&self, checks: &[Check<'_>], lease: u64) -> Decision {
        self.decide(checks, lease, self.clock.now_us())
    }

    /// [`MemoryStore::check_leased`] at `at`, a reading of the monotonic clock the caller took
    /// anyway (the engine, which times the decision with it).
    pub fn check_leased_at(&self, checks: &[Check<'_>], lease: u64, at: Instant) -> Decision {
        self.decide(checks, lease, self.clock.at(at))
    }

    fn decide(&self, checks: &[Check<'_>], lease: u64, now: u64) -> Decision {
        if checks.iter().any(|c| c.max_delay_us.is_some()) {
            return self.decide_paced(checks, lease, now);
        }
        if let [check] = checks {
            return self.check_one(check, lease, now);
        }
        // Scratch lists inline for the usual few checks: no allocation per decision.
        type Few<T> = SmallVec<[T; INLINE_CHECKS]>;
        let hashes: Few<u64> = checks.iter().map(|c| self.hasher.hash_one(c.key)).collect();
        let shard_of: Few<usize> = hashes.iter().map(|&h| self.shard_index(h)).collect();
        let mut order = shard_of.clone();
        order.sort_unstable();
        order.dedup();
        let mut guards: Few<(usize, MutexGuard<'_, Shard>)> =
            order.iter().map(|&i| (i, lock(&self.shards[i]))).collect();

        let mut outcomes = super::Outcomes::with_capacity(checks.len());
        let mut pending: Few<_> = SmallVec::with_capacity(checks.len());
        for ((check, &shard), &hash) in checks.iter().zip(&shard_of).zip(&hashes) {
            let (p, outcome) = self.evaluate(shard_mut(&mut guards, shard), hash, check, now);
            outcomes.push(outcome);
            pending.push(p);
        }
        let mut decision = Decision::from_checks(checks, outcomes);
        decision.stamps = pending.iter().map(|p| p.stamp(lease)).collect();
        if !decision.allowed {
            // Nothing is consumed, so the policies that would have allowed report the state
            // as it stays: the outcome of a zero-cost check.
            let all = checks.iter().zip(&shard_of).zip(&hashes).zip(&pending);
            for ((((check, &shard), &hash), p), outcome) in all.zip(&mut decision.outcomes) {
                if outcome.allowed && check.cost > 0 {
                    let peek = Check { cost: 0, ..*check };
                    let shard = shard_mut(&mut guards, shard);
                    *outcome = match p {
                        Pending::Overflow(_) => shard.overflow.evaluate(hash, peek.rule, now, 0).1,
                        _ => self.evaluate(shard, hash, &peek, now).1,
                    };
                }
            }
        }
        if decision.allowed {
            let all = checks.iter().zip(&shard_of).zip(&hashes).zip(pending);
            for (i, (((check, &shard), &hash), p)) in all.enumerate() {
                if decision.commits(i) {
                    let shard = shard_mut(&mut guards, shard);
                    commit(self, shard, hash, check, p, now, lease);
                }
            }
        }
        decision
    }

    /// A decision with paced checks (`on_limit: delay`, [`pacing`]): every check evaluated at
    /// `now`, each paced one's slot found, and the request admitted at the latest slot when that
    /// is within every paced check's `max_delay`; then each token bucket that paces and every
    /// window reserves at that slot, the other checks commit as usual. All or nothing, under the
    /// shards' locks, as [`MemoryStore::decide`].
    fn decide_paced(&self, checks: &[Check<'_>], lease: u64, now: u64) -> Decision {
        type Few<T> = SmallVec<[T; INLINE_CHECKS]>;
        let hashes: Few<u64> = checks.iter().map(|c| self.hasher.hash_one(c.key)).collect();
        let shard_of: Few<usize> = hashes.iter().map(|&h| self.shard_index(h)).collect();
        let mut order = shard_of.clone();
        order.sort_unstable();
        order.dedup();
        let mut guards: Few<(usize, MutexGuard<'_, Shard>)> =
            order.iter().map(|&i| (i, lock(&self.shards[i]))).collect();

        let mut outcomes = super::Outcomes::with_capacity(checks.len());
        let mut pending: Few<_> = SmallVec::with_capacity(checks.len());
        // Per check: (max delay, slot) when it paces.
        let mut paced: Few<Option<(u64, Option<u64>)>> = SmallVec::with_capacity(checks.len());
        let mut at = now;
        for ((check, &shard), &hash) in checks.iter().zip(&shard_of).zip(&hashes) {
            let shard = shard_mut(&mut guards, shard);
            let (p, outcome) = self.evaluate(shard, hash, check, now);
            let pace = check.max_delay_us.and_then(|max| {
                let entry = shard.table.find_mut(hash, |e| *e.key == *check.key)?;
                let slot = slot_of(entry, check, &p, now)?;
                Some((max, slot))
            });
            if let Some((_, Some(slot))) = pace {
                at = at.max(slot);
            }
            outcomes.push(outcome);
            pending.push(p);
            paced.push(pace);
        }
        for (outcome, pace) in outcomes.iter_mut().zip(&paced) {
            if let Some((max, slot)) = *pace {
                pacing::refused(outcome, slot, at, now, max);
            }
        }
        let mut decision = Decision::from_checks(checks, outcomes);
        // As decide.lua: the stamps of what each check read at `now` (a reservation at a slot
        // is given back by `unreserve`, with the slot).
        decision.stamps = pending.iter().map(|p| p.stamp(lease)).collect();
        if !decision.allowed {
            // As `decide`: the state as it stays; a paced check keeps its own verdict.
            let all = checks.iter().zip(&shard_of).zip(&hashes).zip(&pending);
            let all = all.zip(&paced).zip(&mut decision.outcomes);
            for (((((check, &shard), &hash), p), pace), outcome) in all {
                if (outcome.allowed || pace.is_some()) && check.cost > 0 {
                    let peek = Check {
                        cost: 0,
                        max_delay_us: None,
                        ..*check
                    };
                    let shard = shard_mut(&mut guards, shard);
                    let (allowed, retry_after_us) = (outcome.allowed, outcome.retry_after_us);
                    *outcome = match p {
                        Pending::Overflow(_) => shard.overflow.evaluate(hash, peek.rule, now, 0).1,
                        _ => self.evaluate(shard, hash, &peek, now).1,
                    };
                    if pace.is_some() {
                        outcome.allowed = allowed;
                        outcome.retry_after_us = retry_after_us;
                    }
                }
            }
            return decision;
        }
        let delayed = at > now;
        let all = checks.iter().zip(&shard_of).zip(&hashes).zip(pending);
        for (i, (((check, &shard), &hash), p)) in all.enumerate() {
            if !decision.commits(i) {
                continue;
            }
            let shard = shard_mut(&mut guards, shard);
            // A paced quota refused in its period takes the next one, even with no delay.
            let next_period = matches!(p, Pending::Quota(plan) if !plan.allowed);
            let reserved = (delayed || next_period) && check.cost > 0 && {
                let pace = paced[i].is_some();
                match shard.table.find_mut(hash, |e| *e.key == *check.key) {
                    Some(entry) => reserve(entry, check, &p, pace, at).map(|(outcome, stamp)| {
                        decision.outcomes[i] = outcome;
                        decision.stamps[i] = stamp;
                    }),
                    None => None,
                }
                .is_some()
            };
            if !reserved {
                commit(self, shard, hash, check, p, now, lease);
            }
        }
        if delayed {
            decision.delay_us = at - now;
            decision.slot_us = at;
        }
        decision
    }

    /// The common case, a route with one policy: one lock and none of the scratch vectors that
    /// ordering several locks needs. With one check a rejection consumes nothing anyway, so there
    /// is nothing to re-evaluate.
    fn check_one(&self, check: &Check<'_>, lease: u64, now: u64) -> Decision {
        let hash = self.hasher.hash_one(check.key);
        let mut shard = lock(&self.shards[self.shard_index(hash)]);
        let (pending, outcome) = self.evaluate(&mut shard, hash, check, now);
        let mut decision =
            Decision::from_checks(std::slice::from_ref(check), smallvec::smallvec![outcome]);
        decision.stamps.push(pending.stamp(lease));
        if decision.commits(0) {
            commit(self, &mut shard, hash, check, pending, now, lease);
        }
        decision
    }

    /// Each check's outcome as a decision of it would report it if it were not consumed
    /// (remaining and reset now; allowed and retry-after for its cost), changing nothing: no
    /// counter is created, refilled, pruned or requeued, and the overflow sketch is only read.
    /// Each counter is read under its own shard's lock; a peek needs no atomicity across them.
    pub fn peek(&self, checks: &[Check<'_>]) -> Decision {
        let now = self.clock.now_us();
        let outcomes: super::Outcomes = checks.iter().map(|c| self.peek_one(c, now)).collect();
        Decision::from_checks(checks, outcomes)
    }

    fn peek_one(&self, check: &Check<'_>, now: u64) -> Outcome {
        let hash = self.hasher.hash_one(check.key);
        let shard = lock(&self.shards[self.shard_index(hash)]);
        if let Some(entry) = shard.table.find(hash, |e| *e.key == *check.key) {
            // A counter kept under another rule: as `counter` would align it.
            return if check.rule.restarts_from(&entry.rule).is_none() {
                peek_state(&entry.state, check, now)
            } else {
                peek_state(&State::fresh(check.rule, now), check, now)
            };
        }
        // No counter: a decision would create one (charged with any overflow debt) where there
        // is room, or else be decided by the overflow sketch.
        let room = shard.table.len() < self.keys_per_shard
            || shard.idle_queue.peek().is_some_and(|&Reverse((at, h))| {
                at <= now
                    && shard
                        .table
                        .find(h, |e| e.hash == h && e.is_idle(now))
                        .is_some()
            });
        if !room {
            let (_, mut state) = shard.overflow.evaluate(hash, check.rule, now, 0);
            let (_, asked) = shard.overflow.evaluate(hash, check.rule, now, check.cost);
            state.allowed = asked.allowed;
            state.retry_after_us = asked.retry_after_us;
            return state;
        }
        let mut entry = Entry::new(check.key, hash, check.rule, now);
        let debt = shard.overflow.debt(hash, now);
        if debt > 0.0 {
            entry.charge(debt, now);
        }
        peek_state(&entry.state, check, now)
    }

    /// Consumes every check's cost whatever the counter holds (cost from the response, charged
    /// after the request was admitted): a bucket may go below zero, a window past its limit.
    pub fn charge(&self, checks: &[Check<'_>]) {
        let now = self.clock.now_us();
        for check in checks.iter().filter(|c| c.cost > 0) {
            let hash = self.hasher.hash_one(check.key);
            let mut shard = lock(&self.shards[self.shard_index(hash)]);
            let (pending, _) = self.evaluate(&mut shard, hash, check, now);
            commit(self, &mut shard, hash, check, pending, now, 0);
        }
    }

    /// Gives back every check's `cost` (the unused part of a reservation) from the consumption
    /// its stamp names ([`Decision::stamps`]): a bucket capped at its burst, a window's entry or
    /// bucket and a quota's period only while the counter still holds them. A counter no longer
    /// held (forgotten when idle), or whose state restarted under another rule since, has
    /// nothing to give back; concurrency checks are skipped.
    pub fn refund(&self, checks: &[(Check<'_>, u64)]) {
        for (check, stamp) in checks.iter().filter(|(c, _)| c.cost > 0) {
            let hash = self.hasher.hash_one(check.key);
            let mut shard = lock(&self.shards[self.shard_index(hash)]);
            let Some(entry) = shard.table.find_mut(hash, |e| *e.key == *check.key) else {
                continue;
            };
            if entry.rule.restarts_from(check.rule).is_some() {
                continue;
            }
            match (&mut entry.state, check.rule) {
                (State::Bucket(state), Rule::TokenBucket(tb)) => state.refund(tb, check.cost),
                (State::Log(log), Rule::SlidingWindow(_)) => log.refund(*stamp, check.cost),
                (State::Buckets(buckets), Rule::SlidingWindow(_)) => {
                    buckets.refund(*stamp, check.cost)
                }
                (State::Quota(count), Rule::Quota(_)) => count.refund(*stamp, check.cost),
                _ => {}
            }
        }
    }

    /// Gives back a delayed decision's reservation made at slot `at` (its request went away
    /// before the slot): the units every window recorded at `at`, every token bucket's cost
    /// (capped at the burst) but a paced bucket's only while no reservation was made behind it
    /// (`docs/algorithms.md`, "Pacing"), a paced quota's units in the period of its stamp. Other
    /// quotas and leases are not given back here (a lease goes with its request's guard).
    pub fn unreserve(&self, checks: &[(Check<'_>, u64)], at: u64) {
        for (check, stamp) in checks.iter().filter(|(c, _)| c.cost > 0) {
            let hash = self.hasher.hash_one(check.key);
            let mut shard = lock(&self.shards[self.shard_index(hash)]);
            let Some(entry) = shard.table.find_mut(hash, |e| *e.key == *check.key) else {
                continue;
            };
            match (&mut entry.state, check.rule) {
                // A paced bucket's reservation only while it is the latest: one behind it was
                // placed from this state, and the bucket may have been full in between.
                (State::Bucket(state), Rule::TokenBucket(tb))
                    if check.max_delay_us.is_none() || state.ts == at =>
                {
                    state.refund(tb, check.cost)
                }
                (State::Log(log), Rule::SlidingWindow(_)) => log.unreserve(at, check.cost),
                (State::Buckets(buckets), Rule::SlidingWindow(sw)) => {
                    let width = sw.window_us / u64::from(sw.buckets);
                    buckets.unreserve(at / width, check.cost);
                }
                (State::Quota(count), Rule::Quota(_)) if check.max_delay_us.is_some() => {
                    count.refund(*stamp, check.cost)
                }
                _ => {}
            }
        }
    }

    /// Extends lease `lease` on every concurrency check of `checks` to now + its TTL.
    pub fn renew(&self, checks: &[Check<'_>], lease: u64) {
        let now = self.clock.now_us();
        for check in checks {
            let Rule::Concurrency(cc) = check.rule else {
                continue;
            };
            let hash = self.hasher.hash_one(check.key);
            let mut shard = lock(&self.shards[self.shard_index(hash)]);
            if let Some(entry) = shard.table.find_mut(hash, |e| *e.key == *check.key) {
                if let State::Leases(leases) = &mut entry.state {
                    leases.renew(cc, now, lease);
                }
            }
        }
    }

    /// Gives back lease `lease` on every concurrency check of `checks` (the others are skipped),
    /// handing each lease that comes free to the oldest live waiter of its key
    /// ([`lease_queue`]). Returns the leases handed on, in order.
    pub fn release(&self, checks: &[Check<'_>], lease: u64) -> Vec<u64> {
        let mut handed = Vec::new();
        for check in checks {
            let Rule::Concurrency(cc) = check.rule else {
                continue;
            };
            let now = self.clock.now_us();
            let hash = self.hasher.hash_one(check.key);
            let mut shard = lock(&self.shards[self.shard_index(hash)]);
            if let Some(entry) = shard.table.find_mut(hash, |e| *e.key == *check.key) {
                if let State::Leases(leases) = &mut entry.state {
                    leases.release(lease);
                    if self.queued.load(Ordering::Acquire) > 0 {
                        self.hand_on(check.key, leases, cc, now, &mut handed);
                    }
                }
            }
        }
        handed
    }

    /// Waits for a lease on the concurrency check `check` (its counter full when the request was
    /// decided): granted at once under `lease` when one is free and nobody queues before it,
    /// else queued for at most `max_delay_us` ([`lease_queue`]).
    pub fn enqueue(&self, check: &Check<'_>, lease: u64, max_delay_us: u64) -> Enqueued {
        let Rule::Concurrency(cc) = check.rule else {
            return Enqueued::Refused;
        };
        let now = self.clock.now_us();
        let hash = self.hasher.hash_one(check.key);
        let mut shard = lock(&self.shards[self.shard_index(hash)]);
        let Some(entry) = self.counter(&mut shard, hash, check, now) else {
            return Enqueued::Refused;
        };
        let State::Leases(leases) = &mut entry.state else {
            return Enqueued::Refused;
        };
        // A lease that expired since is handed to those already waiting first.
        self.hand_on(check.key, leases, cc, now, &mut Vec::new());
        let plan = leases.eval(cc, now, 1);
        if plan.allowed {
            leases.commit(cc, &plan, lease);
            return Enqueued::Granted;
        }
        let (wake, woken) = tokio::sync::oneshot::channel();
        let waiter = Waiter {
            lease,
            deadline_us: now.saturating_add(max_delay_us),
            wake,
        };
        lock(&self.queues)
            .entry(check.key.into())
            .or_default()
            .push_back(waiter);
        self.queued.fetch_add(1, Ordering::AcqRel);
        Enqueued::Queued(Ticket::new(woken, String::new()))
    }

    /// A waiter for lease `lease` on `check` gives up: its ticket leaves the queue, and if it was
    /// handed the lease already, the lease is released (and handed on).
    pub fn leave(&self, check: &Check<'_>, lease: u64) -> Vec<u64> {
        {
            let hash = self.hasher.hash_one(check.key);
            let _shard = lock(&self.shards[self.shard_index(hash)]);
            let mut queues = lock(&self.queues);
            if let Some(queue) = queues.get_mut(check.key) {
                if let Some(i) = queue.iter().position(|w| w.lease == lease) {
                    queue.remove(i);
                    self.queued.fetch_sub(1, Ordering::AcqRel);
                    if queue.is_empty() {
                        queues.remove(check.key);
                    }
                    return Vec::new();
                }
            }
        }
        // Off the queue already: handed the lease (or dropped past its deadline, when the
        // release below finds nothing to give back).
        self.release(std::slice::from_ref(check), lease)
    }

    /// [`lease_queue::hand_on`] on `key`'s queue, under its shard's lock.
    fn hand_on(
        &self,
        key: &str,
        leases: &mut Leases,
        rule: &super::Concurrency,
        now: u64,
        handed: &mut Vec<u64>,
    ) {
        let mut queues = lock(&self.queues);
        let Some(queue) = queues.get_mut(key) else {
            return;
        };
        let taken = lease_queue::hand_on(leases, rule, now, queue, handed);
        self.queued.fetch_sub(taken, Ordering::AcqRel);
        if queue.is_empty() {
            queues.remove(key);
        }
    }

    /// Tickets queued for a lease now, on every key (the memory a waiter holds, tests).
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Acquire)
    }

    /// Phase one for one check: its counter's outcome, or the overflow's when there is no room.
    fn evaluate(
        &self,
        shard: &mut Shard,
        hash: u64,
        check: &Check<'_>,
        now: u64,
    ) -> (Pending, Outcome) {
        match self.counter(shard, hash, check, now) {
            Some(entry) => evaluate(entry, check, now),
            None => {
                self.gauges.overflowed.inc();
                let (after, outcome) = shard.overflow.evaluate(hash, check.rule, now, check.cost);
                (Pending::Overflow(after), outcome)
            }
        }
    }

    /// Drops idle counters. Called periodically; holds one shard lock at a time.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now_us();
        let mut removed = 0;
        for shard in self.shards.iter() {
            let mut shard = lock(shard);
            let before = shard.table.len();
            shard.table.retain(|e| !e.is_idle(now));
            removed += before - shard.table.len();
            shard.rebuild_queue();
        }
        self.gauges
            .keys
            .sub(i64::try_from(removed).unwrap_or(i64::MAX));
        removed
    }

    /// The high half of the hash, so the shard does not correlate with the table's own bits.
    fn shard_index(&self, hash: u64) -> usize {
        ((hash >> 32) as usize) % self.shards.len()
    }

    /// The check's counter, created if there is room (or an idle counter to make room); `None`
    /// when the shard is full of counters in use.
    fn counter<'s>(
        &self,
        shard: &'s mut Shard,
        hash: u64,
        check: &Check<'_>,
        now: u64,
    ) -> Option<&'s mut Entry> {
        let Shard {
            table,
            idle_queue,
            overflow,
        } = shard;
        let entry = match table.find_entry(hash, |e| *e.key == *check.key) {
            Ok(found) => found.into_mut(),
            Err(absent) => {
                let table = absent.into_table();
                if table.len() < self.keys_per_shard {
                    // One more counter; one made room for by dropping an idle one is not.
                    self.gauges.keys.inc();
                } else if !make_room(table, idle_queue, now) {
                    return None;
                }
                if idle_queue.len() > 2 * self.keys_per_shard + 64 {
                    // Entries of removed counters piled up: start again from the table.
                    let items: Vec<_> = table
                        .iter()
                        .map(|e| Reverse((e.idle_at(), e.hash)))
                        .collect();
                    *idle_queue = BinaryHeap::from(items);
                }
                let mut entry = Entry::new(check.key, hash, check.rule, now);
                let debt = overflow.debt(hash, now);
                if debt > 0.0 {
                    entry.charge(debt, now);
                }
                idle_queue.push(Reverse((first_idle_at(&entry, check, now), hash)));
                return Some(table.insert_unique(hash, entry, |e| e.hash).into_mut());
            }
        };
        if entry.rule != *check.rule {
            // The config changed under this counter: keep state that means the same thing.
            let keeps_state = match (entry.rule, check.rule) {
                (Rule::TokenBucket(_), Rule::TokenBucket(_)) => true,
                (Rule::Concurrency(_), Rule::Concurrency(_)) => true,
                (Rule::SlidingWindow(old), Rule::SlidingWindow(new)) => {
                    (old.buckets == 0 && new.buckets == 0)
                        || (old.buckets == new.buckets && old.window_us == new.window_us)
                }
                // The same period in the same zone: the units used so far still count.
                (Rule::Quota(old), Rule::Quota(new)) => {
                    old.per == new.per && old.time_zone == new.time_zone
                }
                _ => false,
            };
            entry.rule = *check.rule;
            if !keeps_state {
                entry.state = State::fresh(check.rule, now);
            }
        }
        Some(entry)
    }
}

/// When a counter created for `check` becomes idle once the check commits: its queue time. A new
/// counter nearly always commits its first check, and queueing it at that time rather than `now`
/// spares the queue a correction per key when a full store is flooded. If it does not commit, the
/// counter is found later than it could be (by the sweeper at the latest): never too early.
fn first_idle_at(entry: &Entry, check: &Check<'_>, now: u64) -> u64 {
    let idle_at = entry.idle_at().max(now);
    match check.rule {
        _ if check.cost == 0 => idle_at,
        Rule::TokenBucket(tb) => {
            idle_at.saturating_add((check.cost as f64 * 1e6 / tb.rate).floor() as u64)
        }
        Rule::SlidingWindow(sw) => idle_at.max(now.saturating_add(sw.window_us)),
        Rule::Concurrency(cc) => idle_at.max(now.saturating_add(cc.lease_ttl_us)),
        Rule::Quota(q) => idle_at.max(super::calendar::period(q.per, q.time_zone, now).end),
    }
}

/// Frees one slot by dropping a counter that is idle at `now`, found from the front of the idle
/// queue in at most [`MAX_QUEUE_STEPS`] steps. False when none is (or none was found in time).
fn make_room(
    table: &mut HashTable<Entry>,
    queue: &mut BinaryHeap<Reverse<(u64, u64)>>,
    now: u64,
) -> bool {
    for _ in 0..MAX_QUEUE_STEPS {
        let Some(&Reverse((at, hash))) = queue.peek() else {
            return false;
        };
        if at > now {
            return false;
        }
        queue.pop();
        // Several keys may share a hash (rarely): any idle one of them will do.
        if let Ok(found) = table.find_entry(hash, |e| e.hash == hash && e.is_idle(now)) {
            found.remove();
            return true;
        }
        // Not idle yet (it consumed since it was queued): requeue it at its real time.
        if let Some(entry) = table.find(hash, |e| e.hash == hash) {
            queue.push(Reverse((entry.idle_at().max(now + 1), hash)));
        }
    }
    false
}

fn evaluate(entry: &mut Entry, check: &Check<'_>, now: u64) -> (Pending, Outcome) {
    match (&mut entry.state, check.rule) {
        (State::Bucket(state), Rule::TokenBucket(tb)) => {
            let (refilled, outcome) = state.evaluate(tb, now, check.cost);
            (Pending::Bucket(refilled), outcome)
        }
        (State::Log(log), Rule::SlidingWindow(sw)) => {
            let (at, outcome) = log.evaluate(sw, now, check.cost);
            (Pending::Log(at), outcome)
        }
        (State::Buckets(buckets), Rule::SlidingWindow(sw)) => {
            let (current, outcome) = buckets.evaluate(sw, now, check.cost);
            (Pending::Buckets(current), outcome)
        }
        (State::Leases(leases), Rule::Concurrency(cc)) => {
            let plan = leases.eval(cc, now, check.cost);
            let outcome = leases.outcome(cc, &plan, plan.allowed);
            (Pending::Leases(plan), outcome)
        }
        (State::Quota(count), Rule::Quota(q)) => {
            let (plan, outcome) = count.evaluate(q, now, check.cost);
            (Pending::Quota(plan), outcome)
        }
        // `entry()` always aligns state with rule; this arm only keeps the match total.
        _ => {
            entry.rule = *check.rule;
            entry.state = State::fresh(check.rule, now);
            evaluate(entry, check, now)
        }
    }
}

/// The outcome of `check` on `state` at `now`, not consumed: the algorithm's `eval` and
/// `outcome(plan, false)`, as a decision that refused the request reports it. The states whose
/// `eval` prunes expired entries are evaluated on a copy.
fn peek_state(state: &State, check: &Check<'_>, now: u64) -> Outcome {
    let cost = check.cost;
    match (state, check.rule) {
        (State::Bucket(s), Rule::TokenBucket(tb)) => s.eval(tb, now, cost).outcome(tb, false),
        (State::Log(s), Rule::SlidingWindow(sw)) => {
            let mut log = s.clone();
            let plan = log.eval(sw, now, cost);
            log.outcome(sw, &plan, false)
        }
        (State::Buckets(s), Rule::SlidingWindow(sw)) => {
            let mut buckets = s.clone();
            let plan = buckets.eval(sw, now, cost);
            buckets.outcome(sw, &plan, false)
        }
        (State::Leases(s), Rule::Concurrency(cc)) => {
            let mut leases = s.clone();
            let plan = leases.eval(cc, now, cost);
            leases.outcome(cc, &plan, false)
        }
        (State::Quota(s), Rule::Quota(q)) => s.evaluate(q, now, cost).0.outcome(q, false),
        // A state of another layout than the rule's: a fresh one always matches.
        _ => peek_state(&State::fresh(check.rule, now), check, now),
    }
}

/// Phase two for one check: consumes what phase one evaluated.
fn commit(
    store: &MemoryStore,
    shard: &mut Shard,
    hash: u64,
    check: &Check<'_>,
    pending: Pending,
    now: u64,
    lease: u64,
) {
    if check.cost == 0 {
        return;
    }
    if let Pending::Overflow(after) = pending {
        shard.overflow.commit(hash, now, after);
        return;
    }
    if shard.table.find(hash, |e| *e.key == *check.key).is_none() {
        // Another check of this decision made room by dropping this counter, which was idle
        // (full) when evaluated: recreate it, or count the request in the overflow.
        if store.counter(shard, hash, check, now).is_none() {
            let (after, _) = shard.overflow.evaluate(hash, check.rule, now, check.cost);
            shard.overflow.commit(hash, now, after);
            return;
        }
    }
    let Some(entry) = shard.table.find_mut(hash, |e| *e.key == *check.key) else {
        return;
    };
    match (&mut entry.state, pending) {
        (State::Bucket(state), Pending::Bucket(mut refilled)) => {
            refilled.consume(check.cost);
            *state = refilled;
        }
        (State::Log(log), Pending::Log(at)) => log.consume(at, check.cost),
        (State::Buckets(buckets), Pending::Buckets(current)) => {
            buckets.consume(current, check.cost)
        }
        (State::Leases(leases), Pending::Leases(plan)) => {
            if let Rule::Concurrency(cc) = check.rule {
                leases.commit(cc, &plan, lease);
            }
        }
        (State::Quota(count), Pending::Quota(plan)) => count.commit(&plan),
        _ => {}
    }
}

/// A paced check's slot (`pacing`), from what phase one left in its counter: `None` when its
/// kind does not pace (or the overflow sketch decided it), else the slot, itself `None` when no
/// wait would ever admit the cost.
fn slot_of(entry: &mut Entry, check: &Check<'_>, p: &Pending, now: u64) -> Option<Option<u64>> {
    match (&mut entry.state, check.rule, p) {
        (State::Bucket(_), Rule::TokenBucket(tb), Pending::Bucket(refilled)) => {
            Some(pacing::bucket_slot(tb, &bucket_plan(refilled, check.cost)))
        }
        (State::Log(log), Rule::SlidingWindow(sw), Pending::Log(_)) => {
            let plan = log.eval(sw, now, check.cost);
            Some(pacing::log_slot(log, sw, &plan))
        }
        (State::Buckets(buckets), Rule::SlidingWindow(sw), Pending::Buckets(_)) => {
            let plan = buckets.eval(sw, now, check.cost);
            Some(pacing::buckets_slot(buckets, sw, &plan))
        }
        (State::Quota(_), Rule::Quota(q), Pending::Quota(plan)) => Some(pacing::quota_slot(
            q,
            plan,
            pacing::next_period(q, plan.period),
        )),
        _ => None,
    }
}

/// The plan phase one's refilled bucket stands for (`BucketState::eval` at its time).
fn bucket_plan(refilled: &BucketState, cost: u64) -> BucketPlan {
    BucketPlan {
        tokens: refilled.tokens,
        ts: refilled.ts,
        cost,
        allowed: refilled.tokens >= cost as f64,
    }
}

/// Reserves a delayed decision's check at its slot `at`: a token bucket that paces, every
/// window (a window counts the request when it passes), and a paced quota whose slot is its next
/// period (delayed or not: a store clock past the gateway's period end admits it at once),
/// returning its outcome and refund stamp (as decide.lua stamps it). `None`: the check commits
/// as usual.
fn reserve(
    entry: &mut Entry,
    check: &Check<'_>,
    p: &Pending,
    paces: bool,
    at: u64,
) -> Option<(Outcome, u64)> {
    match (&mut entry.state, check.rule, p) {
        (State::Bucket(state), Rule::TokenBucket(tb), Pending::Bucket(refilled)) if paces => {
            let (reserved, outcome) =
                pacing::bucket_reserve(tb, &bucket_plan(refilled, check.cost), at);
            *state = reserved;
            Some((outcome, 0))
        }
        (State::Log(log), Rule::SlidingWindow(sw), Pending::Log(_)) => {
            Some(pacing::log_reserve(log, sw, check.cost, at))
        }
        (State::Buckets(buckets), Rule::SlidingWindow(sw), Pending::Buckets(_)) => {
            Some(pacing::buckets_reserve(buckets, sw, check.cost, at))
        }
        (State::Quota(count), Rule::Quota(q), Pending::Quota(plan)) if paces && !plan.allowed => {
            let next = pacing::next_period(q, plan.period)?;
            Some(pacing::quota_reserve(count, q, plan, next, at))
        }
        _ => None,
    }
}

/// The locked shard `shard` among `guards` (which hold every shard the decision touches).
fn shard_mut<'g>(guards: &'g mut [(usize, MutexGuard<'_, Shard>)], shard: usize) -> &'g mut Shard {
    let pos = guards.iter().position(|(i, _)| *i == shard).unwrap_or(0);
    &mut guards[pos].1
}

/// A poisoned shard only means another request panicked mid-update; the counters are still
/// usable, and refusing service would turn one bug into an outage.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
#[path = "memory_tests.rs"]
mod tests;
