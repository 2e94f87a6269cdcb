//! Gateway instances (real `turnstile` processes) on a real Redis Cluster of 3 masters and 3
//! replicas: exact limits, multi-slot requests that never exceed a limit and refund what a
//! rejection consumed, slots moved and migrating under traffic, and a master killed under the
//! gateways.
//!
//! The cluster is the heavy fixture: it is started once, and the scenarios run in sequence in one
//! test (the failover last, since it changes the topology). The per-shard failover under load
//! has a cluster of its own, so it runs beside them.

mod support;

use std::time::{Duration, Instant};

use support::fleet::{burst, burst_with, count, decides_again, wait_ready};
use support::redis::RedisCluster;
use support::{Client, GatewayProcess};

const READY: Duration = Duration::from_secs(20);

fn store(cluster: &RedisCluster, timeout: &str) -> String {
    format!(
        "store:\n  type: redis\n  cluster: {}\n  pool_size: 2\n  timeout: {timeout}\n  \
         failure_mode: closed\n  key_prefix: \"ct:\"\n",
        cluster.seeds()
    )
}

/// A route answering 200 by itself, with `policies` (YAML list items, 6 spaces in).
fn route(name: &str, policies: &str) -> String {
    format!(
        "  - name: {name}\n    match: {{ path: /{name} }}\n    respond: {{ status: 200, body: \"ok\\n\" }}\n\
         \x20   policies:\n{policies}"
    )
}

fn policy(name: &str, key: &str, rule: &str) -> String {
    format!("      - name: {name}\n        key: [{key}]\n        {rule}\n")
}

fn config(cluster: &RedisCluster, timeout: &str) -> String {
    let bucket = "token_bucket: { rate: 1/d, burst: 50 }";
    format!(
        "{}routes:\n{}{}{}{}{}",
        store(cluster, timeout),
        route("bucket", &policy("shared", "method", bucket)),
        route(
            "window",
            &policy(
                "shared",
                "method",
                "sliding_window: { limit: 40, window: 1m }"
            )
        ),
        // Two counters of one request, in two slots (asserted below).
        route(
            "pair",
            &(policy("tight", "method", "token_bucket: { rate: 1/d, burst: 2 }")
                + &policy("wide", "method", "token_bucket: { rate: 1/d, burst: 100 }"))
        ),
        route(
            "multi",
            &(policy(
                "per_user",
                "header:x-user",
                "token_bucket: { rate: 1/d, burst: 15 }",
            ) + &policy(
                "shared",
                "method",
                "sliding_window: { limit: 40, window: 1m }",
            ))
        ),
        route("fresh", &policy("shared", "header:x-run", bucket)),
    ) + &route(
        "twin",
        &(policy("a", "header:x-a", "token_bucket: { rate: 1/d, burst: 5 }")
            + &policy("b", "header:x-b", "token_bucket: { rate: 1/d, burst: 5 }")),
    )
}

/// The one key on the cluster whose name contains all of `parts`.
fn key_with(cluster: &RedisCluster, parts: &[&str]) -> String {
    let keys: Vec<String> = cluster
        .keys()
        .into_iter()
        .filter(|k| parts.iter().all(|p| k.contains(p)))
        .collect();
    assert_eq!(keys.len(), 1, "one key with {parts:?}: {keys:?}");
    keys[0].clone()
}

/// Tokens left in a token bucket key (the script stores them exactly, `%.17g`).
fn tokens(cluster: &RedisCluster, key: &str) -> f64 {
    cluster.key_cli(&["hget", key, "t"])[0]
        .parse()
        .expect("tokens")
}

