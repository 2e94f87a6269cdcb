//! One list of cases, run against both engines: the in-process store on an injected clock and
//! `scripts/decide.lua` in a real Redis given the same explicit `now`. Every expected outcome was
//! worked out by hand from `docs/algorithms.md` (the fractional ones in IEEE doubles), so the
//! suite proves both engines right, not merely alike.

mod support;

use std::sync::Arc;
use std::time::Duration;

use turnstile::limiter::algorithm::MAX_US;
use turnstile::limiter::calendar::Per;
use turnstile::limiter::{
    Check, Concurrency, Decision, ManualClock, MemoryStore, Outcome, Quota, RedisStore, Rule,
    SlidingWindow, TokenBucket,
};

const T: u64 = 1_000_000_000;
const S: u64 = 1_000_000;

/// One decision: at `now`, these (counter, cost) checks; then the expected answer, one
/// `(allowed, limit, remaining, reset_us, retry_after_us)` per check.
struct Step {
    now: u64,
    checks: Vec<(usize, u64)>,
    allowed: bool,
    outcomes: Vec<(bool, u64, u64, u64, u64)>,
    /// Admitted for later (pacing): the wait for the slot, in µs.
    delay_us: u64,
}

struct Case {
    name: &'static str,
    /// The rules of the counters the steps refer to by index.
    counters: Vec<Rule>,
    /// Counters checked in shadow mode (report only).
    shadow: &'static [usize],
    steps: Vec<Step>,
}

fn step(now: u64, checks: &[(usize, u64)], outcomes: &[(bool, u64, u64, u64, u64)]) -> Step {
    Step {
        now,
        checks: checks.to_vec(),
        allowed: outcomes.iter().all(|o| o.0),
        outcomes: outcomes.to_vec(),
        delay_us: 0,
    }
}

/// A paced step admitted for `delay_us` later (every outcome allows).
fn delayed(
    now: u64,
    checks: &[(usize, u64)],
    delay_us: u64,
    outcomes: &[(bool, u64, u64, u64, u64)],
) -> Step {
    Step {
        delay_us,
        ..step(now, checks, outcomes)
    }
}

/// A step whose decision is given explicitly (shadow checks: a refusal need not reject).
fn decided(
    now: u64,
    checks: &[(usize, u64)],
    allowed: bool,
    outcomes: &[(bool, u64, u64, u64, u64)],
) -> Step {
    Step {
        allowed,
        ..step(now, checks, outcomes)
    }
}

/// One check on counter 0.
fn one(now: u64, cost: u64, outcome: (bool, u64, u64, u64, u64)) -> Step {
    step(now, &[(0, cost)], &[outcome])
}

fn tb(rate: f64, burst: u64) -> Rule {
    Rule::TokenBucket(TokenBucket { rate, burst })
}

fn sw(limit: u64, window_us: u64, buckets: u32) -> Rule {
    Rule::SlidingWindow(SlidingWindow {
        limit,
        window_us,
        buckets,
    })
}

fn quota(limit: u64, per: Per) -> Rule {
    Rule::Quota(Quota {
        limit,
        per,
        time_zone: chrono_tz::Europe::Berlin,
    })
}

/// Epoch microseconds of an RFC 3339 time.
fn at(text: &str) -> u64 {
    chrono::DateTime::parse_from_rfc3339(text)
        .expect("RFC 3339 time")
        .timestamp_micros() as u64
}

const H: u64 = 3600 * S;
/// Noon in Europe/Berlin (the quotas' zone), 2026-11-23.
const NOON: u64 = 1_795_431_600_000_000;

/// Calendar quotas in Europe/Berlin: midnight, the DST days of 23 and 25 hours, a month and an
/// ISO week boundary, and a clock stepped back over midnight.
fn quota_cases() -> Vec<Case> {
    let before_midnight = at("2026-11-23T23:59:58+01:00");
    vec![
        Case {
            name: "quota_day_crosses_midnight",
            shadow: &[],
            counters: vec![quota(2, Per::Day)],
            steps: vec![
                one(before_midnight, 1, (true, 2, 1, 2 * S, 0)),
                one(before_midnight + S, 1, (true, 2, 0, S, 0)),
                one(before_midnight + S, 1, (false, 2, 0, S, S)),
                // Midnight: a new period with the whole quota, 24 h to the next reset.
                one(before_midnight + 2 * S, 1, (true, 2, 1, 24 * H, 0)),
                // Stepped back before midnight: the counter stays in the newest period.
                one(before_midnight + S, 0, (true, 2, 1, 24 * H + S, 0)),
                one(before_midnight + S, 1, (true, 2, 0, 24 * H + S, 0)),
            ],
        },
        Case {
            name: "quota_dst_spring_forward_day_is_23_hours",
            shadow: &[],
            counters: vec![quota(1, Per::Day)],
            steps: vec![
                one(at("2026-03-29T00:00:00+01:00"), 1, (true, 1, 0, 23 * H, 0)),
                one(
                    at("2026-03-29T12:00:00+02:00"),
                    1,
                    (false, 1, 0, 12 * H, 12 * H),
                ),
                one(at("2026-03-29T23:59:59+02:00"), 1, (false, 1, 0, S, S)),
                one(at("2026-03-30T00:00:00+02:00"), 1, (true, 1, 0, 24 * H, 0)),
            ],
        },
        Case {
            name: "quota_dst_fall_back_day_is_25_hours",
            shadow: &[],
            counters: vec![quota(1, Per::Day)],
            steps: vec![
                one(at("2026-10-25T00:00:00+02:00"), 1, (true, 1, 0, 25 * H, 0)),
                // The second 02:30 of the day (after the clocks went back).
                one(
                    at("2026-10-25T02:30:00+01:00"),
                    1,
                    (false, 1, 0, 21 * H + H / 2, 21 * H + H / 2),
                ),
                one(at("2026-10-26T00:00:00+01:00"), 1, (true, 1, 0, 24 * H, 0)),
            ],
        },
        Case {
            name: "quota_month_boundary",
            shadow: &[],
            counters: vec![quota(3, Per::Month)],
            steps: vec![
                one(at("2026-02-28T23:00:00+01:00"), 2, (true, 3, 1, H, 0)),
                one(at("2026-02-28T23:00:00+01:00"), 2, (false, 3, 1, H, H)),
                // March 2026 has 31 days less the hour of its DST change.
                one(at("2026-03-01T00:00:00+01:00"), 2, (true, 3, 1, 743 * H, 0)),
            ],
        },
        Case {
            name: "quota_iso_week_starts_monday",
            shadow: &[],
            counters: vec![quota(1, Per::Week)],
            steps: vec![
                one(at("2026-11-29T23:00:00+01:00"), 1, (true, 1, 0, H, 0)),
                one(
                    at("2026-11-29T23:30:00+01:00"),
                    1,
                    (false, 1, 0, H / 2, H / 2),
                ),
                one(
                    at("2026-11-30T00:00:00+01:00"),
                    1,
                    (true, 1, 0, 7 * 24 * H, 0),
                ),
            ],
        },
    ]
}

fn cases() -> Vec<Case> {
    let mut cases = rule_cases();
    cases.extend(quota_cases());
    cases
}

