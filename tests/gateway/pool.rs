//! The upstream connection pool: connections the upstream closes while idle are never used for a
//! request, a request that arrives without `Host` gets the upstream's, a response body left
//! unread does not leave its connection in the pool, one read to its end over several polls goes
//! back, and one whose response ended before its request body still goes back once that body is
//! sent.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use http::Method;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::support::client::{empty, full, raw_connect, read_head, read_response, request};
use crate::support::upstream::next_head;
use crate::support::{Client, TestGateway, Upstream, LIVENESS};
use crate::FORWARD_ALL;
use http_body_util::BodyExt;

/// An upstream that answers one request per connection with a keep-alive response, then closes
/// the connection at once: what a server with a very short idle timeout does.
struct OneShotUpstream {
    addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl OneShotUpstream {
    async fn start() -> OneShotUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let connections = Arc::new(AtomicUsize::new(0));
        let counter = connections.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    if next_head(&mut stream, &mut Vec::new()).await.is_none() {
                        return;
                    }
                    let reply =
                        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: keep-alive\r\n\r\nok";
                    let _ = stream.write_all(reply).await;
                    // Dropped here: closed without a word, the connection looked reusable.
                });
            }
        });
        OneShotUpstream {
            addr,
            connections,
            task,
        }
    }
}

impl Drop for OneShotUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test]
async fn connections_the_upstream_closed_while_idle_are_never_used() {
    let upstream = OneShotUpstream::start().await;
    let gw = TestGateway::with_upstream(FORWARD_ALL, upstream.addr).await;
    let client = Client::new();
    let requests = 30;
    for i in 0..requests {
        let reply = client.get(&gw.url("/")).await;
        assert_eq!(reply.status, 200, "request {i}: {}", reply.text());
        assert_eq!(reply.text(), "ok");
    }
    assert_eq!(upstream.connections.load(Ordering::SeqCst), requests);
}

#[tokio::test]
async fn a_request_without_host_gets_the_upstream_authority() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(FORWARD_ALL, upstream.addr).await;
    let mut stream = raw_connect(gw.public, b"GET /x HTTP/1.0\r\n\r\n").await;
    let (head, mut body) = read_head(&mut stream).await;
    assert!(head.starts_with("HTTP/1.0 200"), "{head}");
    stream.read_to_end(&mut body).await.expect("read body");
    let echo: serde_json::Value = serde_json::from_slice(&body).expect("json echo");
    assert_eq!(echo["path"], "/x");
    assert_eq!(echo["headers"]["host"][0], upstream.addr.to_string());
}

#[tokio::test]
async fn a_response_body_left_unread_does_not_pool_its_connection() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(FORWARD_ALL, upstream.addr).await;
    // 8 MiB: far more than the sockets buffer, so the upstream is still writing when the
    // client gives up.
    let req = request(Method::GET, &gw.url("/"))
        .header("x-test-big", (8 * 1024 * 1024).to_string())
        .body(empty())
        .unwrap();
    let head = Client::new().head(req).await;
    assert_eq!(head.status(), 200);
    drop(head);
    // The next request must not land on the half-read connection.
    for _ in 0..3 {
        let reply = Client::new().get(&gw.url("/")).await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.json()["path"], "/");
    }
    assert_eq!(upstream.requests(), 4);
    assert!(upstream.connections() >= 2);
}

#[tokio::test]
async fn a_response_body_streamed_to_its_end_pools_its_connection() {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(FORWARD_ALL, upstream.addr).await;
    // Head and first chunk, then (once released) the last: the body's end arrives while the
    // gateway waits on the connection, which only the response body's polls drive.
    let req = request(Method::GET, &gw.url("/"))
        .header("x-test-stream", "1")
        .body(empty())
        .unwrap();
    let mut body = Client::new().head(req).await.into_body();
    let first = tokio::time::timeout(LIVENESS, body.frame())
        .await
        .expect("the first chunk never came")
        .expect("a frame")
        .expect("a frame");
    assert_eq!(first.into_data().expect("data"), "first;");
    upstream.release(1);
    let rest = tokio::time::timeout(LIVENESS, body.collect())
        .await
        .expect("the last chunk never came")
        .expect("the rest")
        .to_bytes();
    assert_eq!(rest, "last;");
    for _ in 0..3 {
        let reply = Client::new().get(&gw.url("/")).await;
        assert_eq!(reply.status, 200);
    }
    assert_eq!(upstream.requests(), 4);
    assert_eq!(upstream.connections(), 1);
}

/// An upstream that answers every request as soon as its head arrives, then reads the request
/// body (`content-length` framed) and serves the next request on the same connection.
struct EarlyAnswerUpstream {
    addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    bodies: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl EarlyAnswerUpstream {
    async fn start() -> EarlyAnswerUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let connections = Arc::new(AtomicUsize::new(0));
        let bodies = Arc::new(AtomicUsize::new(0));
        let (conn_count, body_count) = (connections.clone(), bodies.clone());
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                conn_count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(answer_early(stream, body_count.clone()));
            }
        });
        EarlyAnswerUpstream {
            addr,
            connections,
            bodies,
            task,
        }
    }

    async fn wait_for_bodies(&self, n: usize) {
        let deadline = tokio::time::Instant::now() + LIVENESS;
        while self.bodies.load(Ordering::SeqCst) < n {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the upstream never got the rest of the request body"
            );
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }
}

impl Drop for EarlyAnswerUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn answer_early(mut stream: tokio::net::TcpStream, bodies: Arc<AtomicUsize>) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 1024];
    loop {
        let Some(head) = next_head(&mut stream, &mut buf).await else {
            return;
        };
        let head = head.to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|line| line.strip_prefix("content-length:"))
            .map_or(0, |v| v.trim().parse().expect("content-length"));
        let reply = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
        if stream.write_all(reply).await.is_err() {
            return;
        }
        while buf.len() < length {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        buf.drain(..length);
        bodies.fetch_add(1, Ordering::SeqCst);
    }
}

#[tokio::test]
async fn a_response_that_ends_before_its_request_body_pools_its_connection_once_the_body_is_sent() {
    let upstream = EarlyAnswerUpstream::start().await;
    let gw = TestGateway::with_upstream(FORWARD_ALL, upstream.addr).await;
    let mut client = raw_connect(
        gw.public,
        b"POST /upload HTTP/1.1\r\nhost: gw\r\ncontent-length: 10\r\n\r\n01234",
    )
    .await;
    // The whole response arrives while half the request body is still to come.
    let (head, body, rest) = read_response(&mut client, Vec::new()).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(body, b"ok");
    assert!(rest.is_empty(), "bytes after the response: {rest:?}");
    client.write_all(b"56789").await.expect("write the rest");
    upstream.wait_for_bodies(1).await;
    // Sent in full, the connection is idle again, and the next request with a body takes it.
    // (A bodiless request would take the lean exchange, whose connections idle apart.)
    let req = request(Method::POST, &gw.url("/"))
        .body(full("x"))
        .expect("request");
    let reply = Client::new().send(req).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.text(), "ok");
    upstream.wait_for_bodies(2).await;
    assert_eq!(upstream.connections.load(Ordering::SeqCst), 1);
}
