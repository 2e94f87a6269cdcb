//! Lifecycle: attach runtime resources to the config, start the public listener
//! ([`crate::listener`]), the admin listener and the Envoy service, reload the config atomically
//! (one path, [`reload`]), and drain on shutdown.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

use crate::shutdown::{Shutdown, Tasks};

use crate::admin::{self, AdminState};
use crate::config::{self, ConfigErrors, Snapshot, StoreSettings};
use crate::limiter::{Engine, MemoryStore, MonotonicClock, RedisStore, Store};
use crate::metrics::Metrics;
use crate::state::{AppState, Live};
use crate::tls::{Alpn, ServerTls, ServerTlsSettings};

/// How often the in-process store drops idle counters.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// A running gateway: its bound addresses, and the handles to reload and stop it.
#[derive(Debug)]
pub struct Running {
    /// The plain-HTTP public listener; `None` with `listen: off`.
    pub public_addr: Option<SocketAddr>,
    pub admin_addr: SocketAddr,
    /// The HTTPS public listener, when `listen_tls:` is configured.
    pub tls_addr: Option<SocketAddr>,
    /// The Envoy rate limit service's gRPC listener, when `rls:` is configured.
    pub rls_addr: Option<SocketAddr>,
    /// The Envoy rate limit quota service's gRPC listener, when `rlqs:` is configured.
    pub rlqs_addr: Option<SocketAddr>,
    /// The forward-auth HTTP check listener, when `forward_auth.listen` is configured.
    pub forward_auth_addr: Option<SocketAddr>,
    /// The Envoy ext_authz gRPC listener, when `forward_auth.grpc_listen` is configured.
    pub ext_authz_addr: Option<SocketAddr>,
    /// Envoy's external processor's gRPC listener, when `ext_proc.listen` is configured.
    pub ext_proc_addr: Option<SocketAddr>,
    /// What every listener shares: the live config, the engine, the metrics.
    pub state: Arc<AppState>,
    /// Owns every background task: the listeners, the sweeper, the overrides sync, the
    /// certificate watch, and (stopped last, so `/readyz` says "draining" while requests finish)
    /// the admin listener.
    background: Shutdown,
    draining: Arc<AtomicBool>,
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
        // With `listen: off` the given public listener is closed: nothing serves plain HTTP.
        Some((public, admin)) => (snapshot.listen.map(|_| public), admin),
        None => (
            match snapshot.listen {
                Some(addr) => Some(bind("listen", addr).await?),
                None => None,
            },
            bind("admin_listen", snapshot.admin_listen).await?,
        ),
    };
    let store = build_store(&snapshot.store)
        .await
        .map_err(std::io::Error::other)?;
    let engine = Engine::new(store, Arc::new(MonotonicClock::new()), &metrics);
    let mut background = Shutdown::new();
    let access_log = match &snapshot.access_log {
        Some(settings) => {
            let (log, writer) = crate::access_log::AccessLog::start(settings, &metrics)?;
            // In the last group: it writes the lines of requests that finish while draining.
            background.spawn_last("access log writer", writer.run(background.last_signal()));
            log
        }
        None => crate::access_log::AccessLog::off(),
    };
    let tracing = match &snapshot.tracing {
        Some(settings) => {
            let store = match engine.store() {
                Store::Redis(_) => "redis",
                _ => "memory",
            };
            let (tracing, exporter) = crate::otel::Tracing::start(settings, store, &metrics)?;
            // In the last group: it exports the spans of requests that finish while draining.
            background.spawn_last("trace exporter", exporter.run(background.last_signal()));
            tracing
        }
        None => crate::otel::Tracing::off(),
    };
    // Before any listener serves: the first requests are verified with the URL's keys. When the
    // first fetch fails, serve anyway (docs/jwt.md, "When the first fetch fails").
    if let Some(first) = activate_jwt(&snapshot, None, &metrics) {
        if let Err(error) = first_fetch(first.await) {
            tracing::error!(
                %error,
                "the first fetch of `jwt.jwks_url` failed: tokens signed with its keys are \
                 refused as unverifiable until a fetch succeeds; retrying with backoff"
            );
        }
    }
    let live = Live::attach(snapshot, &metrics);
    let mut state = AppState::new(live, engine, metrics);
    state.access_log = access_log;
    state.tracing = tracing;
    let state = Arc::new(state);
    state.rebuild_overrides();
    if matches!(state.engine.store(), Store::Redis(_)) {
        // The shared overrides: applied before the first request, then kept current.
        state.refresh_overrides().await;
        background.spawn_until_stopped(
            "overrides sync",
            crate::state::sync_overrides(Arc::downgrade(&state)),
        );
    }
    let shutdown_rx = background.signal();
    let draining = Arc::new(AtomicBool::new(false));

    if matches!(state.engine.store(), Store::Memory(_)) {
        let st = state.clone();
        let mut rx = shutdown_rx.clone();
        background.spawn("memory sweep", async move {
            let mut tick = tokio::time::interval(SWEEP_EVERY);
            loop {
                tokio::select! {
                    _ = tick.tick() => {
                        st.engine.store().sweep();
                    }
                    _ = rx.changed() => return,
                }
            }
        });
    }

    let live = state.live.load();
    let rls_listener = match live.config.rls.as_ref() {
        Some(rls) => Some(bind("rls.listen", rls.listen).await?),
        None => None,
    };
    let rls_addr = rls_listener.as_ref().map(|l| l.local_addr()).transpose()?;
    if let Some(listener) = rls_listener {
        let settings = live.config.rls.as_ref().and_then(|r| r.tls.as_ref());
        let tls = server_tls(settings, "rls", Alpn::H2, &state, &mut background)?;
        let service = crate::rls::RlsService::new(state.clone());
        let rx = shutdown_rx.clone();
        background.spawn("rls listener", async move {
            if let Err(e) = crate::rls::grpc::serve(listener, tls, service, rx).await {
                tracing::error!(error = %e, "rate limit service listener failed");
            }
        });
    }

    let rlqs_addr = start_rlqs(&state, &mut background).await?;

    let public_addr = public.as_ref().map(TcpListener::local_addr).transpose()?;
    let admin_addr = admin.local_addr()?;
    let admin_router = admin::router(AdminState {
        state: state.clone(),
        draining: draining.clone(),
    });
    let admin_tls = server_tls(
        live.config.admin_tls.as_ref(),
        "admin",
        Alpn::Http1,
        &state,
        &mut background,
    )?;
    drop(live);
    let mut rx = background.last_signal();
    let stopped = async move {
        let _ = rx.changed().await;
    };
    match admin_tls {
        None => background.spawn_last("admin listener", async move {
            let serve = axum::serve(admin, admin_router).with_graceful_shutdown(stopped);
            if let Err(e) = serve.await {
                tracing::error!(error = %e, "admin listener failed");
            }
        }),
        Some(tls) => {
            let incoming = crate::tls::incoming::TlsIncoming::new(admin, tls)?;
            background.spawn_last("admin listener", async move {
                let serve = axum::serve(incoming, admin_router).with_graceful_shutdown(stopped);
                if let Err(e) = serve.await {
                    tracing::error!(error = %e, "admin listener failed");
                }
            });
        }
    }
    let (forward_auth_addr, ext_authz_addr) = start_forward_auth(&state, &mut background).await?;
    let ext_proc_addr = start_ext_proc(&state, &mut background).await?;
    let tls = start_tls(&state, &mut background).await?;
    let tls_addr = tls.as_ref().map(|(l, _)| l.local_addr()).transpose()?;
    background.spawn(
        "public listener",
        crate::listener::serve_public(public, tls, state.clone(), shutdown_rx),
    );

    Ok(Running {
        public_addr,
        admin_addr,
        tls_addr,
        rls_addr,
        rlqs_addr,
        forward_auth_addr,
        ext_authz_addr,
        ext_proc_addr,
        state,
        background,
        draining,
    })
}

