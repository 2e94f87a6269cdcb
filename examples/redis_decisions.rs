//! Decisions per second of the Redis store alone, for `bench/` to set against the `redis-benchmark`
//! ceiling of the same EVALSHA: `concurrency` tasks call [`RedisStore::check`] in a loop, sharing
//! one pool, for `seconds` seconds. Prints one line:
//! `decisions_per_second N p50_ms X p99_ms Y errors M slots S`.
//!
//! cargo run --release --example redis_decisions -- TARGET [CONCURRENCY] [SECONDS] [POOL] [POLICIES]
//!
//! TARGET is a `redis://` URL or `cluster:HOST:PORT,HOST:PORT,...` (Redis Cluster seeds).
//! POLICIES is 1 (the default) or 2: two counters per decision, which on a Cluster live in two
//! slots (`S` in the output says how many slots a decision touches).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use turnstile::limiter::redis::{Auth, Target};
use turnstile::limiter::{Check, RedisStore, Rule, TokenBucket};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let url = args
        .next()
        .unwrap_or_else(|| "redis://127.0.0.1:6379".to_string());
    let concurrency: usize = args.next().map_or(Ok(64), |a| a.parse())?;
    let seconds: u64 = args.next().map_or(Ok(10), |a| a.parse())?;
    let pool: usize = args.next().map_or(Ok(4), |a| a.parse())?;
    let policies: usize = args.next().map_or(Ok(1), |a| a.parse())?;
    anyhow::ensure!(seconds <= 600, "at most 600 seconds");
    anyhow::ensure!((1..=2).contains(&policies), "POLICIES is 1 or 2");

    let target = match url.strip_prefix("cluster:") {
        Some(nodes) => Target::Cluster {
            nodes: nodes.split(',').map(str::to_string).collect(),
            auth: Auth::default(),
        },
        None => Target::Url(url.clone()),
    };
    let store = Arc::new(RedisStore::connect_to(
        &target,
        pool,
        Duration::from_secs(1),
        "bench:",
    )?);
    anyhow::ensure!(
        store.wait_ready(Duration::from_secs(10)).await,
        "redis at {url} is not reachable"
    );
    // The policy of bench/turnstile-redis.yaml.tmpl, keyed like a request from 127.0.0.1.
    let rule = Rule::TokenBucket(TokenBucket {
        rate: 1e9,
        burst: 1_000_000_000,
    });
    let done = Arc::new(AtomicBool::new(false));
    let errors = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (store, done) = (store.clone(), done.clone());
            let errors = errors.clone();
            tokio::spawn(async move {
                // Latency of each decision in microseconds.
                let mut took: Vec<u32> = Vec::with_capacity(1 << 16);
                let check =
                    ["bench:never_trips:127.0.0.1", "bench:second:127.0.0.1"].map(|key| Check {
                        key,
                        rule: &rule,
                        cost: 1,
                        shadow: false,
                        max_delay_us: None,
                    });
                let check = &check[..policies];
                while !done.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    match store.check(check).await {
                        Ok(_) => took.push(t.elapsed().as_micros().min(u32::MAX as u128) as u32),
                        Err(_) => {
                            errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                took
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    done.store(true, Ordering::Relaxed);
    let mut took = Vec::new();
    for task in tasks {
        took.extend(task.await?);
    }
    let elapsed = started.elapsed().as_secs_f64();
    took.sort_unstable();
    let percentile = |p: f64| {
        took.get(((took.len() as f64 * p) as usize).min(took.len().saturating_sub(1)))
            .map_or(0.0, |&us| f64::from(us) / 1000.0)
    };
    let slots = ["bench:never_trips:127.0.0.1", "bench:second:127.0.0.1"][..policies]
        .iter()
        .map(|key| {
            let check = Check {
                key,
                rule: &rule,
                cost: 1,
                shadow: false,
                max_delay_us: None,
            };
            fred::util::redis_keyslot(store.redis_key(&check).as_bytes())
        })
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    println!(
        "decisions_per_second {:.0} p50_ms {:.3} p99_ms {:.3} errors {} slots {slots}",
        took.len() as f64 / elapsed,
        percentile(0.50),
        percentile(0.99),
        errors.load(Ordering::Relaxed),
    );
    Ok(())
}
