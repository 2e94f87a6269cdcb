//! The heavy-hitters sketch behind `/debug/top-limited`: bounded memory under a flood of distinct
//! keys, heavy hitters always reported with honest bounds, and periods that roll over.

mod support;

use std::collections::HashMap;
use std::sync::Arc;

use turnstile::limiter::ManualClock;
use turnstile::top_limited::{TopLimited, MAX_KEY_BYTES};

const PERIOD_US: u64 = 60_000_000;

fn sketch(capacity: usize) -> (Arc<ManualClock>, TopLimited) {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let top = TopLimited::new(clock.clone(), capacity, PERIOD_US);
    (clock, top)
}

/// A deterministic generator, so a failure replays.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn exact_while_under_capacity() {
    let (_, top) = sketch(8);
    for _ in 0..5 {
        top.record("users", "per_user", "u1");
    }
    top.record("users", "per_user", "u2");
    top.record("users", "per_ip", "u2");
    top.record("search", "per_user", "u1");

    let report = top.report(10);
    assert_eq!(report.current.limited, 8);
    let keys: Vec<_> = report
        .current
        .keys
        .iter()
        .map(|k| {
            (
                k.route.as_str(),
                k.policy.as_str(),
                k.key.as_str(),
                k.count,
                k.error,
            )
        })
        .collect();
    assert_eq!(keys[0], ("users", "per_user", "u1", 5, 0));
    assert_eq!(
        keys.len(),
        4,
        "the same key under another policy or route is another entry"
    );
    assert!(keys.iter().all(|k| k.4 == 0));
    assert!(report.previous.is_none());
}

#[test]
fn flood_of_distinct_keys_stays_bounded_and_reports_heavy_hitters() {
    const CAPACITY: usize = 64;
    const DISTINCT: u64 = 200_000;
    let (_, top) = sketch(CAPACITY);
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    let heavy = [
        ("users", "per_user", "attacker-1"),
        ("users", "per_ip", "203.0.113.7"),
        ("login", "per_ip", "198.51.100.9"),
    ];
    let mut truth: HashMap<&str, u64> = HashMap::new();

    // Warm up the slots' buffers, then measure.
    for i in 0..(CAPACITY as u64 * 4) {
        top.record("users", "per_user", &format!("warm-{i}"));
    }
    let warm_bytes = top.memory_bytes();
    let mut total = CAPACITY as u64 * 4;

    // A flood of one-off keys (long ones too), with three heavy hitters at 2% each.
    let long_key = "k".repeat(MAX_KEY_BYTES * 4);
    for i in 0..DISTINCT {
        let r = rng.next() % 100;
        if r < 6 {
            let (route, policy, key) = heavy[(r / 2) as usize];
            top.record(route, policy, key);
            *truth.entry(key).or_default() += 1;
        } else if i % 1000 == 0 {
            top.record("users", "per_user", &format!("{long_key}{i}"));
        } else {
            top.record("users", "per_user", &format!("one-off-{i}-{}", rng.next()));
        }
        total += 1;
    }

    let bytes = top.memory_bytes();
    assert!(
        bytes <= warm_bytes + 2 * CAPACITY * (MAX_KEY_BYTES + 64),
        "memory grew with distinct keys: {warm_bytes} -> {bytes} bytes"
    );
    assert!(bytes < 256 * 1024, "{bytes} bytes for {CAPACITY} slots");

    let report = top.report(CAPACITY);
    assert_eq!(report.current.limited, total);
    assert_eq!(report.current.keys.len(), CAPACITY);
    assert_eq!(report.current.guaranteed_above, total / CAPACITY as u64);
    for (route, policy, key) in heavy {
        let true_count = truth[key];
        assert!(
            true_count > report.current.guaranteed_above,
            "the test's heavy hitters must be heavy"
        );
        let entry = report.current.keys[..3]
            .iter()
            .find(|k| k.key == key)
            .unwrap_or_else(|| {
                panic!(
                    "{key} is not among the top 3: {:?}",
                    &report.current.keys[..5]
                )
            });
        assert_eq!(
            (entry.route.as_str(), entry.policy.as_str()),
            (route, policy)
        );
        assert!(
            entry.count - entry.error <= true_count && true_count <= entry.count,
            "{key}: true {true_count} outside [{} - {}, {}]",
            entry.count,
            entry.error,
            entry.count
        );
    }
    // Every monitored count is an upper bound, and the counts add up to what was recorded.
    let sum: u64 = report.current.keys.iter().map(|k| k.count).sum();
    assert_eq!(sum, total, "Space-Saving's counts sum to the stream length");
    assert!(report
        .current
        .keys
        .iter()
        .all(|k| k.key.len() <= MAX_KEY_BYTES));
}

