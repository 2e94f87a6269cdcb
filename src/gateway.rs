//! The inline gateway's request pipeline: route, key, decide, then forward or answer.
//!
//! Everything per request reads the current config snapshot (one `Arc` clone) and the shared
//! limiter; nothing parses config on this path.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;
use http::{Request, Response};
use hyper::body::Incoming;

use crate::config::{Action, FailureMode, Route, Snapshot};
use crate::keys::RequestView;
use crate::limiter::{Check, Decision, Limiter, MonotonicClock};
use crate::metrics::{DecisionLabel, Metrics, RouteMetrics, UpstreamErrorKind};
use crate::normalize;
use crate::proxy::body::ResponseBody;
use crate::proxy::{self, ClientSide, ForwardError};
use crate::respond;
use crate::route::RequestHead;
use crate::top_limited::{TopLimited, DEFAULT_CAPACITY, DEFAULT_PERIOD_US};

/// State shared by every connection of the public listener.
#[derive(Debug)]
pub struct Gateway {
    pub config: ArcSwap<Snapshot>,
    pub limiter: Limiter,
    pub metrics: Metrics,
    /// Requests that matched no route.
    unmatched: RouteMetrics,
    /// Who is being limited, in bounded memory: `/debug/top-limited` on the admin listener.
    pub top_limited: TopLimited,
    /// The last reload attempt's outcome, for `/config` on the admin listener.
    pub reload_status: std::sync::Mutex<crate::config::ReloadStatus>,
}

/// Seconds a client should wait before retrying when the store is down and the route fails
/// closed.
const STORE_DOWN_RETRY_SECONDS: u64 = 1;

impl Gateway {
    pub fn new(snapshot: Snapshot, limiter: Limiter, metrics: Metrics) -> Self {
        Gateway {
            config: ArcSwap::from_pointee(snapshot),
            limiter,
            unmatched: metrics.route("unmatched"),
            metrics,
            top_limited: TopLimited::new(
                Arc::new(MonotonicClock::new()),
                DEFAULT_CAPACITY,
                DEFAULT_PERIOD_US,
            ),
            reload_status: std::sync::Mutex::default(),
        }
    }

    /// Serves one request; never fails (errors become responses).
    pub async fn handle(
        self: Arc<Self>,
        peer: SocketAddr,
        mut req: Request<Incoming>,
    ) -> Result<Response<ResponseBody>, Infallible> {
        let started = Instant::now();
        let snapshot = self.config.load_full();
        // One spelling per request, before anything reads it: routing, keys and the upstream.
        if let Err(e) = normalize::canonicalize(&mut req, snapshot.server.paths) {
            let response = respond::bad_request(&e.to_string());
            self.unmatched
                .record_response(response.status().as_u16(), started.elapsed().as_secs_f64());
            return Ok(response);
        }
        let host = normalize::host::host(req.headers());
        let head = RequestHead {
            method: req.method(),
            host,
            path: req.uri().path(),
            headers: req.headers(),
        };
        let Some((route, params)) = snapshot
            .routes
            .iter()
            .find_map(|r| r.matcher.matches(&head).map(|p| (r, p)))
        else {
            let response = respond::not_found();
            self.unmatched
                .record_response(response.status().as_u16(), started.elapsed().as_secs_f64());
            return Ok(response);
        };

        let response = self.serve_route(&snapshot, route, &params, peer, req).await;
        route
            .metrics
            .record_response(response.status().as_u16(), started.elapsed().as_secs_f64());
        Ok(response)
    }

