//! The admin listener: metrics, health and the status page (`status.rs`), never on the public
//! listener. Bind it to loopback or a private interface; it is not meant for clients.
//!
//! Browsers are held to one origin (`guard`): a request a browser marks as coming from
//! another site (`Sec-Fetch-Site`, `Origin`) may not change anything, and a browser must name
//! the listener by an IP address or `localhost` (`Host`), so a page on another site can neither
//! forge a write (CSRF) nor reach the listener under its own name (DNS rebinding). Clients that
//! are not browsers (curl, scripts) send neither field and use the API as before.

mod overrides;
mod status;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::{RawQuery, Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};

use crate::state::AppState;

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
/// [`overrides`]), the status page at `/` with its JSON under `/status/` (`status.rs`);
/// every one behind the cross-site `guard`; for the
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
        .merge(overrides::router(state.state.clone()))
        .merge(status::router(state))
        .layer(axum::middleware::from_fn(guard))
}

/// Refuses, with 403, what a browser sends from another site: see the module's comment and
/// [`cross_site`].
async fn guard(req: Request, next: Next) -> Response {
    match cross_site(req.method(), req.headers()) {
        Some(reason) => (
            StatusCode::FORBIDDEN,
            Json(serde_json::json!({ "error": "cross_site", "message": reason })),
        )
            .into_response(),
        None => next.run(req).await,
    }
}

/// Why a request may not proceed, if it is a browser's from elsewhere. A request carrying
/// neither `Sec-Fetch-Site` nor `Origin` is not a browser's (every current browser sends
/// `Origin` with a `POST`, `PUT` or `DELETE`, and `Sec-Fetch-Site` with every request): it
/// passes, as the API always did. A browser's request must name the listener by an IP address
/// or `localhost` in `Host` (an attacker's DNS name rebound to this address cannot), and a
/// browser's write (any method but `GET`, `HEAD`, `OPTIONS`) must come from this same origin:
/// `Sec-Fetch-Site: same-origin` (or `none`, typed by the user) and an `Origin` equal to
/// `http://` and its `Host` (Fetch Metadata, and RFC 6454 §7 `Origin`).
pub fn cross_site(method: &Method, headers: &HeaderMap) -> Option<&'static str> {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let site = text("sec-fetch-site");
    let origin = text("origin");
    if site.is_none() && origin.is_none() {
        return None;
    }
    let host = text("host").unwrap_or("");
    if !is_address(host) {
        return Some(
            "a browser must reach the admin listener by its IP address or localhost (DNS \
             rebinding): open http://127.0.0.1:PORT/ (or a port-forward) instead",
        );
    }
    if matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) {
        return None;
    }
    if site.is_some_and(|s| s != "same-origin" && s != "none") {
        return Some("a write from another site is refused (CSRF): use the status page itself");
    }
    if origin.is_some_and(|o| o.strip_prefix("http://") != Some(host)) {
        return Some("a write from another origin is refused (CSRF): use the status page itself");
    }
    None
}

/// Whether `host` (a `Host` value) is an IP address or `localhost`, with or without a port.
fn is_address(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(v6) => v6.split_once(']').map_or("", |(name, _)| name),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    name.eq_ignore_ascii_case("localhost") || name.parse::<std::net::IpAddr>().is_ok()
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

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, value.parse().expect("value"));
        }
        map
    }

    #[test]
    fn a_browser_names_the_listener_by_address_or_localhost() {
        for host in [
            "127.0.0.1:9901",
            "10.1.2.3",
            "[::1]:9901",
            "[2001:db8::1]",
            "localhost:9901",
            "LOCALHOST",
        ] {
            assert!(is_address(host), "{host}");
        }
        for host in [
            "evil.example:9901",
            "127.0.0.1.nip.io:9901",
            "",
            "[::1",
            "::1x",
        ] {
            assert!(!is_address(host), "{host}");
        }
    }

    #[test]
    fn only_a_browsers_writes_from_elsewhere_are_refused() {
        let put = Method::PUT;
        // Not a browser: as the API always was, whatever the host.
        assert_eq!(cross_site(&put, &headers(&[("host", "anything")])), None);
        let same = [
            ("host", "127.0.0.1:9901"),
            ("origin", "http://127.0.0.1:9901"),
            ("sec-fetch-site", "same-origin"),
        ];
        assert_eq!(cross_site(&put, &headers(&same)), None);
        let refused = [
            [
                ("host", "127.0.0.1:9901"),
                ("origin", "http://127.0.0.1:9902"),
                ("sec-fetch-site", "same-site"),
            ],
            [
                ("host", "127.0.0.1:9901"),
                ("origin", "null"),
                ("sec-fetch-site", "cross-site"),
            ],
            [
                ("host", "127.0.0.1:9901"),
                ("origin", "https://127.0.0.1:9901"),
                ("sec-fetch-site", "same-origin"),
            ],
        ];
        for pairs in refused {
            assert!(cross_site(&put, &headers(&pairs)).is_some(), "{pairs:?}");
            // Reads from another site are not refused (nothing changes); a foreign host is.
            assert_eq!(
                cross_site(&Method::GET, &headers(&pairs)),
                None,
                "{pairs:?}"
            );
        }
        let rebound = [
            ("host", "evil.example:9901"),
            ("sec-fetch-site", "same-origin"),
        ];
        assert!(cross_site(&Method::GET, &headers(&rebound)).is_some());
    }
}
