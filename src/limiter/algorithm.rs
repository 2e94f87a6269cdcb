//! The algorithm spec in Rust: pure functions from (state, now, rule, cost) to an outcome.
//!
//! `docs/algorithms.md` is the normative text; `scripts/decide.lua` implements the same formulas in
//! the same order for Redis, function for function: each algorithm has `eval` (read the state,
//! check the cost), `outcome` (given whether the decision consumed it) and `commit` (write it),
//! as the script's `*_eval`, `*_outcome` and `*_commit`; both clamp durations at [`MAX_US`].
//! Nothing here reads a clock or takes a lock, so every branch is testable with hand-picked
//! timestamps.

use std::collections::VecDeque;

use super::calendar::{self, Period};
use super::{Outcome, Quota, SlidingWindow, TokenBucket};

const MICROS: f64 = 1_000_000.0;

/// Token bucket state. `tokens` keeps its fraction so a steady stream is never starved by rounding.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketState {
    pub tokens: f64,
    pub ts: u64,
}

/// What [`BucketState::eval`] learned (decide.lua's `tb_eval`): the state refilled to `now`, and
/// whether `cost` fits.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketPlan {
    pub tokens: f64,
    pub ts: u64,
    pub cost: u64,
    pub allowed: bool,
}

impl BucketState {
    /// A bucket nobody has touched is full.
    pub fn full(rule: &TokenBucket, now: u64) -> Self {
        BucketState {
            tokens: rule.burst as f64,
            ts: now,
        }
    }

    /// Refills to `now` and checks `cost`, changing nothing.
    pub fn eval(&self, rule: &TokenBucket, now: u64, cost: u64) -> BucketPlan {
        let burst = rule.burst as f64;
        let elapsed = now.saturating_sub(self.ts) as f64;
        let tokens = burst.min(self.tokens + elapsed * rule.rate / MICROS);
        BucketPlan {
            tokens,
            ts: now.max(self.ts),
            cost,
            allowed: tokens >= cost as f64,
        }
    }

    /// [`BucketState::eval`] and the outcome of a request decided alone (consumed if allowed).
    /// Returns the refilled state, to [`BucketState::consume`] from.
    pub fn evaluate(&self, rule: &TokenBucket, now: u64, cost: u64) -> (BucketState, Outcome) {
        let plan = self.eval(rule, now, cost);
        let outcome = plan.outcome(rule, plan.allowed);
        let state = BucketState {
            tokens: plan.tokens,
            ts: plan.ts,
        };
        (state, outcome)
    }

    /// Consumes `cost` from a state returned by [`BucketState::evaluate`] that allowed it.
    pub fn consume(&mut self, cost: u64) {
        self.tokens -= cost as f64;
    }

    /// Writes a plan that was consumed (decide.lua's `tb_commit`).
    pub fn commit(&mut self, plan: &BucketPlan) {
        self.tokens = plan.tokens - plan.cost as f64;
        self.ts = plan.ts;
    }

    /// Gives back `units` a reservation took and did not use (decide.lua's `refund` of a `tb`
    /// key): added to the tokens as stored, before any refill, and capped at the burst, so a
    /// refund never lifts the bucket above what it would hold had the units never been taken.
    pub fn refund(&mut self, rule: &TokenBucket, units: u64) {
        self.tokens = (self.tokens + units as f64).min(rule.burst as f64);
    }

    /// A full bucket holds no information: the store may forget it.
    pub fn is_idle(&self, rule: &TokenBucket, now: u64) -> bool {
        let elapsed = now.saturating_sub(self.ts) as f64;
        self.tokens + elapsed * rule.rate / MICROS >= rule.burst as f64
    }

    /// When the bucket is full again if nothing more is consumed (to the microsecond, up to
    /// rounding: [`BucketState::is_idle`] has the last word).
    pub fn idle_at(&self, rule: &TokenBucket) -> u64 {
        self.ts.saturating_add(ceil_us(
            (rule.burst as f64 - self.tokens) * MICROS / rule.rate,
        ))
    }
}