#[test]
fn long_keys_are_told_apart_by_digest() {
    let (_, top) = sketch(8);
    let a = "a".repeat(MAX_KEY_BYTES + 1);
    let b = format!("{}b", "a".repeat(MAX_KEY_BYTES));
    top.record("r", "p", &a);
    top.record("r", "p", &a);
    top.record("r", "p", &b);
    let keys = top.report(8).current.keys;
    assert_eq!(keys.len(), 2);
    assert_eq!(keys[0].count, 2);
    assert!(keys
        .iter()
        .all(|k| k.key.starts_with("sha256:") && k.key.len() == 71));
    assert_ne!(keys[0].key, keys[1].key);
}

#[test]
fn periods_roll_over() {
    let (clock, top) = sketch(8);
    top.record("users", "per_user", "old");
    clock.advance_us(PERIOD_US);
    top.record("users", "per_user", "new");
    top.record("users", "per_user", "new");

    let report = top.report(8);
    assert_eq!(report.current.limited, 2);
    assert_eq!(report.current.keys[0].key, "new");
    let previous = report.previous.expect("the first period is complete");
    assert_eq!(previous.limited, 1);
    assert_eq!(previous.keys[0].key, "old");

    // Two idle periods later, nothing is left.
    clock.advance_us(2 * PERIOD_US);
    let report = top.report(8);
    assert_eq!(report.current.limited, 0);
    let previous = report.previous.expect("complete, and empty");
    assert_eq!(previous.limited, 0);
    assert!(previous.keys.is_empty());
}

#[test]
fn report_is_limited_to_n() {
    let (_, top) = sketch(16);
    for i in 0..10u64 {
        for _ in 0..=i {
            top.record("r", "p", &format!("k{i}"));
        }
    }
    let keys = top.report(3).current.keys;
    let names: Vec<_> = keys.iter().map(|k| (k.key.as_str(), k.count)).collect();
    assert_eq!(names, [("k9", 10), ("k8", 9), ("k7", 8)]);
}

