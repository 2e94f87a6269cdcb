//! The connection pool of one upstream: idle HTTP/1.1 connections, reused last in, first out.
//!
//! Why not hyper-util's pooled client: per request it hashes its pool key (scheme and authority,
//! byte by byte through SipHash) twice and spawns a task to put the connection back once it is
//! idle, which together cost more than the rest of the gateway's own work. One pool per upstream
//! needs no key, and a connection goes back as its response body ends, when it is almost always
//! ready for the next request already (otherwise a task waits for it, as hyper-util's does).
//!
//! Like hyper-util's client, it retries a request that a reused connection never sent (the
//! upstream closed it while it sat idle) on another connection, gives every request a `Host`, and
//! closes connections idle for longer than [`IDLE_TIMEOUT`].
//!
//! At most `max_connections` are open at once, busy and idle together: each connection holds a
//! semaphore permit until it closes. A request that finds none idle and none free waits up to
//! `pool_timeout` for either (then [`ClientError::PoolTimeout`], a 503), so clients that cancel
//! requests in flight (each cancel closes an HTTP/1.1 connection) cannot make the gateway open
//! connections to the upstream without bound.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::uri::{Authority, Scheme};
use http::{HeaderValue, Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::client::legacy::connect::HttpConnector;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tower::ServiceExt;

use super::body::RequestBody;
use crate::tls::Connector;

/// Idle connections kept per upstream; more are closed as they fall idle.
pub const MAX_IDLE: usize = 1024;
/// An idle connection older than this is closed instead of reused.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// The pooled HTTP/1.1 client of one upstream. Cheap to clone: clones share the pool.
#[derive(Clone)]
pub struct UpstreamClient {
    shared: Arc<Shared>,
}

struct Shared {
    connector: Connector,
    /// What the connector dials: `http://authority` or `https://authority`.
    target: Uri,
    /// The `Host` of a request that arrives without one: the authority, minus a default port.
    default_host: Option<HeaderValue>,
    idle: Mutex<VecDeque<Idle>>,
    /// One permit per connection that may be open.
    slots: Arc<Semaphore>,
    /// Wakes a request waiting for a connection when one falls idle.
    idled: Notify,
    pool_timeout: Duration,
}

/// The bounds of one upstream's pool.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub connect_timeout: Duration,
    pub max_connections: usize,
    pub pool_timeout: Duration,
}

struct Idle {
    sender: SendRequest<RequestBody>,
    since: Instant,
}

/// Why a request did not get a response.
#[derive(Debug)]
pub enum ClientError {
    /// No connection could be opened.
    Connect(Box<dyn std::error::Error + Send + Sync>),
    /// The exchange failed on an open connection (or the request body failed).
    Request(hyper::Error),
    /// All `max_connections` stayed busy for `pool_timeout`.
    PoolTimeout,
}

impl std::fmt::Debug for UpstreamClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamClient")
            .field("target", &self.shared.target)
            .finish_non_exhaustive()
    }
}

impl UpstreamClient {
    pub fn new(authority: &Authority, limits: Limits) -> Self {
        Self::with_tls(&Scheme::HTTP, authority, limits, None)
    }

    /// The client of an `http://` or `https://` (`tls` required) upstream.
    pub fn with_tls(
        scheme: &Scheme,
        authority: &Authority,
        limits: Limits,
        tls: Option<&crate::tls::UpstreamTls>,
    ) -> Self {
        let mut tcp = HttpConnector::new();
        tcp.set_connect_timeout(Some(limits.connect_timeout));
        tcp.set_nodelay(true);
        tcp.set_keepalive(Some(Duration::from_secs(60)));
        let connector = Connector::new(tcp, tls, limits.connect_timeout);
        let target = Uri::builder()
            .scheme(scheme.clone())
            .authority(authority.clone())
            .path_and_query("/")
            .build()
            .unwrap_or_default();
        let default_port = if *scheme == Scheme::HTTPS { 443 } else { 80 };
        let default_host = match authority.port_u16() {
            Some(port) if port != default_port => {
                HeaderValue::from_str(&format!("{}:{port}", authority.host())).ok()
            }
            _ => HeaderValue::from_str(authority.host()).ok(),
        };
        UpstreamClient {
            shared: Arc::new(Shared {
                connector,
                target,
                default_host,
                idle: Mutex::new(VecDeque::new()),
                slots: Arc::new(Semaphore::new(limits.max_connections)),
                idled: Notify::new(),
                pool_timeout: limits.pool_timeout,
            }),
        }
    }

    /// The `Host` to send when the client's request has none.
    pub fn default_host(&self) -> Option<&HeaderValue> {
        self.shared.default_host.as_ref()
    }

    /// Sends `req` (origin-form URI, `Host` set) on an idle connection, or a new one, and returns
    /// the response with its body streaming; the connection returns to the pool when that body
    /// ends.
    pub async fn send(
        &self,
        req: Request<RequestBody>,
    ) -> Result<Response<UpstreamBody>, ClientError> {
        self.send_or_return(req).await.map_err(|(e, _)| e)
    }

