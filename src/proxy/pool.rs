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
//! Requests with no body and nothing to upgrade, to a plain-TCP upstream, take the lean
//! HTTP/1.1 exchange of [`super::h1`]; everything else takes hyper's client. The two kinds of
//! connection idle apart (neither can carry the other's exchange) but share one bound. An
//! upstream with `protocol: h2` has neither: each target keeps one multiplexed HTTP/2 connection
//! ([`super::h2`]) that every request shares.
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
use hyper_util::rt::TokioIo;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tower::ServiceExt;

use super::body::{BoxError, RequestBody};
use super::fields::RawFields;
use super::h1;
use super::h2::{self as h2c, H2Conn};
use super::held::Held;
use crate::config::UpstreamProtocol;
use crate::tls::connect::Stream;
use crate::tls::Connector;

/// Idle connections kept per upstream; more are closed as they fall idle.
pub use crate::config::MAX_IDLE;
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
    /// One per connection worker (`crate::workers`), and one for every other thread. A worker
    /// takes from its own, and borrows another's connection only when it has none idle and may
    /// open none. A lean connection idles on the worker whose runtime opened it (its socket's
    /// events and timer are that runtime's), even after a borrow; a hyper one, whose I/O runs in
    /// a task of its own, idles where it was last used.
    idle: Box<[PerWorker]>,
    /// Whether bodiless requests take the lean exchange: only to a plain-TCP upstream.
    lean: bool,
    /// One permit per connection that may be open.
    slots: Arc<Semaphore>,
    /// Wakes a request waiting for a connection when one falls idle.
    idled: Notify,
    pool_timeout: Duration,
    /// `protocol: h2`: the target's one HTTP/2 connection, which every request takes.
    h2: Option<H2Conn>,
}

/// The bounds of one upstream's pool.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub connect_timeout: Duration,
    pub max_connections: usize,
    pub pool_timeout: Duration,
}

struct Idle<C> {
    conn: C,
    since: Instant,
}

/// One worker's idle connections, on a cache line of its own: each worker locks only its own.
#[derive(Default)]
#[repr(align(128))]
struct PerWorker(Mutex<IdleSet>);

/// The idle connections of each kind, most recently idle last.
#[derive(Default)]
struct IdleSet {
    hyper: VecDeque<Idle<SendRequest<RequestBody>>>,
    lean: VecDeque<Idle<h1::Conn>>,
}

impl IdleSet {
    fn take_hyper(&mut self) -> Option<SendRequest<RequestBody>> {
        while let Some(entry) = self.hyper.pop_back() {
            if entry.conn.is_ready() && idle_for(&entry) < IDLE_TIMEOUT {
                return Some(entry.conn);
            }
        }
        None
    }

    fn take_lean(&mut self) -> Option<h1::Conn> {
        while let Some(entry) = self.lean.pop_back() {
            if idle_for(&entry) < IDLE_TIMEOUT && entry.conn.usable() {
                return Some(entry.conn);
            }
        }
        None
    }
}

/// How long a pooled connection has been idle, near enough for a limit of seconds
/// (`crate::now::recent`).
fn idle_for<C>(entry: &Idle<C>) -> Duration {
    crate::now::recent().saturating_duration_since(entry.since)
}

/// An idle connection, or a slot to open one with.
enum Got<C> {
    Idle(C),
    Slot(OwnedSemaphorePermit),
}

