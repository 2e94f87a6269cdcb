//! The series every proxied request moves (its route's answer counter and latency histogram, its
//! policies' decision counters, the store's decision histogram, its upstream target's counters),
//! kept in per-thread stripes and folded into their Prometheus series when `/metrics` is
//! rendered ([`super::Metrics::render`]) or the handle is dropped.
//!
//! A Prometheus counter is one atomic word every worker writes: with two workers, each increment
//! moves its cache line from the other core first (a histogram's observation is four such
//! writes). A stripe is a cache line of its own per thread (threads share one only past
//! [`STRIPES`]), so a worker's increments stay in its own core's cache. The exported series are
//! the same Prometheus families, registered as before; they lag the stripes only between two
//! renders, which fold every stripe first, so `/metrics` always shows every request counted.

use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use prometheus::local::LocalHistogram;
use prometheus::{Histogram, IntCounter, IntGauge};

/// Stripes per handle: a thread writes stripe `its number % STRIPES`.
pub const STRIPES: usize = 8;

static NEXT_STRIPE: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static STRIPE: usize = NEXT_STRIPE.fetch_add(1, Ordering::Relaxed) % STRIPES;
}

#[inline]
fn stripe() -> usize {
    STRIPE.with(|s| *s)
}

/// One stripe on a cache line (or two: adjacent-line prefetch pairs them) of its own.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Padded<T>(T);

/// What a render folds: every striped handle alive.
pub(crate) trait Fold: Send + Sync + std::fmt::Debug {
    fn fold(&self);
}

/// The striped handles of one registry, folded by each render.
#[derive(Debug, Default)]
pub(crate) struct Folds(Mutex<Vec<Weak<dyn Fold>>>);

impl Folds {
    fn list(&self) -> MutexGuard<'_, Vec<Weak<dyn Fold>>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn add(&self, handle: Weak<dyn Fold>) {
        let mut list = self.list();
        // Handles of replaced configs go when they are dropped; forget them now and then, so
        // the list does not grow with reloads between renders.
        if list.len() >= 64 && list.len().is_power_of_two() {
            list.retain(|w| w.strong_count() > 0);
        }
        list.push(handle);
    }

    /// Folds every stripe of every live handle into its series.
    pub(crate) fn fold_all(&self) {
        self.list().retain(|w| match w.upgrade() {
            Some(handle) => {
                handle.fold();
                true
            }
            None => false,
        });
    }
}

/// `N` counters of one family, striped.
#[derive(Debug, Clone)]
pub struct Counters<const N: usize>(Arc<CountersInner<N>>);

#[derive(Debug)]
struct CountersInner<const N: usize> {
    base: [IntCounter; N],
    stripes: [Padded<[AtomicU64; N]>; STRIPES],
}

impl<const N: usize> Counters<N> {
    pub(crate) fn new(base: [IntCounter; N], folds: &Folds) -> Self {
        let inner = Arc::new(CountersInner {
            base,
            stripes: std::array::from_fn(|_| Padded(std::array::from_fn(|_| AtomicU64::new(0)))),
        });
        let weak: Weak<dyn Fold> = Arc::downgrade(&inner) as Weak<dyn Fold>;
        folds.add(weak);
        Counters(inner)
    }

    #[inline]
    pub fn inc(&self, i: usize) {
        self.inc_by(i, 1);
    }

    #[inline]
    pub fn inc_by(&self, i: usize, n: u64) {
        self.0.stripes[stripe()].0[i].fetch_add(n, Ordering::Relaxed);
    }

    /// Counter `i` so far, stripes included.
    pub fn get(&self, i: usize) -> u64 {
        let inner = &self.0;
        let striped: u64 = inner
            .stripes
            .iter()
            .map(|s| s.0[i].load(Ordering::Relaxed))
            .sum();
        inner.base[i].get() + striped
    }
}

impl<const N: usize> Fold for CountersInner<N> {
    fn fold(&self) {
        for stripe in &self.stripes {
            for (cell, base) in stripe.0.iter().zip(&self.base) {
                let n = cell.swap(0, Ordering::Relaxed);
                if n > 0 {
                    base.inc_by(n);
                }
            }
        }
    }
}

impl<const N: usize> Drop for CountersInner<N> {
    fn drop(&mut self) {
        self.fold();
    }
}

/// A gauge moved up and down by requests (in flight), striped: each stripe holds its
/// thread's net change.
#[derive(Debug, Clone)]
pub struct Gauge(Arc<GaugeInner>);

#[derive(Debug)]
struct GaugeInner {
    base: IntGauge,
    stripes: [Padded<AtomicI64>; STRIPES],
}

impl Gauge {
    pub(crate) fn new(base: IntGauge, folds: &Folds) -> Self {
        let inner = Arc::new(GaugeInner {
            base,
            stripes: std::array::from_fn(|_| Padded(AtomicI64::new(0))),
        });
        let weak: Weak<dyn Fold> = Arc::downgrade(&inner) as Weak<dyn Fold>;
        folds.add(weak);
        Gauge(inner)
    }

