//! Decisions per second of the in-process store under a flood of distinct new keys, below
//! `max_keys` and at it (every counter in use, so each new key goes to the overflow sketch), from
//! `threads` threads. Bounded: `keys` decisions per phase, at most 60 s each. Prints one line per
//! phase and the memory held.
//!
//! cargo run --release --example memory_flood -- [MAX_KEYS] [THREADS] [KEYS_PER_PHASE]

use std::sync::Arc;
use std::time::{Duration, Instant};

use turnstile::limiter::{Check, MemoryStore, MonotonicClock, Rule, TokenBucket};

const RULE: Rule = Rule::TokenBucket(TokenBucket {
    rate: 1.0 / 3_600.0,
    burst: 5,
});

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let max_keys: usize = args.next().map_or(Ok(100_000), |a| a.parse())?;
    let threads: usize = args.next().map_or(Ok(2), |a| a.parse())?;
    let keys: usize = args.next().map_or(Ok(max_keys / 2), |a| a.parse())?;
    anyhow::ensure!(
        keys <= max_keys,
        "a phase below the cap must fit: KEYS <= MAX_KEYS"
    );

    let store = Arc::new(MemoryStore::new(Arc::new(MonotonicClock::new()), max_keys));
    let rss_start = rss_kib();
    // Below the cap: `keys` new keys into an empty store.
    let below = flood(&store, threads, keys, "below");
    // Fill the store with counters in use (each consumed once, refilling in an hour).
    let mut i = 0;
    while store.len() < max_keys && i < 4 * max_keys {
        store.check(&[check(&format!("fill-{i}"))]);
        i += 1;
    }
    let overflowed = store.overflowed();
    let at = flood(&store, threads, keys, "at");
    println!(
        "below_cap_decisions_per_second {:.0} at_cap_decisions_per_second {:.0} ratio {:.2}",
        below,
        at,
        at / below
    );
    println!(
        "counters {} max_keys {max_keys} overflow_decisions {} overflow_bytes {} rss_kib_start {} rss_kib_end {}",
        store.len(),
        store.overflowed() - overflowed,
        store.overflow_bytes(),
        rss_start,
        rss_kib()
    );
    Ok(())
}

fn check(key: &str) -> Check<'_> {
    Check {
        key,
        rule: &RULE,
        cost: 1,
        shadow: false,
        max_delay_us: None,
    }
}

/// `keys` decisions on distinct new keys (prefix `tag`) over `threads` threads: decisions/s.
fn flood(store: &Arc<MemoryStore>, threads: usize, keys: usize, tag: &str) -> f64 {
    let per_thread = keys / threads;
    let deadline = Instant::now() + Duration::from_secs(60);
    let started = Instant::now();
    let done: usize = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let store = store.clone();
                scope.spawn(move || {
                    let mut key = String::with_capacity(32);
                    let mut n = 0;
                    while n < per_thread && (n % 1024 != 0 || Instant::now() < deadline) {
                        key.clear();
                        use std::fmt::Write;
                        let _ = write!(key, "{tag}-{t}-{n}");
                        store.check(&[check(&key)]);
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or(0)).sum()
    });
    done as f64 / started.elapsed().as_secs_f64()
}

/// This process's resident memory, from /proc (0 where there is none).
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}
