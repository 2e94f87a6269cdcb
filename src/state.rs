//! What every listener shares: the config with its runtime resources attached, the decision
//! engine, and the metrics registry. The public listener, the admin listener and the Envoy service
//! all hold an `Arc<AppState>`; none reaches another door's type.

use std::collections::HashMap;
use std::sync::Arc;

use arc_swap::ArcSwap;

use crate::config::rls::settings::RlsSnapshot;
use crate::config::rls::tree::RuleId;
use crate::config::{Action, ReloadStatus, Snapshot};
use crate::limiter::Engine;
use crate::metrics::rls::{RlsMetricVecs, RuleMetrics};
use crate::metrics::{Metrics, PolicyMetrics, RouteMetrics};
use crate::proxy::balance::Balancer;

/// Shared by every connection of every listener.
#[derive(Debug)]
pub struct AppState {
    /// The running config and its resources, swapped whole on reload.
    pub live: ArcSwap<Live>,
    pub engine: Engine,
    pub metrics: Metrics,
    /// The last reload attempt's outcome, for `/config` on the admin listener.
    pub reload_status: std::sync::Mutex<ReloadStatus>,
    /// Per-key overrides from the file and the admin API (`crate::overrides`).
    pub overrides: crate::overrides::Overrides,
    /// Where every door's request lines go (`access_log:`, read at start); off by default.
    pub access_log: crate::access_log::AccessLog,
    /// Spans per request (`tracing:`, read at start); off by default.
    pub tracing: crate::otel::Tracing,
    /// Requests admitted for later, waiting for their slot (`on_limit: delay`).
    pub waiters: crate::pacing::Waiters,
}

impl AppState {
    pub fn new(live: Live, engine: Engine, metrics: Metrics) -> Self {
        AppState {
            live: ArcSwap::from_pointee(live),
            engine,
            metrics,
            reload_status: std::sync::Mutex::default(),
            overrides: crate::overrides::Overrides::default(),
            access_log: crate::access_log::AccessLog::off(),
            tracing: crate::otel::Tracing::off(),
            waiters: crate::pacing::Waiters::default(),
        }
    }

    /// Rebuilds the overrides in force from the live config and the API's (after a reload or a
    /// change through the API).
    pub fn rebuild_overrides(&self) {
        self.overrides
            .rebuild(&self.live.load().config, &self.engine);
    }

    /// One refresh of the shared overrides from Redis (a no-op on the in-process store).
    pub async fn refresh_overrides(&self) {
        if let crate::limiter::Store::Redis(store) = self.engine.store() {
            if self.overrides.fetch(store).await {
                self.rebuild_overrides();
            }
        }
    }
}

/// Keeps this instance's copy of Redis's overrides current until the state is dropped: one small
/// call every [`crate::overrides::SYNC_EVERY`], which returns the entries only when their version
/// changed.
pub async fn sync_overrides(state: std::sync::Weak<AppState>) {
    let mut tick = tokio::time::interval(crate::overrides::SYNC_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(state) = state.upgrade() else {
            return;
        };
        state.refresh_overrides().await;
    }
}

/// A config snapshot (plain data) and the resources it needs to run: connection pools and metric
/// handles, resolved once per load so the hot path never builds a label or a pool.
#[derive(Debug)]
pub struct Live {
    pub config: Snapshot,
    /// One per route of `config.routes`, in the same order.
    pub routes: Vec<RouteResources>,
    /// `config.routes` indexed for routing (`crate::route::RouteTable`).
    pub table: crate::route::RouteTable,
    /// Requests that matched no route.
    pub unmatched: RouteMetrics,
    /// Present exactly when `config.rls` is.
    pub rls: Option<RlsResources>,
    /// The routes with a `quota_endpoint`, by index, in config order: the gateway tries their
    /// endpoints before routing (empty, the usual case: one length check per request).
    pub quota_routes: Vec<usize>,
}

