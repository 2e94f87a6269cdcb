//! An in-process HTTP/1.1 upstream on a free loopback port.
//!
//! By default it answers every request with a JSON echo of what it received (method, path and
//! query, headers, body length). Request headers switch on the other behaviours the gateway's
//! proxy must survive:
//!
//! - `x-test-hold-head: 1`: wait for [`Upstream::release`] before sending the response head (504,
//!   in-flight requests during reload and shutdown);
//! - `x-test-stream: 1`: send the head and a first chunk `first;`, wait for [`Upstream::release`],
//!   then send `last;` (streaming without buffering);
//! - `x-test-report-body: 1`: hand every request body frame to [`Upstream::next_body_frame`] as it
//!   arrives, then answer with the total length;
//! - `x-test-hop-response: 1`: add hop-by-hop fields to the response;
//! - `x-test-big: N`: answer with a body of N bytes streamed in 16 KiB chunks;
//! - `x-test-sleep-ms: N`: answer after N ms (a slow request);
//! - `x-test-cost: V`: report V in the response header `x-usage-tokens` (cost from the response);
//! - `x-test-tag: V`: record V in arrival order ([`Upstream::tags`]);
//! - `Connection: upgrade` + `Upgrade`: answer 101 and echo the tunnel's bytes.
//!
//! It counts TCP connections accepted, open now and open at most at once, requests received, and
//! requests in flight (head received, response not yet handed back) now and at most at once, and
//! stops on drop.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch, Mutex, Semaphore};
use tokio::task::{JoinHandle, JoinSet};

use super::LIVENESS;

type UpBody = http_body_util::combinators::BoxBody<Bytes, Infallible>;

#[derive(Debug)]
struct Shared {
    connections: AtomicUsize,
    open: AtomicUsize,
    peak_open: AtomicUsize,
    /// Requests whose head arrived; a watch so tests can wait for "the request got here".
    requests: watch::Sender<usize>,
    gate: Semaphore,
    frames_tx: mpsc::UnboundedSender<Bytes>,
    frames_rx: Mutex<mpsc::UnboundedReceiver<Bytes>>,
    in_flight: AtomicUsize,
    peak_in_flight: AtomicUsize,
    /// When each request's head arrived, in order (pacing tests measure the spacing).
    arrivals: std::sync::Mutex<Vec<std::time::Instant>>,
    /// The `x-test-tag` of each request that sent one, in arrival order.
    tags: std::sync::Mutex<Vec<String>>,
}

/// One request in flight at the upstream, counted until dropped.
struct InFlight(Arc<Shared>);

