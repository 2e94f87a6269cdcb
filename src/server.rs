//! Lifecycle: start the public listener ([`crate::listener`]), the admin listener and the Envoy
//! service, reload the config atomically, and drain on shutdown.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admin::{self, AdminState};
use crate::config::{self, ConfigErrors, Snapshot, StoreSettings};
use crate::gateway::Gateway;
use crate::limiter::{Limiter, MemoryStore, MonotonicClock, RedisStore, Store};
use crate::metrics::Metrics;

/// How often the in-process store drops idle counters.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// A running gateway: its bound addresses, and the handles to reload and stop it.
#[derive(Debug)]
pub struct Running {
    pub public_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// The Envoy rate limit service's gRPC listener, when `rls:` is configured.
    pub rls_addr: Option<SocketAddr>,
    pub gateway: Arc<Gateway>,
    /// Stops the public listener (and the sweeper).
    shutdown: watch::Sender<bool>,
    /// Stops the admin listener, last, so `/readyz` says "draining" while requests finish.
    admin_shutdown: watch::Sender<bool>,
    draining: Arc<AtomicBool>,
    tasks: Vec<JoinHandle<()>>,
    admin_task: JoinHandle<()>,
}

/// Builds the store a snapshot asks for.
pub async fn build_store(settings: &StoreSettings) -> Result<Store, String> {
    match settings {
        StoreSettings::Memory { max_keys } => Ok(Store::Memory(MemoryStore::new(
            Arc::new(MonotonicClock::new()),
            *max_keys,
        ))),
        StoreSettings::Redis {
            target,
            pool_size,
            timeout,
            key_prefix,
        } => {
            let store = RedisStore::connect_to(target, *pool_size, *timeout, key_prefix)
                .map_err(|e| format!("redis store: {e}"))?;
            // Before any listener serves: the first requests are decided by Redis, not by the
            // failure mode. When Redis is really down, serve anyway after the bounded wait (the
            // store's probe then logs it as unreachable, and `/readyz` answers 503).
            store.wait_ready(crate::limiter::redis::STARTUP_WAIT).await;
            Ok(Store::Redis(store))
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

    let rls_listener = match gateway.config.load().rls.as_ref() {
        Some(rls) => Some(TcpListener::bind(rls.listen).await?),
        None => None,
    };
    let rls_addr = rls_listener.as_ref().map(|l| l.local_addr()).transpose()?;
    if let Some(listener) = rls_listener {
        let service = crate::rls::RlsService::new(gateway.clone());
        let rx = shutdown_rx.clone();
        tasks.push(tokio::spawn(async move {
            if let Err(e) = crate::rls::grpc::serve(listener, service, rx).await {
                tracing::error!(error = %e, "rate limit service listener failed");
            }
        }));
    }

    let public_addr = public.local_addr()?;
    let admin_addr = admin.local_addr()?;
    let admin_router = admin::router(AdminState {
        gateway: gateway.clone(),
        draining: draining.clone(),
    });
    let (admin_shutdown, mut rx) = watch::channel(false);
    let admin_task = tokio::spawn(async move {
        let serve = axum::serve(admin, admin_router).with_graceful_shutdown(async move {
            let _ = rx.changed().await;
        });
        if let Err(e) = serve.await {
            tracing::error!(error = %e, "admin listener failed");
        }
    });
    tasks.push(tokio::spawn(crate::listener::serve_public(
        public,
        gateway.clone(),
        shutdown_rx,
    )));

    Ok(Running {
        public_addr,
        admin_addr,
        rls_addr,
        gateway,
        shutdown,
        admin_shutdown,
        draining,
        tasks,
        admin_task,
    })
}

impl Running {
    /// Re-reads the config file. On any error the running config stays, untouched.
    pub fn reload(&self) -> Result<(), ConfigErrors> {
        reload(&self.gateway)
    }

    /// [`Running::reload`] on the blocking pool, so the workers keep serving while the files are
    /// read and validated.
    pub async fn reload_in_background(&self) -> Result<(), ConfigErrors> {
        let gateway = self.gateway.clone();
        match tokio::task::spawn_blocking(move || reload(&gateway)).await {
            Ok(result) => result,
            // The loader panicked: a bug, but the running config is untouched and serving goes on.
            Err(e) => Err(ConfigErrors(vec![config::ConfigError {
                file: self.gateway.config.load().source.clone(),
                line: 1,
                column: 1,
                field: String::new(),
                message: format!("the config loader failed unexpectedly (a bug): {e}"),
            }])),
        }
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
        let _ = self.admin_shutdown.send(true);
        let _ = self.admin_task.await;
    }
}

/// Re-reads `gateway`'s config file and swaps the new snapshot in; on any error the running
/// config stays, untouched.
pub fn reload(gateway: &Gateway) -> Result<(), ConfigErrors> {
    let current = gateway.config.load();
    let result = config::load(&current.source, &gateway.metrics);
    gateway.metrics.record_reload(result.is_ok());
    {
        let mut status = gateway
            .reload_status
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        status.last_attempt = Some(std::time::SystemTime::now());
        status.last_error = result.as_ref().err().map(ToString::to_string);
    }
    let next = result?;
    let changes = current.source_info.changes(&next.source_info);
    tracing::info!(
        config = %next.source.display(),
        sha256 = %next.source_info.sha256,
        changes = %if changes.is_empty() { "none".to_string() } else { changes.join(", ") },
        "config reloaded"
    );
    if next.listen != current.listen || next.admin_listen != current.admin_listen {
        tracing::warn!("listen addresses changed; they take effect at the next restart");
    }
    let rls_listen = |s: &Snapshot| s.rls.as_ref().map(|r| r.listen);
    if rls_listen(&next) != rls_listen(&current) {
        tracing::warn!("rls.listen changed; it takes effect at the next restart");
    }
    let (n, c) = (&next.server, &current.server);
    if (n.max_connections, n.max_header_size) != (c.max_connections, c.max_header_size) {
        tracing::warn!(
            "server.max_connections and max_header_size take effect at the next restart"
        );
    }
    if next.store != current.store {
        tracing::warn!("store settings changed; they take effect at the next restart");
    }
    gateway.config.store(Arc::new(next));
    Ok(())
}
