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
        max_delay_us: None,
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
    assert!(
        store.overflowed() > 0,
        "the rest went to the overflow sketch"
    );
}

fn hourly(burst: u64) -> Rule {
    Rule::TokenBucket(TokenBucket {
        rate: 1.0 / 3_600.0,
        burst,
    })
}

fn admitted(store: &MemoryStore, key: &str, rule: &Rule, tries: usize) -> usize {
    (0..tries)
        .filter(|_| store.check(&[check(key, rule)]).allowed)
        .count()
}

/// Regression (issue 9, item 4): a flood of new keys made room by forgetting counters in use, so
/// an exhausted key was admitted again and idle exhausted keys were reset.
#[test]
fn a_flood_of_new_keys_never_resets_a_counter_in_use() {
    let (clock, store) = store(1_000);
    let rule = hourly(5);
    assert_eq!(admitted(&store, "victim", &rule, 10), 5);
    for i in 0..50 {
        assert_eq!(admitted(&store, &format!("idle-{i}"), &rule, 6), 5);
    }
    for i in 0..100_000 {
        store.check(&[check(&format!("flood-{i}"), &rule)]);
        if i % 10_000 == 0 {
            assert_eq!(
                admitted(&store, "victim", &rule, 3),
                0,
                "after {i} flood keys"
            );
        }
    }
    assert_eq!(admitted(&store, "victim", &rule, 20), 0);
    for i in 0..50 {
        assert_eq!(
            admitted(&store, &format!("idle-{i}"), &rule, 2),
            0,
            "idle-{i}"
        );
    }
    assert!(store.len() <= 1_000, "{} counters", store.len());
    assert!(store.overflowed() > 0);
    // Time still restores them, exactly: one token an hour.
    clock.advance_us(3_600 * S);
    assert_eq!(admitted(&store, "victim", &rule, 3), 1);
}

#[test]
fn idle_counters_make_room_before_the_overflow() {
    let (clock, store) = store(100);
    let fast = Rule::TokenBucket(TokenBucket {
        rate: 1.0,
        burst: 1,
    });
    for i in 0..100 {
        assert!(store.check(&[check(&format!("a-{i}"), &fast)]).allowed);
    }
    clock.advance_us(S);
    // Every bucket has refilled: each new key takes the place of an idle one.
    for i in 0..100 {
        assert!(store.check(&[check(&format!("b-{i}"), &fast)]).allowed);
    }
    assert_eq!(store.overflowed(), 0);
    assert_eq!(store.len(), 100);
}

/// A key the table has no room for is counted in the sketch, which may refuse early but never
/// admits more than the rule allows, for any rule.
#[test]
fn the_overflow_never_admits_more_than_the_rule() {
    let rules = [
        hourly(5),
        Rule::SlidingWindow(SlidingWindow {
            limit: 5,
            window_us: 3_600 * S,
            buckets: 0,
        }),
        Rule::SlidingWindow(SlidingWindow {
            limit: 5,
            window_us: 3_600 * S,
            buckets: 60,
        }),
    ];
    for rule in &rules {
        let (clock, store) = store(100);
        for i in 0..100 {
            store.check(&[check(&format!("full-{i}"), rule)]);
        }
        let before = store.overflowed();
        let mut total = 0;
        for i in 0..300 {
            let n = admitted(&store, &format!("new-{i}"), rule, 8);
            assert!(n <= 5, "{rule:?}: new-{i} admitted {n}");
            total += n;
        }
        assert!(
            store.overflowed() > before,
            "{rule:?}: decided by the overflow"
        );
        assert!(
            total > 0,
            "{rule:?}: the sketch is conservative, not closed"
        );
        // A window later every debt has drained: a new key gets its whole allowance again.
        clock.advance_us(6 * 3_600 * S);
        assert_eq!(admitted(&store, "later", rule, 8), 5, "{rule:?}");
    }
}

