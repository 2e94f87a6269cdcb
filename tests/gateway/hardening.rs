//! Issue 9, items 5, 8, 9 and 10: what a client may cost the gateway and its upstreams. No tunnel
//! opens for an upgrade that is not allowed; a stalled body, an oversized head, too many
//! connections (to the gateway or from it to an upstream) and a stream-cancelling h2 client are
//! each bounded.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Method;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::support::client::{self, raw_connect, read_head};
use crate::support::{metric, Client, GatewayProcess, TestGateway, Upstream, LIVENESS};

/// Reads one response (head, then a `content-length` body) from `stream`.
async fn read_response(stream: &mut TcpStream) -> (String, Vec<u8>) {
    let (head, body, _) = client::read_response(stream, Vec::new()).await;
    (head, body)
}

fn forward_all(server: &str, upstream: &str) -> String {
    format!(
        r#"
server:
{server}
upstreams:
  up:
    url: http://$UPSTREAM
{upstream}
routes:
  - name: all
    upstream: up
"#
    )
}

// ---- item 5: upgrades ----

const H2C_UPGRADE: &[u8] =
    b"GET /h2c HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n\
    Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n";

/// Regression: `Upgrade: h2c` reached an upstream that switched, and the tunnel carried 100
/// requests no decision saw.
#[tokio::test]
async fn an_h2c_upgrade_cannot_open_a_tunnel_past_the_limiter() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(&forward_all("  {}", ""), upstream.addr).await;
    let mut stream = raw_connect(gw.public, H2C_UPGRADE).await;
    let (head, body) = read_response(&mut stream).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let echo: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let seen = echo["headers"].as_object().unwrap();
    for gone in ["upgrade", "connection", "http2-settings"] {
        assert!(!seen.contains_key(gone), "{gone} reached the upstream");
    }
    // The connection still speaks HTTP/1.1, and each request on it is a request of its own.
    stream
        .write_all(b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let (head, _) = read_response(&mut stream).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(upstream.requests(), 2);
}

#[tokio::test]
async fn an_upgrade_listing_a_protocol_not_allowed_beside_websocket_is_stripped() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(&forward_all("  {}", ""), upstream.addr).await;
    let mut stream = raw_connect(
        gw.public,
        b"GET / HTTP/1.1\r\nHost: x\r\nConnection: upgrade\r\nUpgrade: websocket, h2c\r\n\r\n",
    )
    .await;
    let (head, _) = read_response(&mut stream).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
}

#[tokio::test]
async fn allowed_upgrades_can_turn_websocket_off() {
    let upstream = Upstream::start().await;
    let gw =
        TestGateway::with_upstream(&forward_all("  allowed_upgrades: []", ""), upstream.addr).await;
    let mut stream = raw_connect(
        gw.public,
        b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: WebSocket\r\n\r\n",
    )
    .await;
    let (head, _) = read_response(&mut stream).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
}

/// An upstream that answers every request `101 Switching Protocols`, invited or not.
async fn always_switching_upstream() -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut chunk = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&chunk[..n]),
                    }
                }
                let _ = stream
                    .write_all(
                        b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: h2c\r\n\r\n",
                    )
                    .await;
                let mut sink = Vec::new();
                let _ = stream.read_to_end(&mut sink).await;
            });
        }
    });
    (addr, task)
}

#[tokio::test]
async fn an_upstream_switching_protocols_uninvited_is_a_502() {
    let (addr, task) = always_switching_upstream().await;
    let gw = TestGateway::with_upstream(&forward_all("  {}", "    timeout: 5s"), addr).await;
    let mut stream = raw_connect(gw.public, H2C_UPGRADE).await;
    let (head, _) = read_response(&mut stream).await;
    assert!(head.starts_with("HTTP/1.1 502"), "{head}");
    task.abort();
}

