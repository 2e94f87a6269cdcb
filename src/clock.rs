//! Time as the in-process store and the engine see it. Injected, so algorithm tests advance it by
//! hand instead of sleeping. (The Redis store never uses it: its scripts read Redis `TIME`.) The
//! wall clock ([`SystemClock`]) is only for the Envoy service's calendar-aligned fixed windows.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// A source of microsecond timestamps that never go backwards.
pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now_us(&self) -> u64;

    /// The time at `instant`, a reading of the monotonic clock taken just before, so that one
    /// reading serves a decision's counters and its latency metric. A clock that is not driven by
    /// the monotonic clock ignores it.
    fn at(&self, instant: Instant) -> u64 {
        let _ = instant;
        self.now_us()
    }
}

/// The production clock: microseconds since the Unix epoch as read once at creation, advanced by
/// a monotonic source, so a wall-clock step never refills or drains a bucket. Starting at the
/// wall time (rather than 0) lets calendar quotas read local dates from it; it follows NTP's
/// slewing but not a step of the system clock, which a calendar quota of the in-process store
/// therefore sees only after a restart.
#[derive(Debug)]
pub struct MonotonicClock {
    start: Instant,
    origin_us: u64,
}

impl MonotonicClock {
    pub fn new() -> Self {
        let origin_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(0));
        MonotonicClock {
            start: Instant::now(),
            origin_us,
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now_us(&self) -> u64 {
        self.at(Instant::now())
    }

    fn at(&self, instant: Instant) -> u64 {
        let since = instant.saturating_duration_since(self.start);
        self.origin_us.saturating_add(since.as_micros() as u64)
    }
}

/// A clock tests move by hand.
#[derive(Debug, Default)]
pub struct ManualClock {
    now: AtomicU64,
}

impl ManualClock {
    pub fn new(now_us: u64) -> Self {
        ManualClock {
            now: AtomicU64::new(now_us),
        }
    }

    pub fn set(&self, now_us: u64) {
        self.now.store(now_us, Ordering::SeqCst);
    }

    pub fn advance_us(&self, us: u64) {
        self.now.fetch_add(us, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_us(&self) -> u64 {
        self.now.load(Ordering::SeqCst)
    }
}

/// Wall-clock microseconds since the Unix epoch, never going backwards: fixed windows are
/// calendar-aligned, as in envoyproxy/ratelimit (a minute resets at :00).
#[derive(Debug, Default)]
pub struct SystemClock {
    last: AtomicU64,
}

impl Clock for SystemClock {
    fn now_us(&self) -> u64 {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
        self.last.fetch_max(now, Ordering::Relaxed).max(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_monotonic_reading_converts_to_the_same_timeline_as_now() {
        let clock = MonotonicClock::new();
        let before = clock.now_us();
        let instant = Instant::now();
        let at = clock.at(instant);
        let after = clock.now_us();
        assert!(before <= at && at <= after, "{before} {at} {after}");
        assert_eq!(clock.at(instant + Duration::from_millis(5)), at + 5_000);
        // An instant before the clock was made is its start, not an underflow.
        if let Some(earlier) = clock.start.checked_sub(Duration::from_secs(1)) {
            assert_eq!(clock.at(earlier), clock.origin_us);
        }
    }

    #[test]
    fn a_manual_clock_ignores_the_instant() {
        let clock = ManualClock::new(42);
        assert_eq!(clock.at(Instant::now() + Duration::from_secs(9)), 42);
    }
}
