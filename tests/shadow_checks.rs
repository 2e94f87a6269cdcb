//! A shadow check (Envoy's `shadow_mode`) is evaluated and counted, but its refusal never rejects
//! the request, and a request it would have refused consumes nothing from it.

use std::sync::Arc;

use turnstile::limiter::{Check, ManualClock, MemoryStore, Rule, SlidingWindow};

fn window(limit: u64) -> Rule {
    Rule::SlidingWindow(SlidingWindow {
        limit,
        window_us: 60_000_000,
        buckets: 0,
    })
}

#[test]
fn a_shadow_check_over_its_limit_neither_rejects_nor_blocks_the_others() {
    let store = MemoryStore::new(Arc::new(ManualClock::new(1_000_000)), 1000);
    let (strict, loose) = (window(1), window(3));
    let checks = |shadow| {
        [
            Check {
                key: "shadow",
                rule: &strict,
                cost: 1,
                shadow,
                max_delay_us: None,
            },
            Check {
                key: "enforced",
                rule: &loose,
                cost: 1,
                shadow: false,
                max_delay_us: None,
            },
        ]
    };
    let mut admitted = 0;
    for i in 0..5 {
        let d = store.check(&checks(true));
        assert_eq!(d.outcomes[0].allowed, i == 0, "request {i}: shadow check");
        if d.allowed {
            admitted += 1;
        }
    }
    // The enforced window (3) decides alone; the shadow one saw its single unit only.
    assert_eq!(admitted, 3);
    let d = store.check(&checks(false));
    assert!(!d.allowed, "enforced again: both are full");
    assert_eq!((d.outcomes[0].remaining, d.outcomes[1].remaining), (0, 0));
}

#[test]
fn a_rejected_request_consumes_from_no_shadow_check() {
    let store = MemoryStore::new(Arc::new(ManualClock::new(1_000_000)), 1000);
    let (zero, loose) = (window(0), window(5));
    let checks = [
        Check {
            key: "enforced-zero",
            rule: &zero,
            cost: 1,
            shadow: false,
            max_delay_us: None,
        },
        Check {
            key: "shadow-loose",
            rule: &loose,
            cost: 1,
            shadow: true,
            max_delay_us: None,
        },
    ];
    for _ in 0..3 {
        assert!(!store.check(&checks).allowed);
    }
    let peek = [Check {
        cost: 0,
        ..checks[1]
    }];
    assert_eq!(
        store.check(&peek).outcomes[0].remaining,
        5,
        "nothing consumed"
    );
}
