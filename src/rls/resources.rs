//! The metric handles of the Envoy service's part of a snapshot, attached at each (re)load.

use super::metrics::{RlsMetricVecs, RuleMetrics};
use super::settings::RlsSnapshot;
use super::tree::RuleId;
use crate::metrics::Metrics;

/// The metric handles of an [`RlsSnapshot`], attached by `server.rs` at each (re)load.
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