    /// As [`send`](Self::send), but a request that never left (no connection, or none within
    /// `pool_timeout`) comes back with the error, for another target to take.
    pub async fn send_or_return(
        &self,
        mut req: Request<RequestBody>,
    ) -> Result<Response<UpstreamBody>, (ClientError, Option<Request<RequestBody>>)> {
        loop {
            let (mut sender, reused) = match self.acquire().await {
                Ok(acquired) => acquired,
                Err(e) => return Err((e, Some(req))),
            };
            match sender.try_send_request(req).await {
                Ok(response) => {
                    let shared = self.shared.clone();
                    return Ok(response.map(|body| UpstreamBody {
                        inner: body,
                        reuse: Some((sender, shared)),
                    }));
                }
                Err(mut e) => match e.take_message() {
                    // Never sent: the connection closed while idle. Another one may do.
                    Some(back) if reused => req = back,
                    _ => return Err((ClientError::Request(e.into_error()), None)),
                },
            }
        }
    }

    /// The most recently idle connection that is still usable; stale ones are closed on the way.
    fn checkout(&self) -> Option<SendRequest<RequestBody>> {
        let mut idle = lock(&self.shared.idle);
        while let Some(entry) = idle.pop_back() {
            if entry.sender.is_ready() && entry.since.elapsed() < IDLE_TIMEOUT {
                return Some(entry.sender);
            }
        }
        None
    }

    /// An idle connection (`true`), or a new one (`false`) once a slot is free, waiting at most
    /// `pool_timeout` for either.
    async fn acquire(&self) -> Result<(SendRequest<RequestBody>, bool), ClientError> {
        if let Some(sender) = self.checkout() {
            return Ok((sender, true));
        }
        if let Ok(slot) = self.shared.slots.clone().try_acquire_owned() {
            return Ok((self.connect(slot).await?, false));
        }
        let deadline = tokio::time::Instant::now() + self.shared.pool_timeout;
        loop {
            // Registered before looking again, so a connection idled in between still wakes us.
            let idled = self.shared.idled.notified();
            tokio::pin!(idled);
            idled.as_mut().enable();
            if let Some(sender) = self.checkout() {
                return Ok((sender, true));
            }
            tokio::select! {
                slot = self.shared.slots.clone().acquire_owned() => {
                    let slot = slot.map_err(|_| ClientError::PoolTimeout)?;
                    return Ok((self.connect(slot).await?, false));
                }
                () = &mut idled => {}
                () = tokio::time::sleep_until(deadline) => return Err(ClientError::PoolTimeout),
            }
        }
    }

    /// Opens a connection that holds `slot` until it closes.
    async fn connect(
        &self,
        slot: OwnedSemaphorePermit,
    ) -> Result<SendRequest<RequestBody>, ClientError> {
        let io = self
            .shared
            .connector
            .clone()
            .oneshot(self.shared.target.clone())
            .await
            .map_err(|e| ClientError::Connect(e.into()))?;
        let (sender, connection) = http1::Builder::new()
            // Copy body chunks into the head's buffer and write once: cheaper than hyper's
            // vectored queue for the small messages a gateway mostly carries.
            .writev(false)
            .handshake(io)
            .await
            .map_err(|e| ClientError::Connect(e.into()))?;
        tokio::spawn(async move {
            if let Err(e) = connection.with_upgrades().await {
                tracing::debug!(error = %e, "upstream connection ended with an error");
            }
            drop(slot);
        });
        Ok(sender)
    }
}

impl Shared {
    /// Takes back a connection whose exchange is over.
    fn put(self: Arc<Self>, sender: SendRequest<RequestBody>) {
        if sender.is_ready() {
            self.push(sender);
        } else if !sender.is_closed() {
            // Still finishing (a request body the upstream did not wait for): wait aside.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                let mut sender = sender;
                runtime.spawn(async move {
                    if sender.ready().await.is_ok() {
                        self.push(sender);
                    }
                });
            }
        }
    }

    fn push(&self, sender: SendRequest<RequestBody>) {
        let now = Instant::now();
        let mut idle = lock(&self.idle);
        while idle
            .front()
            .is_some_and(|oldest| now.duration_since(oldest.since) >= IDLE_TIMEOUT)
        {
            idle.pop_front();
        }
        if idle.len() < MAX_IDLE {
            idle.push_back(Idle { sender, since: now });
        }
        drop(idle);
        self.idled.notify_one();
    }
}

/// A poisoned pool only means a panic elsewhere while it was locked; the list is still valid.
fn lock(idle: &Mutex<VecDeque<Idle>>) -> MutexGuard<'_, VecDeque<Idle>> {
    idle.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// An upstream response body. When it has been read to the end, its connection goes back to the
/// pool; dropped before that, the connection is closed (HTTP/1.1 cannot skip the rest).
pub struct UpstreamBody {
    inner: Incoming,
    reuse: Option<(SendRequest<RequestBody>, Arc<Shared>)>,
}

impl UpstreamBody {
    /// Keeps the connection out of the pool: it has been upgraded (101) and belongs to a tunnel.
    pub fn detach(&mut self) {
        self.reuse = None;
    }

    fn release(&mut self) {
        if let Some((sender, shared)) = self.reuse.take() {
            shared.put(sender);
        }
    }
}

impl std::fmt::Debug for UpstreamBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamBody")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => this.release(),
            Poll::Ready(Some(Err(_))) => this.reuse = None,
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        // A body the server never polls (empty, or its length reached) still ended cleanly.
        if self.inner.is_end_stream() {
            self.release();
        }
    }
}
