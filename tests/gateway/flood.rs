//! Issue 9, item 4, on the real binary: a flood of distinct keys against a small memory store
//! (`max_keys: 1000`) must not reset an exhausted key, nor idle exhausted keys, and must not grow
//! memory past the bound.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::{Client, GatewayProcess};

/// Distinct keys in the flood: 60 times `max_keys`, bounded so the test takes seconds.
const FLOOD: usize = 60_000;
const TASKS: usize = 8;
/// The flood stops here whatever it has sent (the assertions still run).
const FLOOD_TIME: Duration = Duration::from_secs(40);

const CONFIG: &str = r#"
store: { type: memory, max_keys: 1000 }
routes:
  - name: api
    respond: { body: ok }
    policies:
      - { name: per_key, key: ["header:x-key"], token_bucket: { rate: 1/h, burst: 5 } }
"#;

/// The child's resident memory in KiB, from /proc/PID/status.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

async fn admitted(c: &Client, url: &str, key: &str, tries: usize) -> usize {
    let mut n = 0;
    for _ in 0..tries {
        if c.get_with(url, &[("x-key", key)]).await.status == 200 {
            n += 1;
        }
    }
    n
}

/// Regression: ~1M distinct keys admitted an exhausted key 77 of 90 times and reset 34 of 50 idle
/// exhausted keys, because a full store forgot counters in use to make room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_new_keys_never_resets_an_exhausted_key() {
    let gw = GatewayProcess::spawn(CONFIG).await;
    let c = Client::new();
    let url = gw.url("/");
    assert_eq!(admitted(&c, &url, "victim", 8).await, 5);
    for i in 0..50 {
        assert_eq!(
            admitted(&c, &url, &format!("idle-{i}"), 6).await,
            5,
            "idle-{i}"
        );
    }
    let rss_before = rss_kib(gw.pid());

    // The flood, with the victim probed throughout by one task.
    let sent = Arc::new(AtomicUsize::new(0));
    let deadline = Instant::now() + FLOOD_TIME;
    let flood: Vec<_> = (0..TASKS)
        .map(|t| {
            let (c, url, sent) = (c.clone(), url.clone(), sent.clone());
            tokio::spawn(async move {
                let mut victim_admitted = 0;
                for n in 0..FLOOD / TASKS {
                    if Instant::now() > deadline {
                        break;
                    }
                    let key = format!("flood-{t}-{n}");
                    let status = c.get_with(&url, &[("x-key", &key)]).await.status;
                    assert!(status == 200 || status == 429, "{key}: {status}");
                    sent.fetch_add(1, Ordering::Relaxed);
                    if t == 0 && n % 100 == 0 {
                        victim_admitted += admitted(&c, &url, "victim", 1).await;
                    }
                }
                victim_admitted
            })
        })
        .collect();
    let mut victim_during = 0;
    for task in flood {
        victim_during += task.await.expect("flood task");
    }
    let sent = sent.load(Ordering::Relaxed);
    assert!(
        sent >= 20_000,
        "only {sent} flood requests in {FLOOD_TIME:?}"
    );
    assert_eq!(
        victim_during, 0,
        "the exhausted key was admitted during the flood"
    );

    // Exact: the exhausted key is refused every time, and every idle exhausted key stays so.
    assert_eq!(admitted(&c, &url, "victim", 50).await, 0);
    for i in 0..50 {
        assert_eq!(
            admitted(&c, &url, &format!("idle-{i}"), 1).await,
            0,
            "idle-{i}"
        );
    }
    // Bounded: a store that kept every key would hold ~100 bytes for each of the flood's keys.
    let rss_after = rss_kib(gw.pid());
    let growth = rss_after.saturating_sub(rss_before);
    eprintln!("flood of {sent} keys: RSS {rss_before} KiB -> {rss_after} KiB");
    assert!(
        growth < 4 * 1024,
        "RSS grew {growth} KiB ({rss_before} -> {rss_after}) over {sent} flood keys"
    );
}