/// Binds and serves the rate limit quota service that `rlqs:` names (read once, at start: a
/// reload changes its budgets, not its listener or timing).
async fn start_rlqs(
    state: &Arc<AppState>,
    background: &mut Shutdown,
) -> std::io::Result<Option<SocketAddr>> {
    let Some(settings) = state.live.load().config.rlqs.clone() else {
        return Ok(None);
    };
    let listener = bind("rlqs.listen", settings.listen).await?;
    let addr = listener.local_addr()?;
    let service = crate::rlqs::RlqsService::new(state.clone(), &settings);
    let rx = background.signal();
    background.spawn("rlqs listener", async move {
        if let Err(e) = crate::rlqs::serve(listener, service, rx).await {
            tracing::error!(error = %e, "rate limit quota service listener failed");
        }
    });
    Ok(Some(addr))
}

/// The `jwt:` verifier of a snapshot, when a route uses it (every route shares one).
fn jwt_verifier(snapshot: &Snapshot) -> Option<&crate::jwt::Verifier> {
    snapshot.routes.iter().find_map(|r| r.jwt.as_deref())
}

/// Puts `next`'s JWT keys to work: the running ring of `current` when the key sources are the
/// same, else watches on the key files and fetches of `jwks_url` through the upstream connector
/// (TCP, then TLS trusting the system's CAs or `jwks_ca`). Returns the first fetch to wait for.
fn activate_jwt(
    next: &Snapshot,
    current: Option<&Snapshot>,
    metrics: &Metrics,
) -> Option<tokio::sync::oneshot::Receiver<Result<(), String>>> {
    let verifier = jwt_verifier(next)?;
    let previous = current.and_then(jwt_verifier);
    verifier.activate(previous, metrics.jwt_keys(), |url| {
        let mut tcp = hyper_util::client::legacy::connect::HttpConnector::new();
        tcp.set_connect_timeout(Some(url.timeout));
        let tls = crate::tls::UpstreamTls {
            config: url.tls.clone(),
        };
        crate::tls::Connector::new(tcp, Some(&tls), url.timeout)
    })
}

