//! The in-process store: the default for a single instance.
//!
//! Counters live in a fixed number of shards, each a `HashMap` behind its own mutex, so unrelated
//! keys rarely contend. A decision locks the shards it touches in ascending order (no deadlock),
//! evaluates every check, and consumes only when all allow. Idle counters (a full bucket, an empty
//! window) carry no information and are swept; `max_keys` bounds memory whatever the traffic.

use std::hash::BuildHasher;

use hashbrown::{DefaultHashBuilder, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::algorithm::{BucketState, WindowBuckets, WindowLog};
use super::{Check, Clock, Decision, Outcome, Rule};

/// The most shards; small stores get fewer so that `max_keys` is an exact bound.
const MAX_SHARDS: usize = 64;
/// Counters per shard below which a store uses fewer shards.
const MIN_KEYS_PER_SHARD: usize = 256;

#[derive(Debug)]
enum State {
    Bucket(BucketState),
    Log(WindowLog),
    Buckets(WindowBuckets),
}

#[derive(Debug)]
struct Entry {
    /// The rule last applied, so the sweeper can tell whether the state is idle.
    rule: Rule,
    state: State,
}

impl Entry {
    fn new(rule: &Rule, now: u64) -> Self {
        let state = match rule {
            Rule::TokenBucket(tb) => State::Bucket(BucketState::full(tb, now)),
            Rule::SlidingWindow(sw) if sw.buckets == 0 => State::Log(WindowLog::default()),
            Rule::SlidingWindow(_) => State::Buckets(WindowBuckets::default()),
        };
        Entry { rule: *rule, state }
    }

    fn is_idle(&self, now: u64) -> bool {
        match (&self.state, &self.rule) {
            (State::Bucket(s), Rule::TokenBucket(tb)) => s.is_idle(tb, now),
            (State::Log(s), Rule::SlidingWindow(sw)) => s.is_idle(sw, now),
            (State::Buckets(s), Rule::SlidingWindow(sw)) => s.is_idle(sw, now),
            _ => true,
        }
    }
}

/// What phase one learned about a check, kept until phase two commits it.
enum Pending {
    Bucket(BucketState),
    Log(u64),
    Buckets(u64),
}

type Shard = HashMap<Box<str>, Entry>;

/// Counters in this process's memory.
#[derive(Debug)]
pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    hasher: DefaultHashBuilder,
    clock: Arc<dyn Clock>,
    keys_per_shard: usize,
    evictions: AtomicU64,
}

impl MemoryStore {
    /// `max_keys` bounds the number of live counters; past it, idle counters go first, then
    /// arbitrary ones (which forgets their usage: counted in [`MemoryStore::evictions`]).
    pub fn new(clock: Arc<dyn Clock>, max_keys: usize) -> Self {
        let max_keys = max_keys.max(1);
        let shards = (max_keys / MIN_KEYS_PER_SHARD).clamp(1, MAX_SHARDS);
        // Rounded down: the shards together never hold more than `max_keys`.
        let keys_per_shard = max_keys / shards;
        MemoryStore {
            shards: (0..shards).map(|_| Mutex::new(Shard::default())).collect(),
            hasher: DefaultHashBuilder::default(),
            clock,
            keys_per_shard,
            evictions: AtomicU64::new(0),
        }
    }

