use super::*;

const S: u64 = 1_000_000;

fn tb(rate: f64, burst: u64) -> TokenBucket {
    TokenBucket { rate, burst }
}

fn sw(limit: u64, window_us: u64, buckets: u32) -> SlidingWindow {
    SlidingWindow {
        limit,
        window_us,
        buckets,
    }
}

/// Evaluates and, when allowed, commits: one request against one bucket.
fn take(state: &mut BucketState, rule: &TokenBucket, now: u64, cost: u64) -> Outcome {
    let (mut next, outcome) = state.evaluate(rule, now, cost);
    if outcome.allowed {
        next.consume(cost);
        *state = next;
    }
    outcome
}

fn log_take(log: &mut WindowLog, rule: &SlidingWindow, now: u64, cost: u64) -> Outcome {
    let (at, outcome) = log.evaluate(rule, now, cost);
    if outcome.allowed {
        log.consume(at, cost);
    }
    outcome
}

fn buckets_take(b: &mut WindowBuckets, rule: &SlidingWindow, now: u64, cost: u64) -> Outcome {
    let (current, outcome) = b.evaluate(rule, now, cost);
    if outcome.allowed {
        b.consume(current, cost);
    }
    outcome
}

#[test]
fn bucket_starts_full_and_refuses_past_burst() {
    let rule = tb(1.0, 3);
    let mut s = BucketState::full(&rule, 0);
    let got: Vec<bool> = (0..4).map(|_| take(&mut s, &rule, 0, 1).allowed).collect();
    assert_eq!(got, [true, true, true, false]);
}

#[test]
fn bucket_outcome_fields_follow_the_spec() {
    let rule = tb(2.0, 4); // one token every 500 ms
    let mut s = BucketState::full(&rule, 0);
    let o = take(&mut s, &rule, 0, 3);
    assert_eq!(
        o,
        Outcome {
            allowed: true,
            limit: 4,
            remaining: 1,
            reset_us: 1_500_000,
            retry_after_us: 0
        }
    );
    // 1 token left; cost 2 needs one more token: 500 ms.
    let o = take(&mut s, &rule, 0, 2);
    assert_eq!(
        o,
        Outcome {
            allowed: false,
            limit: 4,
            remaining: 1,
            reset_us: 1_500_000,
            retry_after_us: 500_000
        }
    );
    // 250 ms later: 1.5 tokens; still not enough, 250 ms to go.
    let o = take(&mut s, &rule, 250_000, 2);
    assert!(!o.allowed);
    assert_eq!(o.retry_after_us, 250_000);
    assert!(take(&mut s, &rule, 500_000, 2).allowed);
}

#[test]
fn bucket_keeps_fractions_so_a_steady_stream_is_not_starved() {
    // 3 tokens/s means a token every 333_333.33 µs. A request every 333_334 µs is (barely)
    // slower than the refill, so once the burst is spent every request must still pass: a store
    // that rounded tokens down at each step would starve this stream.
    let rule = tb(3.0, 1);
    let mut s = BucketState::full(&rule, 0);
    assert!(take(&mut s, &rule, 0, 1).allowed);
    for i in 1..=3_000u64 {
        assert!(
            take(&mut s, &rule, i * 333_334, 1).allowed,
            "request {i} starved"
        );
    }
}

#[test]
fn bucket_refill_caps_at_burst() {
    let rule = tb(10.0, 5);
    let mut s = BucketState::full(&rule, 0);
    for _ in 0..5 {
        take(&mut s, &rule, 0, 1);
    }
    let o = take(&mut s, &rule, 3_600 * S, 1);
    assert_eq!(o.remaining, 4);
    assert!(s.is_idle(&rule, 3_600 * S + S));
}

#[test]
fn bucket_ignores_a_clock_that_steps_back() {
    let rule = tb(1.0, 2);
    let mut s = BucketState::full(&rule, 10 * S);
    take(&mut s, &rule, 10 * S, 2);
    // A reading from before the last write must not refill (nor panic).
    let o = take(&mut s, &rule, 5 * S, 1);
    assert!(!o.allowed);
    assert_eq!(o.retry_after_us, S);
    assert!(take(&mut s, &rule, 11 * S, 1).allowed);
}