fn rule_cases() -> Vec<Case> {
    vec![
        Case {
            name: "token_bucket",
            shadow: &[],
            counters: vec![tb(1.0, 2)],
            steps: vec![
                one(T, 1, (true, 2, 1, S, 0)),
                one(T, 1, (true, 2, 0, 2 * S, 0)),
                one(T, 1, (false, 2, 0, 2 * S, S)),
                one(T + S / 2, 1, (false, 2, 0, 3 * S / 2, S / 2)),
                one(T + S, 1, (true, 2, 0, 2 * S, 0)),
                // More than the burst can never pass: retry when full.
                one(T + 2 * S, 3, (false, 2, 1, S, S)),
                // Refills to the cap, never past it.
                one(T + 60 * S, 2, (true, 2, 0, 2 * S, 0)),
            ],
        },
        Case {
            name: "token_bucket_clock_stepped_back",
            shadow: &[],
            counters: vec![tb(1.0, 2)],
            steps: vec![
                one(T + 2 * S, 2, (true, 2, 0, 2 * S, 0)),
                // One second back: no refill, and the stored time does not move back either.
                one(T + S, 1, (false, 2, 0, 2 * S, S)),
                one(T + S, 0, (true, 2, 0, 2 * S, 0)),
                one(T + 5 * S / 2, 1, (false, 2, 0, 3 * S / 2, S / 2)),
                one(T + 3 * S, 1, (true, 2, 0, 2 * S, 0)),
            ],
        },
        Case {
            name: "fractional_rate_half_per_second",
            shadow: &[],
            counters: vec![tb(0.5, 1)],
            steps: vec![
                one(T, 1, (true, 1, 0, 2 * S, 0)),
                one(T + S, 1, (false, 1, 0, S, S)),
                one(T + 2 * S, 1, (true, 1, 0, 2 * S, 0)),
            ],
        },
        Case {
            // Tokens keep their fraction (0.6000000000000001, then 0.20000000000000018).
            name: "fractional_tokens_kept",
            shadow: &[],
            counters: vec![tb(3.0, 2)],
            steps: vec![
                one(T, 1, (true, 2, 1, 333_334, 0)),
                one(T + 200_000, 1, (true, 2, 0, 466_667, 0)),
                one(T + 400_000, 1, (true, 2, 0, 600_000, 0)),
                one(T + 600_000, 1, (false, 2, 0, 400_000, 66_667)),
                one(T + 633_334, 1, (false, 2, 0, 366_666, 33_333)),
            ],
        },
        Case {
            name: "sliding_window_exact",
            shadow: &[],
            counters: vec![sw(2, 10 * S, 0)],
            steps: vec![
                one(100 * S, 1, (true, 2, 1, 10 * S, 0)),
                one(101 * S, 1, (true, 2, 0, 10 * S, 0)),
                // The oldest entry (100 s) leaves the window at 110 s.
                one(102 * S, 1, (false, 2, 0, 9 * S, 8 * S)),
                one(110 * S, 1, (true, 2, 0, 10 * S, 0)),
                // Stepped back to 105 s: the log runs on at 110 s.
                one(105 * S, 1, (false, 2, 0, 10 * S, S)),
                one(105 * S, 0, (true, 2, 0, 10 * S, 0)),
                one(111 * S, 1, (true, 2, 0, 10 * S, 0)),
                // More than the limit can never pass.
                one(111 * S, 3, (false, 2, 0, 10 * S, 10 * S)),
            ],
        },
        Case {
            name: "sliding_window_exact_admitted_while_stepped_back",
            shadow: &[],
            counters: vec![sw(2, 10 * S, 0)],
            steps: vec![
                one(50 * S, 1, (true, 2, 1, 10 * S, 0)),
                // Recorded at 50 s, not 40 s: it must not leave the window early.
                one(40 * S, 1, (true, 2, 0, 10 * S, 0)),
                one(55 * S, 1, (false, 2, 0, 5 * S, 5 * S)),
                one(60 * S, 1, (true, 2, 1, 10 * S, 0)),
            ],
        },
        Case {
            // Units admitted at one time are one entry on both engines, whatever their number.
            name: "sliding_window_exact_large_costs_merge",
            shadow: &[],
            counters: vec![sw(3_000_000, 10 * S, 0)],
            steps: vec![
                one(100 * S, 2_000_000, (true, 3_000_000, 1_000_000, 10 * S, 0)),
                // The same time: added to the entry of 100 s.
                one(100 * S, 500_000, (true, 3_000_000, 500_000, 10 * S, 0)),
                one(101 * S, 400_000, (true, 3_000_000, 100_000, 10 * S, 0)),
                // 100,000 too many: the 2,500,000 of 100 s free them at 110 s.
                one(102 * S, 200_000, (false, 3_000_000, 100_000, 9 * S, 8 * S)),
                one(110 * S, 2_600_000, (true, 3_000_000, 0, 10 * S, 0)),
                // The entry of 101 s frees the one unit needed at 111 s.
                one(110 * S, 1, (false, 3_000_000, 0, 10 * S, S)),
                one(111 * S, 400_000, (true, 3_000_000, 0, 10 * S, 0)),
            ],
        },
        Case {
            // Past 2^51 units counted in one key, Redis numbers its members from 0 again: the
            // counts stay exact.
            name: "sliding_window_exact_counts_past_2_pow_51",
            shadow: &[],
            counters: vec![sw(1 << 52, 10 * S, 0)],
            steps: vec![
                one(100 * S, 1 << 50, (true, 1 << 52, 3 << 50, 10 * S, 0)),
                one(105 * S, 1 << 50, (true, 1 << 52, 1 << 51, 10 * S, 0)),
                one(
                    110 * S,
                    (1 << 50) + 1,
                    (true, 1 << 52, (1 << 51) - 1, 10 * S, 0),
                ),
                one(110 * S, 1, (true, 1 << 52, (1 << 51) - 2, 10 * S, 0)),
                one(115 * S, 0, (true, 1 << 52, (3 << 50) - 2, 5 * S, 0)),
                one(115 * S, 3, (true, 1 << 52, (3 << 50) - 5, 10 * S, 0)),
            ],
        },
        Case {
            // retry_after walks the entries oldest first until they free enough units.
            name: "sliding_window_exact_retry_walks_entries",
            shadow: &[],
            counters: vec![sw(5, 10 * S, 0)],
            steps: vec![
                one(100 * S, 1, (true, 5, 4, 10 * S, 0)),
                one(101 * S, 1, (true, 5, 3, 10 * S, 0)),
                one(102 * S, 2, (true, 5, 1, 10 * S, 0)),
                one(103 * S, 1, (true, 5, 0, 10 * S, 0)),
                // Three units needed: 1 + 1 + 2, the third entry (102 s) leaves at 112 s.
                one(104 * S, 3, (false, 5, 0, 9 * S, 8 * S)),
                // Five: every entry, the last (103 s) leaving at 113 s.
                one(104 * S, 5, (false, 5, 0, 9 * S, 9 * S)),
                // 100 s to 102 s have left; 1 unit of 103 s is counted.
                one(112 * S, 3, (true, 5, 1, 10 * S, 0)),
                // Stepped back: recorded at 112 s, added to its entry (now 4 units).
                one(111 * S, 1, (true, 5, 0, 10 * S, 0)),
                one(112 * S, 1, (false, 5, 0, 10 * S, S)),
                one(113 * S, 1, (true, 5, 0, 10 * S, 0)),
                // Two needed: the 4 units of 112 s free them at 122 s.
                one(113 * S, 2, (false, 5, 0, 10 * S, 9 * S)),
                one(122 * S, 4, (true, 5, 0, 10 * S, 0)),
            ],
        },
        Case {
            // Five sub-windows of 2 s; bucket j covers [2j s, 2j+2 s).
            name: "sliding_window_bucketed",
            shadow: &[],
            counters: vec![sw(3, 10 * S, 5)],
            steps: vec![
                one(100 * S, 2, (true, 3, 1, 12 * S, 0)),
                one(103 * S, 1, (true, 3, 0, 11 * S, 0)),
                one(104 * S, 1, (false, 3, 0, 10 * S, 8 * S)),
                // Bucket 50 is only partly inside the window but still counts whole.
                one(110 * S, 1, (false, 3, 0, 4 * S, 2 * S)),
                one(112 * S, 1, (true, 3, 1, 12 * S, 0)),
                // Stepped back to 105 s: still bucket 56, not 52.
                one(105 * S, 1, (true, 3, 0, 19 * S, 0)),
                one(113 * S, 1, (false, 3, 0, 11 * S, S)),
                one(113 * S, 4, (false, 3, 0, 11 * S, 10 * S)),
            ],
        },
        Case {
            name: "all_or_nothing",
            shadow: &[],
            counters: vec![tb(1.0, 5), sw(1, 10 * S, 0)],
            steps: vec![
                // The window rejects (cost over its limit): the bucket keeps its 5 tokens.
                step(
                    T,
                    &[(0, 1), (1, 2)],
                    &[(true, 5, 5, 0, 0), (false, 1, 1, 0, 10 * S)],
                ),
                step(
                    T,
                    &[(0, 1), (1, 1)],
                    &[(true, 5, 4, S, 0), (true, 1, 0, 10 * S, 0)],
                ),
                step(
                    T + S / 2,
                    &[(0, 1), (1, 1)],
                    &[
                        (true, 5, 4, S / 2, 0),
                        (false, 1, 0, 19 * S / 2, 19 * S / 2),
                    ],
                ),
                // Proof that the rejected requests took nothing from the bucket.
                step(T + S / 2, &[(0, 1)], &[(true, 5, 3, 3 * S / 2, 0)]),
            ],
        },
        Case {
            name: "cost_zero_checks_without_consuming",
            shadow: &[],
            counters: vec![tb(1.0, 5), sw(3, 10 * S, 0), sw(3, 10 * S, 5)],
            steps: vec![
                step(
                    T,
                    &[(0, 0), (1, 0), (2, 0)],
                    &[(true, 5, 5, 0, 0), (true, 3, 3, 0, 0), (true, 3, 3, 0, 0)],
                ),
                step(
                    T,
                    &[(0, 0), (1, 0), (2, 0)],
                    &[(true, 5, 5, 0, 0), (true, 3, 3, 0, 0), (true, 3, 3, 0, 0)],
                ),
                step(T, &[(0, 5)], &[(true, 5, 0, 5 * S, 0)]),
                // An empty bucket still admits a zero-cost check.
                step(T, &[(0, 0)], &[(true, 5, 0, 5 * S, 0)]),
            ],
        },
        Case {
            name: "shadow_refusal_never_rejects",
            shadow: &[0],
            counters: vec![tb(1.0, 1), sw(5, 10 * S, 0)],
            steps: vec![
                step(
                    T,
                    &[(0, 1), (1, 1)],
                    &[(true, 1, 0, S, 0), (true, 5, 4, 10 * S, 0)],
                ),
                // The shadow bucket is empty: it says so, consumes nothing, rejects nothing.
                decided(
                    T,
                    &[(0, 1), (1, 1)],
                    true,
                    &[(false, 1, 0, S, S), (true, 5, 3, 10 * S, 0)],
                ),
                decided(
                    T + S / 2,
                    &[(0, 1), (1, 1)],
                    true,
                    &[(false, 1, 0, S / 2, S / 2), (true, 5, 2, 10 * S, 0)],
                ),
                step(T + S, &[(0, 1)], &[(true, 1, 0, S, 0)]),
            ],
        },
        Case {
            // A rate near zero puts the reset past what a Redis integer holds: both engines clamp
            // every duration at MAX_US (2^62 µs) instead of overflowing.
            name: "durations_clamp_at_max_us",
            shadow: &[],
            counters: vec![tb(1e-13, 10)],
            steps: vec![
                one(T, 1, (true, 10, 9, MAX_US, 0)),
                one(T + S, 10, (false, 10, 9, MAX_US, MAX_US)),
            ],
        },
        Case {
            name: "shadow_consumes_nothing_when_rejected",
            shadow: &[0],
            counters: vec![tb(1.0, 5), sw(1, 10 * S, 0)],
            steps: vec![
                decided(
                    T,
                    &[(0, 1), (1, 2)],
                    false,
                    &[(true, 5, 5, 0, 0), (false, 1, 1, 0, 10 * S)],
                ),
                step(T, &[(0, 1)], &[(true, 5, 4, S, 0)]),
            ],
        },
    ]
}

/// The store checks of `step` in `case`, its counters named by `keys`.
fn step_checks<'a>(case: &'a Case, keys: &'a [String], step: &Step) -> Vec<Check<'a>> {
    step.checks
        .iter()
        .map(|&(i, cost)| Check {
            key: &keys[i],
            rule: &case.counters[i],
            cost,
            shadow: case.shadow.contains(&i),
            max_delay_us: None,
        })
        .collect()
}

