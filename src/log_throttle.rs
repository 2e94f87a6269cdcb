//! Throttled warnings: an attack repeats the same event thousands of times a second, and a log line
//! for each would cost more than the attack itself (and bury everything else). One [`Throttle`] per
//! kind of event lets one line through per period and counts the rest, so the next line says how
//! many were left out.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Lets one event through per period; shared by every connection.
#[derive(Debug)]
pub struct Throttle {
    period_ms: u64,
    /// Milliseconds since [`epoch`] plus one when the last line was let through; 0 for never.
    last: AtomicU64,
    suppressed: AtomicU64,
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

impl Throttle {
    pub const fn new(period: Duration) -> Self {
        Throttle {
            period_ms: period.as_millis() as u64,
            last: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(n)` when this event may be logged, `n` being how many were suppressed since the last
    /// one logged; `None` when it must be left out (and is counted).
    pub fn allow(&self) -> Option<u64> {
        let now = epoch().elapsed().as_millis() as u64 + 1;
        let last = self.last.load(Ordering::Relaxed);
        if (last == 0 || now >= last + self.period_ms)
            && self
                .last
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            return Some(self.suppressed.swap(0, Ordering::Relaxed));
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_event_per_period_and_the_rest_counted() {
        let throttle = Throttle::new(Duration::from_secs(3600));
        assert_eq!(throttle.allow(), Some(0));
        for _ in 0..999 {
            assert_eq!(throttle.allow(), None);
        }
        assert_eq!(throttle.suppressed.load(Ordering::Relaxed), 999);
    }

    #[test]
    fn the_next_period_reports_what_was_left_out() {
        let throttle = Throttle::new(Duration::from_millis(20));
        assert_eq!(throttle.allow(), Some(0));
        assert_eq!(throttle.allow(), None);
        assert_eq!(throttle.allow(), None);
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(throttle.allow(), Some(2));
    }
}