/// How a first fetch ended; a fetch task that ended without saying is a failure too.
fn first_fetch(
    outcome: Result<Result<(), String>, tokio::sync::oneshot::error::RecvError>,
) -> Result<(), String> {
    outcome.unwrap_or_else(|_| Err("the fetch task ended".into()))
}

/// Binds the HTTPS listener that `listen_tls:` names (read once, at start: a reload that changes
/// it warns; its certificate files are watched and reloaded on their own).
async fn start_tls(
    state: &Arc<AppState>,
    background: &mut Shutdown,
) -> std::io::Result<Option<(TcpListener, Arc<crate::tls::ServerTls>)>> {
    let Some(settings) = state.live.load().config.listen_tls.clone() else {
        return Ok(None);
    };
    let listener = bind("listen_tls.listen", settings.listen).await?;
    let tls = server_tls(
        Some(&settings.tls),
        "public",
        Alpn::H2AndHttp1,
        state,
        background,
    )?;
    Ok(tls.map(|tls| (listener, tls)))
}

/// The TLS of one listener, with the watch that reloads its files until shutdown.
fn server_tls(
    settings: Option<&ServerTlsSettings>,
    listener: &'static str,
    alpn: Alpn,
    state: &AppState,
    background: &mut Shutdown,
) -> std::io::Result<Option<Arc<ServerTls>>> {
    let Some(settings) = settings else {
        return Ok(None);
    };
    let tls = ServerTls::new(settings, listener, alpn, &state.metrics)
        .map_err(|e| std::io::Error::other(format!("{listener} listener TLS: {e}")))?;
    let tls = Arc::new(tls);
    let stop = background.signal();
    background.spawn("certificate watch", tls.clone().watch(stop));
    Ok(Some(tls))
}

/// Binds and serves Envoy's external processor on `ext_proc.listen` (read once, at start).
async fn start_ext_proc(
    state: &Arc<AppState>,
    background: &mut Shutdown,
) -> std::io::Result<Option<SocketAddr>> {
    let Some(listen) = state.live.load().config.ext_proc else {
        return Ok(None);
    };
    let listener = bind("ext_proc.listen", listen).await?;
    let addr = listener.local_addr()?;
    let service = crate::ext_proc::grpc::ExtProc::new(state.clone());
    let rx = background.signal();
    background.spawn("ext_proc listener", async move {
        if let Err(e) = crate::ext_proc::grpc::serve(listener, service, rx).await {
            tracing::error!(error = %e, "ext_proc listener failed");
        }
    });
    Ok(Some(addr))
}

/// Binds one listener; the error names the config field and the address, so that "Address already
/// in use" says which of several listeners could not start.
async fn bind(field: &str, addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("`{field}` ({addr}): {e}")))
}

