//! The proxy: what reaches the upstream, what comes back, how bodies stream, and how failures are
//! answered.

use bytes::Bytes;
use http::Method;
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::client::{
    channel_body, empty, full, raw_connect, read_head, read_response, request,
};
use crate::support::upstream::unreachable_addr;
use crate::support::{metric, Client, TestGateway, Upstream, LIVENESS};

const FORWARD_ALL: &str = r#"
upstreams:
  up:
    url: http://$UPSTREAM
    timeout: 1s
server:
  max_body_size: 1KiB
routes:
  - name: all
    upstream: up
"#;

async fn start() -> (Upstream, TestGateway) {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(FORWARD_ALL, upstream.addr).await;
    (upstream, gw)
}

#[tokio::test]
async fn the_upstream_gets_method_path_query_and_body() {
    let (upstream, gw) = start().await;
    let req = request(Method::POST, &gw.url("/a/b?c=d&e"))
        .header("x-custom", "1")
        .body(full("hello"))
        .unwrap();
    let reply = Client::new().send(req).await;
    assert_eq!(reply.status, 200);
    let echo = reply.json();
    assert_eq!(echo["method"], "POST");
    assert_eq!(echo["path"], "/a/b?c=d&e");
    assert_eq!(echo["body_len"], 5);
    assert_eq!(echo["headers"]["x-custom"][0], "1");
    assert_eq!(upstream.requests(), 1);
}

#[tokio::test]
async fn forwarded_headers_are_appended_and_set() {
    let (_upstream, gw) = start().await;
    let c = Client::new();
    let echo = c
        .get_with(&gw.url("/"), &[("host", "shop.example:8080")])
        .await
        .json();
    let h = &echo["headers"];
    assert_eq!(h["x-forwarded-for"][0], "127.0.0.1");
    assert_eq!(h["x-forwarded-proto"][0], "http");
    assert_eq!(h["x-forwarded-host"][0], "shop.example:8080");
    assert_eq!(h["host"][0], "shop.example:8080");

    // An untrusted client's own claims are replaced by what the gateway saw.
    let echo = c
        .get_with(
            &gw.url("/"),
            &[
                ("x-forwarded-for", "203.0.113.7"),
                ("x-forwarded-proto", "https"),
                ("x-forwarded-host", "forged.example"),
            ],
        )
        .await
        .json();
    let h = &echo["headers"];
    assert_eq!(h["x-forwarded-for"], serde_json::json!(["127.0.0.1"]));
    assert_eq!(h["x-forwarded-proto"], serde_json::json!(["http"]));
    assert_eq!(
        h["x-forwarded-host"],
        serde_json::json!([format!("{}", gw.public)])
    );
}

#[tokio::test]
async fn hop_by_hop_request_headers_stop_at_the_gateway() {
    let (_upstream, gw) = start().await;
    let echo = Client::new()
        .get_with(
            &gw.url("/"),
            &[
                ("connection", "x-secret, keep-alive"),
                ("x-secret", "1"),
                ("keep-alive", "timeout=5"),
                ("proxy-connection", "keep-alive"),
                ("te", "trailers"),
                ("trailer", "x-checksum"),
                ("upgrade", "h2c"),
                ("x-end-to-end", "kept"),
            ],
        )
        .await
        .json();
    let h = echo["headers"].as_object().unwrap();
    for gone in [
        "connection",
        "x-secret",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "upgrade",
        "transfer-encoding",
    ] {
        assert!(!h.contains_key(gone), "{gone} reached the upstream: {h:?}");
    }
    assert_eq!(h["x-end-to-end"][0], "kept");
}

#[tokio::test]
async fn hop_by_hop_response_headers_stop_at_the_gateway() {
    let (_upstream, gw) = start().await;
    let reply = Client::new()
        .get_with(&gw.url("/"), &[("x-test-hop-response", "1")])
        .await;
    assert_eq!(reply.status, 200);
    for gone in [
        "connection",
        "x-hop",
        "keep-alive",
        "proxy-connection",
        "upgrade",
    ] {
        assert!(
            !reply.headers.contains_key(gone),
            "{gone} reached the client: {:?}",
            reply.headers
        );
    }
    assert_eq!(reply.header("x-end-to-end"), Some("kept"));
}