/// A decision without its stamps: the answer the spec's steps give (stamps are compared
/// between the engines instead).
fn answer(d: &Decision) -> Decision {
    Decision {
        stamps: Default::default(),
        ..d.clone()
    }
}

fn expected(step: &Step) -> Decision {
    Decision {
        stamps: Default::default(),
        allowed: step.allowed,
        outcomes: step
            .outcomes
            .iter()
            .map(
                |&(allowed, limit, remaining, reset_us, retry_after_us)| Outcome {
                    allowed,
                    limit,
                    remaining,
                    reset_us,
                    retry_after_us,
                },
            )
            .collect(),
        delay_us: step.delay_us,
        slot_us: if step.delay_us > 0 {
            step.now + step.delay_us
        } else {
            0
        },
    }
}

#[tokio::test]
async fn both_stores_follow_the_spec() {
    let redis = support::redis::RedisServer::start();
    let clock = Arc::new(ManualClock::new(T));
    let memory = MemoryStore::new(clock.clone(), 10_000);
    let remote = RedisStore::connect_with_test_clock(
        &redis.url(),
        Duration::from_secs(2),
        "conformance:",
        clock.clone(),
    )
    .expect("redis store");
    assert!(
        remote.wait_ready(Duration::from_secs(10)).await,
        "redis never became ready"
    );

    let mut steps = 0;
    for case in cases() {
        let keys: Vec<String> = (0..case.counters.len())
            .map(|i| format!("{}:{i}", case.name))
            .collect();
        for (n, step) in case.steps.iter().enumerate() {
            clock.set(step.now);
            let checks = step_checks(&case, &keys, step);
            let want = expected(step);
            let from_memory = memory.check(&checks);
            assert_eq!(
                answer(&from_memory),
                want,
                "memory store, {} step {n}",
                case.name
            );
            let from_redis = remote.check(&checks).await.expect("redis decision");
            assert_eq!(
                answer(&from_redis),
                want,
                "redis store, {} step {n}",
                case.name
            );
            assert_eq!(
                from_memory.stamps, from_redis.stamps,
                "stamps, {} step {n}",
                case.name
            );
            steps += 1;
        }
    }
    assert!(steps > 40, "the suite lost its cases: {steps} steps");
}

/// Every step of the spec's cases peeked first on both engines (issue 42): the two peeks agree,
/// a refused decision reports exactly what the peek did, an admitted one the peek's remaining
/// less its cost, and since every decision still gets its expected outcome, the peeks changed
/// nothing; Redis counted no write for any of them.
#[tokio::test]
async fn a_peek_before_every_step_agrees_with_its_decision() {
    let redis = support::redis::RedisServer::start();
    let clock = Arc::new(ManualClock::new(T));
    let memory = MemoryStore::new(clock.clone(), 10_000);
    let remote = RedisStore::connect_with_test_clock(
        &redis.url(),
        Duration::from_secs(2),
        "peek:",
        clock.clone(),
    )
    .expect("redis store");
    assert!(remote.wait_ready(Duration::from_secs(10)).await);
    let mut peeks = 0;
    for case in cases() {
        let keys: Vec<String> = (0..case.counters.len())
            .map(|i| format!("{}:{i}", case.name))
            .collect();
        for (n, step) in case.steps.iter().enumerate() {
            clock.set(step.now);
            let checks = step_checks(&case, &keys, step);
            let peeked = memory.peek(&checks);
            let writes = redis_writes(&redis);
            let remote_peek = remote.peek(&checks).await.expect("redis peek");
            assert_eq!(
                redis_writes(&redis),
                writes,
                "{} step {n}: peek wrote",
                case.name
            );
            assert_eq!(
                remote_peek, peeked,
                "{} step {n}: the engines' peeks",
                case.name
            );
            let want = expected(step);
            assert_eq!(
                answer(&memory.check(&checks)),
                want,
                "memory, {} step {n}",
                case.name
            );
            assert_eq!(answer(&remote.check(&checks).await.expect("redis")), want);
            for ((p, d), check) in peeked.outcomes.iter().zip(&want.outcomes).zip(&checks) {
                if want.allowed && d.allowed {
                    assert!(p.allowed, "{} step {n}: {p:?} / {d:?}", case.name);
                    assert_eq!(p.remaining.saturating_sub(check.cost), d.remaining);
                } else {
                    assert_eq!(
                        p, d,
                        "{} step {n}: refused, the peek is the state",
                        case.name
                    );
                }
            }
            peeks += 1;
        }
    }
    assert!(peeks > 40, "the suite lost its cases: {peeks} peeks");
}

/// The TTL rule in practice: every key the script writes expires, none lives forever.
#[tokio::test]
async fn every_key_written_has_a_ttl() {
    let redis = support::redis::RedisServer::start();
    let clock = Arc::new(ManualClock::new(T));
    let remote =
        RedisStore::connect_with_test_clock(&redis.url(), Duration::from_secs(2), "ttl:", clock)
            .expect("redis store");
    assert!(remote.wait_ready(Duration::from_secs(10)).await);
    for case in cases() {
        let keys: Vec<String> = (0..case.counters.len())
            .map(|i| format!("{}:{i}", case.name))
            .collect();
        let checks: Vec<Check<'_>> = keys
            .iter()
            .zip(&case.counters)
            .map(|(key, rule)| Check {
                key,
                rule,
                cost: 1,
                shadow: false,
                max_delay_us: None,
            })
            .collect();
        remote.check(&checks).await.expect("decision");
    }
    let keys = redis.keys();
    assert_eq!(keys.len(), 25, "one key per counter of the cases: {keys:?}");
    for key in keys {
        assert!(
            key.starts_with("ttl:{"),
            "key {key} lacks the prefix and hash tag"
        );
        let ttl: i64 = redis.cli(&["pttl", &key])[0].parse().expect("pttl");
        assert!(ttl > 0, "key {key} has no TTL ({ttl})");
    }
}

/// What happens to the counters of a lease or charge case, in order.
enum Op {
    /// At `now`, check these (counter, cost) taking lease `lease`; the expected outcomes.
    Take(u64, Vec<(usize, u64)>, u64, Vec<(bool, u64, u64, u64, u64)>),
    /// Release lease `lease` on counter `i`.
    Release(usize, u64),
    /// At `now`, charge `cost` to counter `i` whatever it holds (cost from the response).
    Charge(u64, usize, u64),
    /// At `now`, renew lease `lease` on counter `i` (its request still runs).
    Renew(u64, usize, u64),
    /// At `now`, peek these (counter, cost) checks: the expected outcomes, and nothing written.
    Peek(u64, Vec<(usize, u64)>, Vec<(bool, u64, u64, u64, u64)>),
    /// At `now`, give back `cost` to counter `i` (a reservation settled below what it took), from
    /// the consumption of the `Take` at op index `from`, whose stamp it names.
    Refund(u64, usize, u64, usize),
}

/// A Take's (counter, cost) checks and its decision's stamps, kept by op index for the refunds
/// that name it.
type Taken = (Vec<(usize, u64)>, Vec<u64>);

fn cc(limit: u64, lease_ttl_us: u64) -> Rule {
    Rule::Concurrency(Concurrency {
        limit,
        lease_ttl_us,
    })
}

/// Writes Redis counted since it started (`rdb_changes_since_last_save`: every command that
/// changes the dataset, a PEXPIRE or a DEL of nothing included).
fn redis_writes(redis: &support::redis::RedisServer) -> u64 {
    let info = redis.cli(&["info", "persistence"]);
    support::redis::info_field(&info, "rdb_changes_since_last_save")
        .and_then(|v| v.parse().ok())
        .expect("rdb_changes_since_last_save")
}

