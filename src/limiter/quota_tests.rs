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
    // A new bucket has no credit yet: its first buckets wait for the tick after it is earned.
    assert_eq!(tokens(&shares), [(1, 0.0), (2, 0.0), (3, 0.0)]);
    shares.tick(now + S);
    // Equal at first: 30 less a reserve of ceil((6 + 3) / 5) = 2, as 10, 9, 9.
    let first: f64 = tokens(&shares).iter().map(|(_, t)| t).sum();
    assert_eq!(first, 28.0);
    // Demand 70/20/10: the changes wait for reassign_every after each member's first bucket.
    let later = now + 6 * S;
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
    shares.tick(now + S);
    let before = tokens(&shares);
    let pushes = shares
        .report(1, &key(), (BUDGET, 0), usage(100, 1), now + 2 * S)
        .unwrap();
    assert!(
        pushes
            .iter()
            .all(|p| matches!(p.action, Action::Assign { changed: false, .. })),
        "{pushes:?}"
    );
    assert_eq!(tokens(&shares), before);
    let pushes = shares.tick(now + 6 * S);
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
    shares.tick(now + S);
    // Member 1 took the whole pool; member 2 waits until member 1 may change again.
    shares
        .report(2, &key(), (BUDGET, 0), usage(1, 0), now + S)
        .unwrap();
    assert_eq!(tokens(&shares), [(1, 28.0), (2, 0.0)]);
    shares.tick(now + 6 * S);
    assert_eq!(tokens(&shares), [(1, 14.0), (2, 14.0)]);
    shares.disconnect(2);
    // Within its TTL (6 s from its last send) member 1 is not raised into member 2's tokens.
    shares.tick(now + 11 * S);
    assert_eq!(tokens(&shares), [(1, 14.0), (2, 14.0)]);
    // After it, member 2 is dropped and member 1 gets the pool less the reserve.
    shares.tick(now + 13 * S);
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
    shares.tick(now + S);
    let mut abandoned = false;
    for i in 1..=3 {
        let t = now + S + i * 5 * S;
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
    shares.set_lease(&key(), (12.0, 12.0), now + 4 * S, now);
    // Nothing until the lease has earned the first bucket's depth (2 tokens at 12/s).
    assert!(shares.tick(now).is_empty());
    let pushes = shares.tick(now + S / 4);
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
    let ask = &shares.lease_asks(now + S / 4)[0];
    assert!((ask.held - 11.0).abs() < 1e-9, "{ask:?}");
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

/// One proxy as Envoy 1.40's filter runs an assignment: a token bucket that starts full when it
/// differs from the one before (the same one sent again only extends its TTL), refilled at
/// `tokens_per_fill` per fill interval up to `max_tokens`, and nothing once its TTL has run out.
/// It spends every whole token at once: the most a proxy could admit.
#[derive(Debug, Default)]
struct Envoy {
    demand: f64,
    current: Option<Assignment>,
    expires_us: u64,
    tokens: f64,
    allowed: u64,
    wanted: f64,
    /// When it last held tokens, and the longest it went without them while wanting them.
    last_held_us: u64,
    longest_wait_us: u64,
    first_held_us: Option<u64>,
    reported: bool,
}

struct Sim {
    shares: Shares,
    budget: Budget,
    envoys: Vec<Envoy>,
    /// Admitted by all proxies in each step.
    admitted: Vec<u64>,
    now: u64,
}

const STEP: u64 = S / 10;

impl Sim {
    fn new(budget: Budget, demands: &[f64]) -> Sim {
        Sim {
            shares: Shares::new(timing(), false, 10, 0),
            budget,
            envoys: demands
                .iter()
                .map(|d| Envoy {
                    demand: *d,
                    ..Envoy::default()
                })
                .collect(),
            admitted: Vec::new(),
            // Past the hold-down.
            now: 7 * S,
        }
    }

    fn apply(&mut self, pushes: Vec<Push>) {
        for push in pushes {
            let e = &mut self.envoys[push.proxy as usize - 1];
            match push.action {
                Action::Assign {
                    assignment, ttl_s, ..
                } => {
                    let lapsed = e.expires_us <= self.now;
                    if lapsed || e.current != Some(assignment) {
                        e.tokens = f64::from(assignment.max_tokens());
                    }
                    e.current = Some(assignment);
                    e.expires_us = self.now + u64::from(ttl_s) * S;
                }
                Action::Abandon => e.current = None,
            }
        }
    }

    /// Runs `seconds`: a report from every proxy every 5 s (staggered), a tick a second.
    fn run(&mut self, seconds: u64) {
        let budget = self.budget;
        for _ in 0..seconds * 10 {
            let step = self.now / STEP;
            let mut admitted = 0;
            for e in &mut self.envoys {
                let live = e.expires_us > self.now;
                let (rate, depth) = match e.current {
                    Some(a) if live => (f64::from(a.tokens()), f64::from(a.max_tokens())),
                    _ => (0.0, 0.0),
                };
                e.tokens = (e.tokens + rate * 0.1).min(depth);
                if rate > 0.0 {
                    e.first_held_us.get_or_insert(self.now);
                    e.last_held_us = self.now;
                } else if e.demand > 0.0 {
                    let waited = self.now - e.last_held_us.max(7 * S);
                    e.longest_wait_us = e.longest_wait_us.max(waited);
                }
                e.wanted += e.demand * 0.1;
                if e.demand > 0.0 {
                    let spent = e.tokens.floor();
                    e.tokens -= spent;
                    e.allowed += spent as u64;
                    admitted += spent as u64;
                }
            }
            self.admitted.push(admitted);
            for i in 0..self.envoys.len() {
                let due = step % 50 == (i as u64 * 17) % 50;
                if !due {
                    continue;
                }
                let e = &mut self.envoys[i];
                // The first report comes with the first request; then every 5 s.
                let usage = if e.reported {
                    let requests = (e.wanted.round() as u64).max(e.allowed);
                    Usage {
                        allowed: e.allowed,
                        denied: requests - e.allowed,
                        elapsed_s: 5,
                    }
                } else {
                    Usage {
                        allowed: 0,
                        denied: u64::from(e.demand > 0.0),
                        elapsed_s: 0,
                    }
                };
                e.reported = true;
                e.allowed = 0;
                e.wanted = 0.0;
                let pushes = self
                    .shares
                    .report(i as u64 + 1, &key(), (budget, 0), usage, self.now)
                    .unwrap();
                self.apply(pushes);
            }
            if step.is_multiple_of(10) {
                let pushes = self.shares.tick(self.now);
                self.apply(pushes);
            }
            self.now += STEP;
        }
    }

    /// The most admitted in any window against rate × length + 2 × (burst + proxies).
    fn assert_bound(&self) {
        let slack = 2.0 * (f64::from(self.budget.burst) + self.envoys.len() as f64);
        for i in 0..self.admitted.len() {
            let mut sum = 0;
            for (j, a) in self.admitted[i..].iter().enumerate() {
                sum += a;
                let length = (j + 1) as f64 / 10.0;
                let bound = self.budget.rate * length + slack;
                assert!(
                    sum as f64 <= bound,
                    "{sum} admitted in {length} s from {i}: bound {bound}"
                );
            }
        }
    }

    fn total(&self) -> u64 {
        self.admitted.iter().sum()
    }
}

fn small(rate: f64, burst: u32) -> Budget {
    Budget {
        rate,
        burst,
        floor: 1.0,
    }
}

/// The most a proxy with demand waits for tokens with a small budget (docs/algorithms.md,
/// "Quota shares"): its first report (every 5 s), then ⌈wanting / tokens⌉ turns of
/// reassign_every, the fill interval the credit takes to pay a start, and a tick.
fn longest_wait(wanting: u64, tokens: u64) -> u64 {
    5 * S + wanting.div_ceil(tokens) * (5 + 1 + 1) * S
}

#[test]
fn a_small_budget_reaches_every_proxy_with_demand_within_the_bound() {
    for (rate, burst, demands) in [
        (1.0, 1, vec![5.0, 5.0]),
        (1.0, 5, vec![5.0]),
        (1.0, 5, vec![5.0, 2.0, 1.0]),
        (2.0, 1, vec![5.0, 5.0, 5.0]),
        (2.0, 5, vec![9.0, 1.0, 1.0]),
    ] {
        let mut sim = Sim::new(small(rate, burst), &demands);
        sim.run(90);
        sim.assert_bound();
        let pool = (rate as u64).max(1);
        let wait = longest_wait(demands.len() as u64, pool);
        for (i, e) in sim.envoys.iter().enumerate() {
            let case = format!("rate {rate}, burst {burst}, {demands:?}: proxy {i}: {e:?}");
            assert!(e.first_held_us.is_some(), "{case}");
            assert!(e.longest_wait_us <= wait, "{case}: waited past {wait}");
        }
        // Turns cost a token each at most: most of the budget is admitted.
        let total = sim.total() as f64;
        assert!(
            total >= 0.6 * rate * 90.0,
            "{rate} {burst} {demands:?}: {total}"
        );
    }
}

#[test]
fn a_large_budget_keeps_the_bound_as_demand_moves() {
    let mut sim = Sim::new(BUDGET, &[42.0, 12.0, 6.0]);
    sim.run(40);
    sim.envoys[0].demand = 6.0;
    sim.envoys[2].demand = 42.0;
    sim.run(40);
    sim.assert_bound();
    let total = sim.total() as f64;
    assert!(total >= 0.8 * 30.0 * 80.0, "{total}");
}
