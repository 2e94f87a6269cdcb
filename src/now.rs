//! One clock reading, shared by what runs next on the same thread: NGINX reads its clock once per
//! event-loop turn and every timer and log line of that turn uses it.
//!
//! A request needs the exact time only where a duration is measured: its own (the response
//! histogram) and its decision's (the decision histogram and the counters' clock). Everything
//! else wants "about now", seconds away from mattering: the upstream deadline, an idle
//! connection's age, the `Date` field and the start of a keep-alive wait. Those take
//! [`recent`], the last [`read`] on this thread. The runtime reads the clock each time its thread
//! wakes (`on_thread_unpark`, `main.rs`), so a reading is never older than the work done on this
//! thread since it last woke or last measured something: a request reads the clock four times
//! instead of ten (docs/benchmarks.md, issue 14's eleventh pass).

use std::cell::Cell;
use std::time::Instant;

thread_local! {
    static LAST: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// Reads the clock and keeps the reading for [`recent`].
pub fn read() -> Instant {
    let now = Instant::now();
    LAST.set(Some(now));
    now
}

/// The last [`read`] on this thread (a fresh one if there was none): never later than now, and
/// earlier only by the work this thread did since.
pub fn recent() -> Instant {
    LAST.get().unwrap_or_else(read)
}

/// [`recent`], as a timer deadline's base.
pub fn recent_tokio() -> tokio::time::Instant {
    tokio::time::Instant::from_std(recent())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recent_is_the_last_reading_and_never_ahead_of_the_clock() {
        let first = read();
        assert_eq!(recent(), first);
        std::thread::sleep(std::time::Duration::from_millis(2));
        // Not read since: still the old reading, behind the clock.
        assert_eq!(recent(), first);
        assert!(recent() < Instant::now());
        let second = read();
        assert!(second > first);
        assert_eq!(recent(), second);
    }

    #[test]
    fn each_thread_keeps_its_own_reading() {
        let here = read();
        let there = std::thread::spawn(|| {
            std::thread::sleep(std::time::Duration::from_millis(2));
            (recent(), read())
        })
        .join()
        .expect("thread");
        // The other thread had no reading of its own: `recent` read the clock there.
        assert!(there.0 > here);
        assert_eq!(recent(), here);
    }
}
