//! The gateway's own answers in gRPC's terms, for a request whose `content-type` is
//! `application/grpc` (or `application/grpc+proto`, `application/grpc-web`, ...).
//!
//! A gRPC client reads its call's outcome from `grpc-status`, not from the HTTP status: an HTTP
//! 429 is to it an `UNAVAILABLE` with no reason. So a refusal goes out as a gRPC "Trailers-Only"
//! response (gRPC over HTTP/2, `doc/PROTOCOL-HTTP2.md`): HTTP 200, one header block that ends the
//! stream, holding `grpc-status`, `grpc-message` and, when the client should wait,
//! `grpc-retry-pushback-ms` (gRFC A6, read by the client's own retry policy) beside `retry-after`.
//! The rate-limit fields and the request id stay as they are.
//!
//! Only a refusal's response is built here: the request has already been refused, so the check
//! of `content-type` costs nothing on an admitted request.

use http::header::{CONTENT_LENGTH, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};

use super::Refusal;
use crate::proxy::body::ResponseBody;

pub static GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
pub static GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
pub static GRPC_RETRY_PUSHBACK_MS: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

/// gRPC status codes the gateway answers with (`grpc/status.proto`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Code {
    InvalidArgument = 3,
    DeadlineExceeded = 4,
    ResourceExhausted = 8,
    Unimplemented = 12,
    Internal = 13,
    Unavailable = 14,
    Unauthenticated = 16,
}

/// Whether a request is a gRPC call: its `content-type` starts with `application/grpc`.
pub fn is_grpc(headers: &HeaderMap) -> bool {
    const GRPC: &[u8] = b"application/grpc";
    headers.get(CONTENT_TYPE).is_some_and(|v| {
        v.as_bytes()
            .get(..GRPC.len())
            .is_some_and(|start| start.eq_ignore_ascii_case(GRPC))
    })
}

/// The gRPC code of a refusal, and its message.
pub fn code(refusal: &Refusal<'_>) -> (Code, String) {
    match refusal {
        Refusal::BadRequest(message) => (Code::InvalidArgument, format!("bad request: {message}")),
        Refusal::NoRoute => (Code::Unimplemented, "no route matches this call".into()),
        Refusal::MethodNotAllowed(_) => (
            Code::Unimplemented,
            "the route does not take this method".into(),
        ),
        Refusal::BodyTooLarge(limit) => (
            Code::ResourceExhausted,
            format!("request larger than the gateway's limit of {limit} bytes"),
        ),
        Refusal::BodyReadTimeout => (
            Code::DeadlineExceeded,
            "the request's messages stopped arriving".into(),
        ),
        Refusal::RateLimited { route, policy, .. } => (
            Code::ResourceExhausted,
            format!("rate limited by policy {policy} of route {route}"),
        ),
        Refusal::StoreUnavailable(route) => (
            Code::Unavailable,
            format!("the rate limit store of route {route} is unavailable"),
        ),
        Refusal::UpstreamUnreachable(route) => (
            Code::Unavailable,
            format!("the upstream of route {route} is unreachable"),
        ),
        Refusal::UpstreamTimeout(route) => (
            Code::DeadlineExceeded,
            format!("the upstream of route {route} did not answer in time"),
        ),
        Refusal::CheckOnly(route) => (
            Code::Internal,
            format!("route {route} has no upstream: only forward_auth decides it"),
        ),
        Refusal::UpstreamBusy(route) => (
            Code::Unavailable,
            format!("every connection to the upstream of route {route} is busy"),
        ),
        Refusal::Unauthorized { missing, .. } => (
            Code::Unauthenticated,
            if *missing {
                "a bearer token is required".into()
            } else {
                "the bearer token is not valid".into()
            },
        ),
    }
}

/// How long the client should wait before it retries, in milliseconds, when it should.
fn pushback_ms(refusal: &Refusal<'_>) -> Option<u64> {
    match refusal {
        Refusal::RateLimited { outcome, .. } => Some(outcome.retry_after_us.div_ceil(1000).max(1)),
        Refusal::StoreUnavailable(_) => Some(super::STORE_DOWN_RETRY_SECONDS * 1000),
        _ => None,
    }
}