impl BucketPlan {
    /// The outcome, `consumed` or not (decide.lua's `tb_outcome`): a request the decision
    /// rejected reports the bucket as it stays.
    pub fn outcome(&self, rule: &TokenBucket, consumed: bool) -> Outcome {
        let burst = rule.burst as f64;
        let cost = self.cost as f64;
        let after = if consumed {
            self.tokens - cost
        } else {
            self.tokens
        };
        let reset_us = ceil_us((burst - after) * MICROS / rule.rate);
        let retry_after_us = if self.allowed {
            0
        } else if cost > burst {
            reset_us
        } else {
            ceil_us((cost - self.tokens) * MICROS / rule.rate)
        };
        Outcome {
            allowed: self.allowed,
            limit: rule.burst,
            remaining: after.floor() as u64,
            reset_us,
            retry_after_us,
        }
    }
}

/// Exact sliding log: the units admitted at each distinct time, oldest first, and their total.
///
/// One entry per time at which units were admitted, whatever the units (decide.lua keeps one
/// sorted-set member per time in the same way): a decision or a charge of any cost adds at most
/// one entry, and every operation but the `retry_after` walk is O(1) amortised.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WindowLog {
    /// (time, units): times strictly increasing, units at least 1 (0 only for a paced
    /// reservation given back, [`WindowLog::unreserve`]).
    entries: VecDeque<(u64, u64)>,
    /// The sum of the entries' units.
    total: u64,
}

/// What [`WindowLog::eval`] learned (decide.lua's `sw_eval`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogPlan {
    /// The time the log runs on, which never goes backwards.
    pub now: u64,
    pub count: u64,
    pub cost: u64,
    pub allowed: bool,
}

impl WindowLog {
    /// Drops expired entries and checks `cost` at `now`, consuming nothing.
    pub fn eval(&mut self, rule: &SlidingWindow, now: u64, cost: u64) -> LogPlan {
        let now = self
            .entries
            .back()
            .map_or(now, |&(newest, _)| now.max(newest));
        if let Some(cutoff) = now.checked_sub(rule.window_us) {
            while let Some(&(ts, units)) = self.entries.front() {
                if ts > cutoff {
                    break;
                }
                self.total = self.total.saturating_sub(units);
                self.entries.pop_front();
            }
        }
        let count = self.total;
        LogPlan {
            now,
            count,
            cost,
            allowed: count.saturating_add(cost) <= rule.limit,
        }
    }

    /// The outcome of `plan`, `consumed` or not (decide.lua's `sw_outcome`).
    pub fn outcome(&self, rule: &SlidingWindow, plan: &LogPlan, consumed: bool) -> Outcome {
        let LogPlan {
            now, count, cost, ..
        } = *plan;
        let after = if consumed {
            count.saturating_add(cost)
        } else {
            count
        };
        let newest = if consumed && cost > 0 {
            Some(now)
        } else {
            // An emptied entry (`unreserve`) restores nothing.
            self.entries.back().map(|&(ts, _)| ts).filter(|_| count > 0)
        };
        let reset_us = newest.map_or(0, |ts| ts + rule.window_us - now);
        let retry_after_us = if plan.allowed {
            0
        } else if cost > rule.limit {
            rule.window_us
        } else {
            // The oldest entries leave first: wait for the one that frees enough units.
            let excess = count.saturating_add(cost) - rule.limit;
            let mut freed = 0u64;
            let mut retry = rule.window_us;
            for &(ts, units) in &self.entries {
                freed = freed.saturating_add(units);
                if freed >= excess {
                    retry = ts + rule.window_us - now;
                    break;
                }
            }
            retry
        };
        Outcome {
            allowed: plan.allowed,
            limit: rule.limit,
            remaining: rule.limit.saturating_sub(after),
            reset_us,
            retry_after_us,
        }
    }

    /// [`WindowLog::eval`] and the outcome of a request decided alone (consumed if allowed).
    /// Returns the time to [`WindowLog::consume`] at.
    pub fn evaluate(&mut self, rule: &SlidingWindow, now: u64, cost: u64) -> (u64, Outcome) {
        let plan = self.eval(rule, now, cost);
        (plan.now, self.outcome(rule, &plan, plan.allowed))
    }

    /// Records `cost` units admitted at `now` (the time returned by [`WindowLog::evaluate`], never
    /// before the newest entry): added to the newest entry when it has that time, else one new
    /// entry.
    pub fn consume(&mut self, now: u64, cost: u64) {
        if cost == 0 {
            return;
        }
        self.total = self.total.saturating_add(cost);
        match self.entries.back_mut() {
            Some((ts, units)) if *ts >= now => *units = units.saturating_add(cost),
            _ => self.entries.push_back((now, cost)),
        }
    }

