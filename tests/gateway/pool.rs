//! The upstream connection pool: connections the upstream closes while idle are never used for a
//! request, a request that arrives without `Host` gets the upstream's, and a response body left
//! unread does not leave its connection in the pool.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use http::Method;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::support::client::{empty, raw_connect, read_head, request};
use crate::support::{Client, TestGateway, Upstream};

const FORWARD_ALL: &str = r#"
upstreams:
  up:
    url: http://$UPSTREAM
    timeout: 2s
routes:
  - name: all
    upstream: up
"#;

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
                    let mut head = Vec::new();
                    let mut chunk = [0u8; 1024];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match stream.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&chunk[..n]),
                        }
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
    let mut stream = raw_connect(gw.running().public_addr, b"GET /x HTTP/1.0\r\n\r\n").await;
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
