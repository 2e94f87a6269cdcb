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

#[test]
fn one_check_decides_as_it_would_among_several() {
    // `check` takes a shortcut for a single check; it must agree with the general path, here
    // the same key checked beside a counter that always allows.
    let (clock_one, one) = store(100);
    let (clock_many, many) = store(100);
    let rules = [
        Rule::TokenBucket(TokenBucket {
            rate: 2.0,
            burst: 3,
        }),
        Rule::SlidingWindow(SlidingWindow {
            limit: 3,
            window_us: S,
            buckets: 0,
        }),
        Rule::SlidingWindow(SlidingWindow {
            limit: 3,
            window_us: S,
            buckets: 4,
        }),
    ];
    let roomy = Rule::TokenBucket(TokenBucket {
        rate: 1e9,
        burst: 1_000_000_000,
    });
    for rule in &rules {
        for step in 0..40u64 {
            let key = format!("k-{}", rule.kind());
            let alone = one.check(&[check(&key, rule)]);
            let beside = many.check(&[check(&key, rule), check("roomy", &roomy)]);
            assert_eq!(alone.allowed, beside.allowed, "{rule:?} step {step}");
            assert_eq!(
                alone.outcomes[0], beside.outcomes[0],
                "{rule:?} step {step}"
            );
            clock_one.advance_us(S / 7);
            clock_many.advance_us(S / 7);
        }
    }
}

#[test]
fn one_shadow_check_over_its_limit_admits_and_consumes_nothing() {
    let (clock, store) = store(100);
    let rule = Rule::SlidingWindow(SlidingWindow {
        limit: 2,
        window_us: S,
        buckets: 0,
    });
    let shadow = Check {
        shadow: true,
        ..check("s", &rule)
    };
    for _ in 0..2 {
        assert!(store.check(&[shadow]).outcomes[0].allowed);
    }
    clock.advance_us(S / 2);
    for _ in 0..3 {
        let d = store.check(&[shadow]);
        assert!(d.allowed, "a shadow check never rejects");
        assert!(!d.outcomes[0].allowed);
    }
    // The two admitted units expire; the three refused ones were never logged.
    clock.advance_us(S / 2 + 1);
    let peek = Check { cost: 0, ..shadow };
    assert_eq!(store.check(&[peek]).outcomes[0].remaining, 2);
}
