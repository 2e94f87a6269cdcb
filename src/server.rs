//! Listeners and lifecycle: accept connections (HTTP/1.1 and h2c) on the public listener, serve
//! the admin listener, reload the config atomically, and drain on shutdown.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admin::{self, AdminState};
use crate::config::{self, ConfigErrors, Snapshot, StoreSettings};
use crate::gateway::Gateway;
use crate::limiter::{Limiter, MemoryStore, MonotonicClock, Store};
use crate::metrics::Metrics;

/// How often the in-process store drops idle counters.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// A running gateway: its bound addresses, and the handles to reload and stop it.
#[derive(Debug)]
pub struct Running {
    pub public_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub gateway: Arc<Gateway>,
    shutdown: watch::Sender<bool>,
    draining: Arc<AtomicBool>,
    tasks: Vec<JoinHandle<()>>,
}

/// Builds the store a snapshot asks for.
pub async fn build_store(settings: &StoreSettings) -> Result<Store, String> {
    match settings {
        StoreSettings::Memory { max_keys } => Ok(Store::Memory(MemoryStore::new(
            Arc::new(MonotonicClock::new()),
            *max_keys,
        ))),
        StoreSettings::Redis { .. } => {
            Err("the redis store is not available in this build".to_string())
        }
    }
}

/// Starts serving `snapshot` on the given listeners (or on the addresses it names).
pub async fn start(
    snapshot: Snapshot,
    metrics: Metrics,
    listeners: Option<(TcpListener, TcpListener)>,
) -> std::io::Result<Running> {
    let (public, admin) = match listeners {
        Some(pair) => pair,
        None => (
            TcpListener::bind(snapshot.listen).await?,
            TcpListener::bind(snapshot.admin_listen).await?,
        ),
    };
    let store = build_store(&snapshot.store)
        .await
        .map_err(std::io::Error::other)?;
    let limiter = Limiter::new(store, &metrics);
    let gateway = Arc::new(Gateway::new(snapshot, limiter, metrics));
    let (shutdown, shutdown_rx) = watch::channel(false);
    let draining = Arc::new(AtomicBool::new(false));

    let mut tasks = Vec::new();
    if matches!(gateway.limiter.store(), Store::Memory(_)) {
        let gw = gateway.clone();
        let mut rx = shutdown_rx.clone();
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(SWEEP_EVERY);
            loop {
                tokio::select! {
                    _ = tick.tick() => {
                        gw.limiter.store().sweep();
                    }
                    _ = rx.changed() => return,
                }
            }
        }));
    }

    let public_addr = public.local_addr()?;
    let admin_addr = admin.local_addr()?;
    let admin_router = admin::router(AdminState {
        gateway: gateway.clone(),
        draining: draining.clone(),
    });
    let mut rx = shutdown_rx.clone();
    tasks.push(tokio::spawn(async move {
        let serve = axum::serve(admin, admin_router).with_graceful_shutdown(async move {
            let _ = rx.changed().await;
        });
        if let Err(e) = serve.await {
            tracing::error!(error = %e, "admin listener failed");
        }
    }));
    tasks.push(tokio::spawn(serve_public(
        public,
        gateway.clone(),
        shutdown_rx,
    )));

    Ok(Running {
        public_addr,
        admin_addr,
        gateway,
        shutdown,
        draining,
        tasks,
    })
}

async fn serve_public(
    listener: TcpListener,
    gateway: Arc<Gateway>,
    mut shutdown: watch::Receiver<bool>,
) {
    let settings = gateway.config.load().server.clone();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(settings.header_read_timeout)
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(256);
    let graceful = GracefulShutdown::new();

    loop {
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
        let gw = gateway.clone();
        let service = service_fn(move |req| gw.clone().handle(peer, req));
        let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
        let conn = graceful.watch(conn.into_owned());
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, %peer, "connection ended with an error");
            }
        });
    }
    drop(listener);
    let grace = gateway.config.load().server.shutdown_grace;
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(?grace, "grace period over; closing remaining connections");
    }
}

impl Running {
    /// Re-reads the config file. On any error the running config stays, untouched.
    pub fn reload(&self) -> Result<(), ConfigErrors> {
        let current = self.gateway.config.load();
        let result = config::load(&current.source, &self.gateway.metrics);
        self.gateway.metrics.record_reload(result.is_ok());
        let next = result?;
        if next.listen != current.listen || next.admin_listen != current.admin_listen {
            tracing::warn!("listen addresses changed; they take effect at the next restart");
        }
        if next.store != current.store {
            tracing::warn!("store settings changed; they take effect at the next restart");
        }
        self.gateway.config.store(Arc::new(next));
        Ok(())
    }

    /// Reloads from another file (tests, and `run --config` pointing elsewhere).
    pub fn reload_from(&self, path: &Path) -> Result<(), ConfigErrors> {
        let next = config::load(path, &self.gateway.metrics)?;
        self.gateway.config.store(Arc::new(next));
        Ok(())
    }

    /// Stops accepting, lets in-flight requests finish within the grace period, and returns.
    pub async fn shutdown(self) {
        self.draining.store(true, Ordering::Relaxed);
        let _ = self.shutdown.send(true);
        for task in self.tasks {
            let _ = task.await;
        }
    }
}
