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
use crate::admission::{self, Checked};
use crate::config::compile::deny_status;
use crate::config::CheckProxy;
use crate::metrics::{CheckResult, DoorMetrics};
use crate::proxy::body::{ClientBody, ResponseBody};
use crate::respond::{self, Refusal};
use crate::state::AppState;

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

/// Answers one check call; never fails (every problem is an answer).
pub async fn handle(
    door: Arc<HttpDoor>,
    peer: SocketAddr,
    req: Request<ClientBody>,
) -> Result<Response<ResponseBody>, Infallible> {
    if req.uri().path() != "/check" {
        return Ok(respond::not_found());
    }
    let live = door.state.live.load_full();
    let (configured, proxy) = live
        .config
        .forward_auth
        .as_ref()
        .map_or((StatusCode::TOO_MANY_REQUESTS, CheckProxy::Auto), |f| {
            (f.deny_status, f.proxy)
        });
    let deny = match query_deny_status(req.uri().query()) {
        Ok(status) => status.unwrap_or(configured),
        Err(message) => return Ok(bad_request(&door, &message)),
    };
    let (parts, _body) = req.into_parts();
    let mut original = match original_request(&parts.method, parts.headers, proxy) {
        Ok(original) => original,
        Err(e) => return Ok(bad_request(&door, &e.to_string())),
    };
    let checked = admission::check(&door.state, &live, &mut original, peer.ip()).await;
    door.metrics.record(result_of(&checked));
    Ok(match checked {
        Checked::NoRoute => Response::new(ResponseBody::empty()),
        Checked::Admitted(route, admitted) => {
            let mut response = Response::new(ResponseBody::empty());
            route
                .rate_limit_headers
                .insert(response.headers_mut(), &admitted.limits, false);
            response
        }
        Checked::Refused(refusal @ Refusal::RateLimited { .. }) => {
            let mut response = respond::refusal(&refusal);
            *response.status_mut() = deny;
            response
        }
        Checked::Refused(refusal) => respond::refusal(&refusal),
    })
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
