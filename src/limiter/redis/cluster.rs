//! Redis Cluster: a request whose counters live in different slots.
//!
//! A script call may only touch keys of one slot, so all-or-nothing cannot be one call. Each
//! counter's key is hash-tagged, so each counter is atomic in its own slot; a request whose
//! counters share a slot stays one `EVALSHA`, exactly as on one server. Otherwise the checks are
//! grouped by slot and every group is called concurrently (one round trip in wall time). Each
//! group consumes only when all of its own checks allow, so no counter ever goes over its limit.
//! When any group rejects (or fails), the groups that consumed are refunded at once with the
//! script's refund entry, one more concurrent round trip, before the decision is returned. Until
//! the refund lands, a concurrent request may find those units taken and be rejected: a spurious
//! rejection, never an admission over a limit. `docs/redis.md` states this to users.

use fred::prelude::Key;
use fred::util::redis_keyslot;
use futures_util::future::join_all;

use super::{wire, RedisStore};
use crate::limiter::{Check, Decision, StoreError};

/// A consumption to give back: the check's index and the script's stamp for it.
type Consumed = (usize, [i64; 2]);

/// Checks `checks` on a Cluster: one call when they share a slot, else one per slot plus refunds.
pub(super) async fn check(
    store: &RedisStore,
    checks: &[Check<'_>],
    lease: u64,
) -> Result<Decision, StoreError> {
    let keys: Vec<String> = checks.iter().map(|c| store.redis_key(c)).collect();
    let slots: Vec<u16> = keys.iter().map(|k| redis_keyslot(k.as_bytes())).collect();
    if slots.iter().all(|s| *s == slots[0]) {
        let reply = store
            .shared
            .run(|| {
                let keys = keys.iter().map(|k| Key::from(k.as_str()));
                (keys.collect(), store.args(checks, lease))
            })
            .await?;
        return wire::decode(&reply, checks.len());
    }
    // Groups of check indexes, by slot, in order of first appearance.
    let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
    for (i, slot) in slots.iter().enumerate() {
        match groups.iter_mut().find(|(s, _)| s == slot) {
            Some((_, members)) => members.push(i),
            None => groups.push((*slot, vec![i])),
        }
    }
    let now = store.shared.test_clock.as_ref().map(|c| c.now_us());
    let calls = groups.iter().map(|(_, members)| {
        let (keys, subset) = (&keys, subset(checks, members));
        async move {
            let reply = store
                .shared
                .run(|| {
                    let keys = members.iter().map(|&i| Key::from(keys[i].as_str()));
                    (keys.collect(), wire::args(now, &subset, lease))
                })
                .await?;
            wire::decode(&reply, subset.len()).map(|d| (d, reply))
        }
    });
    let replies = join_all(calls).await;

    let mut outcomes = vec![None; checks.len()];
    // What was consumed, to give back if the request is not admitted.
    let mut consumed: Vec<Consumed> = Vec::new();
    let mut error = None;
    for ((_, members), reply) in groups.iter().zip(replies) {
        match reply {
            Ok((decision, reply)) => {
                for (j, &i) in members.iter().enumerate() {
                    if decision.commits(j) && checks[i].cost > 0 {
                        consumed.push((i, wire::stamp(&reply, members.len(), j)));
                    }
                    outcomes[i] = Some(decision.outcomes[j]);
                }
            }
            Err(e) => error = error.or(Some(e)),
        }
    }
    let decision = match error {
        Some(e) => Err(e),
        None => match outcomes.into_iter().collect::<Option<Vec<_>>>() {
            Some(outcomes) => Ok(Decision::from_checks(checks, outcomes)),
            None => Err(StoreError::Script("a check without an outcome".to_string())),
        },
    };
    match decision {
        Ok(decision) if decision.allowed => Ok(decision),
        Ok(mut decision) => {
            refund(store, checks, &keys, &consumed).await;
            // The request was not admitted: report what is left without it.
            for (i, _) in &consumed {
                let o = &mut decision.outcomes[*i];
                o.remaining = (o.remaining + checks[*i].cost).min(o.limit);
            }
            Ok(decision)
        }
        Err(e) => {
            refund(store, checks, &keys, &consumed).await;
            Err(e)
        }
    }
}

fn subset<'a>(checks: &[Check<'a>], members: &[usize]) -> Vec<Check<'a>> {
    members.iter().map(|&i| checks[i]).collect()
}

/// Gives back every consumption in `consumed` (check index, stamp), one concurrent call per slot,
/// each bounded by the store timeout. A refund that fails leaves those units taken until the
/// counter refills or its window passes: fewer admissions, never more.
async fn refund(store: &RedisStore, checks: &[Check<'_>], keys: &[String], consumed: &[Consumed]) {
    if consumed.is_empty() {
        return;
    }
    let mut groups: Vec<(u16, Vec<Consumed>)> = Vec::new();
    for &(i, stamp) in consumed {
        let slot = redis_keyslot(keys[i].as_bytes());
        match groups.iter_mut().find(|(s, _)| *s == slot) {
            Some((_, members)) => members.push((i, stamp)),
            None => groups.push((slot, vec![(i, stamp)])),
        }
    }
    let calls = groups.iter().map(|(_, members)| {
        let entries: Vec<(Check<'_>, [i64; 2])> =
            members.iter().map(|&(i, s)| (checks[i], s)).collect();
        async move {
            store
                .shared
                .run(|| {
                    let keys = members.iter().map(|&(i, _)| Key::from(keys[i].as_str()));
                    (keys.collect(), wire::refund_args(&entries))
                })
                .await
        }
    });
    for result in join_all(calls).await {
        if let Err(e) = result {
            tracing::debug!(error = %e, "refund of a multi-slot request failed");
        }
    }
}
