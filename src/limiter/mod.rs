//! The decision core: rules, the outcome of checking them, the stores that keep the counters, and
//! the [`Engine`] every door decides through.
//!
//! Every door (the inline gateway, the Envoy rate limit service, forward-auth) reduces a request to
//! [`Checks`] and asks the [`Engine`] for a [`Verdict`]; the engine asks a [`Store`] for one
//! all-or-nothing [`Decision`]. The math is in [`algorithm`] (and, for Redis, in
//! `scripts/decide.lua`); a store only adds state and atomicity, and the engine the policy around
//! it (merging keys, failure modes, metrics, the governing outcome).

pub mod algorithm;
pub mod breaker;
pub mod calendar;
pub use crate::clock;
pub mod deny_cache;
pub mod engine;
pub mod lease_queue;
pub mod leases;
pub mod memory;
pub mod pacing;
pub mod quota;
pub mod redis;

use std::time::Duration;

pub use clock::{Clock, ManualClock, MonotonicClock, SystemClock};
pub use engine::{Checks, Engine, FailureMode, Kind, Reservation, Tally, Verdict};
pub use memory::MemoryStore;
pub use redis::RedisStore;

/// A continuously refilling bucket: `burst` units at most, `rate` units per second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenBucket {
    /// Units per second; positive and finite.
    pub rate: f64,
    pub burst: u64,
}

/// At most `limit` units in any interval of `window_us`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlidingWindow {
    pub limit: u64,
    pub window_us: u64,
    /// 0 for the exact log; otherwise the number of sub-windows (divides `window_us`).
    pub buckets: u32,
}

/// At most `limit` requests in flight: each admitted request holds a lease until it is released,
/// or for `lease_ttl_us` at most (a crashed instance cannot leak capacity for longer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Concurrency {
    pub limit: u64,
    pub lease_ttl_us: u64,
}

/// At most `limit` units per calendar period (a day, an ISO week from Monday, a month) in a named
/// time zone: the counter resets at local midnight of the period's first day, DST included
/// (`calendar.rs` computes the period, `docs/algorithms.md` "Calendar quota" has the math).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    pub limit: u64,
    pub per: calendar::Per,
    pub time_zone: chrono_tz::Tz,
}

/// One rate-limiting rule, already validated: the hot path never looks at config strings again.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Rule {
    TokenBucket(TokenBucket),
    SlidingWindow(SlidingWindow),
    Concurrency(Concurrency),
    Quota(Quota),
}

impl Rule {
    /// The `X-RateLimit-Limit` this rule advertises.
    pub fn limit(&self) -> u64 {
        match self {
            Rule::TokenBucket(tb) => tb.burst,
            Rule::SlidingWindow(sw) => sw.limit,
            Rule::Concurrency(cc) => cc.limit,
            Rule::Quota(q) => q.limit,
        }
    }

    /// Why a counter kept under `old` starts afresh under this rule (a reload changed the
    /// policy), or `None` when its state carries over, on both engines: the same algorithm with
    /// other numbers keeps counting (a bucket's tokens, a window's entries, a quota's units of the
    /// period, leases), as `memory.rs` (`MemoryStore::counter`) and the Redis key layout
    /// (`wire::push_key`) do.
    pub fn restarts_from(&self, old: &Rule) -> Option<&'static str> {
        match (old, self) {
            (Rule::TokenBucket(_), Rule::TokenBucket(_))
            | (Rule::Concurrency(_), Rule::Concurrency(_)) => None,
            (Rule::SlidingWindow(o), Rule::SlidingWindow(n)) => {
                if o.buckets == 0 && n.buckets == 0 {
                    None
                } else if o.buckets == 0 || n.buckets == 0 {
                    Some("the sliding window changed between exact and bucketed")
                } else if (o.buckets, o.window_us) != (n.buckets, n.window_us) {
                    Some("the bucketed window's length or buckets changed")
                } else {
                    None
                }
            }
            (Rule::Quota(o), Rule::Quota(n)) => {
                if o.per != n.per {
                    Some("the quota's period changed")
                } else if o.time_zone != n.time_zone {
                    Some("the quota's time zone changed")
                } else {
                    None
                }
            }
            _ => Some("the algorithm changed"),
        }
    }

    /// A short tag naming the state layout, so one counter key never holds two kinds of state.
    pub fn kind(&self) -> &'static str {
        match self {
            Rule::TokenBucket(_) => "tb",
            Rule::SlidingWindow(SlidingWindow { buckets: 0, .. }) => "sw",
            Rule::SlidingWindow(_) => "swb",
            Rule::Concurrency(_) => "cc",
            Rule::Quota(_) => "q",
        }
    }
}

