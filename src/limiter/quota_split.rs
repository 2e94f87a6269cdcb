//! The split itself: a pool of whole tokens divided among members by demand, with a floor; and
//! for a pool too small to give every member a token, turns.

use super::ProxyId;

/// One member's share of the pool, tokens per fill interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    pub proxy: ProxyId,
    pub tokens: u32,
}

/// Divides `available` tokens among `members` (id, demand in requests per second): each gets
/// `floor` first (less when the pool cannot give every member that much: then an equal part),
/// the rest in proportion to demand (equally when no one has demand), by largest remainder, so
/// the targets sum to exactly `available` (never more).
pub fn targets(members: &[(ProxyId, f64)], available: u32, floor: u32) -> Vec<Target> {
    let n = members.len() as u32;
    if n == 0 {
        return Vec::new();
    }
    let floor = floor.min(available / n);
    let rest = available - floor * n;
    let demand: f64 = members.iter().map(|(_, d)| d.max(0.0)).sum();
    let weight = |d: f64| {
        if demand > 0.0 {
            d.max(0.0) / demand
        } else {
            1.0 / f64::from(n)
        }
    };
    let mut shares: Vec<(ProxyId, u32, f64)> = members
        .iter()
        .map(|(id, d)| {
            let exact = f64::from(rest) * weight(*d);
            let whole = exact.floor();
            (*id, floor + whole as u32, exact - whole)
        })
        .collect();
    let given: u32 = shares.iter().map(|(_, t, _)| t - floor).sum();
    let mut left = rest.saturating_sub(given);
    // Largest remainder first; ties by id, so the split is deterministic.
    let mut order: Vec<usize> = (0..shares.len()).collect();
    order.sort_by(|&a, &b| {
        shares[b]
            .2
            .total_cmp(&shares[a].2)
            .then(shares[a].0.cmp(&shares[b].0))
    });
    for i in order {
        if left == 0 {
            break;
        }
        shares[i].1 += 1;
        left -= 1;
    }
    shares
        .into_iter()
        .map(|(proxy, tokens, _)| Target { proxy, tokens })
        .collect()
}

/// A live member as [`turns`] sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Turn {
    pub proxy: ProxyId,
    /// Requests per second in its last report.
    pub demand: f64,
    /// It holds tokens now.
    pub holds: bool,
    /// Its bucket may change now (it has held it for `reassign_every`).
    pub may_yield: bool,
    /// When it last held tokens (0: never).
    pub served_us: u64,
}

/// Divides a pool of `available` tokens too small for every live member: the members with
/// demand get a token each and the rest by demand when there are tokens enough for them
/// (`targets` with a floor of 1); otherwise they take turns, one token each: a holder keeps its
/// token until it may yield, then the members that have waited longest (by `served_us`, ties by
/// id) take the tokens. Members without demand get nothing. The second value says whether the
/// members take turns.
pub fn turns(members: &[Turn], available: u32) -> (Vec<Target>, bool) {
    let wanting: Vec<&Turn> = members.iter().filter(|m| m.demand > 0.0).collect();
    let none = |proxy| Target { proxy, tokens: 0 };
    if wanting.len() <= available as usize {
        let split: Vec<(ProxyId, f64)> = wanting.iter().map(|m| (m.proxy, m.demand)).collect();
        let given = targets(&split, available, 1);
        let out = members
            .iter()
            .map(|m| {
                given
                    .iter()
                    .find(|t| t.proxy == m.proxy)
                    .copied()
                    .unwrap_or(none(m.proxy))
            })
            .collect();
        return (out, false);
    }
    // Holders that may not yield yet first, then whoever has waited longest; holders that may
    // yield last (they were served now).
    let mut order = wanting.clone();
    order.sort_by_key(|m| match (m.holds, m.may_yield) {
        (true, false) => (0, 0, m.proxy),
        (false, _) => (1, m.served_us, m.proxy),
        (true, true) => (2, 0, m.proxy),
    });
    let chosen: Vec<ProxyId> = order
        .iter()
        .take(available as usize)
        .map(|m| m.proxy)
        .collect();
    let out = members
        .iter()
        .map(|m| Target {
            proxy: m.proxy,
            tokens: u32::from(chosen.contains(&m.proxy)),
        })
        .collect();
    (out, true)
}