/// Why a request did not get a response.
#[derive(Debug)]
pub enum ClientError {
    /// No connection could be opened.
    Connect(Box<dyn std::error::Error + Send + Sync>),
    /// The exchange failed on an open connection (or the request body failed).
    Request(BoxError),
    /// All `max_connections` stayed busy for `pool_timeout`.
    PoolTimeout,
    /// No response head by the deadline.
    Timeout,
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
        Self::with_tls(
            &Scheme::HTTP,
            authority,
            limits,
            None,
            UpstreamProtocol::Http1,
        )
    }

    /// The client of an `http://` or `https://` (`tls` required) upstream, speaking `protocol`.
    pub fn with_tls(
        scheme: &Scheme,
        authority: &Authority,
        limits: Limits,
        tls: Option<&crate::tls::UpstreamTls>,
        protocol: UpstreamProtocol,
    ) -> Self {
        let mut tcp = HttpConnector::new();
        tcp.set_connect_timeout(Some(limits.connect_timeout));
        tcp.set_nodelay(true);
        tcp.set_keepalive(Some(Duration::from_secs(60)));
        let h2 = protocol == UpstreamProtocol::H2;
        // The upstream's TLS settings, offering `h2` instead of `http/1.1` by ALPN (RFC 7301).
        let h2_tls = tls.filter(|_| h2).map(|tls| {
            let mut config = (*tls.config).clone();
            config.alpn_protocols = vec![b"h2".to_vec()];
            crate::tls::UpstreamTls {
                config: Arc::new(config),
            }
        });
        let connector = Connector::new(tcp, h2_tls.as_ref().or(tls), limits.connect_timeout);
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
                idle: (0..=crate::workers::count())
                    .map(|_| PerWorker::default())
                    .collect(),
                lean: *scheme == Scheme::HTTP && !h2,
                slots: Arc::new(Semaphore::new(limits.max_connections)),
                idled: Notify::new(),
                pool_timeout: limits.pool_timeout,
                h2: h2.then(H2Conn::default),
            }),
        }
    }

    /// The `Host` to send when the client's request has none.
    pub fn default_host(&self) -> Option<&HeaderValue> {
        self.shared.default_host.as_ref()
    }

    /// Sends `req` (origin-form URI, `Host` set) on an idle connection, or a new one, and returns
    /// the response with its body streaming; the connection returns to the pool when that body
    /// ends. A request that never left (no connection, or none within `pool_timeout`) comes back
    /// with the error, for another target to take. The response head must come by `deadline` (a
    /// lean connection keeps its own timer for it).
    ///
    /// The request is taken apart before the future is made, which then holds it once (an
    /// `async fn` would keep the request beside its parts). Inlined, so that the future is built
    /// in the awaiting future's state, not built and then copied there.
    #[inline(always)]
    pub fn send_or_return(
        &self,
        req: Request<RequestBody>,
        deadline: tokio::time::Instant,
    ) -> impl std::future::Future<
        Output = Result<Response<UpstreamBody>, (ClientError, Option<Request<RequestBody>>)>,
    > + '_ {
        let (parts, body) = req.into_parts();
        let lean = self.shared.lean && h1::suits(&parts, body.is_end_stream());
        async move {
            if lean {
                return match self.send_lean(&parts, deadline).await {
                    Ok(response) => {
                        // Sent: the fields are done with, their map serves the next request.
                        super::headers::recycle(parts.headers);
                        Ok(response)
                    }
                    Err((e, unsent)) => Err((e, unsent.then(|| Request::from_parts(parts, body)))),
                };
            }
            let req = Request::from_parts(parts, body);
            if let Some(h2) = &self.shared.h2 {
                let sent = Box::pin(self.send_h2(h2, req));
                return tokio::time::timeout_at(deadline, sent)
                    .await
                    .unwrap_or(Err((ClientError::Timeout, None)));
            }
            // Boxed: hyper's exchange would make every request's future as large as its own.
            let sent = Box::pin(self.send_hyper(req, deadline));
            tokio::time::timeout_at(deadline, sent)
                .await
                .unwrap_or(Err((ClientError::Timeout, None)))
        }
    }

    /// A request on the target's HTTP/2 connection (opened first when there is none). A request
    /// the connection refused unsent (it closed in between) is tried once on a new one; one
    /// that could not connect comes back for another target.
    async fn send_h2(
        &self,
        h2: &H2Conn,
        mut req: Request<RequestBody>,
    ) -> Result<Response<UpstreamBody>, (ClientError, Option<Request<RequestBody>>)> {
        let target = &self.shared.target;
        let fallback = target
            .authority()
            .cloned()
            .unwrap_or_else(|| Authority::from_static("localhost"));
        h2c::h2_form(
            &mut req,
            target.scheme().unwrap_or(&Scheme::HTTP),
            &fallback,
        );
        let mut retried = false;
        loop {
            let (mut sender, reused) = match h2.current() {
                Some(sender) => (sender, true),
                None => match h2.open(self.dial()).await {
                    Ok(sender) => (sender, false),
                    Err(e) => return Err((e, Some(req))),
                },
            };
            match sender.try_send_request(req).await {
                Ok(response) => {
                    // The connection is shared, never given back: nothing to reuse.
                    return Ok(response.map(|body| UpstreamBody {
                        inner: Inner::Hyper { body, reuse: None },
                    }));
                }
                Err(mut e) => match e.take_message() {
                    Some(back) if reused && !retried => {
                        tracing::debug!(error = %e.error(), "upstream h2 connection closed; retrying on a new one");
                        retried = true;
                        req = back;
                    }
                    _ => return Err((ClientError::Request(e.into_error().into()), None)),
                },
            }
        }
    }

    /// A bodiless request on a lean connection. The error's flag: nothing was sent.
    /// The deadline covers the wait for a connection (`acquire`) and a new one's connect too.
    async fn send_lean(
        &self,
        parts: &http::request::Parts,
        deadline: tokio::time::Instant,
    ) -> Result<Response<UpstreamBody>, (ClientError, bool)> {
        loop {
            let acquired = self
                .acquire(
                    IdleSet::take_lean,
                    |set| set.hyper.pop_front().is_some(),
                    deadline,
                )
                .await;
            let (conn, reused) = match acquired {
                Ok(Got::Idle(conn)) => (conn, true),
                Ok(Got::Slot(slot)) => {
                    // Boxed, as opening connections is rare (see `acquire`).
                    let conn =
                        Box::pin(tokio::time::timeout_at(deadline, self.connect_lean(slot))).await;
                    match conn {
                        Ok(conn) => (conn.map_err(|e| (e, true))?, false),
                        Err(_) => return Err((ClientError::Timeout, false)),
                    }
                }
                Err(ClientError::Timeout) => return Err((ClientError::Timeout, false)),
                Err(e) => return Err((e, true)),
            };
            match conn.exchange(parts, deadline).await {
                Ok((response, mut body)) => {
                    // A response with no body gives its connection back before it is answered.
                    if body.is_end() {
                        if let Some(conn) = body.take_reusable() {
                            self.shared.push_lean(conn);
                        }
                    }
                    let shared = self.shared.clone();
                    return Ok(response.map(|()| UpstreamBody {
                        inner: Inner::Lean(body, shared),
                    }));
                }
                // The upstream closed a reused connection before answering; a request that may
                // be sent twice goes on another (RFC 9110 §9.2.2).
                Err(failure) if failure.unanswered && reused && h1::idempotent(&parts.method) => {
                    tracing::debug!(error = %failure.error, "reused upstream connection closed; retrying");
                }
                Err(failure) if matches!(failure.error, h1::Error::TimedOut) => {
                    return Err((ClientError::Timeout, false))
                }
                Err(failure) => return Err((ClientError::Request(Box::new(failure.error)), false)),
            }
        }
    }

    async fn send_hyper(
        &self,
        mut req: Request<RequestBody>,
        deadline: tokio::time::Instant,
    ) -> Result<Response<UpstreamBody>, (ClientError, Option<Request<RequestBody>>)> {
        loop {
            let (mut sender, reused) = match self
                .acquire(
                    IdleSet::take_hyper,
                    |set| set.lean.pop_front().is_some(),
                    deadline,
                )
                .await
            {
                Ok(Got::Idle(sender)) => (sender, true),
                Ok(Got::Slot(slot)) => match self.connect(slot).await {
                    Ok(sender) => (sender, false),
                    Err(e) => return Err((e, Some(req))),
                },
                Err(e) => return Err((e, Some(req))),
            };
            match sender.try_send_request(req).await {
                Ok(response) => {
                    let shared = self.shared.clone();
                    return Ok(response.map(|body| UpstreamBody {
                        inner: Inner::Hyper {
                            body,
                            reuse: Some((sender, shared)),
                        },
                    }));
                }
                Err(mut e) => match e.take_message() {
                    // Never sent: the connection closed while idle. Another one may do.
                    Some(back) if reused => req = back,
                    _ => return Err((ClientError::Request(e.into_error().into()), None)),
                },
            }
        }
    }

    /// An idle connection that `take` accepts, or a slot for a new one, waiting at most
    /// `pool_timeout` for either.
    async fn acquire<C>(
        &self,
        take: fn(&mut IdleSet) -> Option<C>,
        evict: fn(&mut IdleSet) -> bool,
        deadline: tokio::time::Instant,
    ) -> Result<Got<C>, ClientError> {
        let shared = &*self.shared;
        if let Some(conn) = take(&mut lock(shared.own())) {
            return Ok(Got::Idle(conn));
        }
        if let Ok(slot) = shared.slots.clone().try_acquire_owned() {
            return Ok(Got::Slot(slot));
        }
        if let Some(conn) = shared.others().find_map(|idle| take(&mut lock(idle))) {
            return Ok(Got::Idle(conn));
        }
        // Boxed: waiting is rare, and its timer and wait lists would otherwise be part of every
        // request's future, which is moved (copied) several times per request.
        Box::pin(self.wait(take, evict, deadline)).await
    }

    /// Waits for an idle connection or a free slot. While waiting, an idle connection of the
    /// other kind is closed (`evict`) so that its slot comes free: otherwise idle connections of
    /// one kind could hold every slot while requests of the other kind time out. The request's
    /// own `deadline` (its response head's) ends the wait too, if it comes first.
    async fn wait<C>(
        &self,
        take: fn(&mut IdleSet) -> Option<C>,
        evict: fn(&mut IdleSet) -> bool,
        deadline: tokio::time::Instant,
    ) -> Result<Got<C>, ClientError> {
        let pool_deadline = tokio::time::Instant::now() + self.shared.pool_timeout;
        let timed_out = deadline < pool_deadline;
        let until = deadline.min(pool_deadline);
        loop {
            // Registered before looking again, so a connection idled in between still wakes us.
            let idled = self.shared.idled.notified();
            tokio::pin!(idled);
            idled.as_mut().enable();
            for idle in std::iter::once(self.shared.own()).chain(self.shared.others()) {
                let mut idle = lock(idle);
                if let Some(conn) = take(&mut idle) {
                    return Ok(Got::Idle(conn));
                }
                evict(&mut idle);
            }
            tokio::select! {
                slot = self.shared.slots.clone().acquire_owned() => {
                    return slot.map(Got::Slot).map_err(|_| ClientError::PoolTimeout);
                }
                () = &mut idled => {}
                () = tokio::time::sleep_until(until) => {
                    return Err(if timed_out { ClientError::Timeout } else { ClientError::PoolTimeout });
                }
            }
        }
    }

    /// A new connection to the target, TCP (and TLS for `https://`) only.
    async fn dial(&self) -> Result<TokioIo<Stream>, ClientError> {
        self.shared
            .connector
            .clone()
            .oneshot(self.shared.target.clone())
            .await
            .map_err(|e| ClientError::Connect(e.into()))
    }

    /// Opens a lean connection that holds `slot` until it closes.
    async fn connect_lean(&self, slot: OwnedSemaphorePermit) -> Result<h1::Conn, ClientError> {
        match self.dial().await?.into_inner() {
            Stream::Plain(tcp) => Ok(h1::Conn::new(tcp, slot)),
            Stream::Tls(_) => Err(ClientError::Connect(
                "a TLS stream for a plain upstream".into(),
            )),
        }
    }

    /// Opens a connection that holds `slot` until it closes.
    async fn connect(
        &self,
        slot: OwnedSemaphorePermit,
    ) -> Result<SendRequest<RequestBody>, ClientError> {
        // The slot goes with the connection's bytes, not with hyper's connection task: an
        // upgraded (101) connection leaves that task for a tunnel, and must still count.
        let io = Held::new(self.dial().await?, slot);
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
        });
        Ok(sender)
    }
}