#[test]
fn bucket_cost_over_burst_never_passes_and_says_so() {
    let rule = tb(1.0, 2);
    let s = BucketState::full(&rule, 0);
    let (_, o) = s.evaluate(&rule, 0, 3);
    assert!(!o.allowed);
    assert_eq!(o.retry_after_us, o.reset_us);
}

#[test]
fn bucket_cost_zero_checks_without_consuming() {
    let rule = tb(1.0, 1);
    let mut s = BucketState::full(&rule, 0);
    assert_eq!(take(&mut s, &rule, 0, 0).remaining, 1);
    assert_eq!(take(&mut s, &rule, 0, 1).remaining, 0);
    let o = take(&mut s, &rule, 0, 0);
    assert!(
        o.allowed,
        "a check of cost 0 passes even on an empty bucket"
    );
    assert_eq!(o.remaining, 0);
}

#[test]
fn window_log_has_no_boundary_burst() {
    // 3 per second. Three at t=0.9 s; at t=1.1 s (a fixed window would have reset) all three are
    // still inside the sliding second.
    let rule = sw(3, S, 0);
    let mut log = WindowLog::default();
    for _ in 0..3 {
        assert!(log_take(&mut log, &rule, 900_000, 1).allowed);
    }
    let o = log_take(&mut log, &rule, 1_100_000, 1);
    assert!(!o.allowed);
    assert_eq!(o.retry_after_us, 800_000, "the first entry leaves at 1.9 s");
    assert_eq!(o.reset_us, 800_000);
    // Exactly when the entries leave the window (ts <= now - window), they free room.
    assert!(log_take(&mut log, &rule, 1_900_000, 1).allowed);
}

#[test]
fn window_log_retry_after_waits_for_enough_entries() {
    let rule = sw(4, 10 * S, 0);
    let mut log = WindowLog::default();
    for t in [0, S, 2 * S, 3 * S] {
        log_take(&mut log, &rule, t, 1);
    }
    // Cost 3 with 4 in the window needs the three oldest gone: the one at 2 s leaves at 12 s.
    let (_, o) = log.evaluate(&rule, 5 * S, 3);
    assert!(!o.allowed);
    assert_eq!(o.retry_after_us, 7 * S);
    assert_eq!(o.remaining, 0);
    assert_eq!(o.reset_us, 8 * S);
}

#[test]
fn window_log_is_exact_under_a_dense_stream() {
    // Any window of 1 s holds at most 10 admitted requests.
    let rule = sw(10, S, 0);
    let mut log = WindowLog::default();
    let mut admitted = Vec::new();
    for i in 0..5_000u64 {
        let now = i * 1_237; // not aligned to anything
        if log_take(&mut log, &rule, now, 1).allowed {
            admitted.push(now);
        }
    }
    for (i, &start) in admitted.iter().enumerate() {
        let inside = admitted[i..].iter().take_while(|&&t| t < start + S).count();
        assert!(
            inside <= 10,
            "{inside} admitted in the second starting at {start}"
        );
    }
    assert!(
        admitted.len() >= 60,
        "the window must admit again once it slides"
    );
}

#[test]
fn window_buckets_never_admit_more_than_the_log() {
    let exact = sw(10, S, 0);
    let coarse = sw(10, S, 10);
    let mut log = WindowLog::default();
    let mut buckets = WindowBuckets::default();
    let (mut by_log, mut by_buckets) = (0, 0);
    let mut admitted = Vec::new();
    for i in 0..20_000u64 {
        let now = i * 733;
        by_log += log_take(&mut log, &exact, now, 1).allowed as u64;
        if buckets_take(&mut buckets, &coarse, now, 1).allowed {
            by_buckets += 1;
            admitted.push(now);
        }
    }
    assert!(by_buckets <= by_log, "{by_buckets} > {by_log}");
    for (i, &start) in admitted.iter().enumerate() {
        assert!(admitted[i..].iter().take_while(|&&t| t < start + S).count() <= 10);
    }
    assert!(by_buckets > 0);
}

