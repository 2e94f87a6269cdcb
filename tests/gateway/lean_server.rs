//! The lean HTTP/1.1 server path (`src/listener/h1.rs`): plain `GET`s served without hyper's
//! dispatcher, and every other request on the same connection handed to hyper with the bytes
//! already read. Raw TCP clients, so that what is on the wire is what is checked.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::client::{head_field, raw_connect, read_head, read_response};
use crate::support::{TestGateway, Upstream, LIVENESS};

const IDLE: Duration = Duration::from_millis(400);

async fn start() -> (Upstream, TestGateway) {
    let upstream = Upstream::start().await;
    let gw = TestGateway::with_upstream(
        r#"
server:
  header_read_timeout: 400ms
upstreams:
  up: { url: "http://$UPSTREAM" }
routes:
  - name: limited
    match: { path: /limited }
    upstream: up
    policies:
      - name: one
        key: [client_ip]
        token_bucket: { rate: 1/h, burst: 1 }
  - name: all
    upstream: up
"#,
        upstream.addr,
    )
    .await;
    (upstream, gw)
}

/// One response read from `stream` after `rest` (bytes of it already read): its head, its body
/// as text, and what was read past it.
async fn response(stream: &mut TcpStream, rest: Vec<u8>) -> (String, String, Vec<u8>) {
    let (head, body, rest) = read_response(stream, rest).await;
    assert!(head_field(&head, "content-length").is_some(), "{head}");
    (head, String::from_utf8_lossy(&body).into_owned(), rest)
}

/// Reads until the gateway closes the connection; how long that took from `since`.
async fn closed_after(stream: &mut TcpStream, since: Instant) -> Duration {
    let mut sink = Vec::new();
    let closed = tokio::time::timeout(LIVENESS, stream.read_to_end(&mut sink)).await;
    assert!(
        closed.is_ok(),
        "the connection stayed open for {LIVENESS:?}"
    );
    assert!(sink.is_empty(), "{}", String::from_utf8_lossy(&sink));
    since.elapsed()
}

/// Three requests in one write: three answers, in order, on the one connection.
#[tokio::test]
async fn pipelined_gets_are_answered_in_order() {
    let (upstream, gw) = start().await;
    let mut stream = raw_connect(
        gw.public,
        b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n\
          GET /c?q=1 HTTP/1.1\r\nHost: x\r\n\r\n",
    )
    .await;
    let mut rest = Vec::new();
    for path in ["/a", "/b", "/c?q=1"] {
        let (head, body, more) = response(&mut stream, rest).await;
        rest = more;
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        assert!(body.contains(&format!("\"path\":\"{path}\"")), "{body}");
    }
    assert!(rest.is_empty());
    assert_eq!(upstream.requests(), 3);
}

/// A `POST` (a body) goes to hyper with the connection; the `GET` before it was served lean, the
/// one after it by hyper, all three on one connection, each whole.
#[tokio::test]
async fn a_request_with_a_body_hands_the_connection_over_whole() {
    let (upstream, gw) = start().await;
    let mut stream = raw_connect(gw.public, b"GET /first HTTP/1.1\r\nHost: x\r\n\r\n").await;
    let (head, body, rest) = response(&mut stream, Vec::new()).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(body.contains("\"path\":\"/first\""), "{body}");

    // The body and the next request come in the same write as the POST's head.
    stream
        .write_all(
            b"POST /second HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello\
              GET /third HTTP/1.1\r\nHost: x\r\n\r\n",
        )
        .await
        .expect("write");
    let (head, body, rest) = response(&mut stream, rest).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(body.contains("\"method\":\"POST\""), "{body}");
    assert!(body.contains("\"body_len\":5"), "{body}");
    let (head, body, rest) = response(&mut stream, rest).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(body.contains("\"path\":\"/third\""), "{body}");
    assert!(rest.is_empty());
    assert_eq!(upstream.requests(), 3);
}

/// A head split across writes is handed over with its first part and answered.
#[tokio::test]
async fn a_head_split_across_writes_is_answered() {
    let (_upstream, gw) = start().await;
    let mut stream = raw_connect(gw.public, b"GET /split HTTP/1.1\r\nHo").await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    stream.write_all(b"st: x\r\n\r\n").await.expect("write");
    let (head, body, _) = response(&mut stream, Vec::new()).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(body.contains("\"path\":\"/split\""), "{body}");
}

