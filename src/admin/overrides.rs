//! The admin API of overrides, on the admin listener only (the public listener never routes
//! here): `GET /overrides`, `PUT` and `DELETE /overrides/{route}/{policy}/{key}`. The key is the
//! rest of the path, percent-decoded, so key values with `/` work (`%2F` also does).

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};

use crate::limiter::Store;
use crate::overrides::{resolve_any, Limits, Override, MAX_OVERRIDES};
use crate::state::AppState;

/// The routes to merge into the admin router.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/overrides", get(list))
        .route(
            "/overrides/{route}/{policy}/{*key}",
            axum::routing::put(put).delete(delete),
        )
        .with_state(state)
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(serde_json::json!({ "error": message.into() }))).into_response()
}

async fn list(State(state): State<Arc<AppState>>) -> Response {
    let overrides = state.overrides.list(&state.live.load().config);
    Json(serde_json::json!({
        "max": MAX_OVERRIDES,
        "active": state.overrides.active().len(),
        "overrides": overrides,
    }))
    .into_response()
}

/// Sets (or replaces) the override; the body gives the new numbers (`{"limit": 1000}`, or
/// `{"rate": "50/s", "burst": 100}` for a token bucket). 400 when they do not fit the policy, 404
/// when the route or policy does not exist, 409 when [`MAX_OVERRIDES`] are set, 503 when the
/// Redis store cannot take it (nothing changed then).
async fn put(
    State(state): State<Arc<AppState>>,
    Path((route, policy, key)): Path<(String, String, String)>,
    body: Result<Json<Limits>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let Json(limits) = match body {
        Ok(body) => body,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.body_text()),
    };
    let o = Override::new(&route, &policy, &key, limits);
    let live = state.live.load();
    let resolved = resolve_any(&live.config.routes, live.config.rlqs.as_ref(), &o).map(|_| ());
    drop(live);
    if let Err(e) = resolved {
        let status = if e.missing {
            StatusCode::NOT_FOUND
        } else {
            StatusCode::BAD_REQUEST
        };
        return error(status, format!("{}: {}", e.field, e.message));
    }
    let field = o.counter_key();
    if let Store::Redis(store) = state.engine.store() {
        let json = serde_json::to_string(&o).unwrap_or_default();
        match store.overrides_put(&field, &json, MAX_OVERRIDES).await {
            // Applied here from Redis itself, after any refresh already under way.
            Ok(true) => state.refresh_overrides().await,
            Ok(false) => return full(),
            Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        }
    } else {
        let mut api = state.overrides.api();
        if api.len() >= MAX_OVERRIDES && !api.contains_key(&field) {
            return full();
        }
        api.insert(field, o.clone());
        drop(api);
        state.rebuild_overrides();
    }
    (StatusCode::OK, Json(o)).into_response()
}

fn full() -> Response {
    error(
        StatusCode::CONFLICT,
        format!("{MAX_OVERRIDES} overrides are set already; delete some first"),
    )
}

/// Removes the API's override of that key (the file's, if any, applies again). 404 when the API
/// set none.
async fn delete(
    State(state): State<Arc<AppState>>,
    Path((route, policy, key)): Path<(String, String, String)>,
) -> Response {
    let field = Override::new(&route, &policy, &key, Limits::default()).counter_key();
    let existed = if let Store::Redis(store) = state.engine.store() {
        match store.overrides_delete(&field).await {
            Ok(existed) => {
                state.refresh_overrides().await;
                existed
            }
            Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        }
    } else {
        let existed = state.overrides.api().remove(&field).is_some();
        state.rebuild_overrides();
        existed
    };
    if existed {
        StatusCode::NO_CONTENT.into_response()
    } else {
        error(
            StatusCode::NOT_FOUND,
            format!("no override set through the API for `{field}`"),
        )
    }
}
