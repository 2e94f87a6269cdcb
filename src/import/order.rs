//! Route order and names.
//!
//! Turnstile tries routes in order and the first match wins; nginx picks an exact location first,
//! then the longest prefix, within the server of the request's host. So routes are sorted: hosts
//! (alphabetically) before the rules without a host, and within one host, exact paths first, then
//! prefixes longest first. When rules without a host exist, each host that has no catch-all gets a
//! 404 route after its own, as ingress-nginx answers for a host it serves: without it the host's
//! unknown paths would fall through to the routes without a host.

use std::collections::{BTreeMap, BTreeSet};

use sha2::{Digest, Sha256};

use super::translate::{PathOut, RouteOut};
use super::Note;

/// A route before ordering.
pub struct Candidate {
    pub route: RouteOut,
    /// The Ingress (`namespace/name`) and the rule, for notes.
    pub subject: String,
    pub shown: String,
    pub exact: bool,
    /// The path as written, whose length orders prefixes.
    pub written: String,
    pub default_backend: bool,
}

/// nginx's precedence as an ordered list, duplicates dropped (the first Ingress keeps a host and
/// path, as ingress-nginx keeps the oldest), and 404 guards for hosts without a catch-all.
pub fn order(mut candidates: Vec<Candidate>, notes: &mut Vec<Note>) -> Vec<RouteOut> {
    candidates.sort_by(|a, b| {
        let key = |c: &Candidate| {
            (
                c.route.host.is_none(),
                c.route.host.clone(),
                c.default_backend,
                !c.exact,
                std::cmp::Reverse(c.written.trim_end_matches('/').len()),
                c.route.path.clone(),
            )
        };
        key(a).cmp(&key(b))
    });
    let mut seen: BTreeMap<(Option<String>, PathOut), String> = BTreeMap::new();
    let mut kept: Vec<RouteOut> = Vec::new();
    for c in candidates {
        let key = (c.route.host.clone(), c.route.path.clone());
        if let Some(first) = seen.get(&key) {
            notes.push(super::translate::note(&c.subject, format!("{}: the same host and path as route {first}; not imported (the first Ingress in namespace/name order keeps it)", c.shown)));
            continue;
        }
        seen.insert(key, c.route.name.clone());
        kept.push(c.route);
    }
    if !kept.iter().any(|r| r.host.is_none()) {
        return kept;
    }
    let mut out: Vec<RouteOut> = Vec::with_capacity(kept.len());
    for (i, r) in kept.iter().enumerate() {
        out.push(r.clone());
        let Some(host) = &r.host else { continue };
        let last_of_host = kept
            .get(i + 1)
            .is_none_or(|n| n.host.as_ref() != Some(host));
        let catch_all = kept
            .iter()
            .any(|k| k.host.as_ref() == Some(host) && k.path == PathOut::Prefix("/".into()));
        if last_of_host && !catch_all {
            out.push(RouteOut {
                name: fit(&format!("{host}_404")),
                comments: vec![format!("{host}, any other path: 404, as ingress-nginx answers for a host it serves (otherwise the routes without a host below would take these requests)")],
                host: Some(host.clone()),
                path: PathOut::Prefix("/".to_string()),
                upstream: None,
                exempt: Vec::new(),
                policies: Vec::new(),
                rewrite: None,
            });
        }
    }
    out
}

/// A Turnstile name (1-64 letters, digits, `_`, `-`) for `text`: other characters become `-`;
/// a longer name is cut and ends with a digest of the whole, so it stays unique and stable.
pub fn fit(text: &str) -> String {
    let clean = clean(text);
    if (1..=64).contains(&clean.len()) {
        return clean;
    }
    with_digest(text)
}

/// `text` cleaned as [`fit`] cleans it, cut to 47 characters, then `_` and 16 hex digits of its
/// SHA-256: a name that no other text gives.
pub fn with_digest(text: &str) -> String {
    let clean = clean(text);
    let digest: String = Sha256::digest(text.as_bytes())[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("{}_{digest}", &clean[..47.min(clean.len())])
}

/// Every character a name may not have replaced by `-`.
fn clean(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect()
}

/// Route names cut or cleaned by [`fit`] could meet; a repeated name gets a digest suffix.
pub fn unique_names(routes: &mut [RouteOut]) {
    let mut taken = BTreeSet::new();
    for (i, route) in routes.iter_mut().enumerate() {
        if !taken.insert(route.name.clone()) {
            route.name = fit(&format!("{}-{i}", route.name));
            taken.insert(route.name.clone());
        }
    }
}