/// The gateway's own answers on this path: `Date`, `Content-Length`, and the rate-limit fields.
#[tokio::test]
async fn a_refusal_is_framed_and_dated() {
    let (upstream, gw) = start().await;
    let mut stream = raw_connect(
        gw.public,
        b"GET /limited HTTP/1.1\r\nHost: x\r\n\r\nGET /limited HTTP/1.1\r\nHost: x\r\n\r\n",
    )
    .await;
    let (head, _, rest) = response(&mut stream, Vec::new()).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let (head, _, rest) = response(&mut stream, rest).await;
    assert!(
        head.starts_with("HTTP/1.1 429 Too Many Requests\r\n"),
        "{head}"
    );
    assert_eq!(head_field(&head, "x-ratelimit-remaining"), Some("0"));
    assert!(head_field(&head, "retry-after").is_some(), "{head}");
    let date = head_field(&head, "date").expect("date");
    assert!(httpdate::parse_http_date(date).is_ok(), "{date}");
    assert!(rest.is_empty());
    assert_eq!(upstream.requests(), 1);
}

/// Idle between requests, a kept-alive connection is closed after `header_read_timeout`, as
/// hyper closes it; not before.
#[tokio::test]
async fn an_idle_kept_alive_connection_is_closed_after_the_header_read_timeout() {
    let (_upstream, gw) = start().await;
    let mut stream = raw_connect(gw.public, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
    let (head, _, _) = response(&mut stream, Vec::new()).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let since = Instant::now();
    let held = closed_after(&mut stream, since).await;
    assert!(
        held >= IDLE - Duration::from_millis(50),
        "closed after {held:?}"
    );

    // And a connection that keeps sending requests is not cut at the timeout of its first wait.
    let mut stream = raw_connect(gw.public, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
    let (_, _, _) = response(&mut stream, Vec::new()).await;
    let started = Instant::now();
    while started.elapsed() < IDLE * 3 {
        tokio::time::sleep(IDLE / 4).await;
        stream
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .expect("write");
        let (head, _, _) = response(&mut stream, Vec::new()).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    }
}

/// `Connection: close` from the client: answered, then closed (by hyper, which takes it).
#[tokio::test]
async fn a_client_asking_to_close_gets_its_answer_then_the_close() {
    let (_upstream, gw) = start().await;
    let mut stream = raw_connect(
        gw.public,
        b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    let (head, _, rest) = response(&mut stream, Vec::new()).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(rest.is_empty());
    let held = closed_after(&mut stream, Instant::now()).await;
    assert!(held < IDLE, "closed only after {held:?}");
}

/// A malformed head is hyper's to refuse, with the 400 it always sent.
#[tokio::test]
async fn a_malformed_head_gets_hyper_s_400() {
    let (upstream, gw) = start().await;
    let mut stream = raw_connect(gw.public, b"GET / HTTP/1.1\r\nBad Name: x\r\n\r\n").await;
    let (head, _) = read_head(&mut stream).await;
    assert!(head.starts_with("HTTP/1.1 400"), "{head}");
    assert_eq!(upstream.requests(), 0);
}

/// A request's field map is given back and reused by the next request on the thread
/// (`proxy::headers::field_map`): nothing of one request reaches the upstream with the next,
/// whether the first was forwarded or refused.
#[tokio::test]
async fn no_field_of_one_request_reaches_the_upstream_with_the_next() {
    let (upstream, gw) = start().await;
    let mut stream = raw_connect(
        gw.public,
        b"GET /a HTTP/1.1\r\nHost: x\r\nX-First: 1\r\nX-Multi: a\r\nX-Multi: b\r\n\r\n",
    )
    .await;
    let (_, body, rest) = response(&mut stream, Vec::new()).await;
    assert!(body.contains(r#""x-multi":["a","b"]"#), "{body}");
    // The second is refused (a burst of one): its fields went nowhere, its map back to the spares.
    for status in ["200", "429"] {
        stream
            .write_all(b"GET /limited HTTP/1.1\r\nHost: x\r\nX-Refused: 1\r\n\r\n")
            .await
            .expect("write");
        let (head, _, more) = response(&mut stream, rest.clone()).await;
        assert!(head.starts_with(&format!("HTTP/1.1 {status} ")), "{head}");
        assert!(more.is_empty());
    }
    stream
        .write_all(b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    let (head, body, _) = response(&mut stream, rest).await;
    assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
    assert!(body.contains("\"path\":\"/b\""), "{body}");
    for name in ["x-first", "x-multi", "x-refused"] {
        assert!(
            !body.contains(name),
            "{name} leaked into the next request: {body}"
        );
    }
    assert_eq!(upstream.requests(), 3);
}
