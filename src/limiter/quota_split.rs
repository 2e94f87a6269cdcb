//! The split itself: a pool of whole tokens divided among members by demand, with a floor.

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
