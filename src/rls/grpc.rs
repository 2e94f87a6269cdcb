//! The gRPC listener: `envoy.service.ratelimit.v3.RateLimitService` (the server trait generated
//! in `envoy-types`) and the standard health service, which reports the service name
//! `ratelimit` (as envoyproxy/ratelimit does) and the empty name (the whole server).

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::ServingStatus;

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
fn status(e: &RlsError) -> Status {
    match e {
        RlsError::Invalid(message) => Status::invalid_argument(message.clone()),
        RlsError::Store(_) | RlsError::NotConfigured => Status::unavailable(e.to_string()),
    }
}

/// Serves the rate limit and health services on `listener` until `shutdown` changes. Health turns
/// `NOT_SERVING` as soon as shutdown begins, so Envoy stops routing to us before we stop.
///
/// On a runtime of several workers, connections are served by one single-threaded runtime per
/// worker ([`serve_per_thread`]); on one worker, by the runtime itself.
pub async fn serve(
    listener: TcpListener,
    service: RlsService,
    shutdown: watch::Receiver<bool>,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status(HEALTH_SERVICE_NAME, ServingStatus::Serving)
        .await;
    reporter
        .set_service_status("", ServingStatus::Serving)
        .await;
    let threads = tokio::runtime::Handle::current().metrics().num_workers();
    let (health_shutdown, health_done) = watch::channel(false);
    let mut stop = shutdown;
    let health_task = tokio::spawn(async move {
        let _ = stop.changed().await;
        reporter
            .set_service_status(HEALTH_SERVICE_NAME, ServingStatus::NotServing)
            .await;
        reporter
            .set_service_status("", ServingStatus::NotServing)
            .await;
        let _ = health_shutdown.send(true);
    });
    let result = if threads > 1 {
        serve_per_thread(listener, service, health, threads, health_done).await;
        Ok(())
    } else {
        let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
        let mut done = health_done;
        tonic::transport::Server::builder()
            .add_service(health)
            .add_service(RateLimitServiceServer::new(service))
            .serve_with_incoming_shutdown(incoming, async move {
                let _ = done.wait_for(|stop| *stop).await;
            })
            .await
    };
    if result.is_err() {
        // The listener failed on its own: no shutdown is coming to end the health task.
        health_task.abort();
    }
    let _ = health_task.await;
    result
}

/// Several workers: each of `threads` threads runs a single-threaded runtime serving the
/// connections handed to it (round robin, in accept order), and this task only accepts.
///
/// Why: an RLS connection is a long-lived HTTP/2 stream of small calls. On tokio's work-stealing
/// runtime, every call that wakes a connection's task also wakes an idle sibling worker to look
/// for work to steal, which it rarely finds: futex wake-ups and context switches that cost about a
/// fifth of the CPU per decision with two workers (`docs/benchmarks.md`, "Envoy RLS against
/// Limitador"). A connection pinned to one thread's runtime never wakes another thread; the store
/// and metrics are shared as before.
async fn serve_per_thread<H: Health>(
    listener: TcpListener,
    service: RlsService,
    health: HealthServer<H>,
    threads: usize,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut senders = Vec::with_capacity(threads);
    let mut finished = Vec::with_capacity(threads);
    for n in 0..threads {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<std::net::TcpStream>();
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
        let (service, health, stop) = (service.clone(), health.clone(), shutdown.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("rls-{n}"))
            .spawn(move || {
                serve_thread(rx, service, health, stop);
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
    let mut next = 0;
    while !senders.is_empty() {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = shutdown.wait_for(|stop| *stop) => break,
        };
        let stream = match accepted.and_then(|(s, _)| {
            s.set_nodelay(true)?;
            s.into_std()
        }) {
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
        if let Err(returned) = senders[next].send(stream) {
            // That thread's server has ended (it logged why): serve on the others.
            senders.swap_remove(next);
            if let Some(tx) = senders.get(next % senders.len().max(1)) {
                let _ = tx.send(returned.0);
            }
        }
    }
    drop(senders);
    for done in finished {
        let _ = done.await;
    }
}

/// One serving thread: a single-threaded runtime serving the connections that arrive on `rx`
/// until shutdown; in-flight calls finish first (tonic's graceful shutdown).
fn serve_thread<H: Health>(
    rx: tokio::sync::mpsc::UnboundedReceiver<std::net::TcpStream>,
    service: RlsService,
    health: HealthServer<H>,
    mut stop: watch::Receiver<bool>,
) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            tracing::error!(error = %e, "cannot start a rate limit service runtime");
            return;
        }
    };
    runtime.block_on(async move {
        let incoming = futures_util::stream::unfold(rx, |mut rx| async move {
            let stream = rx.recv().await?;
            Some((tokio::net::TcpStream::from_std(stream), rx))
        });
        let served = tonic::transport::Server::builder()
            .add_service(health)
            .add_service(RateLimitServiceServer::new(service))
            .serve_with_incoming_shutdown(incoming, async move {
                let _ = stop.wait_for(|stop| *stop).await;
            })
            .await;
        if let Err(e) = served {
            tracing::error!(error = %e, "rate limit service thread failed");
        }
    });
}
