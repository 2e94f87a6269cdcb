//! Per-key overrides: another limit for one key value of one policy (a premium tenant), changed
//! without a restart.
//!
//! Two sources, layered: the `overrides:` file named by `policies.yaml` (validated with the
//! config, reloaded with it, and on its own change), and the admin API (`crate::admin`), which wins over
//! the file for the same key. With the Redis store the API's overrides live in Redis, so every
//! instance applies them: each keeps a local copy that a background task refreshes
//! (`crate::state::sync_overrides`, every [`SYNC_EVERY`]), and the hot path reads only that copy, so an override adds
//! no Redis round trip to any request. The price is staleness: an instance applies a change made
//! on another within one refresh interval (plus one Redis call).
//!
//! An override keeps the policy's algorithm, key and window or period; it changes the numbers
//! only (`limit`, or a bucket's `rate` and `burst`). The counter keeps its state: a tenant who
//! used 90 of 100 and gets 1000 has 910 left. An override naming the route [`RLQS_ROUTE`] sets
//! the `rate` and `burst` of one of the quota service's budgets for the bucket ids with the
//! `*` values it names; the service applies it at those buckets' next reports.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use arc_swap::{ArcSwap, Guard};
use serde::Serialize;

pub use crate::config::overrides::{
    load_file, resolve, resolve_any, rule_for, Invalid, Limits, Override, Resolved, MAX_KEY_BYTES,
    MAX_OVERRIDES, RLQS_ROUTE,
};
use crate::config::Snapshot;
use crate::limiter::quota::Budget;
use crate::limiter::redis::RedisStore;
use crate::limiter::{Engine, Rule};

/// How often an instance on the Redis store refreshes its copy of the shared overrides: the bound
/// on how long another instance's change takes to apply here.
pub const SYNC_EVERY: Duration = Duration::from_millis(250);

/// The rules in force, by counter key: what admission reads on every request; and the quota
/// service's overridden budgets, which it reads on each usage report.
#[derive(Debug, Default)]
pub struct Table {
    rules: HashMap<Box<str>, Rule>,
    /// By `budget:key` ([`Resolved::Budget`]).
    budgets: HashMap<Box<str>, Budget>,
}

impl Table {
    /// The overridden budget of the quota service's budget `name` for the bucket ids whose `*`
    /// values are `key` ([`crate::config::rlqs::BudgetRule::override_key`]).
    pub fn budget(&self, name: &str, key: &str) -> Option<Budget> {
        if self.budgets.is_empty() {
            return None;
        }
        self.budgets.get(format!("{name}:{key}").as_str()).copied()
    }

    /// Whether any quota service budget is overridden (else no bucket id needs its key).
    pub fn has_budgets(&self) -> bool {
        !self.budgets.is_empty()
    }

    /// The override for `counter_key`, if any (no hashing at all while there are none).
    pub fn rule(&self, counter_key: &str) -> Option<&Rule> {
        if self.rules.is_empty() {
            return None;
        }
        self.rules.get(counter_key)
    }

    pub fn len(&self) -> usize {
        self.rules.len() + self.budgets.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty() && self.budgets.is_empty()
    }
}

/// Every instance's overrides: the API's (local, or this instance's copy of Redis's) and the
/// table in force, rebuilt from those and the live config's file overrides on every change.
#[derive(Debug, Default)]
pub struct Overrides {
    active: ArcSwap<Table>,
    /// By counter key. With Redis, replaced whole by each refresh that finds a change.
    api: Mutex<BTreeMap<String, Override>>,
    /// Redis's version of the shared overrides this copy reflects (`None`: never fetched).
    pub(crate) version: Mutex<Option<String>>,
    /// One refresh at a time, so a slow one can never apply an older copy over a newer one.
    refreshing: tokio::sync::Mutex<()>,
}

/// One line of `GET /overrides`.
#[derive(Debug, Serialize)]
pub struct Listed {
    #[serde(flatten)]
    pub o: Override,
    /// `file` or `api`.
    pub source: &'static str,
    /// False when the live config has no such route or policy, the numbers do not fit it, or the
    /// key could never be one of its counters' (another number of parts, say): the override is
    /// kept but not applied.
    pub active: bool,
}

impl Overrides {
    /// The table in force; cheap (no lock), for the hot path.
    pub fn active(&self) -> Guard<Arc<Table>> {
        self.active.load()
    }

    pub(crate) fn api(&self) -> MutexGuard<'_, BTreeMap<String, Override>> {
        self.api.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Rebuilds the table from `config` (the live one: its routes and file overrides) and the
    /// API's overrides; `engine` forgets the refusals it cached under the rules before.
    pub fn rebuild(&self, config: &Snapshot, engine: &Engine) {
        let mut rules = HashMap::new();
        let mut budgets = HashMap::new();
        let api = self.api();
        for o in config.overrides.iter().chain(api.values()) {
            match resolve_any(&config.routes, config.rlqs.as_ref(), o) {
                Ok(Resolved::Policy(policy, rule)) => {
                    rules.insert(o.counter_key_of(policy).into_boxed_str(), rule);
                }
                Ok(Resolved::Budget { name, budget }) => {
                    budgets.insert(name.into_boxed_str(), budget);
                }
                Err(e) => tracing::debug!(
                    route = %o.route, policy = %o.policy, field = e.field, error = %e.message,
                    "override not applied"
                ),
            }
        }
        drop(api);
        self.active.store(Arc::new(Table { rules, budgets }));
        // Every reload and every change of an override comes through here: refusals cached under
        // the rules before are not replayed under these.
        engine.rules_changed();
    }

    /// Every override, file first, with whether it applies to `config` (the live one).
    pub fn list(&self, config: &Snapshot) -> Vec<Listed> {
        let api = self.api();
        let listed = |o: &Override, source| Listed {
            o: o.clone(),
            source,
            active: resolve_any(&config.routes, config.rlqs.as_ref(), o).is_ok(),
        };
        config
            .overrides
            .iter()
            .map(|o| listed(o, "file"))
            .chain(api.values().map(|o| listed(o, "api")))
            .collect()
    }
}

impl Overrides {
    /// Replaces the API's overrides with Redis's when their version changed: true then, and the
    /// table wants a [`Overrides::rebuild`] (`crate::state::AppState::refresh_overrides`).
    pub async fn fetch(&self, store: &RedisStore) -> bool {
        let _one = self.refreshing.lock().await;
        let known = self.version.lock().ok().and_then(|v| v.clone());
        match store.overrides_fetch(known.as_deref()).await {
            Ok(Some((version, entries))) => {
                let mut api = BTreeMap::new();
                for (field, json) in entries.into_iter().take(MAX_OVERRIDES) {
                    match serde_json::from_str::<Override>(&json) {
                        Ok(o) if o.counter_key() == field => {
                            api.insert(field, o);
                        }
                        _ => tracing::warn!(field, "ignoring a malformed override in Redis"),
                    }
                }
                *self.api() = api;
                if let Ok(mut v) = self.version.lock() {
                    *v = Some(version);
                }
                true
            }
            Ok(None) => false,
            Err(e) => {
                tracing::debug!(error = %e, "overrides refresh failed; keeping the last copy");
                false
            }
        }
    }
}
