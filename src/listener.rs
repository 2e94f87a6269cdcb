//! The public listener: accepts connections (HTTP/1.1 and h2c, and on the TLS listener HTTP/1.1
//! and h2 by ALPN) and bounds what each may cost. The TLS listener ([`crate::tls`]) has the same
//! bounds (its own `max_connections` slots), plus a handshake timeout. On plain TCP, HTTP/1.1
//! connections start on the lean path (`src/listener/h1.rs`), which serves plain `GET`s itself and hands the
//! connection to hyper, bytes already read included, at the first request of any other kind.
//!
//! - At most `server.max_connections` are open at once. The acceptor waits for a free slot before
//!   it accepts again, so connections past the limit wait in the kernel's accept backlog (and are
//!   refused by the kernel once that is full); none is accepted and then dropped.
//! - A request head (HTTP/1.1 read buffer) or h2 header list is at most `server.max_header_size`:
//!   hyper answers a larger HTTP/1.1 head with 431 and closes; h2 refuses the stream.
//! - A connection whose streams are cancelled after the gateway accepted them (each cancel costs
//!   an upstream HTTP/1.1 connection) more than [`CANCEL_LIMIT`] times within [`CANCEL_WINDOW`] is
//!   shut down gracefully (h2: GOAWAY). hyper already does this for streams reset before they are
//!   accepted (rapid reset, CVE-2023-44487), with a warning in the `h2` crate per connection; both
//!   are counted in `turnstile_connection_goaways_total` and logged through one [`Throttle`].
//!
//! Shutdown: each connection is told to finish gracefully, and the drain waits until every slot
//! is back (or the grace period is over).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::{Request, Response};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use prometheus::{IntCounter, IntGauge};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, OwnedSemaphorePermit, Semaphore};

use crate::log_throttle::Throttle;
use crate::metrics::Metrics;
use crate::proxy::body::{ClientBody, ResponseBody};
use crate::proxy::held::Held;
use crate::state::AppState;
use crate::tls::ServerTls;

mod h1;

pub(crate) use crate::tls::prefixed::Prefixed;

/// Requests cancelled after acceptance that one connection may have within [`CANCEL_WINDOW`].
/// Browsers cancel a few when a page is left; hundreds in seconds is an attack.
pub const CANCEL_LIMIT: u32 = 100;
pub const CANCEL_WINDOW: Duration = Duration::from_secs(10);

/// One warning line per this period for connections closed for abuse.
static ABUSE_LOG: Throttle = Throttle::new(Duration::from_secs(10));

/// The listener's metrics.
#[derive(Debug, Clone)]
struct ListenerMetrics {
    open: IntGauge,
    /// Per connection worker, the first at 0 (`crate::workers::index` 1); empty without them.
    workers: Arc<[IntGauge]>,
    goaway_cancelled: IntCounter,
    goaway_resets: IntCounter,
}

impl ListenerMetrics {
    /// The series of `listener` (`public`, `forward_auth`); the goaway counters are shared.
    fn register(metrics: &Metrics, listener: &str) -> Self {
        ListenerMetrics {
            open: metrics.open_connections(listener),
            workers: (1..=crate::workers::count())
                .map(|worker| metrics.worker_connections(worker))
                .collect(),
            goaway_cancelled: metrics.goaways("cancelled_streams"),
            goaway_resets: metrics.goaways("rapid_reset"),
        }
    }
}

/// Per connection: its cancellations, and the signal to shut it down.
#[derive(Debug)]
struct Connection {
    /// (start of the current window, cancellations in it). Locked only when a request is
    /// cancelled, never on the normal path.
    cancels: Mutex<(Instant, u32)>,
    goaway: Notify,
}

impl Connection {
    fn cancelled(&self) {
        let mut window = self
            .cancels
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let now = Instant::now();
        if now.duration_since(window.0) > CANCEL_WINDOW {
            *window = (now, 0);
        }
        window.1 += 1;
        if window.1 == CANCEL_LIMIT + 1 {
            self.goaway.notify_one();
        }
    }
}

/// Counts its request as cancelled if dropped before [`Finished::done`]: hyper drops the service
/// future when the client resets the stream (or closes) before the response head.
struct Finished {
    connection: Arc<Connection>,
    done: bool,
}

impl Finished {
    fn done(mut self) {
        self.done = true;
    }
}

impl Drop for Finished {
    fn drop(&mut self) {
        if !self.done {
            self.connection.cancelled();
        }
    }
}

