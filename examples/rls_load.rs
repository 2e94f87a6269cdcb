//! A bounded load generator for the Envoy rate limit service: `ShouldRateLimit` calls from
//! `--concurrency` tasks over `--connections` HTTP/2 channels, until `--seconds` pass or
//! `--requests` are sent, whichever comes first. Prints decisions per second and latency.
//!
//! cargo run --release --example rls_load -- --addr 127.0.0.1:8081 --domain bench \
//!     --key user --values 1000 --seconds 10 --requests 2000000 --concurrency 64

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;

struct Args {
    addr: String,
    domain: String,
    key: String,
    values: u64,
    descriptors: usize,
    seconds: u64,
    requests: u64,
    concurrency: usize,
    connections: usize,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        addr: "127.0.0.1:8081".into(),
        domain: "bench".into(),
        key: "user".into(),
        values: 1000,
        descriptors: 1,
        seconds: 10,
        requests: 1_000_000,
        concurrency: 64,
        connections: 4,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let num = || {
            value
                .parse::<u64>()
                .map_err(|_| format!("{flag}: not a number"))
        };
        match flag.as_str() {
            "--addr" => a.addr = value.clone(),
            "--domain" => a.domain = value.clone(),
            "--key" => a.key = value.clone(),
            "--values" => a.values = num()?.max(1),
            "--descriptors" => a.descriptors = num()?.max(1) as usize,
            "--seconds" => a.seconds = num()?.clamp(1, 600),
            "--requests" => a.requests = num()?,
            "--concurrency" => a.concurrency = num()?.clamp(1, 4096) as usize,
            "--connections" => a.connections = num()?.clamp(1, 256) as usize,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(a)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Arc::new(parse()?);
    let mut clients = Vec::new();
    for _ in 0..args.connections {
        clients.push(RateLimitServiceClient::connect(format!("http://{}", args.addr)).await?);
    }
    let sent = Arc::new(AtomicU64::new(0));
    let (ok, over, errors) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let deadline = Instant::now() + Duration::from_secs(args.seconds);
    let started = Instant::now();
    let mut tasks = Vec::new();
    for t in 0..args.concurrency {
        let mut client = clients[t % clients.len()].clone();
        let (args, sent, ok, over, errors) = (
            args.clone(),
            sent.clone(),
            ok.clone(),
            over.clone(),
            errors.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            loop {
                let n = sent.fetch_add(1, Ordering::Relaxed);
                if n >= args.requests || Instant::now() >= deadline {
                    break;
                }
                let descriptors = (0..args.descriptors)
                    .map(|d| RateLimitDescriptor {
                        entries: vec![Entry {
                            key: format!(
                                "{}{}",
                                args.key,
                                if d == 0 { String::new() } else { d.to_string() }
                            ),
                            value: format!("v{}", (n * 7919 + d as u64) % args.values),
                        }],
                        ..Default::default()
                    })
                    .collect();
                let request = RateLimitRequest {
                    domain: args.domain.clone(),
                    descriptors,
                    hits_addend: 0,
                };
                let at = Instant::now();
                match client.should_rate_limit(request).await {
                    Ok(r) if r.get_ref().overall_code == Code::OverLimit as i32 => {
                        over.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => {
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
                latencies.push(at.elapsed().as_micros() as u64);
            }
            latencies
        }));
    }
    let mut latencies = Vec::new();
    for task in tasks {
        latencies.extend(task.await?);
    }
    let elapsed = started.elapsed().as_secs_f64();
    latencies.sort_unstable();
    let pct = |p: f64| {
        latencies
            .get(((latencies.len() as f64 * p) as usize).min(latencies.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    let done = latencies.len() as u64;
    println!(
        "requests={done} ok={} over_limit={} errors={} seconds={elapsed:.2} calls_per_second={:.0} descriptors_per_second={:.0} p50_us={} p99_us={}",
        ok.load(Ordering::Relaxed),
        over.load(Ordering::Relaxed),
        errors.load(Ordering::Relaxed),
        done as f64 / elapsed,
        done as f64 * args.descriptors as f64 / elapsed,
        pct(0.50),
        pct(0.99),
    );
    Ok(())
}
