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

use super::algorithm::{BucketPlan, BucketState, BucketsPlan, LogPlan, WindowBuckets, WindowLog};
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

/// What phase one learned about a check, kept until phase two reports and commits it.
enum Plan {
    Bucket(BucketPlan),
    Log(LogPlan),
    Buckets(BucketsPlan),
}

impl Plan {
    fn allowed(&self) -> bool {
        match self {
            Plan::Bucket(p) => p.allowed,
            Plan::Log(p) => p.allowed,
            Plan::Buckets(p) => p.allowed,
        }
    }
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

    /// Checks all; consumes only if all allow (shadow checks aside, see [`Check::shadow`]). The
    /// phases are decide.lua's: evaluate every check, decide, then report each outcome (consumed
    /// or not) and commit what was consumed.
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

        let mut plans = Vec::with_capacity(checks.len());
        for (check, &shard) in checks.iter().zip(&shard_of) {
            let entry = self.entry(shard_mut(&mut guards, shard), check, now);
            plans.push(eval(entry, check, now));
        }
        let allowed = checks
            .iter()
            .zip(&plans)
            .all(|(c, p)| c.shadow || p.allowed());
        let mut outcomes = Vec::with_capacity(checks.len());
        for ((check, &shard), plan) in checks.iter().zip(&shard_of).zip(&plans) {
            let consumed = allowed && plan.allowed();
            let entry = self.entry(shard_mut(&mut guards, shard), check, now);
            outcomes.push(outcome(entry, plan, consumed));
            if consumed {
                commit(entry, plan);
            }
        }
        Decision { allowed, outcomes }
    }

    /// The common case, a route with one policy: one lock and none of the scratch vectors that
    /// ordering several locks needs.
    fn check_one(&self, check: &Check<'_>) -> Decision {
        let now = self.clock.now_us();
        let mut map = lock(&self.shards[self.shard_index(check.key)]);
        let entry = self.entry(&mut map, check, now);
        let plan = eval(entry, check, now);
        let allowed = check.shadow || plan.allowed();
        let consumed = allowed && plan.allowed();
        let outcome = outcome(entry, &plan, consumed);
        if consumed {
            commit(entry, &plan);
        }
        Decision {
            allowed,
            outcomes: vec![outcome],
        }
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

fn eval(entry: &mut Entry, check: &Check<'_>, now: u64) -> Plan {
    match (&mut entry.state, check.rule) {
        (State::Bucket(state), Rule::TokenBucket(tb)) => {
            Plan::Bucket(state.eval(tb, now, check.cost))
        }
        (State::Log(log), Rule::SlidingWindow(sw)) => Plan::Log(log.eval(sw, now, check.cost)),
        (State::Buckets(buckets), Rule::SlidingWindow(sw)) => {
            Plan::Buckets(buckets.eval(sw, now, check.cost))
        }
        // `entry()` always aligns state with rule; this arm only keeps the match total.
        _ => {
            *entry = Entry::new(check.rule, now);
            eval(entry, check, now)
        }
    }
}

fn outcome(entry: &Entry, plan: &Plan, consumed: bool) -> Outcome {
    match (&entry.state, &entry.rule, plan) {
        (_, Rule::TokenBucket(tb), Plan::Bucket(p)) => p.outcome(tb, consumed),
        (State::Log(log), Rule::SlidingWindow(sw), Plan::Log(p)) => log.outcome(sw, p, consumed),
        (State::Buckets(b), Rule::SlidingWindow(sw), Plan::Buckets(p)) => {
            b.outcome(sw, p, consumed)
        }
        // A plan always matches the entry it was made from.
        _ => Outcome {
            allowed: plan.allowed(),
            limit: entry.rule.limit(),
            remaining: 0,
            reset_us: 0,
            retry_after_us: 0,
        },
    }
}

/// Writes a consumed plan; a cost of 0 writes nothing (decide.lua commits only `cost > 0`).
fn commit(entry: &mut Entry, plan: &Plan) {
    match (&mut entry.state, plan) {
        (State::Bucket(state), Plan::Bucket(p)) if p.cost > 0 => state.commit(p),
        (State::Log(log), Plan::Log(p)) if p.cost > 0 => log.commit(p),
        (State::Buckets(buckets), Plan::Buckets(p)) if p.cost > 0 => buckets.commit(p),
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
