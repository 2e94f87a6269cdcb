//! Quota shares: one budget divided among the proxies that enforce it locally (Envoy's rate
//! limit quota filter, served by [`crate::rlqs`]). The door hands over usage reports and stream
//! events; this module decides every assignment and returns what to send. The algorithm and its
//! bound are in `docs/algorithms.md` ("Quota shares").
//!
//! Each bucket (one bucket id, one budget) holds its members: one per proxy stream that reports
//! it. A member's assignment is a token bucket of `tokens_per_fill` tokens per `fill_interval`
//! and `max_tokens` deep. The rules that keep the bound:
//!
//! - the tokens per fill of every assignment not yet expired (a vanished proxy's included, until
//!   its TTL ends) sum to at most the pool;
//! - Envoy starts a *changed* bucket full, so every bucket start is paid from the bucket's credit
//!   (`quota_credit.rs`): what the pool earned and the assignments did not spend, at most
//!   `burst + members` tokens. No start without the credit for its depth: the long-run rate
//!   stays within the budget;
//! - while the pool can give every live member a token, a reserve (`(burst + members) /
//!   reassign_every`) is left out of the split: it earns the credit for one change per member per
//!   `reassign_every`; a smaller pool is handed out whole, one token to each member with demand
//!   in turns when there are more of them than tokens (`quota_split.rs`), so none starves;
//! - the same assignment sent again only extends its TTL (Envoy keeps the bucket), so refreshing
//!   costs nothing;
//! - a pool is the whole budget on the in-process store (after a hold-down of one TTL at start,
//!   so a restart never overlaps the assignments of the previous run), or this server's lease
//!   from Redis ([`Pool::Leased`], `redis/quota.rs`), which never shrinks below what is out.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

#[path = "quota_credit.rs"]
mod credit;
#[path = "quota_split.rs"]
mod split;

pub use split::{targets, turns, Target, Turn};

/// A budget as configured: the global token bucket every proxy's share comes out of.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Budget {
    /// Tokens (requests) per second, for all proxies together.
    pub rate: f64,
    /// The sum of the proxies' `max_tokens` (each gets at least 1).
    pub burst: u32,
    /// Each proxy's least share, tokens per second, while the budget allows.
    pub floor: f64,
}

/// The timing every bucket shares (`rlqs:` in `policies.yaml`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// The assignment's time to live, whole seconds (Envoy reads only the seconds).
    pub ttl_s: u32,
    /// The least time between two changes of one member's bucket.
    pub reassign_every: Duration,
    /// The token bucket's `fill_interval`, whole seconds (Envoy cuts anything else).
    pub fill_interval_s: u32,
    /// Reports in a row without a request after which a member is abandoned.
    pub abandon_after: u32,
}

impl Timing {
    fn ttl_us(&self) -> u64 {
        u64::from(self.ttl_s) * 1_000_000
    }

    fn reassign_us(&self) -> u64 {
        u64::try_from(self.reassign_every.as_micros()).unwrap_or(u64::MAX)
    }
}

/// One proxy stream, as the door numbers them.
pub type ProxyId = u64;

/// A bucket id: its entries, sorted by key.
pub type BucketKey = Arc<[(String, String)]>;

/// What a member is told to enforce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Assignment {
    /// Refuse every request (a share too small to split).
    Deny,
    Bucket {
        tokens_per_fill: u32,
        max_tokens: u32,
    },
}

impl Assignment {
    /// Tokens per fill interval (0 for `Deny`).
    pub fn tokens(self) -> u32 {
        match self {
            Assignment::Deny => 0,
            Assignment::Bucket {
                tokens_per_fill, ..
            } => tokens_per_fill,
        }
    }

    /// The bucket's depth (0 for `Deny`).
    pub fn max_tokens(self) -> u32 {
        match self {
            Assignment::Deny => 0,
            Assignment::Bucket { max_tokens, .. } => max_tokens,
        }
    }
}