/// A WebSocket handshake for `key` (RFC 6455 §4.1; the test upstream echoes the tunnel's bytes).
fn websocket(key: &str) -> Vec<u8> {
    format!(
        "GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
         X-Key: {key}\r\n\r\n"
    )
    .into_bytes()
}

/// Opens a tunnel through the gateway: the 101, then one echoed round trip.
async fn open_tunnel(gw: &TestGateway, key: &str) -> Result<TcpStream, String> {
    let mut stream = raw_connect(gw.public, &websocket(key)).await;
    let (head, _rest) = read_head(&mut stream).await;
    if !head.starts_with("HTTP/1.1 101") {
        return Err(head);
    }
    stream.write_all(b"ping").await.expect("write");
    let mut echo = [0u8; 4];
    tokio::time::timeout(LIVENESS, stream.read_exact(&mut echo))
        .await
        .expect("echo in time")
        .expect("echo");
    assert_eq!(&echo, b"ping");
    Ok(stream)
}

/// Regression (issue 33, item 5): the lease was released at the `101`, so fifty tunnels opened
/// on one key whose concurrency limit was 2. A tunnel is a request that lasts: it holds its lease
/// (renewed) until it closes, and only then may another open.
#[tokio::test]
async fn a_websocket_tunnel_holds_its_concurrency_lease_until_it_closes() {
    let upstream = Upstream::start().await;
    let yaml = format!(
        "{}    policies:\n      - name: tunnels\n        key: [\"header:x-key\"]\n        \
         concurrency: {{ limit: 2, lease_ttl: 1s }}\n",
        forward_all("  {}", "    timeout: 5s")
    );
    let gw = TestGateway::with_upstream(&yaml, upstream.addr).await;
    let first = open_tunnel(&gw, "k").await.expect("first tunnel");
    let mut second = open_tunnel(&gw, "k").await.expect("second tunnel");
    // Past two lease TTLs: the tunnels' leases are renewed, not expired.
    tokio::time::sleep(Duration::from_millis(2200)).await;
    for _ in 0..3 {
        let refused = open_tunnel(&gw, "k").await.expect_err("a third tunnel");
        assert!(refused.starts_with("HTTP/1.1 429"), "{refused}");
    }
    // Another key has its own limit.
    let _other = open_tunnel(&gw, "other").await.expect("another key");
    // The open tunnels still carry bytes.
    second.write_all(b"pong").await.expect("write");
    let mut echo = [0u8; 4];
    second.read_exact(&mut echo).await.expect("echo");
    assert_eq!(&echo, b"pong");
    // A closed tunnel gives its lease back.
    drop(first);
    let deadline = Instant::now() + LIVENESS;
    let reopened = loop {
        match open_tunnel(&gw, "k").await {
            Ok(stream) => break stream,
            Err(head) if Instant::now() < deadline => {
                assert!(head.starts_with("HTTP/1.1 429"), "{head}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(head) => panic!("the closed tunnel's lease never came back: {head}"),
        }
    };
    drop((second, reopened));
}

/// A tunnel keeps its upstream connection's `max_connections` slot until it closes, so tunnels
/// cannot open connections past the bound either.
#[tokio::test]
async fn a_websocket_tunnel_counts_against_the_upstreams_max_connections() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(
        &forward_all(
            "  {}",
            "    timeout: 5s\n    max_connections: 2\n    pool_timeout: 300ms",
        ),
        upstream.addr,
    )
    .await;
    let first = open_tunnel(&gw, "a").await.expect("first tunnel");
    let _second = open_tunnel(&gw, "b").await.expect("second tunnel");
    let busy = open_tunnel(&gw, "c")
        .await
        .expect_err("no slot for a third");
    assert!(busy.starts_with("HTTP/1.1 503"), "{busy}");
    assert_eq!(Client::new().get(&gw.url("/")).await.status, 503);
    drop(first);
    let deadline = Instant::now() + LIVENESS;
    loop {
        let status = Client::new().get(&gw.url("/")).await.status;
        if status == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the closed tunnel's slot never came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Regression (issue 34, item 6): a tunnel's client connection gave back its
/// `server.max_connections` slot (and left `turnstile_open_connections`) at the `101`. It keeps
/// both until the tunnel closes; past the bound, new connections wait in the accept backlog.
#[tokio::test]
async fn a_websocket_tunnel_counts_against_server_max_connections() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(
        &forward_all("  max_connections: 2", "    timeout: 5s"),
        upstream.addr,
    )
    .await;
    let first = open_tunnel(&gw, "a").await.expect("first tunnel");
    let _second = open_tunnel(&gw, "b").await.expect("second tunnel");
    assert_eq!(
        gw.metric("turnstile_open_connections", &[("listener", "public")])
            .await,
        2.0
    );
    // A third connection is not served while both tunnels are open.
    let url = gw.url("/");
    let waiting = tokio::spawn(async move { Client::new().get(&url).await.status });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiting.is_finished(), "served past max_connections");
    drop(first);
    let status = tokio::time::timeout(LIVENESS, waiting)
        .await
        .expect("served once a tunnel closed")
        .expect("request task");
    assert_eq!(status, 200);
}

// ---- item 8: body read timeout and max_connections ----

#[tokio::test]
async fn a_stalled_body_gets_408_and_frees_the_upstream_connection() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(
        &forward_all("  body_read_timeout: 500ms", "    timeout: 20s"),
        upstream.addr,
    )
    .await;
    let started = Instant::now();
    let mut stream = raw_connect(
        gw.public,
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789",
    )
    .await;
    upstream.wait_for_requests(1).await;
    assert_eq!(upstream.open_connections(), 1);
    let (head, body) = read_response(&mut stream).await;
    let waited = started.elapsed();
    assert!(head.starts_with("HTTP/1.1 408"), "{head}");
    assert!(
        String::from_utf8_lossy(&body).contains("body_read_timeout"),
        "{body:?}"
    );
    assert!(waited >= Duration::from_millis(500), "408 after {waited:?}");
    assert!(
        waited < Duration::from_secs(10),
        "408 only after {waited:?}"
    );
    // The upstream request was aborted: its connection is closed, not left holding a half body.
    upstream.wait_for_open_connections_at_most(0).await;
    // And the client's connection is closed after the 408.
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(LIVENESS, stream.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "the client connection stayed open");
}

