//! The lean HTTP/1.1 exchange (`src/proxy/h1.rs`) that carries bodiless requests to plain-TCP
//! upstreams: response framing (RFC 9112 §6.3), connection reuse (§9.3), and retries on a reused
//! connection the upstream closed (RFC 9110 §9.2.2), against a scripted raw upstream.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use http::Method;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::support::client::{empty, head_values, raw_connect, read_head, read_response, request};
use crate::support::upstream::next_head;
use crate::support::{Client, TestGateway, LIVENESS};
use crate::FORWARD_ALL;

/// What the scripted upstream does with one request.
enum Answer {
    /// Writes these bytes and waits for the next request on the connection.
    Send(&'static [u8]),
    /// Writes these bytes, then closes the connection.
    SendAndClose(&'static [u8]),
    /// Closes the connection without a word.
    Close,
}

/// An upstream that reads request heads (no bodies) and answers the `n`th request of each
/// connection (from 0) as `script` says.
struct Scripted {
    addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    heads: Arc<Mutex<Vec<String>>>,
    task: JoinHandle<()>,
}

impl Scripted {
    async fn start(script: fn(usize, &str) -> Answer) -> Scripted {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let connections = Arc::new(AtomicUsize::new(0));
        let heads = Arc::new(Mutex::new(Vec::new()));
        let (count, seen) = (connections.clone(), heads.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let seen = seen.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    for n in 0.. {
                        let Some(head) = next_head(&mut stream, &mut buf).await else {
                            return;
                        };
                        seen.lock().expect("heads").push(head.clone());
                        match script(n, &head) {
                            Answer::Send(bytes) => {
                                if stream.write_all(bytes).await.is_err() {
                                    return;
                                }
                            }
                            Answer::SendAndClose(bytes) => {
                                let _ = stream.write_all(bytes).await;
                                return;
                            }
                            Answer::Close => return,
                        }
                    }
                });
            }
        });
        Scripted {
            addr,
            connections,
            heads,
            task,
        }
    }

    fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }

    fn heads(&self) -> Vec<String> {
        self.heads.lock().expect("heads").clone()
    }
}

impl Drop for Scripted {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test]
async fn chunked_responses_arrive_whole_and_keep_their_connection() {
    let upstream = Scripted::start(|_, _| {
        Answer::Send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3;ext=1\r\nabc\r\n0A\r\n0123456789\r\n0\r\nx-trailer: t\r\n\r\n")
    })
    .await;
    let gw = TestGateway::with_upstream(FORWARD_ALL, upstream.addr).await;
    for _ in 0..3 {
        let reply = Client::new().get(&gw.url("/")).await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.text(), "abc0123456789");
    }
    assert_eq!(upstream.connections(), 1);
}

#[tokio::test]
async fn a_response_without_a_length_runs_to_the_close_and_is_not_reused() {
    let upstream =
        Scripted::start(|_, _| Answer::SendAndClose(b"HTTP/1.1 200 OK\r\n\r\nuntil the end")).await;
    let gw = TestGateway::with_upstream(FORWARD_ALL, upstream.addr).await;
    for _ in 0..2 {
        let reply = Client::new().get(&gw.url("/")).await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.text(), "until the end");
    }
    assert_eq!(upstream.connections(), 2);
}

#[tokio::test]
async fn connection_close_is_honoured() {
    let upstream = Scripted::start(|_, _| {
        Answer::SendAndClose(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok")
    })
    .await;
    let gw = TestGateway::with_upstream(FORWARD_ALL, upstream.addr).await;
    for _ in 0..3 {
        let reply = Client::new().get(&gw.url("/")).await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.text(), "ok");
    }
    assert_eq!(upstream.connections(), 3);
}

