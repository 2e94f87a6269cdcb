//! Shared policies on a real Redis Cluster (3 masters, 3 replicas): a shared counter has one key,
//! so one slot, whichever route uses it, and a request whose shared and own counters live in two
//! slots is decided all or nothing (the cross-slot path refunds what a refusal consumed).

mod support;

use support::redis::RedisCluster;
use support::{Client, TestGateway};

/// `one` has the shared `common` (5) and its own `tight` (1); `two` has `common` only. Keys on the
/// method, so every request of the test counts on the same two counters.
fn config(cluster: &RedisCluster) -> String {
    let common =
        "{ name: common, shared: true, key: [method], token_bucket: { rate: 1/d, burst: 5 } }";
    format!(
        "store:\n  type: redis\n  cluster: {}\n  pool_size: 2\n  timeout: 2s\n  failure_mode: closed\n  key_prefix: \"sh:\"\n\
         routes:\n  - name: one\n    match: {{ path: /one }}\n    respond: {{ body: one }}\n    policies:\n      - {common}\n\
         \x20     - {{ name: tight, key: [method], token_bucket: {{ rate: 1/d, burst: 1 }} }}\n\
         \x20 - name: two\n    match: {{ path: /two }}\n    respond: {{ body: two }}\n    policies:\n      - {common}\n",
        cluster.seeds()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_counter_has_one_slot_and_refunds_across_slots() {
    let cluster = RedisCluster::start();
    let gw = TestGateway::start(&config(&cluster)).await;
    let c = Client::new();
    let mut statuses = Vec::new();
    for path in [
        "/one", "/one", "/one", "/two", "/two", "/two", "/two", "/two",
    ] {
        statuses.push(c.get(&gw.url(path)).await.status);
    }
    // `tight` refuses the 2nd and 3rd on `one`: `common` keeps them, and `two` gets the other 4.
    assert_eq!(statuses, [200, 429, 429, 200, 200, 200, 200, 429]);

    let mut keys = cluster.keys();
    keys.sort();
    assert_eq!(keys, ["sh:{one:tight:GET}:tb", "sh:{shared/common:GET}:tb"]);
    assert_ne!(
        cluster.slot(&keys[0]),
        cluster.slot(&keys[1]),
        "the test needs the two counters of `one` in two slots"
    );
    let left: f64 = cluster.key_cli(&["hget", &keys[1], "t"])[0]
        .parse()
        .expect("tokens");
    assert!(left.abs() < 0.01, "all 5 of `common` taken: {left} left");
}