    /// Counters forgotten while still active because the store was full.
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }

    /// Live counters, idle ones included until the next sweep.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Checks all; consumes only if all allow (shadow checks aside, see [`Check::shadow`]).
    pub fn check(&self, checks: &[Check<'_>]) -> Decision {
        if let [check] = checks {
            return self.check_one(check);
        }
        let now = self.clock.now_us();
        let shard_of: Vec<usize> = checks.iter().map(|c| self.shard_index(c.key)).collect();
        let mut order = shard_of.clone();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<(usize, MutexGuard<'_, Shard>)> =
            order.iter().map(|&i| (i, lock(&self.shards[i]))).collect();

        let mut outcomes = Vec::with_capacity(checks.len());
        let mut pending = Vec::with_capacity(checks.len());
        for (check, &shard) in checks.iter().zip(&shard_of) {
            let map = shard_mut(&mut guards, shard);
            let entry = self.entry(map, check, now);
            let (p, outcome) = evaluate(entry, check, now);
            outcomes.push(outcome);
            pending.push(p);
        }
        let mut decision = Decision::from_checks(checks, outcomes);
        if !decision.allowed {
            // Nothing is consumed, so the policies that would have allowed report the state
            // as it stays: the outcome of a zero-cost check.
            for ((check, &shard), outcome) in
                checks.iter().zip(&shard_of).zip(&mut decision.outcomes)
            {
                if outcome.allowed && check.cost > 0 {
                    let entry = self.entry(shard_mut(&mut guards, shard), check, now);
                    *outcome = evaluate(entry, &Check { cost: 0, ..*check }, now).1;
                }
            }
        }
        if decision.allowed {
            let all = checks.iter().zip(&shard_of).zip(pending).enumerate();
            for (i, ((check, &shard), p)) in all {
                if !decision.commits(i) {
                    continue;
                }
                if let Some(entry) = shard_mut(&mut guards, shard).get_mut(check.key) {
                    commit(entry, p, check.cost);
                }
            }
        }
        decision
    }

    /// The common case, a route with one policy: one lock and none of the scratch vectors that
    /// ordering several locks needs. With one check a rejection consumes nothing anyway, so there
    /// is nothing to re-evaluate.
    fn check_one(&self, check: &Check<'_>) -> Decision {
        let now = self.clock.now_us();
        let mut map = lock(&self.shards[self.shard_index(check.key)]);
        let entry = self.entry(&mut map, check, now);
        let (pending, outcome) = evaluate(entry, check, now);
        let decision = Decision::from_checks(std::slice::from_ref(check), vec![outcome]);
        if decision.commits(0) {
            commit(entry, pending, check.cost);
        }
        decision
    }

    /// Drops idle counters. Called periodically; holds one shard lock at a time.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now_us();
        let mut removed = 0;
        for shard in self.shards.iter() {
            let mut map = lock(shard);
            let before = map.len();
            map.retain(|_, e| !e.is_idle(now));
            removed += before - map.len();
        }
        removed
    }

    fn shard_index(&self, key: &str) -> usize {
        (self.hasher.hash_one(key) as usize) % self.shards.len()
    }

    fn entry<'m>(&self, map: &'m mut Shard, check: &Check<'_>, now: u64) -> &'m mut Entry {
        if !map.contains_key(check.key) && map.len() >= self.keys_per_shard {
            self.make_room(map, now);
        }
        let entry = map
            .entry_ref(check.key)
            .or_insert_with(|| Entry::new(check.rule, now));
        if entry.rule != *check.rule {
            // The config changed under this counter: keep state that means the same thing.
            let keeps_state = match (entry.rule, check.rule) {
                (Rule::TokenBucket(_), Rule::TokenBucket(_)) => true,
                (Rule::SlidingWindow(old), Rule::SlidingWindow(new)) => {
                    (old.buckets == 0 && new.buckets == 0)
                        || (old.buckets == new.buckets && old.window_us == new.window_us)
                }
                _ => false,
            };
            if keeps_state {
                entry.rule = *check.rule;
            } else {
                *entry = Entry::new(check.rule, now);
            }
        }
        entry
    }

    fn make_room(&self, map: &mut Shard, now: u64) {
        map.retain(|_, e| !e.is_idle(now));
        if map.len() >= self.keys_per_shard {
            if let Some(victim) = map.keys().next().cloned() {
                map.remove(&victim);
                self.evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
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
        // `entry()` always aligns state with rule; this arm only keeps the match total.
        _ => {
            *entry = Entry::new(check.rule, now);
            evaluate(entry, check, now)
        }
    }
}

fn commit(entry: &mut Entry, pending: Pending, cost: u64) {
    if cost == 0 {
        return;
    }
    match (&mut entry.state, pending) {
        (State::Bucket(state), Pending::Bucket(mut refilled)) => {
            refilled.consume(cost);
            *state = refilled;
        }
        (State::Log(log), Pending::Log(at)) => log.consume(at, cost),
        (State::Buckets(buckets), Pending::Buckets(current)) => buckets.consume(current, cost),
        _ => {}
    }
}

/// The locked shard `shard` among `guards` (which hold every shard the decision touches).
fn shard_mut<'g>(guards: &'g mut [(usize, MutexGuard<'_, Shard>)], shard: usize) -> &'g mut Shard {
    let pos = guards.iter().position(|(i, _)| *i == shard).unwrap_or(0);
    &mut guards[pos].1
}

/// A poisoned shard only means another request panicked mid-update; the counters are still
/// usable, and refusing service would turn one bug into an outage.
fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    shard
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
#[path = "memory_tests.rs"]
mod tests;
