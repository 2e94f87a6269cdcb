//! The engine on an injected clock, over the in-process store behind a switch that makes it fail
//! on demand: failure modes, key merging, the governing outcome, what is counted and logged.

use std::sync::atomic::AtomicBool;

use super::*;
use crate::limiter::{ManualClock, MemoryStore, SlidingWindow, TokenBucket};

const T: u64 = 1_000_000_000;
const S: u64 = 1_000_000;

/// The in-process store, or a store that answers `Connection` errors while `failing` is set.
#[derive(Debug)]
pub struct FaultyStore {
    inner: MemoryStore,
    failing: AtomicBool,
}

impl FaultyStore {
    pub fn check(&self, checks: &[Check<'_>]) -> Result<Decision, StoreError> {
        if self.failing.load(Ordering::Relaxed) {
            return Err(StoreError::Connection("failing on demand".into()));
        }
        Ok(self.inner.check(checks))
    }

    pub fn peek(&self, checks: &[Check<'_>]) -> Result<Decision, StoreError> {
        if self.failing.load(Ordering::Relaxed) {
            return Err(StoreError::Connection("failing on demand".into()));
        }
        Ok(self.inner.peek(checks))
    }
}

struct Fixture {
    clock: Arc<ManualClock>,
    metrics: Metrics,
    engine: Engine,
}

impl Fixture {
    fn new() -> Fixture {
        let clock = Arc::new(ManualClock::new(T));
        let metrics = Metrics::new();
        let store = Store::Faulty(FaultyStore {
            inner: MemoryStore::new(clock.clone(), 1_000),
            failing: AtomicBool::new(false),
        });
        let engine = Engine::new(store, clock.clone(), &metrics);
        Fixture {
            clock,
            metrics,
            engine,
        }
    }

    fn fail(&self, failing: bool) {
        let Store::Faulty(store) = self.engine.store() else {
            unreachable!("the fixture's store is the faulty one")
        };
        store.failing.store(failing, Ordering::Relaxed);
    }

    /// `turnstile_decisions_total{route="r", policy, decision}`.
    fn decisions(&self, policy: &str, decision: &str) -> f64 {
        let series = format!(
            "turnstile_decisions_total{{decision=\"{decision}\",policy=\"{policy}\",route=\"r\"}} "
        );
        let text = self.metrics.render();
        text.lines()
            .find_map(|l| l.strip_prefix(&series))
            .map_or(0.0, |v| v.parse().unwrap_or(f64::NAN))
    }

    fn store_errors(&self) -> f64 {
        let series = "turnstile_store_errors_total{kind=\"connection\",store=\"faulty\"} ";
        let text = self.metrics.render();
        text.lines()
            .find_map(|l| l.strip_prefix(series))
            .map_or(0.0, |v| v.parse().unwrap_or(f64::NAN))
    }
}

fn tb(rate: f64, burst: u64) -> Rule {
    Rule::TokenBucket(TokenBucket { rate, burst })
}

fn sw(limit: u64, window_us: u64) -> Rule {
    Rule::SlidingWindow(SlidingWindow {
        limit,
        window_us,
        buckets: 0,
    })
}

fn policy<'a>(metrics: &'a PolicyMetrics, name: &'a str) -> Tally<'a> {
    Tally::Policy {
        metrics,
        route: "r",
        policy: name,
        prefix: "r:",
    }
}

#[tokio::test]
async fn failure_mode_open_admits_without_outcomes_and_counts_failed_open() {
    let f = Fixture::new();
    let m = f.metrics.policy("r", "p");
    let rule = tb(1.0, 5);
    f.fail(true);
    let mut checks = Checks::with_capacity(1);
    checks.push("r:a", &rule, 1, false, policy(&m, "p"));
    let verdict = f.engine.decide(checks, FailureMode::Open).await;
    assert_eq!(verdict.kind, Kind::FailedOpen);
    assert!(verdict.admits());
    assert!(verdict.outcome(0).is_none());
    assert!(verdict.governing().is_none());
    assert!(verdict.error().is_some());
    assert_eq!(f.decisions("p", "failed_open"), 1.0);
    assert_eq!(f.decisions("p", "failed_closed"), 0.0);
    assert_eq!(f.store_errors(), 1.0);
}

#[tokio::test]
async fn failure_mode_closed_refuses_and_counts_failed_closed() {
    let f = Fixture::new();
    let m = f.metrics.policy("r", "p");
    let rule = tb(1.0, 5);
    f.fail(true);
    let mut checks = Checks::with_capacity(1);
    checks.push("r:a", &rule, 1, false, policy(&m, "p"));
    let verdict = f.engine.decide(checks, FailureMode::Closed).await;
    assert_eq!(verdict.kind, Kind::FailedClosed);
    assert!(!verdict.admits());
    assert_eq!(f.decisions("p", "failed_closed"), 1.0);
    assert_eq!(f.decisions("p", "failed_open"), 0.0);
}

#[tokio::test]
async fn failure_mode_error_hands_the_store_error_back_uncounted_as_a_decision() {
    let f = Fixture::new();
    let m = f.metrics.policy("r", "p");
    let rule = tb(1.0, 5);
    f.fail(true);
    let mut checks = Checks::with_capacity(1);
    checks.push("r:a", &rule, 1, false, policy(&m, "p"));
    let verdict = f.engine.decide(checks, FailureMode::Error).await;
    assert_eq!(verdict.kind, Kind::Failed);
    assert!(!verdict.admits());
    assert!(matches!(
        verdict.into_error(),
        Some(StoreError::Connection(_))
    ));
    for label in ["allowed", "limited", "failed_open", "failed_closed"] {
        assert_eq!(f.decisions("p", label), 0.0, "{label}");
    }
    assert_eq!(f.store_errors(), 1.0, "the store error itself is counted");
}

#[tokio::test]
async fn the_store_recovering_ends_the_failure_mode() {
    let f = Fixture::new();
    let m = f.metrics.policy("r", "p");
    let rule = tb(1.0, 5);
    for failing in [true, false] {
        f.fail(failing);
        let mut checks = Checks::with_capacity(1);
        checks.push("r:a", &rule, 1, false, policy(&m, "p"));
        let verdict = f.engine.decide(checks, FailureMode::Closed).await;
        let want = if failing {
            Kind::FailedClosed
        } else {
            Kind::Allowed
        };
        assert_eq!(verdict.kind, want);
    }
    assert_eq!(f.decisions("p", "allowed"), 1.0);
}

#[tokio::test]
async fn store_failures_are_logged_at_most_once_a_second_on_the_engine_clock() {
    let f = Fixture::new();
    let rule = tb(1.0, 5);
    let m = f.metrics.policy("r", "p");
    f.fail(true);
    let decide = || async {
        let mut checks = Checks::with_capacity(1);
        checks.push("r:a", &rule, 1, false, policy(&m, "p"));
        f.engine.decide(checks, FailureMode::Open).await;
    };
    for _ in 0..5 {
        decide().await;
    }
    assert_eq!(f.engine.failures_logged(), 1);
    f.clock.advance_us(S - 1);
    decide().await;
    assert_eq!(f.engine.failures_logged(), 1, "not yet a second later");
    f.clock.advance_us(1);
    decide().await;
    decide().await;
    assert_eq!(f.engine.failures_logged(), 2);
    assert_eq!(f.store_errors(), 8.0, "every failure is counted");
}

#[tokio::test]
async fn duplicate_keys_merge_into_one_check_with_costs_summed() {
    let f = Fixture::new();
    let m = f.metrics.policy("r", "p");
    let rule = sw(5, 60 * S);
    let mut checks = Checks::with_capacity(3);
    let a = checks.push("r:k", &rule, 2, false, policy(&m, "p"));
    let b = checks.push("r:other", &rule, 1, false, policy(&m, "p"));
    let c = checks.push(String::from("r:k"), &rule, 2, false, policy(&m, "p"));
    let verdict = f.engine.decide(checks, FailureMode::Open).await;
    assert_eq!(verdict.kind, Kind::Allowed);
    // One counter took both costs: 5 - 4.
    assert_eq!(verdict.outcome(a).map(|o| o.remaining), Some(1));
    assert_eq!(verdict.outcome(c), verdict.outcome(a));
    assert_eq!(verdict.outcome(b).map(|o| o.remaining), Some(4));

    // Together they ask for 4 more of the 1 left: refused, and nothing consumed.
    let mut checks = Checks::with_capacity(2);
    checks.push("r:k", &rule, 2, false, policy(&m, "p"));
    checks.push("r:k", &rule, 2, false, policy(&m, "p"));
    let verdict = f.engine.decide(checks, FailureMode::Open).await;
    assert_eq!(verdict.kind, Kind::Limited);
    let mut checks = Checks::with_capacity(1);
    checks.push("r:k", &rule, 1, false, policy(&m, "p"));
    let verdict = f.engine.decide(checks, FailureMode::Open).await;
    assert_eq!(verdict.outcome(0).map(|o| o.remaining), Some(0));
}

#[tokio::test]
async fn a_merged_check_is_shadow_only_when_every_part_is() {
    let f = Fixture::new();
    let m = f.metrics.policy("r", "p");
    let rule = sw(1, 60 * S);
    let mut checks = Checks::with_capacity(2);
    checks.push("r:k", &rule, 1, true, policy(&m, "p"));
    checks.push("r:k", &rule, 1, false, policy(&m, "p"));
    let verdict = f.engine.decide(checks, FailureMode::Open).await;
    assert_eq!(verdict.kind, Kind::Limited, "2 units of a limit of 1");
    let mut checks = Checks::with_capacity(2);
    checks.push("r:k", &rule, 1, true, policy(&m, "p"));
    checks.push("r:k", &rule, 1, true, policy(&m, "p"));
    let verdict = f.engine.decide(checks, FailureMode::Open).await;
    assert_eq!(verdict.kind, Kind::Allowed, "all shadow: never rejects");
}

#[tokio::test]
async fn admitted_the_least_remaining_governs_and_ties_go_to_the_first() {
    let f = Fixture::new();
    let m = f.metrics.policy("r", "p");
    let roomy = tb(1.0, 10);
    let tight = tb(1.0, 3);
    let mut checks = Checks::with_capacity(4);
    checks.push("r:a", &roomy, 1, false, policy(&m, "p"));
    checks.push("r:b", &tight, 1, false, policy(&m, "p"));
    checks.push("r:c", &tight, 1, false, policy(&m, "p"));
    checks.push("r:d", &roomy, 1, false, policy(&m, "p"));
    let verdict = f.engine.decide(checks, FailureMode::Open).await;
    assert_eq!(verdict.kind, Kind::Allowed);
    let (i, o) = verdict.governing().expect("a governing outcome");
    assert_eq!((i, o.remaining, o.limit), (1, 2, 3));
    assert_eq!(verdict.key(i), "r:b");
}

#[tokio::test]
async fn rejected_the_longest_wait_among_enforced_refusals_governs() {
    let f = Fixture::new();
    let m = f.metrics.policy("r", "p");
    let short = sw(1, 10 * S);
    let long = sw(1, 60 * S);
    let longest = sw(1, 600 * S);
    // Fill all four counters at T.
    for key in ["r:s", "r:l", "r:l2", "r:shadow"] {
        let rule = if key == "r:s" {
            &short
        } else if key == "r:shadow" {
            &longest
        } else {
            &long
        };
        let mut checks = Checks::with_capacity(1);
        checks.push(key, rule, 1, false, policy(&m, "p"));
        assert_eq!(
            f.engine.decide(checks, FailureMode::Open).await.kind,
            Kind::Allowed
        );
    }
    f.clock.advance_us(S);
    let mut checks = Checks::with_capacity(4);
    checks.push("r:s", &short, 1, false, policy(&m, "p"));
    // A shadow refusal waits longest but never speaks for a rejection.
    checks.push("r:shadow", &longest, 1, true, policy(&m, "p"));
    checks.push("r:l", &long, 1, false, policy(&m, "p"));
    checks.push("r:l2", &long, 1, false, policy(&m, "p"));
    let verdict = f.engine.decide(checks, FailureMode::Open).await;
    assert_eq!(verdict.kind, Kind::Limited);
    let (i, o) = verdict.governing().expect("a governing outcome");
    assert_eq!(i, 2, "the first of the two longest enforced waits");
    assert_eq!(o.retry_after_us, 59 * S);
}

#[tokio::test]
async fn limited_policies_are_counted_and_reach_the_top_limited_sketch() {
    let f = Fixture::new();
    let roomy_m = f.metrics.policy("r", "roomy");
    let tight_m = f.metrics.policy("r", "tight");
    let roomy = tb(0.001, 10);
    let tight = tb(0.001, 1);
    for _ in 0..3 {
        let mut checks = Checks::with_capacity(2);
        checks.push("r:roomy:u1", &roomy, 1, false, policy(&roomy_m, "roomy"));
        checks.push("r:tight:u1", &tight, 1, false, policy(&tight_m, "tight"));
        f.engine.decide(checks, FailureMode::Open).await;
    }
    assert_eq!(f.decisions("roomy", "allowed"), 3.0);
    assert_eq!(f.decisions("tight", "allowed"), 1.0);
    assert_eq!(f.decisions("tight", "limited"), 2.0);
    let report = serde_json::to_value(f.engine.top_limited().report(10)).expect("json");
    let text = report.to_string();
    assert!(text.contains("\"tight:u1\""), "{text}");
    assert!(!text.contains("roomy:u1"), "{text}");
}

#[tokio::test]
async fn nothing_to_check_is_allowed_without_asking_the_store() {
    let f = Fixture::new();
    f.fail(true);
    let verdict = f
        .engine
        .decide(Checks::default(), FailureMode::Closed)
        .await;
    assert_eq!(verdict.kind, Kind::Allowed);
    assert!(verdict.governing().is_none());
    assert_eq!(f.store_errors(), 0.0);
}

/// `turnstile_deny_cache_hits_total{store="faulty"}`.
fn deny_hits(f: &Fixture) -> f64 {
    let series = "turnstile_deny_cache_hits_total{store=\"faulty\"} ";
    f.metrics
        .render()
        .lines()
        .find_map(|l| l.strip_prefix(series))
        .map_or(0.0, |v| v.parse().unwrap_or(f64::NAN))
}

async fn decide_one(f: &Fixture, m: &PolicyMetrics, rule: &Rule, cost: u64, shadow: bool) -> Kind {
    let mut checks = Checks::with_capacity(1);
    checks.push("r:a", rule, cost, shadow, policy(m, "p"));
    f.engine.decide(checks, FailureMode::Open).await.kind
}

#[tokio::test]
async fn a_cached_refusal_is_answered_without_the_store_and_counted() {
    let f = Fixture::new();
    let m = f.metrics.policy("r", "p");
    let rule = tb(1.0, 1);
    assert_eq!(decide_one(&f, &m, &rule, 1, false).await, Kind::Allowed);
    assert_eq!(decide_one(&f, &m, &rule, 1, false).await, Kind::Limited);
    // The store is down now: only the cache can answer, and it answers what the store did.
    f.fail(true);
    let mut checks = Checks::with_capacity(1);
    checks.push("r:a", &rule, 1, false, policy(&m, "p"));
    let verdict = f.engine.decide(checks, FailureMode::Open).await;
    assert_eq!(verdict.kind, Kind::Limited);
    let (_, outcome) = verdict.governing().expect("a governing refusal");
    assert_eq!(
        (outcome.allowed, outcome.limit, outcome.remaining),
        (false, 1, 0)
    );
    assert_eq!(outcome.retry_after_us, S);
    assert_eq!(deny_hits(&f), 1.0);
    assert_eq!(f.decisions("p", "limited"), 2.0);
    assert_eq!(f.store_errors(), 0.0);
    // Until the margin before the refusal ends (1 s / 128 = 7812 µs), then the store again.
    f.clock.advance_us(S - 7_813);
    assert_eq!(decide_one(&f, &m, &rule, 1, false).await, Kind::Limited);
    assert_eq!(deny_hits(&f), 2.0);
    f.clock.advance_us(1);
    assert_eq!(decide_one(&f, &m, &rule, 1, false).await, Kind::FailedOpen);
    f.fail(false);
    f.clock.advance_us(7_812);
    assert_eq!(decide_one(&f, &m, &rule, 1, false).await, Kind::Allowed);
}

#[tokio::test]
async fn a_refusal_at_a_cost_never_refuses_a_lower_cost_from_the_cache() {
    let f = Fixture::new();
    let m = f.metrics.policy("r", "p");
    let rule = tb(1.0, 5);
    assert_eq!(decide_one(&f, &m, &rule, 4, false).await, Kind::Allowed);
    assert_eq!(decide_one(&f, &m, &rule, 3, false).await, Kind::Limited);
    // Cost 1 fits in the token left: the store is asked, and admits.
    assert_eq!(decide_one(&f, &m, &rule, 1, false).await, Kind::Allowed);
    assert_eq!(deny_hits(&f), 0.0);
    f.fail(true);
    // Cost 3 and more are certain refusals; cost 2 is not (the store, down, fails open).
    assert_eq!(decide_one(&f, &m, &rule, 3, false).await, Kind::Limited);
    assert_eq!(decide_one(&f, &m, &rule, 9, false).await, Kind::Limited);
    assert_eq!(decide_one(&f, &m, &rule, 2, false).await, Kind::FailedOpen);
    assert_eq!(deny_hits(&f), 2.0);
}

#[tokio::test]
async fn a_changed_rule_misses_the_cache() {
    let f = Fixture::new();
    let m = f.metrics.policy("r", "p");
    let (small, large) = (sw(1, 60 * S), sw(3, 60 * S));
    assert_eq!(decide_one(&f, &m, &small, 1, false).await, Kind::Allowed);
    assert_eq!(decide_one(&f, &m, &small, 1, false).await, Kind::Limited);
    // A reload raised the limit: the refusal under the old rule says nothing.
    assert_eq!(decide_one(&f, &m, &large, 1, false).await, Kind::Allowed);
    assert_eq!(deny_hits(&f), 0.0);
}

#[tokio::test]
async fn shadow_refusals_never_answer_a_request_alone() {
    let f = Fixture::new();
    let m = f.metrics.policy("r", "p");
    let rule = sw(1, 60 * S);
    assert_eq!(decide_one(&f, &m, &rule, 1, true).await, Kind::Allowed);
    // Over the limit, in shadow: admitted, and the refusal is cached for its counter.
    assert_eq!(decide_one(&f, &m, &rule, 1, true).await, Kind::Allowed);
    f.fail(true);
    // A request whose checks are all shadow always asks the store.
    assert_eq!(decide_one(&f, &m, &rule, 1, true).await, Kind::FailedOpen);
    // An enforced request on the same counter is a certain refusal.
    assert_eq!(decide_one(&f, &m, &rule, 1, false).await, Kind::Limited);
    assert_eq!(deny_hits(&f), 1.0);
}

#[tokio::test]
async fn a_request_is_answered_from_the_cache_only_when_every_check_is_refused() {
    let f = Fixture::new();
    let m = f.metrics.policy("r", "p");
    let (tight, loose) = (sw(1, 60 * S), sw(100, 60 * S));
    for expected in [Kind::Allowed, Kind::Limited] {
        let mut checks = Checks::with_capacity(2);
        checks.push("r:tight", &tight, 1, false, policy(&m, "p"));
        checks.push("r:loose", &loose, 1, false, policy(&m, "p"));
        assert_eq!(
            f.engine.decide(checks, FailureMode::Open).await.kind,
            expected
        );
    }
    f.fail(true);
    // `loose` allowed: its outcome is unknown to the cache, so the store is asked.
    let mut checks = Checks::with_capacity(2);
    checks.push("r:tight", &tight, 1, false, policy(&m, "p"));
    checks.push("r:loose", &loose, 1, false, policy(&m, "p"));
    let verdict = f.engine.decide(checks, FailureMode::Open).await;
    assert_eq!(verdict.kind, Kind::FailedOpen);
    assert_eq!(deny_hits(&f), 0.0);
}

#[test]
fn the_deny_cache_holds_at_most_its_capacity() {
    use super::super::deny_cache::DenyCache;
    let cache = DenyCache::new(64);
    let rule = sw(1, 60 * S);
    let refused = Outcome {
        allowed: false,
        limit: 1,
        remaining: 0,
        reset_us: 60 * S,
        retry_after_us: 60 * S,
    };
    for i in 0..10_000 {
        cache.insert(&format!("k{i}"), &rule, 1, &refused, (T + i, 0));
        assert!(cache.len() <= 64, "{} entries after {i}", cache.len());
    }
    // The newest are kept (the oldest end soonest and were dropped first).
    assert!(cache.lookup("k9999", &rule, 1, T + 10_000, 0).is_some());
    assert!(cache.lookup("k0", &rule, 1, T + 10_000, 0).is_none());
    // Nor in another epoch of the store (it lost state: a restarted Redis).
    assert!(cache.lookup("k9999", &rule, 1, T + 10_000, 1).is_none());
    // Expired entries go at the sweep.
    cache.sweep(T + 61 * S);
    assert_eq!(cache.len(), 0);
}

#[tokio::test]
async fn concurrency_refusals_are_never_cached() {
    let f = Fixture::new();
    let m = f.metrics.policy("r", "p");
    let rule = Rule::Concurrency(crate::limiter::Concurrency {
        limit: 1,
        lease_ttl_us: 60 * S,
    });
    assert_eq!(decide_one(&f, &m, &rule, 1, false).await, Kind::Allowed);
    assert_eq!(decide_one(&f, &m, &rule, 1, false).await, Kind::Limited);
    // A slot comes back when a request ends, not with time: the store is asked again.
    assert_eq!(f.engine.deny_cache_len(), 0);
    f.fail(true);
    assert_eq!(decide_one(&f, &m, &rule, 1, false).await, Kind::FailedOpen);
    assert_eq!(deny_hits(&f), 0.0);
}

/// A paced check through the engine: the verdict says how long to wait and holds the owned
/// reservation (its heap bytes: one entry per check and its key, the memory a waiter holds); a
/// paced refusal is never cached, since a waiter that goes away frees its slot.
#[tokio::test]
async fn a_paced_verdict_waits_and_owns_its_reservation() {
    let f = Fixture::new();
    let m = f.metrics.policy("r", "p");
    let rule = tb(10.0, 1);
    let key = "r:p:a-key-of-thirty-bytes-long!";
    let decide = || {
        let mut checks = Checks::with_capacity(1);
        let i = checks.push(key, &rule, 1, false, policy(&m, "p"));
        checks.pace(i, S);
        f.engine.decide(checks, FailureMode::Closed)
    };
    let first = decide().await;
    assert!(first.admits() && first.delay().is_zero() && first.reservation().is_none());
    let second = decide().await;
    assert_eq!(second.delay(), std::time::Duration::from_millis(100));
    let reservation = second
        .reservation()
        .expect("a delayed verdict's reservation");
    let per_check = std::mem::size_of::<Reserved>();
    assert_eq!(reservation.heap_bytes(), per_check + key.len());
    assert!(per_check <= 100, "{per_check} bytes per check");
    for _ in 0..9 {
        assert!(decide().await.admits());
    }
    // Eleven reserved: the next slot is 1.1 s away.
    let refused = decide().await;
    assert_eq!(refused.kind, Kind::Limited);
    assert_eq!(
        f.engine.deny_cache_len(),
        0,
        "a paced refusal is not cached"
    );
    f.engine.unreserve(&reservation).await;
    f.clock.set(T + 100_000);
    assert!(decide().await.admits(), "a slot came back with time");
}