/// One message for one member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Assign {
        assignment: Assignment,
        ttl_s: u32,
        /// Whether it differs from the member's previous one (Envoy starts it full).
        changed: bool,
    },
    /// The server stops tracking the bucket for this member: it reported no request for
    /// `abandon_after` reports.
    Abandon,
}

/// An action addressed to one proxy stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Push {
    pub proxy: ProxyId,
    pub bucket: BucketKey,
    pub action: Action,
}

/// One bucket's part of a usage report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub allowed: u64,
    pub denied: u64,
    /// Whole seconds since the member's previous report (0 on its first).
    pub elapsed_s: u64,
}

/// Where a bucket's tokens come from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Pool {
    /// The whole budget (the in-process store: this server alone serves it).
    Whole,
    /// This server's lease from Redis: it may hand out `rate` tokens per second, and Redis holds
    /// `grant` (at least `rate`, and at least what is out) for it, until `until_us`; nothing
    /// before the first grant.
    Leased {
        rate: f64,
        grant: f64,
        until_us: u64,
    },
}

/// What a bucket asks of Redis: its lease request ([`crate::limiter::RedisStore::quota_lease`]).
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseAsk {
    pub bucket: BucketKey,
    pub budget: Budget,
    /// Tokens per second this server has out (assignments not yet expired): the lease never
    /// drops below it.
    pub held: f64,
    /// The members' recent demand, requests per second.
    pub demand: f64,
    /// This server's least share: its members' floors and its reserve.
    pub floor: f64,
}

#[derive(Debug)]
struct Member {
    /// Requests per second (allowed and denied) in the last report.
    demand: f64,
    /// Reports in a row with no request.
    idle_reports: u32,
    current: Option<Assignment>,
    /// When its bucket last started (was first sent or changed).
    started_us: Option<u64>,
    /// Until when its assignment may be in force (the last send plus the TTL).
    expires_us: u64,
    /// When it last held tokens (0: never): who has waited longest takes the next turn.
    served_us: u64,
    connected: bool,
}

#[derive(Debug)]
struct Bucket {
    budget: Budget,
    /// The door's index for the budget's metrics.
    rule: usize,
    pool: Pool,
    members: HashMap<ProxyId, Member>,
    /// Tokens that pay for bucket starts (`quota_credit.rs`), as of `credit_us`.
    credit: f64,
    credit_us: u64,
}

#[derive(Debug, Default)]
struct Inner {
    buckets: HashMap<BucketKey, Bucket>,
    proxies: HashMap<ProxyId, HashSet<BucketKey>>,
}

/// Every bucket this server tracks, shared by the door's streams and its tick.
#[derive(Debug)]
pub struct Shares {
    inner: Mutex<Inner>,
    timing: Timing,
    /// Nothing is handed out before this (a restart must not overlap the previous run's
    /// assignments); 0 with Redis, whose leases outlive a restart.
    hold_until_us: u64,
    leased: bool,
    max_buckets: usize,
}

/// A bucket's view for metrics: its rule and each member's tokens per second.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketView {
    pub rule: usize,
    pub shares: Vec<(ProxyId, f64)>,
}

/// Why a report's bucket was not tracked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Untracked {
    /// `max_buckets` are tracked already.
    Full,
}

/// Margin added to an assignment's expiry for the message's way to the proxy.
const DELIVERY_MARGIN_US: u64 = 250_000;

impl Shares {
    /// `leased`: pools come from Redis leases ([`Shares::lease_asks`], [`Shares::set_lease`]);
    /// otherwise each pool is the whole budget, from `now_us` plus one TTL on.
    pub fn new(timing: Timing, leased: bool, max_buckets: usize, now_us: u64) -> Self {
        let hold_until_us = if leased {
            0
        } else {
            now_us + timing.ttl_us() + DELIVERY_MARGIN_US
        };
        Shares {
            inner: Mutex::new(Inner::default()),
            timing,
            hold_until_us,
            leased,
            max_buckets,
        }
    }

