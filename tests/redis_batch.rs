//! Concurrent decisions share script calls (`src/limiter/redis/batch.rs`), and each stays
//! all-or-nothing on its own: many concurrent requests on one store admit exactly the limit, in
//! fewer `EVALSHA` calls than decisions.

mod support;

use std::sync::Arc;
use std::time::Duration;

use turnstile::limiter::{Check, RedisStore, Rule, SlidingWindow, TokenBucket};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_decisions_share_calls_and_admit_exactly_the_limit() {
    let redis = support::redis::RedisServer::start();
    let store = Arc::new(
        RedisStore::connect(&redis.url(), 2, Duration::from_secs(5), "batch:").expect("store"),
    );
    assert!(store.wait_ready(Duration::from_secs(10)).await);
    let bucket = Rule::TokenBucket(TokenBucket {
        rate: 1.0 / 3600.0,
        burst: 50,
    });
    let window = Rule::SlidingWindow(SlidingWindow {
        limit: 30,
        window_us: 3_600_000_000,
        buckets: 0,
    });
    let calls_before = evalsha_calls(&redis);
    // 400 decisions, 100 at a time: each asks for one unit of the shared bucket and, every other
    // one, also one of the window (so a two-check decision must refuse both or consume both).
    let mut tasks = Vec::new();
    for i in 0..400u32 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let mut checks = vec![Check {
                key: "shared",
                rule: &bucket,
                cost: 1,
                shadow: false,
                max_delay_us: None,
            }];
            if i % 2 == 0 {
                checks.push(Check {
                    key: "window",
                    rule: &window,
                    cost: 1,
                    shadow: false,
                    max_delay_us: None,
                });
            }
            let d = store.check(&checks).await.expect("a decision");
            (d.allowed, checks.len())
        }));
    }
    let mut admitted = 0;
    let mut admitted_pairs = 0;
    for t in tasks {
        let (allowed, n) = t.await.expect("task");
        admitted += u32::from(allowed);
        admitted_pairs += u32::from(allowed && n == 2);
    }
    assert_eq!(admitted, 50, "the bucket admits exactly its burst");
    assert!(
        admitted_pairs <= 30,
        "{admitted_pairs} pairs past a window of 30"
    );
    // What Redis holds agrees with the admissions: all-or-nothing per decision.
    // The window's units: its newest member's count less the base (docs/redis.md), no member
    // having left the window.
    let members = redis.cli(&["zrange", "batch:{window}:sw:2", "0", "-1", "withscores"]);
    let newest = members[members.len() - 2]
        .rsplit('#')
        .next()
        .expect("count");
    let newest: f64 = newest.parse().expect("count");
    assert_eq!(members[..2], ["n", "-1"], "the base: {members:?}");
    assert_eq!(newest, f64::from(admitted_pairs));
    let calls = evalsha_calls(&redis) - calls_before;
    assert!(
        calls < 400,
        "400 concurrent decisions took {calls} script calls: none were batched"
    );
}

