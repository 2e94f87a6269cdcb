//! The compiled, immutable descriptor tree of every domain, and the lookup that envoyproxy/ratelimit
//! performs on it.
//!
//! Children of a node are grouped by key. Within a key, a request value is tried as: an exact
//! value, then the wildcards in config order (the first match wins), then the key-only child (a
//! counter per distinct value). There is no backtracking: once a level matched, the walk never
//! tries that level's other candidates. A limit applies only when its node matched the request's
//! last entry, and a node with neither a limit nor children ends the walk with no limit, which is
//! how an exact value whitelists itself from a key-only default.

// Seeded per process like std's, and several times faster on the short keys and values of
// descriptors: three lookups per descriptor on every call.
use hashbrown::HashMap;

use super::config::{invalid, RawDescriptor, RawFile, RawKind, RlsConfigError, WindowKind};
use super::glob::Glob;
use super::rule::{Algorithm, Entry, Level, Rule};

/// Options of a load that are not part of the files.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Files naming the same domain are merged (envoyproxy/ratelimit's `MERGE_DOMAIN_CONFIG`)
    /// instead of rejected; a descriptor defined twice is still an error.
    pub merge_domains: bool,
}

/// Every domain of a loaded config, ready for lookups. Built once per (re)load and never changed,
/// so it can be shared by all requests behind an `Arc`.
#[derive(Debug, Default)]
pub struct RlsConfig {
    domains: HashMap<Box<str>, Children>,
    nodes: Vec<TreeNode>,
    rules: Vec<Rule>,
}

/// Identifies a rule of one `RlsConfig`, e.g. to index per-rule metric handles built at load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RuleId(pub u32);

#[derive(Debug, Default)]
struct TreeNode {
    rule: Option<RuleId>,
    children: Children,
}

/// The children of one node (or a domain's top level), grouped by key.
#[derive(Debug, Default)]
struct Children {
    by_key: HashMap<Box<str>, KeyChildren>,
}

#[derive(Debug, Default)]
struct KeyChildren {
    exact: HashMap<Box<str>, u32>,
    wildcards: Vec<(Glob, u32)>,
    key_only: Option<u32>,
}