    pub fn timing(&self) -> Timing {
        self.timing
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A member's report for `bucket` (under `budget`, the door's rule `rule`): its demand is
    /// updated, the bucket rebalanced, and the member's assignment sent again (which extends
    /// its TTL) when nothing changed. Returns every message to send.
    pub fn report(
        &self,
        proxy: ProxyId,
        bucket: &BucketKey,
        (budget, rule): (Budget, usize),
        usage: Usage,
        now_us: u64,
    ) -> Result<Vec<Push>, Untracked> {
        let mut inner = self.lock();
        let inner = &mut *inner;
        if !inner.buckets.contains_key(bucket) && inner.buckets.len() >= self.max_buckets {
            return Err(Untracked::Full);
        }
        let state = inner
            .buckets
            .entry(bucket.clone())
            .or_insert_with(|| Bucket {
                budget,
                rule,
                pool: if self.leased {
                    Pool::Leased {
                        rate: 0.0,
                        grant: 0.0,
                        until_us: 0,
                    }
                } else {
                    Pool::Whole
                },
                members: HashMap::new(),
                credit: 0.0,
                credit_us: now_us,
            });
        // What the pool earned and spent so far was under the rule before.
        self.accrue(state, now_us);
        // A reload or an override may have changed the rule: the next rebalance applies it.
        state.budget = budget;
        state.rule = rule;
        inner
            .proxies
            .entry(proxy)
            .or_default()
            .insert(bucket.clone());
        let member = state.members.entry(proxy).or_insert_with(|| Member {
            demand: 0.0,
            idle_reports: 0,
            current: None,
            started_us: None,
            expires_us: 0,
            served_us: 0,
            connected: true,
        });
        let requests = usage.allowed.saturating_add(usage.denied);
        member.demand = requests as f64 / usage.elapsed_s.max(1) as f64;
        let mut out = Vec::new();
        if requests == 0 && member.current.is_some() {
            member.idle_reports += 1;
            if member.idle_reports >= self.timing.abandon_after {
                // The proxy drops the bucket as it reads this: its assignment ends here.
                state.members.remove(&proxy);
                if let Some(set) = inner.proxies.get_mut(&proxy) {
                    set.remove(bucket);
                }
                out.push(Push {
                    proxy,
                    bucket: bucket.clone(),
                    action: Action::Abandon,
                });
                self.rebalance(bucket, state, now_us, &mut out);
                return Ok(out);
            }
        } else {
            member.idle_reports = 0;
        }
        self.rebalance(bucket, state, now_us, &mut out);
        if !out.iter().any(|p| p.proxy == proxy) {
            if let Some(push) = self.refresh(proxy, bucket, state, now_us) {
                out.push(push);
            }
        }
        Ok(out)
    }

    /// A stream ended: its members keep their share until their assignments expire.
    pub fn disconnect(&self, proxy: ProxyId) {
        let mut inner = self.lock();
        let inner = &mut *inner;
        for bucket in inner.proxies.remove(&proxy).unwrap_or_default() {
            if let Some(state) = inner.buckets.get_mut(&bucket) {
                if let Some(member) = state.members.get_mut(&proxy) {
                    member.connected = false;
                }
            }
        }
    }

    /// The periodic pass (about once a second): drops members whose assignments have expired
    /// after their stream ended, applies the changes `reassign_every` held back, and sends
    /// assignments again before their TTL runs out.
    pub fn tick(&self, now_us: u64) -> Vec<Push> {
        let mut inner = self.lock();
        let mut out = Vec::new();
        inner.buckets.retain(|bucket, state| {
            // The members about to go spent their tokens until now.
            self.accrue(state, now_us);
            state
                .members
                .retain(|_, m| m.connected || m.expires_us > now_us);
            if state.members.is_empty() {
                return false;
            }
            self.rebalance(bucket, state, now_us, &mut out);
            let due: Vec<ProxyId> = state
                .members
                .iter()
                .filter(|(id, m)| {
                    m.connected
                        && m.current.is_some()
                        && m.expires_us < now_us + self.timing.ttl_us() / 2
                        && !out.iter().any(|p| p.proxy == **id && p.bucket == *bucket)
                })
                .map(|(id, _)| *id)
                .collect();
            for proxy in due {
                out.extend(self.refresh(proxy, bucket, state, now_us));
            }
            true
        });
        out
    }