impl InFlight {
    fn new(shared: &Arc<Shared>) -> InFlight {
        let now = shared.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        shared.peak_in_flight.fetch_max(now, Ordering::SeqCst);
        InFlight(shared.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A running upstream. Dropping it closes the listener and every connection.
#[derive(Debug)]
pub struct Upstream {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl Upstream {
    pub async fn start() -> Upstream {
        Self::start_on("127.0.0.1:0".parse().expect("loopback")).await
    }

    /// An upstream on `addr`: a port an earlier upstream (now dropped) had, to bring a target back.
    pub async fn start_on(addr: SocketAddr) -> Upstream {
        let listener = TcpListener::bind(addr).await.expect("bind upstream");
        let addr = listener.local_addr().expect("upstream addr");
        let (frames_tx, frames_rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            connections: AtomicUsize::new(0),
            open: AtomicUsize::new(0),
            peak_open: AtomicUsize::new(0),
            requests: watch::channel(0).0,
            gate: Semaphore::new(0),
            frames_tx,
            frames_rx: Mutex::new(frames_rx),
            in_flight: AtomicUsize::new(0),
            peak_in_flight: AtomicUsize::new(0),
            arrivals: std::sync::Mutex::default(),
            tags: std::sync::Mutex::default(),
        });
        let accept_shared = shared.clone();
        let task = tokio::spawn(async move {
            // Owning the connection tasks here means aborting this task ends them too.
            let mut connections = JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                accept_shared.connections.fetch_add(1, Ordering::SeqCst);
                let open = accept_shared.open.fetch_add(1, Ordering::SeqCst) + 1;
                accept_shared.peak_open.fetch_max(open, Ordering::SeqCst);
                let shared = accept_shared.clone();
                connections.spawn(async move {
                    let counted = shared.clone();
                    let service = service_fn(move |req| handle(shared.clone(), req));
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .with_upgrades()
                        .await;
                    counted.open.fetch_sub(1, Ordering::SeqCst);
                });
                while connections.try_join_next().is_some() {}
            }
        });
        Upstream { addr, shared, task }
    }

    /// The `x-test-tag` values received so far, in arrival order.
    pub fn tags(&self) -> Vec<String> {
        self.shared
            .tags
            .lock()
            .map(|t| t.clone())
            .unwrap_or_default()
    }

    /// When each request's head arrived so far, in arrival order.
    pub fn arrivals(&self) -> Vec<std::time::Instant> {
        self.shared
            .arrivals
            .lock()
            .map(|a| a.clone())
            .unwrap_or_default()
    }

    /// TCP connections accepted so far (to observe the gateway's connection pool).
    pub fn connections(&self) -> usize {
        self.shared.connections.load(Ordering::SeqCst)
    }

    /// TCP connections open now (closed ones, and upgraded ones, no longer count).
    pub fn open_connections(&self) -> usize {
        self.shared.open.load(Ordering::SeqCst)
    }

    /// The most TCP connections that were open at once.
    pub fn peak_open_connections(&self) -> usize {
        self.shared.peak_open.load(Ordering::SeqCst)
    }

    /// Waits until at most `n` connections are open.
    pub async fn wait_for_open_connections_at_most(&self, n: usize) {
        let deadline = std::time::Instant::now() + LIVENESS;
        while self.open_connections() > n {
            assert!(
                std::time::Instant::now() < deadline,
                "{} upstream connections still open, expected at most {n}",
                self.open_connections()
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    /// Requests in flight now: head received, response not yet handed back (nor abandoned).
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight.load(Ordering::SeqCst)
    }

    /// The most requests that were in flight at once.
    pub fn peak_in_flight(&self) -> usize {
        self.shared.peak_in_flight.load(Ordering::SeqCst)
    }

    /// Request heads received so far (a rejected request must never add to this).
    pub fn requests(&self) -> usize {
        *self.shared.requests.borrow()
    }

    /// The request count, readable after the upstream is dropped: dropping aborts its tasks,
    /// and a connection task already woken may still answer before the abort reaches it.
    pub fn request_count(&self) -> watch::Receiver<usize> {
        self.shared.requests.subscribe()
    }

    /// Waits until at least `n` request heads have arrived.
    pub async fn wait_for_requests(&self, n: usize) {
        let mut rx = self.shared.requests.subscribe();
        tokio::time::timeout(LIVENESS, rx.wait_for(|&count| count >= n))
            .await
            .unwrap_or_else(|_| panic!("upstream never received {n} requests"))
            .expect("upstream counter closed");
    }

    /// Lets one held response (head or stream) go on.
    pub fn release(&self, n: usize) {
        self.shared.gate.add_permits(n);
    }

    /// The next request body frame received in `x-test-report-body` mode.
    pub async fn next_body_frame(&self) -> Bytes {
        let mut rx = self.shared.frames_rx.lock().await;
        tokio::time::timeout(LIVENESS, rx.recv())
            .await
            .expect("no body frame reached the upstream in time")
            .expect("frame channel closed")
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn flag(req: &Request<Incoming>, name: &str) -> bool {
    req.headers().get(name).is_some_and(|v| v == "1")
}

async fn handle(
    shared: Arc<Shared>,
    req: Request<Incoming>,
) -> Result<Response<UpBody>, Infallible> {
    if let Ok(mut arrivals) = shared.arrivals.lock() {
        arrivals.push(std::time::Instant::now());
    }
    let _in_flight = InFlight::new(&shared);
    if let Some(tag) = req.headers().get("x-test-tag") {
        if let Ok(mut tags) = shared.tags.lock() {
            tags.push(String::from_utf8_lossy(tag.as_bytes()).into_owned());
        }
    }
    shared.requests.send_modify(|n| *n += 1);
    if let Some(ms) = req
        .headers()
        .get("x-test-sleep-ms")
        .and_then(|v| v.to_str().ok())
    {
        let ms = ms.parse().expect("x-test-sleep-ms: N");
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
    }
    let cost = req.headers().get("x-test-cost").cloned();

    let connection = req.headers().get(http::header::CONNECTION);
    let upgrading = connection.is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"upgrade"));
    if upgrading && req.headers().contains_key(http::header::UPGRADE) {
        return Ok(upgrade(req));
    }
    if flag(&req, "x-test-hold-head") {
        hold(&shared).await;
    }
    if flag(&req, "x-test-stream") {
        return Ok(held_stream(shared));
    }
    if let Some(n) = req
        .headers()
        .get("x-test-big")
        .and_then(|v| v.to_str().ok())
    {
        return Ok(big(n.parse().expect("x-test-big: N")));
    }
    let hop = flag(&req, "x-test-hop-response");
    let report = flag(&req, "x-test-report-body");
    let (parts, mut body) = req.into_parts();
    let mut body_len = 0usize;
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else { break };
        if let Ok(data) = frame.into_data() {
            body_len += data.len();
            if report {
                let _ = shared.frames_tx.send(data);
            }
        }
    }
    let mut headers = serde_json::Map::new();
    for name in parts.headers.keys() {
        let values: Vec<serde_json::Value> = parts
            .headers
            .get_all(name)
            .iter()
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into())
            .collect();
        headers.insert(name.as_str().to_string(), values.into());
    }
    let echo = serde_json::json!({
        "method": parts.method.as_str(),
        "path": parts.uri.path_and_query().map_or("/", |p| p.as_str()),
        "version": format!("{:?}", parts.version),
        "headers": headers,
        "body_len": body_len,
    });
    let mut response = Response::new(full(echo.to_string()));
    let h = response.headers_mut();
    h.insert("content-type", HeaderValue::from_static("application/json"));
    if let Some(cost) = cost {
        h.insert("x-usage-tokens", cost);
    }
    if hop {
        // RFC 9110 §7.6.1: none of these may reach the client.
        h.insert("connection", HeaderValue::from_static("x-hop"));
        h.insert("x-hop", HeaderValue::from_static("secret"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("proxy-connection", HeaderValue::from_static("keep-alive"));
        h.insert("upgrade", HeaderValue::from_static("h2c"));
        h.insert("x-end-to-end", HeaderValue::from_static("kept"));
    }
    Ok(response)
}

async fn hold(shared: &Shared) {
    shared.gate.acquire().await.expect("gate closed").forget();
}

fn full(body: impl Into<Bytes>) -> UpBody {
    Full::new(body.into()).boxed()
}

fn held_stream(shared: Arc<Shared>) -> Response<UpBody> {
    let chunks = futures_util::stream::unfold(0u8, move |step| {
        let shared = shared.clone();
        async move {
            match step {
                0 => Some((Ok(Frame::data(Bytes::from_static(b"first;"))), 1)),
                1 => {
                    hold(&shared).await;
                    Some((Ok(Frame::data(Bytes::from_static(b"last;"))), 2))
                }
                _ => None,
            }
        }
    });
    Response::new(StreamBody::new(chunks).boxed())
}

fn big(len: usize) -> Response<UpBody> {
    const CHUNK: usize = 16 * 1024;
    let chunks = futures_util::stream::unfold(len, |left| async move {
        if left == 0 {
            return None;
        }
        let n = left.min(CHUNK);
        Some((Ok(Frame::data(Bytes::from(vec![b'x'; n]))), left - n))
    });
    Response::new(StreamBody::new(chunks).boxed())
}

/// 101, then echo every byte of the tunnel back.
fn upgrade(req: Request<Incoming>) -> Response<UpBody> {
    let protocol = req.headers()[http::header::UPGRADE].clone();
    tokio::spawn(async move {
        let Ok(upgraded) = hyper::upgrade::on(req).await else {
            return;
        };
        let mut io = TokioIo::new(upgraded);
        let mut buf = [0u8; 4096];
        loop {
            match io.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if io.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            }
        }
    });
    let mut response = Response::new(full(Bytes::new()));
    *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    response.headers_mut().insert(
        http::header::CONNECTION,
        HeaderValue::from_static("upgrade"),
    );
    response
        .headers_mut()
        .insert(http::header::UPGRADE, protocol);
    response
}

/// An address where nothing listens (connection refused), for 502 tests.
pub async fn unreachable_addr() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    // Ephemeral ports are handed out in sequence, so the port stays free for the few
    // milliseconds the test needs it.
    drop(listener);
    addr
}

/// For the raw upstreams tests script by hand: reads from `stream` until `buf` holds a whole
/// message head, then takes the head off `buf` (what follows it stays). `None` once the peer
/// closes or the read fails.
pub async fn next_head(stream: &mut tokio::net::TcpStream, buf: &mut Vec<u8>) -> Option<String> {
    let mut chunk = [0u8; 1024];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end + 4]).into_owned();
            buf.drain(..end + 4);
            return Some(head);
        }
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}
