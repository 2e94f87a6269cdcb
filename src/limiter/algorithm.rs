//! The algorithm spec in Rust: pure functions from (state, now, rule, cost) to an outcome.
//!
//! `docs/algorithms.md` is the normative text; `scripts/decide.lua` implements the same formulas in
//! the same order for Redis. Nothing here reads a clock or takes a lock, so every branch is testable
//! with hand-picked timestamps.

use std::collections::VecDeque;

use super::{Outcome, SlidingWindow, TokenBucket};

const MICROS: f64 = 1_000_000.0;

/// Token bucket state. `tokens` keeps its fraction so a steady stream is never starved by rounding.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketState {
    pub tokens: f64,
    pub ts: u64,
}

impl BucketState {
    /// A bucket nobody has touched is full.
    pub fn full(rule: &TokenBucket, now: u64) -> Self {
        BucketState {
            tokens: rule.burst as f64,
            ts: now,
        }
    }

    /// Refills to `now` and evaluates `cost` without consuming. Returns the refilled state.
    pub fn evaluate(&self, rule: &TokenBucket, now: u64, cost: u64) -> (BucketState, Outcome) {
        let burst = rule.burst as f64;
        let elapsed = now.saturating_sub(self.ts) as f64;
        let tokens = burst.min(self.tokens + elapsed * rule.rate / MICROS);
        let cost_f = cost as f64;
        let allowed = tokens >= cost_f;
        let after = if allowed { tokens - cost_f } else { tokens };
        let reset_us = ceil_us((burst - after) * MICROS / rule.rate);
        let retry_after_us = if allowed {
            0
        } else if cost_f > burst {
            reset_us
        } else {
            ceil_us((cost_f - tokens) * MICROS / rule.rate)
        };
        let state = BucketState {
            tokens,
            ts: now.max(self.ts),
        };
        let outcome = Outcome {
            allowed,
            limit: rule.burst,
            remaining: after.floor() as u64,
            reset_us,
            retry_after_us,
        };
        (state, outcome)
    }

    /// Consumes `cost` from a state returned by [`BucketState::evaluate`] that allowed it.
    pub fn consume(&mut self, cost: u64) {
        self.tokens -= cost as f64;
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

/// Exact sliding log: one timestamp per admitted unit, oldest first.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WindowLog {
    entries: VecDeque<u64>,
}

impl WindowLog {
    /// Drops expired entries and evaluates `cost` at `now` without consuming. Returns the time the
    /// log runs on, which never goes backwards.
    pub fn evaluate(&mut self, rule: &SlidingWindow, now: u64, cost: u64) -> (u64, Outcome) {
        let now = self.entries.back().map_or(now, |&newest| now.max(newest));
        if let Some(cutoff) = now.checked_sub(rule.window_us) {
            while self.entries.front().is_some_and(|&ts| ts <= cutoff) {
                self.entries.pop_front();
            }
        }
        let count = self.entries.len() as u64;
        let allowed = count + cost <= rule.limit;
        let after = if allowed { count + cost } else { count };
        let newest = if allowed && cost > 0 {
            Some(now)
        } else {
            self.entries.back().copied()
        };
        let reset_us = newest.map_or(0, |ts| ts + rule.window_us - now);
        let retry_after_us = if allowed {
            0
        } else if cost > rule.limit {
            rule.window_us
        } else {
            let index = (count + cost - rule.limit - 1) as usize;
            self.entries
                .get(index)
                .map_or(rule.window_us, |&ts| ts + rule.window_us - now)
        };
        let outcome = Outcome {
            allowed,
            limit: rule.limit,
            remaining: rule.limit.saturating_sub(after),
            reset_us,
            retry_after_us,
        };
        (now, outcome)
    }

    /// Records `cost` units admitted at `now` (the time returned by [`WindowLog::evaluate`]).
    pub fn consume(&mut self, now: u64, cost: u64) {
        self.entries.extend(std::iter::repeat_n(now, cost as usize));
    }

    /// An empty window holds no information: the store may forget it.
    pub fn is_idle(&self, rule: &SlidingWindow, now: u64) -> bool {
        self.entries
            .back()
            .is_none_or(|&newest| newest + rule.window_us <= now)
    }

    /// When the window is empty again if nothing more is admitted.
    pub fn idle_at(&self, rule: &SlidingWindow) -> u64 {
        self.entries
            .back()
            .map_or(0, |&newest| newest.saturating_add(rule.window_us))
    }
}

/// Bucketed sliding window: `buckets + 1` counters cover the window, the oldest counted whole, so it
/// never admits more than the exact log.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WindowBuckets {
    /// (bucket index, units), oldest first, indexes strictly increasing.
    counts: VecDeque<(u64, u64)>,
}

impl WindowBuckets {
    /// Drops buckets older than the window and evaluates `cost` without consuming. Returns the
    /// current bucket index.
    pub fn evaluate(&mut self, rule: &SlidingWindow, now: u64, cost: u64) -> (u64, Outcome) {
        let n = u64::from(rule.buckets);
        let width = rule.window_us / n;
        let current = (now / width).max(self.counts.back().map_or(0, |&(j, _)| j));
        let oldest = current.saturating_sub(n);
        while self.counts.front().is_some_and(|&(j, _)| j < oldest) {
            self.counts.pop_front();
        }
        let count: u64 = self.counts.iter().map(|&(_, c)| c).sum();
        let allowed = count + cost <= rule.limit;
        let after = if allowed { count + cost } else { count };
        let until_gone = |j: u64| ((j + n + 1) * width).saturating_sub(now);
        let newest = if allowed && cost > 0 {
            Some(current)
        } else {
            self.counts.back().map(|&(j, _)| j)
        };
        let reset_us = newest.map_or(0, until_gone);
        let retry_after_us = if allowed {
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
        let outcome = Outcome {
            allowed,
            limit: rule.limit,
            remaining: rule.limit.saturating_sub(after),
            reset_us,
            retry_after_us,
        };
        (current, outcome)
    }

    /// Records `cost` units in bucket `current` (as returned by [`WindowBuckets::evaluate`]).
    pub fn consume(&mut self, current: u64, cost: u64) {
        match self.counts.back_mut() {
            Some((j, c)) if *j == current => *c += cost,
            _ => self.counts.push_back((current, cost)),
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

fn ceil_us(us: f64) -> u64 {
    if us <= 0.0 {
        0
    } else {
        us.ceil() as u64
    }
}

#[cfg(test)]
#[path = "algorithm_tests.rs"]
mod tests;
