use super::*;
use crate::limiter::{ManualClock, SlidingWindow, TokenBucket};

const S: u64 = 1_000_000;

fn store(max_keys: usize) -> (Arc<ManualClock>, MemoryStore) {
    let clock = Arc::new(ManualClock::new(0));
    (clock.clone(), MemoryStore::new(clock, max_keys))
}

fn check<'a>(key: &'a str, rule: &'a Rule) -> Check<'a> {
    Check {
        key,
        rule,
        cost: 1,
        shadow: false,
    }
}

#[test]
fn all_or_nothing_a_rejected_request_consumes_nothing() {
    let (_, store) = store(100);
    let roomy = Rule::TokenBucket(TokenBucket {
        rate: 0.001,
        burst: 10,
    });
    let tight = Rule::TokenBucket(TokenBucket {
        rate: 0.001,
        burst: 1,
    });
    assert!(
        store
            .check(&[check("a", &roomy), check("b", &tight)])
            .allowed
    );
    for _ in 0..5 {
        let d = store.check(&[check("a", &roomy), check("b", &tight)]);
        assert!(!d.allowed);
        assert_eq!(
            d.outcomes[0].remaining, 9,
            "the roomy bucket reports its state without the request"
        );
    }
    // Only the first request consumed from `a`.
    assert_eq!(store.check(&[check("a", &roomy)]).outcomes[0].remaining, 8);
}

#[test]
fn keys_are_independent() {
    let (_, store) = store(100);
    let rule = Rule::SlidingWindow(SlidingWindow {
        limit: 1,
        window_us: S,
        buckets: 0,
    });
    assert!(store.check(&[check("x", &rule)]).allowed);
    assert!(store.check(&[check("y", &rule)]).allowed);
    assert!(!store.check(&[check("x", &rule)]).allowed);
}

#[test]
fn concurrent_decisions_admit_exactly_the_burst() {
    let (_, store) = store(100);
    let store = Arc::new(store);
    let rule = Rule::TokenBucket(TokenBucket {
        rate: 0.000_001,
        burst: 50,
    });
    let other = Rule::SlidingWindow(SlidingWindow {
        limit: 1_000,
        window_us: S,
        buckets: 0,
    });
    let admitted: u64 = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..8)
            .map(|_| {
                let store = store.clone();
                scope.spawn(move || {
                    (0..100)
                        .filter(|i| {
                            // Alternate key order so shard locks are taken in both orders.
                            let (a, b) = (check("hot", &rule), check("side", &other));
                            let checks = if i % 2 == 0 { [a, b] } else { [b, a] };
                            store.check(&checks).allowed
                        })
                        .count() as u64
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    });
    assert_eq!(admitted, 50);
}

#[test]
fn sweep_forgets_idle_counters_only() {
    let (clock, store) = store(100);
    let rule = Rule::TokenBucket(TokenBucket {
        rate: 1.0,
        burst: 2,
    });
    store.check(&[check("busy", &rule)]);
    store.check(&[check("idle", &rule)]);
    clock.advance_us(S / 2);
    store.check(&[check("busy", &rule)]);
    clock.advance_us(S / 2);
    // `idle` has refilled (1 s at 1/s), `busy` still lacks half a token.
    assert_eq!(store.sweep(), 1);
    assert_eq!(store.len(), 1);
    assert_eq!(
        store.check(&[check("busy", &rule)]).outcomes[0].remaining,
        0
    );
}

#[test]
fn max_keys_bounds_memory_whatever_the_traffic() {
    let (_, store) = store(100);
    let rule = Rule::SlidingWindow(SlidingWindow {
        limit: 5,
        window_us: 3_600 * S,
        buckets: 0,
    });
    for i in 0..10_000 {
        store.check(&[check(&format!("client-{i}"), &rule)]);
    }
    assert_eq!(store.len(), 100, "exactly max_keys counters kept");
    assert!(store.evictions() > 0);
}

#[test]
fn max_keys_is_exact_for_large_stores_too() {
    let (_, store) = store(MAX_SHARDS * MIN_KEYS_PER_SHARD + 7);
    let rule = Rule::SlidingWindow(SlidingWindow {
        limit: 5,
        window_us: 3_600 * S,
        buckets: 0,
    });
    for i in 0..40_000 {
        store.check(&[check(&format!("client-{i}"), &rule)]);
    }
    assert!(store.len() <= MAX_SHARDS * MIN_KEYS_PER_SHARD + 7);
}

#[test]
fn a_changed_rule_keeps_compatible_state() {
    let (_, store) = store(100);
    let small = Rule::TokenBucket(TokenBucket {
        rate: 0.001,
        burst: 2,
    });
    let large = Rule::TokenBucket(TokenBucket {
        rate: 0.001,
        burst: 10,
    });
    store.check(&[check("k", &small)]);
    store.check(&[check("k", &small)]);
    // A reload raised the burst: the spent tokens stay spent.
    let o = store.check(&[check("k", &large)]).outcomes[0];
    assert!(!o.allowed);
    // A different algorithm under the same key starts afresh rather than misreading state.
    let window = Rule::SlidingWindow(SlidingWindow {
        limit: 1,
        window_us: S,
        buckets: 0,
    });
    assert!(store.check(&[check("k", &window)]).allowed);
}