/// Sends one byte to `stream` every `every` (at most `max`) until the gateway answers.
async fn trickle_until_answered(stream: &TcpStream, every: Duration, max: usize) {
    for _ in 0..max {
        tokio::select! {
            _ = tokio::time::sleep(every) => {
                let _ = stream.try_write(b"x");
            }
            _ = stream.readable() => return,
        }
    }
}

/// Regression: a client sending one byte every 400 ms was never idle for `body_read_timeout`, so
/// it held its upstream connection for as long as it liked. By default (`min_body_rate: 1KiB/s`
/// after 5 s of waiting) it gets 408 after about 5 s, the upstream request is aborted, and it is
/// counted as `too_slow`, not as an upstream error.
#[tokio::test]
async fn a_body_trickling_below_the_default_min_body_rate_gets_408_and_is_counted() {
    let upstream = Upstream::start().await;
    let gw =
        TestGateway::with_upstream(&forward_all("  {}", "    timeout: 60s"), upstream.addr).await;
    let started = Instant::now();
    let mut stream = raw_connect(
        gw.public,
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0",
    )
    .await;
    upstream.wait_for_requests(1).await;
    trickle_until_answered(&stream, Duration::from_millis(400), 99).await;
    let (head, body) = read_response(&mut stream).await;
    let waited = started.elapsed();
    assert!(head.starts_with("HTTP/1.1 408"), "{head}");
    assert!(
        String::from_utf8_lossy(&body).contains("body_read_timeout"),
        "{body:?}"
    );
    assert!(waited >= Duration::from_secs(5), "408 after {waited:?}");
    assert!(
        waited < Duration::from_secs(15),
        "408 only after {waited:?}"
    );
    upstream.wait_for_open_connections_at_most(0).await;
    let metrics = gw.metrics().await;
    let cut = |reason| {
        metric(
            &metrics,
            "turnstile_request_body_timeouts_total",
            &[("route", "all"), ("reason", reason)],
        )
    };
    assert_eq!(cut("too_slow"), Some(1.0));
    assert_eq!(cut("idle"), Some(0.0));
    for kind in ["connect", "timeout", "busy", "other"] {
        let labels = [("route", "all"), ("kind", kind)];
        assert_eq!(
            metric(&metrics, "turnstile_upstream_errors_total", &labels),
            Some(0.0),
            "{kind}"
        );
    }
    let code = |code| {
        metric(
            &metrics,
            "turnstile_requests_total",
            &[("route", "all"), ("code", code)],
        )
    };
    assert_eq!((code("4xx"), code("2xx")), (Some(1.0), Some(0.0)));
}