/// Peeks (issue 42): after N decisions a peek reports the state they left (remaining now, the
/// time to full reset; allowed and retry-after for its cost) and the next decision's remaining is
/// the peek's less its cost; expired window members and leases are skipped, not removed (a
/// decision at an earlier time still counts them); nothing is ever written.
fn peek_cases() -> Vec<(&'static str, Vec<Rule>, Vec<Op>)> {
    use Op::*;
    let noon = at("2026-11-23T12:00:00+01:00");
    vec![
        (
            "peek_token_bucket",
            vec![tb(1.0, 5)],
            vec![
                Peek(T, vec![(0, 1)], vec![(true, 5, 5, 0, 0)]),
                Take(T, vec![(0, 1)], 0, vec![(true, 5, 4, S, 0)]),
                Take(T, vec![(0, 1)], 0, vec![(true, 5, 3, 2 * S, 0)]),
                Take(T, vec![(0, 1)], 0, vec![(true, 5, 2, 3 * S, 0)]),
                Peek(T, vec![(0, 1)], vec![(true, 5, 2, 3 * S, 0)]),
                Peek(T, vec![(0, 1)], vec![(true, 5, 2, 3 * S, 0)]),
                Take(T, vec![(0, 1)], 0, vec![(true, 5, 1, 4 * S, 0)]),
                // 1.5 tokens: a cost of 3 would wait 1.5 s.
                Peek(
                    T + S / 2,
                    vec![(0, 3)],
                    vec![(false, 5, 1, 3 * S + S / 2, S + S / 2)],
                ),
                Take(
                    T + S / 2,
                    vec![(0, 1)],
                    0,
                    vec![(true, 5, 0, 4 * S + S / 2, 0)],
                ),
            ],
        ),
        (
            "peek_sliding_window",
            vec![sw(3, 10 * S, 0)],
            vec![
                Take(T, vec![(0, 1)], 0, vec![(true, 3, 2, 10 * S, 0)]),
                Take(T + S, vec![(0, 1)], 0, vec![(true, 3, 1, 10 * S, 0)]),
                Peek(T + 2 * S, vec![(0, 1)], vec![(true, 3, 1, 9 * S, 0)]),
                // The entry of T has left the window at T + 10 s: skipped, not removed.
                Peek(T + 10 * S, vec![(0, 1)], vec![(true, 3, 2, S, 0)]),
                Take(T + 2 * S, vec![(0, 1)], 0, vec![(true, 3, 0, 10 * S, 0)]),
                Peek(T + 3 * S, vec![(0, 1)], vec![(false, 3, 0, 9 * S, 7 * S)]),
                Take(
                    T + 3 * S,
                    vec![(0, 1)],
                    0,
                    vec![(false, 3, 0, 9 * S, 7 * S)],
                ),
            ],
        ),
        (
            "peek_bucketed_window",
            vec![sw(4, 10 * S, 2)],
            vec![
                Take(T, vec![(0, 1)], 0, vec![(true, 4, 3, 15 * S, 0)]),
                Take(T + 5 * S, vec![(0, 2)], 0, vec![(true, 4, 1, 15 * S, 0)]),
                Peek(T + 6 * S, vec![(0, 1)], vec![(true, 4, 1, 14 * S, 0)]),
                // The bucket of T has left: skipped.
                Peek(T + 15 * S, vec![(0, 1)], vec![(true, 4, 2, 5 * S, 0)]),
                Take(T + 6 * S, vec![(0, 1)], 0, vec![(true, 4, 0, 14 * S, 0)]),
                Peek(T + 6 * S, vec![(0, 1)], vec![(false, 4, 0, 14 * S, 9 * S)]),
            ],
        ),
        (
            "peek_quota",
            vec![quota(3, Per::Day)],
            vec![
                Peek(noon, vec![(0, 1)], vec![(true, 3, 3, 0, 0)]),
                Take(noon, vec![(0, 2)], 0, vec![(true, 3, 1, 12 * H, 0)]),
                Peek(noon, vec![(0, 2)], vec![(false, 3, 1, 12 * H, 12 * H)]),
                Peek(noon, vec![(0, 1)], vec![(true, 3, 1, 12 * H, 0)]),
                Take(noon, vec![(0, 1)], 0, vec![(true, 3, 0, 12 * H, 0)]),
            ],
        ),
        (
            "peek_concurrency",
            vec![cc(2, 10 * S)],
            vec![
                Take(T, vec![(0, 1)], 1, vec![(true, 2, 1, 10 * S, 0)]),
                Peek(T + S, vec![(0, 1)], vec![(true, 2, 1, 9 * S, 0)]),
                Take(T + S, vec![(0, 1)], 2, vec![(true, 2, 0, 10 * S, 0)]),
                Peek(T + 2 * S, vec![(0, 1)], vec![(false, 2, 0, 9 * S, S)]),
                // Lease 1 expires at T + 10 s: skipped, not removed.
                Peek(T + 10 * S, vec![(0, 1)], vec![(true, 2, 1, S, 0)]),
                Take(T + 2 * S, vec![(0, 1)], 3, vec![(false, 2, 0, 9 * S, S)]),
            ],
        ),
        (
            "peek_all_policies",
            vec![tb(1.0, 1), sw(5, 10 * S, 0)],
            vec![
                Peek(
                    T,
                    vec![(0, 1), (1, 1)],
                    vec![(true, 1, 1, 0, 0), (true, 5, 5, 0, 0)],
                ),
                Take(
                    T,
                    vec![(0, 1), (1, 1)],
                    0,
                    vec![(true, 1, 0, S, 0), (true, 5, 4, 10 * S, 0)],
                ),
                // The bucket would refuse; the window reports its state as it stays.
                Peek(
                    T,
                    vec![(0, 1), (1, 1)],
                    vec![(false, 1, 0, S, S), (true, 5, 4, 10 * S, 0)],
                ),
            ],
        ),
    ]
}

/// Leases (acquire, release, expiry, all-or-nothing with a refusing bucket) and charges after
/// admission (a bucket and a window pushed past their limit, refusing until they recover).
fn lease_and_charge_cases() -> Vec<(&'static str, Vec<Rule>, Vec<Op>)> {
    use Op::*;
    vec![
        (
            "concurrency",
            vec![cc(2, 10 * S), tb(1.0 / 3600.0, 1), cc(1, 10 * S)],
            vec![
                Take(T, vec![(0, 1)], 1, vec![(true, 2, 1, 10 * S, 0)]),
                Take(T + S, vec![(0, 1)], 2, vec![(true, 2, 0, 10 * S, 0)]),
                // Full: refused for a second; the last lease expires at T + 11 s.
                Take(T + 2 * S, vec![(0, 1)], 3, vec![(false, 2, 0, 9 * S, S)]),
                Release(0, 1),
                Release(0, 1),
                Take(T + 3 * S, vec![(0, 1)], 4, vec![(true, 2, 0, 10 * S, 0)]),
                // Lease 2 expires at T + 11 s exactly: never released, it stops counting.
                Take(T + 11 * S, vec![(0, 1)], 5, vec![(true, 2, 0, 10 * S, 0)]),
                // Lease 4 (expiring at T + 13 s) is renewed at T + 12 s to T + 22 s; lease 2,
                // expired, stays gone.
                Renew(T + 12 * S, 0, 4),
                Renew(T + 12 * S, 0, 2),
                Take(T + 13 * S, vec![(0, 0)], 0, vec![(true, 2, 0, 9 * S, 0)]),
                // All or nothing: the bucket refuses the second time, so no lease is taken.
                Take(
                    T + 14 * S,
                    vec![(2, 1), (1, 1)],
                    6,
                    vec![(true, 1, 0, 10 * S, 0), (true, 1, 0, 3600 * S, 0)],
                ),
                Release(2, 6),
                Take(
                    T + 15 * S,
                    vec![(2, 1), (1, 1)],
                    7,
                    vec![(true, 1, 1, 0, 0), (false, 1, 0, 3599 * S, 3599 * S)],
                ),
                Take(T + 15 * S, vec![(2, 1)], 8, vec![(true, 1, 0, 10 * S, 0)]),
            ],
        ),
        (
            "charge_bucket",
            vec![tb(1.0, 10)],
            vec![
                Take(T, vec![(0, 1)], 0, vec![(true, 10, 9, S, 0)]),
                // The response reports 20 more: 9 - 20 = -11 tokens.
                Charge(T, 0, 20),
                Take(T, vec![(0, 1)], 0, vec![(false, 10, 0, 21 * S, 12 * S)]),
                Take(T + 11 * S, vec![(0, 1)], 0, vec![(false, 10, 0, 10 * S, S)]),
                Take(T + 12 * S, vec![(0, 1)], 0, vec![(true, 10, 0, 10 * S, 0)]),
            ],
        ),
        (
            "reserve_then_refund_bucket",
            vec![tb(1.0, 10), tb(1.0, 10)],
            vec![
                // A reservation of 8, of which the response used 3: 5 come back.
                Take(T, vec![(0, 8)], 0, vec![(true, 10, 2, 8 * S, 0)]),
                Refund(T, 0, 5, 0),
                Take(T, vec![(0, 8)], 0, vec![(false, 10, 7, 3 * S, S)]),
                Take(T, vec![(0, 7)], 0, vec![(true, 10, 0, 10 * S, 0)]),
                // Never above the burst: 0 + 20 is 10, full.
                Refund(T + 2 * S, 0, 20, 3),
                Take(T + 2 * S, vec![(0, 10)], 0, vec![(true, 10, 0, 10 * S, 0)]),
                // Added before the refill since T + 2 s: 4 + 3 s of refill.
                Refund(T + 5 * S, 0, 4, 5),
                Take(T + 5 * S, vec![(0, 0)], 0, vec![(true, 10, 7, 3 * S, 0)]),
                // A counter never taken from (or forgotten full) gets nothing: still 10.
                Refund(T + 5 * S, 1, 4, 5),
                Take(T + 5 * S, vec![(1, 0)], 0, vec![(true, 10, 10, 0, 0)]),
            ],
        ),
        (
            // The stamped refund of an exact window: units go back to the entry of the time the
            // admission wrote, so they leave the window when it does; an entry that has left
            // the window gets nothing, and no refund takes more than the entry holds.
            "reserve_then_refund_window",
            vec![sw(10, 10 * S, 0)],
            vec![
                Take(T, vec![(0, 8)], 0, vec![(true, 10, 2, 10 * S, 0)]),
                Take(T + S, vec![(0, 2)], 0, vec![(true, 10, 0, 10 * S, 0)]),
                // The first used 3 of its 8: the entry of T holds 3.
                Refund(T + 2 * S, 0, 5, 0),
                Take(T + 2 * S, vec![(0, 5)], 0, vec![(true, 10, 0, 10 * S, 0)]),
                // At T + 10 s the entry of T (3) leaves: 2 + 5 counted, 3 fit.
                Take(T + 10 * S, vec![(0, 3)], 0, vec![(true, 10, 0, 10 * S, 0)]),
                // Refunded after its entry left the window: nothing, the window is not inflated.
                Refund(T + 10 * S, 0, 5, 0),
                Take(T + 10 * S, vec![(0, 0)], 0, vec![(true, 10, 0, 10 * S, 0)]),
                // More than the entry of T + 1 s holds: only its 2, never below zero.
                Refund(T + 10 * S, 0, 100, 1),
                Take(T + 10 * S, vec![(0, 0)], 0, vec![(true, 10, 2, 10 * S, 0)]),
                // Admitted at the same time as the 3 of T + 10 s: one entry of 5, of which the
                // first admission's refund takes back its own 2; the other 3 stay.
                Take(T + 10 * S, vec![(0, 2)], 0, vec![(true, 10, 0, 10 * S, 0)]),
                Refund(T + 10 * S, 0, 2, 4),
                Take(T + 10 * S, vec![(0, 0)], 0, vec![(true, 10, 2, 10 * S, 0)]),
                // 5 of T + 2 s and 3 of T + 10 s: 3 more wait for T + 2 s to leave.
                Take(T + 11 * S, vec![(0, 3)], 0, vec![(false, 10, 2, 9 * S, S)]),
                Take(T + 12 * S, vec![(0, 3)], 0, vec![(true, 10, 4, 10 * S, 0)]),
            ],
        ),
        (
            // The same on a bucketed window (five buckets of 2 s; bucket 500 is [T, T + 2 s)).
            "reserve_then_refund_bucketed_window",
            vec![sw(10, 10 * S, 5)],
            vec![
                Take(T, vec![(0, 8)], 0, vec![(true, 10, 2, 12 * S, 0)]),
                Take(T + 2 * S, vec![(0, 2)], 0, vec![(true, 10, 0, 12 * S, 0)]),
                Refund(T + 3 * S, 0, 5, 0),
                Take(T + 3 * S, vec![(0, 5)], 0, vec![(true, 10, 0, 11 * S, 0)]),
                // Bucket 506: bucket 500 (3) has left, 501 holds 7.
                Take(T + 12 * S, vec![(0, 3)], 0, vec![(true, 10, 0, 12 * S, 0)]),
                Refund(T + 12 * S, 0, 5, 0),
                Take(T + 12 * S, vec![(0, 0)], 0, vec![(true, 10, 0, 12 * S, 0)]),
                // Bucket 501 gives back 2 of its 7 (the second admission's), 506 keeps its 3.
                Refund(T + 12 * S, 0, 2, 1),
                Take(T + 12 * S, vec![(0, 0)], 0, vec![(true, 10, 2, 12 * S, 0)]),
                // More than bucket 506 holds: emptied, never below zero.
                Refund(T + 12 * S, 0, 100, 4),
                Take(T + 12 * S, vec![(0, 0)], 0, vec![(true, 10, 5, 2 * S, 0)]),
            ],
        ),
        (
            // A quota's refund goes to the period admission counted in, while the counter is
            // still in it: after midnight it gives nothing, so the new day is not inflated.
            "reserve_then_refund_quota",
            vec![quota(10, Per::Day)],
            vec![
                Take(NOON, vec![(0, 8)], 0, vec![(true, 10, 2, 12 * H, 0)]),
                Refund(NOON + H, 0, 5, 0),
                Take(NOON + H, vec![(0, 7)], 0, vec![(true, 10, 0, 11 * H, 0)]),
                // Midnight: a new period.
                Take(
                    NOON + 12 * H,
                    vec![(0, 4)],
                    0,
                    vec![(true, 10, 6, 24 * H, 0)],
                ),
                Refund(NOON + 12 * H, 0, 7, 2),
                Take(
                    NOON + 12 * H,
                    vec![(0, 0)],
                    0,
                    vec![(true, 10, 6, 24 * H, 0)],
                ),
                // More than was used: down to 0, never below.
                Refund(NOON + 12 * H, 0, 100, 3),
                Take(NOON + 12 * H, vec![(0, 0)], 0, vec![(true, 10, 10, 0, 0)]),
                Take(
                    NOON + 12 * H,
                    vec![(0, 10)],
                    0,
                    vec![(true, 10, 0, 24 * H, 0)],
                ),
            ],
        ),
        (
            // The optimistic mode on a quota: admission takes min_cost (1), the response's rest
            // is charged whatever the count, and refusals last until the period ends.
            "charge_quota",
            vec![quota(10, Per::Day)],
            vec![
                Take(NOON, vec![(0, 1)], 0, vec![(true, 10, 9, 12 * H, 0)]),
                Charge(NOON, 0, 20),
                Take(NOON, vec![(0, 1)], 0, vec![(false, 10, 0, 12 * H, 12 * H)]),
                Take(
                    NOON + 12 * H,
                    vec![(0, 1)],
                    0,
                    vec![(true, 10, 9, 24 * H, 0)],
                ),
            ],
        ),
        (
            "charge_window",
            vec![sw(5, 10 * S, 0)],
            vec![
                Take(T, vec![(0, 1)], 0, vec![(true, 5, 4, 10 * S, 0)]),
                Charge(T + S, 0, 6),
                // 7 units in the window, limit 5: refused until the sixth-newest leaves.
                Take(
                    T + 2 * S,
                    vec![(0, 1)],
                    0,
                    vec![(false, 5, 0, 9 * S, 9 * S)],
                ),
                Take(T + 11 * S, vec![(0, 1)], 0, vec![(true, 5, 4, 10 * S, 0)]),
            ],
        ),
        (
            "charge_window_two_million",
            vec![sw(10, 60 * S, 0)],
            vec![
                Take(T, vec![(0, 1)], 0, vec![(true, 10, 9, 60 * S, 0)]),
                Charge(T + S, 0, 2_000_000),
                // Charged at the same time: the same entry.
                Charge(T + S, 0, 3),
                // 2,000,004 units: the entry of T + 1 s frees enough at T + 61 s.
                Take(
                    T + 2 * S,
                    vec![(0, 1)],
                    0,
                    vec![(false, 10, 0, 59 * S, 59 * S)],
                ),
                Take(T + 60 * S, vec![(0, 1)], 0, vec![(false, 10, 0, S, S)]),
                Take(T + 61 * S, vec![(0, 1)], 0, vec![(true, 10, 9, 60 * S, 0)]),
            ],
        ),
    ]
}