/// What a listener answers each request with. The answer may borrow the handler: the lean
/// HTTP/1.1 path awaits it in place, so a request there clones nothing the handler holds (an
/// `Arc` cloned per request is a reference count every worker writes). hyper's path, whose
/// answers are futures of their own, clones the handler per request.
pub(crate) trait Handler: Clone + Send + Sync + 'static {
    fn call(
        &self,
        peer: SocketAddr,
        req: Request<ClientBody>,
    ) -> impl Future<Output = Result<Response<ResponseBody>, Infallible>> + Send + '_;
}

impl<H, F> Handler for H
where
    H: Fn(SocketAddr, Request<ClientBody>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Result<Response<ResponseBody>, Infallible>> + Send + 'static,
{
    fn call(
        &self,
        peer: SocketAddr,
        req: Request<ClientBody>,
    ) -> impl Future<Output = Result<Response<ResponseBody>, Infallible>> + Send + '_ {
        self(peer, req)
    }
}

/// The inline gateway on the shared state.
#[derive(Clone)]
struct Gateway(Arc<AppState>);

impl Handler for Gateway {
    fn call(
        &self,
        peer: SocketAddr,
        req: Request<ClientBody>,
    ) -> impl Future<Output = Result<Response<ResponseBody>, Infallible>> + Send + '_ {
        crate::gateway::handle(&self.0, peer, req)
    }
}

/// A handler on the TLS listener: each request marked as having come over HTTPS.
#[derive(Clone)]
struct Https<H>(H);

impl<H: Handler> Handler for Https<H> {
    fn call(
        &self,
        peer: SocketAddr,
        mut req: Request<ClientBody>,
    ) -> impl Future<Output = Result<Response<ResponseBody>, Infallible>> + Send + '_ {
        req.extensions_mut().insert(crate::tls::Https);
        self.0.call(peer, req)
    }
}

/// A handler on a TLS connection that sent a client certificate: the certificate on each
/// request.
#[derive(Clone)]
struct WithCert<H> {
    handler: H,
    cert: Option<Arc<crate::client_cert::ClientCert>>,
}

impl<H: Handler> Handler for WithCert<H> {
    fn call(
        &self,
        peer: SocketAddr,
        mut req: Request<ClientBody>,
    ) -> impl Future<Output = Result<Response<ResponseBody>, Infallible>> + Send + '_ {
        if let Some(cert) = &self.cert {
            req.extensions_mut().insert(cert.clone());
        }
        self.handler.call(peer, req)
    }
}

/// The public listener (unless `listen: off`), and the TLS one when configured: the inline
/// gateway. Both count in `turnstile_open_connections{listener="public"}`.
pub(crate) async fn serve_public(
    listener: Option<TcpListener>,
    tls: Option<(TcpListener, Arc<ServerTls>)>,
    state: Arc<AppState>,
    shutdown: watch::Receiver<bool>,
) {
    let metrics = ListenerMetrics::register(&state.metrics, "public");
    let handler = Gateway(state.clone());
    let tls_task = tls.map(|(listener, tls)| {
        let https = Https(handler.clone());
        tokio::spawn(serve_http(
            listener,
            Some(tls),
            state.clone(),
            shutdown.clone(),
            metrics.clone(),
            https,
        ))
    });
    if let Some(listener) = listener {
        serve_http(listener, None, state, shutdown, metrics, handler).await;
    }
    if let Some(task) = tls_task {
        let _ = task.await;
    }
}

/// The forward-auth check listener: the same bounds and drain as the public one (and TLS with
/// `forward_auth.tls`), its connections in `turnstile_open_connections{listener="forward_auth"}`.
pub(crate) async fn serve_check<H: Handler>(
    listener: TcpListener,
    tls: Option<Arc<ServerTls>>,
    state: Arc<AppState>,
    shutdown: watch::Receiver<bool>,
    handler: H,
) {
    let metrics = ListenerMetrics::register(&state.metrics, "forward_auth");
    serve_http(listener, tls, state, shutdown, metrics, handler).await;
}