/// Binds and serves the ingress door's listeners that `forward_auth:` names (read once, at
/// start: a reload that changes them warns). Returns their bound addresses.
async fn start_forward_auth(
    state: &Arc<AppState>,
    background: &mut Shutdown,
) -> std::io::Result<(Option<SocketAddr>, Option<SocketAddr>)> {
    let Some(settings) = state.live.load().config.forward_auth.clone() else {
        return Ok((None, None));
    };
    let mut http_addr = None;
    if let Some(listen) = settings.listen {
        let listener = bind("forward_auth.listen", listen).await?;
        http_addr = Some(listener.local_addr()?);
        let tls = server_tls(
            settings.tls.as_ref(),
            "forward_auth",
            Alpn::H2AndHttp1,
            state,
            background,
        )?;
        let door = Arc::new(crate::forward_auth::http::HttpDoor::new(state.clone()));
        let stop = background.signal();
        background.spawn(
            "forward_auth listener",
            crate::listener::serve_check(listener, tls, state.clone(), stop, move |peer, req| {
                crate::forward_auth::http::handle(door.clone(), peer, req)
            }),
        );
    }
    let mut grpc_addr = None;
    if let Some(listen) = settings.grpc_listen {
        let listener = bind("forward_auth.grpc_listen", listen).await?;
        grpc_addr = Some(listener.local_addr()?);
        let tls = server_tls(
            settings.tls.as_ref(),
            "ext_authz",
            Alpn::H2,
            state,
            background,
        )?;
        let service = crate::forward_auth::grpc::ExtAuthz::new(state.clone());
        let rx = background.signal();
        background.spawn("ext_authz listener", async move {
            if let Err(e) = crate::forward_auth::grpc::serve(listener, tls, service, rx).await {
                tracing::error!(error = %e, "ext_authz listener failed");
            }
        });
    }
    Ok((http_addr, grpc_addr))
}

impl Running {
    /// Re-reads the config file, as SIGHUP does: see [`reload`].
    pub async fn reload(&self) -> Result<Vec<&'static str>, ConfigErrors> {
        reload(&self.state).await
    }

    /// Stops accepting, lets in-flight requests finish within the grace period, and returns.
    /// Every background task is stopped and awaited: the listeners first, the admin listener
    /// last.
    pub async fn shutdown(self) {
        self.draining.store(true, Ordering::Relaxed);
        // Requests waiting for a slot are answered now, not held through the drain.
        self.state.waiters.stop();
        self.background.stop().await;
    }

    /// The live count of this gateway's background tasks; it reads 0 once
    /// [`Running::shutdown`] has returned.
    pub fn background_tasks(&self) -> Tasks {
        self.background.tasks()
    }
}

/// The one reload path. Re-reads the running config's file on the blocking pool (so workers keep
/// serving while it is read and validated), attaches fresh resources and swaps the pair in; on
/// any error the running config stays, untouched. Every result is counted in
/// `turnstile_config_reloads_total`. Returns the changed settings that only a restart applies
/// (each is also logged): they keep their running values until then.
pub async fn reload(state: &Arc<AppState>) -> Result<Vec<&'static str>, ConfigErrors> {
    let source = state.live.load().config.source.clone();
    let loader = state.clone();
    let result = match tokio::task::spawn_blocking(move || swap_in(&loader, &source)).await {
        Ok(result) => result,
        // The loader panicked: a bug, but the running config is untouched and serving goes on.
        Err(e) => Err(ConfigErrors(vec![config::ConfigError {
            file: state.live.load().config.source.clone(),
            line: 1,
            column: 1,
            field: String::new(),
            message: format!("the config loader failed unexpectedly (a bug): {e}"),
        }])),
    };
    state.metrics.record_reload(result.is_ok());
    if let Err(e) = &result {
        let mut status = reload_status(state);
        status.last_attempt = Some(std::time::SystemTime::now());
        status.last_error = Some(e.to_string());
    }
    result
}