#[test]
fn window_buckets_outcome_fields_follow_the_spec() {
    // 10 buckets of 100 ms; limit 2.
    let rule = sw(2, S, 10);
    let mut b = WindowBuckets::default();
    assert!(buckets_take(&mut b, &rule, 50_000, 1).allowed); // bucket 0
    let o = buckets_take(&mut b, &rule, 150_000, 1); // bucket 1
    assert_eq!(o.remaining, 0);
    // Newest bucket 1 leaves when floor(now/w) - 10 > 1, at (1 + 11) * 100 ms.
    assert_eq!(o.reset_us, 1_200_000 - 150_000);
    let o = buckets_take(&mut b, &rule, 200_000, 1);
    assert!(!o.allowed);
    // Bucket 0 (counted whole) leaves at 1.1 s.
    assert_eq!(o.retry_after_us, 1_100_000 - 200_000);
    assert!(!buckets_take(&mut b, &rule, 1_099_999, 1).allowed);
    assert!(buckets_take(&mut b, &rule, 1_100_000, 1).allowed);
}

#[test]
fn idle_states_are_recognised() {
    let rule = sw(1, S, 0);
    let mut log = WindowLog::default();
    assert!(log.is_idle(&rule, 0));
    log_take(&mut log, &rule, 0, 1);
    assert!(!log.is_idle(&rule, S - 1));
    assert!(log.is_idle(&rule, S));
}

#[test]
fn window_log_keeps_one_entry_per_time_whatever_the_units() {
    let rule = sw(5_000_000, 10 * S, 0);
    let mut log = WindowLog::default();
    log.consume(S, 2_000_000);
    log.consume(S, 1_000_000);
    assert_eq!(log.entries(), 1, "units at one time are one entry");
    // Stepped back: recorded at the newest time, in its entry.
    let (at, o) = log.evaluate(&rule, S / 2, 1);
    assert_eq!((at, o.remaining), (S, 1_999_999));
    log.consume(at, 1);
    assert_eq!(log.entries(), 1);
    log.consume(2 * S, 7);
    assert_eq!(log.entries(), 2);
    // The entry of 1 s leaves at 11 s, taking its 3,000,001 units out of the count.
    let plan = log.eval(&rule, 11 * S, 0);
    assert_eq!((plan.count, log.entries()), (7, 1));
    let plan = log.eval(&rule, 12 * S, 0);
    assert_eq!((plan.count, log.entries()), (0, 0));
    assert!(log.is_idle(&rule, 12 * S));
}

#[test]
fn window_log_retry_after_walks_units_across_entries() {
    let rule = sw(10, 10 * S, 0);
    let mut log = WindowLog::default();
    for (t, units) in [(0, 3), (S, 2), (2 * S, 4), (3 * S, 1)] {
        assert!(log_take(&mut log, &rule, t, units).allowed);
    }
    // 10 held: 6 more need 3 + 2 + 4 units gone, the entry of 2 s leaving at 12 s.
    let (_, o) = log.evaluate(&rule, 4 * S, 6);
    assert_eq!(
        (o.allowed, o.retry_after_us, o.reset_us),
        (false, 8 * S, 9 * S)
    );
    // Exactly the units of the first two entries: the second's time.
    let (_, o) = log.evaluate(&rule, 4 * S, 5);
    assert_eq!(o.retry_after_us, 7 * S);
    // Past the limit after a charge: only the entry that brings the count low enough counts.
    log.consume(3 * S, 100);
    let (_, o) = log.evaluate(&rule, 4 * S, 1);
    assert_eq!((o.allowed, o.retry_after_us), (false, 9 * S));
    // More than the limit never passes: a whole window.
    let (_, o) = log.evaluate(&rule, 4 * S, 11);
    assert_eq!(o.retry_after_us, 10 * S);
}
