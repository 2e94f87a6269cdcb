//! Every response the gateway writes itself, in one place: the rate-limit headers and the JSON
//! error bodies. A door that refuses a request names a [`Refusal`] and [`refusal`] turns it into
//! the response (one rescue layer); adapters never format these on their own.
//!
//! [`headers`] writes the rate-limit fields in a route's dialect (`rate_limit_headers`), and
//! [`limited`] holds a route's compiled refusal (`limited_response`), and [`grpc`] makes any
//! refusal of a gRPC call a gRPC answer (`grpc-status`).

pub mod grpc;

pub use crate::config::limited;
pub use crate::rate_limit_headers as headers;

use http::header::{ALLOW, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, Response, StatusCode};

use crate::limiter::Outcome;
use crate::proxy::body::ResponseBody;
pub(crate) use headers::digits;
pub use headers::{
    ceil_seconds, number_value, retry_after_seconds, HeaderMode, Limits, RateLimitHeaders,
    X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING, X_RATELIMIT_RESET,
};
pub use limited::LimitedResponse;

/// Seconds a client should wait before retrying when the store is down and the route fails
/// closed.
pub const STORE_DOWN_RETRY_SECONDS: u64 = 1;

/// Why the gateway answers a request itself instead of forwarding it, by where it came from:
/// the request (downstream), the rate limit or its store, or the upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal<'a> {
    /// 400: the request cannot be read one way only (a path that does not normalise, a key
    /// header or query parameter sent twice).
    BadRequest(String),
    /// 404: no route matches.
    NoRoute,
    /// 405: routes match the path but none the method; the value is `Allow` (RFC 9110 §15.5.6).
    MethodNotAllowed(HeaderValue),
    /// 413: the declared or streamed body is over `server.max_body_size`.
    BodyTooLarge(u64),
    /// 408: the client stopped sending its body (`server.body_read_timeout`).
    BodyReadTimeout,
    /// 429 (or the route's `limited_response`): the governing policy's outcome.
    RateLimited {
        route: &'a str,
        policy: &'a str,
        outcome: Outcome,
        /// The fields every policy that applied contributes (`rate_limit_headers`).
        limits: Limits,
        headers: &'a RateLimitHeaders,
        response: &'a LimitedResponse,
    },
    /// 503: the store cannot decide and the route fails closed.
    StoreUnavailable(&'a str),
    /// 502: the upstream could not be reached or broke the exchange.
    UpstreamUnreachable(&'a str),
    /// 504: no response head within the upstream's timeout.
    UpstreamTimeout(&'a str),
    /// 500: a check-only route (no upstream, no respond) reached the inline gateway.
    CheckOnly(&'a str),
    /// 503: every connection the upstream may have stayed busy for its `pool_timeout`.
    UpstreamBusy(&'a str),
    /// 401: the route has `require_jwt` and the request has no valid bearer token (`missing`:
    /// no credentials at all).
    Unauthorized { route: &'a str, missing: bool },
}

/// The one place a refusal becomes a response.
pub fn refusal(refusal: &Refusal<'_>) -> Response<ResponseBody> {
    refusal_for(refusal, None)
}

/// [`refusal`] for the request named `request_id` (`crate::request_id`), which the JSON body of
/// a rate-limited refusal carries; a door adds the id's field to every response itself.
pub fn refusal_for(
    refusal: &Refusal<'_>,
    request_id: Option<&HeaderValue>,
) -> Response<ResponseBody> {
    match refusal {
        Refusal::BadRequest(message) => bad_request(message),
        Refusal::NoRoute => not_found(),
        Refusal::MethodNotAllowed(allow) => method_not_allowed(allow),
        Refusal::BodyTooLarge(limit) => payload_too_large(*limit),
        Refusal::BodyReadTimeout => request_timeout(),
        Refusal::RateLimited {
            route,
            policy,
            outcome,
            limits,
            headers,
            response,
        } => rate_limited(
            route,
            policy,
            outcome,
            limits,
            headers,
            response,
            request_id.and_then(|id| id.to_str().ok()),
        ),
        Refusal::StoreUnavailable(route) => store_unavailable(route, STORE_DOWN_RETRY_SECONDS),
        Refusal::UpstreamUnreachable(route) => bad_gateway(route),
        Refusal::UpstreamTimeout(route) => gateway_timeout(route),
        Refusal::CheckOnly(route) => json(
            StatusCode::INTERNAL_SERVER_ERROR,
            serde_json::json!({
                "error": "check_only_route",
                "route": route,
                "message": "this route has no upstream and no respond: only forward_auth decides it",
            }),
        ),
        Refusal::UpstreamBusy(route) => upstream_busy(route),
        Refusal::Unauthorized { route, missing } => unauthorized(route, *missing),
    }
}

/// 401 with a `WWW-Authenticate: Bearer` challenge (RFC 6750 §3). A request without credentials
/// gets no error code (§3.1); one whose token failed verification gets `invalid_token` (§3.1),
/// never the reason, which would help a forger more than a client.
pub fn unauthorized(route: &str, missing: bool) -> Response<ResponseBody> {
    let mut response = json(
        StatusCode::UNAUTHORIZED,
        serde_json::json!({
            "error": if missing { "missing_token" } else { "invalid_token" },
            "route": route,
        }),
    );
    let challenge = if missing {
        HeaderValue::from_static("Bearer")
    } else {
        HeaderValue::from_static("Bearer error=\"invalid_token\"")
    };
    response
        .headers_mut()
        .insert(http::header::WWW_AUTHENTICATE, challenge);
    response
}

fn json(status: StatusCode, body: serde_json::Value) -> Response<ResponseBody> {
    let mut response = Response::new(ResponseBody::full(body.to_string()));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// A refused request: the route's `limited_response` (by default a JSON 429 naming the route,
/// the policy and the request id), with `Retry-After` and the route's rate-limit fields.
pub fn rate_limited(
    route: &str,
    policy: &str,
    outcome: &Outcome,
    limits: &Limits,
    headers: &RateLimitHeaders,
    limited: &LimitedResponse,
    request_id: Option<&str>,
) -> Response<ResponseBody> {
    let retry = retry_after_seconds(outcome);
    let mut response = match &limited.body {
        None => {
            let mut body = serde_json::json!({
                "error": "rate_limited",
                "route": route,
                "policy": policy,
                "retry_after_seconds": retry,
            });
            if let (Some(id), Some(fields)) = (request_id, body.as_object_mut()) {
                fields.insert("request_id".to_string(), id.into());
            }
            json(limited.status, body)
        }
        Some((template, content_type)) => {
            let body = template.render_for(retry, policy, route, request_id.unwrap_or_default());
            let mut r = Response::new(ResponseBody::full(body));
            *r.status_mut() = limited.status;
            r.headers_mut().insert(CONTENT_TYPE, content_type.clone());
            r
        }
    };
    *response.status_mut() = limited.status;
    let fields = response.headers_mut();
    headers.insert(fields, limits, true);
    fields.insert(RETRY_AFTER, number_value(retry));
    response
}

/// 405 with `Allow`: the path is routed, but not for this method (RFC 9110 §15.5.6, §10.2.1).
pub fn method_not_allowed(allow: &HeaderValue) -> Response<ResponseBody> {
    let mut response = json(
        StatusCode::METHOD_NOT_ALLOWED,
        serde_json::json!({
            "error": "method_not_allowed",
            "allow": allow.to_str().unwrap_or_default(),
        }),
    );
    response.headers_mut().insert(ALLOW, allow.clone());
    response
}

pub fn not_found() -> Response<ResponseBody> {
    json(
        StatusCode::NOT_FOUND,
        serde_json::json!({"error": "no_route", "message": "no route matches this request"}),
    )
}

pub fn bad_gateway(route: &str) -> Response<ResponseBody> {
    json(
        StatusCode::BAD_GATEWAY,
        serde_json::json!({"error": "upstream_unreachable", "route": route}),
    )
}

pub fn gateway_timeout(route: &str) -> Response<ResponseBody> {
    json(
        StatusCode::GATEWAY_TIMEOUT,
        serde_json::json!({"error": "upstream_timeout", "route": route}),
    )
}

pub fn payload_too_large(limit: u64) -> Response<ResponseBody> {
    json(
        StatusCode::PAYLOAD_TOO_LARGE,
        serde_json::json!({"error": "body_too_large", "max_body_bytes": limit}),
    )
}

/// 408: the client stopped sending its request body (`server.body_read_timeout`). hyper closes an
/// HTTP/1.1 connection whose request body was left unread, as RFC 9110 §15.5.9 expects.
pub fn request_timeout() -> Response<ResponseBody> {
    json(
        StatusCode::REQUEST_TIMEOUT,
        serde_json::json!({"error": "body_read_timeout"}),
    )
}

/// 503: every connection the upstream may have (`max_connections`) stayed busy for its
/// `pool_timeout`.
pub fn upstream_busy(route: &str) -> Response<ResponseBody> {
    json(
        StatusCode::SERVICE_UNAVAILABLE,
        serde_json::json!({"error": "upstream_busy", "route": route}),
    )
}

pub fn bad_request(message: &str) -> Response<ResponseBody> {
    json(
        StatusCode::BAD_REQUEST,
        serde_json::json!({"error": "bad_request", "message": message}),
    )
}

/// 503 when the store cannot decide and the route fails closed.
pub fn store_unavailable(route: &str, retry_after: u64) -> Response<ResponseBody> {
    let mut response = json(
        StatusCode::SERVICE_UNAVAILABLE,
        serde_json::json!({"error": "rate_limit_store_unavailable", "route": route, "retry_after_seconds": retry_after}),
    );
    response
        .headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(retry_after));
    response
}

#[cfg(test)]
mod tests {
    #[test]
    fn digits_read_as_the_number() {
        for n in [0, 1, 9, 10, 99, 100, 1_763_900_000_123_457, u64::MAX] {
            let mut buf = [0u8; 20];
            assert_eq!(super::digits(n, &mut buf), n.to_string().as_bytes());
        }
    }

    use super::*;

    #[test]
    fn number_values_read_as_the_numbers() {
        let mut numbers: Vec<u64> = (0..2100).collect();
        numbers.extend([9_999, 10_000, 1_000_000_000, u64::MAX - 1, u64::MAX]);
        for n in numbers {
            assert_eq!(number_value(n), HeaderValue::from(n), "{n}");
            assert_eq!(number_value(n).to_str().unwrap(), n.to_string());
        }
    }
}
