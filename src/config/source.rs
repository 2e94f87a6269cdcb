//! What a snapshot was loaded from, and what a reload changed: the admin listener's `/config`
//! shows it, and every reload logs the sections it changed, so an operator can tell which file is
//! live and what the last edit did without reading the process's memory.

use std::collections::hash_map::DefaultHasher;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::hash::{Hash, Hasher};
use std::time::SystemTime;

use sha2::{Digest, Sha256};

/// The identity of one loaded config text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceInfo {
    /// SHA-256 of the file's bytes, in hex: the same file on every instance has the same hash.
    pub sha256: String,
    pub loaded_at: SystemTime,
    /// A digest per section (`store`, `route users`, `upstream api`, ...), to name what changed.
    sections: BTreeMap<String, u64>,
    /// Route names in order: routes are tried in order, so a reordering changes behaviour.
    route_order: Vec<String>,
}

impl SourceInfo {
    /// Describes `text`, which has already been validated as a config.
    pub fn of(text: &str) -> Self {
        let mut sha256 = String::with_capacity(64);
        for byte in Sha256::digest(text.as_bytes()) {
            let _ = write!(sha256, "{byte:02x}");
        }
        let mut sections = BTreeMap::new();
        let mut route_order = Vec::new();
        let document: serde_norway::Value =
            serde_norway::from_str(text).unwrap_or(serde_norway::Value::Null);
        if let serde_norway::Value::Mapping(top) = &document {
            for (key, value) in top {
                let Some(key) = key.as_str() else { continue };
                match (key, value) {
                    ("routes", serde_norway::Value::Sequence(routes)) => {
                        for (i, route) in routes.iter().enumerate() {
                            let name = route
                                .get("name")
                                .and_then(|n| n.as_str())
                                .map_or_else(|| format!("#{i}"), str::to_string);
                            sections.insert(format!("route `{name}`"), digest(route));
                            route_order.push(name);
                        }
                    }
                    ("upstreams", serde_norway::Value::Mapping(upstreams)) => {
                        for (name, upstream) in upstreams {
                            let name = name.as_str().unwrap_or("?");
                            sections.insert(format!("upstream `{name}`"), digest(upstream));
                        }
                    }
                    _ => {
                        sections.insert(key.to_string(), digest(value));
                    }
                }
            }
        }
        SourceInfo {
            sha256,
            loaded_at: SystemTime::now(),
            sections,
            route_order,
        }
    }

    /// What differs from `self` in `next`, one phrase per section: `route `users` changed`,
    /// `upstream `api` added`, `store changed`. Empty when the two are the same config.
    pub fn changes(&self, next: &SourceInfo) -> Vec<String> {
        let mut out = Vec::new();
        for (name, hash) in &next.sections {
            match self.sections.get(name) {
                None => out.push(format!("{name} added")),
                Some(old) if old != hash => out.push(format!("{name} changed")),
                Some(_) => {}
            }
        }
        for name in self.sections.keys() {
            if !next.sections.contains_key(name) {
                out.push(format!("{name} removed"));
            }
        }
        let kept = |order: &[String], other: &SourceInfo| -> Vec<String> {
            order
                .iter()
                .filter(|n| other.route_order.contains(n))
                .cloned()
                .collect()
        };
        if kept(&self.route_order, next) != kept(&next.route_order, self) {
            out.push("route order changed".to_string());
        }
        out
    }
}

impl Default for SourceInfo {
    fn default() -> Self {
        SourceInfo {
            sha256: String::new(),
            loaded_at: SystemTime::now(),
            sections: BTreeMap::new(),
            route_order: Vec::new(),
        }
    }
}

fn digest(value: &serde_norway::Value) -> u64 {
    let mut hasher = DefaultHasher::new();
    serde_norway::to_string(value)
        .unwrap_or_default()
        .hash(&mut hasher);
    hasher.finish()
}

/// The outcome of the last reload attempt, for `/config`. A failed reload leaves the running
/// config serving; this is where an operator sees why the edit did not apply.
#[derive(Debug, Clone, Default)]
pub struct ReloadStatus {
    pub last_attempt: Option<SystemTime>,
    /// The errors of the last attempt when it failed; cleared by a successful one.
    pub last_error: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "store: {type: memory}\nupstreams:\n  api: {url: 'http://127.0.0.1:1'}\nroutes:\n  - name: a\n    respond: {}\n  - name: b\n    respond: {}\n";

    #[test]
    fn the_same_text_changes_nothing_and_has_one_hash() {
        let one = SourceInfo::of(BASE);
        let two = SourceInfo::of(BASE);
        assert_eq!(one.sha256, two.sha256);
        assert_eq!(one.sha256.len(), 64);
        assert!(one.changes(&two).is_empty());
    }

    #[test]
    fn changes_name_routes_upstreams_and_sections() {
        let old = SourceInfo::of(BASE);
        let next = SourceInfo::of(
            "store: {type: memory, max_keys: 10}\nupstreams:\n  web: {url: 'http://127.0.0.1:1'}\nroutes:\n  - name: b\n    respond: {}\n  - name: a\n    respond: {status: 204}\n  - name: c\n    respond: {}\n",
        );
        let changes = old.changes(&next);
        for want in [
            "route `a` changed",
            "route `c` added",
            "upstream `web` added",
            "upstream `api` removed",
            "store changed",
            "route order changed",
        ] {
            assert!(changes.iter().any(|c| c == want), "{want} in {changes:?}");
        }
        assert!(
            !changes.iter().any(|c| c.contains("route `b`")),
            "{changes:?}"
        );
    }
}
