//! Every response the gateway writes itself, in one place: the rate-limit headers and the JSON
//! error bodies. Adapters never format these on their own.

use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};

use crate::limiter::Outcome;
use crate::proxy::body::ResponseBody;

pub static X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
pub static X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
pub static X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// Whole seconds, rounded up.
pub fn ceil_seconds(us: u64) -> u64 {
    us.div_ceil(1_000_000)
}

/// `X-RateLimit-Limit`, `-Remaining` and `-Reset` (delta seconds) for the governing outcome.
pub fn insert_rate_limit_headers(headers: &mut HeaderMap, outcome: &Outcome) {
    headers.insert(X_RATELIMIT_LIMIT.clone(), HeaderValue::from(outcome.limit));
    headers.insert(
        X_RATELIMIT_REMAINING.clone(),
        HeaderValue::from(outcome.remaining),
    );
    headers.insert(
        X_RATELIMIT_RESET.clone(),
        HeaderValue::from(ceil_seconds(outcome.reset_us)),
    );
}

/// `Retry-After` in whole seconds, at least 1: the time until the request could succeed.
pub fn retry_after_seconds(outcome: &Outcome) -> u64 {
    ceil_seconds(outcome.retry_after_us).max(1)
}

fn json(status: StatusCode, body: serde_json::Value) -> Response<ResponseBody> {
    let mut response = Response::new(ResponseBody::full(body.to_string()));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// 429: names the route and policy, and says when to come back.
pub fn rate_limited(route: &str, policy: &str, outcome: &Outcome) -> Response<ResponseBody> {
    let retry = retry_after_seconds(outcome);
    let mut response = json(
        StatusCode::TOO_MANY_REQUESTS,
        serde_json::json!({
            "error": "rate_limited",
            "route": route,
            "policy": policy,
            "retry_after_seconds": retry,
        }),
    );
    let headers = response.headers_mut();
    insert_rate_limit_headers(
        headers,
        &Outcome {
            remaining: 0,
            ..*outcome
        },
    );
    headers.insert(RETRY_AFTER, HeaderValue::from(retry));
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