/// `min_body_rate` is an average over the time spent waiting on the client, after the grace: a
/// client that sends 2 KiB/s in small chunks, long past the grace, is never cut off by a
/// 1 KiB/s minimum.
#[tokio::test]
async fn a_body_above_min_body_rate_passes_past_the_grace() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(
        &forward_all(
            "  min_body_rate: 1KiB/s\n  min_body_rate_grace: 500ms",
            "    timeout: 60s",
        ),
        upstream.addr,
    )
    .await;
    let mut stream = raw_connect(
        gw.public,
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 6000\r\n\r\n",
    )
    .await;
    // 100 bytes every 50 ms: 2 KB/s for 3 s, six times the grace.
    for _ in 0..60 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        stream.write_all(&[b'y'; 100]).await.unwrap();
    }
    let (head, body) = read_response(&mut stream).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let echo: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(echo["body_len"], 6000);
    let labels = [("route", "all"), ("reason", "too_slow")];
    assert_eq!(
        gw.metric("turnstile_request_body_timeouts_total", &labels)
            .await,
        0.0
    );
}

#[tokio::test]
async fn a_slow_body_that_keeps_sending_within_the_idle_timeout_passes() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(
        &forward_all("  body_read_timeout: 1s", "    timeout: 20s"),
        upstream.addr,
    )
    .await;
    let mut stream = raw_connect(
        gw.public,
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\n",
    )
    .await;
    // 6 bytes over ~1.5 s: longer than the timeout in all, never idle that long.
    for byte in b"abcdef" {
        tokio::time::sleep(Duration::from_millis(250)).await;
        stream.write_all(&[*byte]).await.unwrap();
    }
    let (head, body) = read_response(&mut stream).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let echo: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(echo["body_len"], 6);
}

#[tokio::test]
async fn max_connections_serves_exactly_that_many_at_once() {
    const MAX: usize = 4;
    const EXTRA: usize = 3;
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(
        &forward_all(&format!("  max_connections: {MAX}"), "    timeout: 20s"),
        upstream.addr,
    )
    .await;
    let mut streams = Vec::new();
    for i in 0..MAX + EXTRA {
        let request = format!("GET /{i} HTTP/1.1\r\nHost: x\r\nx-test-hold-head: 1\r\n\r\n");
        streams.push(raw_connect(gw.public, request.as_bytes()).await);
    }
    upstream.wait_for_requests(MAX).await;
    // Give the extra connections every chance to be (wrongly) served.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(upstream.requests(), MAX);
    let metrics = gw.metrics().await;
    assert_eq!(
        metric(
            &metrics,
            "turnstile_open_connections",
            &[("listener", "public")]
        ),
        Some(MAX as f64)
    );
    // As the first ones finish and close, the waiting ones are served.
    upstream.release(MAX + EXTRA);
    for mut stream in streams {
        let (head, _) = read_response(&mut stream).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        drop(stream);
    }
    assert_eq!(upstream.requests(), MAX + EXTRA);
}