    /// Writes a plan that was consumed (decide.lua's `sw_commit`).
    pub fn commit(&mut self, plan: &LogPlan) {
        self.consume(plan.now, plan.cost);
    }

    /// Gives back up to `units` recorded at exactly `at` (a paced reservation whose request went
    /// away before its slot: `pacing.rs`); other units at that time stay. Nothing when the
    /// entry has left the window already.
    ///
    /// The entry stays, emptied: the entries this log dropped when it admitted the request at
    /// its slot are forgotten soundly only while an entry that late holds the log's time
    /// (`eval` runs on the newest entry's time).
    pub fn unreserve(&mut self, at: u64, units: u64) {
        if let Some(entry) = self.entries.iter_mut().rev().find(|(ts, _)| *ts == at) {
            let back = units.min(entry.1);
            entry.1 -= back;
            self.total = self.total.saturating_sub(back);
        }
    }

    /// Gives back `units` of those admitted at time `at` (the stamp of their decision, the time
    /// its [`LogPlan`] ran on), never more than that entry holds (decide.lua's `refund` of an
    /// `sw` key): the units admitted at other times, later ones included, stay as they are, and
    /// an entry that has left the window (or was never written) gets nothing.
    pub fn refund(&mut self, at: u64, units: u64) {
        let Ok(i) = self.entries.binary_search_by_key(&at, |&(ts, _)| ts) else {
            return;
        };
        let held = self.entries[i].1;
        let back = held.min(units);
        self.total = self.total.saturating_sub(back);
        if back == held {
            self.entries.remove(i);
        } else {
            self.entries[i].1 = held - back;
        }
    }

    /// Entries held: one per distinct time with units in the window, whatever the units.
    pub fn entries(&self) -> usize {
        self.entries.len()
    }

    /// An empty window holds no information: the store may forget it.
    pub fn is_idle(&self, rule: &SlidingWindow, now: u64) -> bool {
        self.entries
            .back()
            .is_none_or(|&(newest, _)| newest + rule.window_us <= now)
    }

    /// When the window is empty again if nothing more is admitted.
    pub fn idle_at(&self, rule: &SlidingWindow) -> u64 {
        self.entries
            .back()
            .map_or(0, |&(newest, _)| newest.saturating_add(rule.window_us))
    }
}

/// Bucketed sliding window: `buckets + 1` counters cover the window, the oldest counted whole, so it
/// never admits more than the exact log.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WindowBuckets {
    /// (bucket index, units), oldest first, indexes strictly increasing.
    counts: VecDeque<(u64, u64)>,
}

/// What [`WindowBuckets::eval`] learned (decide.lua's `swb_eval`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketsPlan {
    pub now: u64,
    /// The current bucket index, which never goes backwards.
    pub current: u64,
    pub count: u64,
    pub cost: u64,
    pub allowed: bool,
}

impl WindowBuckets {
    /// Drops buckets older than the window and checks `cost`, consuming nothing.
    pub fn eval(&mut self, rule: &SlidingWindow, now: u64, cost: u64) -> BucketsPlan {
        let n = u64::from(rule.buckets);
        let width = rule.window_us / n;
        let current = (now / width).max(self.counts.back().map_or(0, |&(j, _)| j));
        let oldest = current.saturating_sub(n);
        while self.counts.front().is_some_and(|&(j, _)| j < oldest) {
            self.counts.pop_front();
        }
        let count: u64 = self.counts.iter().map(|&(_, c)| c).sum();
        BucketsPlan {
            now,
            current,
            count,
            cost,
            allowed: count + cost <= rule.limit,
        }
    }

