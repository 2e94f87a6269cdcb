use std::time::Duration;

use super::*;

const S: u64 = 1_000_000;

fn timing() -> Timing {
    Timing {
        ttl_s: 6,
        reassign_every: Duration::from_secs(5),
        fill_interval_s: 1,
        abandon_after: 3,
    }
}

const BUDGET: Budget = Budget {
    rate: 30.0,
    burst: 6,
    floor: 1.0,
};

fn key() -> BucketKey {
    vec![("name".to_owned(), "api".to_owned())].into()
}

fn usage(requests: u64, elapsed_s: u64) -> Usage {
    Usage {
        allowed: requests / 2,
        denied: requests - requests / 2,
        elapsed_s,
    }
}

fn tokens(shares: &Shares) -> Vec<(ProxyId, f64)> {
    let mut v = shares.view().pop().map(|v| v.shares).unwrap_or_default();
    v.sort_by_key(|(id, _)| *id);
    v
}

#[test]
fn targets_split_the_pool_exactly_by_demand_above_the_floor() {
    let t = targets(&[(1, 42.0), (2, 12.0), (3, 6.0)], 28, 1);
    let got: Vec<u32> = t.iter().map(|t| t.tokens).collect();
    // 25 above the floors, 70/20/10: 17.5, 5, 2.5; the largest remainders take the last one.
    assert_eq!(got, [19, 6, 3]);
    assert_eq!(
        targets(&[(1, 0.0), (2, 0.0)], 7, 1)
            .iter()
            .map(|t| t.tokens)
            .sum::<u32>(),
        7
    );
    // A pool too small for every floor: an equal part each, never more than the pool.
    let small = targets(&[(1, 9.0), (2, 1.0), (3, 1.0)], 2, 5);
    assert_eq!(small.iter().map(|t| t.tokens).sum::<u32>(), 2);
}

#[test]
fn nothing_is_handed_out_during_the_hold_down_after_a_start() {
    let shares = Shares::new(timing(), false, 10, 0);
    let pushes = shares
        .report(1, &key(), (BUDGET, 0), usage(1, 0), S)
        .unwrap();
    assert!(pushes.is_empty(), "{pushes:?}");
    // After one TTL (and the delivery margin), the first assignment goes out.
    let pushes = shares.tick(7 * S);
    assert_eq!(pushes.len(), 1, "{pushes:?}");
}

#[test]
fn the_pool_less_the_reserve_goes_out_by_demand() {
    let shares = Shares::new(timing(), false, 10, 0);
    let now = 10 * S;
    for proxy in 1..=3 {
        shares
            .report(proxy, &key(), (BUDGET, 0), usage(1, 0), now)
            .unwrap();
    }
    // Equal at first: 30 less a reserve of ceil((6 + 3) / 5) = 2, as 10, 9, 9.
    let first: f64 = tokens(&shares).iter().map(|(_, t)| t).sum();
    assert_eq!(first, 28.0);
    // Demand 70/20/10: the changes wait for reassign_every after each member's first bucket.
    let later = now + 5 * S;
    for (proxy, requests) in [(1, 210), (2, 60), (3, 30)] {
        shares
            .report(proxy, &key(), (BUDGET, 0), usage(requests, 5), later)
            .unwrap();
    }
    // The first report moved member 1 against the others' older demand; one reassign_every
    // later every member is at its share.
    shares.tick(later + 5 * S);
    assert_eq!(tokens(&shares), [(1, 19.0), (2, 6.0), (3, 3.0)]);
}

#[test]
fn a_member_changes_at_most_once_per_reassign_every() {
    let shares = Shares::new(timing(), false, 10, 0);
    let now = 10 * S;
    shares
        .report(1, &key(), (BUDGET, 0), usage(1, 0), now)
        .unwrap();
    shares
        .report(2, &key(), (BUDGET, 0), usage(1, 0), now)
        .unwrap();
    let before = tokens(&shares);
    let pushes = shares
        .report(1, &key(), (BUDGET, 0), usage(100, 1), now + S)
        .unwrap();
    assert!(
        pushes
            .iter()
            .all(|p| matches!(p.action, Action::Assign { changed: false, .. })),
        "{pushes:?}"
    );
    assert_eq!(tokens(&shares), before);
    let pushes = shares.tick(now + 5 * S);
    assert!(pushes
        .iter()
        .any(|p| matches!(p.action, Action::Assign { changed: true, .. })));
}

