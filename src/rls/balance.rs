//! Which serving thread gets a new connection, and when a thread sheds one.
//!
//! With several workers the listener runs one single-threaded runtime per worker
//! ([`super::grpc`]). Spreading connections evenly over them costs CPU when one thread would keep
//! up: each thread wakes for its own share of the calls, so every wake-up (an `epoll_wait`, a
//! context switch, a `writev`) answers fewer calls. Measured on the memory store with two
//! workers, the same load cost 15-20% more CPU per decision spread over two threads than on one
//! (`docs/benchmarks.md`, "Envoy RLS against Limitador", fourth pass).
//!
//! So connections are packed: a new connection goes to the first thread that keeps up (busy less
//! than [`KEEPS_UP`] of the last second), and only when none does, to the least busy one. Packing
//! alone would leave a thread that later saturates with connections it took while it was idle
//! (Envoy's connections live as long as Envoy), so a thread busy [`SATURATED`] or more with at
//! least two connections, while another keeps up, sheds one: that connection closes gracefully
//! (HTTP/2 GOAWAY, calls in flight finish) and its client reconnects, to the thread that keeps up.
//! gRPC clients (Envoy, tonic, grpc-go) reconnect on GOAWAY as they do for a server's maximum
//! connection age. At most one connection is shed per second.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::runtime::RuntimeMetrics;
use tokio::sync::Notify;

/// A thread whose busy share of the last second is below this takes new connections first.
pub(crate) const KEEPS_UP: f64 = 0.75;
/// A thread at least this busy sheds a connection when another thread keeps up.
pub(crate) const SATURATED: f64 = 0.95;
/// How often busy shares are sampled (and so the most often a connection is shed).
pub(crate) const SAMPLE_EVERY: Duration = Duration::from_secs(1);

/// One serving thread as the accept loop sees it.
#[derive(Debug)]
pub(crate) struct ThreadLoad {
    /// The thread's runtime: its busy time is the load.
    metrics: RuntimeMetrics,
    /// Connections the thread serves now (the accept loop adds, the thread subtracts).
    pub(crate) connections: Arc<AtomicUsize>,
    /// Notified to close one of the thread's connections gracefully.
    pub(crate) shed: Arc<Notify>,
    busy_before: Duration,
    /// Busy share of the last sample interval, 0 to 1.
    busy: f64,
}

impl ThreadLoad {
    pub(crate) fn new(metrics: RuntimeMetrics) -> Self {
        let busy_before = metrics.worker_total_busy_duration(0);
        ThreadLoad {
            metrics,
            connections: Arc::new(AtomicUsize::new(0)),
            shed: Arc::new(Notify::new()),
            busy_before,
            busy: 0.0,
        }
    }
}

/// The serving threads' loads, sampled by the accept loop every [`SAMPLE_EVERY`].
#[derive(Debug)]
pub(crate) struct Balancer {
    threads: Vec<ThreadLoad>,
    sampled_at: Instant,
}

impl Balancer {
    pub(crate) fn new(threads: Vec<ThreadLoad>) -> Self {
        Balancer {
            threads,
            sampled_at: Instant::now(),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.threads.len()
    }

    /// Forgets a thread that is gone (its runtime stopped); the others keep their order.
    pub(crate) fn remove(&mut self, thread: usize) {
        self.threads.remove(thread);
    }

    /// The thread for a new connection, counted as one of its connections.
    pub(crate) fn place(&mut self) -> usize {
        let thread = place(self.threads.iter().map(|t| t.busy));
        self.threads[thread]
            .connections
            .fetch_add(1, Ordering::Relaxed);
        thread
    }

    /// A connection that never reached `thread` (its thread is gone).
    pub(crate) fn unplace(&mut self, thread: usize) {
        self.threads[thread]
            .connections
            .fetch_sub(1, Ordering::Relaxed);
    }

    /// Samples each thread's busy share since the last sample and, when one is saturated while
    /// another keeps up, asks it to shed a connection. Returns the thread asked, if any.
    pub(crate) fn sample(&mut self) -> Option<usize> {
        let now = Instant::now();
        let elapsed = now.duration_since(self.sampled_at).as_secs_f64();
        self.sampled_at = now;
        if elapsed <= 0.0 {
            return None;
        }
        for t in &mut self.threads {
            let busy = t.metrics.worker_total_busy_duration(0);
            t.busy = (busy.saturating_sub(t.busy_before).as_secs_f64() / elapsed).min(1.0);
            t.busy_before = busy;
        }
        let loads = self
            .threads
            .iter()
            .map(|t| (t.busy, t.connections.load(Ordering::Relaxed)));
        tracing::trace!(loads = ?loads.clone().collect::<Vec<_>>(), "rate limit service threads");
        let thread = shed(loads)?;
        self.threads[thread].shed.notify_one();
        Some(thread)
    }
}

/// The first thread that keeps up, else the least busy (the first of equals).
fn place(busy: impl Iterator<Item = f64>) -> usize {
    let mut least = (0, f64::INFINITY);
    for (i, b) in busy.enumerate() {
        if b < KEEPS_UP {
            return i;
        }
        if b < least.1 {
            least = (i, b);
        }
    }
    least.0
}

/// The busiest saturated thread with a connection to spare, when another thread keeps up.
fn shed(loads: impl Iterator<Item = (f64, usize)> + Clone) -> Option<usize> {
    if !loads.clone().any(|(busy, _)| busy < KEEPS_UP) {
        return None;
    }
    let mut busiest: Option<(usize, f64)> = None;
    for (i, (busy, connections)) in loads.enumerate() {
        if busy >= SATURATED && connections >= 2 && busiest.is_none_or(|(_, b)| busy > b) {
            busiest = Some((i, busy));
        }
    }
    busiest.map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::{place, shed};

    #[test]
    fn new_connections_pack_onto_the_first_thread_that_keeps_up() {
        assert_eq!(place([0.0, 0.0].into_iter()), 0);
        assert_eq!(place([0.6, 0.0].into_iter()), 0);
        assert_eq!(place([0.8, 0.1].into_iter()), 1);
        assert_eq!(place([0.9, 0.8, 0.2].into_iter()), 2);
    }

    #[test]
    fn when_no_thread_keeps_up_the_least_busy_gets_it() {
        assert_eq!(place([0.9, 0.8].into_iter()), 1);
        assert_eq!(place([0.8, 0.8].into_iter()), 0);
        assert_eq!(place([1.0, 0.95, 0.97].into_iter()), 1);
    }

    #[test]
    fn a_saturated_thread_sheds_only_a_spare_connection_to_a_thread_that_keeps_up() {
        // Saturated with four connections, the other idle: shed one.
        assert_eq!(shed([(0.97, 4), (0.1, 0)].into_iter()), Some(0));
        // Its only connection would take all of its load along: keep it.
        assert_eq!(shed([(0.97, 1), (0.1, 0)].into_iter()), None);
        // Nobody keeps up: moving load around helps nobody.
        assert_eq!(shed([(0.97, 4), (0.9, 3)].into_iter()), None);
        // Busy but not saturated.
        assert_eq!(shed([(0.9, 4), (0.1, 0)].into_iter()), None);
        // The busiest of two saturated threads.
        assert_eq!(shed([(0.96, 2), (0.99, 3), (0.2, 1)].into_iter()), Some(1));
    }
}