#[tokio::test]
async fn a_head_response_has_no_body_and_keeps_its_connection() {
    let upstream =
        Scripted::start(|_, _| Answer::Send(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n")).await;
    let gw = TestGateway::with_upstream(FORWARD_ALL, upstream.addr).await;
    for _ in 0..3 {
        let mut client = raw_connect(
            gw.public,
            b"HEAD / HTTP/1.1\r\nhost: gw\r\nconnection: close\r\n\r\n",
        )
        .await;
        let (head, body) = read_head(&mut client).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(
            head.to_ascii_lowercase().contains("content-length: 5"),
            "{head}"
        );
        let mut rest = body;
        tokio::time::timeout(LIVENESS, client.read_to_end(&mut rest))
            .await
            .expect("close timed out")
            .expect("read");
        assert!(rest.is_empty(), "a HEAD response carried a body");
    }
    assert_eq!(upstream.connections(), 1);
}

#[tokio::test]
async fn informational_answers_are_skipped() {
    let upstream = Scripted::start(|_, _| {
        Answer::Send(b"HTTP/1.1 103 Early Hints\r\nlink: </a.css>\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
    })
    .await;
    let gw = TestGateway::with_upstream(FORWARD_ALL, upstream.addr).await;
    let reply = Client::new().get(&gw.url("/")).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.text(), "ok");
}

#[tokio::test]
async fn responses_that_could_split_are_a_502() {
    let upstream = Scripted::start(|_, head| {
        if head.starts_with("GET /split ") {
            Answer::Send(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n0\r\n\r\n",
            )
        } else {
            Answer::Send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        }
    })
    .await;
    let gw = TestGateway::with_upstream(FORWARD_ALL, upstream.addr).await;
    assert_eq!(Client::new().get(&gw.url("/split")).await.status, 502);
    // The refused connection is closed; the next request opens another.
    let reply = Client::new().get(&gw.url("/")).await;
    assert_eq!(reply.status, 200);
    assert_eq!(upstream.connections(), 2);
}

#[tokio::test]
async fn an_uninvited_switch_of_protocols_is_a_502() {
    let upstream = Scripted::start(|_, _| {
        Answer::Send(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n")
    })
    .await;
    let gw = TestGateway::with_upstream(FORWARD_ALL, upstream.addr).await;
    assert_eq!(Client::new().get(&gw.url("/")).await.status, 502);
}

#[tokio::test]
async fn a_body_cut_short_does_not_pool_its_connection() {
    let upstream = Scripted::start(|_, head| {
        if head.starts_with("GET /short ") {
            Answer::SendAndClose(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort")
        } else {
            Answer::Send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        }
    })
    .await;
    let gw = TestGateway::with_upstream(FORWARD_ALL, upstream.addr).await;
    let mut client = raw_connect(gw.public, b"GET /short HTTP/1.1\r\nhost: gw\r\n\r\n").await;
    // The client never sees a whole response: the connection ends, before or after the head.
    let mut seen = Vec::new();
    let _ = tokio::time::timeout(LIVENESS, client.read_to_end(&mut seen))
        .await
        .expect("close timed out");
    let seen = String::from_utf8_lossy(&seen);
    if let Some((_, body)) = seen.split_once("\r\n\r\n") {
        assert!(
            body.len() < 10,
            "a truncated body was passed off as whole: {seen}"
        );
    }
    let reply = Client::new().get(&gw.url("/")).await;
    assert_eq!(reply.text(), "ok");
    assert_eq!(upstream.connections(), 2);
}

/// The second request of every connection finds it closed without an answer: what happens when
/// an upstream's idle timeout fires just as a reused connection is written to.
fn close_on_second(n: usize, _: &str) -> Answer {
    match n {
        0 => Answer::Send(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"),
        _ => Answer::Close,
    }
}

#[tokio::test]
async fn an_idempotent_request_is_retried_when_a_reused_connection_closes_unanswered() {
    let upstream = Scripted::start(close_on_second).await;
    let gw = TestGateway::with_upstream(FORWARD_ALL, upstream.addr).await;
    let client = Client::new();
    assert_eq!(client.get(&gw.url("/")).await.status, 200);
    // Reuses the first connection, which closes unanswered; retried on a new one.
    let reply = client.get(&gw.url("/")).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.text(), "ok");
    assert_eq!(upstream.connections(), 2);
    assert_eq!(upstream.heads().len(), 3);
}

#[tokio::test]
async fn a_non_idempotent_request_is_never_sent_twice() {
    let upstream = Scripted::start(close_on_second).await;
    let gw = TestGateway::with_upstream(FORWARD_ALL, upstream.addr).await;
    let client = Client::new();
    assert_eq!(client.get(&gw.url("/")).await.status, 200);
    let post = request(Method::POST, &gw.url("/"))
        .body(empty())
        .expect("request");
    assert_eq!(client.send(post).await.status, 502);
    assert_eq!(upstream.connections(), 1);
    assert_eq!(upstream.heads().len(), 2);
}

#[tokio::test]
async fn the_request_head_is_what_the_client_sent_in_origin_form() {
    let upstream =
        Scripted::start(|_, _| Answer::Send(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")).await;
    let gw = TestGateway::with_upstream(FORWARD_ALL, upstream.addr).await;
    let reply = Client::new()
        .get_with(&gw.url("/a/b?c=d"), &[("x-custom", "1")])
        .await;
    assert_eq!(reply.status, 200);
    let heads = upstream.heads();
    let head = heads[0].to_ascii_lowercase();
    assert!(head.starts_with("get /a/b?c=d http/1.1\r\n"), "{head}");
    assert!(head.contains("\r\nx-custom: 1\r\n"), "{head}");
    assert!(head.contains("\r\nhost: "), "{head}");
    assert!(
        head.contains("\r\nx-forwarded-for: 127.0.0.1\r\n"),
        "{head}"
    );
    let post = request(Method::POST, &gw.url("/"))
        .body(empty())
        .expect("request");
    assert_eq!(Client::new().send(post).await.status, 200);
    let head = upstream.heads()[1].to_ascii_lowercase();
    assert!(head.contains("\r\ncontent-length: 0\r\n"), "{head}");
}

#[tokio::test]
async fn idle_connections_of_one_kind_never_starve_the_other() {
    // One connection in all: the lean kind (bodiless requests) and hyper's (requests with a
    // body) take turns, each closing the other's idle connection to free the one slot.
    let upstream = crate::support::Upstream::start().await;
    let config = r#"
upstreams:
  up:
    url: http://$UPSTREAM
    timeout: 2s
    max_connections: 1
    pool_timeout: 5s
routes:
  - name: all
    upstream: up
"#;
    let gw = TestGateway::with_upstream(config, upstream.addr).await;
    let client = Client::new();
    for _ in 0..2 {
        assert_eq!(client.get(&gw.url("/")).await.status, 200);
        let post = request(Method::POST, &gw.url("/"))
            .body(crate::support::client::full("body"))
            .expect("request");
        let started = std::time::Instant::now();
        assert_eq!(client.send(post).await.status, 200);
        assert!(
            started.elapsed() < std::time::Duration::from_secs(4),
            "waited for the pool timeout"
        );
    }
    assert_eq!(upstream.requests(), 4);
}

/// The upstream's own fields reach the client whole, in order and repeated, and a field the
/// gateway sets (its rate-limit fields) replaces the upstream's of the same name: on the lean
/// server path (a plain GET, which copies the upstream's lines as they came) and on hyper's (a
/// POST, for which they are first moved into the field map).
#[tokio::test]
async fn upstream_fields_pass_whole_and_the_gateways_own_replace_them() {
    let upstream = Scripted::start(|_, _| {
        Answer::Send(
            b"HTTP/1.1 200 OK\r\nServer: up\r\nSet-Cookie: a=1\r\nX-RateLimit-Limit: 999\r\n\
              X-Custom:  spaced\r\nSet-Cookie: b=2\r\nContent-Length: 2\r\n\r\nok",
        )
    })
    .await;
    let gw = TestGateway::with_upstream(
        r#"
upstreams:
  up: { url: "http://$UPSTREAM", timeout: 2s }
routes:
  - name: all
    upstream: up
    policies:
      - { name: per_ip, key: [client_ip], token_bucket: { rate: 1/h, burst: 100 } }
"#,
        upstream.addr,
    )
    .await;
    for request in [
        &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..],
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
    ] {
        let mut stream = raw_connect(gw.public, request).await;
        let (head, body, _) = read_response(&mut stream, Vec::new()).await;
        assert_eq!(body, b"ok", "{head}");
        let values = |name: &str| head_values(&head, name);
        assert_eq!(values("server"), ["up"], "{head}");
        assert_eq!(values("set-cookie"), ["a=1", "b=2"], "{head}");
        assert_eq!(values("x-custom"), ["spaced"], "{head}");
        assert_eq!(values("x-ratelimit-limit"), ["100"], "{head}");
        assert_eq!(values("content-length"), ["2"], "{head}");
        assert_eq!(values("date").len(), 1, "{head}");
    }
}
