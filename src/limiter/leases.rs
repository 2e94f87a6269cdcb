//! Concurrency leases in Rust: the spec of `cc_*` in `scripts/decide.lua`, function for function.
//!
//! A counter is the set of leases held, each `(expires at, lease id)`. A decision first drops the
//! expired leases, then admits when `held + cost <= limit` (cost is 1 for a request, 0 to peek);
//! an admitted request adds its lease, which lives until it is released or `lease_ttl_us` passes.
//! Expiry is what bounds a crash: a lease nobody releases stops counting after its TTL.
//! `docs/algorithms.md` ("Concurrency") is the normative text.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex};

use super::{Concurrency, Outcome};

/// How long a refused request is told to wait (`Retry-After: 1`): a lease is released when some
/// request ends, which no clock predicts.
pub const RETRY_AFTER_US: u64 = 1_000_000;

/// The leases held on one key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Leases {
    /// (expires at µs, lease id), in no particular order: `limit` entries at most, usually few.
    held: Vec<(u64, u64)>,
}

/// What [`Leases::eval`] learned (decide.lua's `cc_eval`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeasePlan {
    pub now: u64,
    pub count: u64,
    pub cost: u64,
    pub allowed: bool,
}

impl Leases {
    /// Drops expired leases and checks `cost` more, taking nothing.
    pub fn eval(&mut self, rule: &Concurrency, now: u64, cost: u64) -> LeasePlan {
        self.held.retain(|&(expires, _)| expires > now);
        let count = self.held.len() as u64;
        LeasePlan {
            now,
            count,
            cost,
            allowed: count + cost <= rule.limit,
        }
    }

    /// The outcome of `plan`, `consumed` or not (decide.lua's `cc_outcome`). `reset_us` is when
    /// the last lease expires if none is released; `retry_after_us` is [`RETRY_AFTER_US`].
    pub fn outcome(&self, rule: &Concurrency, plan: &LeasePlan, consumed: bool) -> Outcome {
        let taken = consumed && plan.cost > 0;
        let after = if taken {
            plan.count + plan.cost
        } else {
            plan.count
        };
        let mut last = self.held.iter().map(|&(e, _)| e).max();
        if taken {
            last = Some(plan.now + rule.lease_ttl_us);
        }
        Outcome {
            allowed: plan.allowed,
            limit: rule.limit,
            remaining: rule.limit.saturating_sub(after),
            reset_us: last.map_or(0, |e| e.saturating_sub(plan.now)),
            retry_after_us: if plan.allowed { 0 } else { RETRY_AFTER_US },
        }
    }

    /// Takes lease `id` for a plan that was consumed (decide.lua's `cc_commit`).
    pub fn commit(&mut self, rule: &Concurrency, plan: &LeasePlan, id: u64) {
        if plan.cost > 0 {
            self.held.push((plan.now + rule.lease_ttl_us, id));
        }
    }

    /// Gives lease `id` back (decide.lua's `refund` of a `cc` key); unknown or expired: nothing.
    pub fn release(&mut self, id: u64) {
        if let Some(i) = self.held.iter().position(|&(_, held)| held == id) {
            self.held.swap_remove(i);
        }
    }

    /// Extends lease `id` to `now + lease_ttl_us` while its request still runs (decide.lua's
    /// `renew`); an expired or released lease stays gone.
    pub fn renew(&mut self, rule: &Concurrency, now: u64, id: u64) {
        if let Some(lease) = self
            .held
            .iter_mut()
            .find(|(e, held)| *held == id && *e > now)
        {
            lease.0 = now + rule.lease_ttl_us;
        }
    }

    /// Leases held now, expired ones aside.
    pub fn held(&self, now: u64) -> u64 {
        self.held.iter().filter(|&&(e, _)| e > now).count() as u64
    }

    /// No lease held: the store may forget the counter.
    pub fn is_idle(&self, now: u64) -> bool {
        self.held(now) == 0
    }

    /// When the last lease expires if none is released.
    pub fn idle_at(&self) -> u64 {
        self.held.iter().map(|&(e, _)| e).max().unwrap_or(0)
    }
}

/// Shards of [`LocalInFlight`]: a lock covers one sixteenth of the keys.
const SHARDS: usize = 16;

/// This instance's own requests in flight per concurrency key, on a shared store: those holding a
/// lease from the store and those admitted by the fallback while the store could not decide
/// (`docs/algorithms.md`, "Concurrency", "The store fails"). The fallback admits only while this
/// count is below the limit, so one instance never has more than `limit` in flight on its own.
/// A key's entry exists only while it has requests in flight.
#[derive(Debug)]
pub struct LocalInFlight {
    hasher: RandomState,
    shards: [Mutex<hashbrown::HashMap<Box<str>, u64>>; SHARDS],
}

