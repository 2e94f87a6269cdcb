//! Slowloris: a client that never finishes its request head loses its connection once
//! `server.header_read_timeout` has passed, whatever it trickles in meanwhile.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::client::read_head;
use crate::support::{TestGateway, Upstream, LIVENESS};

const TIMEOUT: Duration = Duration::from_millis(500);

async fn start() -> (Upstream, TestGateway) {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(
        r#"
server:
  header_read_timeout: 500ms
upstreams:
  up: { url: "http://$UPSTREAM" }
routes:
  - name: all
    upstream: up
"#,
        upstream.addr,
    )
    .await;
    (upstream, gw)
}

/// Trickles `prefix` one byte every 50 ms, then (with `endless`) header bytes forever or (without)
/// nothing more, until the gateway closes the connection; returns how long it stayed open since
/// `since` (taken before the gateway could start its clock: before connecting, or before sending
/// the previous request).
async fn trickle(stream: TcpStream, since: Instant, prefix: &[u8], endless: bool) -> Duration {
    let (mut read, mut write) = stream.into_split();
    let prefix = prefix.to_vec();
    let writer = tokio::spawn(async move {
        let filler = std::iter::repeat_n(b'a', if endless { usize::MAX } else { 0 });
        // Bounded: at most LIVENESS worth of bytes.
        for byte in prefix
            .into_iter()
            .chain(filler)
            .take((LIVENESS.as_millis() / 50) as usize)
        {
            if write.write_all(&[byte]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    let mut sink = Vec::new();
    let closed = tokio::time::timeout(LIVENESS, read.read_to_end(&mut sink)).await;
    writer.abort();
    assert!(
        closed.is_ok(),
        "the connection stayed open for {LIVENESS:?}"
    );
    let held = since.elapsed();
    let answer = String::from_utf8_lossy(&sink);
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 408"),
        "{answer}"
    );
    held
}

async fn connect(gw: &TestGateway) -> TcpStream {
    TcpStream::connect(gw.public).await.unwrap()
}

#[tokio::test]
async fn a_head_trickled_byte_by_byte_is_cut_off() {
    let (upstream, gw) = start().await;
    let since = Instant::now();
    let held = trickle(
        connect(&gw).await,
        since,
        b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ",
        true,
    )
    .await;
    assert!(held >= TIMEOUT, "closed after {held:?}, before the timeout");
    assert_eq!(upstream.requests(), 0);
}

/// Regression: hyper-util's HTTP/1-or-h2c detection waited for the first bytes with no deadline.
#[tokio::test]
async fn a_silent_connection_is_cut_off_during_protocol_detection() {
    let (_upstream, gw) = start().await;
    let started = Instant::now();
    let mut stream = connect(&gw).await;
    let mut sink = Vec::new();
    let closed = tokio::time::timeout(LIVENESS, stream.read_to_end(&mut sink)).await;
    assert!(
        closed.is_ok(),
        "an idle connection stayed open for {LIVENESS:?}"
    );
    assert!(started.elapsed() >= TIMEOUT);
}

/// Regression: the same detection waited forever for the rest of a partial h2c preface.
#[tokio::test]
async fn a_trickled_h2c_preface_is_cut_off_during_protocol_detection() {
    let (_upstream, gw) = start().await;
    let since = Instant::now();
    let held = trickle(
        connect(&gw).await,
        since,
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        false,
    )
    .await;
    assert!(held >= TIMEOUT, "closed after {held:?}, before the timeout");
}

#[tokio::test]
async fn a_second_head_trickled_on_a_kept_alive_connection_is_cut_off() {
    let (upstream, gw) = start().await;
    let mut stream = connect(&gw).await;
    let since = Instant::now();
    stream
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let (head, rest) = read_head(&mut stream).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .expect("content-length")
        .parse()
        .unwrap();
    let mut body = vec![0u8; length - rest.len()];
    stream.read_exact(&mut body).await.unwrap();
    // The first request went through; the second head never ends.
    let held = trickle(
        stream,
        since,
        b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ",
        true,
    )
    .await;
    assert!(held >= TIMEOUT, "closed after {held:?}, before the timeout");
    assert_eq!(upstream.requests(), 1);
}
