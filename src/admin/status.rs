//! The status page on the admin listener: one HTML page (`status.html`, `status.css` and
//! `status.js`, embedded in the binary: no build step, no CDN, no external font or script) and
//! the small JSON endpoints it reads. Its writes go through the overrides API itself
//! (`super::overrides`); `super::guard` refuses them from any other site.
//!
//! - `GET /` the page; `/status.css`, `/status.js` its style and script;
//! - `GET /status/instance`: version, uptime, store and its health, the config's source and hash,
//!   the last reload and its error (with `FILE:LINE:COL`);
//! - `GET /status/routes`: the routes in match order with their policies and each policy's
//!   decisions so far by kind (the page turns two readings into decisions per second);
//! - `POST /status/peek`: `{"route": R, "keys": {"POLICY": "VALUE", ...}}`, each named policy's
//!   state for that key value (remaining, reset), read without consuming (`crate::quota::peek`).

use std::sync::OnceLock;
use std::time::Instant;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};

use super::AdminState;
use crate::config::{Action, Policy};
use crate::keys::KeyPart;

const PAGE: &str = include_str!("status.html");
const STYLE: &str = include_str!("status.css");
const SCRIPT: &str = include_str!("status.js");

/// When the admin router was first built: the process's start, to a few milliseconds.
static STARTED: OnceLock<Instant> = OnceLock::new();

pub fn router(state: AdminState) -> Router {
    STARTED.get_or_init(Instant::now);
    Router::new()
        .route(
            "/",
            get(|| async { page(PAGE, "text/html; charset=utf-8") }),
        )
        .route(
            "/status.css",
            get(|| async { page(STYLE, "text/css; charset=utf-8") }),
        )
        .route(
            "/status.js",
            get(|| async { page(SCRIPT, "text/javascript; charset=utf-8") }),
        )
        .route("/status/instance", get(instance))
        .route("/status/routes", get(routes))
        .route("/status/peek", post(peek))
        .with_state(state)
}

fn page(text: &'static str, content_type: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            // Nothing but this listener: no other origin's script, style, font, frame or form
            // target, and no framing of the page by another site.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
            ),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        text,
    )
        .into_response()
}

async fn instance(State(state): State<AdminState>) -> Json<Value> {
    let unix = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
    };
    let app = &state.state;
    let live = app.live.load();
    let config = &live.config;
    let reload = app
        .reload_status
        .lock()
        .map(|s| s.clone())
        .unwrap_or_else(|poisoned| poisoned.into_inner().clone());
    let store = app.engine.store();
    Json(json!({
        "version": env!("CARGO_PKG_VERSION"),
        "uptime_seconds": STARTED.get().map_or(0.0, |s| s.elapsed().as_secs_f64()),
        "store": { "type": store.name(), "ready": store.is_ready() },
        "draining": state.draining.load(std::sync::atomic::Ordering::Relaxed),
        "config": {
            "source": config.source.display().to_string(),
            "sha256": config.source_info.sha256,
            "loaded_at_unix": unix(config.source_info.loaded_at),
        },
        "last_reload": {
            "attempt_unix": reload.last_attempt.map(unix),
            "error": reload.last_error,
        },
        "show_key_values": config.admin.show_key_values,
        "overrides": app.overrides.active().len(),
    }))
}

/// A key part as the config writes it (`client_ip`, `header:x-api-key`, `path:user_id`, ...).
fn key_part(part: &KeyPart, params: &[&str]) -> String {
    match part {
        KeyPart::ClientIp => "client_ip".into(),
        KeyPart::Header(name) => format!("header:{name}"),
        KeyPart::PathParam(i) => format!("path:{}", params.get(*i).copied().unwrap_or("?")),
        KeyPart::Query(name) => format!("query:{name}"),
        KeyPart::Method => "method".into(),
        KeyPart::Host => "host".into(),
        KeyPart::Jwt(claim) => format!("jwt:{claim}"),
        KeyPart::Body(pointer) => format!("body:{pointer}"),
        KeyPart::ClientCert(field) => format!("client_cert:{}", field.as_str()),
    }
}

