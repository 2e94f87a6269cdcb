//! One route: its `match`, its action (`upstream` or `respond`), its path rewrite and its
//! policies.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderValue, Method, StatusCode};

use super::policies::policy;
use super::{failure_mode, header_pair, inflight, valid_name, Errors, NAME_HELP};
use crate::config::raw::*;
use crate::config::rewrite::{PathRewrite, RouteShape};
use crate::config::snapshot::*;
use crate::route::RouteMatch;

pub(super) fn route(
    e: &mut Errors,
    path: &str,
    raw: &RawRoute,
    upstreams: &HashMap<String, Option<Arc<Upstream>>>,
    default_mode: FailureMode,
    (jwt, jwt_block): (&Option<Arc<crate::jwt::Verifier>>, bool),
    ext_proc: bool,
) -> Option<Route> {
    if !valid_name(&raw.name) {
        e.add(format!("{path}.name"), NAME_HELP);
    }
    let (matcher, params) = route_match(e, path, &raw.matcher);
    // A bad `match` is reported once; its captures are unknown, so a rewrite is not judged.
    let rewrite = match matcher {
        Some(_) => path_rewrite(e, path, raw, &params),
        None => Some(None),
    };
    let action = match (&raw.upstream, &raw.respond) {
        (Some(name), None) => match upstreams.get(name) {
            Some(Some(up)) => Some(Action::Forward(up.clone())),
            Some(None) => None,
            None => {
                let mut known: Vec<&str> = upstreams.keys().map(String::as_str).collect();
                known.sort_unstable();
                let hint = if known.is_empty() {
                    "no upstreams are defined; add one under `upstreams:`".to_string()
                } else {
                    format!("defined: {}", known.join(", "))
                };
                e.add(
                    format!("{path}.upstream"),
                    format!("`{name}` is not defined under `upstreams` ({hint})"),
                );
                None
            }
        },
        (None, Some(respond)) => {
            direct_response(e, &format!("{path}.respond"), respond).map(Action::Respond)
        }
        (Some(_), Some(_)) => {
            e.add(path, "give either `upstream` or `respond`, not both");
            None
        }
        (None, None) => {
            e.warn(
                path,
                format!(
                    "route `{}` has neither `upstream` nor `respond`: a check-only route, decided \
                     by `forward_auth` only; the inline gateway answers it with 500",
                    raw.name
                ),
            );
            Some(Action::CheckOnly)
        }
    };
    let failure_mode = raw
        .failure_mode
        .as_deref()
        .and_then(|m| failure_mode(e, &format!("{path}.failure_mode"), m))
        .unwrap_or(default_mode);

    let mut policies = Vec::new();
    let mut names = HashMap::new();
    for (j, raw_policy) in raw.policies.iter().enumerate() {
        let ppath = format!("{path}.policies[{j}]");
        if let Some(first) = names.insert(raw_policy.name.as_str(), j) {
            e.add(
                format!("{ppath}.name"),
                format!(
                    "`{}` is already the name of policies[{first}]",
                    raw_policy.name
                ),
            );
        }
        if let Some(p) = policy(e, &ppath, &raw.name, raw_policy, &params, jwt_block) {
            inflight::check_door(e, &ppath, &p, action.as_ref(), ext_proc);
            policies.push(p);
        }
    }
    let require_jwt = raw.require_jwt.unwrap_or(false);
    if require_jwt && !jwt_block {
        e.add(
            format!("{path}.require_jwt"),
            "needs a top-level `jwt:` block with the keys that verify tokens (docs/jwt.md)",
        );
    }
    let needs_jwt = require_jwt || policies.iter().any(Policy::uses_jwt);
    Some(Route {
        name: raw.name.as_str().into(),
        matcher: matcher?,
        action: action?,
        policies,
        failure_mode,
        exempt: Exempt::default(),
        jwt: jwt.clone().filter(|_| needs_jwt),
        require_jwt,
        rate_limit_headers: Default::default(),
        limited_response: Default::default(),
        rewrite: rewrite?,
        quota_endpoint: quota_endpoint(e, path, raw, &params)?,
        max_waiting: super::pacing::max_waiting(e, path, raw),
    })
}