    /// Every bucket's lease request (Redis only).
    pub fn lease_asks(&self, now_us: u64) -> Vec<LeaseAsk> {
        let inner = self.lock();
        inner
            .buckets
            .iter()
            .map(|(key, b)| {
                let (held_tokens, reserve) = held(b, &self.timing, now_us);
                let f = f64::from(self.timing.fill_interval_s);
                let live = b.members.values().filter(|m| m.connected).count();
                LeaseAsk {
                    bucket: key.clone(),
                    budget: b.budget,
                    held: f64::from(held_tokens) / f,
                    demand: b.members.values().map(|m| m.demand).sum(),
                    floor: b.budget.floor * live as f64 + f64::from(reserve) / f,
                }
            })
            .collect()
    }

    /// A lease granted by Redis and acknowledged by a replica where there is one: `grant`
    /// tokens per second held for this server, `rate` of which it may hand out, until `until_us`.
    pub fn set_lease(
        &self,
        bucket: &BucketKey,
        (grant, rate): (f64, f64),
        until_us: u64,
        now_us: u64,
    ) {
        if let Some(state) = self.lock().buckets.get_mut(bucket) {
            self.accrue(state, now_us);
            state.pool = Pool::Leased {
                rate,
                grant,
                until_us,
            };
        }
    }

    /// A lease renewal that no replica acknowledged: a failover may lose it, so the last
    /// acknowledged lease stays in force (until it ends), lowered to the renewal's `grant` and
    /// `rate` where those are less.
    pub fn cap_lease(&self, bucket: &BucketKey, (grant, rate): (f64, f64), now_us: u64) {
        if let Some(state) = self.lock().buckets.get_mut(bucket) {
            self.accrue(state, now_us);
            if let Pool::Leased {
                rate: r, grant: g, ..
            } = &mut state.pool
            {
                *r = r.min(rate);
                *g = g.min(grant);
            }
        }
    }

    /// The number of buckets tracked.
    pub fn buckets(&self) -> usize {
        self.lock().buckets.len()
    }

    /// Each bucket's members and their tokens per second (for the metrics).
    pub fn view(&self) -> Vec<BucketView> {
        let inner = self.lock();
        let f = f64::from(self.timing.fill_interval_s);
        inner
            .buckets
            .values()
            .map(|b| BucketView {
                rule: b.rule,
                shares: b
                    .members
                    .iter()
                    .map(|(id, m)| (*id, f64::from(m.current.map_or(0, Assignment::tokens)) / f))
                    .collect(),
            })
            .collect()
    }

    /// The pool's tokens per fill interval and the TTL an assignment sent now may carry.
    fn pool(&self, state: &Bucket, now_us: u64) -> (u32, u32) {
        if now_us < self.hold_until_us {
            return (0, 0);
        }
        let f = f64::from(self.timing.fill_interval_s);
        match state.pool {
            Pool::Whole => ((state.budget.rate * f).floor() as u32, self.timing.ttl_s),
            Pool::Leased { rate, until_us, .. } => {
                // An assignment must end before the lease does, in whole seconds.
                let left_s = until_us.saturating_sub(now_us + DELIVERY_MARGIN_US) / 1_000_000;
                let ttl = u32::try_from(left_s)
                    .unwrap_or(u32::MAX)
                    .min(self.timing.ttl_s);
                if ttl == 0 {
                    (0, 0)
                } else {
                    ((rate.min(state.budget.rate) * f + 1e-9).floor() as u32, ttl)
                }
            }
        }
    }