    /// The outcome of `plan`, `consumed` or not (decide.lua's `swb_outcome`).
    pub fn outcome(&self, rule: &SlidingWindow, plan: &BucketsPlan, consumed: bool) -> Outcome {
        let BucketsPlan {
            now,
            current,
            count,
            cost,
            ..
        } = *plan;
        let n = u64::from(rule.buckets);
        let width = rule.window_us / n;
        let after = if consumed { count + cost } else { count };
        let until_gone = |j: u64| ((j + n + 1) * width).saturating_sub(now);
        let newest = if consumed && cost > 0 {
            Some(current)
        } else {
            // An emptied bucket (`unreserve`) restores nothing (decide.lua's `live`).
            self.counts
                .iter()
                .rev()
                .find(|&&(_, c)| c > 0)
                .map(|&(j, _)| j)
        };
        let reset_us = newest.map_or(0, until_gone);
        let retry_after_us = if plan.allowed {
            0
        } else if cost > rule.limit {
            rule.window_us
        } else {
            let excess = count + cost - rule.limit;
            let mut freed = 0;
            let mut retry = rule.window_us;
            for &(j, c) in &self.counts {
                freed += c;
                if freed >= excess {
                    retry = until_gone(j);
                    break;
                }
            }
            retry
        };
        Outcome {
            allowed: plan.allowed,
            limit: rule.limit,
            remaining: rule.limit.saturating_sub(after),
            reset_us,
            retry_after_us,
        }
    }

    /// [`WindowBuckets::eval`] and the outcome of a request decided alone (consumed if allowed).
    /// Returns the current bucket index, to [`WindowBuckets::consume`] into.
    pub fn evaluate(&mut self, rule: &SlidingWindow, now: u64, cost: u64) -> (u64, Outcome) {
        let plan = self.eval(rule, now, cost);
        (plan.current, self.outcome(rule, &plan, plan.allowed))
    }

    /// Records `cost` units in bucket `current` (as returned by [`WindowBuckets::evaluate`]).
    pub fn consume(&mut self, current: u64, cost: u64) {
        match self.counts.back_mut() {
            Some((j, c)) if *j == current => *c += cost,
            _ => self.counts.push_back((current, cost)),
        }
    }

    /// Writes a plan that was consumed (decide.lua's `swb_commit`).
    pub fn commit(&mut self, plan: &BucketsPlan) {
        self.consume(plan.current, plan.cost);
    }

    /// Gives back up to `units` recorded in bucket `index` (a paced reservation whose request
    /// went away: `pacing.rs`). Nothing when the bucket has left the window already.
    /// The bucket stays, emptied, as [`WindowLog::unreserve`]'s entry does.
    pub fn unreserve(&mut self, index: u64, units: u64) {
        if let Some((_, c)) = self.counts.iter_mut().find(|(j, _)| *j == index) {
            *c = c.saturating_sub(units);
        }
    }

    /// Gives back `units` of those counted in bucket `bucket` (the stamp of their decision, its
    /// [`BucketsPlan::current`]), never more than the bucket holds (decide.lua's `refund` of an
    /// `swb` key): a bucket that has left the window gets nothing, and no other bucket changes.
    pub fn refund(&mut self, bucket: u64, units: u64) {
        let Ok(i) = self.counts.binary_search_by_key(&bucket, |&(j, _)| j) else {
            return;
        };
        let held = self.counts[i].1;
        if held <= units {
            self.counts.remove(i);
        } else {
            self.counts[i].1 = held - units;
        }
    }

    pub fn is_idle(&self, rule: &SlidingWindow, now: u64) -> bool {
        self.idle_at(rule) <= now
    }

    /// When every bucket has left the window if nothing more is admitted.
    pub fn idle_at(&self, rule: &SlidingWindow) -> u64 {
        let width = rule.window_us / u64::from(rule.buckets);
        self.counts
            .back()
            .map_or(0, |&(j, _)| (j + u64::from(rule.buckets) + 1) * width)
    }
}

/// Calendar quota state (decide.lua's `q_*`): units used in one period, and units a paced
/// decision reserved in the period after it (`pacing.rs`). A store keeps one per counter, and a
/// counter never goes back to an older period: when instances disagree on the time near a
/// boundary, the first to reach the new period moves the counter for everyone.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QuotaCount {
    pub period: Option<Period>,
    pub used: u64,
    /// Units reserved in the period that starts at `period`'s end (decide.lua's field `x`).
    pub next: u64,
    /// That period's end while `next` holds units (decide.lua's `xe`), else 0.
    pub next_end: u64,
}

/// What [`QuotaCount::eval`] learned (decide.lua's `q_eval`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaPlan {
    pub now: u64,
    pub period: Period,
    pub used: u64,
    /// Units already reserved in the period after `period`, and its end (0 when none are).
    pub next: u64,
    pub next_end: u64,
    pub cost: u64,
    pub allowed: bool,
}

