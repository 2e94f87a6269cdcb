//! What the writes a proxied request makes to data every worker shares cost from one thread and
//! from two at once: the same operation, the same number of times per thread, timed alone and
//! then with a second thread doing the same on the same data (paired, interleaved rounds; the
//! median of the rounds is printed). A ratio near 1.0 means the second worker costs the first
//! nothing; well above it, the two threads bounce the data's cache line between their cores.
//!
//! The operations are the hot path's own: a reference count taken and dropped on one `Arc` (the
//! state a request holds), one Prometheus counter and histogram shared by both threads (what a
//! route's answer was counted in before its series were striped), a route's response counter
//! and latency histogram as they are now (`RouteMetrics::record_response`), a policy's decision
//! counter, and the in-process store's decision on one key (every request from one client) and
//! on a key per thread.
//!
//! cargo run --release --example shared_writes -- [OPS_PER_THREAD] [ROUNDS]
//!
//! Bounded: OPS_PER_THREAD operations (default 2,000,000) per thread per case and round (default
//! 5), each case at most 30 s a round. Needs 2 cores to mean anything; the ratio is sensitive to
//! other load (state the load average with the figures).

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use turnstile::limiter::{Check, MemoryStore, MonotonicClock, Rule, TokenBucket};
use turnstile::metrics::{DecisionLabel, Metrics};

const RULE: Rule = Rule::TokenBucket(TokenBucket {
    rate: 1e9,
    burst: 1_000_000_000,
});

type Op = Arc<dyn Fn(usize, u64) + Send + Sync>;

#[derive(Default)]
#[repr(align(128))]
struct Padded(std::sync::atomic::AtomicU64);

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let ops: u64 = args.next().map_or(Ok(2_000_000), |a| a.parse())?;
    let rounds: usize = args.next().map_or(Ok(5), |a| a.parse())?;

    let metrics = Metrics::new();
    let route = Arc::new(metrics.route("bench"));
    route.register();
    let policy = Arc::new(metrics.policy("bench", "never_trips"));
    policy.register();
    let shared = Arc::new(0u64);
    let counter = prometheus::IntCounter::new("c", "c")?;
    let histogram = prometheus::Histogram::with_opts(prometheus::HistogramOpts::new("h", "h"))?;
    let store = Arc::new(MemoryStore::new(Arc::new(MonotonicClock::new()), 100_000));

    let own: Arc<[Padded; 2]> = Arc::new([Padded::default(), Padded::default()]);
    let cases: Vec<(&str, Op)> = vec![
        ("own_counter_per_thread", {
            // The control: an atomic add on a line no other thread writes.
            let own = own.clone();
            Arc::new(move |t, _| {
                own[t.min(1)]
                    .0
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            })
        }),
        ("arc_clone_drop", {
            let shared = shared.clone();
            Arc::new(move |_, _| drop(black_box(shared.clone())))
        }),
        ("prometheus_counter_and_histogram", {
            // What `record_response` did before its series were striped: one shared counter and
            // one shared histogram.
            let (counter, histogram) = (counter.clone(), histogram.clone());
            Arc::new(move |_, i| {
                counter.inc();
                histogram.observe((i % 7) as f64 * 1e-4);
            })
        }),
        ("route_record_response", {
            let route = route.clone();
            Arc::new(move |_, i| route.record_response(200, (i % 7) as f64 * 1e-4))
        }),
        ("policy_record", {
            let policy = policy.clone();
            Arc::new(move |_, _| policy.record(DecisionLabel::Allowed))
        }),
        ("store_one_key", {
            let store = store.clone();
            Arc::new(move |_, _| {
                black_box(store.check(&[check("client")]));
            })
        }),
        ("store_key_per_thread", {
            let store = store.clone();
            Arc::new(move |t, _| {
                let key = if t == 0 { "client-0" } else { "client-1" };
                black_box(store.check(&[check(key)]));
            })
        }),
    ];

    println!(
        "# {ops} operations a thread, {rounds} rounds, load average {}",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    println!("case cpu_ns_per_op_1_thread cpu_ns_per_op_2_threads ratio");
    for (name, op) in &cases {
        let mut one = Vec::new();
        let mut two = Vec::new();
        for _ in 0..rounds {
            one.push(run(op, 1, ops));
            two.push(run(op, 2, ops));
        }
        let (one, two) = (median(&mut one), median(&mut two));
        println!("{name} {one:.1} {two:.1} {:.2}", two / one);
    }
    Ok(())
}

fn check(key: &str) -> Check<'_> {
    Check {
        key,
        rule: &RULE,
        cost: 1,
        shadow: false,
        max_delay_us: None,
    }
}

/// `ops` calls of `op` on each of `threads` threads started together: nanoseconds of CPU per
/// call (the thread's time on a core, from `/proc/thread-self/schedstat`: waiting for a core
/// while other processes run is not counted, waiting for a cache line is), the mean of the
/// threads.
fn run(op: &Op, threads: usize, ops: u64) -> f64 {
    let barrier = Arc::new(Barrier::new(threads));
    let deadline = Duration::from_secs(30);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (op, barrier) = (op.clone(), barrier.clone());
                scope.spawn(move || {
                    barrier.wait();
                    let cpu = on_cpu_ns();
                    let started = Instant::now();
                    let mut done = 0;
                    while done < ops {
                        op(t, done);
                        done += 1;
                        if done % 65_536 == 0 && started.elapsed() > deadline {
                            break;
                        }
                    }
                    (on_cpu_ns() - cpu) as f64 / done as f64
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or(f64::NAN))
            .sum::<f64>()
            / threads as f64
    })
}

/// This thread's time on a core so far, in nanoseconds.
fn on_cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}