/// Entries in an exact sliding window key.
/// The units an exact window holds while none has left it: its newest member's count, `TIME#C`,
/// less the base, the member `n` scored `-(base + 1)` (docs/redis.md).
fn units(cluster: &RedisCluster, key: &str) -> usize {
    let members = cluster.key_cli(&["zrange", key, "0", "-1", "withscores"]);
    if members.len() < 4 {
        return 0;
    }
    let base = -members[1].parse::<f64>().expect("base") - 1.0;
    let newest = &members[members.len() - 2];
    let count: f64 = newest
        .rsplit('#')
        .next()
        .expect("count")
        .parse()
        .expect("count");
    (count - base) as usize
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fleet_on_a_redis_cluster() {
    let started = Instant::now();
    let mut cluster = tokio::task::block_in_place(RedisCluster::start);
    eprintln!("cluster up in {:?}", started.elapsed());
    let yaml = config(&cluster, "2s");
    let mut gateways = Vec::new();
    for workers in [1, 2, 2] {
        gateways.push(GatewayProcess::spawn_with_workers(&yaml, workers).await);
    }
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
    exact_limits_across_three_instances(&gateways).await;
    a_rejection_in_one_slot_consumes_nothing_in_another(&cluster, &gateways).await;
    a_peek_reads_each_slot_and_writes_nothing(&cluster, &gateways).await;
    concurrent_multi_slot_requests_never_exceed_either_limit(&cluster, &gateways).await;
    a_slot_moved_under_load_keeps_its_count(&cluster, &gateways).await;
    traffic_on_a_migrating_slot_keeps_deciding(&cluster, &gateways).await;
    a_request_split_by_a_migration_fails_fast(&cluster, &gateways).await;
    overrides_follow_their_slot_when_it_moves(&cluster, &gateways).await;
    stamped_refunds_land_in_each_slot(&cluster).await;
    lease_waiters_are_handed_leases_in_each_slot(&cluster).await;
    paced_checks_across_slots_are_never_delayed(&cluster).await;
    killing_a_master_fails_over_and_limiting_resumes(&mut cluster, &gateways).await;
    eprintln!("all scenarios in {:?}", started.elapsed());
}

async fn exact_limits_across_three_instances(gateways: &[GatewayProcess]) {
    let urls: Vec<String> = gateways.iter().map(|g| g.url("/bucket")).collect();
    let statuses = burst(&urls, 300).await;
    assert_eq!(
        (count(&statuses, 200), count(&statuses, 429)),
        (50, 250),
        "token bucket of burst 50 on a cluster: {statuses:?}"
    );
    let urls: Vec<String> = gateways.iter().map(|g| g.url("/window")).collect();
    let statuses = burst(&urls, 300).await;
    assert_eq!(
        (count(&statuses, 200), count(&statuses, 429)),
        (40, 260),
        "sliding window of 40/min on a cluster: {statuses:?}"
    );
}

async fn a_rejection_in_one_slot_consumes_nothing_in_another(
    cluster: &RedisCluster,
    gateways: &[GatewayProcess],
) {
    let client = Client::new();
    let mut statuses = Vec::new();
    for i in 0..6 {
        statuses.push(client.get(&gateways[i % 3].url("/pair")).await.status);
    }
    assert_eq!(statuses, [200, 200, 429, 429, 429, 429]);
    let tight = key_with(cluster, &["{pair:tight"]);
    let wide = key_with(cluster, &["{pair:wide"]);
    assert_ne!(
        cluster.slot(&tight),
        cluster.slot(&wide),
        "the test needs the two counters in two slots"
    );
    // The refund is part of the rejected request's decision: it has landed when the 429 is sent.
    let left = tokens(cluster, &wide);
    assert!(
        (left - 98.0).abs() < 0.01,
        "only the two admitted requests consumed from `wide`: {left} tokens left"
    );
}

/// Reservations settled on a Cluster (`docs/algorithms.md`, "Reserve, then settle"): one request's
/// exact window, bucketed window and quota, in three slots, each stamped by its own slot's call;
/// each stamped refund, one call per slot, gives back exactly the units of that admission, in
/// its entry, bucket and period, and leaves another admission's units where they are.
/// A concurrency key's waiter queue shares its slot: a waiter on each of two keys in different
/// slots is handed the lease released there (one call per slot), and woken by its message,
/// which a Cluster delivers whichever node the subscriber is on.
async fn lease_waiters_are_handed_leases_in_each_slot(cluster: &RedisCluster) {
    use std::sync::Arc;
    use turnstile::limiter::lease_queue::Enqueued;
    use turnstile::limiter::redis::{Auth, Target};
    use turnstile::limiter::{Check, Concurrency, ManualClock, RedisStore, Rule};
    let nodes = cluster
        .seeds()
        .trim_matches(|c| c == '[' || c == ']')
        .split(", ")
        .map(str::to_string)
        .collect();
    let target = Target::Cluster {
        nodes,
        auth: Auth::default(),
    };
    let clock = Arc::new(ManualClock::new(1_000_000_000));
    let store =
        RedisStore::connect_to_with_test_clock(&target, Duration::from_secs(2), "lq:", clock)
            .expect("cluster store");
    assert!(
        store.wait_ready(READY).await,
        "the cluster store never became ready"
    );
    let rule = Rule::Concurrency(Concurrency {
        limit: 1,
        lease_ttl_us: 10_000_000,
    });
    let keys = ["lease-a", "lease-b"];
    let check = |key| Check {
        key,
        rule: &rule,
        cost: 1,
        shadow: false,
        max_delay_us: None,
    };
    let checks: Vec<Check<'_>> = keys.iter().map(|k| check(*k)).collect();
    let slots: Vec<u16> = checks
        .iter()
        .map(|c| cluster.slot(&store.redis_key(c)))
        .collect();
    assert_ne!(slots[0], slots[1], "two slots");
    let mut tickets = Vec::new();
    for (i, c) in checks.iter().enumerate() {
        let lease = 10 + i as u64;
        assert!(store.check_leased(&[*c], 1).await.expect("lease").allowed);
        match store.enqueue(c, lease, 5_000_000).await.expect("enqueue") {
            Enqueued::Queued(ticket) => tickets.push(ticket),
            other => panic!("queued, not {other:?}"),
        }
    }
    let handed = store.release(&checks, 1, "").await.expect("release");
    assert_eq!(handed, [10, 11], "each slot's waiter is handed its lease");
    for mut ticket in tickets {
        let woken = tokio::time::timeout(Duration::from_secs(5), ticket.granted()).await;
        assert_eq!(woken, Ok(true), "woken by its message");
    }
    for (i, c) in checks.iter().enumerate() {
        assert!(store
            .release(&[*c], 10 + i as u64, "")
            .await
            .expect("release")
            .is_empty());
    }
}

async fn stamped_refunds_land_in_each_slot(cluster: &RedisCluster) {
    use std::sync::Arc;
    use turnstile::limiter::calendar::Per;
    use turnstile::limiter::redis::{Auth, Target};
    use turnstile::limiter::{Check, ManualClock, Quota, RedisStore, Rule, SlidingWindow};
    let nodes = cluster
        .seeds()
        .trim_matches(|c| c == '[' || c == ']')
        .split(", ")
        .map(str::to_string)
        .collect();
    let target = Target::Cluster {
        nodes,
        auth: Auth::default(),
    };
    let noon = 1_795_431_600_000_000; // 2026-11-23 12:00 in Europe/Berlin
    let clock = Arc::new(ManualClock::new(noon));
    let store = RedisStore::connect_to_with_test_clock(
        &target,
        Duration::from_secs(2),
        "st:",
        clock.clone(),
    )
    .expect("cluster store");
    assert!(
        store.wait_ready(READY).await,
        "the cluster store never became ready"
    );
    let rules = [
        Rule::SlidingWindow(SlidingWindow {
            limit: 100,
            window_us: 3_600_000_000,
            buckets: 0,
        }),
        Rule::SlidingWindow(SlidingWindow {
            limit: 100,
            window_us: 3_600_000_000,
            buckets: 60,
        }),
        Rule::Quota(Quota {
            limit: 100,
            per: Per::Month,
            time_zone: chrono_tz::Europe::Berlin,
        }),
    ];
    let keys = ["refund:window", "refund:buckets", "refund:quota"];
    let checks = |cost: u64| -> Vec<Check<'_>> {
        keys.iter()
            .zip(&rules)
            .map(|(key, rule)| Check {
                key,
                rule,
                cost,
                shadow: false,
                max_delay_us: None,
            })
            .collect()
    };
    // A first admission of 30 units stays; the second, a minute later (another entry and
    // bucket), reserves 60 and used 25.
    let first = store.check(&checks(30)).await.expect("decision");
    assert!(first.allowed);
    let later = noon + 61_000_000;
    clock.set(later);
    let second = store.check(&checks(60)).await.expect("decision");
    assert!(second.allowed);
    assert_eq!(second.stamps.len(), 3, "a stamp per check, from each slot");
    assert_eq!(
        second.stamps[0], later,
        "the exact window's: the time written"
    );
    let slots: Vec<u16> = keys.iter().map(|k| cluster.slot(k)).collect();
    assert!(
        slots[0] != slots[1] && slots[1] != slots[2] && slots[0] != slots[2],
        "the test needs three slots: {slots:?}"
    );
    let stamped = |cost: u64| -> Vec<(Check<'_>, u64)> {
        checks(cost)
            .into_iter()
            .zip(second.stamps.iter().copied())
            .collect()
    };
    let refunds = stamped(35);
    store.refund(&refunds).await.expect("refund");
    let after = store.check(&checks(0)).await.expect("decision");
    let remaining: Vec<u64> = after.outcomes.iter().map(|o| o.remaining).collect();
    assert_eq!(
        remaining,
        [45, 45, 45],
        "100 less 30 and 25, on each counter"
    );
    // The same refund again (a bug's double settlement) cannot take the first admission's units:
    // only the 25 left of the second's in its entry and bucket; the quota's count is one number.
    store.refund(&stamped(35)).await.expect("refund");
    let after = store.check(&checks(0)).await.expect("decision");
    let remaining: Vec<u64> = after.outcomes.iter().map(|o| o.remaining).collect();
    assert_eq!(remaining[..2], [70, 70], "the first admission's 30 stay");
}

