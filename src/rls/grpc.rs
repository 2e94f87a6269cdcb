//! The gRPC listener: `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit` and the
//! standard health check, which reports the service name `ratelimit` (as envoyproxy/ratelimit
//! does) and the empty name (the whole server). The listener accepts here and serves each
//! connection with [`super::wire`]; the tonic service trait is implemented too, for embedding
//! [`RlsService`] in a tonic server of one's own.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tonic::{Request, Response, Status};

use super::balance::{Balancer, ThreadLoad, SAMPLE_EVERY};
use super::decide::{RlsError, RlsService};
use crate::tls::ServerTls;
use crate::workers::{Detached, IntoTokio};

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
/// worker ([`serve_per_thread`]), packed onto as few of them as keep up; on one worker, by the
/// runtime itself. Each connection is served by [`super::wire`].
pub async fn serve(
    listener: TcpListener,
    tls: Option<Arc<ServerTls>>,
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
    let runtime = tokio::runtime::Handle::current().metrics();
    let threads = runtime.num_workers();
    if threads > 1 {
        serve_per_thread(listener, tls, service, serving, threads, stop).await;
    } else {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<TcpStream>();
        let load = ThreadLoad::new(runtime);
        let (connections, shed) = (load.connections.clone(), load.shed.clone());
        let serve = serve_connections(rx, tls, service, serving, stop.clone(), connections, shed);
        let accept = accept_loop(listener, vec![tx], Balancer::new(vec![load]), stop);
        tokio::join!(serve, accept);
    }
    let _ = signal.await;
    Ok(())
}

/// Accepts until `stop`, handing each connection to the thread [`Balancer::place`] picks
/// (`senders` and the balancer's threads in the same order), and samples the threads' loads every
/// [`SAMPLE_EVERY`] when there are several. A receiver that is gone (its thread failed) is
/// dropped from then on.
async fn accept_loop<T: From<tokio::net::TcpStream> + Send + 'static>(
    listener: TcpListener,
    mut senders: Vec<tokio::sync::mpsc::UnboundedSender<T>>,
    mut balancer: Balancer,
    mut stop: watch::Receiver<bool>,
) {
    debug_assert_eq!(senders.len(), balancer.len());
    // The first sample a whole interval after the threads started, not at once: a share of a
    // few microseconds would read as a busy thread.
    let first = tokio::time::Instant::now() + SAMPLE_EVERY;
    let mut sample = tokio::time::interval_at(first, SAMPLE_EVERY);
    sample.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !senders.is_empty() {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = sample.tick(), if senders.len() > 1 => {
                if let Some(thread) = balancer.sample() {
                    tracing::debug!(thread, "rate limit service: a saturated thread sheds a connection");
                }
                continue;
            }
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
        let mut stream = T::from(stream);
        loop {
            let next = balancer.place();
            match senders[next].send(stream) {
                Ok(()) => break,
                Err(returned) => {
                    balancer.unplace(next);
                    balancer.remove(next);
                    senders.remove(next);
                    if senders.is_empty() {
                        break;
                    }
                    stream = returned.0;
                }
            }
        }
    }
}