    /// The member's assignment again, as it is (Envoy only extends its TTL).
    fn refresh(
        &self,
        proxy: ProxyId,
        bucket: &BucketKey,
        state: &mut Bucket,
        now_us: u64,
    ) -> Option<Push> {
        let (_, ttl_s) = self.pool(state, now_us);
        let member = state.members.get_mut(&proxy)?;
        let assignment = member.current?;
        if ttl_s == 0 || member.expires_us <= now_us {
            // Lapsed: sending it again would start a new bucket; the rebalance decides that.
            return None;
        }
        member.expires_us = now_us + u64::from(ttl_s) * 1_000_000 + DELIVERY_MARGIN_US;
        Some(Push {
            proxy,
            bucket: bucket.clone(),
            action: Action::Assign {
                assignment,
                ttl_s,
                changed: false,
            },
        })
    }

    /// Moves the members' assignments towards their targets: first every lowering that is due,
    /// then raises within what is left, never past the pool, never two bucket changes of one
    /// member within `reassign_every`, and no bucket start the credit cannot pay for (a lowering
    /// it cannot pay for goes to `DENY_ALL`, which starts nothing).
    fn rebalance(&self, bucket: &BucketKey, state: &mut Bucket, now_us: u64, out: &mut Vec<Push>) {
        let timing = &self.timing;
        self.accrue(state, now_us);
        for m in state.members.values_mut() {
            if m.expires_us <= now_us {
                // The proxy has lost it (the TTL ran out): a new one starts a new bucket.
                m.current = None;
            }
        }
        let (pool_tokens, ttl_s) = self.pool(state, now_us);
        if ttl_s == 0 {
            return;
        }
        let (_, reserve) = held(state, timing, now_us);
        let gone: u32 = state
            .members
            .values()
            .filter(|m| !m.connected)
            .map(|m| m.current.map_or(0, Assignment::tokens))
            .sum();
        let mut live: Vec<(ProxyId, f64)> = state
            .members
            .iter()
            .filter(|(_, m)| m.connected)
            .map(|(id, m)| (*id, m.demand))
            .collect();
        live.sort_unstable_by_key(|(id, _)| *id);
        let f = f64::from(timing.fill_interval_s);
        let can_change = |m: &Member| {
            // DENY_ALL starts no bucket: leaving it is never a second change.
            matches!(m.current, None | Some(Assignment::Deny))
                || m.started_us
                    .is_none_or(|s| now_us.saturating_sub(s) >= timing.reassign_us())
        };
        // A pool that can give every live member a token keeps the reserve out of the split;
        // a smaller one is handed out whole, in turns when it must be (`quota_split.rs`).
        let split = pool_tokens.saturating_sub(reserve).saturating_sub(gone);
        let (available, wanted, taking_turns) = if split as usize >= live.len() {
            let floor_tokens = (state.budget.floor * f).ceil() as u32;
            (split, targets(&live, split, floor_tokens), false)
        } else {
            let available = pool_tokens.saturating_sub(gone);
            let members: Vec<Turn> = live
                .iter()
                .map(|(id, demand)| {
                    let m = &state.members[id];
                    let holds = m.current.is_some_and(|a| a.tokens() > 0);
                    Turn {
                        proxy: *id,
                        demand: *demand,
                        holds,
                        may_yield: can_change(m),
                        served_us: m.served_us,
                    }
                })
                .collect();
            let (wanted, taking) = turns(&members, available);
            (available, wanted, taking)
        };
        let burst = burst_share(state);
        let assignment_for = |tokens: u32| {
            if tokens == 0 {
                Assignment::Deny
            } else {
                // Turns of one token each: depth 1, so a turn costs one token of credit.
                let depth = if taking_turns {
                    1.0
                } else {
                    (burst * f64::from(tokens) / f64::from(pool_tokens.max(1))).floor()
                };
                Assignment::Bucket {
                    tokens_per_fill: tokens,
                    max_tokens: (depth as u32).max(1),
                }
            }
        };
        let mut out_now: u32 = state
            .members
            .values()
            .filter(|m| m.connected)
            .map(|m| m.current.map_or(0, Assignment::tokens))
            .sum();
        let credit = &mut state.credit;
        // Sends `a` unless the credit cannot pay for the bucket it starts.
        let mut send = |proxy: ProxyId, m: &mut Member, a: Assignment| {
            let cost = f64::from(a.max_tokens());
            if cost > 0.0 && cost > *credit {
                return false;
            }
            *credit -= cost;
            if a.tokens() > 0 || m.current.is_some_and(|c| c.tokens() > 0) {
                m.served_us = now_us;
            }
            m.current = Some(a);
            m.started_us = Some(now_us);
            m.expires_us = now_us + u64::from(ttl_s) * 1_000_000 + DELIVERY_MARGIN_US;
            out.push(Push {
                proxy,
                bucket: bucket.clone(),
                action: Action::Assign {
                    assignment: a,
                    ttl_s,
                    changed: true,
                },
            });
            true
        };
        // What members without an assignment yet are due: room for them forces lowerings.
        let waiting: u32 = wanted
            .iter()
            .filter(|t| {
                state
                    .members
                    .get(&t.proxy)
                    .is_some_and(|m| m.current.is_none())
            })
            .map(|t| t.tokens)
            .sum();
        // Lowerings first: each one frees tokens for the raises.
        for t in &wanted {
            let Some(m) = state.members.get_mut(&t.proxy) else {
                continue;
            };
            let Some(current) = m.current else { continue };
            let have = current.tokens();
            let over = out_now + waiting > available;
            if t.tokens < have && can_change(m) && (over || differs(have, t.tokens)) {
                if send(t.proxy, m, assignment_for(t.tokens)) {
                    out_now -= have - t.tokens;
                } else if send(t.proxy, m, Assignment::Deny) {
                    out_now -= have;
                }
            }
        }
        // Then the raises, new members first, within what is left and what the credit pays.
        let mut order: Vec<&Target> = wanted.iter().collect();
        order.sort_by_key(|t| {
            let m = state.members.get(&t.proxy);
            (m.is_some_and(|m| m.current.is_some()), t.proxy)
        });
        for t in order {
            let Some(m) = state.members.get_mut(&t.proxy) else {
                continue;
            };
            let have = m.current.map(Assignment::tokens);
            let room = available.saturating_sub(out_now);
            let give = match have {
                None => t.tokens.min(room),
                Some(have) if t.tokens > have && can_change(m) => {
                    let give = t.tokens.min(have + room);
                    if give > have && (have == 0 || differs(have, give)) {
                        give
                    } else {
                        continue;
                    }
                }
                Some(_) => continue,
            };
            if give == 0 && t.tokens > 0 {
                // No room yet: it waits (the proxy on its no-assignment behaviour).
                continue;
            }
            if send(t.proxy, m, assignment_for(give)) {
                out_now += give - have.unwrap_or(0);
            }
        }
    }
}