/// One counter to check within a store decision. Keys within one decision must be distinct: the
/// [`Engine`] merges repeated keys before a store sees them.
#[derive(Debug, Clone, Copy)]
pub struct Check<'a> {
    /// The counter's identity, already bounded and escaped by [`crate::keys`].
    pub key: &'a str,
    pub rule: &'a Rule,
    /// Units to consume; 0 checks without consuming.
    pub cost: u64,
    /// Report only (Envoy's `shadow_mode`): the check is evaluated and consumes when it and the
    /// decision allow, but its own refusal never rejects the request.
    pub shadow: bool,
    /// Pacing (`on_limit: delay`): the longest the request may wait for a slot, in µs, instead
    /// of being refused (`pacing.rs`); `None` refuses at once. `Some(0)` admits only what needs
    /// no wait, behind every reservation already made (a route whose waiters are at their cap).
    /// Token buckets and sliding windows; a store ignores it on other kinds (a concurrency
    /// check's wait for a lease is [`Store::enqueue`], after a refusing decision).
    pub max_delay_us: Option<u64>,
}

/// What one rule says about one request. Times are microseconds so both engines agree exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    pub allowed: bool,
    pub limit: u64,
    /// Whole units left after this request (before it, when the decision rejected it).
    pub remaining: u64,
    /// Until the counter is fully restored if nothing more is consumed.
    pub reset_us: u64,
    /// Until this same request could succeed; 0 when allowed.
    pub retry_after_us: u64,
}

impl Outcome {
    pub fn reset(&self) -> Duration {
        Duration::from_micros(self.reset_us)
    }

    pub fn retry_after(&self) -> Duration {
        Duration::from_micros(self.retry_after_us)
    }
}

/// The all-or-nothing answer for a request: it was admitted (and consumed from every counter) only
/// when every check allowed it, shadow checks aside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub allowed: bool,
    /// One outcome per check, in the order of the checks.
    pub outcomes: Outcomes,
    /// Admitted for later (pacing): how long the request waits for its slot, in µs; 0 when it
    /// was admitted now or refused.
    pub delay_us: u64,
    /// Admitted for later: the slot, in the store's clock (µs), at which every window check of
    /// the decision recorded it (its refund stamp, `Store::unreserve`); 0 otherwise.
    pub slot_us: u64,
    /// What identifies each check's consumption, for a refund of it ([`Store::refund`]): one per
    /// check when the store decided them, else none. A token bucket's is 0 (a refund needs no
    /// stamp); an exact window's the time its units were written at; a bucketed window's the
    /// bucket index; a quota's the start of the period it counted in; a concurrency check's its
    /// lease (decide.lua's reply, `docs/algorithms.md` "Reserve, then settle").
    pub stamps: Stamps,
}

/// One outcome per check, inline for the usual few checks (no allocation per decision).
pub type Outcomes = smallvec::SmallVec<[Outcome; engine::INLINE_CHECKS]>;

/// One refund stamp per check (see [`Decision::stamps`]), inline like [`Outcomes`].
pub type Stamps = smallvec::SmallVec<[u64; engine::INLINE_CHECKS]>;

impl Decision {
    pub fn from_outcomes(outcomes: impl Into<Outcomes>) -> Self {
        let outcomes = outcomes.into();
        Decision {
            allowed: outcomes.iter().all(|o| o.allowed),
            outcomes,
            delay_us: 0,
            slot_us: 0,
            stamps: Stamps::new(),
        }
    }

    /// The stamp of check `i` (0 when the store gave none).
    pub fn stamp(&self, i: usize) -> u64 {
        self.stamps.get(i).copied().unwrap_or(0)
    }

    /// The decision over `checks` (one outcome each, in order): shadow checks never reject.
    pub fn from_checks(checks: &[Check<'_>], outcomes: impl Into<Outcomes>) -> Self {
        let outcomes = outcomes.into();
        Decision {
            allowed: checks
                .iter()
                .zip(&outcomes)
                .all(|(c, o)| c.shadow || o.allowed),
            outcomes,
            delay_us: 0,
            slot_us: 0,
            stamps: Stamps::new(),
        }
    }

    /// Whether a store commits check `i`: the decision admitted the request and the check itself
    /// allowed it (a shadow check over its limit consumes nothing, as if it were enforced).
    pub fn commits(&self, i: usize) -> bool {
        self.allowed && self.outcomes.get(i).is_some_and(|o| o.allowed)
    }
}

/// Why a store could not decide. The engine turns it into an answer by the caller's [`FailureMode`].
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store did not answer within {0:?}")]
    Timeout(Duration),
    #[error("store connection failed: {0}")]
    Connection(String),
    #[error("store script failed: {0}")]
    Script(String),
    #[error("store skipped: circuit open after repeated failures")]
    CircuitOpen,
}