impl QuotaCount {
    /// The period at `now` for `rule` and the check of `cost` in it, changing nothing. `period`
    /// is [`calendar::period`] at the caller's time (the gateway's, for Redis); `now` is the
    /// store's, which only measures the time to the period's end. A counter whose period ended
    /// where `period` starts brings the units reserved in it.
    pub fn eval(&self, rule: &Quota, period: Period, now: u64, cost: u64) -> QuotaPlan {
        let (period, used, next, next_end) = match self.period {
            Some(stored) if stored.start >= period.start => {
                (stored, self.used, self.next, self.next_end)
            }
            Some(stored) if stored.end == period.start => (period, self.next, 0, 0),
            _ => (period, 0, 0, 0),
        };
        QuotaPlan {
            now,
            period,
            used,
            next,
            next_end,
            cost,
            allowed: used.saturating_add(cost) <= rule.limit,
        }
    }

    /// [`QuotaCount::eval`] at the period of `now` itself (the in-process store, whose one clock
    /// is both), and the outcome of a request decided alone.
    pub fn evaluate(&self, rule: &Quota, now: u64, cost: u64) -> (QuotaPlan, Outcome) {
        let period = calendar::period(rule.per, rule.time_zone, now);
        let plan = self.eval(rule, period, now, cost);
        (plan, plan.outcome(rule, plan.allowed))
    }

    /// Writes a plan that was consumed (decide.lua's `q_commit`).
    pub fn commit(&mut self, plan: &QuotaPlan) {
        self.period = Some(plan.period);
        self.used = plan.used + plan.cost;
        self.next = plan.next;
        self.next_end = plan.next_end;
    }

    /// Gives back `units` charged in the period starting at `start` (the stamp of their
    /// decision, its [`QuotaPlan::period`]'s start, or for a paced reservation the start of the
    /// period after it), at most what was counted there (decide.lua's `refund` of a `q` key):
    /// once the counter has moved past that period, it is over and nothing is given back, so a
    /// refund never lends a new period units it did not count.
    pub fn refund(&mut self, start: u64, units: u64) {
        match self.period {
            Some(p) if p.start == start => self.used = self.used.saturating_sub(units),
            Some(p) if p.end == start && self.next > 0 => {
                self.next = self.next.saturating_sub(units)
            }
            _ => {}
        }
    }

    /// A counter whose period is over, with nothing reserved after it, holds no information.
    pub fn is_idle(&self, now: u64) -> bool {
        self.idle_at() <= now
    }

    /// The end of the counter's period, or of the next one while units are reserved in it (0
    /// when it has none).
    pub fn idle_at(&self) -> u64 {
        self.period.map_or(0, |p| p.end).max(self.next_end)
    }
}

impl QuotaPlan {
    /// The outcome, `consumed` or not (decide.lua's `q_outcome`): the whole quota comes back at
    /// the period's end, so both `reset` (when anything is used) and `retry_after` (when refused)
    /// are the time to it.
    pub fn outcome(&self, rule: &Quota, consumed: bool) -> Outcome {
        let after = if consumed {
            self.used + self.cost
        } else {
            self.used
        };
        let to_end = self.period.end.saturating_sub(self.now);
        Outcome {
            allowed: self.allowed,
            limit: rule.limit,
            remaining: rule.limit.saturating_sub(after),
            reset_us: if after > 0 { to_end } else { 0 },
            retry_after_us: if self.allowed { 0 } else { to_end },
        }
    }
}

/// The largest duration either engine reports, in microseconds (2^62, about 146,000 years):
/// decide.lua's `MAX_US`, which keeps a Lua number in range of the Redis integer it becomes. An
/// absurd rule (a rate near zero) gives the same answer from both engines.
pub const MAX_US: u64 = 1 << 62;

/// Whole microseconds, rounded up, at most [`MAX_US`] (decide.lua's `ceil_us`).
pub(crate) fn ceil_us(us: f64) -> u64 {
    if us <= 0.0 {
        0
    } else {
        let c = us.ceil();
        if c > MAX_US as f64 {
            MAX_US
        } else {
            c as u64
        }
    }
}

#[cfg(test)]
#[path = "algorithm_tests.rs"]
mod tests;