fn reload_status(state: &AppState) -> std::sync::MutexGuard<'_, config::ReloadStatus> {
    state
        .reload_status
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn swap_in(state: &AppState, source: &std::path::Path) -> Result<Vec<&'static str>, ConfigErrors> {
    let next = config::load(source)?;
    let current = state.live.load();
    let changes = current.config.source_info.changes(&next.source_info);
    tracing::info!(
        config = %next.source.display(),
        sha256 = %next.source_info.sha256,
        changes = %if changes.is_empty() { "none".to_string() } else { changes.join(", ") },
        "config reloaded"
    );
    for warning in &next.warnings {
        tracing::warn!("{warning}");
    }
    for (route, policy, why) in restarted_counters(&current.config, &next) {
        tracing::warn!(
            route,
            policy,
            why,
            "the reload restarts this policy's counters: every key starts afresh"
        );
    }
    let pending = needs_restart(&current.config, &next);
    for setting in &pending {
        tracing::warn!(
            setting,
            "changed by the reload; it takes effect at the next restart"
        );
    }
    // Sources unchanged: the running keys and their tasks carry over. A new URL is fetched
    // before the swap (bounded by `jwks_timeout`; the old config serves meanwhile), and a reload
    // whose new URL gives no keys fails: the running config, keys included, stays.
    if let Some(first) = activate_jwt(&next, Some(&current.config), &state.metrics) {
        if let Err(error) = first_fetch(first.blocking_recv()) {
            let text = std::fs::read_to_string(source).unwrap_or_default();
            let at = config::locate::Positions::index(&text).find("jwt.jwks_url");
            let (line, column) = at.map_or((1, 1), |p| (p.line, p.column));
            return Err(ConfigErrors(vec![config::ConfigError::at(
                source,
                line,
                column,
                "jwt.jwks_url".into(),
                format!("the first fetch failed, so the running keys stay: {error}"),
            )]));
        }
    }
    let live = Arc::new(Live::attach(next, &state.metrics));
    {
        // Held across the swap: whoever reads `/config` after it sees the new config with its
        // status, never with the error of the attempt before.
        let mut status = reload_status(state);
        state.live.store(live);
        status.last_attempt = Some(std::time::SystemTime::now());
        status.last_error = None;
    }
    // The file's overrides came with the config; the API's may name routes it changed.
    state.rebuild_overrides();
    Ok(pending)
}

/// The policies of `next` whose counters a reload from `current` restarts (same route and policy
/// name, a rule whose state does not carry over: [`crate::limiter::Rule::restarts_from`]), with
/// why. Every other policy keeps its counters.
pub fn restarted_counters<'n>(
    current: &Snapshot,
    next: &'n Snapshot,
) -> Vec<(&'n str, &'n str, &'static str)> {
    let mut restarted = Vec::new();
    for route in &next.routes {
        let Some(old_route) = current.routes.iter().find(|r| r.name == route.name) else {
            continue;
        };
        for policy in &route.policies {
            let old = old_route.policies.iter().find(|p| p.name == policy.name);
            if let Some(why) = old.and_then(|old| policy.rule.restarts_from(&old.rule)) {
                restarted.push((&*route.name, &*policy.name, why));
            }
        }
    }
    restarted
}

/// The settings read once at startup (listeners, the store, the connection builder) that differ
/// between `current` and `next`.
pub fn needs_restart(current: &Snapshot, next: &Snapshot) -> Vec<&'static str> {
    let rls_listen = |s: &Snapshot| s.rls.as_ref().map(|r| r.listen);
    let rls_tls = |s: &Snapshot| s.rls.as_ref().and_then(|r| r.tls.clone());
    let rlqs_start = |s: &Snapshot| s.rlqs.as_ref().map(|r| (r.listen, r.timing, r.max_buckets));
    let forward_auth_listen =
        |s: &Snapshot| s.forward_auth.as_ref().map(|f| (f.listen, f.grpc_listen));
    let forward_auth_tls = |s: &Snapshot| s.forward_auth.as_ref().and_then(|f| f.tls.clone());
    [
        ("listen", current.listen != next.listen),
        ("admin_listen", current.admin_listen != next.admin_listen),
        ("admin.tls", current.admin_tls != next.admin_tls),
        ("listen_tls", current.listen_tls != next.listen_tls),
        ("rls.listen", rls_listen(current) != rls_listen(next)),
        ("rls.tls", rls_tls(current) != rls_tls(next)),
        (
            "rlqs (listen, timing, max_buckets)",
            rlqs_start(current) != rlqs_start(next),
        ),
        (
            "forward_auth.tls",
            forward_auth_tls(current) != forward_auth_tls(next),
        ),
        (
            "forward_auth.listen",
            forward_auth_listen(current) != forward_auth_listen(next),
        ),
        ("ext_proc.listen", current.ext_proc != next.ext_proc),
        ("store", current.store != next.store),
        ("access_log", current.access_log != next.access_log),
        ("tracing", current.tracing != next.tracing),
        (
            "server.header_read_timeout",
            current.server.header_read_timeout != next.server.header_read_timeout,
        ),
        (
            "server.max_connections",
            current.server.max_connections != next.server.max_connections,
        ),
        (
            "server.max_header_size",
            current.server.max_header_size != next.server.max_header_size,
        ),
    ]
    .into_iter()
    .filter_map(|(name, changed)| changed.then_some(name))
    .collect()
}