impl Shared {
    /// This thread's idle connections.
    fn own(&self) -> &PerWorker {
        &self.idle[crate::workers::index() % self.idle.len()]
    }

    /// Every other worker's, in turn from the next one.
    fn others(&self) -> impl Iterator<Item = &PerWorker> {
        let own = crate::workers::index() % self.idle.len();
        (1..self.idle.len()).map(move |step| &self.idle[(own + step) % self.idle.len()])
    }

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
        let evicted = push_idle(&mut lock(self.own()).hyper, sender);
        drop(evicted);
        self.idled.notify_one();
    }

    fn push_lean(&self, conn: h1::Conn) {
        // Home to the worker whose runtime it was opened on, even after another borrowed it.
        let home = &self.idle[conn.home() % self.idle.len()];
        let evicted = push_idle(&mut lock(home).lean, conn);
        drop(evicted);
        self.idled.notify_one();
    }
}

/// Adds a connection to one idle list, first dropping entries that expired; what was dropped is
/// returned, to be closed outside the lock.
fn push_idle<C>(list: &mut VecDeque<Idle<C>>, conn: C) -> Vec<Idle<C>> {
    let now = crate::now::recent();
    let mut evicted = Vec::new();
    while list
        .front()
        .is_some_and(|oldest| now.duration_since(oldest.since) >= IDLE_TIMEOUT)
    {
        evicted.extend(list.pop_front());
    }
    if list.len() < MAX_IDLE {
        list.push_back(Idle { conn, since: now });
    } else {
        evicted.push(Idle { conn, since: now });
    }
    evicted
}