/// Through the gateway: a flood of distinct limited keys and one heavy hitter, read back from
/// `/debug/top-limited` on the admin listener.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_endpoint_reports_the_heaviest_limited_keys() {
    let gw = support::TestGateway::start(
        r#"
admin: { show_key_values: true }
routes:
  - name: users
    match:
      path: /api/users/{user_id}
    respond: { status: 200, body: "ok" }
    policies:
      - name: per_user
        key: [path:user_id]
        token_bucket: { rate: 1/h, burst: 1 }
"#,
    )
    .await;
    // 400 one-off users limited once each (their first request passes), and mallory limited 150
    // times.
    let mut limited = 0u64;
    for i in 0..400 {
        assert_eq!(gw.get(&format!("/api/users/u{i}")).await, 200);
        assert_eq!(gw.get(&format!("/api/users/u{i}")).await, 429);
        limited += 1;
        if i % 2 == 0 {
            assert_eq!(
                gw.get("/api/users/mallory").await,
                if i == 0 { 200 } else { 429 }
            );
            limited += u64::from(i != 0);
        }
    }
    for _ in 0..=50 {
        assert_eq!(gw.get("/api/users/mallory").await, 429);
        limited += 1;
    }

    let (status, body) = gw.admin_get("/debug/top-limited?n=5").await;
    assert_eq!(status, 200, "{body}");
    let json = body.trim_start_matches(|c: char| c != '{');
    let json = &json[..=json.rfind('}').expect("a JSON object")];
    let report: serde_json::Value = serde_json::from_str(json).expect("JSON");
    let current = &report["current"];
    assert_eq!(current["limited"], limited, "every 429 was recorded");
    let keys = current["keys"].as_array().expect("keys");
    assert_eq!(keys.len(), 5, "?n=5");
    assert_eq!(keys[0]["route"], "users");
    assert_eq!(keys[0]["policy"], "per_user");
    assert_eq!(
        keys[0]["key"], "mallory",
        "the key's value, without route and policy"
    );
    let (count, error) = (
        keys[0]["count"].as_u64().unwrap(),
        keys[0]["error"].as_u64().unwrap(),
    );
    assert!(
        count - error <= 250 && 250 <= count,
        "mallory: 250 limited, reported {count} - {error}"
    );
    assert_eq!(report["capacity"], turnstile::top_limited::DEFAULT_CAPACITY);

    let (_, body) = gw.admin_get("/debug/top-limited").await;
    assert!(body.contains("\"keys\""));
    gw.shutdown().await;
}

/// The first key of `/debug/top-limited`'s current period, and the whole body.
async fn top_key(gw: &support::TestGateway) -> (String, String) {
    let (status, body) = gw.admin_get("/debug/top-limited?n=1").await;
    assert_eq!(status, 200, "{body}");
    let json = body.trim_start_matches(|c: char| c != '{');
    let json = &json[..=json.rfind('}').expect("a JSON object")];
    let report: serde_json::Value = serde_json::from_str(json).expect("JSON");
    let key = report["current"]["keys"][0]["key"]
        .as_str()
        .unwrap_or_else(|| panic!("no key listed: {body}"))
        .to_string();
    (key, body)
}

/// Keys can be secrets (an API key in `header:x-api-key`): by default the admin endpoint shows a
/// short SHA-256 digest of each, and the raw value only with `admin.show_key_values: true`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_limited_shows_key_digests_unless_show_key_values() {
    use sha2::{Digest, Sha256};
    const SECRET: &str = "sk-live-s3cret-api-key";
    let config = |admin: &str| {
        format!(
            r#"
{admin}
routes:
  - name: api
    respond: {{ status: 200, body: "ok" }}
    policies:
      - name: per_key
        key: ["header:x-api-key"]
        token_bucket: {{ rate: 1/h, burst: 1 }}
"#
        )
    };
    let gw = support::TestGateway::start(&config("")).await;
    let client = support::Client::new();
    let url = gw.url("/");
    let statuses: Vec<u16> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            v.push(client.get_with(&url, &[("x-api-key", SECRET)]).await.status);
        }
        v
    };
    assert_eq!(statuses, [200, 429, 429]);

    let hex: String = Sha256::digest(SECRET.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let (key, body) = top_key(&gw).await;
    assert_eq!(key, format!("sha256:{}", &hex[..12]), "{body}");
    assert!(!body.contains("s3cret"), "the raw key leaked: {body}");

    // Opting in (a reload is enough: the endpoint reads the running config).
    gw.reload_with(&config("admin: { show_key_values: true }"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let (key, _) = top_key(&gw).await;
    assert_eq!(key, SECRET);

    // And back: values hidden again, an unknown field under `admin` refused.
    gw.reload_with(&config("admin: { show_key_values: false }"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(top_key(&gw).await.0, format!("sha256:{}", &hex[..12]));
    let e = gw
        .reload_with(&config("admin: { show_keys: true }"))
        .await
        .expect_err("unknown field");
    assert!(
        e.to_string().contains("admin: unknown field `show_keys`"),
        "{e}"
    );
    drop(client);
    gw.shutdown().await;
}