/// Serves the connections that arrive on `rx` on the current runtime, one task each, until the
/// senders are gone; then waits for the connections to end (they shut down on `stop`).
/// `connections` counts the live ones (the accept loop adds them); `shed` asks one to close
/// gracefully ([`super::balance`]).
async fn serve_connections<T: IntoTokio>(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<T>,
    tls: Option<Arc<ServerTls>>,
    service: RlsService,
    serving: watch::Receiver<bool>,
    stop: watch::Receiver<bool>,
    connections: Arc<AtomicUsize>,
    shed: Arc<Notify>,
) {
    let mut tasks = tokio::task::JoinSet::new();
    while let Some(stream) = rx.recv().await {
        let stream = match stream.into_tokio() {
            Ok(stream) => stream,
            Err(e) => {
                tracing::debug!(error = %e, "rate limit service: cannot register a connection");
                connections.fetch_sub(1, Ordering::Relaxed);
                continue;
            }
        };
        let (service, serving, stop, shed) =
            (service.clone(), serving.clone(), stop.clone(), shed.clone());
        let live = connections.clone();
        match tls.clone() {
            None => {
                let serve = super::wire::serve_connection(stream, service, serving, stop, shed);
                tasks.spawn(async move {
                    serve.await;
                    live.fetch_sub(1, Ordering::Relaxed);
                });
            }
            // The handshake runs in the connection's own task, on its thread.
            Some(tls) => {
                tasks.spawn(async move {
                    if let Some(stream) = tls.handshake(stream).await {
                        super::wire::serve_connection(stream, service, serving, stop, shed).await;
                    }
                    live.fetch_sub(1, Ordering::Relaxed);
                });
            }
        }
        // Reap the connections that ended, so the set holds only live ones.
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
}

/// Several workers: each of `threads` threads runs a single-threaded runtime serving the
/// connections handed to it, and this task only accepts, packing connections onto as few threads
/// as keep up ([`super::balance`]).
///
/// Why: an RLS connection is a long-lived HTTP/2 stream of small calls. On tokio's work-stealing
/// runtime, every call that wakes a connection's task also wakes an idle sibling worker to look
/// for work to steal, which it rarely finds: futex wake-ups and context switches that cost about a
/// fifth of the CPU per decision with two workers (`docs/benchmarks.md`, "Envoy RLS against
/// Limitador"). A connection pinned to one thread's runtime never wakes another thread; the store
/// and metrics are shared as before.
async fn serve_per_thread(
    listener: TcpListener,
    tls: Option<Arc<ServerTls>>,
    service: RlsService,
    serving: watch::Receiver<bool>,
    threads: usize,
    stop: watch::Receiver<bool>,
) {
    let mut senders = Vec::with_capacity(threads);
    let mut loads = Vec::with_capacity(threads);
    let mut finished = Vec::with_capacity(threads);
    for n in 0..threads {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(runtime) => runtime,
            Err(e) => {
                tracing::error!(error = %e, "cannot start a rate limit service runtime");
                continue;
            }
        };
        let load = ThreadLoad::new(runtime.metrics());
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Detached>();
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
        let (service, serving, stop) = (service.clone(), serving.clone(), stop.clone());
        let tls = tls.clone();
        let (connections, shed) = (load.connections.clone(), load.shed.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("rls-{n}"))
            .spawn(move || {
                runtime.block_on(serve_connections(
                    rx,
                    tls,
                    service,
                    serving,
                    stop,
                    connections,
                    shed,
                ));
                let _ = done_tx.send(());
            });
        match spawned {
            Ok(_) => {
                senders.push(tx);
                loads.push(load);
                finished.push(done_rx);
            }
            Err(e) => tracing::error!(error = %e, "cannot start a rate limit service thread"),
        }
    }
    accept_loop(listener, senders, Balancer::new(loads), stop).await;
    for done in finished {
        let _ = done.await;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    use std::time::Duration;

    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
    use tokio::net::{TcpListener, TcpStream};
    use tokio::sync::watch;

    use super::{accept_loop, serve_connections, Balancer, ThreadLoad};
    use crate::limiter::{Engine, MonotonicClock};
    use crate::metrics::Metrics;
    use crate::rls::RlsService;
    use crate::state::{AppState, Live};

    /// The service on the memory store with one rule: 5 per minute per `user`.
    async fn service(dir: &std::path::Path) -> RlsService {
        std::fs::create_dir(dir.join("rls")).unwrap();
        let rule = "domain: d\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 5}\n";
        std::fs::write(dir.join("rls/d.yaml"), rule).unwrap();
        let rls = dir.join("rls");
        let yaml = format!(
            "listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nstore:\n  type: memory\nrls:\n  listen: 127.0.0.1:0\n  config: {}\n",
            rls.display()
        );
        let path = dir.join("policies.yaml");
        std::fs::write(&path, &yaml).unwrap();
        let snapshot = crate::config::load(&path).unwrap();
        let metrics = Metrics::new();
        let store = crate::server::build_store(&snapshot.store).await.unwrap();
        let engine = Engine::new(store, Arc::new(MonotonicClock::new()), &metrics);
        let live = Live::attach(snapshot, &metrics);
        RlsService::new(Arc::new(AppState::new(live, engine, metrics)))
    }

    fn ask() -> RateLimitRequest {
        RateLimitRequest {
            domain: "d".into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: "user".into(),
                    value: "u".into(),
                }],
                ..Default::default()
            }],
            hits_addend: 1,
        }
    }

    async fn until(what: &str, mut done: impl FnMut() -> bool) {
        for _ in 0..500 {
            if done() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("not within 5 s: {what}");
    }

    /// A shed connection closes gracefully (GOAWAY) and its client carries on over a new one:
    /// every call is answered, and the count stays exact across the two connections.
    #[tokio::test]
    async fn a_shed_connection_closes_gracefully_and_the_client_reconnects() {
        let dir = tempfile::tempdir().unwrap();
        let service = service(dir.path()).await;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop_tx, stop) = watch::channel(false);
        let (_serving_tx, serving) = watch::channel(true);
        let load = ThreadLoad::new(tokio::runtime::Handle::current().metrics());
        let (connections, shed) = (load.connections.clone(), load.shed.clone());
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<TcpStream>();
        let serve = serve_connections(
            rx,
            None,
            service,
            serving,
            stop.clone(),
            connections.clone(),
            shed.clone(),
        );
        let accept = accept_loop(listener, vec![tx], Balancer::new(vec![load]), stop);
        let server = tokio::spawn(async move {
            tokio::join!(serve, accept);
        });
        let live = || connections.load(Ordering::Relaxed);

        let mut client = RateLimitServiceClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        let mut codes = Vec::new();
        for _ in 0..3 {
            let r = client.should_rate_limit(ask()).await.unwrap().into_inner();
            codes.push(r.overall_code);
        }
        assert_eq!(live(), 1);
        shed.notify_one();
        until("the shed connection closes", || live() == 0).await;
        for _ in 0..4 {
            let r = client.should_rate_limit(ask()).await.unwrap().into_inner();
            codes.push(r.overall_code);
        }
        assert_eq!(live(), 1, "the client reconnected");
        let over = Code::OverLimit as i32;
        let ok = Code::Ok as i32;
        assert_eq!(codes, [ok, ok, ok, ok, ok, over, over]);
        stop_tx.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .unwrap()
            .unwrap();
    }
}