#[tokio::test]
async fn leases_and_charges_follow_the_spec() {
    let redis = support::redis::RedisServer::start();
    let clock = Arc::new(ManualClock::new(T));
    let memory = MemoryStore::new(clock.clone(), 10_000);
    let remote = RedisStore::connect_with_test_clock(
        &redis.url(),
        Duration::from_secs(2),
        "leases:",
        clock.clone(),
    )
    .expect("redis store");
    assert!(remote.wait_ready(Duration::from_secs(10)).await);
    for (name, counters, ops) in lease_and_charge_cases().into_iter().chain(peek_cases()) {
        let keys: Vec<String> = (0..counters.len()).map(|i| format!("{name}:{i}")).collect();
        let mut taken: std::collections::HashMap<usize, Taken> = std::collections::HashMap::new();
        let check = |i: usize, cost: u64| Check {
            key: &keys[i],
            rule: &counters[i],
            cost,
            shadow: false,
            max_delay_us: None,
        };
        for (n, op) in ops.iter().enumerate() {
            match op {
                Op::Take(now, items, lease, outcomes) => {
                    clock.set(*now);
                    let checks: Vec<Check<'_>> = items.iter().map(|&(i, c)| check(i, c)).collect();
                    let want = expected(&step(*now, items, outcomes));
                    let local = memory.check_leased(&checks, *lease);
                    assert_eq!(answer(&local), want, "memory store, {name} op {n}");
                    let got = remote.check_leased(&checks, *lease).await.expect("redis");
                    assert_eq!(answer(&got), want, "redis store, {name} op {n}");
                    // Both engines name each consumption alike: a refund means the same on both.
                    assert_eq!(local.stamps, got.stamps, "stamps, {name} op {n}");
                    assert_eq!(got.stamps.len(), checks.len(), "{name} op {n}");
                    taken.insert(n, (items.clone(), got.stamps.to_vec()));
                }
                Op::Release(i, lease) => {
                    memory.release(&[check(*i, 1)], *lease);
                    remote
                        .release(&[check(*i, 1)], *lease, "")
                        .await
                        .expect("release");
                }
                Op::Renew(now, i, lease) => {
                    clock.set(*now);
                    memory.renew(&[check(*i, 1)], *lease);
                    remote.renew(&[check(*i, 1)], *lease).await.expect("renew");
                }
                Op::Charge(now, i, cost) => {
                    clock.set(*now);
                    memory.charge(&[check(*i, *cost)]);
                    remote.charge(&[check(*i, *cost)]).await.expect("charge");
                }
                Op::Peek(now, items, outcomes) => {
                    clock.set(*now);
                    let checks: Vec<Check<'_>> = items.iter().map(|&(i, c)| check(i, c)).collect();
                    let want = expected(&step(*now, items, outcomes));
                    assert_eq!(memory.peek(&checks), want, "memory peek, {name} op {n}");
                    let writes = redis_writes(&redis);
                    let got = remote.peek(&checks).await.expect("redis peek");
                    assert_eq!(got, want, "redis peek, {name} op {n}");
                    assert_eq!(
                        redis_writes(&redis),
                        writes,
                        "the peek wrote, {name} op {n}"
                    );
                }
                Op::Refund(now, i, cost, from) => {
                    clock.set(*now);
                    let (items, stamps) = taken.get(from).expect("a Take before the refund");
                    // A counter that Take did not check was never taken from: no stamp (0).
                    let stamp = items
                        .iter()
                        .position(|&(c, _)| c == *i)
                        .map_or(0, |at| stamps[at]);
                    let refund = [(check(*i, *cost), stamp)];
                    memory.refund(&refund);
                    remote.refund(&refund).await.expect("refund");
                }
            }
        }
    }
    // Every lease key expires on its own: a crashed instance's leases cannot outlive their TTL.
    for key in redis.keys() {
        let ttl: i64 = redis.cli(&["pttl", &key])[0].parse().expect("pttl");
        assert!(ttl > 0, "key {key} has no TTL ({ttl})");
    }
}

