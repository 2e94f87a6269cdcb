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
use crate::config::CheckProxy;
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
    #[error("the check call lacks `{0}`, which `forward_auth.proxy: {1}` always sends")]
    Missing(HeaderName, &'static str),
    #[error(
        "the check call names the original request with both `{0}` and `{1}`: one of them may \
         come from the client; set `forward_auth.proxy`, or have the proxy clear the names it \
         does not set"
    )]
    Mixed(HeaderName, HeaderName),
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

/// The naming fields of one call, each taken out of its headers.
struct Names {
    forwarded_method: Option<HeaderValue>,
    forwarded_uri: Option<HeaderValue>,
    forwarded_host: Option<HeaderValue>,
    original_method: Option<HeaderValue>,
    original_uri: Option<HeaderValue>,
    original_url: Option<HeaderValue>,
}

/// Where the original request's method, target and host come from.
enum Source {
    /// Traefik, Caddy: `X-Forwarded-Method`, `-Uri`, `-Host`.
    Forwarded,
    /// nginx: `X-Original-Method`, `X-Original-URI`, and the call's `Host`.
    OriginalUri,
    /// ingress-nginx: `X-Original-Method`, and target and host from `X-Original-URL`.
    OriginalUrl,
}

/// The original request of a forward-auth call, from the headers its proxy sends:
///
/// | `forward_auth.proxy` | method | target | host |
/// |---|---|---|---|
/// | `traefik`, `caddy` | `X-Forwarded-Method` | `X-Forwarded-Uri` | `X-Forwarded-Host`, else `Host` |
/// | `nginx` | `X-Original-Method` | `X-Original-URI` | `Host` |
/// | `ingress-nginx` | `X-Original-Method` | path and query of `X-Original-URL` | its authority |
///
/// A named proxy's method and target fields must be there, and every other naming field is
/// ignored: the proxy sets its own names, and passes the client's others through. Unnamed
/// (`auto`), the call's fields choose the row, and a call that names the request in two rows is
/// refused ([`Malformed::Mixed`]): the proxy wrote one of them and the client the other, and
/// nothing in the call says which. Without a method field (`auto` only), the call's own method is
/// used.
///
/// Every naming field is removed, so no key can read it, and the other headers of the call are the
/// original request's, as the proxies forward them. The result is not yet canonical:
/// [`crate::admission::check`] normalises it as the gateway does.
pub fn original_request(
    call_method: &Method,
    mut headers: HeaderMap,
    proxy: CheckProxy,
) -> Result<Request<()>, Malformed> {
    let names = Names {
        forwarded_method: take(&mut headers, &X_FORWARDED_METHOD)?,
        forwarded_uri: take(&mut headers, &X_FORWARDED_URI)?,
        forwarded_host: take(&mut headers, &X_FORWARDED_HOST)?,
        original_method: take(&mut headers, &X_ORIGINAL_METHOD)?,
        original_uri: take(&mut headers, &X_ORIGINAL_URI)?,
        original_url: take(&mut headers, &X_ORIGINAL_URL)?,
    };
    let source = source(&names, proxy)?;
    let (method, method_name) = match source {
        Source::Forwarded => (names.forwarded_method, X_FORWARDED_METHOD),
        Source::OriginalUri | Source::OriginalUrl => (names.original_method, X_ORIGINAL_METHOD),
    };
    let method = match method {
        Some(value) => Method::from_bytes(value.as_bytes())
            .map_err(|_| Malformed::Invalid(method_name, "method"))?,
        None if proxy == CheckProxy::Auto => call_method.clone(),
        None => return Err(Malformed::Missing(method_name, proxy.name())),
    };
    let missing = |name: HeaderName| match proxy {
        CheckProxy::Auto => Malformed::NoUri,
        named => Malformed::Missing(name, named.name()),
    };
    let (target, host) = match source {
        Source::Forwarded => {
            let uri = names
                .forwarded_uri
                .ok_or_else(|| missing(X_FORWARDED_URI))?;
            (origin_form(&uri, X_FORWARDED_URI)?, names.forwarded_host)
        }
        Source::OriginalUri => {
            let uri = names.original_uri.ok_or_else(|| missing(X_ORIGINAL_URI))?;
            (origin_form(&uri, X_ORIGINAL_URI)?, None)
        }
        Source::OriginalUrl => {
            let value = names.original_url.ok_or_else(|| missing(X_ORIGINAL_URL))?;
            let url = Uri::try_from(value.as_bytes())
                .ok()
                .filter(|u| u.authority().is_some())
                .ok_or(Malformed::Invalid(X_ORIGINAL_URL, "absolute URL"))?;
            let target = url
                .path_and_query()
                .cloned()
                .unwrap_or_else(|| PathAndQuery::from_static("/"));
            let host = url
                .authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok());
            (target, host)
        }
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

/// Which fields name the request: the named proxy's, or (`auto`) the only family the call uses.
fn source(names: &Names, proxy: CheckProxy) -> Result<Source, Malformed> {
    match proxy {
        CheckProxy::Forwarded => return Ok(Source::Forwarded),
        CheckProxy::Nginx => return Ok(Source::OriginalUri),
        CheckProxy::IngressNginx => return Ok(Source::OriginalUrl),
        CheckProxy::Auto => {}
    }
    let forwarded = [
        (&names.forwarded_uri, X_FORWARDED_URI),
        (&names.forwarded_method, X_FORWARDED_METHOD),
    ]
    .into_iter()
    .find_map(|(v, n)| v.as_ref().map(|_| n));
    let original = [
        (&names.original_uri, X_ORIGINAL_URI),
        (&names.original_url, X_ORIGINAL_URL),
        (&names.original_method, X_ORIGINAL_METHOD),
    ]
    .into_iter()
    .find_map(|(v, n)| v.as_ref().map(|_| n));
    match (forwarded, original) {
        (Some(a), Some(b)) => Err(Malformed::Mixed(a, b)),
        (Some(_), None) => Ok(Source::Forwarded),
        (None, _) => match (&names.original_uri, &names.original_url) {
            (Some(_), Some(_)) => Err(Malformed::Mixed(X_ORIGINAL_URI, X_ORIGINAL_URL)),
            (None, Some(_)) => Ok(Source::OriginalUrl),
            (Some(_), None) => Ok(Source::OriginalUri),
            (None, None) => Err(Malformed::NoUri),
        },
    }
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
