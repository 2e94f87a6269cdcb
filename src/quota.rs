//! Reading counters without consuming: a route's quota endpoint on the public listener (a client
//! asks for its own remaining quota) and the status page's "why was I limited?" lookup on the
//! admin listener. Both name one counter key per policy and ask the engine for a peek
//! ([`crate::limiter::Engine::peek`]), which reports each policy's state as a decision would and
//! writes nothing.
//!
//! The quota endpoint derives its keys from the asking request with the route's own key
//! extraction (`Policy::counter_key`), so a client sees exactly the counters its requests would
//! spend, no other. Each ask takes one token of the endpoint's own bucket on the client's network
//! ([`crate::config::QUOTA_ASK_RATE`], [`crate::config::QUOTA_ASK_BURST`]): asking spends nothing
//! of the route's policies, and is limited itself.

use std::net::SocketAddr;

use http::header::{CACHE_CONTROL, CONTENT_TYPE};
use http::{HeaderValue, Request, Response, StatusCode};
use serde_json::{json, Value};

use crate::config::{Policy, Route};
use crate::keys::RequestView;
use crate::limiter::{Checks, Kind, Outcome, Rule, StoreError, Tally};
use crate::proxy::body::ResponseBody;
use crate::rate_limit_headers::{ceil_seconds, retry_after_seconds, HeaderMode, Limits};
use crate::respond::{self, Refusal};
use crate::route::{PathParams, RequestHead};
use crate::state::{AppState, Live};

/// One policy's part in a peek.
#[derive(Debug)]
pub struct PolicyState<'r> {
    pub policy: &'r Policy,
    /// The counter key peeked; `None` when a key part is absent (the policy does not apply).
    pub key: Option<String>,
    /// Its state; `None` when the policy does not apply.
    pub outcome: Option<Outcome>,
    /// An override (file or API) gave this key its own numbers.
    pub overridden: bool,
}

/// Peeks `route`'s policies at `keys` (one counter key per policy, in order; `None` where it
/// does not apply), under the overrides in force, as a decision of one request would see them.
pub async fn peek<'r>(
    state: &AppState,
    route: &'r Route,
    resources: &crate::state::RouteResources,
    keys: Vec<Option<String>>,
) -> Result<Vec<PolicyState<'r>>, StoreError> {
    let overrides = state.overrides.active();
    let rules: Vec<Option<(Rule, bool)>> = keys
        .iter()
        .zip(&route.policies)
        .map(|(key, policy)| {
            let key = key.as_deref()?;
            Some(match overrides.rule(key) {
                Some(rule) => (*rule, true),
                None => (policy.rule, false),
            })
        })
        .collect();
    drop(overrides);
    let mut checks = Checks::with_capacity(route.policies.len());
    let mut pushed = Vec::with_capacity(route.policies.len());
    for (((policy, metrics), key), rule) in route
        .policies
        .iter()
        .zip(&resources.policies)
        .zip(&keys)
        .zip(&rules)
    {
        let (Some(key), Some((rule, _))) = (key, rule) else {
            pushed.push(None);
            continue;
        };
        // A peek is never counted: the tally only satisfies the engine's list.
        let tally = Tally::Policy {
            metrics,
            route: &route.name,
            policy: &policy.name,
            prefix: policy.key_prefix(),
        };
        pushed.push(Some(checks.push(
            key.as_str(),
            rule,
            policy.cost,
            policy.shadow,
            tally,
        )));
    }
    let verdict = state.engine.peek(checks).await?;
    Ok(route
        .policies
        .iter()
        .zip(keys.iter())
        .zip(pushed)
        .zip(&rules)
        .map(|(((policy, key), index), rule)| PolicyState {
            policy,
            key: key.clone(),
            outcome: index.and_then(|i| verdict.outcome(i).copied()),
            overridden: rule.is_some_and(|(_, o)| o),
        })
        .collect())
}

