//! The deny cache never admits more than the store (`docs/algorithms.md`, "The deny cache"): random
//! traffic goes through an engine with the cache and, step for step, through a store of the same
//! kind without it, on one manual clock. Every decision and every check's `allowed` must agree,
//! on the in-process store and on a real Redis, and the cache must have answered a good share.

mod support;

use std::sync::Arc;
use std::time::Duration;

use turnstile::limiter::{
    Check, Checks, Engine, ManualClock, MemoryStore, RedisStore, Rule, SlidingWindow, Store, Tally,
    TokenBucket,
};
use turnstile::metrics::Metrics;

const T: u64 = 1_000_000_000;

/// A small deterministic generator (xorshift64*), so a failure replays.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn rules() -> Vec<Rule> {
    vec![
        Rule::TokenBucket(TokenBucket {
            rate: 20.0,
            burst: 5,
        }),
        Rule::SlidingWindow(SlidingWindow {
            limit: 6,
            window_us: 400_000,
            buckets: 0,
        }),
        Rule::SlidingWindow(SlidingWindow {
            limit: 8,
            window_us: 600_000,
            buckets: 4,
        }),
    ]
}

/// Replays `steps` random requests through `engine` (with the cache) and `reference` (the same
/// kind of store, without one) and asserts they agree; returns the cache hits.
async fn replay(
    engine: &Engine,
    reference: &Store,
    clock: &ManualClock,
    metrics: &Metrics,
    steps: usize,
) -> u64 {
    let rules = rules();
    let keys: Vec<String> = (0..rules.len()).map(|i| format!("counter:{i}")).collect();
    let policy = metrics.policy("r", "p");
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut admitted = 0;
    for step in 0..steps {
        // Mostly short steps, so refusals repeat within their retry_after.
        clock.advance_us(match rng.below(10) {
            0 => rng.below(300_000),
            _ => rng.below(8_000),
        });
        let picks: Vec<(usize, u64, bool)> = (0..1 + rng.below(2))
            .map(|_| {
                let counter = rng.below(rules.len() as u64) as usize;
                (counter, rng.below(4), rng.below(6) == 0)
            })
            .collect();
        let mut checks = Checks::with_capacity(picks.len());
        for &(counter, cost, shadow) in &picks {
            let tally = Tally::Policy {
                metrics: &policy,
                route: "r",
                policy: "p",
                prefix: "",
            };
            checks.push(keys[counter].as_str(), &rules[counter], cost, shadow, tally);
        }
        // The store's view of the same request: repeated keys merged, costs summed, shadow only
        // if every mention is.
        let mut merged: Vec<(usize, u64, bool)> = Vec::new();
        for &(counter, cost, shadow) in &picks {
            match merged.iter_mut().find(|m| m.0 == counter) {
                Some(m) => {
                    m.1 += cost;
                    m.2 &= shadow;
                }
                None => merged.push((counter, cost, shadow)),
            }
        }
        let store_checks: Vec<Check<'_>> = merged
            .iter()
            .map(|&(counter, cost, shadow)| Check {
                key: &keys[counter],
                rule: &rules[counter],
                cost,
                shadow,
                max_delay_us: None,
            })
            .collect();
        let verdict = engine
            .decide(checks, turnstile::limiter::FailureMode::Closed)
            .await;
        let want = reference.check(&store_checks).await.expect("reference");
        assert_eq!(
            verdict.admits(),
            want.allowed,
            "step {step}: the engine and the store disagree on {picks:?}"
        );
        for (i, &(counter, _, _)) in picks.iter().enumerate() {
            let j = merged.iter().position(|m| m.0 == counter).expect("merged");
            let got = verdict.outcome(i).expect("an outcome");
            assert_eq!(
                got.allowed, want.outcomes[j].allowed,
                "step {step}: check {i} of {picks:?}"
            );
            if !got.allowed {
                // A cached refusal's wait is the store's for the smallest cost refused: never
                // longer than the store's own answer (a client told to retry then is not misled
                // into waiting longer than it must), up to the microsecond both round up.
                assert!(
                    got.retry_after_us <= want.outcomes[j].retry_after_us + 1,
                    "step {step}: retry_after {} against the store's {}",
                    got.retry_after_us,
                    want.outcomes[j].retry_after_us
                );
            }
        }
        admitted += u64::from(want.allowed);
    }
    assert!(
        admitted > steps as u64 / 10,
        "the traffic must be admitted at times too: {admitted} of {steps}"
    );
    hits(metrics, engine.store().name())
}

fn hits(metrics: &Metrics, store: &str) -> u64 {
    let series = format!("turnstile_deny_cache_hits_total{{store=\"{store}\"}} ");
    metrics
        .render()
        .lines()
        .find_map(|l| l.strip_prefix(&series))
        .map_or(0, |v| v.trim().parse().expect("a count"))
}

#[tokio::test]
async fn a_cached_refusal_never_admits_more_than_the_memory_store() {
    let clock = Arc::new(ManualClock::new(T));
    let metrics = Metrics::new();
    let engine = Engine::new(
        Store::Memory(MemoryStore::new(clock.clone(), 1_000)),
        clock.clone(),
        &metrics,
    );
    let reference = Store::Memory(MemoryStore::new(clock.clone(), 1_000));
    let steps = 20_000;
    let hits = replay(&engine, &reference, &clock, &metrics, steps).await;
    assert!(
        hits > steps as u64 / 10,
        "the cache answered only {hits} of {steps}"
    );
}

#[tokio::test]
async fn a_cached_refusal_never_admits_more_than_redis() {
    let redis = support::redis::RedisServer::start();
    let clock = Arc::new(ManualClock::new(T));
    let metrics = Metrics::new();
    let connect = |prefix: &str| {
        RedisStore::connect_with_test_clock(
            &redis.url(),
            Duration::from_secs(5),
            prefix,
            clock.clone(),
        )
        .expect("redis store")
    };
    let (cached, plain) = (connect("cached:"), connect("plain:"));
    for store in [&cached, &plain] {
        assert!(store.wait_ready(Duration::from_secs(10)).await);
    }
    let engine = Engine::new(Store::Redis(cached), clock.clone(), &metrics);
    let reference = Store::Redis(plain);
    let steps = 3_000;
    let hits = replay(&engine, &reference, &clock, &metrics, steps).await;
    assert!(
        hits > steps as u64 / 10,
        "the cache answered only {hits} of {steps}"
    );
}

/// A store with no cache answers every request itself: the cache is what made the hits.
#[tokio::test]
async fn without_the_cache_every_decision_asks_the_store() {
    let clock = Arc::new(ManualClock::new(T));
    let metrics = Metrics::new();
    let engine = Engine::with_deny_cache(
        Store::Memory(MemoryStore::new(clock.clone(), 1_000)),
        clock.clone(),
        &metrics,
        0,
    );
    let reference = Store::Memory(MemoryStore::new(clock.clone(), 1_000));
    assert_eq!(
        replay(&engine, &reference, &clock, &metrics, 2_000).await,
        0
    );
}
