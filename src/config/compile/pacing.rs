//! Pacing settings: a policy's `on_limit: delay` and `max_delay`, a route's `max_waiting`
//! (`docs/algorithms.md`, "Pacing").

use super::Errors;
use crate::config::raw::{RawPolicy, RawRoute};
use crate::config::snapshot::Policy;
use crate::config::units::parse_duration;

/// The longest `max_delay`: an hour. A waiting request holds a connection and memory; anything
/// longer is a queue, not a rate.
const MAX_DELAY_S: u64 = 3600;

/// `max_waiting` when a route does not say.
pub const DEFAULT_MAX_WAITING: usize = 1000;

/// The most `max_waiting` may be on one route.
const MAX_WAITING: usize = 1_000_000;

/// `on_limit: refuse | delay` with `max_delay`, into [`Policy::max_delay_us`].
pub(super) fn on_limit(e: &mut Errors, path: &str, raw: &RawPolicy, policy: &mut Policy) {
    let delay = match raw.on_limit.as_deref() {
        None | Some("refuse") => false,
        Some("delay") => true,
        Some(other) => {
            e.add(
                format!("{path}.on_limit"),
                format!("`{other}` is not an answer to a limit; expected `refuse` or `delay`"),
            );
            return;
        }
    };
    match (delay, &raw.max_delay) {
        (false, None) => {}
        (false, Some(_)) => e.add(
            format!("{path}.max_delay"),
            "applies only with `on_limit: delay`",
        ),
        (true, None) => e.add(
            format!("{path}.on_limit"),
            "`delay` needs `max_delay`: the longest a request may wait (`2s`)",
        ),
        (true, Some(text)) => {
            let field = format!("{path}.max_delay");
            let Some(max) = e.take(field.clone(), parse_duration(text)) else {
                return;
            };
            if max.is_zero()
                || max.as_secs() > MAX_DELAY_S
                || max.as_secs_f64() > MAX_DELAY_S as f64
            {
                e.add(
                    field,
                    format!("must be more than 0ms and at most {MAX_DELAY_S}s"),
                );
                return;
            }
            if policy.response_cost.is_some() {
                e.add(
                    format!("{path}.on_limit"),
                    "`delay` is not supported with a cost from the response: a settled charge or \
                     refund would move a slot already handed out; pace with a policy of its own",
                );
                return;
            }
            // Every algorithm paces: a bucket or window reserves its slot, a quota a unit of its
            // next period, a concurrency policy waits for a lease (`admission::wait_for_lease`).
            policy.max_delay_us = Some(max.as_micros() as u64);
        }
    }
}

/// A route's `max_waiting` (default [`DEFAULT_MAX_WAITING`]); an error only where it is set
/// badly or to no purpose.
pub(super) fn max_waiting(e: &mut Errors, path: &str, raw: &RawRoute) -> usize {
    let delays = raw
        .policies
        .iter()
        .any(|p| p.on_limit.as_deref() == Some("delay"));
    // A request waits for one lease at a time: two concurrency policies that wait would each
    // hold a lease while waiting for the other's.
    let waiting_leases = raw
        .policies
        .iter()
        .enumerate()
        .filter(|(_, p)| p.concurrency.is_some() && p.on_limit.as_deref() == Some("delay"))
        .map(|(i, _)| i)
        .collect::<Vec<_>>();
    if let [_, second, ..] = waiting_leases[..] {
        e.add(
            format!("{path}.policies[{second}].on_limit"),
            "a route waits for at most one concurrency policy's lease; let the others refuse",
        );
    }
    match raw.max_waiting {
        None => DEFAULT_MAX_WAITING,
        Some(_) if !delays => {
            e.add(
                format!("{path}.max_waiting"),
                "applies only to a route with a policy that has `on_limit: delay`",
            );
            DEFAULT_MAX_WAITING
        }
        Some(n) if n == 0 || n > MAX_WAITING => {
            e.add(
                format!("{path}.max_waiting"),
                format!("must be 1-{MAX_WAITING}"),
            );
            DEFAULT_MAX_WAITING
        }
        Some(n) => n,
    }
}