/// Whether `to` is far enough from `have` to be worth a new bucket (which Envoy starts full):
/// by more than a tenth, and by at least one token.
fn differs(have: u32, to: u32) -> bool {
    let gap = have.abs_diff(to);
    gap >= 1 && u64::from(gap) * 10 > u64::from(have)
}

/// The part of the budget's burst this server's pool carries: all of it on the in-process
/// store, the lease's fraction with Redis.
fn burst_share(state: &Bucket) -> f64 {
    let burst = f64::from(state.budget.burst);
    match state.pool {
        Pool::Whole => burst,
        Pool::Leased { rate, .. } => burst * (rate / state.budget.rate).clamp(0.0, 1.0),
    }
}

/// The tokens per fill out (every unexpired assignment, a vanished member's included) and the
/// reserve that pays for bucket restarts: `(burst + members) * fill / reassign_every`, rounded up.
fn held(state: &Bucket, timing: &Timing, now_us: u64) -> (u32, u32) {
    let out = state
        .members
        .values()
        .filter(|m| m.expires_us > now_us)
        .map(|m| m.current.map_or(0, Assignment::tokens))
        .sum();
    let members = state.members.len() as f64;
    let every = timing.reassign_every.as_secs_f64().max(1e-3);
    let reserve =
        ((burst_share(state) + members) * f64::from(timing.fill_interval_s) / every).ceil() as u32;
    (out, reserve)
}

#[cfg(test)]
#[path = "quota_tests.rs"]
mod tests;