impl Default for LocalInFlight {
    fn default() -> Self {
        LocalInFlight {
            hasher: RandomState::new(),
            shards: std::array::from_fn(|_| Mutex::default()),
        }
    }
}

impl LocalInFlight {
    fn shard(&self, key: &str) -> &Mutex<hashbrown::HashMap<Box<str>, u64>> {
        let i = self.hasher.hash_one(key) as usize % SHARDS;
        &self.shards[i]
    }

    /// Counts one more request in flight on `key`: always for a lease the store granted
    /// (`limit: None`), only below `limit` for the fallback. Whether it was counted.
    pub fn take(&self, key: &str, limit: Option<u64>) -> bool {
        let mut shard = self.shard(key).lock().unwrap_or_else(|e| e.into_inner());
        let held = shard.get(key).copied().unwrap_or(0);
        if limit.is_some_and(|limit| held >= limit) {
            return false;
        }
        match shard.get_mut(key) {
            Some(n) => *n += 1,
            None => {
                shard.insert(key.into(), 1);
            }
        }
        true
    }

    /// One request on `key` ended; the entry goes with its last one.
    pub fn give_back(&self, key: &str) {
        let mut shard = self.shard(key).lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = shard.get_mut(key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                shard.remove(key);
            }
        }
    }

    /// Requests in flight on `key` now.
    pub fn held(&self, key: &str) -> u64 {
        let shard = self.shard(key).lock().unwrap_or_else(|e| e.into_inner());
        shard.get(key).copied().unwrap_or(0)
    }

    /// Keys with requests in flight.
    pub fn keys(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).len())
            .sum()
    }
}

/// Slots counted in a [`LocalInFlight`], given back when dropped (a request's end, its client
/// gone, an error after admission: whatever drops it).
#[derive(Debug)]
pub struct LocalSlots {
    table: Arc<LocalInFlight>,
    keys: smallvec::SmallVec<[Box<str>; 1]>,
}

impl LocalSlots {
    pub fn new(table: Arc<LocalInFlight>) -> Self {
        LocalSlots {
            table,
            keys: smallvec::SmallVec::new(),
        }
    }

    /// [`LocalInFlight::take`], remembered for the drop when counted.
    pub fn take(&mut self, key: &str, limit: Option<u64>) -> bool {
        let taken = self.table.take(key, limit);
        if taken {
            self.keys.push(key.into());
        }
        taken
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

impl Drop for LocalSlots {
    fn drop(&mut self) {
        for key in &self.keys {
            self.table.give_back(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULE: Concurrency = Concurrency {
        limit: 2,
        lease_ttl_us: 10_000_000,
    };

    #[test]
    fn admits_up_to_the_limit_and_releases_by_id() {
        let mut l = Leases::default();
        for id in 1..=2 {
            let plan = l.eval(&RULE, 0, 1);
            assert!(plan.allowed);
            assert_eq!(l.outcome(&RULE, &plan, true).remaining, 2 - id);
            l.commit(&RULE, &plan, id);
        }
        let plan = l.eval(&RULE, 5, 1);
        let refused = l.outcome(&RULE, &plan, false);
        assert!(!refused.allowed);
        assert_eq!(refused.retry_after_us, RETRY_AFTER_US);
        assert_eq!(refused.reset_us, 10_000_000 - 5);
        l.release(1);
        l.release(1);
        assert_eq!(l.held(5), 1);
        assert!(l.eval(&RULE, 5, 1).allowed);
    }

    #[test]
    fn local_slots_count_to_the_limit_and_come_back_when_dropped() {
        let table = Arc::new(LocalInFlight::default());
        let mut granted = LocalSlots::new(table.clone());
        // Leases the store granted count whatever the local count.
        assert!(granted.take("k", None));
        assert!(granted.take("k", None));
        let mut fallback = LocalSlots::new(table.clone());
        assert!(fallback.take("k", Some(3)));
        assert!(!fallback.take("k", Some(3)), "a fourth past a limit of 3");
        assert_eq!(table.held("k"), 3);
        drop(granted);
        assert_eq!(table.held("k"), 1);
        drop(fallback);
        assert_eq!((table.held("k"), table.keys()), (0, 0));
    }

    #[test]
    fn leases_expire_after_their_ttl() {
        let mut l = Leases::default();
        let plan = l.eval(&RULE, 100, 1);
        l.commit(&RULE, &plan, 7);
        assert_eq!(l.eval(&RULE, 100 + RULE.lease_ttl_us - 1, 0).count, 1);
        assert_eq!(l.eval(&RULE, 100 + RULE.lease_ttl_us, 0).count, 0);
        assert!(l.is_idle(100 + RULE.lease_ttl_us));
    }
}
