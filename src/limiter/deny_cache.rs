//! The local deny cache: refusals the store gave, remembered until the instant they stop being
//! certain, so a flood of requests already over their limit is answered without a store round
//! trip (`docs/algorithms.md`, "The deny cache").
//!
//! A counter that refuses cost `c` with `retry_after` cannot admit any cost `>= c` before that
//! instant: nothing but time gives units back, and other requests only consume more. So a cached
//! refusal only ever refuses; it never admits. An entry is keyed on the counter key and holds the
//! rule it was decided under (a reload that changes the rule misses) and the epoch it was decided
//! in (the store's, plus a generation bumped by every change of the rules in force, so a rule that
//! changes and changes back misses too), the smallest cost refused,
//! and the instant by the engine's clock, taken *before* the store was asked (the store decided at
//! that instant or later) minus a safety margin for clocks that run at slightly different rates.
//!
//! Memory is bounded: a fixed number of shards of a fixed capacity. A full shard first drops
//! its expired entries, then the one that expires soonest. When no entry is live, a lookup is
//! one atomic load: traffic that is never refused pays nothing.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use hashbrown::{DefaultHashBuilder, HashMap};

use super::{Outcome, Rule};

/// Entries in all, unless the engine is built with another capacity.
pub const DEFAULT_CAPACITY: usize = 8_192;
/// Shards, each behind its own mutex.
const SHARDS: usize = 16;
/// Never trust a refusal closer than this to its end (clock granularity, a store a little ahead).
const MARGIN_US: u64 = 1_000;
/// And never closer than `retry_after / 2^RATE_SHIFT` (0.8 %): two clocks' rates may differ.
const RATE_SHIFT: u32 = 7;

#[derive(Debug, Clone, Copy)]
struct Entry {
    rule: Rule,
    /// The smallest cost refused: costs below it may be admitted.
    cost: u64,
    /// Trusted until this instant (engine clock, margin subtracted).
    until_us: u64,
    /// The store's instant at which the refusal ends (engine clock): `retry_after` on a hit.
    ends_us: u64,
    /// When the counter would be full again, and its `limit` and `remaining` at the refusal.
    reset_at_us: u64,
    limit: u64,
    remaining: u64,
    /// The epoch when the store refused ([`crate::limiter::Store::epoch`] plus the engine's
    /// rules generation).
    epoch: u64,
}

type Shard = Mutex<HashMap<Box<str>, Entry>>;

/// A bounded map from counter key to the refusal the store last gave it.
#[derive(Debug)]
pub struct DenyCache {
    shards: Box<[Shard]>,
    per_shard: usize,
    hasher: DefaultHashBuilder,
    /// Entries in all shards (expired ones included until dropped): 0 skips every lookup.
    len: AtomicUsize,
}

impl DenyCache {
    /// A cache of at most `capacity` entries; 0 disables it.
    pub fn new(capacity: usize) -> Self {
        let shards = if capacity == 0 { 0 } else { SHARDS };
        DenyCache {
            shards: (0..shards).map(|_| Mutex::new(HashMap::new())).collect(),
            per_shard: capacity.div_ceil(SHARDS),
            hasher: DefaultHashBuilder::default(),
            len: AtomicUsize::new(0),
        }
    }

    pub fn is_enabled(&self) -> bool {
        !self.shards.is_empty()
    }

    /// Whether nothing is cached (one atomic load; the hot path's common case).
    pub fn is_empty(&self) -> bool {
        self.len.load(Ordering::Relaxed) == 0
    }

    /// Entries held now, expired ones included until they are dropped.
    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    fn shard(&self, key: &str) -> &Shard {
        let i = (self.hasher.hash_one(key) as usize) % self.shards.len();
        &self.shards[i]
    }

    /// The refusal the store would give `key` under `rule` at `cost`, if one is certain at `now`
    /// and the store has not lost state since (`epoch`, [`crate::limiter::Store::epoch`]).
    pub fn lookup(
        &self,
        key: &str,
        rule: &Rule,
        cost: u64,
        now: u64,
        epoch: u64,
    ) -> Option<Outcome> {
        if !self.is_enabled() || self.is_empty() {
            return None;
        }
        let mut shard = self.shard(key).lock().unwrap_or_else(|e| e.into_inner());
        let e = *shard.get(key)?;
        if now >= e.until_us || e.epoch != epoch {
            shard.remove(key);
            self.len.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        if e.rule != *rule || cost < e.cost {
            return None;
        }
        Some(Outcome {
            allowed: false,
            limit: e.limit,
            remaining: e.remaining,
            reset_us: e.reset_at_us.saturating_sub(now),
            retry_after_us: e.ends_us.saturating_sub(now),
        })
    }

    /// Remembers that the store refused `cost` on `key` under `rule`, as asked at `asked_at`
    /// in the store's `epoch`.
    pub fn insert(&self, key: &str, rule: &Rule, cost: u64, outcome: &Outcome, asked: (u64, u64)) {
        let (asked_at, epoch) = asked;
        if !self.is_enabled() || outcome.allowed {
            return;
        }
        let retry = outcome.retry_after_us;
        let margin = MARGIN_US.max(retry >> RATE_SHIFT);
        if retry <= margin {
            return;
        }
        let entry = Entry {
            rule: *rule,
            cost,
            until_us: asked_at.saturating_add(retry - margin),
            ends_us: asked_at.saturating_add(retry),
            reset_at_us: asked_at.saturating_add(outcome.reset_us),
            limit: outcome.limit,
            remaining: outcome.remaining,
            epoch,
        };
        let mut shard = self.shard(key).lock().unwrap_or_else(|e| e.into_inner());
        if let Some(old) = shard.get_mut(key) {
            // Keep what still refuses the most: a live entry at a lower cost covers more costs.
            let old_live = old.rule == entry.rule && old.epoch == epoch && asked_at < old.until_us;
            if !old_live
                || entry.cost < old.cost
                || (entry.cost == old.cost && entry.until_us > old.until_us)
            {
                *old = entry;
            }
            return;
        }
        if shard.len() >= self.per_shard {
            let before = shard.len();
            shard.retain(|_, e| e.until_us > asked_at);
            if shard.len() >= self.per_shard {
                // Still full of live refusals: drop the one that ends soonest.
                let soonest = shard
                    .iter()
                    .min_by_key(|(_, e)| e.until_us)
                    .map(|(k, _)| k.clone());
                if let Some(k) = soonest {
                    shard.remove(&k);
                }
            }
            self.len.fetch_sub(before - shard.len(), Ordering::Relaxed);
        }
        shard.insert(key.into(), entry);
        self.len.fetch_add(1, Ordering::Relaxed);
    }

    /// Drops every entry (the rules changed: `Engine::rules_changed`), so the hot path is back to
    /// one atomic load until something is refused again.
    pub fn clear(&self) {
        for shard in self.shards.iter() {
            let mut shard = shard.lock().unwrap_or_else(|e| e.into_inner());
            self.len.fetch_sub(shard.len(), Ordering::Relaxed);
            shard.clear();
        }
    }

    /// Drops expired entries everywhere (the sweeper), so an idle cache is empty again.
    pub fn sweep(&self, now: u64) {
        for shard in self.shards.iter() {
            let mut shard = shard.lock().unwrap_or_else(|e| e.into_inner());
            let before = shard.len();
            shard.retain(|_, e| e.until_us > now);
            self.len.fetch_sub(before - shard.len(), Ordering::Relaxed);
        }
    }
}