/// A poisoned pool only means a panic elsewhere while it was locked; the lists are still valid.
fn lock(idle: &PerWorker) -> MutexGuard<'_, IdleSet> {
    idle.0
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// An upstream response body. When it has been read to the end, its connection goes back to the
/// pool; dropped before that, the connection is closed (HTTP/1.1 cannot skip the rest).
pub struct UpstreamBody {
    inner: Inner,
}

enum Inner {
    Hyper {
        body: Incoming,
        reuse: Option<(SendRequest<RequestBody>, Arc<Shared>)>,
    },
    Lean(h1::Body, Arc<Shared>),
}

impl UpstreamBody {
    /// Keeps the connection out of the pool: it has been upgraded (101) and belongs to a tunnel.
    pub fn detach(&mut self) {
        if let Inner::Hyper { reuse, .. } = &mut self.inner {
            *reuse = None;
        }
    }

    /// The raw fields of a lean exchange's response (none for hyper's: its map has them).
    pub fn upstream_fields(&self) -> Option<&RawFields> {
        match &self.inner {
            Inner::Lean(body, _) => Some(body.fields()),
            Inner::Hyper { .. } => None,
        }
    }

    /// The same, to set the gateway's fields beside them or take them.
    pub fn upstream_fields_mut(&mut self) -> Option<&mut RawFields> {
        match &mut self.inner {
            Inner::Lean(body, _) => Some(body.fields_mut()),
            Inner::Hyper { .. } => None,
        }
    }

