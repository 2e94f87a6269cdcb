//! Where the in-process store counts keys it has no room for: a count-min sketch of time debts
//! that can only over-count, so a flood of new keys is never a way past a limit.
//!
//! Every rule is read as a debt in microseconds that drains at one microsecond per microsecond:
//! a token bucket charges `1e6 / rate` per unit and allows a debt of `burst` units (exactly the
//! bucket, as GCRA); a sliding window charges `window` per unit and allows `limit` units, which
//! admits at most `limit` units in any window (k units in a window leave a debt above
//! `(k - 1) * window`), so it is never laxer than the exact log. Debts of different keys and rules
//! add up in a cell because they all drain at the same speed; a cell therefore holds at least
//! the debt of every key hashed to it, and the smallest of a key's `DEPTH` cells is an
//! over-estimate of its own debt. A cell stores the time its debt runs out (`debt = cell - now`),
//! so draining costs nothing. Updates are conservative (a cell is raised only to the key's new
//! estimate), which keeps the over-count low. Memory is fixed at construction.

use super::{Outcome, Rule};

/// Rows of the sketch: a key is refused only when all its cells are indebted.
const DEPTH: usize = 4;

/// Per-row seeds, so the rows index independently from one key hash.
const SEEDS: [u64; DEPTH] = [
    0x9e37_79b9_7f4a_7c15,
    0xc2b2_ae3d_27d4_eb4f,
    0x1656_67b1_9e37_79f9,
    0x27d4_eb2f_1656_67c5,
];

#[derive(Debug)]
pub(super) struct Overflow {
    /// `DEPTH` rows of `mask + 1` cells: the time (µs) each cell's debt runs out.
    cells: Box<[f64]>,
    mask: usize,
    /// The latest time any cell runs out: once past, the sketch is empty and costs nothing.
    busy_until: f64,
}

impl Overflow {
    /// `width` cells per row, rounded up to a power of two.
    pub(super) fn new(width: usize) -> Self {
        let width = width.next_power_of_two();
        Overflow {
            cells: vec![0.0; DEPTH * width].into_boxed_slice(),
            mask: width - 1,
            busy_until: 0.0,
        }
    }

    pub(super) fn memory_bytes(&self) -> usize {
        std::mem::size_of_val(&*self.cells)
    }

    fn cell(&self, row: usize, hash: u64) -> usize {
        let mixed = (hash ^ SEEDS[row]).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        row * (self.mask + 1) + ((mixed >> 32) as usize & self.mask)
    }

    /// An upper bound of the debt (µs) of the key with `hash` at `now`: 0 when it owes nothing.
    pub(super) fn debt(&self, hash: u64, now: u64) -> f64 {
        let now = now as f64;
        if now >= self.busy_until {
            return 0.0;
        }
        (0..DEPTH)
            .map(|row| self.cells[self.cell(row, hash)])
            .fold(f64::INFINITY, f64::min)
            .max(now)
            - now
    }

    /// Evaluates `cost` units of `rule` for the key without consuming. Returns the debt the key
    /// would owe after the request (for [`Overflow::commit`]) and the outcome.
    pub(super) fn evaluate(&self, hash: u64, rule: &Rule, now: u64, cost: u64) -> (f64, Outcome) {
        let (unit_us, limit) = unit(rule);
        let debt = self.debt(hash, now);
        let charge = cost as f64 * unit_us;
        let allowance = limit as f64 * unit_us;
        let allowed = cost <= limit && debt + charge <= allowance;
        let after = if allowed { debt + charge } else { debt };
        let reset_us = ceil_us(after);
        let outcome = Outcome {
            allowed,
            limit,
            remaining: ((allowance - after) / unit_us).max(0.0).floor() as u64,
            reset_us,
            retry_after_us: if allowed {
                0
            } else if cost > limit {
                reset_us
            } else {
                ceil_us(debt + charge - allowance).max(1)
            },
        };
        (after, outcome)
    }

    /// Records that the key owes `after` µs from `now` (from [`Overflow::evaluate`]).
    pub(super) fn commit(&mut self, hash: u64, now: u64, after: f64) {
        let until = now as f64 + after;
        for row in 0..DEPTH {
            let i = self.cell(row, hash);
            // Conservative update: raise the cell only as far as this key's own estimate.
            self.cells[i] = self.cells[i].max(until);
        }
        self.busy_until = self.busy_until.max(until);
    }
}

/// The debt one unit of `rule` adds (µs), and how many units' debt it allows.
pub(super) fn unit(rule: &Rule) -> (f64, u64) {
    match rule {
        Rule::TokenBucket(tb) => (1e6 / tb.rate, tb.burst),
        Rule::SlidingWindow(sw) => (sw.window_us as f64, sw.limit),
        // A lease counted here is never released: it holds its slot for the whole TTL.
        Rule::Concurrency(cc) => (cc.lease_ttl_us as f64, cc.limit),
        // Read as a sliding window as long as the longest period: never laxer than the quota.
        Rule::Quota(q) => (crate::limiter::calendar::longest_us(q.per) as f64, q.limit),
    }
}

fn ceil_us(us: f64) -> u64 {
    if us <= 0.0 {
        0
    } else {
        us.ceil() as u64
    }
}
