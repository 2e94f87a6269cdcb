//! Batching concurrent decisions: one script call carries the decisions of every request that
//! arrived while earlier calls were in flight (`scripts/decide.lua`, "Batch" and "Packed batch").
//!
//! Each decision stays all-or-nothing on its own: the script runs them one after another, each
//! seeing what the ones before consumed, exactly as if they had been separate calls in that
//! order. What a batch saves is Redis's per-call cost (parsing, the script's setup) and the
//! gateway's writes and reads: under load, tens of decisions share one `EVALSHA`.
//!
//! A request queues its decision and waits for its own reply. One task drains the queue: it takes
//! everything waiting (up to [`MAX_BATCH`]) as soon as one of [`MAX_IN_FLIGHT`] calls is free, so
//! an idle gateway sends each decision alone, at once, and a busy one sends bigger batches rather
//! than more calls. A decision whose caller has given up (its timeout passed, the client went
//! away) is dropped before the call is written, so a request that failed open never consumes later.
//! Used on one server (and Sentinel's master); a Cluster decides per slot (`cluster.rs`).
//!
//! Every decision ends by its deadline (`timeout` after it was queued) without a timer of its own:
//! a call answers all of its decisions with a timeout when the earliest deadline among them
//! passes, and keeps polling fred's command to its end; while every call is taken, one timer of
//! the draining task drops the queued decisions whose deadline has passed.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::{pin, Pin};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use fred::prelude::{Key, Value};
use smallvec::SmallVec;
use tokio::sync::{mpsc, oneshot};

use super::wire::{self, Packed};
use super::{Shared, StoreError};
use crate::limiter::engine::INLINE_CHECKS;
use crate::limiter::Decision;

/// Decisions in one script call at most (the script runs about 5 µs a decision, blocking Redis).
pub const MAX_BATCH: usize = 64;
/// Script calls in flight at once (fred pipelines them on the pool's connections). Under a burst
/// the first calls each carry one decision and their replies are read as late as the busy
/// runtime gets to them (tens of ms in a loaded debug build); with only two, the rest of the burst
/// waited that long for a free call before it was even sent, and timed out together (issue 34).
const MAX_IN_FLIGHT: usize = 8;

/// One request's decision, written once into one buffer: its arguments as
/// [`super::wire::pack`] writes them (`now`, the number of checks, then six per check), then its
/// keys one after another; and where its decision goes.
pub struct Job {
    pub wire: Vec<u8>,
    /// Where the packed arguments end and the first key starts in `wire`.
    pub packed_len: usize,
    /// Where each key ends in `wire` (one per check).
    pub key_ends: SmallVec<[usize; INLINE_CHECKS]>,
    pub deadline: Instant,
    pub reply: oneshot::Sender<Result<Decision, StoreError>>,
}

/// The queue of decisions waiting for a call.
pub struct Batcher {
    tx: mpsc::UnboundedSender<Job>,
}

impl Batcher {
    /// Starts the task that drains the queue; it ends when `shared` is dropped.
    /// Every decision's deadline is `timeout` after it is queued.
    pub fn start(
        shared: Weak<Shared>,
        timeout: Duration,
    ) -> (Batcher, impl std::future::Future<Output = ()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let start = move |jobs| shared.upgrade().map(|shared| call(shared, jobs));
        (Batcher { tx }, drain(start, timeout, rx))
    }

    /// Queues `job`; false when the draining task is gone (the store is shutting down).
    pub fn submit(&self, job: Job) -> bool {
        self.tx.send(job).is_ok()
    }
}

/// Takes the queue's decisions into calls made by `start` (`None`: the store is gone, stop).
async fn drain<F: Future<Output = ()>>(
    mut start: impl FnMut(Vec<Job>) -> Option<F>,
    timeout: Duration,
    mut rx: mpsc::UnboundedReceiver<Job>,
) {
    // The calls in flight are polled by this task itself: a task spawned per call would copy
    // the call's future (kilobytes) several times on its way in, for every batch.
    let mut slots: [_; MAX_IN_FLIGHT] = [
        pin!(None),
        pin!(None),
        pin!(None),
        pin!(None),
        pin!(None),
        pin!(None),
        pin!(None),
        pin!(None),
    ];
    // Decisions taken off the queue to be timed, oldest first, waiting for a free call.
    let mut held: VecDeque<Job> = VecDeque::new();
    // Armed while every call is taken: the calls in flight may be stalled past their deadlines,
    // and the decisions waiting behind them must still end by their own (see `expire`).
    let mut guard = pin!(tokio::time::sleep(Duration::ZERO));
    let mut armed = false;
    let mut open = true;
    std::future::poll_fn(move |cx| {
        for slot in &mut slots {
            poll_slot(slot, cx);
        }
        if armed && guard.as_mut().poll(cx).is_ready() {
            armed = false;
            expire(&mut rx, &mut held);
        }
        // A free call takes everything queued meanwhile: with none free, the queue waits (and
        // is not polled; a call that ends wakes this task).
        while open || !held.is_empty() {
            let Some(slot) = slots.iter_mut().find(|slot| slot.is_none()) else {
                break;
            };
            if held.is_empty() {
                match rx.poll_recv(cx) {
                    Poll::Ready(Some(first)) => held.push_back(first),
                    Poll::Ready(None) => {
                        open = false;
                        continue;
                    }
                    Poll::Pending => break,
                }
            }
            let mut jobs = Vec::with_capacity((held.len() + rx.len()).min(MAX_BATCH));
            let from_held = held.len().min(MAX_BATCH);
            jobs.extend(held.drain(..from_held));
            while jobs.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(job) => jobs.push(job),
                    Err(_) => break,
                }
            }
            let Some(call) = start(jobs) else {
                return Poll::Ready(());
            };
            slot.set(Some(call));
            poll_slot(slot, cx);
        }
        if !armed && slots.iter().all(|slot| slot.is_some()) {
            // Every decision queued from now on has a deadline after `timeout` from now; one
            // already held, its own.
            let at = held
                .front()
                .map_or_else(|| Instant::now() + timeout, |job| job.deadline);
            guard.as_mut().reset(tokio::time::Instant::from_std(at));
            armed = true;
            if guard.as_mut().poll(cx).is_ready() {
                cx.waker().wake_by_ref();
            }
        }
        if !open && held.is_empty() && slots.iter().all(|slot| slot.is_none()) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
}

