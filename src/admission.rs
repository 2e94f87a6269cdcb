//! Admission: routing a canonical request and asking the engine about its keys, shared by every
//! door that decides HTTP requests (the inline gateway, forward-auth, Envoy ext_authz), so each
//! one answers exactly what the gateway would for the same request.
//!
//! A door canonicalizes the request ([`crate::normalize`]), finds its route ([`route_for`]) and
//! admits it ([`admit`]); [`check`] does all three for the doors that only decide.

use std::net::IpAddr;

use http::Request;

use crate::config::Route;
use crate::inflight::AfterAdmission;
use crate::keys::RequestView;
use crate::limiter::{Checks, Kind, Outcome, Rule, Tally};
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

/// The policies whose key parts are all present, decided together by the engine, for a door that
/// never sees the response (forward-auth, ext_authz): concurrency policies do not apply there,
/// and a cost from the response is charged up front as `max(fallback, min_cost)`.
pub async fn admit<'l>(
    state: &AppState,
    route: &'l Route,
    resources: &'l RouteResources,
    view: &RequestView<'_>,
) -> Result<Admitted, Refusal<'l>> {
    admit_with(state, route, resources, view, false)
        .await
        .map(|(admitted, _)| admitted)
}

/// [`admit`] for the inline gateway, which sees the response: concurrency policies take a lease,
/// and what must happen after admission (release it, charge the response's cost) is returned.
pub async fn admit_inline<'l>(
    state: &AppState,
    route: &'l Route,
    resources: &'l RouteResources,
    view: &RequestView<'_>,
) -> Result<(Admitted, AfterAdmission), Refusal<'l>> {
    admit_with(state, route, resources, view, true).await
}

async fn admit_with<'l>(
    state: &AppState,
    route: &'l Route,
    resources: &'l RouteResources,
    view: &RequestView<'_>,
    inline: bool,
) -> Result<(Admitted, AfterAdmission), Refusal<'l>> {
    // An exempt request skips every policy and consumes nothing (`exempt:`).
    if !route.exempt.is_empty() && route.exempt.matches(view.client_ip, view.headers) {
        resources.metrics.record_exempt();
        let admitted = Admitted {
            governing: None,
            kind: Kind::Allowed,
        };
        return Ok((admitted, AfterAdmission::default()));
    }
    let mut checks = Checks::with_capacity(route.policies.len());
    // Per-key overrides: a local copy, never a store call (`crate::overrides`).
    let overrides = state.overrides.active();
    // (pushed index, policy index) of the checks that need something after admission.
    let mut later: Vec<(usize, usize)> = Vec::new();
    for (j, (policy, metrics)) in route.policies.iter().zip(&resources.policies).enumerate() {
        let concurrency = matches!(policy.rule, Rule::Concurrency(_));
        if concurrency && !inline {
            continue;
        }
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
            let cost = match &policy.response_cost {
                Some(rc) if !inline => rc.total(None),
                _ => policy.cost,
            };
            let i = checks.push(key, rule, cost, false, tally);
            if inline && (concurrency || policy.response_cost.is_some()) {
                later.push((i, j));
            }
        }
    }
    let verdict = state.engine.decide(checks, route.failure_mode).await;
    let after = if later.is_empty() || !verdict.admits() {
        AfterAdmission::default()
    } else {
        AfterAdmission::new(route, &verdict, &later)
    };
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
        (kind @ (Kind::Allowed | Kind::FailedOpen), governing) => Ok((
            Admitted {
                governing: governing.map(|(_, o)| o),
                kind,
            },
            after,
        )),
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