impl StoreError {
    /// A bounded label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::Timeout(_) => "timeout",
            StoreError::Connection(_) => "connection",
            StoreError::Script(_) => "script",
            StoreError::CircuitOpen => "circuit_open",
        }
    }
}

/// Where counters live. An enum rather than a trait object: two engines, no boxing per request.
#[derive(Debug)]
pub enum Store {
    Memory(MemoryStore),
    Redis(RedisStore),
    /// The in-process store behind a switch that makes it fail on demand (engine unit tests).
    #[cfg(test)]
    Faulty(engine::tests::FaultyStore),
}

impl Store {
    /// Checks every counter and consumes from all of them only if all allow.
    pub async fn check(&self, checks: &[Check<'_>]) -> Result<Decision, StoreError> {
        self.check_leased(checks, 0).await
    }

    /// [`Store::check`], where a concurrency check that commits takes lease `lease` (an id unique
    /// among the leases held, below 2^53 so Lua holds it exactly).
    pub async fn check_leased(
        &self,
        checks: &[Check<'_>],
        lease: u64,
    ) -> Result<Decision, StoreError> {
        self.check_leased_at(checks, lease, crate::now::read())
            .await
    }

    /// [`Store::check_leased`], the in-process store deciding at `at` (a monotonic clock reading
    /// the caller just took); the Redis store reads Redis `TIME` whatever `at` says.
    pub async fn check_leased_at(
        &self,
        checks: &[Check<'_>],
        lease: u64,
        at: std::time::Instant,
    ) -> Result<Decision, StoreError> {
        match self {
            Store::Memory(store) => Ok(store.check_leased_at(checks, lease, at)),
            Store::Redis(store) => store.check_leased(checks, lease).await,
            #[cfg(test)]
            Store::Faulty(store) => store.check(checks),
        }
    }

    /// Every check's state as its decision would report it, consuming nothing and writing
    /// nothing (no counter created, refilled, pruned or re-expired): each outcome is what a
    /// decision refusing the request would report (remaining and reset now; allowed and
    /// retry-after for the check's cost). The status page's lookup and the quota endpoint read
    /// it; `tests/conformance.rs` holds both engines to it.
    pub async fn peek(&self, checks: &[Check<'_>]) -> Result<Decision, StoreError> {
        match self {
            Store::Memory(store) => Ok(store.peek(checks)),
            Store::Redis(store) => Box::pin(store.peek(checks)).await,
            #[cfg(test)]
            Store::Faulty(store) => store.peek(checks),
        }
    }

    /// Consumes every check's cost whatever the counters hold: the charge of a cost known only
    /// from the response, after the request was admitted (`docs/algorithms.md`).
    pub async fn charge(&self, checks: &[Check<'_>]) -> Result<(), StoreError> {
        match self {
            Store::Memory(store) => {
                store.charge(checks);
                Ok(())
            }
            Store::Redis(store) => Box::pin(store.charge(checks)).await,
            #[cfg(test)]
            Store::Faulty(_) => Ok(()),
        }
    }

    /// Gives back each check's `cost` from the consumption its stamp names (the admission's
    /// [`Decision::stamps`]): the part of a reservation the response did not use
    /// (`docs/algorithms.md`, "Reserve, then settle"). A bucket is capped at its burst; a window
    /// or a quota gets back at most what that admission wrote, in the entry, bucket or period
    /// it wrote it in, and nothing once that has left the window or the period has ended.
    /// Concurrency checks are skipped (a lease is released, not refunded).
    pub async fn refund(&self, checks: &[(Check<'_>, u64)]) -> Result<(), StoreError> {
        match self {
            Store::Memory(store) => {
                store.refund(checks);
                Ok(())
            }
            Store::Redis(store) => Box::pin(store.refund(checks)).await,
            #[cfg(test)]
            Store::Faulty(_) => Ok(()),
        }
    }

    /// Gives back a delayed decision's reservation made at slot `at` ([`Decision::slot_us`]):
    /// its request went away before the slot. Each check comes with its stamp in the decision
    /// ([`Decision::stamps`]). Token buckets get their cost back (capped at the burst), windows
    /// the units recorded at the slot, a paced quota the units counted in its stamp's period;
    /// other quotas and leases are not given back here.
    pub async fn unreserve(&self, checks: &[(Check<'_>, u64)], at: u64) -> Result<(), StoreError> {
        match self {
            Store::Memory(store) => {
                store.unreserve(checks, at);
                Ok(())
            }
            Store::Redis(store) => Box::pin(store.unreserve(checks, at)).await,
            #[cfg(test)]
            Store::Faulty(_) => Ok(()),
        }
    }

    /// Extends lease `lease` on the concurrency checks among `checks` (a request still running).
    pub async fn renew(&self, checks: &[Check<'_>], lease: u64) -> Result<(), StoreError> {
        match self {
            Store::Memory(store) => {
                store.renew(checks, lease);
                Ok(())
            }
            Store::Redis(store) => Box::pin(store.renew(checks, lease)).await,
            #[cfg(test)]
            Store::Faulty(_) => Ok(()),
        }
    }

    /// Releases lease `lease` on the concurrency checks among `checks`, handing each lease that
    /// comes free to the oldest live waiter of its key ([`lease_queue`]); returns the leases
    /// handed on.
    pub async fn release(&self, checks: &[Check<'_>], lease: u64) -> Result<Vec<u64>, StoreError> {
        match self {
            Store::Memory(store) => Ok(store.release(checks, lease)),
            Store::Redis(store) => Box::pin(store.release(checks, lease, "")).await,
            #[cfg(test)]
            Store::Faulty(_) => Ok(Vec::new()),
        }
    }

    /// Waits for a lease on the concurrency check `check`, whose counter refused the request:
    /// taken at once under `lease` when one came free and nobody queues before it, else a
    /// ticket at the back of the key's queue for `max_delay_us` at most ([`lease_queue`]).
    pub async fn enqueue(
        &self,
        check: &Check<'_>,
        lease: u64,
        max_delay_us: u64,
    ) -> Result<lease_queue::Enqueued, StoreError> {
        match self {
            Store::Memory(store) => Ok(store.enqueue(check, lease, max_delay_us)),
            Store::Redis(store) => Box::pin(store.enqueue(check, lease, max_delay_us)).await,
            #[cfg(test)]
            Store::Faulty(_) => Ok(lease_queue::Enqueued::Refused),
        }
    }

    /// A waiter for lease `lease` on `check` gives up (`ticket`: its [`lease_queue::Ticket`]'s
    /// name): its ticket leaves the queue, and a lease handed to it already is released, which
    /// hands it on. Returns the leases handed on.
    pub async fn leave(
        &self,
        check: &Check<'_>,
        lease: u64,
        ticket: &str,
    ) -> Result<Vec<u64>, StoreError> {
        match self {
            Store::Memory(store) => Ok(store.leave(check, lease)),
            Store::Redis(store) => {
                Box::pin(store.release(std::slice::from_ref(check), lease, ticket)).await
            }
            #[cfg(test)]
            Store::Faulty(_) => Ok(Vec::new()),
        }
    }

    /// The metrics label of this engine.
    pub fn name(&self) -> &'static str {
        match self {
            Store::Memory(_) => "memory",
            Store::Redis(_) => "redis",
            #[cfg(test)]
            Store::Faulty(_) => "faulty",
        }
    }

    /// Drops idle counters (the in-process store; Redis expires keys itself).
    pub fn sweep(&self) {
        match self {
            Store::Memory(store) => {
                store.sweep();
            }
            Store::Redis(_) => {}
            #[cfg(test)]
            Store::Faulty(_) => {}
        }
    }

    /// Changes whenever the store may have lost state (a Redis connection failed or was
    /// re-established, a script cache was found empty): refusals cached before say nothing after.
    pub fn epoch(&self) -> u64 {
        match self {
            Store::Memory(_) => 0,
            Store::Redis(store) => store.epoch(),
            #[cfg(test)]
            Store::Faulty(_) => 0,
        }
    }

    /// Whether the store can take decisions now (for `/readyz`).
    pub fn is_ready(&self) -> bool {
        match self {
            Store::Memory(_) => true,
            Store::Redis(store) => store.is_ready(),
            #[cfg(test)]
            Store::Faulty(_) => true,
        }
    }
}