/// Pacing on a Cluster (`docs/redis.md`): a request whose paced counters span slots is decided
/// per slot, so it is never delayed: it is admitted when it needs no wait and otherwise refused
/// at once, `retry_after` the wait it would have had; nothing is consumed by the refusal. The
/// same counter alone (one slot) is delayed as on one server.
async fn paced_checks_across_slots_are_never_delayed(cluster: &RedisCluster) {
    use std::sync::Arc;
    use turnstile::limiter::redis::{Auth, Target};
    use turnstile::limiter::{Check, ManualClock, RedisStore, Rule, TokenBucket};
    let nodes = cluster
        .seeds()
        .trim_matches(|c| c == '[' || c == ']')
        .split(", ")
        .map(str::to_string)
        .collect();
    let target = Target::Cluster {
        nodes,
        auth: Auth::default(),
    };
    let clock = Arc::new(ManualClock::new(1_795_431_600_000_000));
    let store =
        RedisStore::connect_to_with_test_clock(&target, Duration::from_secs(2), "pc:", clock)
            .expect("cluster store");
    assert!(
        store.wait_ready(READY).await,
        "the cluster store never became ready"
    );
    let rule = Rule::TokenBucket(TokenBucket {
        rate: 10.0,
        burst: 1,
    });
    let keys = ["pace:a", "pace:b"];
    assert_ne!(
        cluster.slot(&format!("pc:{{{}}}:tb", keys[0])),
        cluster.slot(&format!("pc:{{{}}}:tb", keys[1])),
        "the test needs two slots"
    );
    let checks = |keys: &[&'static str]| -> Vec<Check<'_>> {
        keys.iter()
            .map(|key| Check {
                key,
                rule: &rule,
                cost: 1,
                shadow: false,
                max_delay_us: Some(2_000_000),
            })
            .collect()
    };
    let first = store.check(&checks(&keys)).await.expect("decision");
    assert!(first.allowed && first.delay_us == 0, "{first:?}");
    // On one server: delayed 100 ms. Across slots: refused now, for the wait it would have had.
    let second = store.check(&checks(&keys)).await.expect("decision");
    assert!(!second.allowed, "{second:?}");
    assert_eq!(second.delay_us, 0);
    let waits: Vec<u64> = second.outcomes.iter().map(|o| o.retry_after_us).collect();
    assert_eq!(waits, [100_000, 100_000], "{second:?}");
    // The refusal consumed nothing: one counter alone, in one slot, is delayed 100 ms.
    let alone = store.check(&checks(&keys[..1])).await.expect("decision");
    assert!(alone.allowed, "{alone:?}");
    assert_eq!(alone.delay_us, 100_000);
}

/// Writes every node of the cluster counted since it started (`rdb_changes_since_last_save`).
fn cluster_writes(cluster: &RedisCluster) -> u64 {
    cluster
        .nodes
        .iter()
        .map(|node| {
            let info = node.cli(&["info", "persistence"]);
            support::redis::info_field(&info, "rdb_changes_since_last_save")
                .and_then(|v| v.parse::<u64>().ok())
                .expect("rdb_changes_since_last_save")
        })
        .sum()
}

/// The status page's lookup (issue 42) on a Cluster: the two counters of `/pair`, in two slots,
/// read on their own masters, exactly as the last decisions left them, and nothing written on
/// any node.
async fn a_peek_reads_each_slot_and_writes_nothing(
    cluster: &RedisCluster,
    gateways: &[GatewayProcess],
) {
    use support::client::{full, request};
    let before = cluster_writes(cluster);
    for gw in gateways {
        let req = request(http::Method::POST, &gw.admin_url("/status/peek"))
            .header("content-type", "application/json")
            .body(full(
                r#"{"route": "pair", "keys": {"tight": "GET", "wide": "GET"}}"#,
            ))
            .expect("request");
        let reply = Client::new().send(req).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        let body = reply.json();
        let (tight, wide) = (&body["policies"][0], &body["policies"][1]);
        assert_eq!(
            (tight["remaining"].as_u64(), tight["next_allowed"].as_bool()),
            (Some(0), Some(false))
        );
        assert_eq!(
            (wide["remaining"].as_u64(), wide["next_allowed"].as_bool()),
            (Some(98), Some(true))
        );
    }
    assert_eq!(
        cluster_writes(cluster),
        before,
        "a peek wrote on the cluster"
    );
}

async fn concurrent_multi_slot_requests_never_exceed_either_limit(
    cluster: &RedisCluster,
    gateways: &[GatewayProcess],
) {
    const USERS: usize = 4;
    let urls: Vec<String> = gateways.iter().map(|g| g.url("/multi")).collect();
    // 4 users of 15 each could take 60; the shared window stops them at 40.
    let statuses = burst_with(&urls, 200, |i| vec![("x-user", format!("u{}", i % USERS))]).await;
    let admitted = count(&statuses, 200);
    assert_eq!(admitted + count(&statuses, 429), 200, "{statuses:?}");
    assert!(
        (1..=40).contains(&admitted),
        "never over the shared limit: {admitted}"
    );
    let mut per_user_admitted = 0;
    for user in 0..USERS {
        let admitted_here = statuses
            .iter()
            .enumerate()
            .filter(|(i, s)| i % USERS == user && **s == 200)
            .count();
        assert!(admitted_here <= 15, "user {user}: {admitted_here} > 15");
        // What is left is exactly what was admitted: every rejection's consumption came back.
        let key = key_with(cluster, &["{multi:per_user", &format!("u{user}")]);
        let left = tokens(cluster, &key);
        assert!(
            (left - (15 - admitted_here) as f64).abs() < 0.01,
            "user {user}: {admitted_here} admitted, {left} tokens left"
        );
        per_user_admitted += admitted_here;
    }
    assert_eq!(per_user_admitted, admitted);
    let shared = key_with(cluster, &["{multi:shared"]);
    assert_eq!(
        units(cluster, &shared),
        admitted,
        "the shared window holds exactly the admitted requests"
    );
    eprintln!("multi-slot: {admitted} of 200 admitted (at most 40)");
}

/// Resharding: the slot of a counter moves to another master (its key migrated, then the move
/// made final). The next requests get `MOVED`, the topology is refreshed, and the count carries
/// over exactly.
async fn a_slot_moved_under_load_keeps_its_count(
    cluster: &RedisCluster,
    gateways: &[GatewayProcess],
) {
    let urls: Vec<String> = gateways.iter().map(|g| g.url("/fresh")).collect();
    let run = || vec![("x-run", "moving".to_string())];
    let first = burst_with(&urls, 20, |_| run()).await;
    assert_eq!(count(&first, 200), 20, "{first:?}");
    let key = key_with(cluster, &["{fresh:shared", "moving"]);
    let moving = tokio::task::block_in_place(|| cluster.begin_move(&key));
    tokio::task::block_in_place(|| cluster.finish_move(&moving));
    assert_eq!(cluster.master_of(&key), moving.to);
    let moved = burst_with(&urls, 60, |_| run()).await;
    assert_eq!(
        (count(&moved, 200), count(&moved, 429)),
        (30, 30),
        "after the move (MOVED): the count carried over: {moved:?}; log:\n{}",
        gateways[0].log()
    );
}

/// Resharding caught midway: the slot of a counter is migrating (its key already on the importing
/// node), so the old owner answers `ASK`. Every request is still decided, within the store
/// timeout, and counted exactly: on the moved key, and on a key of the same slot that exists
/// nowhere yet (created on the importing node). After the move is final (`MOVED`), both counts
/// carry over. Regression test for fred 10.1's `ASK` handling, which wedged the clustered client
/// for 40 s and more.
async fn traffic_on_a_migrating_slot_keeps_deciding(
    cluster: &RedisCluster,
    gateways: &[GatewayProcess],
) {
    let urls: Vec<String> = gateways.iter().map(|g| g.url("/fresh")).collect();
    let run = |value: &str| {
        let value = value.to_string();
        move |_| vec![("x-run", value.clone())]
    };
    let before = burst_with(&urls, 10, run("migrating")).await;
    assert_eq!(count(&before, 200), 10, "{before:?}");
    let key = key_with(cluster, &["{fresh:shared", "migrating"]);
    // Another x-run whose counter falls in the same slot, and does not exist yet.
    let slot = cluster.slot(&key);
    let sibling = (0..200_000)
        .map(|i| format!("sibling-{i}"))
        .find(|v| fred::util::redis_keyslot(key.replace("migrating", v).as_bytes()) == slot)
        .expect("a sibling key in the same slot");
    assert_eq!(cluster.slot(&key.replace("migrating", &sibling)), slot);

    let moving = tokio::task::block_in_place(|| cluster.begin_move(&key));
    let started = Instant::now();
    let asked = burst_with(&urls, 20, run("migrating")).await;
    let fresh = burst_with(&urls, 10, run(&sibling)).await;
    let took = started.elapsed();
    tokio::task::block_in_place(|| cluster.finish_move(&moving));
    assert_eq!(
        (count(&asked, 200), count(&fresh, 200)),
        (20, 10),
        "during the migration (ASK): {asked:?}, {fresh:?}; log:\n{}",
        gateways[0].log()
    );
    assert!(
        took < Duration::from_secs(10),
        "30 decisions during the migration took {took:?}"
    );
    assert_eq!(cluster.master_of(&key), moving.to);

    let moved = burst_with(&urls, 40, run("migrating")).await;
    let fresh = burst_with(&urls, 50, run(&sibling)).await;
    assert_eq!(
        (count(&moved, 200), count(&moved, 429)),
        (20, 20),
        "after the move (MOVED): 50 - 10 - 20 left: {moved:?}; log:\n{}",
        gateways[0].log()
    );
    assert_eq!(
        (count(&fresh, 200), count(&fresh, 429)),
        (40, 10),
        "after the move: the counter created during the migration carried over: {fresh:?}"
    );
    eprintln!("migrating slot: 30 decisions under ASK in {took:?}");
}

/// A request whose two counters share a slot is one call, all or nothing. While a migration has
/// split them between the two nodes, Redis answers `TRYAGAIN`: the request fails at once under
/// the route's failure mode (closed: 503), consuming nothing, without opening the circuit breaker
/// for other keys (Redis answered: it is not an outage). Once both keys are on the importing node
/// it is one call again (after `ASK`).
async fn a_request_split_by_a_migration_fails_fast(
    cluster: &RedisCluster,
    gateways: &[GatewayProcess],
) {
    let client = Client::new();
    let url = gateways[0].url("/twin");
    // Learn both key names, then pick an x-b whose counter shares the slot of x-a's.
    let probe = client
        .get_with(&url, &[("x-a", "split"), ("x-b", "probe")])
        .await;
    assert_eq!(probe.status, 200);
    let a = key_with(cluster, &["{twin:a", "split"]);
    let b_probe = key_with(cluster, &["{twin:b", "probe"]);
    let slot = fred::util::redis_keyslot(a.as_bytes());
    let (value, b) = (0..1_000_000)
        .map(|i| format!("v{i}"))
        .map(|v| (v.clone(), b_probe.replace("probe", &v)))
        .find(|(_, k)| fred::util::redis_keyslot(k.as_bytes()) == slot)
        .expect("an x-b in the slot of x-a");
    let headers = [("x-a", "split"), ("x-b", value.as_str())];
    assert_eq!(client.get_with(&url, &headers).await.status, 200);
    assert_eq!(cluster.slot(&b), cluster.slot(&a), "one slot for both");

    let moving = tokio::task::block_in_place(|| cluster.begin_move_of(&a, &[&a]));
    let mut slowest = Duration::ZERO;
    for _ in 0..8 {
        let sent = Instant::now();
        let status = client.get_with(&url, &headers).await.status;
        slowest = slowest.max(sent.elapsed());
        assert_eq!(status, 503, "TRYAGAIN fails the request (closed)");
    }
    assert!(
        slowest < Duration::from_secs(1),
        "TRYAGAIN fails at once, not after the 2 s timeout: {slowest:?}"
    );
    assert!(
        gateways[0].log().contains("TRYAGAIN"),
        "the failure is Redis's TRYAGAIN; log:\n{}",
        gateways[0].log()
    );
    let beside = [("x-run", "beside-split")];
    assert_eq!(
        client
            .get_with(&gateways[0].url("/fresh"), &beside)
            .await
            .status,
        200,
        "8 TRYAGAIN answers did not open the breaker; log:\n{}",
        gateways[0].log()
    );

    tokio::task::block_in_place(|| cluster.migrate_rest(&moving));
    assert_eq!(client.get_with(&url, &headers).await.status, 200);
    tokio::task::block_in_place(|| cluster.finish_move(&moving));
    // `a` had 5: the probe, the first pair and the one after the migration took 3, the eight
    // failed requests nothing.
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(client.get_with(&url, &headers).await.status);
    }
    assert_eq!(statuses, [200, 200, 429, 429]);
    eprintln!("split slot: 8 TRYAGAIN failures, slowest {slowest:?}");
}