#[tokio::test]
async fn response_bodies_stream_without_buffering() {
    let (upstream, gw) = start().await;
    let req = request(Method::GET, &gw.url("/"))
        .header("x-test-stream", "1")
        .body(empty())
        .unwrap();
    let mut body = Client::new().head(req).await.into_body();
    // The upstream holds its last chunk until released: the first must already be here.
    let first = tokio::time::timeout(LIVENESS, body.frame())
        .await
        .expect("the first chunk was held back")
        .unwrap()
        .unwrap()
        .into_data()
        .unwrap();
    assert_eq!(first, Bytes::from_static(b"first;"));
    upstream.release(1);
    let rest = tokio::time::timeout(LIVENESS, body.collect())
        .await
        .unwrap()
        .unwrap()
        .to_bytes();
    assert_eq!(rest, Bytes::from_static(b"last;"));
}

#[tokio::test]
async fn request_bodies_stream_without_buffering() {
    let (upstream, gw) = start().await;
    let (tx, body) = channel_body();
    let req = request(Method::POST, &gw.url("/"))
        .header("x-test-report-body", "1")
        .body(body)
        .unwrap();
    let client = Client::new();
    let pending = tokio::spawn(async move { client.send(req).await });
    tx.send(Bytes::from_static(b"one;")).await.unwrap();
    // The client has not finished its body, yet the upstream already has the first chunk.
    assert_eq!(
        upstream.next_body_frame().await,
        Bytes::from_static(b"one;")
    );
    tx.send(Bytes::from_static(b"two;")).await.unwrap();
    assert_eq!(
        upstream.next_body_frame().await,
        Bytes::from_static(b"two;")
    );
    drop(tx);
    let reply = pending.await.unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(reply.json()["body_len"], 8);
}

#[tokio::test]
async fn large_responses_arrive_whole() {
    let (_upstream, gw) = start().await;
    let len = 8 * 1024 * 1024;
    let reply = Client::new()
        .get_with(&gw.url("/"), &[("x-test-big", &len.to_string())])
        .await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.body.len(), len);
    assert!(reply.body.iter().all(|&b| b == b'x'));
}

#[tokio::test]
async fn upstream_connections_are_pooled() {
    let (upstream, gw) = start().await;
    let requests = 50;
    for _ in 0..requests {
        // A new client connection each time: only the gateway's pool can keep one upstream link.
        let reply = Client::new().get(&gw.url("/")).await;
        assert_eq!(reply.status, 200);
    }
    assert_eq!(upstream.requests(), requests);
    let connections = upstream.connections();
    assert!(
        connections <= 3,
        "{connections} upstream connections for {requests} sequential requests"
    );
}

#[tokio::test]
async fn an_unreachable_upstream_is_a_502() {
    let dead = unreachable_addr().await;
    let gw = TestGateway::with_upstream(FORWARD_ALL, dead).await;
    let reply = Client::new().get(&gw.url("/")).await;
    assert_eq!(reply.status, 502);
    assert_eq!(reply.header("content-type"), Some("application/json"));
    assert_eq!(reply.json()["error"], "upstream_unreachable");
    assert_eq!(reply.json()["route"], "all");
    let metrics = gw.metrics().await;
    let connect = [("route", "all"), ("kind", "connect")];
    assert_eq!(
        metric(&metrics, "turnstile_upstream_errors_total", &connect),
        Some(1.0)
    );
}

