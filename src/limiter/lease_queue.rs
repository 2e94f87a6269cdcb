//! Waiting for a concurrency lease (`on_limit: delay` on a concurrency policy, `docs/algorithms.md`
//! "Pacing"): the spec of decide.lua's `cc_hand_on`, `enqueue` and `release` entries, with the
//! in-process store's queue.
//!
//! A request that finds every lease held takes a ticket at the back of its key's queue. A lease
//! that comes free (released, or expired and found so) goes to the oldest ticket whose waiter is
//! still there and whose deadline has not passed, in the same atomic step as the release: the
//! lease is added under the waiter's id and the waiter is woken, so no lease is ever free while a
//! live waiter queues for it, and nobody polls. A waiter that gives up (its `max_delay` passed,
//! its client went away) takes its ticket out; if it was handed the lease at that moment, it
//! releases it, which hands it on.

use std::collections::VecDeque;

use tokio::sync::oneshot;

use super::leases::Leases;
use super::Concurrency;

/// What asking to wait for a lease gave.
#[derive(Debug)]
pub enum Enqueued {
    /// A lease was free (one came free since the refusing decision): it is held under the
    /// waiter's id now.
    Granted,
    /// Every lease is held: the waiter queues behind the tickets already there.
    Queued(Ticket),
    /// The store cannot queue on this key (the in-process store had no room for its counter):
    /// the refusal stands.
    Refused,
}

/// A waiter's place in a key's queue. [`Ticket::granted`] resolves when a release hands it the
/// lease; the waiter must leave the queue when it gives up (`Store::leave`).
#[derive(Debug)]
pub struct Ticket {
    woken: oneshot::Receiver<()>,
    /// The ticket as the Redis queue holds it (`lease:deadline:instance`); empty in process.
    pub(crate) name: String,
}

impl Ticket {
    pub(crate) fn new(woken: oneshot::Receiver<()>, name: String) -> Self {
        Ticket { woken, name }
    }

    /// The ticket as the store's queue names it (`lease:deadline:instance` on Redis; empty in
    /// process), for [`crate::limiter::Store::leave`].
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Resolves with `true` once the lease was handed to this waiter; `false` when the store
    /// dropped the ticket without a lease (the store went away).
    pub async fn granted(&mut self) -> bool {
        (&mut self.woken).await.is_ok()
    }
}

/// One waiter in the in-process queue of a key.
#[derive(Debug)]
pub struct Waiter {
    pub lease: u64,
    /// In the store's clock (µs): past it, the ticket is skipped.
    pub deadline_us: u64,
    pub wake: oneshot::Sender<()>,
}

/// Hands the leases free on `leases` to the oldest live waiters of `queue` (decide.lua's
/// `cc_hand_on`): each is added under the waiter's id and the waiter woken. Tickets whose
/// deadline passed or whose waiter is gone are dropped on the way. Returns how many waiters it
/// took off the queue (handed a lease or dropped) and the leases handed, oldest first.
pub(crate) fn hand_on(
    leases: &mut Leases,
    rule: &Concurrency,
    now: u64,
    queue: &mut VecDeque<Waiter>,
    handed: &mut Vec<u64>,
) -> usize {
    let mut taken = 0;
    while !queue.is_empty() {
        let plan = leases.eval(rule, now, 1);
        if !plan.allowed {
            break;
        }
        let Some(waiter) = queue.pop_front() else {
            break;
        };
        taken += 1;
        if waiter.deadline_us <= now || waiter.wake.is_closed() {
            continue;
        }
        leases.commit(rule, &plan, waiter.lease);
        if waiter.wake.send(()).is_err() {
            // Gone between the check and the send: the lease comes straight back.
            leases.release(waiter.lease);
            continue;
        }
        handed.push(waiter.lease);
    }
    taken
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULE: Concurrency = Concurrency {
        limit: 1,
        lease_ttl_us: 10_000_000,
    };

    fn waiter(lease: u64, deadline_us: u64) -> (Waiter, oneshot::Receiver<()>) {
        let (wake, woken) = oneshot::channel();
        let waiter = Waiter {
            lease,
            deadline_us,
            wake,
        };
        (waiter, woken)
    }

    #[test]
    fn a_free_lease_goes_to_the_oldest_live_waiter() {
        let mut leases = Leases::default();
        let plan = leases.eval(&RULE, 0, 1);
        leases.commit(&RULE, &plan, 1);
        let mut queue = VecDeque::new();
        let (late, _late_rx) = waiter(2, 5);
        let (gone, gone_rx) = waiter(3, 100);
        let (next, mut next_rx) = waiter(4, 100);
        let (last, mut last_rx) = waiter(5, 100);
        queue.extend([late, gone, next, last]);
        drop(gone_rx);
        let mut handed = Vec::new();
        assert_eq!(hand_on(&mut leases, &RULE, 10, &mut queue, &mut handed), 0);
        leases.release(1);
        assert_eq!(hand_on(&mut leases, &RULE, 10, &mut queue, &mut handed), 3);
        assert_eq!(handed, [4], "past its deadline, gone, then the next");
        assert!(next_rx.try_recv().is_ok());
        assert!(last_rx.try_recv().is_err(), "one lease, one waiter");
        assert_eq!((leases.held(10), queue.len()), (1, 1));
    }
}