// ---- item 9: header size and memory ----

#[tokio::test]
async fn a_head_over_max_header_size_gets_431() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(&forward_all("  max_header_size: 8KiB", ""), upstream.addr)
        .await;
    let fits = format!(
        "GET / HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
        "a".repeat(6 * 1024)
    );
    let mut stream = raw_connect(gw.public, fits.as_bytes()).await;
    let (head, _) = read_response(&mut stream).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");

    let too_big = format!(
        "GET / HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
        "a".repeat(9 * 1024)
    );
    let mut stream = TcpStream::connect(gw.public).await.unwrap();
    // The gateway may close while we still write; the answer is what counts.
    let _ = stream.write_all(too_big.as_bytes()).await;
    let (head, _) = read_head(&mut stream).await;
    assert!(head.starts_with("HTTP/1.1 431"), "{head}");
    assert_eq!(upstream.requests(), 1);
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

/// Regression: 1,000 connections each holding a partial 380 KB head raised RSS from 228 to
/// 512 MB. Now each head is cut at `max_header_size` (431), and heads within it hold at most that.
#[tokio::test]
async fn partial_heads_do_not_grow_memory_without_bound() {
    const CONNECTIONS: usize = 400;
    let upstream = Upstream::start().await;
    let yaml = forward_all("  header_read_timeout: 20s", "")
        .replace("$UPSTREAM", &upstream.addr.to_string());
    let gw = GatewayProcess::spawn(&yaml).await;
    assert_eq!(Client::new().get(&gw.url("/")).await.status, 200);
    let before = rss_kib(gw.pid());

    // Half send 380 KB of a head that never ends; half 30 KiB, just under the 32 KiB default.
    let mut held = Vec::new();
    let mut cut = 0;
    for i in 0..CONNECTIONS {
        let mut stream = TcpStream::connect(gw.public).await.unwrap();
        let len = if i % 2 == 0 { 380_000 } else { 30 * 1024 };
        let mut head = b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: ".to_vec();
        head.resize(len, b'a');
        let written = tokio::time::timeout(Duration::from_secs(5), stream.write_all(&head)).await;
        if i % 2 == 0 {
            // Cut off at the limit: a 431 (or a reset) arrives, never a 200.
            let mut answer = Vec::new();
            let _ = tokio::time::timeout(LIVENESS, stream.read_to_end(&mut answer)).await;
            let answer = String::from_utf8_lossy(&answer);
            assert!(
                answer.is_empty() || answer.starts_with("HTTP/1.1 431"),
                "{answer}"
            );
            cut += 1;
        } else {
            assert!(matches!(written, Ok(Ok(()))), "30 KiB head not accepted");
            held.push(stream);
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let during = rss_kib(gw.pid());
    let grown = during.saturating_sub(before);
    eprintln!(
        "RSS {before} KiB -> {during} KiB with {} partial heads held ({cut} cut at the limit)",
        held.len()
    );
    // 200 held heads of at most 32 KiB each, plus per-connection state: well under 200 × 96 KiB.
    // Before the bound, the 200 cut-off heads alone would have held 200 × 380 KB = 76 MB.
    assert!(grown < 200 * 96, "RSS grew by {grown} KiB");
    assert_eq!(upstream.requests(), 1);
}

// ---- item 10: connections per upstream, cancelled h2 streams ----

#[tokio::test]
async fn upstream_max_connections_caps_concurrent_upstream_connections_exactly() {
    const MAX: usize = 3;
    const REQUESTS: usize = 8;
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(
        &forward_all(
            "  {}",
            &format!("    timeout: 20s\n    max_connections: {MAX}\n    pool_timeout: 20s"),
        ),
        upstream.addr,
    )
    .await;
    let mut pending = Vec::new();
    for _ in 0..REQUESTS {
        let url = gw.url("/");
        pending.push(tokio::spawn(async move {
            Client::new()
                .get_with(&url, &[("x-test-hold-head", "1")])
                .await
                .status
        }));
    }
    upstream.wait_for_requests(MAX).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(upstream.requests(), MAX, "requests past the cap reached it");
    upstream.release(REQUESTS);
    for request in pending {
        assert_eq!(request.await.unwrap(), 200);
    }
    assert_eq!(upstream.requests(), REQUESTS);
    // The waiting requests reused the capped connections; none more was ever opened.
    assert_eq!(upstream.peak_open_connections(), MAX);
    assert_eq!(upstream.connections(), MAX);
}

/// A gateway whose upstream allows one connection, waiting `pool_timeout` for it, with that
/// connection held by a request whose response head the upstream holds back.
async fn one_connection_held(
    pool_timeout: &str,
) -> (Upstream, TestGateway, tokio::task::JoinHandle<u16>) {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(
        &forward_all(
            "  {}",
            &format!("    timeout: 20s\n    max_connections: 1\n    pool_timeout: {pool_timeout}"),
        ),
        upstream.addr,
    )
    .await;
    let url = gw.url("/");
    let held = tokio::spawn(async move {
        Client::new()
            .get_with(&url, &[("x-test-hold-head", "1")])
            .await
            .status
    });
    upstream.wait_for_requests(1).await;
    (upstream, gw, held)
}

#[tokio::test]
async fn a_request_waiting_longer_than_pool_timeout_gets_503() {
    let (upstream, gw, held) = one_connection_held("300ms").await;
    let started = Instant::now();
    let reply = Client::new().get(&gw.url("/")).await;
    assert_eq!(reply.status, 503);
    assert_eq!(reply.json()["error"], "upstream_busy");
    assert!(started.elapsed() >= Duration::from_millis(300));
    upstream.release(1);
    assert_eq!(held.await.unwrap(), 200);
    assert_eq!(upstream.requests(), 1);
}

/// Regression: a `pool_timeout` 503 was counted in no `turnstile_upstream_errors_total` series,
/// so an upstream short of connections paged no one.
#[tokio::test]
async fn pool_timeout_503s_are_counted_as_upstream_errors() {
    let (upstream, gw, held) = one_connection_held("200ms").await;
    for _ in 0..2 {
        assert_eq!(Client::new().get(&gw.url("/")).await.status, 503);
    }
    upstream.release(1);
    assert_eq!(held.await.unwrap(), 200);
    let metrics = gw.metrics().await;
    let errors = |kind| {
        metric(
            &metrics,
            "turnstile_upstream_errors_total",
            &[("route", "all"), ("kind", kind)],
        )
    };
    assert_eq!(errors("busy"), Some(2.0));
    assert_eq!(errors("timeout"), Some(0.0));
    assert_eq!(errors("connect"), Some(0.0));
    assert_eq!(errors("other"), Some(0.0));
    let target = upstream.addr.to_string();
    let attempts = |outcome| {
        metric(
            &metrics,
            "turnstile_upstream_requests_total",
            &[
                ("upstream", "up"),
                ("target", &target),
                ("outcome", outcome),
            ],
        )
    };
    assert_eq!(attempts("busy"), Some(2.0));
    assert_eq!(attempts("ok"), Some(1.0));
    assert_eq!(
        metric(
            &metrics,
            "turnstile_requests_total",
            &[("route", "all"), ("code", "5xx")]
        ),
        Some(2.0)
    );
}

/// Opens an h2c connection to `addr`; the connection is driven by a task whose handle is
/// returned (it ends when the server closes the connection).
async fn h2_connect(
    addr: std::net::SocketAddr,
) -> (
    h2::client::SendRequest<Bytes>,
    tokio::task::JoinHandle<Result<(), h2::Error>>,
) {
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (send, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
    (send, tokio::spawn(connection))
}

/// Sends a held GET and cancels it (RST_STREAM) once the upstream has it: accepted, then
/// cancelled.
async fn send_and_cancel(send: &mut h2::client::SendRequest<Bytes>, upstream: &Upstream) {
    let seen = upstream.requests();
    let request = http::Request::builder()
        .method(Method::GET)
        .uri("http://x/")
        .header("x-test-hold-head", "1")
        .body(())
        .unwrap();
    let ready = tokio::time::timeout(LIVENESS, send.clone().ready())
        .await
        .expect("h2 not ready in time")
        .expect("h2 connection failed");
    *send = ready;
    let (response, mut stream) = send.send_request(request, false).expect("send_request");
    upstream.wait_for_requests(seen + 1).await;
    stream.send_reset(h2::Reason::CANCEL);
    drop(response);
}

/// Regression: 49k h2 streams cancelled after acceptance cost 49k new upstream connections in
/// 30 s; the client connection lived on.
#[tokio::test]
async fn an_h2_client_cancelling_accepted_streams_rapidly_gets_goaway() {
    let upstream = Upstream::start().await;
    let gw =
        TestGateway::with_upstream(&forward_all("  {}", "    timeout: 20s"), upstream.addr).await;
    let limit = turnstile::listener::CANCEL_LIMIT as usize;
    let (mut send, connection) = h2_connect(gw.public).await;
    for _ in 0..limit {
        send_and_cancel(&mut send, &upstream).await;
    }
    // At the limit the connection still serves.
    let request = http::Request::get("http://x/").body(()).unwrap();
    send = tokio::time::timeout(LIVENESS, send.ready())
        .await
        .unwrap()
        .unwrap();
    let (response, _) = send.send_request(request, true).unwrap();
    let response = tokio::time::timeout(LIVENESS, response)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(response.status(), 200);
    assert!(!connection.is_finished());

    // One more, and the gateway says GOAWAY: the connection ends.
    send_and_cancel(&mut send, &upstream).await;
    let ended = tokio::time::timeout(LIVENESS, connection).await;
    assert!(ended.is_ok(), "the connection stayed open");
    let metrics = gw.metrics().await;
    assert_eq!(
        metric(
            &metrics,
            "turnstile_connection_goaways_total",
            &[("reason", "cancelled_streams")]
        ),
        Some(1.0)
    );
    // A new connection is served as usual.
    let reply = Client::http2().get(&gw.url("/")).await;
    assert_eq!(reply.status, 200);
}

#[tokio::test]
async fn an_h2_header_list_over_max_header_size_is_refused() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(&forward_all("  max_header_size: 8KiB", ""), upstream.addr)
        .await;
    let (send, _connection) = h2_connect(gw.public).await;
    let mut send = tokio::time::timeout(LIVENESS, send.ready())
        .await
        .unwrap()
        .unwrap();
    let request = http::Request::get("http://x/")
        .header("x-big", "a".repeat(9 * 1024))
        .body(())
        .unwrap();
    let (response, _) = send.send_request(request, true).unwrap();
    match tokio::time::timeout(LIVENESS, response).await.unwrap() {
        Ok(response) => assert_eq!(response.status(), 431),
        Err(e) => assert_eq!(e.reason(), Some(h2::Reason::REFUSED_STREAM), "{e}"),
    }
    // A header list within the bound is served on the same connection.
    let request = http::Request::get("http://x/")
        .header("x-big", "a".repeat(6 * 1024))
        .body(())
        .unwrap();
    let mut send = tokio::time::timeout(LIVENESS, send.ready())
        .await
        .unwrap()
        .unwrap();
    let (response, _) = send.send_request(request, true).unwrap();
    let response = tokio::time::timeout(LIVENESS, response)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(upstream.requests(), 1);
}