/// The algorithm of `rule` and its numbers, as the config writes them.
pub fn describe(rule: &Rule) -> (&'static str, String) {
    match rule {
        Rule::TokenBucket(tb) => {
            // In the largest unit that shows at least one token, as a config would write it.
            let (per, unit) = [(1.0, "s"), (60.0, "m"), (3600.0, "h")]
                .into_iter()
                .find(|(seconds, _)| tb.rate * seconds >= 0.999)
                .unwrap_or((86400.0, "d"));
            let text = format!("{:.3}", tb.rate * per);
            let n = text.trim_end_matches('0').trim_end_matches('.');
            ("token_bucket", format!("{n}/{unit}, burst {}", tb.burst))
        }
        Rule::SlidingWindow(sw) => (
            "sliding_window",
            format!(
                "{} per {}s{}",
                sw.limit,
                sw.window_us as f64 / 1e6,
                if sw.buckets > 0 {
                    format!(", {} buckets", sw.buckets)
                } else {
                    String::new()
                }
            ),
        ),
        Rule::Quota(q) => (
            "quota",
            format!(
                "{} per {} ({})",
                q.limit,
                q.per.as_str(),
                q.time_zone.name()
            ),
        ),
        Rule::Concurrency(cc) => ("concurrency", format!("{} in flight", cc.limit)),
    }
}

/// One policy's line in a peek's JSON: what it is and, when it applies, its state.
pub fn state_json(s: &PolicyState<'_>) -> Value {
    let (algorithm, _) = describe(&s.policy.rule);
    let mut line = json!({
        "policy": &*s.policy.name,
        "algorithm": algorithm,
        "mode": if s.policy.shadow { "shadow" } else { "enforce" },
        "applies": s.outcome.is_some(),
    });
    if let (Some(o), Some(map)) = (s.outcome, line.as_object_mut()) {
        map.insert("limit".into(), o.limit.into());
        map.insert("remaining".into(), o.remaining.into());
        map.insert("reset_seconds".into(), ceil_seconds(o.reset_us).into());
        map.insert("reset_us".into(), o.reset_us.into());
        map.insert("next_allowed".into(), o.allowed.into());
        let retry = if o.allowed {
            0
        } else {
            retry_after_seconds(&o)
        };
        map.insert("retry_after_seconds".into(), retry.into());
        map.insert("overridden".into(), s.overridden.into());
    }
    line
}

/// The route whose quota endpoint `head` asks for, with the endpoint's captures: the first of
/// `live.quota_routes` in config order.
pub fn endpoint_for(live: &Live, head: &RequestHead<'_>) -> Option<(usize, PathParams)> {
    live.quota_routes.iter().find_map(|&i| {
        let endpoint = live.config.routes.get(i)?.quota_endpoint.as_ref()?;
        Some((i, endpoint.matcher.matches(head)?))
    })
}

/// Answers an ask of route `index`'s quota endpoint: 200 with the client's state of every policy
/// in a JSON body and the IETF `RateLimit-Policy` and `RateLimit` fields of the policy that
/// governs (the one a request would be refused by, else the one with the least remaining); 429
/// when the asks themselves are over their limit; 401, 400 and 503 as a request of the route
/// would get them.
pub async fn answer<B>(
    state: &AppState,
    live: &Live,
    index: usize,
    params: &PathParams,
    peer: SocketAddr,
    req: &Request<B>,
    host: Option<&str>,
) -> Response<ResponseBody> {
    let (Some(route), Some(resources)) = (live.config.routes.get(index), live.routes.get(index))
    else {
        return respond::not_found();
    };
    let Some(endpoint) = route.quota_endpoint.as_ref() else {
        return respond::not_found();
    };
    resources.register_metrics();
    let view = RequestView {
        method: req.method(),
        host,
        path: req.uri().path(),
        query: req.uri().query(),
        headers: req.headers(),
        params,
        client_ip: live
            .config
            .trusted_proxies
            .client_ip(peer.ip().to_canonical(), req.headers()),
        client_prefix: live.config.client_prefix,
        // A quota ask is a GET: a policy keyed on the body sees its part absent.
        body: None,
        // Only a listener with a client CA hands requests a certificate.
        client_cert: if live.config.asks_client_cert() {
            req.extensions()
                .get::<std::sync::Arc<crate::client_cert::ClientCert>>()
                .map(|c| &**c)
        } else {
            None
        },
    };
    if let Some(refused) = take_ask(state, route, resources, &endpoint.ask, &view).await {
        return refused;
    }
    let claims = match route.jwt.as_ref().map(|jwt| jwt.verify(view.headers)) {
        Some(Ok(claims)) => Some(claims),
        Some(Err(rejected)) if route.require_jwt => {
            return respond::unauthorized(&route.name, rejected == crate::jwt::Rejected::Missing)
        }
        _ => None,
    };
    let head_only = req.method() == http::Method::HEAD;
    if !route.exempt.is_empty() && route.exempt.matches(view.client_ip, view.headers) {
        let body = json!({ "route": &*route.name, "exempt": true, "policies": [] });
        return ok(body, head_only);
    }
    let mut keys = Vec::with_capacity(route.policies.len());
    for policy in &route.policies {
        match policy.counter_key(&view, claims.as_deref()) {
            Ok(key) => keys.push(key),
            Err(e) => return respond::bad_request(&e.to_string()),
        }
    }
    let states = match peek(state, route, resources, keys).await {
        Ok(states) => states,
        Err(_) => return respond::refusal(&Refusal::StoreUnavailable(&route.name)),
    };
    let limits = governing(&states);
    let body = json!({
        "route": &*route.name,
        "exempt": false,
        "policies": states.iter().map(state_json).collect::<Vec<_>>(),
    });
    let mut response = ok(body, head_only);
    let mut fields = route.rate_limit_headers.clone();
    fields.mode = HeaderMode::Ietf;
    let limited = limits.governing.is_some_and(|(_, o)| !o.allowed);
    fields.insert(response.headers_mut(), &limits, limited);
    response
}