/// `response`, the gateway's HTTP answer to `refusal`, made the gRPC one: status 200, an empty
/// body (so one header block ends the stream), `grpc-status` and `grpc-message`, and the pushback.
/// Every other field the HTTP answer has (`retry-after`, the rate-limit fields, the request id)
/// is kept.
pub fn answer(refusal: &Refusal<'_>, response: Response<ResponseBody>) -> Response<ResponseBody> {
    let (mut parts, _json) = response.into_parts();
    parts.status = StatusCode::OK;
    let (code, message) = code(refusal);
    let fields = &mut parts.headers;
    fields.remove(CONTENT_LENGTH);
    fields.remove(http::header::WWW_AUTHENTICATE);
    fields.remove(http::header::ALLOW);
    fields.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    fields.insert(GRPC_STATUS.clone(), HeaderValue::from(code as u16));
    if let Ok(message) = HeaderValue::from_str(&percent_encode(&message)) {
        fields.insert(GRPC_MESSAGE.clone(), message);
    }
    if let Some(ms) = pushback_ms(refusal) {
        fields.insert(GRPC_RETRY_PUSHBACK_MS.clone(), HeaderValue::from(ms));
        if !fields.contains_key(RETRY_AFTER) {
            fields.insert(RETRY_AFTER, HeaderValue::from(ms.div_ceil(1000)));
        }
    }
    Response::from_parts(parts, ResponseBody::empty())
}

/// `grpc-message` is percent-encoded UTF-8: every byte outside printable ASCII, and `%`, as
/// `%XX` (`doc/PROTOCOL-HTTP2.md`).
fn percent_encode(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for &b in message.as_bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Outcome;

    #[test]
    fn grpc_content_types_are_recognised() {
        let mut h = HeaderMap::new();
        assert!(!is_grpc(&h));
        for (ct, grpc) in [
            ("application/grpc", true),
            ("application/grpc+proto", true),
            ("Application/GRPC-web", true),
            ("application/json", false),
            ("application/grp", false),
        ] {
            h.insert(CONTENT_TYPE, HeaderValue::from_static(ct));
            assert_eq!(is_grpc(&h), grpc, "{ct}");
        }
    }

    #[test]
    fn a_rate_limited_call_gets_resource_exhausted_with_the_pushback() {
        let outcome = Outcome {
            allowed: false,
            limit: 3,
            remaining: 0,
            reset_us: 2_500_000,
            retry_after_us: 2_400_001,
        };
        let headers = crate::respond::RateLimitHeaders::default();
        let limited = crate::respond::LimitedResponse::default();
        let refusal = Refusal::RateLimited {
            route: "greeter",
            policy: "calls",
            outcome,
            limits: Default::default(),
            headers: &headers,
            response: &limited,
        };
        let response = answer(&refusal, crate::respond::refusal(&refusal));
        assert_eq!(response.status(), StatusCode::OK);
        let h = response.headers();
        assert_eq!(h["content-type"], "application/grpc");
        assert_eq!(h["grpc-status"], "8");
        assert_eq!(
            h["grpc-message"],
            "rate limited by policy calls of route greeter"
        );
        assert_eq!(h["grpc-retry-pushback-ms"], "2401");
        assert_eq!(h["retry-after"], "3");
        assert!(http_body::Body::is_end_stream(response.body()));
    }

    #[test]
    fn upstream_failures_map_to_their_codes() {
        assert_eq!(
            code(&Refusal::UpstreamTimeout("r")).0,
            Code::DeadlineExceeded
        );
        assert_eq!(
            code(&Refusal::UpstreamUnreachable("r")).0,
            Code::Unavailable
        );
        assert_eq!(code(&Refusal::UpstreamBusy("r")).0, Code::Unavailable);
        assert_eq!(code(&Refusal::NoRoute).0, Code::Unimplemented);
    }

    #[test]
    fn messages_are_percent_encoded() {
        assert_eq!(percent_encode("a 100% é"), "a 100%25 %C3%A9");
    }
}