#[tokio::test]
async fn an_upstream_slower_than_its_timeout_is_a_504() {
    let (upstream, gw) = start().await;
    let started = std::time::Instant::now();
    let reply = Client::new()
        .get_with(&gw.url("/"), &[("x-test-hold-head", "1")])
        .await;
    assert_eq!(reply.status, 504);
    assert!(started.elapsed() >= std::time::Duration::from_secs(1));
    assert_eq!(reply.json()["error"], "upstream_timeout");
    assert_eq!(upstream.requests(), 1);
    let metrics = gw.metrics().await;
    let timeout = [("route", "all"), ("kind", "timeout")];
    assert_eq!(
        metric(&metrics, "turnstile_upstream_errors_total", &timeout),
        Some(1.0)
    );
}

/// A pooled upstream connection keeps its response-head timer from one exchange to the next
/// (`proxy::h1::Conn`), reset to each request's deadline: it fires for none of them early, for a
/// held one on time, and not at all for one that comes after it fired while the connection idled.
#[tokio::test]
async fn a_reused_upstream_connection_times_each_request_from_its_own_start() {
    use std::time::{Duration, Instant};
    let (upstream, gw) = start().await;
    let client = Client::new();
    assert_eq!(client.get(&gw.url("/")).await.status, 200);
    // The connection's timer was armed for the first request's deadline (its start + 1 s), which
    // passes while the second is held: the second times out from its own start.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = Instant::now();
    let reply = client
        .get_with(&gw.url("/"), &[("x-test-hold-head", "1")])
        .await;
    assert_eq!(reply.status, 504);
    let waited = started.elapsed();
    assert!(waited >= Duration::from_secs(1), "504 after {waited:?}");
    assert!(waited < Duration::from_millis(1800), "504 after {waited:?}");
    assert_eq!(
        upstream.connections(),
        1,
        "the second request reused the first's connection"
    );

    // A fresh connection answers, then idles past its timer's deadline: the timer fires with no
    // exchange waiting, and the next exchange on the connection is not cut short by it.
    assert_eq!(client.get(&gw.url("/")).await.status, 200);
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let started = Instant::now();
    assert_eq!(client.get(&gw.url("/")).await.status, 200);
    assert!(started.elapsed() < Duration::from_millis(900));
    assert_eq!(upstream.connections(), 2, "the idle connection was reused");
    assert_eq!(upstream.requests(), 4);
}

#[tokio::test]
async fn a_declared_body_past_the_limit_is_a_413_before_the_upstream() {
    let (upstream, gw) = start().await;
    let c = Client::new();
    let ok = request(Method::POST, &gw.url("/"))
        .body(full(vec![b'a'; 1024]))
        .unwrap();
    let reply = c.send(ok).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.json()["body_len"], 1024);
    let too_big = request(Method::POST, &gw.url("/"))
        .body(full(vec![b'a'; 1025]))
        .unwrap();
    let reply = c.send(too_big).await;
    assert_eq!(reply.status, 413);
    assert_eq!(reply.json()["error"], "body_too_large");
    assert_eq!(
        upstream.requests(),
        1,
        "the oversized request never reached the upstream"
    );
}

#[tokio::test]
async fn a_chunked_body_growing_past_the_limit_is_a_413() {
    let (_upstream, gw) = start().await;
    let c = Client::new();
    let (tx, body) = channel_body();
    let req = request(Method::POST, &gw.url("/")).body(body).unwrap();
    let pending = tokio::spawn({
        let c = c.clone();
        async move { c.send(req).await }
    });
    for _ in 0..3 {
        // The gateway may stop reading once the limit is passed; later sends may fail.
        if tx.send(Bytes::from(vec![b'a'; 600])).await.is_err() {
            break;
        }
    }
    drop(tx);
    let reply = pending.await.unwrap();
    assert_eq!(reply.status, 413);

    // Within the limit, chunked bodies pass.
    let (tx, body) = channel_body();
    let req = request(Method::POST, &gw.url("/")).body(body).unwrap();
    let pending = tokio::spawn(async move { c.send(req).await });
    tx.send(Bytes::from(vec![b'a'; 600])).await.unwrap();
    tx.send(Bytes::from(vec![b'a'; 400])).await.unwrap();
    drop(tx);
    let reply = pending.await.unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(reply.json()["body_len"], 1000);
}