/// Serves HTTP/1.1 and h2c (or, with `tls`, HTTPS) on `listener` with `handler` until
/// `shutdown`, then drains.
async fn serve_http<H: Handler>(
    listener: TcpListener,
    tls: Option<Arc<ServerTls>>,
    state: Arc<AppState>,
    mut shutdown: watch::Receiver<bool>,
    metrics: ListenerMetrics,
    handler: H,
) {
    let settings = state.live.load().config.server.clone();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(settings.header_read_timeout)
        .max_buf_size(settings.max_header_size)
        .keep_alive(true)
        // One flat write per response (head and small bodies copied together) costs fewer
        // instructions than hyper's vectored queue; large bodies still stream chunk by chunk.
        .writev(false);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(256)
        .max_header_list_size(u32::try_from(settings.max_header_size).unwrap_or(u32::MAX))
        // Pings find dead peers; a connection that stops answering is closed.
        .keep_alive_interval(Some(Duration::from_secs(30)))
        .keep_alive_timeout(Duration::from_secs(10));
    let builder = Arc::new(builder);
    let limits = h1::Limits {
        header_read_timeout: settings.header_read_timeout,
        max_header_size: settings.max_header_size,
    };
    let max_connections = u32::try_from(settings.max_connections).unwrap_or(u32::MAX);
    let slots = Arc::new(Semaphore::new(max_connections as usize));

    loop {
        // A slot first: past the limit, connections wait in the accept backlog.
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
            _ = shutdown.changed() => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = shutdown.changed() => break,
        };
        let _ = stream.set_nodelay(true);
        let handler = handler.clone();
        let builder = builder.clone();
        let stopping = shutdown.clone();
        let metrics = metrics.clone();
        let tls = tls.clone();
        // On a connection worker of its own when there are several (`crate::workers`).
        crate::workers::spawn_connection(stream, move |stream| async move {
            let open = Open::new(slot, &metrics);
            serve_connection(
                stream,
                peer,
                handler,
                &builder,
                stopping,
                limits,
                &metrics,
                tls.as_deref(),
                open,
            )
            .await;
        });
    }
    drop(listener);
    let grace = state.live.load().config.server.shutdown_grace;
    // Every slot back means every connection has ended.
    if tokio::time::timeout(grace, slots.acquire_many(max_connections))
        .await
        .is_err()
    {
        tracing::warn!(?grace, "grace period over; closing remaining connections");
    }
}

/// A connection's `max_connections` slot and its count in the open-connections gauges (its
/// listener's, and its worker's), released together when it is dropped: when the connection
/// ends, or, for one that upgraded (a WebSocket), when its tunnel closes (it rides on the stream:
/// `crate::proxy::held`).
struct Open {
    _slot: OwnedSemaphorePermit,
    gauge: IntGauge,
    worker: Option<IntGauge>,
}