/// The resources of one route.
#[derive(Debug)]
pub struct RouteResources {
    pub metrics: RouteMetrics,
    /// One per policy of the route, in the same order.
    pub policies: Vec<PolicyMetrics>,
    /// The targets (each with its pool) of the route's upstream, shared with every route
    /// forwarding there; `None` for a `respond:` route.
    pub client: Option<Arc<Balancer>>,
    /// The decisions of its quota endpoint's own limit (`policy="quota_endpoint"`), if it has one.
    pub quota_ask: Option<PolicyMetrics>,
}

impl RouteResources {
    /// Exports the route's series and its policies', every one at 0, on its first request: a
    /// route that has seen one shows every outcome, one never used shows none. After that, one
    /// atomic load.
    #[inline]
    pub fn register_metrics(&self) {
        if self.metrics.registered() {
            return;
        }
        for policy in &self.policies {
            policy.register();
        }
        self.metrics.register();
    }
}

/// A config with at most this many routes exports every route's series from startup, at 0, so
/// that every rate has a starting sample; a larger one exports a route's series from its first
/// request, so `/metrics` grows with the routes in use rather than with the routes configured.
pub const EAGER_METRICS_ROUTES: usize = 256;

impl Live {
    /// Attaches the resources `config` needs: one connection pool per upstream (rebuilt on every
    /// load; in-flight requests drain the old ones) and every metric handle, exported at once
    /// (up to [`EAGER_METRICS_ROUTES`] routes) or from its route's first request.
    pub fn attach(config: Snapshot, metrics: &Metrics) -> Live {
        let mut clients: HashMap<&str, Arc<Balancer>> = HashMap::new();
        let routes: Vec<RouteResources> = config
            .routes
            .iter()
            .map(|route| {
                let client = match &route.action {
                    Action::Forward(up) => Some(
                        clients
                            .entry(up.name.as_str())
                            .or_insert_with(|| Arc::new(Balancer::new(up, metrics)))
                            .clone(),
                    ),
                    Action::Respond(_) | Action::CheckOnly => None,
                };
                RouteResources {
                    metrics: metrics.route(&route.name),
                    policies: route
                        .policies
                        .iter()
                        .map(|p| {
                            let m = metrics.policy(&route.name, &p.name);
                            match p.rule {
                                crate::limiter::Rule::Quota(_) => m.with_quota_units(),
                                _ => m,
                            }
                        })
                        .collect(),
                    client,
                    quota_ask: route
                        .quota_endpoint
                        .as_ref()
                        .map(|q| metrics.policy(&route.name, &q.ask.name)),
                }
            })
            .collect();
        drop(clients);
        if routes.len() <= EAGER_METRICS_ROUTES {
            routes.iter().for_each(RouteResources::register_metrics);
        }
        let rls = config
            .rls
            .as_ref()
            .map(|rls| RlsResources::attach(rls, metrics));
        Live {
            quota_routes: (config.routes.iter().enumerate())
                .filter(|(_, r)| r.quota_endpoint.is_some())
                .map(|(i, _)| i)
                .collect(),
            table: crate::route::RouteTable::new(config.routes.iter().map(|r| &r.matcher)),
            routes,
            unmatched: {
                let unmatched = metrics.route("unmatched");
                unmatched.register();
                unmatched
            },
            rls,
            config,
        }
    }
}

/// The metric handles of the Envoy service's part of a snapshot
/// ([`crate::config::rls::settings::RlsSnapshot`]), attached by `server.rs` at each (re)load.
#[derive(Debug)]
pub struct RlsResources {
    pub(crate) vecs: RlsMetricVecs,
    /// Per rule of the tree, resolved at load when its label needs no request value.
    rules: Vec<Option<RuleMetrics>>,
}

impl RlsResources {
    pub fn attach(rls: &RlsSnapshot, metrics: &Metrics) -> Self {
        let vecs = metrics.rls().clone();
        let rules = rls
            .tree
            .rules()
            .iter()
            .map(|rule| {
                rule.static_metric()
                    .map(|label| vecs.rule(&rule.domain, label))
            })
            .collect();
        RlsResources { vecs, rules }
    }

    pub(crate) fn rule(&self, id: RuleId) -> Option<&RuleMetrics> {
        self.rules.get(id.0 as usize).and_then(Option::as_ref)
    }
}