/// The per-key overrides live in Redis under one hash tag; their scripts follow `ASK` while that
/// slot migrates and `MOVED` once it has moved, as decisions do.
async fn overrides_follow_their_slot_when_it_moves(
    cluster: &RedisCluster,
    gateways: &[GatewayProcess],
) {
    let admin = |method: &str, body: &'static str| {
        let url = gateways[0].admin_url("/overrides/fresh/shared/premium");
        let req = support::client::request(method.parse().expect("method"), &url)
            .header("content-type", "application/json")
            .body(support::client::full(body.to_string()))
            .expect("request");
        async move { Client::new().send(req).await }
    };
    let put = admin("PUT", r#"{"rate": "1/d", "burst": 70}"#).await;
    assert_eq!(put.status, 200, "{}", put.text());
    let hash = key_with(cluster, &["{turnstile-overrides}", ":version"]);
    let hash = hash.trim_end_matches(":version").to_string();
    let moving = tokio::task::block_in_place(|| cluster.begin_move(&hash));
    let put = admin("PUT", r#"{"rate": "1/d", "burst": 80}"#).await;
    assert_eq!(
        put.status,
        200,
        "during the migration (ASK): {}",
        put.text()
    );
    tokio::task::block_in_place(|| cluster.finish_move(&moving));
    let deleted = admin("DELETE", "").await;
    assert_eq!(
        deleted.status,
        204,
        "after the move (MOVED): {}; log:\n{}",
        deleted.text(),
        gateways[0].log()
    );
}

async fn killing_a_master_fails_over_and_limiting_resumes(
    cluster: &mut RedisCluster,
    gateways: &[GatewayProcess],
) {
    // A gateway with a short timeout, to measure what an outage costs a request.
    let quick = GatewayProcess::spawn(&config(cluster, "200ms")).await;
    wait_ready(&quick, 200, READY).await;
    let client = Client::new();
    let before = [("x-run", "before")];
    let reply = client.get_with(&quick.url("/fresh"), &before).await;
    assert_eq!(reply.status, 200);
    let key = key_with(cluster, &["{fresh:shared", "before"]);
    let victim = cluster.master_of(&key);
    let victim_port = cluster.nodes[victim].port;
    cluster.nodes[victim].kill();
    let killed = Instant::now();

    // While the shard has no master: each decision fails within the timeout (plus slack for a
    // loaded machine), the route's failure_mode (closed) answers, and the breaker keeps it cheap.
    // Promotion takes more than the 1 s node timeout, so this whole loop is in the outage.
    let mut failed = 0;
    let mut slowest = Duration::ZERO;
    let mut unready = false;
    while killed.elapsed() < Duration::from_millis(1200) {
        let sent = Instant::now();
        let reply = client.get_with(&quick.url("/fresh"), &before).await;
        slowest = slowest.max(sent.elapsed());
        if reply.status == 503 {
            failed += 1;
        }
        unready |= client.get(&quick.admin_url("/readyz")).await.status == 503;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        failed > 0,
        "a shard without a master fails its decisions (closed: 503)"
    );
    assert!(unready, "/readyz says 503 while a shard has no master");
    assert!(
        slowest < Duration::from_millis(1200),
        "a decision took {slowest:?} during the outage"
    );

    // The replica is promoted; limiting resumes by itself on every instance.
    let promoted = Instant::now();
    tokio::task::block_in_place(|| cluster.wait_healthy(Duration::from_secs(30)));
    let new_master = cluster.nodes[cluster.master_of(&key)].port;
    assert_ne!(new_master, victim_port);
    eprintln!(
        "failover: {failed} failed decisions, slowest {slowest:?}; promoted after {:?}",
        killed.elapsed()
    );
    let everyone: Vec<&GatewayProcess> = gateways.iter().chain([&quick]).collect();
    for (i, gw) in everyone.iter().enumerate() {
        // Decided again (not 503) on the promoted shard, with a key of its own per instance.
        decides_again(gw, i, "/fresh", READY).await;
    }
    eprintln!(
        "limiting resumed {:?} after promotion began",
        promoted.elapsed()
    );
    // Exact again, on fresh keys, in the slot that failed over and in others.
    for run in ["before-2", "after", "after-2"] {
        let urls: Vec<String> = gateways.iter().map(|g| g.url("/fresh")).collect();
        let statuses = burst_with(&urls, 150, |_| vec![("x-run", run.to_string())]).await;
        assert_eq!(
            (count(&statuses, 200), count(&statuses, 429)),
            (50, 100),
            "burst 50 after the failover, x-run {run}: {statuses:?}"
        );
    }
}

/// A breaker per shard: one master SIGKILLed under load costs the requests whose counters live on
/// the other shards nothing. A fleet of workers decides on keys spread over all three masters
/// (`failure_mode: closed`, so a decision that fails is a 503) from before the kill until the
/// replica is promoted; the keys on healthy shards must all be decided (200), the killed shard's
/// keys fail under their failure mode and are decided again after the promotion. Its own cluster:
/// it changes the topology, and runs beside `a_fleet_on_a_redis_cluster`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_master_killed_under_load_costs_the_other_shards_nothing() {
    const WORKERS_PER_KEY: usize = 2;
    const LOAD_LIMIT: Duration = Duration::from_secs(30);
    const MAX_REQUESTS: usize = 200_000;
    let mut cluster = tokio::task::block_in_place(RedisCluster::start);
    // Redis itself refuses every command (`CLUSTERDOWN`) on every master while any slot has no
    // master, unless the Cluster is told to serve partial coverage (docs/redis.md).
    for node in &cluster.nodes {
        node.cli(&["config", "set", "cluster-require-full-coverage", "no"]);
    }
    let bucket = "token_bucket: { rate: 1000/s, burst: 1000000 }";
    let yaml = store(&cluster, "300ms")
        + "routes:\n"
        + &route("fresh", &policy("shared", "header:x-run", bucket));
    let gw = GatewayProcess::spawn_with_workers(&yaml, 2).await;
    wait_ready(&gw, 200, READY).await;
    let client = Client::new();
    let url = gw.url("/fresh");
    let first = client.get_with(&url, &[("x-run", "probe")]).await.status;
    assert_eq!(first, 200, "log:\n{}", gw.log());
    let probe = key_with(&cluster, &["{fresh:shared", "probe"]);

    // Two keys on each master (computed slots, each master asked which slots it serves).
    let masters = tokio::task::block_in_place(|| {
        let mut by_master: Vec<(usize, Vec<String>)> = Vec::new();
        for i in 0..200 {
            let value = format!("k{i}");
            let key = probe.replace("probe", &value);
            assert_eq!(
                fred::util::redis_keyslot(key.as_bytes()),
                cluster.slot(&key)
            );
            let master = cluster.master_of(&key);
            match by_master.iter_mut().find(|(m, _)| *m == master) {
                Some((_, values)) if values.len() < 2 => values.push(value),
                Some(_) => {}
                None => by_master.push((master, vec![value])),
            }
            if by_master.len() == 3 && by_master.iter().all(|(_, v)| v.len() == 2) {
                break;
            }
        }
        by_master
    });
    assert_eq!(masters.len(), 3, "keys on every master: {masters:?}");
    let (victim, doomed) = masters[0].clone();
    let healthy: Vec<String> = masters[1..].iter().flat_map(|(_, v)| v.clone()).collect();
    for value in doomed.iter().chain(&healthy) {
        assert_eq!(client.get_with(&url, &[("x-run", value)]).await.status, 200);
    }

    // The load: workers deciding in a loop on every key, until told to stop (bounded in time
    // and count). Each reports, per key, (decided, failed, slowest).
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let load_started = Instant::now();
    let mut workers = Vec::new();
    for value in doomed.iter().chain(&healthy) {
        for _ in 0..WORKERS_PER_KEY {
            let (client, url, value) = (client.clone(), url.clone(), value.clone());
            let (stop, sent) = (stop.clone(), sent.clone());
            workers.push(tokio::spawn(async move {
                let (mut decided, mut failed, mut slowest) = (0usize, 0usize, Duration::ZERO);
                while !stop.load(std::sync::atomic::Ordering::Relaxed)
                    && load_started.elapsed() < LOAD_LIMIT
                    && sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < MAX_REQUESTS
                {
                    let at = Instant::now();
                    let status = client.get_with(&url, &[("x-run", &value)]).await.status;
                    slowest = slowest.max(at.elapsed());
                    match status {
                        200 => decided += 1,
                        _ => failed += 1,
                    }
                }
                (value, decided, failed, slowest)
            }));
        }
    }
    // /readyz, polled meanwhile (503 while a shard has no master), for the record.
    let readiness = {
        let (client, url, stop) = (client.clone(), gw.admin_url("/readyz"), stop.clone());
        tokio::spawn(async move {
            let (mut polled, mut unready) = (0usize, 0usize);
            while !stop.load(std::sync::atomic::Ordering::Relaxed)
                && load_started.elapsed() < LOAD_LIMIT
            {
                polled += 1;
                if client.get(&url).await.status != 200 {
                    unready += 1;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (polled, unready)
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let victim_port = cluster.nodes[victim].port;
    let pid = cluster.nodes[victim].pid().expect("the victim runs");
    cluster.nodes[victim].kill();
    let killed = Instant::now();
    eprintln!("SIGKILLed master :{victim_port} (pid {pid}) under load");
    tokio::task::block_in_place(|| cluster.wait_healthy(Duration::from_secs(30)));
    let promoted = killed.elapsed();
    // The killed shard's keys are decided again after the promotion (bounded).
    let deadline = Instant::now() + READY;
    for value in &doomed {
        while client.get_with(&url, &[("x-run", value)]).await.status != 200 {
            assert!(
                Instant::now() < deadline,
                "the killed shard's key {value} was never decided again; log:\n{}",
                gw.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let recovered = killed.elapsed();
    // A little more load on the healed cluster, then stop.
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (mut healthy_decided, mut healthy_failed, mut doomed_failed) = (0, 0, 0);
    let mut slowest = Duration::ZERO;
    for worker in workers {
        let (value, decided, failed, slow) = worker.await.expect("worker");
        if healthy.contains(&value) {
            healthy_decided += decided;
            healthy_failed += failed;
            slowest = slowest.max(slow);
        } else {
            doomed_failed += failed;
        }
    }
    let (polled, unready) = readiness.await.expect("readiness poller");
    eprintln!("/readyz: {unready} of {polled} polls answered 503");
    eprintln!(
        "per-shard failover: promoted after {promoted:?}, killed shard deciding again after \
         {recovered:?}; healthy shards: {healthy_decided} decided, {healthy_failed} failed, \
         slowest {slowest:?}; killed shard: {doomed_failed} failed"
    );
    assert!(
        doomed_failed > 0,
        "the load reached the killed shard during its outage"
    );
    assert!(healthy_decided > 100, "the load ran: {healthy_decided}");
    assert_eq!(
        healthy_failed,
        0,
        "decisions on healthy shards failed during another shard's failover; log:\n{}",
        gw.log()
    );
}

/// The script's refund entry gives back exactly what one call consumed, for each kind of counter
/// (a single server is enough: the entry is the same on every shard).
#[test]
fn the_refund_entry_undoes_one_consumption_of_each_kind() {
    let redis = support::RedisServer::start();
    let script =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/decide.lua"))
            .expect("decide.lua");
    let now = "1000000000000";
    let eval = |args: &[&str]| {
        let mut all = vec!["eval", script.as_str()];
        all.extend_from_slice(args);
        redis.cli(&all)
    };
    // One consumption of 3 units from each kind, then its refund from the reply's stamps.
    let cases: [(&str, [&str; 4]); 3] = [
        ("r{a}:tb", ["tb", "1", "10", "0"]),
        ("r{b}:sw", ["sw", "10", "60000000", "0"]),
        ("r{c}:swb", ["swb", "10", "60000000", "6"]),
    ];
    for (key, [kind, p1, p2, p3]) in cases {
        let wire_kind = if kind == "swb" { "sw" } else { kind };
        // A first request of 2 units stays; the second (3 units) is refunded.
        for cost in ["2", "3"] {
            let reply = eval(&["1", key, now, wire_kind, p1, p2, p3, cost, "0"]);
            assert_eq!(reply[0], "1", "{key}: admitted: {reply:?}");
        }
        let reply = eval(&["1", key, now, wire_kind, p1, p2, p3, "3", "0"]);
        let (s1, s2) = (reply[6].clone(), reply[7].clone());
        let burst = if kind == "tb" { p2 } else { "0" };
        let done = eval(&["1", key, "refund", kind, "3", burst, &s1, &s2]);
        assert_eq!(done, ["1"], "{key}");
        // What is left is what the first two requests (5 units) left.
        let reply = eval(&["1", key, now, wire_kind, p1, p2, p3, "0", "0"]);
        assert_eq!(
            reply[3], "5",
            "{key}: remaining after the refund: {reply:?}"
        );
    }
}