#[tokio::test]
async fn h2c_clients_are_served_and_limited() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(
        r#"
upstreams:
  up: { url: "http://$UPSTREAM" }
routes:
  - name: all
    upstream: up
    policies:
      - { name: p, key: [host], token_bucket: { rate: 1/h, burst: 2 } }
"#,
        upstream.addr,
    )
    .await;
    let c = Client::http2();
    let reply = c.get(&gw.url("/h2?x=1")).await;
    assert_eq!(reply.status, 200);
    let echo = reply.json();
    // The upstream speaks HTTP/1.1 and gets the authority as Host.
    assert_eq!(echo["version"], "HTTP/1.1");
    assert_eq!(echo["path"], "/h2?x=1");
    assert_eq!(echo["headers"]["host"][0], gw.public.to_string());
    assert_eq!(
        echo["headers"]["x-forwarded-host"][0],
        gw.public.to_string()
    );
    assert_eq!(reply.header_u64("x-ratelimit-remaining"), 1);
    assert_eq!(c.get(&gw.url("/")).await.status, 200);
    assert_eq!(c.get(&gw.url("/")).await.status, 429);
    assert_eq!(upstream.requests(), 2);
}

#[tokio::test]
async fn websocket_upgrades_tunnel_bytes_both_ways() {
    let (upstream, gw) = start().await;
    let mut stream = raw_connect(
        gw.public,
        b"GET /ws HTTP/1.1\r\nHost: ws.example\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
          Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
    )
    .await;
    let (head, rest) = read_head(&mut stream).await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    let lower = head.to_ascii_lowercase();
    assert!(lower.contains("upgrade: websocket"), "{head}");
    assert!(lower.contains("connection: upgrade"), "{head}");
    assert!(rest.is_empty());
    for message in [
        &b"ping"[..],
        b"a longer message through the tunnel",
        &[0u8, 255, 1, 254],
    ] {
        stream.write_all(message).await.unwrap();
        let mut echoed = vec![0u8; message.len()];
        tokio::time::timeout(LIVENESS, stream.read_exact(&mut echoed))
            .await
            .expect("no echo through the tunnel")
            .unwrap();
        assert_eq!(echoed, message);
    }
    assert_eq!(upstream.requests(), 1);
}

/// `python3 -m http.server`: an HTTP/1.0 upstream (its status line says `HTTP/1.0` and it closes
/// each connection), stopped by PID on drop.
struct Http10Upstream {
    addr: std::net::SocketAddr,
    child: std::process::Child,
    _dir: tempfile::TempDir,
}

impl Http10Upstream {
    async fn start() -> Http10Upstream {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("hello.txt"), "hello\n").expect("write");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let child = std::process::Command::new("python3")
            .args([
                "-m",
                "http.server",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
            ])
            .current_dir(dir.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("python3 -m http.server");
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let deadline = std::time::Instant::now() + LIVENESS;
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "http.server did not listen"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        Http10Upstream {
            addr,
            child,
            _dir: dir,
        }
    }
}

impl Drop for Http10Upstream {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// RFC 9110 §2.5: a response carries the sender's own HTTP version. An upstream's `HTTP/1.0`
/// used to reach the client, which then dropped keep-alive.
#[tokio::test]
async fn regression_an_http_1_0_upstreams_version_reached_the_client() {
    let upstream = Http10Upstream::start().await;
    let gw = TestGateway::with_upstream(FORWARD_ALL, upstream.addr).await;
    let request = b"GET /hello.txt HTTP/1.1\r\nHost: a.example\r\n\r\n";
    let mut stream = raw_connect(gw.public, request).await;
    for round in 0..2 {
        if round > 0 {
            stream
                .write_all(request)
                .await
                .expect("second request, same connection");
        }
        let (head, body, _) = read_response(&mut stream, Vec::new()).await;
        assert!(head.starts_with("HTTP/1.1 200"), "round {round}: {head}");
        assert!(
            head.to_ascii_lowercase().contains("content-length:"),
            "round {round}: {head}"
        );
        assert_eq!(body, b"hello\n");
    }
}