impl Open {
    /// Counts a connection on the thread that serves it.
    fn new(slot: OwnedSemaphorePermit, metrics: &ListenerMetrics) -> Self {
        metrics.open.inc();
        let worker = crate::workers::index()
            .checked_sub(1)
            .and_then(|i| metrics.workers.get(i))
            .cloned();
        if let Some(worker) = &worker {
            worker.inc();
        }
        Open {
            _slot: slot,
            gauge: metrics.open.clone(),
            worker,
        }
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.gauge.dec();
        if let Some(worker) = &self.worker {
            worker.dec();
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn serve_connection<H: Handler>(
    stream: TcpStream,
    peer: SocketAddr,
    handler: H,
    builder: &auto::Builder<TokioExecutor>,
    mut stopping: watch::Receiver<bool>,
    limits: h1::Limits,
    metrics: &ListenerMetrics,
    tls: Option<&ServerTls>,
    open: Open,
) {
    // A connection that has not said a byte when shutdown begins has no request to finish: close
    // it rather than hold the drain until its detection times out.
    if let Some(tls) = tls {
        let accepted = tokio::select! {
            accepted = crate::tls::accept::accept(tls, stream, limits.header_read_timeout) => accepted,
            _ = stopping.wait_for(|stop| *stop) => None,
        };
        let Some(stream) = accepted else {
            return;
        };
        // Read once per connection, only where a client CA asks for certificates.
        let cert = if tls.asks_client_cert() {
            crate::client_cert::of_connection(stream.get_ref().get_ref().1)
        } else {
            None
        };
        let handler = WithCert { handler, cert };
        serve_io(
            Held::new(TokioIo::new(stream), open),
            peer,
            handler,
            builder,
            stopping,
            metrics,
        )
        .await;
        return;
    }
    let known = tokio::select! {
        known = protocol_known(&stream, limits.header_read_timeout) => known,
        _ = stopping.wait_for(|stop| *stop) => None,
    };
    match known {
        None => {}
        Some(Protocol::H2) => {
            serve_io(
                Held::new(TokioIo::new(stream), open),
                peer,
                handler,
                builder,
                stopping,
                metrics,
            )
            .await;
        }
        Some(Protocol::Http1) => {
            if let h1::Ended::HandOff(io) =
                h1::serve(stream, peer, &handler, limits, &stopping).await
            {
                let io = Held::new(TokioIo::new(io), open);
                serve_io(io, peer, handler, builder, stopping, metrics).await;
            }
        }
    }
}

/// What a plain-TCP client speaks, from its first bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Http1,
    /// The h2c preface (prior knowledge).
    H2,
}

/// Serves one connection whose protocol is known, until it ends, shutdown, or abuse.
async fn serve_io<I, H: Handler>(
    io: I,
    peer: SocketAddr,
    handler: H,
    builder: &auto::Builder<TokioExecutor>,
    mut stopping: watch::Receiver<bool>,
    metrics: &ListenerMetrics,
) where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let connection = Arc::new(Connection {
        cancels: Mutex::new((Instant::now(), 0)),
        goaway: Notify::new(),
    });
    let state = connection.clone();
    let service = service_fn(move |req| {
        let finished = Finished {
            connection: state.clone(),
            done: false,
        };
        // A future of its own: it holds its own handler.
        let handler = handler.clone();
        async move {
            let mut response = handler.call(peer, req.map(ClientBody::from)).await;
            finished.done();
            // hyper writes the response from its field map alone.
            if let Ok(response) = &mut response {
                crate::proxy::fields::materialize(response);
            }
            response
        }
    });
    let conn = builder.serve_connection_with_upgrades(io, service);
    tokio::pin!(conn);
    let mut closing = false;
    let result = loop {
        tokio::select! {
            result = conn.as_mut() => break result,
            _ = stopping.wait_for(|stop| *stop), if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
            () = connection.goaway.notified(), if !closing => {
                closing = true;
                metrics.goaway_cancelled.inc();
                if let Some(suppressed) = ABUSE_LOG.allow() {
                    tracing::warn!(
                        %peer,
                        suppressed,
                        "closing a connection that cancelled more than {CANCEL_LIMIT} requests \
                         within {CANCEL_WINDOW:?}"
                    );
                }
                conn.as_mut().graceful_shutdown();
            }
        }
    };
    if let Err(e) = result {
        if is_reset_flood(&*e as &(dyn std::error::Error + 'static)) {
            metrics.goaway_resets.inc();
            if let Some(suppressed) = ABUSE_LOG.allow() {
                tracing::warn!(%peer, suppressed, "closed a connection that reset streams rapidly");
            }
        } else {
            tracing::debug!(error = %e, %peer, "connection ended with an error");
        }
    }
}

/// Whether hyper's h2 closed the connection with `ENHANCE_YOUR_CALM` (too many streams reset
/// before acceptance, or too many local resets).
fn is_reset_flood(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(e);
    while let Some(err) = source {
        if let Some(h2) = err.downcast_ref::<h2::Error>() {
            return h2.reason() == Some(h2::Reason::ENHANCE_YOUR_CALM);
        }
        source = err.source();
    }
    false
}

/// The h2c connection preface (RFC 9113 §3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Waits until the client's first bytes tell HTTP/1.1 from an h2c preface, for at most `limit`;
/// `None` when the client said too little in time (or hung up). hyper-util's own detection waits
/// without a deadline, and hyper's `header_read_timeout` only starts after it, so without this a
/// client that connects and stays silent, or trickles a preface, holds a connection forever
/// (slowloris). Bytes are peeked, not read: the lean path (or hyper) then reads them as usual. A
/// slow HTTP/1.1 head thus gets at most twice `limit` in all: this wait, then hyper's own.
async fn protocol_known(stream: &TcpStream, limit: Duration) -> Option<Protocol> {
    let deadline = tokio::time::Instant::now() + limit;
    let mut buf = [0u8; H2_PREFACE.len()];
    loop {
        let n = match tokio::time::timeout_at(deadline, stream.peek(&mut buf)).await {
            Ok(Ok(n)) => n,
            Ok(Err(_)) | Err(_) => return None,
        };
        if n == 0 {
            return None;
        }
        if buf[..n] != H2_PREFACE[..n] {
            return Some(Protocol::Http1);
        }
        if n == H2_PREFACE.len() {
            return Some(Protocol::H2);
        }
        // Part of a preface: `peek` returns at once while bytes are waiting, so pause rather
        // than spin. Real h2c clients send the 24 bytes in one write and never get here.
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(5).min(deadline - tokio::time::Instant::now()))
            .await;
    }
}
