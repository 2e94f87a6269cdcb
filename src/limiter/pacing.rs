//! Pacing: a policy with `on_limit: delay` admits a request it would refuse when a slot is free
//! within `max_delay`, reserving that slot in the same atomic decision (`docs/algorithms.md`,
//! "Pacing"). The slot is the earliest time the algorithm could admit the request, given every
//! reservation already made; the request waits for the latest slot of its policies and reserves
//! in all of them at that time, or in none.
//!
//! Pure functions over the states of [`super::algorithm`], as decide.lua's `*_slot` and
//! `*_reserve`: `slot` reads a plan (the state evaluated at the decision's time), `reserve`
//! writes the request at the slot and returns the outcome it is admitted with, which is the
//! outcome of the same request decided alone at the slot.

use super::algorithm::{
    ceil_us, BucketPlan, BucketState, BucketsPlan, LogPlan, QuotaCount, QuotaPlan, WindowBuckets,
    WindowLog, MAX_US,
};
use super::calendar::{self, Period};
use super::{Outcome, Quota, SlidingWindow, TokenBucket};

const MICROS: f64 = 1_000_000.0;

/// The earliest time a token bucket admits `plan`'s cost (decide.lua's `tb_slot`): the plan's
/// own time when the tokens are there (later than now while earlier reservations wait), else
/// when they will have refilled. `None`: never (a cost above the burst).
pub fn bucket_slot(rule: &TokenBucket, plan: &BucketPlan) -> Option<u64> {
    if plan.allowed {
        Some(plan.ts)
    } else if plan.cost > rule.burst {
        None
    } else {
        let wait = ceil_us((plan.cost as f64 - plan.tokens) * MICROS / rule.rate);
        Some(plan.ts.saturating_add(wait))
    }
}

/// Reserves `plan`'s cost at `at` (at or after the plan's time; decide.lua's `tb_reserve`): the
/// bucket refilled to `at`, less the cost, kept as of `at`, so that every later request is
/// evaluated from there and waits behind this one.
pub fn bucket_reserve(rule: &TokenBucket, plan: &BucketPlan, at: u64) -> (BucketState, Outcome) {
    let elapsed = at.saturating_sub(plan.ts) as f64;
    let tokens = (rule.burst as f64).min(plan.tokens + elapsed * rule.rate / MICROS);
    let at_slot = BucketPlan {
        tokens,
        ts: at.max(plan.ts),
        cost: plan.cost,
        allowed: true,
    };
    let outcome = at_slot.outcome(rule, true);
    let state = BucketState {
        tokens: tokens - plan.cost as f64,
        ts: at_slot.ts,
    };
    (state, outcome)
}

/// The earliest time an exact window admits `plan`'s cost (decide.lua's `sw_slot`): the plan's
/// time when it fits, else when the oldest entries that free enough units leave the window.
pub fn log_slot(log: &WindowLog, rule: &SlidingWindow, plan: &LogPlan) -> Option<u64> {
    if plan.allowed {
        Some(plan.now)
    } else if plan.cost > rule.limit {
        None
    } else {
        let wait = log.outcome(rule, plan, false).retry_after_us;
        Some(plan.now.saturating_add(wait))
    }
}

/// Records `cost` at `at` (at or after every entry; decide.lua's `sw_reserve`) and returns the
/// outcome of the request decided at `at`, with its refund stamp (the time written).
pub fn log_reserve(
    log: &mut WindowLog,
    rule: &SlidingWindow,
    cost: u64,
    at: u64,
) -> (Outcome, u64) {
    let plan = LogPlan {
        allowed: true,
        ..log.eval(rule, at, cost)
    };
    let outcome = log.outcome(rule, &plan, true);
    log.commit(&plan);
    (outcome, plan.now)
}