/// Issue 33 item 2: a response reporting 2,000,000 units on an exact window wrote one sorted-set
/// member per unit in one script call (4 s with Redis blocked, 235 MB). Now a charge of any size
/// writes one member: fast, and the key stays small.
#[tokio::test]
async fn a_charge_of_two_million_units_is_one_member_on_redis() {
    let redis = support::redis::RedisServer::start();
    let clock = Arc::new(ManualClock::new(T));
    let remote = RedisStore::connect_with_test_clock(
        &redis.url(),
        Duration::from_secs(5),
        "big:",
        clock.clone(),
    )
    .expect("redis store");
    assert!(remote.wait_ready(Duration::from_secs(10)).await);
    let rule = sw(10, 60 * S, 0);
    let check = |cost| Check {
        key: "k",
        rule: &rule,
        cost,
        shadow: false,
        max_delay_us: None,
    };
    for (now, cost) in [(T, 2_000_000), (T, 200_000), (T + S, 2_000_000)] {
        clock.set(now);
        let started = std::time::Instant::now();
        remote.charge(&[check(cost)]).await.expect("charge");
        let took = started.elapsed();
        assert!(
            took < Duration::from_millis(500),
            "a charge of {cost} took {took:?}"
        );
    }
    let keys = redis.keys();
    assert_eq!(keys, ["big:{k}:sw:2"]);
    // Two times, and the total.
    // One member per time, named with the units counted up to it, and the base (0).
    assert_eq!(
        redis.cli(&["zrange", &keys[0], "0", "-1", "withscores"]),
        [
            "n".to_string(),
            "-1".to_string(),
            format!("{T}#2200000"),
            T.to_string(),
            format!("{}#4200000", T + S),
            (T + S).to_string(),
        ]
    );
    let bytes: u64 = redis.cli(&["memory", "usage", &keys[0]])[0]
        .parse()
        .expect("memory usage");
    assert!(bytes < 1024, "the key takes {bytes} bytes");
    // The units still count, exactly: the later entry frees enough at T + 61 s.
    clock.set(T + 2 * S);
    let d = remote.check(&[check(1)]).await.expect("decision");
    assert_eq!((d.allowed, d.outcomes[0].retry_after_us), (false, 59 * S));
}

/// The refund entry (Redis Cluster, docs/redis.md) gives back exactly the units of one admitted
/// call from the member of its time, leaving the units other calls wrote at that time.
#[test]
fn an_exact_window_refund_gives_back_only_its_own_units() {
    let redis = support::redis::RedisServer::start();
    let script =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/decide.lua"))
            .expect("decide.lua");
    let eval = |args: &[&str]| {
        let mut all = vec!["eval", script.as_str(), "1", "rf{a}:sw:2"];
        all.extend_from_slice(args);
        redis.cli(&all)
    };
    let decide = |now: &str, cost: &str| eval(&[now, "sw", "5000000", "10000000", "0", cost, "0"]);
    let now = "1000000000000";
    assert_eq!(decide(now, "2000000")[0], "1");
    let second = decide(now, "1000000");
    assert_eq!(second[..4], ["1", "1", "5000000", "2000000"]);
    assert_eq!(second[6..], [now, "0"], "the stamp: the time written");
    // A later call, whose member counts the refunded units too.
    assert_eq!(decide("1000000000001", "5")[3], "1999995");
    let started = std::time::Instant::now();
    let done = eval(&["refund", "sw", "1000000", "0", &second[6], &second[7]]);
    assert_eq!(done, ["1"]);
    assert!(started.elapsed() < Duration::from_millis(500));
    assert_eq!(
        decide("1000000000001", "0")[3],
        "2999995",
        "the other calls' units stay"
    );
    assert_eq!(
        redis.cli(&["zrange", "rf{a}:sw:2", "0", "-1"]),
        ["n", "1000000000000#2000000", "1000000000001#2000005"]
    );
    // Once that time has left the window, a refund of it changes nothing.
    let later = "1000010000001";
    assert_eq!(decide(later, "3")[3], "4999997");
    assert_eq!(eval(&["refund", "sw", "2000000", "0", now, "0"]), ["1"]);
    assert_eq!(decide(later, "0")[3], "4999997");
    // The last units given back: the key is gone.
    assert_eq!(eval(&["refund", "sw", "3", "0", later, "0"]), ["1"]);
    assert_eq!(redis.cli(&["exists", "rf{a}:sw:2"]), ["0"]);
}

/// A call that fails on a later check's bad arguments still leaves an exact window's count right,
/// although the window's check had already removed its expired members.
#[test]
fn a_window_count_survives_a_call_refused_for_bad_arguments() {
    let redis = support::redis::RedisServer::start();
    let script =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/decide.lua"))
            .expect("decide.lua");
    let eval = |args: &[&str]| {
        let mut all = vec!["eval", script.as_str()];
        all.extend_from_slice(args);
        redis.cli(&all)
    };
    let window = ["sw", "5", "10000000", "0"];
    let reply = eval(
        &[
            &["1", "tot{a}:sw:2", "1000000000000"],
            &window[..],
            &["3", "0"],
        ]
        .concat(),
    );
    assert_eq!(reply[3], "2");
    let reply = eval(
        &[
            &["1", "tot{a}:sw:2", "1000005000000"],
            &window[..],
            &["1", "0"],
        ]
        .concat(),
    );
    assert_eq!(reply[3], "1");
    // The first entry has expired, the second not; the second check is of no known kind.
    let later = "1000010000001";
    let reply = eval(
        &[
            &["2", "tot{a}:sw:2", "tot{a}:x", later],
            &window[..],
            &["0", "0", "zz", "1", "1", "0", "1", "0"],
        ]
        .concat(),
    );
    assert!(reply.join(" ").contains("unknown kind"), "{reply:?}");
    // 1 unit in the window: 4 more fit.
    let reply = eval(&[&["1", "tot{a}:sw:2", later], &window[..], &["4", "0"]].concat());
    assert_eq!(reply[..4], ["1", "1", "5", "0"]);
}

/// A paced case (`on_limit: delay`): `Case` with each counter's `max_delay` (`None`: refuses at
/// once).
struct PacedCase {
    case: Case,
    max_delay_us: Vec<Option<u64>>,
}

/// Pacing (`docs/algorithms.md`, "Pacing"), worked out by hand: the slot of each algorithm, a
/// request admitted for later reserving there, the ones behind it queueing after it, the latest
/// slot of several policies, and a refusal's `retry_after` as the time until the latest slot
/// would be within `max_delay`.
fn paced_cases() -> Vec<PacedCase> {
    const MS: u64 = 1000;
    vec![
        PacedCase {
            // 10/s, burst 2, max_delay 300 ms: two at once, then one each 100 ms.
            case: Case {
                name: "paced_bucket_queues_at_its_rate",
                shadow: &[],
                counters: vec![tb(10.0, 2)],
                steps: vec![
                    one(T, 1, (true, 2, 1, 100 * MS, 0)),
                    one(T, 1, (true, 2, 0, 200 * MS, 0)),
                    delayed(T, &[(0, 1)], 100 * MS, &[(true, 2, 0, 200 * MS, 0)]),
                    delayed(T, &[(0, 1)], 200 * MS, &[(true, 2, 0, 200 * MS, 0)]),
                    delayed(T, &[(0, 1)], 300 * MS, &[(true, 2, 0, 200 * MS, 0)]),
                    // Its slot would be 400 ms away: 100 ms until it is within 300.
                    one(T, 1, (false, 2, 0, 200 * MS, 100 * MS)),
                    // 100 ms later it is.
                    delayed(
                        T + 100 * MS,
                        &[(0, 1)],
                        300 * MS,
                        &[(true, 2, 0, 200 * MS, 0)],
                    ),
                ],
            },
            max_delay_us: vec![Some(300 * MS)],
        },
        PacedCase {
            // 2 a second, exact: a slot is when the oldest entry leaves.
            case: Case {
                name: "paced_exact_window_takes_the_slot_the_oldest_frees",
                shadow: &[],
                counters: vec![sw(2, S, 0)],
                steps: vec![
                    one(T, 1, (true, 2, 1, S, 0)),
                    one(T + 250 * MS, 1, (true, 2, 0, S, 0)),
                    delayed(T + 500 * MS, &[(0, 1)], 500 * MS, &[(true, 2, 0, S, 0)]),
                    delayed(T + 500 * MS, &[(0, 1)], 750 * MS, &[(true, 2, 0, S, 0)]),
                    // Behind the two reserved, at T + 2 s: 1.5 s away, 0.5 s over the bound.
                    one(T + 500 * MS, 1, (false, 2, 0, S, 500 * MS)),
                ],
            },
            max_delay_us: vec![Some(S)],
        },
        PacedCase {
            // Two buckets of 500 ms: a slot is the start of the bucket that has room.
            case: Case {
                name: "paced_bucketed_window_takes_a_later_bucket",
                shadow: &[],
                counters: vec![sw(2, S, 2)],
                steps: vec![
                    one(T, 1, (true, 2, 1, 1500 * MS, 0)),
                    one(T, 1, (true, 2, 0, 1500 * MS, 0)),
                    delayed(T, &[(0, 1)], 1500 * MS, &[(true, 2, 1, 1500 * MS, 0)]),
                    delayed(T, &[(0, 1)], 1500 * MS, &[(true, 2, 0, 1500 * MS, 0)]),
                    one(T, 1, (false, 2, 0, 3 * S, S)),
                ],
            },
            max_delay_us: vec![Some(2 * S)],
        },
        PacedCase {
            // Two paced buckets (10/s and 2/s) and a window that does not pace: the request
            // waits for the slowest bucket's slot, every check takes it there or none does.
            case: Case {
                name: "paced_policies_wait_for_the_latest_slot_together",
                shadow: &[],
                counters: vec![tb(10.0, 1), tb(2.0, 1), sw(10, S, 0)],
                steps: vec![
                    step(
                        T,
                        &[(0, 1), (1, 1), (2, 1)],
                        &[
                            (true, 1, 0, 100 * MS, 0),
                            (true, 1, 0, 500 * MS, 0),
                            (true, 10, 9, S, 0),
                        ],
                    ),
                    delayed(
                        T + 100 * MS,
                        &[(0, 1), (1, 1), (2, 1)],
                        400 * MS,
                        &[
                            (true, 1, 0, 100 * MS, 0),
                            (true, 1, 0, 500 * MS, 0),
                            (true, 10, 8, S, 0),
                        ],
                    ),
                    delayed(
                        T + 100 * MS,
                        &[(0, 1), (1, 1), (2, 1)],
                        900 * MS,
                        &[
                            (true, 1, 0, 100 * MS, 0),
                            (true, 1, 0, 500 * MS, 0),
                            (true, 10, 8, S, 0),
                        ],
                    ),
                    // The slowest slot is 1.4 s away: both buckets refuse, nothing is taken.
                    step(
                        T + 100 * MS,
                        &[(0, 1), (1, 1), (2, 1)],
                        &[
                            (false, 1, 0, 100 * MS, 400 * MS),
                            (false, 1, 0, 500 * MS, 400 * MS),
                            (true, 10, 8, S, 0),
                        ],
                    ),
                    delayed(T + 100 * MS, &[(2, 1)], 0, &[(true, 10, 7, S, 0)]),
                ],
            },
            max_delay_us: vec![Some(S), Some(S), None],
        },
        PacedCase {
            // 2 a minute (Berlin), max_delay 5 s: refused in the last 5 s of a minute, a request
            // takes a unit of the next minute and waits for it; the next minute's count starts
            // from those reservations, and its limit still holds.
            case: Case {
                name: "paced_quota_waits_for_the_next_period",
                shadow: &[],
                counters: vec![quota(2, Per::Minute)],
                steps: vec![
                    one(MINUTE - 10 * S, 1, (true, 2, 1, 10 * S, 0)),
                    one(MINUTE - 10 * S, 1, (true, 2, 0, 10 * S, 0)),
                    // The next minute is 10 s away: 5 s until it is within max_delay.
                    one(MINUTE - 10 * S, 1, (false, 2, 0, 10 * S, 5 * S)),
                    // Reset: the next minute's end, from the slot.
                    delayed(MINUTE - 4 * S, &[(0, 1)], 4 * S, &[(true, 2, 1, 60 * S, 0)]),
                    delayed(MINUTE - 4 * S, &[(0, 1)], 4 * S, &[(true, 2, 0, 60 * S, 0)]),
                    // The next minute is full too: refused until this one ends.
                    one(MINUTE - 4 * S, 1, (false, 2, 0, 4 * S, 4 * S)),
                    // In the new minute the two reserved count: the one after is 60 s away.
                    one(MINUTE, 0, (true, 2, 0, 60 * S, 0)),
                    one(MINUTE, 1, (false, 2, 0, 60 * S, 55 * S)),
                    delayed(
                        MINUTE + 56 * S,
                        &[(0, 1)],
                        4 * S,
                        &[(true, 2, 1, 60 * S, 0)],
                    ),
                ],
            },
            max_delay_us: vec![Some(5 * S)],
        },
        PacedCase {
            // A day of Europe/Berlin: the next period's bounds are the zone's (24 h from
            // midnight, Berlin's), and a paced bucket beside the quota waits with it.
            case: Case {
                name: "paced_quota_day_and_bucket_wait_for_midnight_together",
                shadow: &[],
                counters: vec![quota(1, Per::Day), tb(1.0, 1)],
                steps: vec![
                    step(
                        MIDNIGHT - 3 * S,
                        &[(0, 1), (1, 1)],
                        &[(true, 1, 0, 3 * S, 0), (true, 1, 0, S, 0)],
                    ),
                    // The quota's slot is midnight, the bucket's 1 s from now: both at midnight.
                    delayed(
                        MIDNIGHT - 3 * S,
                        &[(0, 1), (1, 1)],
                        3 * S,
                        &[(true, 1, 0, 24 * H, 0), (true, 1, 0, S, 0)],
                    ),
                    // The next day is taken: refused until today ends, nothing consumed.
                    step(
                        MIDNIGHT - 2 * S,
                        &[(0, 1), (1, 1)],
                        &[(false, 1, 0, 2 * S, 2 * S), (true, 1, 0, S, 0)],
                    ),
                ],
            },
            max_delay_us: vec![Some(5 * S), Some(5 * S)],
        },
    ]
}

