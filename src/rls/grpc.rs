//! The gRPC listener: `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit` and the
//! standard health check, which reports the service name `ratelimit` (as envoyproxy/ratelimit
//! does) and the empty name (the whole server). The listener accepts here and serves each
//! connection with [`super::wire`]; the tonic service trait is implemented too, for embedding
//! [`RlsService`] in a tonic server of one's own.

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use super::decide::{RlsError, RlsService};

/// The service name health checks ask about.
pub const HEALTH_SERVICE_NAME: &str = "ratelimit";

#[tonic::async_trait]
impl RateLimitService for RlsService {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        match RlsService::should_rate_limit(self, request.get_ref()).await {
            Ok(response) => Ok(Response::new(response)),
            Err(e) => Err(status(&e)),
        }
    }
}

/// The gRPC status of an error. `UNAVAILABLE` lets Envoy apply its `failure_mode_deny`.
pub(crate) fn status(e: &RlsError) -> Status {
    match e {
        RlsError::Invalid(message) => Status::invalid_argument(message.clone()),
        RlsError::Store(_) | RlsError::NotConfigured => Status::unavailable(e.to_string()),
    }
}

/// Serves the rate limit and health services on `listener` until `shutdown` changes. Health turns
/// `NOT_SERVING` as soon as shutdown begins, so Envoy stops routing to us before we stop; calls in
/// flight finish (HTTP/2 graceful shutdown).
///
/// On a runtime of several workers, connections are served by one single-threaded runtime per
/// worker ([`serve_per_thread`]); on one worker, by the runtime itself. Each connection is served
/// by [`super::wire`].
pub async fn serve(
    listener: TcpListener,
    service: RlsService,
    mut shutdown: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let (serving_tx, serving) = watch::channel(true);
    let (stop_tx, stop) = watch::channel(false);
    let signal = tokio::spawn(async move {
        // A dropped sender counts as shutdown too.
        let _ = shutdown.changed().await;
        let _ = serving_tx.send(false);
        let _ = stop_tx.send(true);
    });
    let threads = tokio::runtime::Handle::current().metrics().num_workers();
    if threads > 1 {
        serve_per_thread(listener, service, serving, threads, stop).await;
    } else {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<TcpStream>();
        let serve = serve_connections(rx, service, serving, stop.clone());
        let accept = accept_loop(listener, vec![tx], stop);
        tokio::join!(serve, accept);
    }
    let _ = signal.await;
    Ok(())
}

/// Accepts until `stop`, handing connections to `senders` round robin (in accept order). A
/// receiver that is gone (its thread failed) is skipped from then on.
async fn accept_loop<T: From<tokio::net::TcpStream> + Send + 'static>(
    listener: TcpListener,
    mut senders: Vec<tokio::sync::mpsc::UnboundedSender<T>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut next = 0;
    while !senders.is_empty() {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.wait_for(|stop| *stop) => break,
        };
        let stream = match accepted.and_then(|(s, _)| s.set_nodelay(true).map(|()| s)) {
            Ok(stream) => stream,
            Err(e) => {
                // As tonic's own listener does: a failed accept (e.g. out of descriptors) is
                // logged and the loop goes on, after a pause so it cannot spin.
                tracing::debug!(error = %e, "rate limit service: accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                continue;
            }
        };
        next = (next + 1) % senders.len();
        let mut stream = T::from(stream);
        while let Err(returned) = senders[next].send(stream) {
            senders.swap_remove(next);
            if senders.is_empty() {
                break;
            }
            next %= senders.len();
            stream = returned.0;
        }
    }
}

/// Serves the connections that arrive on `rx` on the current runtime, one task each, until the
/// senders are gone; then waits for the connections to end (they shut down on `stop`).
async fn serve_connections<T: IntoTokio>(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<T>,
    service: RlsService,
    serving: watch::Receiver<bool>,
    stop: watch::Receiver<bool>,
) {
    let mut connections = tokio::task::JoinSet::new();
    while let Some(stream) = rx.recv().await {
        let stream = match stream.into_tokio() {
            Ok(stream) => stream,
            Err(e) => {
                tracing::debug!(error = %e, "rate limit service: cannot register a connection");
                continue;
            }
        };
        connections.spawn(super::wire::serve_connection(
            stream,
            service.clone(),
            serving.clone(),
            stop.clone(),
        ));
        // Reap the connections that ended, so the set holds only live ones.
        while connections.try_join_next().is_some() {}
    }
    while connections.join_next().await.is_some() {}
}

/// A connection as it travels to the runtime that serves it.
trait IntoTokio: Send + 'static {
    fn into_tokio(self) -> std::io::Result<TcpStream>;
}

impl IntoTokio for TcpStream {
    fn into_tokio(self) -> std::io::Result<TcpStream> {
        Ok(self)
    }
}

/// Between runtimes a socket travels as a std one and is registered with the receiving runtime.
struct Detached(std::io::Result<std::net::TcpStream>);

impl From<TcpStream> for Detached {
    fn from(stream: TcpStream) -> Self {
        Detached(stream.into_std())
    }
}

impl IntoTokio for Detached {
    fn into_tokio(self) -> std::io::Result<TcpStream> {
        TcpStream::from_std(self.0?)
    }
}

/// Several workers: each of `threads` threads runs a single-threaded runtime serving the
/// connections handed to it, and this task only accepts.
///
/// Why: an RLS connection is a long-lived HTTP/2 stream of small calls. On tokio's work-stealing
/// runtime, every call that wakes a connection's task also wakes an idle sibling worker to look
/// for work to steal, which it rarely finds: futex wake-ups and context switches that cost about a
/// fifth of the CPU per decision with two workers (`docs/benchmarks.md`, "Envoy RLS against
/// Limitador"). A connection pinned to one thread's runtime never wakes another thread; the store
/// and metrics are shared as before.
async fn serve_per_thread(
    listener: TcpListener,
    service: RlsService,
    serving: watch::Receiver<bool>,
    threads: usize,
    stop: watch::Receiver<bool>,
) {
    let mut senders = Vec::with_capacity(threads);
    let mut finished = Vec::with_capacity(threads);
    for n in 0..threads {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Detached>();
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
        let (service, serving, stop) = (service.clone(), serving.clone(), stop.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("rls-{n}"))
            .spawn(move || {
                match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime.block_on(serve_connections(rx, service, serving, stop)),
                    Err(e) => {
                        tracing::error!(error = %e, "cannot start a rate limit service runtime")
                    }
                }
                let _ = done_tx.send(());
            });
        match spawned {
            Ok(_) => {
                senders.push(tx);
                finished.push(done_rx);
            }
            Err(e) => tracing::error!(error = %e, "cannot start a rate limit service thread"),
        }
    }
    accept_loop(listener, senders, stop).await;
    for done in finished {
        let _ = done.await;
    }
}
