//! A small HTTP client for tests (hyper's pooled client, HTTP/1.1 or h2c), and raw-socket helpers
//! for what a well-behaved client would never send.

use std::net::SocketAddr;

use bytes::Bytes;
use http::{HeaderMap, Method, Request};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, Full, StreamBody};
use hyper::body::Frame;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::LIVENESS;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type ReqBody = BoxBody<Bytes, BoxError>;

/// A test client; every call fails the test if it takes longer than [`LIVENESS`].
#[derive(Clone)]
pub struct Client {
    inner: hyper_util::client::legacy::Client<HttpConnector, ReqBody>,
}

/// A whole response, body collected.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Client {
    /// HTTP/1.1, keep-alive.
    pub fn new() -> Client {
        Client {
            inner: hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build_http(),
        }
    }

    /// h2c with prior knowledge (no upgrade dance).
    pub fn http2() -> Client {
        Client {
            inner: hyper_util::client::legacy::Client::builder(TokioExecutor::new())
                .http2_only(true)
                .build_http(),
        }
    }

    pub async fn get(&self, url: &str) -> Reply {
        self.send(request(Method::GET, url).body(empty()).expect("request"))
            .await
    }

    /// GET with extra headers.
    pub async fn get_with(&self, url: &str, headers: &[(&str, &str)]) -> Reply {
        let mut builder = request(Method::GET, url);
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        self.send(builder.body(empty()).expect("request")).await
    }

    /// Sends and collects the whole response.
    pub async fn send(&self, req: Request<ReqBody>) -> Reply {
        let response = self.head(req).await;
        collect(response).await.unwrap_or_else(|e| panic!("{e}"))
    }

    /// GET that reports failure instead of failing the test: for load loops that count errors.
    pub async fn try_get(&self, url: &str) -> Result<Reply, String> {
        self.try_get_with(url, &[]).await
    }

    /// [`Client::try_get`] with extra headers.
    pub async fn try_get_with(&self, url: &str, headers: &[(&str, &str)]) -> Result<Reply, String> {
        let mut builder = request(Method::GET, url);
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        let req = builder.body(empty()).map_err(|e| e.to_string())?;
        let response = tokio::time::timeout(LIVENESS, self.inner.request(req))
            .await
            .map_err(|_| "timed out".to_string())?
            .map_err(|e| format!("request failed: {e}"))?;
        collect(response).await
    }

    /// Sends and returns as soon as the response head arrives (the body still streaming).
    pub async fn head(&self, req: Request<ReqBody>) -> http::Response<hyper::body::Incoming> {
        tokio::time::timeout(LIVENESS, self.inner.request(req))
            .await
            .expect("request timed out")
            .expect("request failed")
    }
}

impl Default for Client {
    fn default() -> Self {
        Client::new()
    }
}

pub fn request(method: Method, url: &str) -> http::request::Builder {
    Request::builder().method(method).uri(url)
}

pub fn empty() -> ReqBody {
    Empty::new().map_err(|never| match never {}).boxed()
}

pub fn full(bytes: impl Into<Bytes>) -> ReqBody {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

/// A request body the test feeds chunk by chunk; it ends when the sender is dropped. It has no
/// length, so HTTP/1.1 sends it chunked.
pub fn channel_body() -> (mpsc::Sender<Bytes>, ReqBody) {
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|chunk| (Ok::<_, BoxError>(Frame::data(chunk)), rx))
    });
    (tx, StreamBody::new(stream).boxed())
}

impl Reply {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(name)
            .map(|v| v.to_str().expect("ASCII header"))
    }

    /// A header that must be present and an unsigned integer.
    pub fn header_u64(&self, name: &str) -> u64 {
        self.header(name)
            .unwrap_or_else(|| panic!("no {name} header in {:?}", self.headers))
            .parse()
            .unwrap_or_else(|e| panic!("{name} is not an integer: {e}"))
    }
}

/// Reads from `stream` until the end of a response head; returns the head and any bytes after
/// it.
pub async fn read_head(stream: &mut TcpStream) -> (String, Vec<u8>) {
    read_head_after(stream, Vec::new()).await
}

/// [`read_head`] for a head that may have begun in `buf`, bytes already read.
async fn read_head_after(stream: &mut TcpStream, mut buf: Vec<u8>) -> (String, Vec<u8>) {
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = buf.split_off(end + 4);
            return (String::from_utf8_lossy(&buf).into_owned(), rest);
        }
        let n = tokio::time::timeout(LIVENESS, stream.read(&mut chunk))
            .await
            .expect("response head timed out")
            .expect("read failed");
        assert!(n > 0, "connection closed before a response head: {buf:?}");
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Every value of the field `name` (any case) in a raw response head, trimmed, in order.
pub fn head_values<'h>(head: &'h str, name: &str) -> Vec<&'h str> {
    head.lines()
        .skip(1)
        .filter_map(|line| line.split_once(':'))
        .filter(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, value)| value.trim())
        .collect()
}

/// The first value of the field `name` (any case) in a raw response head.
pub fn head_field<'h>(head: &'h str, name: &str) -> Option<&'h str> {
    head_values(head, name).first().copied()
}

/// Reads one response from `stream`, framed by its `content-length` (none: no body), after
/// `rest` (bytes of it already read). Returns its head, its body, and what was read past it
/// (the next pipelined response's first bytes).
pub async fn read_response(stream: &mut TcpStream, rest: Vec<u8>) -> (String, Vec<u8>, Vec<u8>) {
    let (head, mut body) = read_head_after(stream, rest).await;
    let length: usize = head_field(&head, "content-length")
        .map_or(0, |value| value.parse().expect("content-length"));
    let mut chunk = [0u8; 4096];
    while body.len() < length {
        let n = tokio::time::timeout(LIVENESS, stream.read(&mut chunk))
            .await
            .expect("body timed out")
            .expect("read body");
        assert!(n > 0, "the connection closed mid-body");
        body.extend_from_slice(&chunk[..n]);
    }
    let rest = body.split_off(length);
    (head, body, rest)
}

/// Opens a connection and writes `bytes` to it.
pub async fn raw_connect(addr: SocketAddr, bytes: &[u8]) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(bytes).await.expect("write");
    stream
}

/// `GET path` to `addr` on a connection from `source` (another loopback address, such as
/// 127.0.0.2, is a client the proxies under test do not trust), with extra headers.
pub async fn get_from(
    source: std::net::IpAddr,
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
) -> Reply {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind(SocketAddr::new(source, 0))
        .unwrap_or_else(|e| panic!("bind {source}: {e}"));
    let stream = tokio::time::timeout(LIVENESS, socket.connect(addr))
        .await
        .expect("connect timed out")
        .expect("connect");
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .expect("handshake");
    tokio::spawn(conn);
    let mut builder = Request::get(path).header("host", addr.to_string());
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    let response = tokio::time::timeout(
        LIVENESS,
        sender.send_request(builder.body(Empty::<Bytes>::new()).expect("request")),
    )
    .await
    .expect("response timed out")
    .expect("response");
    collect(response).await.unwrap_or_else(|e| panic!("{e}"))
}

/// Collects a response's whole body (within [`LIVENESS`]) into a [`Reply`].
async fn collect(response: http::Response<hyper::body::Incoming>) -> Result<Reply, String> {
    let (parts, body) = response.into_parts();
    let body = tokio::time::timeout(LIVENESS, body.collect())
        .await
        .map_err(|_| "response body timed out".to_string())?
        .map_err(|e| format!("response body failed: {e}"))?
        .to_bytes();
    Ok(Reply {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body,
    })
}