/// `quota_endpoint`: a path pattern whose captures are the route's own, in the same order (so a
/// `path:` key part reads the same value), on a route without a policy of the reserved name.
/// `Some(None)` when there is none; `None` on an error.
fn quota_endpoint(
    e: &mut Errors,
    path: &str,
    raw: &RawRoute,
    params: &[String],
) -> Option<Option<QuotaEndpoint>> {
    let Some(pattern) = &raw.quota_endpoint else {
        return Some(None);
    };
    let field = format!("{path}.quota_endpoint");
    let (mut matcher, names) = match RouteMatch::with_pattern(pattern) {
        Ok(found) => found,
        Err(msg) => {
            e.add(field, msg);
            return None;
        }
    };
    if names != params {
        let list = |names: &[String]| {
            if names.is_empty() {
                "none".to_string()
            } else {
                names
                    .iter()
                    .map(|n| format!("{{{n}}}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        };
        e.add(
            field,
            format!(
                "its captures ({}) must be the route's own, in the same order ({}), so that its \
                 policies read the same key values",
                list(&names),
                list(params)
            ),
        );
        return None;
    }
    if raw.policies.iter().any(|p| p.name == QUOTA_ASK_POLICY) {
        e.add(
            field,
            format!(
                "the route has a policy named `{QUOTA_ASK_POLICY}`, the endpoint's own: rename it"
            ),
        );
        return None;
    }
    matcher.set_methods(vec![Method::GET, Method::HEAD]);
    if let Some(host) = &raw.matcher.host {
        matcher.set_host(host);
    }
    let rule = crate::limiter::Rule::TokenBucket(crate::limiter::TokenBucket {
        rate: QUOTA_ASK_RATE,
        burst: QUOTA_ASK_BURST,
    });
    let ask = Policy::new(
        &raw.name,
        QUOTA_ASK_POLICY,
        vec![crate::keys::KeyPart::ClientIp],
        rule,
        1,
    );
    Some(Some(QuotaEndpoint {
        path: pattern.clone(),
        matcher,
        ask,
    }))
}

/// `strip_prefix` or `rewrite`, checked against the route's `match` ([`crate::config::rewrite`]).
/// `Some(None)` when there is neither; `None` on an error.
fn path_rewrite(
    e: &mut Errors,
    path: &str,
    raw: &RawRoute,
    params: &[String],
) -> Option<Option<PathRewrite>> {
    let shape = RouteShape {
        literal_start: match (&raw.matcher.path, &raw.matcher.prefix) {
            (Some(pattern), _) => pattern.split('{').next(),
            (None, Some(prefix)) => Some(prefix.as_str()),
            (None, None) => None,
        },
        pattern: raw.matcher.path.is_some(),
        captures: params,
    };
    let (field, result) = match (&raw.strip_prefix, &raw.rewrite) {
        (None, None) => return Some(None),
        (Some(_), Some(_)) => {
            e.add(path, "give either `strip_prefix` or `rewrite`, not both");
            return None;
        }
        (Some(prefix), None) => ("strip_prefix", PathRewrite::strip_prefix(prefix, shape)),
        (None, Some(template)) => ("rewrite", PathRewrite::template(template, shape)),
    };
    if raw.upstream.is_none() {
        e.add(
            format!("{path}.{field}"),
            "only a route with an `upstream` forwards a path",
        );
        return None;
    }
    e.take(format!("{path}.{field}"), result).map(Some)
}

fn route_match(e: &mut Errors, path: &str, raw: &RawMatch) -> (Option<RouteMatch>, Vec<String>) {
    let (matcher, params) = match (&raw.path, &raw.prefix) {
        (Some(pattern), None) => match RouteMatch::with_pattern(pattern) {
            Ok((m, names)) => (Some(m), names),
            Err(msg) => {
                e.add(format!("{path}.match.path"), msg);
                (None, Vec::new())
            }
        },
        (None, Some(prefix)) => (
            e.take(
                format!("{path}.match.prefix"),
                RouteMatch::with_prefix(prefix),
            ),
            Vec::new(),
        ),
        (None, None) => (Some(RouteMatch::default()), Vec::new()),
        (Some(_), Some(_)) => {
            e.add(
                format!("{path}.match"),
                "give either `path` or `prefix`, not both",
            );
            (None, Vec::new())
        }
    };
    let mut matcher = matcher;
    if let Some(m) = matcher.as_mut() {
        if let Some(methods) = &raw.methods {
            let mut parsed = Vec::new();
            for (k, text) in methods.iter().enumerate() {
                let upper = text.to_ascii_uppercase();
                parsed.extend(
                    e.take(
                        format!("{path}.match.methods[{k}]"),
                        Method::from_bytes(upper.as_bytes())
                            .map_err(|_| format!("`{text}` is not an HTTP method")),
                    ),
                );
            }
            m.set_methods(parsed);
        }
        if let Some(host) = &raw.host {
            m.set_host(host);
        }
        for (name, value) in &raw.headers {
            let hpath = format!("{path}.match.headers.{name}");
            if let Some((n, v)) = header_pair(e, &hpath, name, value) {
                m.add_header(n, v);
            }
        }
    }
    (matcher, params)
}

fn direct_response(e: &mut Errors, path: &str, raw: &RawRespond) -> Option<DirectResponse> {
    let status = e.take(
        format!("{path}.status"),
        StatusCode::from_u16(raw.status)
            .map_err(|_| format!("`{}` is not an HTTP status (100-999)", raw.status)),
    )?;
    let content_type = raw
        .content_type
        .as_deref()
        .unwrap_or("text/plain; charset=utf-8");
    let content_type = e.take(
        format!("{path}.content_type"),
        HeaderValue::from_str(content_type).map_err(|_| "not a valid header value".to_string()),
    )?;
    Some(DirectResponse {
        status,
        body: Bytes::from(raw.body.clone()),
        content_type,
    })
}