/// `EVALSHA` calls Redis has served (INFO commandstats).
fn evalsha_calls(redis: &support::redis::RedisServer) -> u64 {
    redis
        .cli(&["info", "commandstats"])
        .iter()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|l| l.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// decide.lua's packed batch (the gateway's call: two arguments, one reply string, both
/// little-endian doubles) decides exactly as the plain batch: the same integers, stamps of
/// microsecond timestamps and fractional token counts included.
#[test]
fn a_packed_batch_answers_what_the_plain_batch_answers() {
    let redis = support::redis::RedisServer::start();
    let script =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/decide.lua"))
            .expect("decide.lua");
    let now = 1_763_900_000_123_457u64;
    // Three decisions on a bucket (fractional refill) and a window, then a quota alone.
    let decisions: Vec<(u64, Vec<[String; 6]>)> = vec![
        (now, vec![tb_args(1), sw_args(1)]),
        (now + 1_700, vec![tb_args(2), sw_args(1)]),
        (now + 2_900_001, vec![tb_args(1), sw_args(2)]),
        (now + 3_000_000, vec![q_args(now)]),
    ];
    let keys = |prefix: &str| -> Vec<String> {
        let checks = decisions.iter().flat_map(|(_, checks)| checks);
        checks.map(|c| format!("{prefix}{{k}}:{}", c[0])).collect()
    };

    let mut plain_args: Vec<String> = vec!["eval".into(), script.clone()];
    let plain_keys = keys("plain:");
    plain_args.push(plain_keys.len().to_string());
    plain_args.extend(plain_keys);
    plain_args.push("batch".into());
    for (at, checks) in &decisions {
        plain_args.push(at.to_string());
        plain_args.push(checks.len().to_string());
        for c in checks {
            plain_args.extend(c.iter().cloned());
        }
    }
    let refs: Vec<&str> = plain_args.iter().map(String::as_str).collect();
    let reply = redis.cli(&refs);
    let plain: Vec<i64> = reply
        .iter()
        .flat_map(|line| line.split_whitespace())
        .map(|n| {
            n.parse()
                .unwrap_or_else(|_| panic!("not an integer: {reply:?}"))
        })
        .collect();

    // The same words as doubles, the way `wire::pack` writes them (the kind as its number).
    let mut blob = Vec::new();
    let mut put = |v: f64| blob.extend_from_slice(&v.to_le_bytes());
    for (at, checks) in &decisions {
        put(*at as f64);
        put(checks.len() as f64);
        for c in checks {
            put(match c[0].as_str() {
                "tb" => 1.0,
                "sw" => 2.0,
                "cc" => 3.0,
                _ => 4.0,
            });
            for word in &c[1..] {
                put(word.parse().expect("a number"));
            }
        }
    }
    let packed_keys = keys("packed:");
    let mut args: Vec<&[u8]> = vec![b"EVAL", script.as_bytes()];
    let count = packed_keys.len().to_string();
    args.push(count.as_bytes());
    args.extend(packed_keys.iter().map(|k| k.as_bytes()));
    args.push(b"packed");
    args.push(&blob);
    let packed = doubles(&call(redis.port, &args));

    assert_eq!(plain.len(), (1 + 7 * 2) * 3 + (1 + 7));
    assert_eq!(packed, plain);
    // Some decision refused, some admitted: the comparison covered both.
    assert!(plain.contains(&0) && plain.contains(&1));
    // A negative now is Redis TIME, as "" is in the plain form.
    let timed: Vec<u8> = [-1.0, 1.0, 1.0, 0.5, 3.0, 0.0, 1.0, 0.0]
        .iter()
        .flat_map(|v: &f64| v.to_le_bytes())
        .collect();
    let packed_call = |blob: &[u8]| {
        let args: [&[u8]; 6] = [
            b"EVAL",
            script.as_bytes(),
            b"1",
            b"t{k}:tb",
            b"packed",
            blob,
        ];
        call(redis.port, &args)
    };
    let reply = doubles(&packed_call(&timed));
    assert_eq!(reply.len(), 8, "{reply:?}");
    assert_eq!(reply[..3], [1, 1, 3]);
    // A malformed batch is an error reply, not a decision.
    let refused = packed_call(&timed[..60]);
    assert!(
        refused.starts_with(b"-"),
        "{:?}",
        String::from_utf8_lossy(&refused)
    );
}

/// One command in RESP over a fresh connection; the reply's bulk string, or the error line.
fn call(port: u16, args: &[&[u8]]) -> Vec<u8> {
    use std::io::{BufRead, BufReader, Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
    stream.write_all(&out).expect("write");
    let mut reader = BufReader::new(stream);
    let mut line = Vec::new();
    reader.read_until(b'\n', &mut line).expect("reply");
    if line.first() != Some(&b'$') {
        return line;
    }
    let len: usize = std::str::from_utf8(&line[1..line.len() - 2])
        .expect("length")
        .parse()
        .expect("length");
    let mut body = vec![0u8; len + 2];
    reader.read_exact(&mut body).expect("body");
    body.truncate(len);
    body
}

/// A packed reply's integers: little-endian doubles, truncated as Redis truncates Lua numbers.
fn doubles(bytes: &[u8]) -> Vec<i64> {
    assert_eq!(
        bytes.len() % 8,
        0,
        "not a packed reply: {:?}",
        String::from_utf8_lossy(bytes)
    );
    bytes
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as i64)
        .collect()
}

fn tb_args(cost: u64) -> [String; 6] {
    ["tb", "0.3333333333333333", "3", "0", &cost.to_string(), "0"].map(String::from)
}

fn sw_args(cost: u64) -> [String; 6] {
    ["sw", "3", "3000000", "0", &cost.to_string(), "0"].map(String::from)
}

fn q_args(now: u64) -> [String; 6] {
    let start = now - now % 86_400_000_000;
    [
        "q".to_string(),
        "2".to_string(),
        start.to_string(),
        (start + 86_400_000_000).to_string(),
        "1".to_string(),
        "1".to_string(),
    ]
}

/// One decision of a plain batch: microseconds after a start, then its checks as (counter, the
/// check's six arguments).
type Decision = (u64, Vec<(&'static str, [String; 6])>);

/// A run of single-bucket decisions on one bucket reads it once and writes it once
/// (decide.lua's kept bucket), and answers and stores exactly what separate calls do: the same
/// integers, the same tokens and timestamp, the TTL of the run's last commit. Runs broken by
/// another bucket, by a decision with several checks on that bucket, and by a refusal are in it.
#[test]
fn a_run_on_one_bucket_answers_and_stores_what_separate_calls_do() {
    let redis = support::redis::RedisServer::start();
    let script =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/decide.lua"))
            .expect("decide.lua");
    let now = 1_763_900_000_123_457u64;
    let a = |cost: u64| ("a", tb_args(cost));
    let b = |cost: u64| ("b", tb_args(cost));
    let w = || ("w", sw_args(1));
    let decisions: Vec<Decision> = vec![
        (0, vec![a(1)]),
        (1_700, vec![a(1)]),
        (1_700, vec![a(5)]), // refused: over the burst
        (2_000, vec![a(1)]),
        (2_000, vec![a(1)]), // refused: empty
        (2_500, vec![b(1)]),
        (900_000, vec![a(1)]), // refused: a third of a token
        (3_100_000, vec![a(1), w()]),
        (3_100_000, vec![a(1)]), // refused
        (6_100_000, vec![a(1)]),
        (6_100_000, vec![a(0)]),
        (8_000_000, vec![a(1)]), // refused
        (9_000_000, vec![b(2)]),
        (9_000_000, vec![b(1)]), // a run of two commits, each with its own TTL
    ];
    let key = |prefix: &str, counter: &str, kind: &str| format!("{prefix}{{{counter}}}:{kind}");
    let batch_words = |prefix: &str, decisions: &[Decision]| {
        let mut keys = Vec::new();
        let mut argv = vec!["batch".to_string()];
        for (at, checks) in decisions {
            argv.push((now + at).to_string());
            argv.push(checks.len().to_string());
            for (counter, args) in checks {
                keys.push(key(prefix, counter, &args[0]));
                argv.extend(args.iter().cloned());
            }
        }
        let mut words = vec!["eval".to_string(), script.clone(), keys.len().to_string()];
        words.extend(keys);
        words.extend(argv);
        words
    };
    let integers = |words: Vec<String>| -> Vec<i64> {
        let refs: Vec<&str> = words.iter().map(String::as_str).collect();
        let reply = redis.cli(&refs);
        reply
            .iter()
            .flat_map(|line| line.split_whitespace())
            .map(|n| {
                n.parse()
                    .unwrap_or_else(|_| panic!("not an integer: {reply:?}"))
            })
            .collect()
    };

    let together = integers(batch_words("run:", &decisions));
    let mut separate = Vec::new();
    for d in &decisions {
        separate.extend(integers(batch_words("one:", std::slice::from_ref(d))));
    }
    assert_eq!(together, separate);
    // Each decision's reply is its verdict, then seven integers per check.
    let mut verdicts = Vec::new();
    let mut at = 0;
    for (_, checks) in &decisions {
        verdicts.push(together[at]);
        at += 1 + 7 * checks.len();
    }
    assert_eq!(verdicts, [1, 1, 0, 1, 0, 1, 0, 1, 0, 1, 1, 0, 1, 1]);

    for (counter, kind) in [("a", "tb"), ("b", "tb"), ("w", "sw")] {
        let (run, one) = (key("run:", counter, kind), key("one:", counter, kind));
        if kind == "tb" {
            for field in ["t", "ts"] {
                assert_eq!(
                    redis.cli(&["hget", &run, field]),
                    redis.cli(&["hget", &one, field]),
                    "{counter}.{field}"
                );
            }
        }
        let pttl = |k: &str| -> i64 { redis.cli(&["pttl", k])[0].parse().expect("pttl") };
        let (run_ttl, one_ttl) = (pttl(&run), pttl(&one));
        assert!(run_ttl > 0, "{run} has no TTL");
        // The separate calls ran later, so theirs is at most the time between longer.
        assert!(
            (one_ttl - run_ttl).abs() < 500,
            "{counter}: TTL {run_ttl} ms in a run, {one_ttl} ms alone"
        );
    }

    // A malformed decision fails the call; the decisions before it stand, as separate calls'.
    let mut words = batch_words("bad:", &decisions[..2]);
    words.extend(["x", "1"].map(String::from));
    let reply = redis.cli(&words.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(reply.join(" ").contains("bad"), "{reply:?}");
    for d in &decisions[..2] {
        integers(batch_words("good:", std::slice::from_ref(d)));
    }
    for field in ["t", "ts"] {
        assert_eq!(
            redis.cli(&["hget", &key("bad:", "a", "tb"), field]),
            redis.cli(&["hget", &key("good:", "a", "tb"), field]),
            "{field} after a malformed third decision"
        );
    }
}