impl RlsConfig {
    /// The rule that applies to one request descriptor, `None` for an unknown domain, a
    /// descriptor that matches nothing, or a whitelisted one.
    pub fn lookup(&self, domain: &str, entries: &[Entry<'_>]) -> Option<(RuleId, &Rule)> {
        let mut level = self.domains.get(domain)?;
        let mut found = None;
        for (i, (key, value)) in entries.iter().enumerate() {
            let children = level.by_key.get(*key)?;
            let index = children
                .exact
                .get(*value)
                .copied()
                .or_else(|| {
                    let mut wildcards = children.wildcards.iter();
                    wildcards.find(|(g, _)| g.matches(value)).map(|(_, n)| *n)
                })
                .or(children.key_only)?;
            let node = &self.nodes[index as usize];
            if i + 1 == entries.len() {
                found = node.rule;
            }
            if node.children.by_key.is_empty() {
                break;
            }
            level = &node.children;
        }
        found.map(|id| (id, &self.rules[id.0 as usize]))
    }

    /// Whether `domain` is configured at all.
    pub fn has_domain(&self, domain: &str) -> bool {
        self.domains.contains_key(domain)
    }

    /// The domains, in no particular order.
    pub fn domains(&self) -> impl Iterator<Item = &str> {
        self.domains.keys().map(|d| &**d)
    }

    /// Every rule, indexed by `RuleId`.
    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// Compiles checked files into the tree, rejecting duplicate domains (unless merged) and
    /// duplicate descriptors.
    pub(crate) fn compile(
        files: Vec<RawFile>,
        options: LoadOptions,
    ) -> Result<RlsConfig, RlsConfigError> {
        let mut config = RlsConfig::default();
        for file in files {
            let mut top = match config.domains.remove(file.domain.as_str()) {
                Some(existing) if options.merge_domains => existing,
                Some(_) => {
                    let message = format!("duplicate domain '{}' in config file", file.domain);
                    return Err(invalid(&file.name, file.domain_line, "domain", message));
                }
                None => Children::default(),
            };
            let mut path = Vec::new();
            config.add(&file, &file.descriptors, &mut top, &mut path)?;
            config.domains.insert(file.domain.as_str().into(), top);
        }
        Ok(config)
    }

    fn add(
        &mut self,
        file: &RawFile,
        descriptors: &[RawDescriptor],
        into: &mut Children,
        path: &mut Vec<Level>,
    ) -> Result<(), RlsConfigError> {
        for d in descriptors {
            let composite = |path: &[Level]| {
                let mut key = file.domain.clone();
                for level in path {
                    key.push('.');
                    key.push_str(&level.key);
                    if let Some(v) = &level.value {
                        key.push('_');
                        key.push_str(v);
                    }
                }
                key
            };
            let wildcard = d.value.as_deref().and_then(Glob::new);
            path.push(Level {
                key: d.key.as_str().into(),
                value: d.value.as_deref().map(Into::into),
                shared: d.share_threshold && wildcard.is_some(),
                value_to_metric: d.value_to_metric,
            });
            let slot = into.by_key.entry(d.key.as_str().into()).or_default();
            let taken = match (&d.value, &wildcard) {
                (None, _) => slot.key_only.is_some(),
                (Some(_), Some(g)) => slot.wildcards.iter().any(|(w, _)| w == g),
                (Some(v), None) => slot.exact.contains_key(v.as_str()),
            };
            if taken {
                let message = format!("duplicate descriptor composite key '{}'", composite(path));
                return Err(invalid(&file.name, d.line, &d.field, message));
            }
            let rule = d.limit.as_ref().map(|l| self.push_rule(file, d, l, path));
            let mut node = TreeNode {
                rule,
                children: Children::default(),
            };
            self.add(file, &d.descriptors, &mut node.children, path)?;
            path.pop();
            let index = u32::try_from(self.nodes.len()).unwrap_or(u32::MAX);
            self.nodes.push(node);
            let slot = into.by_key.entry(d.key.as_str().into()).or_default();
            match (&d.value, wildcard) {
                (None, _) => slot.key_only = Some(index),
                (Some(_), Some(g)) => slot.wildcards.push((g, index)),
                (Some(v), None) => {
                    slot.exact.insert(v.as_str().into(), index);
                }
            }
        }
        Ok(())
    }

    fn push_rule(
        &mut self,
        file: &RawFile,
        d: &RawDescriptor,
        limit: &super::config::RawLimit,
        path: &[Level],
    ) -> RuleId {
        let algorithm = match (&limit.kind, limit.unit) {
            (RawKind::Unlimited, _) | (_, None) => Algorithm::Unlimited,
            (RawKind::TokenBucket { burst }, Some(unit)) => Algorithm::TokenBucket {
                rate_per_sec: f64::from(limit.requests_per_unit) / unit.seconds() as f64,
                burst: *burst,
            },
            (RawKind::Window(kind), Some(unit)) => {
                let window = unit.duration() * limit.unit_multiplier;
                let limit = limit.requests_per_unit;
                match kind.or(file.algorithm).unwrap_or(WindowKind::Sliding) {
                    WindowKind::Sliding => Algorithm::SlidingWindow { limit, window },
                    WindowKind::Fixed => Algorithm::FixedWindow { limit, window },
                }
            }
        };
        let id = RuleId(u32::try_from(self.rules.len()).unwrap_or(u32::MAX));
        let mut rule = Rule::new(
            &file.domain,
            path.to_vec(),
            limit.name.clone(),
            limit.replaces.clone(),
            limit.requests_per_unit,
            limit.unit,
            algorithm,
            d.shadow_mode,
            d.detailed_metric,
            format!("{}:{}", file.name, limit.line),
        );
        rule.quota_mode = d.quota_mode;
        rule.metadata = d.metadata.clone();
        self.rules.push(rule);
        id
    }
}
