//! The admin listener: metrics and health, never on the public listener. Bind it to loopback or
//! a private interface; it is not meant for clients.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::{RawQuery, State};
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};

use crate::state::AppState;

mod overrides;

/// What the admin endpoints read.
#[derive(Debug, Clone)]
pub struct AdminState {
    pub state: Arc<AppState>,
    /// Set once shutdown begins, so load balancers stop sending traffic before we stop accepting.
    pub draining: Arc<AtomicBool>,
}

/// `/metrics`, `/healthz` (the process is up), `/readyz` (it can decide: the store answers and
/// we are not draining), `/debug/top-limited` (the keys limited most, `?n=` of them) and `/config`
/// (the active config's hash and the last reload error), `/overrides` (per-key limits,
/// [`overrides`]); for the
/// Envoy rate limit service, envoyproxy/ratelimit's `POST /json` and `/healthcheck`.
pub fn router(state: AdminState) -> Router {
    let rls = crate::rls::RlsService::new(state.state.clone());
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/healthcheck", get(healthcheck))
        .route("/debug/top-limited", get(top_limited))
        .route("/config", get(config_status))
        .with_state(state.clone())
        .merge(crate::rls::json::router(rls))
        .merge(overrides::router(state.state))
}

async fn metrics(State(state): State<AdminState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.state.metrics.render(),
    )
}

/// envoyproxy/ratelimit's health check: `OK` while serving, 500 once draining or when the store
/// cannot decide.
async fn healthcheck(State(state): State<AdminState>) -> impl IntoResponse {
    if state.draining.load(Ordering::Relaxed) || !state.state.engine.store().is_ready() {
        (StatusCode::INTERNAL_SERVER_ERROR, "NOT OK\n")
    } else {
        (StatusCode::OK, "OK\n")
    }
}

async fn readyz(State(state): State<AdminState>) -> impl IntoResponse {
    if state.draining.load(Ordering::Relaxed) {
        (StatusCode::SERVICE_UNAVAILABLE, "draining\n")
    } else if !state.state.engine.store().is_ready() {
        (StatusCode::SERVICE_UNAVAILABLE, "store unavailable\n")
    } else {
        (StatusCode::OK, "ready\n")
    }
}

/// The active config's identity and the last reload's outcome: which file is live on this
/// instance (compare `sha256` across a fleet) and, when an edit did not apply, why.
async fn config_status(State(state): State<AdminState>) -> impl IntoResponse {
    let unix = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
    };
    let live = state.state.live.load();
    let snapshot = &live.config;
    let status = state
        .state
        .reload_status
        .lock()
        .map(|s| s.clone())
        .unwrap_or_else(|poisoned| poisoned.into_inner().clone());
    Json(serde_json::json!({
        "source": snapshot.source.display().to_string(),
        "sha256": snapshot.source_info.sha256,
        "loaded_at_unix": unix(snapshot.source_info.loaded_at),
        "routes": snapshot.routes.len(),
        "last_reload_attempt_unix": status.last_attempt.map(unix),
        "last_reload_error": status.last_error,
    }))
}

/// How many keys `/debug/top-limited` lists per period unless `?n=` says otherwise.
const TOP_LIMITED_DEFAULT: usize = 20;

async fn top_limited(
    State(state): State<AdminState>,
    RawQuery(query): RawQuery,
) -> impl IntoResponse {
    let n = query
        .as_deref()
        .unwrap_or("")
        .split('&')
        .find_map(|pair| pair.strip_prefix("n="))
        .and_then(|n| n.parse().ok())
        .unwrap_or(TOP_LIMITED_DEFAULT);
    let show_values = state.state.live.load().config.admin.show_key_values;
    Json(state.state.engine.top_limited().report_with(n, show_values))
}