    #[inline]
    pub fn inc(&self) {
        self.0.stripes[stripe()].0.fetch_add(1, Ordering::Relaxed);
    }

    #[inline]
    pub fn dec(&self) {
        self.0.stripes[stripe()].0.fetch_sub(1, Ordering::Relaxed);
    }

    /// The gauge's value, stripes included.
    pub fn get(&self) -> i64 {
        let striped: i64 = self
            .0
            .stripes
            .iter()
            .map(|s| s.0.load(Ordering::Relaxed))
            .sum();
        self.0.base.get() + striped
    }
}

impl Fold for GaugeInner {
    fn fold(&self) {
        for stripe in &self.stripes {
            let n = stripe.0.swap(0, Ordering::Relaxed);
            if n != 0 {
                self.base.add(n);
            }
        }
    }
}

impl Drop for GaugeInner {
    fn drop(&mut self) {
        self.fold();
    }
}

/// A histogram, striped: each stripe a Prometheus local histogram (bucket counts, count and
/// sum as plain numbers) behind a lock only its thread takes but for a render's fold.
#[derive(Debug, Clone)]
pub struct Observations(Arc<ObservationsInner>);

#[derive(Debug)]
struct ObservationsInner {
    stripes: [Padded<Mutex<LocalHistogram>>; STRIPES],
}

impl Observations {
    pub(crate) fn new(base: &Histogram, folds: &Folds) -> Self {
        let inner = Arc::new(ObservationsInner {
            stripes: std::array::from_fn(|_| Padded(Mutex::new(base.local()))),
        });
        let weak: Weak<dyn Fold> = Arc::downgrade(&inner) as Weak<dyn Fold>;
        folds.add(weak);
        Observations(inner)
    }

    #[inline]
    pub fn observe(&self, v: f64) {
        lock(&self.0.stripes[stripe()].0).observe(v);
    }
}

fn lock(m: &Mutex<LocalHistogram>) -> MutexGuard<'_, LocalHistogram> {
    // A poisoned stripe only means a panic while it was held: its numbers are whole.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Fold for ObservationsInner {
    fn fold(&self) {
        for stripe in &self.stripes {
            lock(&stripe.0).flush();
        }
    }
}

// Each stripe's local histogram folds itself when dropped.

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::{HistogramOpts, Opts};

    #[test]
    fn every_thread_s_increments_reach_the_series_by_a_fold_or_a_drop() {
        let folds = Folds::default();
        let a = IntCounter::with_opts(Opts::new("a", "a")).unwrap();
        let b = IntCounter::with_opts(Opts::new("b", "b")).unwrap();
        let counters = Counters::new([a.clone(), b.clone()], &folds);
        std::thread::scope(|s| {
            for _ in 0..(STRIPES + 3) {
                let c = counters.clone();
                s.spawn(move || (0..1000).for_each(|_| c.inc(1)));
            }
        });
        counters.inc_by(0, 5);
        assert_eq!(counters.get(1), (STRIPES as u64 + 3) * 1000);
        assert_eq!(b.get(), 0, "not folded yet");
        folds.fold_all();
        assert_eq!((a.get(), b.get()), (5, (STRIPES as u64 + 3) * 1000));
        assert_eq!(counters.get(1), b.get());
        counters.inc(0);
        drop(counters);
        assert_eq!(a.get(), 6, "a dropped handle folds what it held");
        folds.fold_all();
        assert!(folds.list().is_empty());
    }

    #[test]
    fn a_gauge_s_moves_on_different_threads_net_out() {
        let folds = Folds::default();
        let base = IntGauge::new("g", "g").unwrap();
        let gauge = Gauge::new(base.clone(), &folds);
        gauge.inc();
        gauge.inc();
        let g = gauge.clone();
        std::thread::spawn(move || g.dec()).join().unwrap();
        assert_eq!(gauge.get(), 1);
        folds.fold_all();
        assert_eq!(base.get(), 1);
        assert_eq!(gauge.get(), 1);
    }

    #[test]
    fn observations_fold_into_the_histogram_s_buckets_count_and_sum() {
        let folds = Folds::default();
        let opts = HistogramOpts::new("h", "h").buckets(vec![0.1, 1.0]);
        let base = Histogram::with_opts(opts).unwrap();
        let obs = Observations::new(&base, &folds);
        obs.observe(0.05);
        let o = obs.clone();
        std::thread::spawn(move || o.observe(0.5)).join().unwrap();
        assert_eq!(base.get_sample_count(), 0);
        folds.fold_all();
        assert_eq!(base.get_sample_count(), 2);
        assert!((base.get_sample_sum() - 0.55).abs() < 1e-12);
        obs.observe(2.0);
        drop(obs);
        assert_eq!(
            base.get_sample_count(),
            3,
            "a dropped handle folds what it held"
        );
    }
}