/// A minute boundary in Europe/Berlin (the quotas' zone), and a midnight there.
const MINUTE: u64 = 1_795_431_660_000_000;
const MIDNIGHT: u64 = 1_795_474_800_000_000;

fn paced_checks<'a>(paced: &'a PacedCase, keys: &'a [String], step: &Step) -> Vec<Check<'a>> {
    let mut checks = step_checks(&paced.case, keys, step);
    for (check, &(i, _)) in checks.iter_mut().zip(&step.checks) {
        check.max_delay_us = paced.max_delay_us[i];
    }
    checks
}

#[tokio::test]
async fn both_stores_pace_to_the_spec() {
    let redis = support::redis::RedisServer::start();
    let clock = Arc::new(ManualClock::new(T));
    let memory = MemoryStore::new(clock.clone(), 10_000);
    let remote = RedisStore::connect_with_test_clock(
        &redis.url(),
        Duration::from_secs(2),
        "paced:",
        clock.clone(),
    )
    .expect("redis store");
    assert!(remote.wait_ready(Duration::from_secs(10)).await);
    let mut steps = 0;
    for paced in paced_cases() {
        let case = &paced.case;
        let keys: Vec<String> = (0..case.counters.len())
            .map(|i| format!("{}:{i}", case.name))
            .collect();
        for (n, step) in case.steps.iter().enumerate() {
            clock.set(step.now);
            let checks = paced_checks(&paced, &keys, step);
            let want = expected(step);
            let from_memory = memory.check(&checks);
            let from_redis = remote.check(&checks).await.expect("redis decision");
            // The refund stamps are the reserve-and-settle spec's (checked there); here both
            // engines must give the same ones.
            assert_eq!(
                from_memory.stamps, from_redis.stamps,
                "stamps, {} step {n}",
                case.name
            );
            let unstamped = |d: Decision| Decision {
                stamps: Default::default(),
                ..d
            };
            assert_eq!(
                unstamped(from_memory),
                want,
                "memory, {} step {n}",
                case.name
            );
            assert_eq!(unstamped(from_redis), want, "redis, {} step {n}", case.name);
            steps += 1;
        }
        // Every key a paced decision wrote expires.
        for key in redis.cli(&["keys", "paced:*"]) {
            let ttl: i64 = redis.cli(&["pttl", &key])[0].parse().expect("pttl");
            assert!(ttl > 0, "{key} has no TTL ({ttl})");
        }
    }
    assert!(steps >= 20, "the paced suite lost its cases: {steps} steps");
}

/// A waiter that goes away gives its reservation back where the algorithm allows, on both
/// engines alike: a window its entry at the slot, a bucket only its latest reservation (one
/// behind it was placed from its state).
#[tokio::test]
async fn a_reservation_given_back_frees_its_slot_on_both_stores() {
    let redis = support::redis::RedisServer::start();
    let clock = Arc::new(ManualClock::new(T));
    let memory = MemoryStore::new(clock.clone(), 10_000);
    let remote = RedisStore::connect_with_test_clock(
        &redis.url(),
        Duration::from_secs(2),
        "unreserve:",
        clock.clone(),
    )
    .expect("redis store");
    assert!(remote.wait_ready(Duration::from_secs(10)).await);
    let bucket = tb(10.0, 1);
    let window = sw(1, S, 0);
    for (name, rule) in [("bucket", &bucket), ("window", &window)] {
        let check = Check {
            key: name,
            rule,
            cost: 1,
            shadow: false,
            max_delay_us: Some(10 * S),
        };
        let mut delays = Vec::new();
        let mut slots = Vec::new();
        for d in [
            memory.check(&[check]),
            remote.check(&[check]).await.expect("redis"),
        ] {
            assert!(d.allowed && d.delay_us == 0);
        }
        for _ in 0..2 {
            let m = memory.check(&[check]);
            let r = remote.check(&[check]).await.expect("redis");
            assert_eq!(m, r, "{name}");
            delays.push(m.delay_us);
            slots.push(m.slot_us);
        }
        // The earlier of the two waiters goes: a window frees its entry, so the next request
        // takes that slot; a bucket keeps it (the later waiter was placed behind it).
        memory.unreserve(&[(check, 0)], slots[0]);
        remote
            .unreserve(&[(check, 0)], slots[0])
            .await
            .expect("redis unreserve");
        let m = memory.check(&[check]);
        assert_eq!(m, remote.check(&[check]).await.expect("redis"), "{name}");
        let after_middle = m.delay_us;
        // The latest waiter goes: both give it back.
        memory.unreserve(&[(check, 0)], m.slot_us);
        remote
            .unreserve(&[(check, 0)], m.slot_us)
            .await
            .expect("redis unreserve");
        let again = memory.check(&[check]);
        assert_eq!(
            again,
            remote.check(&[check]).await.expect("redis"),
            "{name}"
        );
        assert_eq!(
            again.delay_us, after_middle,
            "{name}: the latest slot came back"
        );
        match name {
            "bucket" => {
                assert_eq!(delays, [100_000, 200_000]);
                assert_eq!(
                    after_middle, 300_000,
                    "a bucket keeps a slot behind which one waits"
                );
            }
            _ => {
                assert_eq!(delays, [S, 2 * S]);
                // The window's entry at 1 s is gone, but a new request still queues behind
                // the newest (2 s): slot 3 s. The freed unit lowers every later window's count.
                assert_eq!(after_middle, 3 * S, "{name}");
            }
        }
    }
}

