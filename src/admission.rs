//! Admission: routing a canonical request and asking the engine about its keys, shared by every
//! door that decides HTTP requests (the inline gateway, forward-auth, Envoy ext_authz), so each
//! one answers exactly what the gateway would for the same request.
//!
//! A door canonicalizes the request ([`crate::normalize`]), finds its route ([`route_for`]) and
//! admits it ([`admit`]); [`check`] does all three for the doors that only decide.

use std::net::IpAddr;

use http::Request;

use crate::config::Route;
use crate::keys::RequestView;
use crate::limiter::{Checks, Kind, Outcome, Tally};
use crate::normalize;
use crate::respond::Refusal;
use crate::route::{PathParams, RequestHead};
use crate::state::{AppState, Live, RouteResources};

/// An admitted request: the outcome whose headers decorate the answer (none when no policy
/// applied or the store failed open), and how the engine decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admitted {
    pub governing: Option<Outcome>,
    pub kind: Kind,
}

/// The first route matching `head`, by index into `live.config.routes`, with its path params.
pub fn route_for(live: &Live, head: &RequestHead<'_>) -> Option<(usize, PathParams)> {
    live.config
        .routes
        .iter()
        .enumerate()
        .find_map(|(i, r)| r.matcher.matches(head).map(|p| (i, p)))
}

/// The policies whose key parts are all present, decided together by the engine.
pub async fn admit<'l>(
    state: &AppState,
    route: &'l Route,
    resources: &'l RouteResources,
    view: &RequestView<'_>,
) -> Result<Admitted, Refusal<'l>> {
    // An exempt request skips every policy and consumes nothing (`exempt:`).
    if !route.exempt.is_empty() && route.exempt.matches(view.client_ip, view.headers) {
        resources.metrics.record_exempt();
        return Ok(Admitted {
            governing: None,
            kind: Kind::Allowed,
        });
    }
    let mut checks = Checks::with_capacity(route.policies.len());
    // Per-key overrides: a local copy, never a store call (`crate::overrides`).
    let overrides = state.overrides.active();
    for (policy, metrics) in route.policies.iter().zip(&resources.policies) {
        // A key header or query parameter sent twice is ambiguous: 400.
        let key = policy
            .counter_key(view)
            .map_err(|e| Refusal::BadRequest(e.to_string()))?;
        if let Some(key) = key {
            let tally = Tally::Policy {
                metrics,
                route: &route.name,
                policy: &policy.name,
                prefix: policy.key_prefix(),
            };
            let rule = overrides.rule(&key).unwrap_or(&policy.rule);
            checks.push(key, rule, policy.cost, false, tally);
        }
    }
    let verdict = state.engine.decide(checks, route.failure_mode).await;
    let governing = verdict.governing().map(|(i, o)| (i, *o));
    match (verdict.kind, governing) {
        (Kind::Limited, Some((i, outcome))) => Err(Refusal::RateLimited {
            route: &route.name,
            // The route's own name (the verdict's borrows end with the overrides' guard).
            policy: match verdict.tally(i) {
                Some(Tally::Policy { policy, .. }) => route
                    .policies
                    .iter()
                    .find(|p| *p.name == *policy)
                    .map_or("", |p| &p.name),
                _ => "",
            },
            outcome,
        }),
        // (A limited verdict always has an enforced refusal to govern; routes never use `Error`.)
        (Kind::FailedClosed | Kind::Failed | Kind::Limited, _) => {
            Err(Refusal::StoreUnavailable(&route.name))
        }
        (kind @ (Kind::Allowed | Kind::FailedOpen), governing) => Ok(Admitted {
            governing: governing.map(|(_, o)| o),
            kind,
        }),
    }
}

/// What a deciding door learns about a request.
#[derive(Debug)]
pub enum Checked<'l> {
    /// No route matches: nothing applies.
    NoRoute,
    Admitted(&'l Route, Admitted),
    Refused(Refusal<'l>),
}

/// Canonicalizes `req`, routes it and admits it, as the gateway does, with `peer` as the
/// connection's address for `client_ip.trusted_proxies`. The body is never read.
pub async fn check<'l, B>(
    state: &AppState,
    live: &'l Live,
    req: &mut Request<B>,
    peer: IpAddr,
) -> Checked<'l> {
    if let Err(e) = normalize::canonicalize(req, live.config.server.paths) {
        return Checked::Refused(Refusal::BadRequest(e.to_string()));
    }
    let head = RequestHead {
        method: req.method(),
        host: normalize::host::host(req.headers()),
        path: req.uri().path(),
        headers: req.headers(),
    };
    let Some((index, params)) = route_for(live, &head) else {
        return Checked::NoRoute;
    };
    let route = &live.config.routes[index];
    let view = RequestView {
        method: req.method(),
        host: head.host,
        path: req.uri().path(),
        query: req.uri().query(),
        headers: req.headers(),
        params: &params,
        client_ip: live
            .config
            .trusted_proxies
            .client_ip(peer.to_canonical(), req.headers()),
        client_prefix: live.config.client_prefix,
    };
    match admit(state, route, &live.routes[index], &view).await {
        Ok(admitted) => Checked::Admitted(route, admitted),
        Err(refusal) => Checked::Refused(refusal),
    }
}
