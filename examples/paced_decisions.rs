//! What a paced decision costs against an ordinary admitted one (`docs/benchmarks.md`, "Pacing"):
//! paired slices, alternating, of single-policy decisions on one store, timed one by one.
//!
//! - admitted: a token bucket that never trips (the gateway benchmark's policy);
//! - paced: a bucket of 1 at 1000/s (100/s on Redis, whose round trip can take a millisecond on a
//!   loaded machine) with `max_delay: 3600s`, so every decision after the first is admitted for a
//!   later slot (the reservation, the slot and the give-back stamp in the reply): the decisions
//!   run faster than the rate, and the queue stays ahead of the clock.
//!
//! Prints one line per store: `store S admitted_p50_ns A admitted_p99_ns B paced_p50_ns C
//! paced_p99_ns D ratio R` (R: admitted decisions per second over paced ones, from the medians of
//! the slices' means; above 1 a paced decision costs more).
//!
//! cargo run --release --example paced_decisions -- [SLICES] [DECISIONS_PER_SLICE] [REDIS_URL]

use std::sync::Arc;
use std::time::{Duration, Instant};

use turnstile::limiter::{
    Check, MemoryStore, MonotonicClock, RedisStore, Rule, Store, TokenBucket,
};

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let slices: usize = args.next().map_or(Ok(10), |a| a.parse())?;
    let per_slice: usize = args.next().map_or(Ok(20_000), |a| a.parse())?;
    let redis = args.next();
    anyhow::ensure!(
        slices * per_slice <= 2_000_000,
        "at most 2,000,000 decisions a side"
    );

    let memory = Store::Memory(MemoryStore::new(Arc::new(MonotonicClock::new()), 10_000));
    run("memory", &memory, 1000.0, slices, per_slice).await?;
    if let Some(url) = redis {
        let store = RedisStore::connect(&url, 2, Duration::from_secs(1), "bench-pacing:")?;
        anyhow::ensure!(
            store.wait_ready(Duration::from_secs(10)).await,
            "redis at {url} is not reachable"
        );
        // Fewer on Redis: a round trip each.
        run("redis", &Store::Redis(store), 100.0, slices, per_slice / 10).await?;
    }
    Ok(())
}

async fn run(
    name: &str,
    store: &Store,
    rate: f64,
    slices: usize,
    per_slice: usize,
) -> anyhow::Result<()> {
    let never = Rule::TokenBucket(TokenBucket {
        rate: 1e9,
        burst: 1_000_000_000,
    });
    let paced = Rule::TokenBucket(TokenBucket { rate, burst: 1 });
    let admitted = Check {
        key: "bench:admitted",
        rule: &never,
        cost: 1,
        shadow: false,
        max_delay_us: None,
    };
    let delayed = Check {
        key: "bench:paced",
        rule: &paced,
        cost: 1,
        shadow: false,
        max_delay_us: Some(3_600_000_000),
    };
    let (mut a_times, mut p_times) = (Vec::new(), Vec::new());
    let (mut a_means, mut p_means) = (Vec::new(), Vec::new());
    for _ in 0..slices {
        for (check, times, means, want_delay) in [
            (&admitted, &mut a_times, &mut a_means, false),
            (&delayed, &mut p_times, &mut p_means, true),
        ] {
            let began = Instant::now();
            for _ in 0..per_slice {
                let t = Instant::now();
                let d = store.check(std::slice::from_ref(check)).await?;
                times.push(t.elapsed().as_nanos() as u64);
                anyhow::ensure!(d.allowed, "{name}: a decision refused");
                anyhow::ensure!(
                    !want_delay || d.delay_us > 0 || times.len() == 1,
                    "{name}: a paced decision was not delayed"
                );
            }
            means.push(began.elapsed().as_nanos() as f64 / per_slice as f64);
        }
    }
    let pct = |v: &mut Vec<u64>, q: f64| {
        v.sort_unstable();
        v[((v.len() - 1) as f64 * q) as usize]
    };
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let ratio = median(&mut p_means) / median(&mut a_means);
    println!(
        "store {name} admitted_p50_ns {} admitted_p99_ns {} paced_p50_ns {} paced_p99_ns {} ratio {ratio:.2}",
        pct(&mut a_times, 0.5),
        pct(&mut a_times, 0.99),
        pct(&mut p_times, 0.5),
        pct(&mut p_times, 0.99),
    );
    Ok(())
}