/// The enforced policies that apply, and the one that governs: among those that would refuse the
/// next request the one with the longest wait, else the one with the least remaining (the first
/// on a tie), as a decision picks it.
fn governing(states: &[PolicyState<'_>]) -> Limits {
    let mut applied = 0u64;
    let enforced = states.iter().enumerate().filter_map(|(i, s)| {
        let o = s.outcome?;
        (!s.policy.shadow && i < crate::rate_limit_headers::MAX_POLICIES).then_some((i, o))
    });
    let enforced: Vec<(usize, Outcome)> = enforced.collect();
    for &(i, _) in &enforced {
        applied |= 1 << i;
    }
    let refused = enforced
        .iter()
        .filter(|(_, o)| !o.allowed)
        .max_by_key(|(i, o)| (o.retry_after_us, std::cmp::Reverse(*i)));
    let governing = refused
        .or_else(|| enforced.iter().min_by_key(|(_, o)| o.remaining))
        .copied();
    Limits {
        governing,
        applied,
        delayed_us: 0,
    }
}

/// Takes one token of the endpoint's own bucket for the asking client's network; the response
/// to send instead when it is empty (429 with `Retry-After`) or the store cannot decide and the
/// route fails closed.
async fn take_ask(
    state: &AppState,
    route: &Route,
    resources: &crate::state::RouteResources,
    ask: &Policy,
    view: &RequestView<'_>,
) -> Option<Response<ResponseBody>> {
    let key = match ask.counter_key(view, None) {
        Ok(Some(key)) => key,
        // A client_ip key is always present.
        Ok(None) | Err(_) => return None,
    };
    let metrics = resources.quota_ask.as_ref()?;
    let mut checks = Checks::with_capacity(1);
    let tally = Tally::Policy {
        metrics,
        route: &route.name,
        policy: &ask.name,
        prefix: ask.key_prefix(),
    };
    let i = checks.push(key, &ask.rule, 1, false, tally);
    let verdict = state.engine.decide(checks, route.failure_mode).await;
    match verdict.kind {
        Kind::Allowed | Kind::FailedOpen => None,
        Kind::Limited => {
            let outcome = verdict.outcome(i).copied().unwrap_or(Outcome {
                allowed: false,
                limit: ask.rule.limit(),
                remaining: 0,
                reset_us: 0,
                retry_after_us: 1_000_000,
            });
            // `Retry-After` says when the next ask fits.
            Some(respond::refusal(&Refusal::RateLimited {
                route: &route.name,
                policy: &ask.name,
                outcome,
                limits: Limits::default(),
                headers: &route.rate_limit_headers,
                response: &route.limited_response,
            }))
        }
        Kind::FailedClosed | Kind::Failed => {
            Some(respond::refusal(&Refusal::StoreUnavailable(&route.name)))
        }
    }
}

fn ok(body: Value, head_only: bool) -> Response<ResponseBody> {
    let text = if head_only {
        String::new()
    } else {
        body.to_string()
    };
    let mut response = Response::new(ResponseBody::full(text));
    *response.status_mut() = StatusCode::OK;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    // The state changes with every request: never a cached answer.
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}
