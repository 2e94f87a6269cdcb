//! What a limited request gets back: `mode` (enforce or shadow), `rate_limit_headers` and
//! `limited_response`, a route's own or the server's.

use super::Errors;
use crate::config::limited::LimitedResponse;
use crate::config::raw::*;
use crate::config::snapshot::*;
use crate::rate_limit_headers::MAX_POLICIES;
use crate::rate_limit_headers::{HeaderMode, RateLimitHeaders};

/// `server.rate_limit_headers` and `server.limited_response`: what a route without its own uses.
pub(super) struct ResponseDefaults {
    headers: HeaderMode,
    limited: LimitedResponse,
}

pub(super) fn response_defaults(e: &mut Errors, raw: &RawServer) -> ResponseDefaults {
    ResponseDefaults {
        headers: raw
            .rate_limit_headers
            .as_deref()
            .and_then(|m| e.take("server.rate_limit_headers", HeaderMode::parse(m)))
            .unwrap_or_default(),
        limited: raw
            .limited_response
            .as_ref()
            .and_then(|r| limited_response(e, "server.limited_response", r))
            .unwrap_or_default(),
    }
}

fn limited_response(
    e: &mut Errors,
    path: &str,
    raw: &RawLimitedResponse,
) -> Option<LimitedResponse> {
    LimitedResponse::compile(raw.status, raw.body.as_deref(), raw.content_type.as_deref())
        .map_err(|problems| {
            for (field, message) in problems {
                e.add(format!("{path}.{field}"), message);
            }
        })
        .ok()
}

/// `enforce` or `shadow`: whether a route or policy only reports.
fn shadow_mode(e: &mut Errors, path: &str, text: Option<&str>) -> bool {
    match text {
        None | Some("enforce") => false,
        Some("shadow") => true,
        Some(other) => {
            e.add(
                path,
                format!("`{other}` is not a mode; expected `enforce` or `shadow`"),
            );
            false
        }
    }
}

/// A route's rollout mode and response settings: `mode` (its own and its policies'),
/// `rate_limit_headers` and `limited_response`, each defaulting to the server's.
pub(super) fn route_responses(
    e: &mut Errors,
    path: &str,
    raw: &RawRoute,
    route: &mut Route,
    defaults: &ResponseDefaults,
) {
    let route_shadow = shadow_mode(e, &format!("{path}.mode"), raw.mode.as_deref());
    for (j, raw_policy) in raw.policies.iter().enumerate() {
        let shadow = shadow_mode(
            e,
            &format!("{path}.policies[{j}].mode"),
            raw_policy.mode.as_deref(),
        );
        if let Some(policy) = route
            .policies
            .iter_mut()
            .find(|p| *p.name == *raw_policy.name)
        {
            policy.shadow = route_shadow || shadow;
            if policy.shadow && policy.max_delay_us.is_some() {
                e.add(
                    format!("{path}.policies[{j}].on_limit"),
                    "a shadow policy never refuses, so it cannot delay: leave out `on_limit: \
                     delay`, or enforce the policy",
                );
            }
        }
    }
    if route.policies.len() > MAX_POLICIES {
        e.add(
            format!("{path}.policies"),
            format!("a route may have at most {MAX_POLICIES} policies"),
        );
    }
    let mode = raw
        .rate_limit_headers
        .as_deref()
        .and_then(|m| e.take(format!("{path}.rate_limit_headers"), HeaderMode::parse(m)))
        .unwrap_or(defaults.headers);
    route.rate_limit_headers = RateLimitHeaders::new(
        mode,
        route.policies.iter().map(|p| (&*p.name, &p.rule, p.shadow)),
    );
    route.limited_response = match &raw.limited_response {
        Some(own) => {
            limited_response(e, &format!("{path}.limited_response"), own).unwrap_or_default()
        }
        None => defaults.limited.clone(),
    };
}