    async fn serve_route(
        &self,
        snapshot: &Snapshot,
        route: &Route,
        params: &crate::route::PathParams,
        peer: SocketAddr,
        req: Request<Incoming>,
    ) -> Response<ResponseBody> {
        let max_body = snapshot.server.max_body_size;
        if declared_length(&req).is_some_and(|len| len > max_body) {
            return respond::payload_too_large(max_body);
        }
        let peer_ip = peer.ip().to_canonical();
        let client_ip = snapshot.trusted_proxies.client_ip(peer_ip, req.headers());
        let host = normalize::host::host(req.headers());
        let view = RequestView {
            method: req.method(),
            host,
            path: req.uri().path(),
            query: req.uri().query(),
            headers: req.headers(),
            params,
            client_ip,
            client_prefix: snapshot.client_prefix,
        };

        // The policies that apply (all key parts present), with their counter keys. A key
        // header or query parameter sent twice is ambiguous: 400.
        let mut keyed: Vec<(usize, String)> = Vec::with_capacity(route.policies.len());
        for (i, policy) in route.policies.iter().enumerate() {
            match policy.counter_key(&view) {
                Ok(Some(key)) => keyed.push((i, key)),
                Ok(None) => {}
                Err(e) => return respond::bad_request(&e.to_string()),
            }
        }
        let governing = if keyed.is_empty() {
            None
        } else {
            let checks: Vec<Check<'_>> = keyed
                .iter()
                .map(|(i, key)| Check {
                    key,
                    rule: &route.policies[*i].rule,
                    cost: route.policies[*i].cost,
                    shadow: false,
                })
                .collect();
            match self.limiter.decide(&checks).await {
                Ok(decision) => match self.record(route, &keyed, &decision) {
                    Verdict::Admit(outcome) => outcome,
                    Verdict::Reject(response) => return response,
                },
                Err(e) => {
                    let label = match route.failure_mode {
                        FailureMode::Open => DecisionLabel::FailedOpen,
                        FailureMode::Closed => DecisionLabel::FailedClosed,
                    };
                    for (i, _) in &keyed {
                        route.policies[*i].metrics.record(label);
                    }
                    log_store_error(&e);
                    if route.failure_mode == FailureMode::Closed {
                        return respond::store_unavailable(&route.name, STORE_DOWN_RETRY_SECONDS);
                    }
                    None
                }
            }
        };

        let mut response = match &route.action {
            Action::Respond(direct) => {
                let mut r = Response::new(ResponseBody::full(direct.body.clone()));
                *r.status_mut() = direct.status;
                r.headers_mut()
                    .insert(http::header::CONTENT_TYPE, direct.content_type.clone());
                r
            }
            Action::Forward(upstream) => {
                let client_side = ClientSide {
                    peer: peer_ip,
                    peer_trusted: snapshot.trusted_proxies.contains(&peer_ip),
                };
                match proxy::forward(upstream, req, client_side, &snapshot.server).await {
                    Ok(r) => r,
                    Err(ForwardError::Timeout) => {
                        route
                            .metrics
                            .record_upstream_error(UpstreamErrorKind::Timeout);
                        respond::gateway_timeout(&route.name)
                    }
                    Err(ForwardError::Unreachable(kind)) => {
                        route.metrics.record_upstream_error(kind);
                        respond::bad_gateway(&route.name)
                    }
                    Err(ForwardError::BodyTooLarge) => respond::payload_too_large(max_body),
                    Err(ForwardError::BodyReadTimeout) => respond::request_timeout(),
                    Err(ForwardError::PoolTimeout) => respond::upstream_busy(&route.name),
                }
            }
        };
        if let Some(outcome) = governing {
            respond::insert_rate_limit_headers(response.headers_mut(), &outcome);
        }
        response
    }

    fn record(&self, route: &Route, keyed: &[(usize, String)], decision: &Decision) -> Verdict {
        for ((i, key), outcome) in keyed.iter().zip(&decision.outcomes) {
            let policy = &route.policies[*i];
            if decision.allowed || outcome.allowed {
                policy.metrics.record(DecisionLabel::Allowed);
            } else {
                policy.metrics.record(DecisionLabel::Limited);
                self.top_limited
                    .record(&route.name, &policy.name, policy.key_value(key));
            }
        }
        match decision.governing() {
            None => Verdict::Admit(None),
            Some((_, outcome)) if decision.allowed => Verdict::Admit(Some(*outcome)),
            Some((j, outcome)) => {
                let policy = &route.policies[keyed[j].0];
                Verdict::Reject(respond::rate_limited(&route.name, &policy.name, outcome))
            }
        }
    }
}

enum Verdict {
    Admit(Option<crate::limiter::Outcome>),
    Reject(Response<ResponseBody>),
}

fn declared_length<B>(req: &Request<B>) -> Option<u64> {
    req.headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

/// Logs store failures at most once per second per process, so an outage does not flood logs.
fn log_store_error(e: &crate::limiter::StoreError) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static LAST: AtomicU64 = AtomicU64::new(0);
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let now = START.get_or_init(Instant::now).elapsed().as_secs() + 1;
    let last = LAST.load(Ordering::Relaxed);
    if now > last
        && LAST
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        tracing::warn!(error = %e, "rate-limit store failed; applying the route's failure_mode");
    }
}