    fn release(&mut self) {
        match &mut self.inner {
            Inner::Hyper { reuse, .. } => {
                if let Some((sender, shared)) = reuse.take() {
                    shared.put(sender);
                }
            }
            Inner::Lean(body, shared) => {
                if let Some(conn) = body.take_reusable() {
                    shared.push_lean(conn);
                }
            }
        }
    }
}

impl std::fmt::Debug for UpstreamBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            Inner::Hyper { body, .. } => f
                .debug_struct("UpstreamBody")
                .field("inner", body)
                .finish_non_exhaustive(),
            Inner::Lean(body, _) => f
                .debug_struct("UpstreamBody")
                .field("inner", body)
                .finish_non_exhaustive(),
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        match &mut this.inner {
            Inner::Hyper { body, reuse } => {
                let polled = Pin::new(body).poll_frame(cx);
                match &polled {
                    Poll::Ready(None) => this.release(),
                    Poll::Ready(Some(Err(_))) => *reuse = None,
                    _ => {}
                }
                polled.map_err(Into::into)
            }
            Inner::Lean(body, _) => {
                let polled = body.poll_data(cx);
                // The last piece read: the connection can take the next request already.
                if body.is_end() {
                    this.release();
                }
                match polled {
                    Poll::Ready(Some(Ok(data))) => Poll::Ready(Some(Ok(Frame::data(data)))),
                    Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(Box::new(e)))),
                    Poll::Ready(None) => Poll::Ready(None),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Inner::Hyper { body, .. } => body.is_end_stream(),
            Inner::Lean(body, _) => body.is_end(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Hyper { body, .. } => body.size_hint(),
            Inner::Lean(body, _) => match body.remaining() {
                Some(n) => SizeHint::with_exact(n),
                None => SizeHint::default(),
            },
        }
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        // A body the server never polls (empty, or its length reached) still ended cleanly.
        if self.is_end_stream() {
            self.release();
        }
    }
}
