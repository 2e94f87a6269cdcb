//! Gateway instances (real `turnstile` processes) on Redis behind Sentinel: a master, a replica
//! and one Sentinel. Exact limits from two instances, then the master is killed and the gateways
//! follow the master Sentinel promotes, without a restart.

mod support;

use std::time::{Duration, Instant};

use support::fleet::{burst_with, count, decides_again, wait_ready};
use support::redis::RedisSentinelSetup;
use support::GatewayProcess;

const READY: Duration = Duration::from_secs(20);

fn config(setup: &RedisSentinelSetup) -> String {
    format!(
        "store:\n  type: redis\n  sentinel: {{ service: {}, nodes: [\"127.0.0.1:{}\"] }}\n  \
         pool_size: 2\n  timeout: 2s\n  failure_mode: closed\n  key_prefix: \"st:\"\n\
         routes:\n  - name: fresh\n    match: {{ path: /fresh }}\n    \
         respond: {{ status: 200, body: \"ok\\n\" }}\n    policies:\n      - name: shared\n        \
         key: [header:x-run]\n        token_bucket: {{ rate: 1/d, burst: 20 }}\n",
        RedisSentinelSetup::SERVICE,
        setup.sentinel.port
    )
}

async fn exact(gateways: &[GatewayProcess], run: &str) {
    let urls: Vec<String> = gateways.iter().map(|g| g.url("/fresh")).collect();
    let statuses = burst_with(&urls, 60, |_| vec![("x-run", run.to_string())]).await;
    assert_eq!(
        (count(&statuses, 200), count(&statuses, 429)),
        (20, 40),
        "burst 20 through Sentinel, x-run {run}: {statuses:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_gateway_follows_the_master_sentinel_names() {
    let started = Instant::now();
    let mut setup = tokio::task::block_in_place(RedisSentinelSetup::start);
    let yaml = config(&setup);
    let gateways = vec![
        GatewayProcess::spawn(&yaml).await,
        GatewayProcess::spawn(&yaml).await,
    ];
    for gw in &gateways {
        wait_ready(gw, 200, READY).await;
    }
    for gw in &gateways {
        assert!(
            !gw.log().contains("unreachable"),
            "no false unreachable warning at a normal start:\n{}",
            gw.log()
        );
    }
    exact(&gateways, "before").await;

    let old = setup.master.port;
    setup.master.kill();
    let killed = Instant::now();
    let deadline = killed + Duration::from_secs(30);
    while tokio::task::block_in_place(|| setup.master_port()) == old {
        assert!(
            Instant::now() < deadline,
            "Sentinel never promoted the replica"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(setup.master_port(), setup.replica.port);
    let promoted = killed.elapsed();

    // Every instance decides again by itself, on the promoted replica.
    for (i, gw) in gateways.iter().enumerate() {
        decides_again(gw, i, "/fresh", READY).await;
    }
    eprintln!(
        "sentinel: promoted {promoted:?} after the kill, both instances deciding {:?} after it",
        killed.elapsed()
    );
    exact(&gateways, "after").await;
    // The writes went to the new master.
    let keys = setup.replica.keys();
    assert!(
        keys.iter().any(|k| k.contains("after")),
        "the new master holds the new counter: {keys:?}"
    );
    eprintln!("sentinel test in {:?}", started.elapsed());
}