#[test]
fn a_key_moving_from_the_overflow_into_the_table_keeps_its_debt() {
    let (clock, store) = store(10);
    let fast = Rule::TokenBucket(TokenBucket {
        rate: 1.0,
        burst: 1,
    });
    let slow = hourly(5);
    for i in 0..10 {
        store.check(&[check(&format!("fast-{i}"), &fast)]);
    }
    // The table is full of counters in use: `k` is counted in the overflow, and exhausted.
    assert!(admitted(&store, "k", &slow, 10) <= 5);
    assert!(store.overflowed() > 0);
    assert_eq!(store.len(), 10);
    // The fast buckets refill and make room; `k` enters the table still owing its hours.
    clock.advance_us(2 * S);
    assert_eq!(admitted(&store, "k", &slow, 5), 0);
    assert!(store.len() <= 10);
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
        max_delay_us: None,
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

/// A calendar quota's counter holds information until its period ends, then the sweeper drops it;
/// an override (another limit, same period) keeps what was used.
#[test]
fn a_quota_counter_lives_until_its_period_ends() {
    use crate::limiter::calendar::Per;
    let (clock, store) = store(100);
    let day = 86_400 * S;
    clock.set(10 * day + 3_600 * S);
    let rule = Rule::Quota(crate::limiter::Quota {
        limit: 3,
        per: Per::Day,
        time_zone: chrono_tz::UTC,
    });
    assert!(store.check(&[check("q", &rule)]).allowed);
    assert!(store.check(&[check("q", &rule)]).allowed);
    let raised = Rule::Quota(crate::limiter::Quota {
        limit: 10,
        per: Per::Day,
        time_zone: chrono_tz::UTC,
    });
    assert_eq!(store.check(&[check("q", &raised)]).outcomes[0].remaining, 7);
    clock.set(11 * day - 1);
    assert_eq!(store.sweep(), 0, "still in its period");
    clock.set(11 * day);
    assert_eq!(store.sweep(), 1, "the day is over");
    assert_eq!(store.check(&[check("q", &rule)]).outcomes[0].remaining, 2);
}

/// A full store counts a new quota key in the overflow sketch, read as a window of the longest
/// period: it may refuse early, never admit past the limit.
#[test]
fn a_full_store_never_admits_a_quota_key_past_its_limit() {
    use crate::limiter::calendar::Per;
    let (clock, store) = store(1);
    clock.set(86_400 * S * 100);
    let rule = Rule::Quota(crate::limiter::Quota {
        limit: 2,
        per: Per::Month,
        time_zone: chrono_tz::UTC,
    });
    assert!(store.check(&[check("held", &rule)]).allowed);
    let admitted = (0..5)
        .filter(|_| store.check(&[check("overflowing", &rule)]).allowed)
        .count();
    assert_eq!(admitted, 2);
    assert!(store.overflowed() > 0);
}

/// Entries in the exact window log of counter `key`.
fn log_entries(store: &MemoryStore, key: &str) -> usize {
    let hash = store.hasher.hash_one(key);
    let shard = lock(&store.shards[store.shard_index(hash)]);
    match shard.table.find(hash, |e| *e.key == *key).map(|e| &e.state) {
        Some(State::Log(log)) => log.entries(),
        other => panic!("no window log for {key}: {other:?}"),
    }
}

/// Issue 33 item 2: a response reporting 2,000,000 units made the exact window hold one
/// timestamp per unit (16 MB for one key, outside what `max_keys` bounds).
#[test]
fn a_charge_of_two_million_units_is_one_window_entry() {
    let (clock, store) = store(100);
    clock.set(1_000 * S);
    let rule = Rule::SlidingWindow(SlidingWindow {
        limit: 10,
        window_us: 60 * S,
        buckets: 0,
    });
    let charge = |cost| {
        store.charge(&[Check {
            cost,
            ..check("k", &rule)
        }])
    };
    charge(2_000_000);
    charge(2_000_000);
    assert_eq!(log_entries(&store, "k"), 1);
    clock.set(1_001 * S);
    charge(2_000_000);
    assert_eq!(log_entries(&store, "k"), 2);
    let d = store.check(&[check("k", &rule)]);
    assert!(!d.allowed);
    // The first entry's 4,000,000 units are not enough: the second's leave at 1,061 s.
    assert_eq!(d.outcomes[0].retry_after_us, 60 * S);
    clock.set(1_061 * S);
    assert!(store.check(&[check("k", &rule)]).allowed);
    assert_eq!(log_entries(&store, "k"), 1);
}

/// The key gauge moves when a counter is created or dropped: not when a full store drops an idle
/// counter for a new one, nor for a key the overflow sketch decides.
#[test]
fn the_key_gauge_follows_creations_and_drops() {
    let (clock, store) = store(2);
    let rule = Rule::SlidingWindow(SlidingWindow {
        limit: 5,
        window_us: S,
        buckets: 0,
    });
    assert!(store.check(&[check("a", &rule)]).allowed);
    assert!(store.check(&[check("b", &rule)]).allowed);
    assert!(store.check(&[check("a", &rule)]).allowed);
    assert_eq!((store.keys(), store.len()), (2, 2));
    store.check(&[check("c", &rule)]);
    assert_eq!((store.keys(), store.overflowed()), (2, 1));
    clock.advance_us(2 * S);
    // Both idle: `d` takes the place of one of them.
    assert!(store.check(&[check("d", &rule)]).allowed);
    assert_eq!((store.keys(), store.len()), (2, 2));
    clock.advance_us(2 * S);
    assert_eq!(store.sweep(), 2);
    assert_eq!((store.keys(), store.len()), (0, 0));
}
