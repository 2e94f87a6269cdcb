//! The admin listener: metrics and health, never on the public listener. Bind it to loopback or
//! a private interface; it is not meant for clients.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use crate::gateway::Gateway;

/// What the admin endpoints read.
#[derive(Debug, Clone)]
pub struct AdminState {
    pub gateway: Arc<Gateway>,
    /// Set once shutdown begins, so load balancers stop sending traffic before we stop accepting.
    pub draining: Arc<AtomicBool>,
}

/// `/metrics`, `/healthz` (the process is up) and `/readyz` (it can decide: the store answers and
/// we are not draining).
pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(state)
}

async fn metrics(State(state): State<AdminState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.gateway.metrics.render(),
    )
}

async fn readyz(State(state): State<AdminState>) -> impl IntoResponse {
    if state.draining.load(Ordering::Relaxed) {
        (StatusCode::SERVICE_UNAVAILABLE, "draining\n")
    } else if !state.gateway.limiter.store().is_ready() {
        (StatusCode::SERVICE_UNAVAILABLE, "store unavailable\n")
    } else {
        (StatusCode::OK, "ready\n")
    }
}