fn policy_json(policy: &Policy, params: &[&str], counts: &[(&'static str, u64)]) -> Value {
    let (algorithm, numbers) = crate::quota::describe(&policy.rule);
    let decisions: serde_json::Map<String, Value> = counts
        .iter()
        .map(|&(label, n)| (label.to_string(), n.into()))
        .collect();
    json!({
        "name": &*policy.name,
        "algorithm": algorithm,
        "limit": numbers,
        "cost": policy.cost,
        "key": policy.key.iter().map(|p| key_part(p, params)).collect::<Vec<_>>(),
        "mode": if policy.shadow { "shadow" } else { "enforce" },
        "shared": policy.shared,
        "decisions": decisions,
    })
}

async fn routes(State(state): State<AdminState>) -> Json<Value> {
    let live = state.state.live.load();
    let routes: Vec<Value> = live
        .config
        .routes
        .iter()
        .zip(&live.routes)
        .enumerate()
        .map(|(i, (route, resources))| {
            let params: Vec<&str> = route.matcher.param_names().collect();
            let policies: Vec<Value> = route
                .policies
                .iter()
                .zip(&resources.policies)
                .map(|(p, m)| policy_json(p, &params, &m.counts()))
                .collect();
            let action = match &route.action {
                Action::Forward(up) => format!("upstream {}", up.name),
                Action::Respond(_) => "respond".to_string(),
                Action::CheckOnly => "check only".to_string(),
            };
            json!({
                "order": i + 1,
                "name": &*route.name,
                "match": route.matcher.describe(),
                "action": action,
                "quota_endpoint": route.quota_endpoint.as_ref().map(|q| q.path.as_str()),
                "policies": policies,
            })
        })
        .collect();
    Json(json!({ "routes": routes }))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PeekRequest {
    route: String,
    /// The key value of each policy to read (its parts joined by `|`, as `/overrides` names it).
    keys: std::collections::BTreeMap<String, String>,
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({ "error": message.into() }))).into_response()
}

/// Each policy of the route named in `keys`, at that key value: its state now, read without
/// consuming. 404 for an unknown route or policy, 400 for a key value that could never be one of
/// the policy's counters (as `PUT /overrides` judges it), 503 when the store cannot answer.
async fn peek(
    State(state): State<AdminState>,
    body: Result<Json<PeekRequest>, axum::extract::rejection::JsonRejection>,
) -> Response {
    let Json(asked) = match body {
        Ok(body) => body,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.body_text()),
    };
    let app = &state.state;
    let live = app.live.load();
    let Some(index) = live
        .config
        .routes
        .iter()
        .position(|r| *r.name == *asked.route)
    else {
        return error(StatusCode::NOT_FOUND, format!("no route `{}`", asked.route));
    };
    let (route, resources) = (&live.config.routes[index], &live.routes[index]);
    if let Some(unknown) = asked
        .keys
        .keys()
        .find(|name| !route.policies.iter().any(|p| *p.name == **name))
    {
        return error(
            StatusCode::NOT_FOUND,
            format!("route `{}` has no policy `{unknown}`", route.name),
        );
    }
    let mut keys = Vec::with_capacity(route.policies.len());
    for policy in &route.policies {
        let Some(value) = asked.keys.get(&*policy.name) else {
            keys.push(None);
            continue;
        };
        if let Err(e) = crate::config::overrides::key_fits(policy, value) {
            return error(
                StatusCode::BAD_REQUEST,
                format!("{}: {}", policy.name, e.message),
            );
        }
        keys.push(Some(format!("{}{value}", policy.key_prefix())));
    }
    match crate::quota::peek(app, route, resources, keys).await {
        Ok(states) => Json(json!({
            "route": &*route.name,
            "policies": states.iter().map(crate::quota::state_json).collect::<Vec<_>>(),
        }))
        .into_response(),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}
