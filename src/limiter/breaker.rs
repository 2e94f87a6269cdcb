//! A circuit breaker for the Redis store, so that an outage costs requests nothing.
//!
//! Without it every request would wait the full store timeout before its route's failure mode
//! applies. After [`FAILURES_TO_OPEN`] consecutive failures the breaker opens: requests skip Redis
//! at once for [`COOL_DOWN`]. Then one request at a time is let through as a probe; its success
//! closes the breaker, its failure opens it for another cool-down.
//!
//! One server and Sentinel's master have one breaker; a Redis Cluster has one per master
//! (`redis/cluster.rs`), so a dead master's failures skip only the calls of its own slots.
//!
//! Lock-free: three atomics, read on every request. Time is passed in (milliseconds on a monotonic
//! clock) so the state machine is tested without sleeping.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// Consecutive failures that open the breaker.
pub const FAILURES_TO_OPEN: u32 = 5;
/// How long an open breaker skips the store before probing it.
pub const COOL_DOWN: Duration = Duration::from_secs(1);

/// What a request may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// The breaker is closed: use the store.
    Pass,
    /// The breaker was open and this request is the one probe: use the store and report back.
    Probe,
    /// Skip the store.
    Skip,
}

#[derive(Debug, Default)]
pub struct Breaker {
    failures: AtomicU32,
    /// While non-zero, the breaker is open until this instant (ms); 0 when closed.
    open_until_ms: AtomicU64,
    /// A probe is in flight.
    probing: AtomicBool,
}

impl Breaker {
    pub fn admit(&self, now_ms: u64) -> Admission {
        let until = self.open_until_ms.load(Ordering::Acquire);
        if until == 0 {
            return Admission::Pass;
        }
        if now_ms < until {
            return Admission::Skip;
        }
        match self
            .probing
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => Admission::Probe,
            Err(_) => Admission::Skip,
        }
    }

    /// The store answered (or failed in a way that is not about its availability).
    pub fn success(&self) {
        self.failures.store(0, Ordering::Relaxed);
        if self.open_until_ms.load(Ordering::Relaxed) != 0 {
            self.open_until_ms.store(0, Ordering::Release);
            self.probing.store(false, Ordering::Release);
        }
    }

    /// The store timed out or could not be reached. Returns `true` when this opened the breaker.
    pub fn failure(&self, now_ms: u64, was_probe: bool) -> bool {
        let failures = self
            .failures
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1);
        if was_probe || failures >= FAILURES_TO_OPEN {
            let was_closed = self.open_until_ms.load(Ordering::Relaxed) == 0;
            // `max(1)`: 0 means closed.
            let until = (now_ms + COOL_DOWN.as_millis() as u64).max(1);
            self.open_until_ms.store(until, Ordering::Release);
            self.probing.store(false, Ordering::Release);
            return was_closed;
        }
        false
    }

    pub fn is_open(&self) -> bool {
        self.open_until_ms.load(Ordering::Relaxed) != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const COOL: u64 = COOL_DOWN.as_millis() as u64;

    #[test]
    fn opens_after_consecutive_failures_only() {
        let b = Breaker::default();
        for _ in 0..FAILURES_TO_OPEN - 1 {
            assert!(!b.failure(10, false));
        }
        b.success();
        for _ in 0..FAILURES_TO_OPEN - 1 {
            assert!(!b.failure(10, false));
        }
        assert_eq!(b.admit(10), Admission::Pass);
        assert!(b.failure(10, false));
        assert_eq!(b.admit(11), Admission::Skip);
        assert_eq!(b.admit(10 + COOL - 1), Admission::Skip);
    }

    #[test]
    fn one_probe_after_cool_down_then_closes_on_success() {
        let b = Breaker::default();
        for _ in 0..FAILURES_TO_OPEN {
            b.failure(0, false);
        }
        assert_eq!(b.admit(COOL), Admission::Probe);
        assert_eq!(b.admit(COOL), Admission::Skip, "only one probe at a time");
        b.success();
        assert!(!b.is_open());
        assert_eq!(b.admit(COOL + 1), Admission::Pass);
    }

    #[test]
    fn failed_probe_reopens_for_a_full_cool_down() {
        let b = Breaker::default();
        for _ in 0..FAILURES_TO_OPEN {
            b.failure(0, false);
        }
        assert_eq!(b.admit(COOL + 5), Admission::Probe);
        assert!(
            !b.failure(COOL + 5, true),
            "already open: not a new opening"
        );
        assert_eq!(b.admit(2 * COOL + 4), Admission::Skip);
        assert_eq!(b.admit(2 * COOL + 5), Admission::Probe);
    }
}
