//! The ingress door: an ingress proxy (nginx `auth_request`, ingress-nginx `auth-url`, Traefik
//! ForwardAuth, Caddy `forward_auth`) or Envoy (ext_authz) asks whether a request may pass, and
//! Turnstile answers exactly what its inline gateway would decide for that request.
//!
//! Each door is a protocol translation: [`http`] and [`grpc`] rebuild the original request, hand
//! it to [`crate::admission::check`] (the gateway's own routing, keys and engine), and turn the
//! answer back into their protocol. This module holds what both share: the original request and
//! how an answer is counted.
//!
//! The check listeners trust their peer (the ingress) for the original request line, so they must
//! never be reachable by clients (see `docs/ingress.md`).

pub mod grpc;
pub mod http;

use ::http::header::HOST;
use ::http::uri::PathAndQuery;
use ::http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Uri, Version};

use crate::admission::Checked;
use crate::limiter::Kind;
use crate::metrics::CheckResult;
use crate::respond::Refusal;

/// Traefik and Caddy: the original method, request target and host.
pub const X_FORWARDED_METHOD: HeaderName = HeaderName::from_static("x-forwarded-method");
pub const X_FORWARDED_URI: HeaderName = HeaderName::from_static("x-forwarded-uri");
pub const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
/// nginx `auth_request` (set in the recipe) and ingress-nginx.
pub const X_ORIGINAL_METHOD: HeaderName = HeaderName::from_static("x-original-method");
pub const X_ORIGINAL_URI: HeaderName = HeaderName::from_static("x-original-uri");
/// ingress-nginx: the whole original URL, scheme and host included.
pub const X_ORIGINAL_URL: HeaderName = HeaderName::from_static("x-original-url");

/// Why a check call does not describe a request: answered with 400.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Malformed {
    #[error(
        "the check call names no original request: send X-Forwarded-Uri (Traefik, Caddy), \
         X-Original-URI (nginx) or X-Original-URL (ingress-nginx)"
    )]
    NoUri,
    #[error("header `{0}` must be sent once")]
    Repeated(HeaderName),
    #[error("header `{0}` is not a valid {1}")]
    Invalid(HeaderName, &'static str),
}

/// Removes every `name` field; its value when there was exactly one.
fn take(headers: &mut HeaderMap, name: &HeaderName) -> Result<Option<HeaderValue>, Malformed> {
    if headers.get_all(name).iter().nth(1).is_some() {
        return Err(Malformed::Repeated(name.clone()));
    }
    Ok(headers.remove(name))
}

/// The original request of a forward-auth call, from the headers each proxy sends:
///
/// - method: `X-Forwarded-Method`, else `X-Original-Method`, else the call's own method;
/// - target: `X-Forwarded-Uri`, else `X-Original-URI`, else the path and query of
///   `X-Original-URL` (origin-form, RFC 9112 §3.2.1);
/// - host: `X-Forwarded-Host`, else the authority of `X-Original-URL`, else the call's `Host`;
/// - every other header of the call, as the proxies forward the original ones.
///
/// The naming headers are removed, so no key can read them. The result is not yet canonical:
/// [`crate::admission::check`] normalises it as the gateway does.
pub fn original_request(
    call_method: &Method,
    mut headers: HeaderMap,
) -> Result<Request<()>, Malformed> {
    let forwarded_method = take(&mut headers, &X_FORWARDED_METHOD)?;
    let original_method = take(&mut headers, &X_ORIGINAL_METHOD)?;
    let forwarded_uri = take(&mut headers, &X_FORWARDED_URI)?;
    let original_uri = take(&mut headers, &X_ORIGINAL_URI)?;
    let original_url = take(&mut headers, &X_ORIGINAL_URL)?;
    let forwarded_host = take(&mut headers, &X_FORWARDED_HOST)?;

    let method = match forwarded_method
        .as_ref()
        .map(|v| (X_FORWARDED_METHOD, v))
        .or(original_method.as_ref().map(|v| (X_ORIGINAL_METHOD, v)))
    {
        Some((name, value)) => {
            Method::from_bytes(value.as_bytes()).map_err(|_| Malformed::Invalid(name, "method"))?
        }
        None => call_method.clone(),
    };
    let url = match &original_url {
        Some(value) => Some(
            Uri::try_from(value.as_bytes())
                .ok()
                .filter(|u| u.authority().is_some())
                .ok_or(Malformed::Invalid(X_ORIGINAL_URL, "absolute URL"))?,
        ),
        None => None,
    };
    let target = match (forwarded_uri, original_uri) {
        (Some(v), _) => origin_form(&v, X_FORWARDED_URI)?,
        (None, Some(v)) => origin_form(&v, X_ORIGINAL_URI)?,
        (None, None) => match &url {
            Some(url) => url
                .path_and_query()
                .cloned()
                .unwrap_or_else(|| PathAndQuery::from_static("/")),
            None => return Err(Malformed::NoUri),
        },
    };
    let host = match (forwarded_host, &url) {
        (Some(host), _) => Some(host),
        (None, Some(url)) => url
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok()),
        (None, None) => None,
    };
    if let Some(host) = host {
        headers.insert(HOST, host);
    }
    let mut req = Request::new(());
    *req.method_mut() = method;
    *req.uri_mut() = Uri::from(target);
    *req.version_mut() = Version::HTTP_11;
    *req.headers_mut() = headers;
    Ok(req)
}

/// A request target header as an origin-form `path[?query]`.
fn origin_form(value: &HeaderValue, name: HeaderName) -> Result<PathAndQuery, Malformed> {
    if !value.as_bytes().starts_with(b"/") {
        return Err(Malformed::Invalid(name, "request target (`/path?query`)"));
    }
    PathAndQuery::try_from(value.as_bytes())
        .map_err(|_| Malformed::Invalid(name, "request target (`/path?query`)"))
}

/// How an answer is counted in `turnstile_door_checks_total`.
pub fn result_of(checked: &Checked<'_>) -> CheckResult {
    match checked {
        Checked::NoRoute => CheckResult::NoRoute,
        Checked::Admitted(_, a) if a.kind == Kind::FailedOpen => CheckResult::FailedOpen,
        Checked::Admitted(..) => CheckResult::Allowed,
        Checked::Refused(Refusal::RateLimited { .. }) => CheckResult::Limited,
        Checked::Refused(Refusal::StoreUnavailable(_)) => CheckResult::FailedClosed,
        Checked::Refused(Refusal::Unauthorized { .. }) => CheckResult::Unauthorized,
        Checked::Refused(_) => CheckResult::BadRequest,
    }
}

#[cfg(test)]
mod tests;