/// The earliest time a bucketed window admits `plan`'s cost (decide.lua's `swb_slot`): the start
/// of the plan's bucket (later than now while reservations fill later buckets) when it fits,
/// else when the oldest buckets that free enough units leave the window.
pub fn buckets_slot(
    buckets: &WindowBuckets,
    rule: &SlidingWindow,
    plan: &BucketsPlan,
) -> Option<u64> {
    let width = rule.window_us / u64::from(rule.buckets);
    if plan.allowed {
        Some(plan.now.max(plan.current.saturating_mul(width)))
    } else if plan.cost > rule.limit {
        None
    } else {
        let wait = buckets.outcome(rule, plan, false).retry_after_us;
        Some(plan.now.saturating_add(wait))
    }
}

/// Records `cost` in the bucket of `at` (decide.lua's `swb_reserve`) and returns the outcome of
/// the request decided at `at`, with its refund stamp (the bucket's index).
pub fn buckets_reserve(
    buckets: &mut WindowBuckets,
    rule: &SlidingWindow,
    cost: u64,
    at: u64,
) -> (Outcome, u64) {
    let plan = BucketsPlan {
        allowed: true,
        ..buckets.eval(rule, at, cost)
    };
    let outcome = buckets.outcome(rule, &plan, true);
    buckets.commit(&plan);
    (outcome, plan.current)
}

/// The period after `current`, as the gateway computes it (`calendar::period` at `current`'s
/// end): what a paced quota reserves in. `None` where the local clock makes that period start
/// elsewhere (an hour across a half-hour DST change): such a quota does not pace there.
pub fn next_period(rule: &Quota, current: Period) -> Option<Period> {
    let next = calendar::period(rule.per, rule.time_zone, current.end);
    (next.start == current.end).then_some(next)
}

/// The earliest time a quota admits `plan`'s cost (decide.lua's `q_slot`): now when it fits,
/// else the start of the next period (`next`, the gateway's) when the units already reserved
/// there leave room for it. A quota paces only across one period boundary: `None` when the
/// next period is full too, or the cost is above the limit.
pub fn quota_slot(rule: &Quota, plan: &QuotaPlan, next: Option<Period>) -> Option<u64> {
    if plan.allowed {
        Some(plan.now)
    } else if next.is_some() && plan.next.saturating_add(plan.cost) <= rule.limit {
        Some(plan.period.end)
    } else {
        None
    }
}

/// Reserves `plan`'s cost in the next period (`next`; decide.lua's `q_reserve`), for a quota
/// whose slot was that period's start, and returns the outcome of the request decided at `at`
/// in that period, with its refund stamp (the next period's start).
pub fn quota_reserve(
    count: &mut QuotaCount,
    rule: &Quota,
    plan: &QuotaPlan,
    next: Period,
    at: u64,
) -> (Outcome, u64) {
    let reserved = plan.next + plan.cost;
    *count = QuotaCount {
        period: Some(plan.period),
        used: plan.used,
        next: reserved,
        next_end: next.end,
    };
    let outcome = Outcome {
        allowed: true,
        limit: rule.limit,
        remaining: rule.limit.saturating_sub(reserved),
        reset_us: if reserved > 0 {
            next.end.saturating_sub(at)
        } else {
            0
        },
        retry_after_us: 0,
    };
    (outcome, next.start)
}

/// A paced check's own verdict once the decision's slot `at` is known (decide.lua's
/// `paced_outcome`): allowed when it has a slot and `at` is within its `max_delay` of `now`;
/// otherwise refused, with the time until the latest slot would be within its bound (or the
/// algorithm's own wait when it has no slot at all).
pub fn refused(outcome: &mut Outcome, slot: Option<u64>, at: u64, now: u64, max_delay_us: u64) {
    let delay = at.saturating_sub(now);
    outcome.allowed = slot.is_some() && delay <= max_delay_us;
    outcome.retry_after_us = match slot {
        _ if outcome.allowed => 0,
        Some(_) => (delay - max_delay_us).min(MAX_US),
        None => outcome.retry_after_us,
    };
}