/// A paced quota's reservation in the next period, given back when its waiter goes (the stamp
/// is that period's start): the next request takes it, on both engines alike; a stamp of a
/// period the counter has left gives nothing back.
#[tokio::test]
async fn a_paced_quota_gives_back_its_unit_of_the_next_period_on_both_stores() {
    let redis = support::redis::RedisServer::start();
    let clock = Arc::new(ManualClock::new(MINUTE - 3 * S));
    let memory = MemoryStore::new(clock.clone(), 10_000);
    let remote = RedisStore::connect_with_test_clock(
        &redis.url(),
        Duration::from_secs(2),
        "unreserve-q:",
        clock.clone(),
    )
    .expect("redis store");
    assert!(remote.wait_ready(Duration::from_secs(10)).await);
    let rule = quota(1, Per::Minute);
    let check = Check {
        key: "q",
        rule: &rule,
        cost: 1,
        shadow: false,
        max_delay_us: Some(5 * S),
    };
    let both = |what: &'static str| {
        let (memory, remote) = (&memory, &remote);
        async move {
            let m = memory.check(&[check]);
            let r = remote.check(&[check]).await.expect("redis");
            assert_eq!(m, r, "{what}");
            m
        }
    };
    assert_eq!(both("now").await.delay_us, 0);
    let waiter = both("the next minute").await;
    assert_eq!((waiter.delay_us, waiter.stamps[0]), (3 * S, MINUTE));
    assert!(!both("both minutes full").await.allowed);
    memory.unreserve(&[(check, waiter.stamps[0])], waiter.slot_us);
    remote
        .unreserve(&[(check, waiter.stamps[0])], waiter.slot_us)
        .await
        .expect("redis unreserve");
    let again = both("the unit came back").await;
    assert_eq!((again.allowed, again.delay_us), (true, 3 * S));
    // In the next minute the counter holds that reservation as used: the stamp of the minute
    // before gives nothing back.
    clock.set(MINUTE + S);
    memory.unreserve(&[(check, MINUTE - 60 * S)], 0);
    remote
        .unreserve(&[(check, MINUTE - 60 * S)], 0)
        .await
        .expect("redis unreserve");
    let full = both("the new minute is full").await;
    assert_eq!((full.allowed, full.outcomes[0].remaining), (false, 0));
    // Its own stamp still does.
    memory.unreserve(&[(check, MINUTE)], 0);
    remote
        .unreserve(&[(check, MINUTE)], 0)
        .await
        .expect("redis unreserve");
    assert_eq!(both("given back in its minute").await.delay_us, 0);
}

/// A paced quota on the script's plain ARGV (a Cluster's per-slot call, `wire::args`): its kind
/// is the next period's end, negated; the reservation lands in `x` and `xe` of the quota's hash.
#[test]
fn a_paced_quota_reserves_the_next_period_through_plain_argv() {
    let redis = support::redis::RedisServer::start();
    let script =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/decide.lua"))
            .expect("decide.lua");
    let now = (MINUTE - 2 * S).to_string();
    let kind = format!("-{}", MINUTE + 60 * S);
    let (start, end) = ((MINUTE - 60 * S).to_string(), MINUTE.to_string());
    let mode = (2 + 5 * S).to_string();
    let decide = || {
        redis.cli(&[
            "eval",
            &script,
            "1",
            "aq{a}:q:minute",
            &now,
            &kind,
            "1",
            &start,
            &end,
            "1",
            &mode,
        ])
    };
    assert_eq!(decide(), ["1", "1", "1", "0", "2000000", "0", &start, "0"]);
    // The minute is full: 2 s to the next one, within max_delay, counted there.
    let slot = MINUTE.to_string();
    assert_eq!(
        decide(),
        ["2000001", "1", "1", "0", "60000000", "0", &slot, &slot]
    );
    let hash = redis.cli(&["hgetall", "aq{a}:q:minute"]);
    let fields: std::collections::HashMap<_, _> = hash
        .chunks(2)
        .map(|pair| (pair[0].clone(), pair[1].clone()))
        .collect();
    assert_eq!(fields["n"], "1");
    assert_eq!(fields["x"], "1");
    assert_eq!(fields["xe"], (MINUTE + 60 * S).to_string());
    // Both minutes full: refused until this one ends.
    assert_eq!(
        decide(),
        ["0", "0", "1", "0", "2000000", "2000000", &start, "0"]
    );
}

/// One step of a lease queue case (`lease_queue`, decide.lua's "Waiting for a lease").
enum QueueOp {
    /// At `now`, decide one lease `lease` on the counter: allowed, and the leases left after.
    Take(u64, u64, bool, u64),
    /// At `now`, wait for lease `lease` for `max_delay`: granted at once (`true`) or queued.
    Enqueue(u64, u64, u64, bool),
    /// At `now`, release lease `lease`: the leases handed on, oldest ticket first.
    Release(u64, u64, Vec<u64>),
    /// At `now`, the waiter for lease `lease` gives up: the leases handed on (its own, when it
    /// had been handed one, goes to the next).
    Leave(u64, u64, Vec<u64>),
}

/// The hand-off on both engines: tickets are served oldest first; a released lease goes
/// straight to the next live ticket (a ticket past its deadline is skipped); a waiter that
/// leaves before its turn takes its ticket out, and one that leaves just after being handed the
/// lease hands it on; a lease that expired is handed on by the next enqueue, to those queued
/// first.
fn lease_queue_ops() -> Vec<QueueOp> {
    use QueueOp::*;
    vec![
        Take(T, 1, true, 1),
        Take(T, 2, true, 0),
        Take(T + S, 3, false, 0),
        Enqueue(T + S, 3, 5 * S, false),
        Enqueue(T + S, 4, 5 * S, false),
        // Its deadline is T + 2 s.
        Enqueue(T + S, 5, S, false),
        Release(T + S + S / 2, 1, vec![3]),
        // Still queued: it leaves, handed nothing.
        Leave(T + S + S / 2, 4, vec![]),
        // Lease 5's ticket is past its deadline: skipped, and the lease stays free.
        Release(T + 3 * S, 2, vec![]),
        Take(T + 3 * S, 6, true, 0),
        Enqueue(T + 3 * S, 7, 5 * S, false),
        Enqueue(T + 3 * S, 8, 5 * S, false),
        // Handed the lease, the waiter for 3 gives up at that moment: it goes to 7.
        Leave(T + 4 * S, 3, vec![7]),
        // Lease 6 expired at T + 13 s; 8's deadline (T + 8 s) passed: the enqueue takes it.
        Enqueue(T + 13 * S + S / 2, 9, 5 * S, true),
        Release(T + 14 * S, 7, vec![]),
        Take(T + 14 * S, 10, true, 0),
        Release(T + 14 * S, 9, vec![]),
        Release(T + 14 * S, 10, vec![]),
    ]
}

#[tokio::test]
async fn lease_queues_follow_the_spec() {
    use turnstile::limiter::lease_queue::Enqueued;
    let redis = support::redis::RedisServer::start();
    let clock = Arc::new(ManualClock::new(T));
    let memory = MemoryStore::new(clock.clone(), 10_000);
    let remote = RedisStore::connect_with_test_clock(
        &redis.url(),
        Duration::from_secs(2),
        "queue:",
        clock.clone(),
    )
    .expect("redis store");
    assert!(remote.wait_ready(Duration::from_secs(10)).await);
    let rule = cc(2, 10 * S);
    let key = "queue";
    let check = |cost: u64| Check {
        key,
        rule: &rule,
        cost,
        shadow: false,
        max_delay_us: None,
    };
    // Each waiter's tickets on the two engines, by lease id.
    let mut tickets: std::collections::HashMap<u64, (Ticket, Ticket)> = Default::default();
    let queued = |e: Enqueued| match e {
        Enqueued::Queued(ticket) => Some(ticket),
        Enqueued::Granted => None,
        Enqueued::Refused => panic!("refused to queue"),
    };
    for (n, op) in lease_queue_ops().into_iter().enumerate() {
        match op {
            QueueOp::Take(now, lease, allowed, remaining) => {
                clock.set(now);
                let local = memory.check_leased(&[check(1)], lease);
                let got = remote
                    .check_leased(&[check(1)], lease)
                    .await
                    .expect("redis");
                for (engine, d) in [("memory", &local), ("redis", &got)] {
                    let o = d.outcomes[0];
                    assert_eq!(
                        (o.allowed, o.remaining),
                        (allowed, remaining),
                        "{engine} op {n}"
                    );
                }
            }
            QueueOp::Enqueue(now, lease, max_delay, granted) => {
                clock.set(now);
                let local = queued(memory.enqueue(&check(1), lease, max_delay));
                let got = queued(
                    remote
                        .enqueue(&check(1), lease, max_delay)
                        .await
                        .expect("redis enqueue"),
                );
                assert_eq!(local.is_none(), granted, "memory op {n}");
                assert_eq!(got.is_none(), granted, "redis op {n}");
                if let (Some(local), Some(got)) = (local, got) {
                    tickets.insert(lease, (local, got));
                }
            }
            QueueOp::Release(now, lease, handed) => {
                clock.set(now);
                assert_eq!(memory.release(&[check(1)], lease), handed, "memory op {n}");
                let got = remote.release(&[check(1)], lease, "").await;
                assert_eq!(got.expect("redis release"), handed, "redis op {n}");
                woken(&mut tickets, &handed, n).await;
            }
            QueueOp::Leave(now, lease, handed) => {
                clock.set(now);
                let (_, ticket) = tickets.remove(&lease).expect("a queued waiter");
                assert_eq!(memory.leave(&check(1), lease), handed, "memory op {n}");
                let got = remote.release(&[check(1)], lease, ticket.name()).await;
                assert_eq!(got.expect("redis leave"), handed, "redis op {n}");
                woken(&mut tickets, &handed, n).await;
            }
        }
    }
    assert_eq!(memory.queued(), 0, "no ticket left in process");
    assert_eq!(
        redis.keys(),
        Vec::<String>::new(),
        "no lease and no queue left in Redis"
    );
}

use turnstile::limiter::lease_queue::Ticket;

/// Every waiter handed a lease is woken, on both engines (on Redis by its published id).
async fn woken(
    tickets: &mut std::collections::HashMap<u64, (Ticket, Ticket)>,
    handed: &[u64],
    n: usize,
) {
    for lease in handed {
        let (local, remote) = tickets.get_mut(lease).expect("a queued waiter");
        for (engine, ticket) in [("memory", local), ("redis", remote)] {
            let granted = tokio::time::timeout(Duration::from_secs(5), ticket.granted()).await;
            assert_eq!(granted, Ok(true), "{engine} op {n}: lease {lease} woken");
        }
    }
}