/// Every call taken past the guard's deadline: the queue's decisions move to `held` (in order,
/// so the oldest deadline is first), and those whose deadline has passed are dropped unsent,
/// which their callers see as a timeout.
fn expire(rx: &mut mpsc::UnboundedReceiver<Job>, held: &mut VecDeque<Job>) {
    while let Ok(job) = rx.try_recv() {
        held.push_back(job);
    }
    let now = Instant::now();
    while held.front().is_some_and(|job| job.deadline <= now) {
        held.pop_front();
    }
}

/// Polls the call in `slot`, if any, and empties the slot once the call is over.
fn poll_slot<F: Future<Output = ()>>(slot: &mut Pin<&mut Option<F>>, cx: &mut Context<'_>) {
    if let Some(call) = slot.as_mut().as_pin_mut() {
        if call.poll(cx).is_ready() {
            slot.set(None);
        }
    }
}

/// One script call for `jobs`, each answered with its own part of the reply. However many they
/// are, the call is decide.lua's packed batch: the keys, then two arguments and one reply string,
/// where the plain form costs the client eight values to write and read per decision. The keys
/// are slices of one buffer: no allocation per key.
async fn call(shared: Arc<Shared>, mut jobs: Vec<Job>) {
    let now = Instant::now();
    jobs.retain(|job| job.deadline > now && !job.reply.is_closed());
    let Some(budget) = jobs.iter().map(|job| job.deadline - now).min() else {
        return;
    };
    let (mut packed_len, mut names_len, mut keys) = (0, 0, 0);
    for job in &jobs {
        packed_len += job.packed_len;
        names_len += job.wire.len() - job.packed_len;
        keys += job.key_ends.len();
    }
    let mut packed = Vec::with_capacity(packed_len);
    let mut names = Vec::with_capacity(names_len);
    let mut ends = Vec::with_capacity(keys);
    for job in &jobs {
        let (args, job_names) = job.wire.split_at(job.packed_len);
        packed.extend_from_slice(args);
        let base = names.len();
        names.extend_from_slice(job_names);
        ends.extend(job.key_ends.iter().map(|&end| base + end - job.packed_len));
    }
    let names = bytes::Bytes::from(names);
    let keys = || {
        let mut start = 0;
        ends.iter()
            .map(|&end| {
                let key = Key::from(names.slice(start..end));
                start = end;
                key
            })
            .collect()
    };
    let args = [
        Value::from_static_str("packed"),
        Value::Bytes(packed.into()),
    ];
    // One call site: the call's future is most of this task's size. It runs to its end even
    // when its decisions have been answered: fred's own timeout is what keeps a timed-out
    // command from being written later.
    let mut fred = pin!(shared.run_within::<Packed>(budget, || (keys(), args.to_vec())));
    // The decisions' own timer: fred's command timeout does not always hold (a stalled server;
    // `decisions_queued_behind_a_stalled_redis_wait_at_most_the_timeout`).
    let mut expiry = pin!(tokio::time::sleep_until(tokio::time::Instant::from_std(
        now + budget
    )));
    let result = std::future::poll_fn(|cx| match fred.as_mut().poll(cx) {
        Poll::Ready(result) => Poll::Ready(Some(result)),
        Poll::Pending => expiry.as_mut().poll(cx).map(|()| None),
    })
    .await;
    let Some(result) = result else {
        for job in jobs {
            let _ = job.reply.send(Err(StoreError::Timeout(shared.timeout)));
        }
        let _ = fred.await;
        return;
    };
    match result {
        Ok(Packed(reply)) => answer(jobs, &reply),
        Err(e) => {
            for job in jobs {
                let _ = job.reply.send(Err(same(&e)));
            }
        }
    }
}