#[test]
fn a_vanished_members_share_is_held_until_its_ttl_ends() {
    let shares = Shares::new(timing(), false, 10, 0);
    let now = 10 * S;
    shares
        .report(1, &key(), (BUDGET, 0), usage(1, 0), now)
        .unwrap();
    // Member 1 took the whole pool; member 2 waits until member 1 may change again.
    shares
        .report(2, &key(), (BUDGET, 0), usage(1, 0), now)
        .unwrap();
    assert_eq!(tokens(&shares), [(1, 28.0), (2, 0.0)]);
    shares.tick(now + 5 * S);
    assert_eq!(tokens(&shares), [(1, 14.0), (2, 14.0)]);
    shares.disconnect(2);
    // Within its TTL (6 s from its last send) member 1 is not raised into member 2's tokens.
    shares.tick(now + 10 * S);
    assert_eq!(tokens(&shares), [(1, 14.0), (2, 14.0)]);
    // After it, member 2 is dropped and member 1 gets the pool less the reserve.
    shares.tick(now + 12 * S);
    assert_eq!(tokens(&shares), [(1, 28.0)]);
}

#[test]
fn an_idle_member_is_abandoned_and_its_share_returned() {
    let shares = Shares::new(timing(), false, 10, 0);
    let now = 10 * S;
    shares
        .report(1, &key(), (BUDGET, 0), usage(1, 0), now)
        .unwrap();
    shares
        .report(2, &key(), (BUDGET, 0), usage(1, 0), now)
        .unwrap();
    let mut abandoned = false;
    for i in 1..=3 {
        let t = now + i * 5 * S;
        shares
            .report(1, &key(), (BUDGET, 0), usage(50, 5), t)
            .unwrap();
        let pushes = shares
            .report(2, &key(), (BUDGET, 0), usage(0, 5), t)
            .unwrap();
        abandoned |= pushes
            .iter()
            .any(|p| p.proxy == 2 && p.action == Action::Abandon);
    }
    assert!(abandoned);
    assert_eq!(tokens(&shares), [(1, 28.0)]);
}

#[test]
fn the_sum_out_never_passes_the_pool_as_demand_moves() {
    let shares = Shares::new(timing(), false, 10, 0);
    let mut now = 10 * S;
    let pattern = [
        [90u64, 5, 5],
        [5, 90, 5],
        [5, 5, 90],
        [30, 30, 30],
        [0, 100, 1],
    ];
    for step in 0..60 {
        let demand = pattern[(step / 6) % pattern.len()];
        for (i, d) in demand.iter().enumerate() {
            shares
                .report(i as u64 + 1, &key(), (BUDGET, 0), usage(*d * 5, 5), now)
                .unwrap();
        }
        shares.tick(now);
        let out: f64 = tokens(&shares).iter().map(|(_, t)| t).sum();
        assert!(out <= 28.0, "step {step}: {:?}", tokens(&shares));
        now += S;
    }
}

#[test]
fn a_lease_bounds_the_pool_and_the_ttl() {
    let shares = Shares::new(timing(), true, 10, 0);
    let now = 10 * S;
    // No lease yet: nothing out.
    assert!(shares
        .report(1, &key(), (BUDGET, 0), usage(1, 0), now)
        .unwrap()
        .is_empty());
    shares.set_lease(&key(), 12.0, now + 4 * S);
    let pushes = shares.tick(now);
    // 12 less a reserve of ceil((6 * 12/30 + 1) / 5) = 1; TTL cut to the lease's 3 whole seconds.
    assert_eq!(
        pushes[0].action,
        Action::Assign {
            assignment: Assignment::Bucket {
                tokens_per_fill: 11,
                max_tokens: 2
            },
            ttl_s: 3,
            changed: true
        }
    );
    let ask = &shares.lease_asks(now)[0];
    assert!((ask.held - 12.0).abs() < 1e-9, "{ask:?}");
}

#[test]
fn no_bucket_past_max_buckets() {
    let shares = Shares::new(timing(), false, 1, 0);
    shares
        .report(1, &key(), (BUDGET, 0), usage(1, 0), S)
        .unwrap();
    let other: BucketKey = vec![("name".to_owned(), "b".to_owned())].into();
    assert_eq!(
        shares.report(1, &other, (BUDGET, 0), usage(1, 0), S),
        Err(Untracked::Full)
    );
}
