//! The HTTP check endpoint: `/check` (any method) on `forward_auth.listen`.
//!
//! The proxy calls it before forwarding a request; a 2xx lets the request through. Allowed: 200,
//! empty, with `X-RateLimit-*` for the proxy to copy onto the upstream request. Refused:
//! `deny_status` (or the call's `?deny_status=`), `Retry-After`, `X-RateLimit-*` and the gateway's
//! JSON body. No route: 200. Store down: the route's failure mode (open: 200; closed: 503 and
//! `Retry-After`). A call that names no valid request: 400.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use http::{Request, Response, StatusCode};

use super::{original_request, result_of};
use crate::access_log::{Door, Record};
use crate::admission::{self, Checked};
use crate::config::compile::deny_status;
use crate::config::CheckProxy;
use crate::metrics::{CheckResult, DoorMetrics, RouteMetrics};
use crate::proxy::body::{ClientBody, ResponseBody};
use crate::respond::{self, Refusal};
use crate::state::{AppState, Live};

/// What the HTTP check listener shares between connections.
#[derive(Debug)]
pub struct HttpDoor {
    state: Arc<AppState>,
    metrics: DoorMetrics,
}

impl HttpDoor {
    pub fn new(state: Arc<AppState>) -> Self {
        let metrics = state.metrics.door("forward_auth");
        HttpDoor { state, metrics }
    }
}

/// Answers one check call; never fails (every problem is an answer). Each answer is counted in
/// `turnstile_requests_total` and `turnstile_request_duration_seconds`, under the route the call
/// names (or `unmatched`), as the gateway counts its own.
pub async fn handle(
    door: Arc<HttpDoor>,
    peer: SocketAddr,
    req: Request<ClientBody>,
) -> Result<Response<ResponseBody>, Infallible> {
    let started = crate::now::read();
    let live = door.state.live.load_full();
    let log = &door.state.access_log;
    let mut record = log
        .is_on()
        .then(|| Box::new(Record::new(Door::Check, std::time::SystemTime::now())));
    let (response, counted) = answer(&door, &live, peer, req, record.as_deref_mut()).await;
    let seconds = crate::now::read()
        .saturating_duration_since(started)
        .as_secs_f64();
    counted
        .unwrap_or(&live.unmatched)
        .record_response(response.status().as_u16(), seconds);
    if let Some(mut record) = record {
        let status = response.status();
        if log.wants(!status.is_success()) {
            record.status = status.as_u16();
            record.duration = std::time::Duration::from_secs_f64(seconds);
            log.submit(record);
        }
    }
    Ok(response)
}

/// The answer to one call, and the counters of the route it named (none: `unmatched`).
async fn answer<'l>(
    door: &HttpDoor,
    live: &'l Live,
    peer: SocketAddr,
    req: Request<ClientBody>,
    mut record: Option<&mut Record>,
) -> (Response<ResponseBody>, Option<&'l RouteMetrics>) {
    if req.uri().path() != "/check" {
        return (respond::not_found(), None);
    }
    let (configured, proxy) = live
        .config
        .forward_auth
        .as_ref()
        .map_or((StatusCode::TOO_MANY_REQUESTS, CheckProxy::Auto), |f| {
            (f.deny_status, f.proxy)
        });
    let deny = match query_deny_status(req.uri().query()) {
        Ok(status) => status.unwrap_or(configured),
        Err(message) => return (bad_request(door, &message), None),
    };
    let (parts, _body) = req.into_parts();
    let mut original = match original_request(&parts.method, parts.headers, proxy) {
        Ok(original) => original,
        Err(e) => return (bad_request(door, &e.to_string()), None),
    };
    // The caller is the proxy, trusted with the request's id as with the request itself.
    let request_id =
        crate::request_id::resolve(&live.config.request_id, true, original.headers_mut());
    let peer_ip = peer.ip().to_canonical();
    if let Some(record) = &mut record {
        record.request_id = request_id.clone();
        record.trace_id = crate::request_id::trace_id(original.headers());
        let proxies = &live.config.trusted_proxies;
        record.client_ip = Some(proxies.client_ip(peer_ip, original.headers()));
    }
    let note = record.as_mut().map(|r| &mut r.decided);
    let (checked, counted) =
        admission::check(&door.state, live, &mut original, peer_ip, note).await;
    door.metrics.record(result_of(&checked));
    if let Some(record) = &mut record {
        // As the check saw it: canonical.
        record.method = Some(original.method().clone());
        record.host = crate::normalize::host::host(original.headers()).map(str::to_string);
        record.path = Some(original.uri().path().to_string());
    }
    let mut response = match checked {
        Checked::NoRoute => Response::new(ResponseBody::empty()),
        Checked::Admitted(route, admitted) => {
            let mut response = Response::new(ResponseBody::empty());
            route
                .rate_limit_headers
                .insert(response.headers_mut(), &admitted.limits, false);
            response
        }
        Checked::Refused(refusal @ Refusal::RateLimited { .. }) => {
            let mut response = respond::refusal_for(&refusal, request_id.as_ref());
            *response.status_mut() = deny;
            response
        }
        Checked::Refused(refusal) => respond::refusal(&refusal),
    };
    if let Some(id) = request_id {
        let name = live.config.request_id.header.clone();
        response.headers_mut().insert(name, id);
    }
    (response, Some(counted))
}

fn bad_request(door: &HttpDoor, message: &str) -> Response<ResponseBody> {
    door.metrics.record(CheckResult::BadRequest);
    respond::refusal(&Refusal::BadRequest(message.to_string()))
}

/// The call's `?deny_status=CODE`, for proxies that pass on only some statuses (nginx's
/// `auth_request`: 401 and 403).
fn query_deny_status(query: Option<&str>) -> Result<Option<StatusCode>, String> {
    let Some(value) = query
        .into_iter()
        .flat_map(|q| q.split('&'))
        .find_map(|pair| pair.strip_prefix("deny_status="))
    else {
        return Ok(None);
    };
    let code = value
        .parse::<u16>()
        .map_err(|_| format!("deny_status: `{value}` is not a status code"))?;
    deny_status(code)
        .map(Some)
        .map_err(|e| format!("deny_status: {e}"))
}