/// Answers each of `jobs` with its part of a packed `reply`: `1 + 7n` doubles each, in order. A
/// reply of any other total length answers none of them.
fn answer(jobs: Vec<Job>, reply: &[u8]) {
    let part = |job: &Job| 8 * (1 + 7 * job.key_ends.len());
    let expected: usize = jobs.iter().map(part).sum();
    let mut at = 0;
    for job in jobs {
        let len = part(&job);
        let decision = match reply.get(at..at + len) {
            Some(bytes) if reply.len() == expected => {
                wire::decode_packed(bytes, job.key_ends.len())
            }
            _ => Err(StoreError::Script(format!(
                "decide.lua answered {} bytes for a batch of {expected}",
                reply.len()
            ))),
        };
        at += len;
        let _ = job.reply.send(decision);
    }
}

/// The same failure, for each decision of a batch that failed as a whole.
fn same(e: &StoreError) -> StoreError {
    match e {
        StoreError::Timeout(d) => StoreError::Timeout(*d),
        StoreError::Connection(s) => StoreError::Connection(s.clone()),
        StoreError::Script(s) => StoreError::Script(s.clone()),
        StoreError::CircuitOpen => StoreError::CircuitOpen,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(timeout: Duration) -> (Job, oneshot::Receiver<Result<Decision, StoreError>>) {
        let (reply, answer) = oneshot::channel();
        let job = Job {
            wire: Vec::new(),
            packed_len: 0,
            key_ends: SmallVec::new(),
            deadline: Instant::now() + timeout,
            reply,
        };
        (job, answer)
    }

    /// Each decision reads its own part of the reply; a reply one decision short answers none.
    #[test]
    fn a_packed_reply_is_split_by_decision_and_must_be_whole() {
        let decision =
            |allowed: f64, remaining: f64| [allowed, allowed, 10.0, remaining, 5.0, 0.0, 0.0, 0.0];
        let bytes =
            |values: &[f64]| -> Vec<u8> { values.iter().flat_map(|v| v.to_le_bytes()).collect() };
        let two = || {
            let (mut a, ra) = job(Duration::from_secs(1));
            let (mut b, rb) = job(Duration::from_secs(1));
            a.key_ends.push(0);
            b.key_ends.push(0);
            (vec![a, b], ra, rb)
        };
        let (jobs, mut ra, mut rb) = two();
        let mut reply = decision(1.0, 7.0).to_vec();
        reply.extend(decision(0.0, 3.0));
        answer(jobs, &bytes(&reply));
        let a = ra.try_recv().expect("answered").expect("decided");
        let b = rb.try_recv().expect("answered").expect("decided");
        assert!(a.allowed && !b.allowed);
        assert_eq!((a.outcomes[0].remaining, b.outcomes[0].remaining), (7, 3));

        let (jobs, mut ra, mut rb) = two();
        answer(jobs, &bytes(&decision(1.0, 7.0)));
        assert!(matches!(ra.try_recv(), Ok(Err(StoreError::Script(_)))));
        assert!(matches!(rb.try_recv(), Ok(Err(StoreError::Script(_)))));
    }

    /// With every call stalled past its deadline (a call that never ends), the decisions queued
    /// behind them end by their own deadline, unsent.
    #[tokio::test]
    async fn decisions_queued_behind_calls_that_never_end_end_by_their_deadline() {
        const TIMEOUT: Duration = Duration::from_millis(200);
        let (tx, rx) = mpsc::unbounded_channel();
        let started = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let calls = started.clone();
        let start = move |jobs: Vec<Job>| {
            calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Some(async move {
                let _unanswered = jobs;
                std::future::pending::<()>().await
            })
        };
        tokio::spawn(drain(start, TIMEOUT, rx));
        let mut stalled = Vec::new();
        for _ in 0..MAX_IN_FLIGHT {
            let (job, answer) = job(TIMEOUT);
            tx.send(job).expect("drain runs");
            stalled.push(answer);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let sent = Instant::now();
        let mut queued = Vec::new();
        for _ in 0..3 {
            let (job, answer) = job(TIMEOUT);
            tx.send(job).expect("drain runs");
            queued.push(answer);
        }
        for answer in queued {
            let waited = tokio::time::timeout(TIMEOUT * 3, answer).await;
            assert!(
                matches!(waited, Ok(Err(_))),
                "a queued decision was not dropped by its deadline"
            );
        }
        let took = sent.elapsed();
        // Not before the deadline; well before the stalled calls (which never end). The slack is
        // for a loaded CI machine.
        assert!(took >= TIMEOUT && took < TIMEOUT * 2, "{took:?}");
        assert_eq!(
            started.load(std::sync::atomic::Ordering::Relaxed),
            MAX_IN_FLIGHT,
            "no call was started for the queued decisions"
        );
        drop(stalled);
    }
}
