//! Ingress rules to Turnstile routes and upstreams; [`super::order`] then puts the routes in
//! nginx's precedence order.

use std::collections::{BTreeMap, BTreeSet};

use super::annotations::{self, PolicyOut};
use super::emit;
use super::manifest::{Backend, Ingress, Manifests, CLASS_ANNOTATION};
use super::nginx::turnstile_size;
use super::order::{fit, order, unique_names, with_digest, Candidate};
use super::Note;

/// The config document to write.
#[derive(Debug, Default)]
pub struct Document {
    pub ingresses: usize,
    /// `server.max_body_size` and where it came from.
    pub max_body_size: Option<(String, String)>,
    pub upstreams: BTreeMap<String, UpstreamOut>,
    pub routes: Vec<RouteOut>,
    pub notes: Vec<Note>,
}

#[derive(Debug, Clone)]
pub struct UpstreamOut {
    pub url: String,
    /// `tls_verify: false` (an `https://` url from `backend-protocol: HTTPS`).
    pub no_verify: bool,
    pub comment: Option<String>,
}

#[derive(Debug, Clone)]
pub struct RouteOut {
    pub name: String,
    pub comments: Vec<String>,
    pub host: Option<String>,
    pub path: PathOut,
    /// The upstream's name, or `None` for a 404 answer.
    pub upstream: Option<String>,
    pub exempt: Vec<String>,
    pub policies: Vec<PolicyOut>,
    /// The route's `rewrite` template (from `rewrite-target`).
    pub rewrite: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum PathOut {
    /// `match.path`: a pattern (exact literal segments, `{*rest}` for element-wise prefixes).
    Pattern(String),
    /// `match.prefix`: a string prefix.
    Prefix(String),
}

pub fn translate(manifests: &Manifests, options: &super::Options) -> Document {
    let mut doc = Document::default();
    let mut notes = Vec::new();
    let mut by_id: BTreeMap<(String, String), &Ingress> = BTreeMap::new();
    for (ingress, at) in &manifests.ingresses {
        let id = (
            ingress.metadata.namespace().to_string(),
            ingress.metadata.name.clone(),
        );
        if by_id.insert(id.clone(), ingress).is_some() {
            notes.push(note(
                &format!("{}/{}", id.0, id.1),
                format!(
                    "defined again in {at}; the later definition is used, as kubectl apply would"
                ),
            ));
        }
    }
    if let Some(wanted) = &options.ingress_class {
        by_id.retain(|(ns, name), ingress| {
            let subject = format!("{ns}/{name}");
            match ingress.class() {
                Some((class, _)) if class == *wanted => true,
                Some((class, from)) => {
                    notes.push(note(&subject, format!("class {} ({from}), not {wanted}: skipped (--ingress-class {wanted})", emit::scalar(&class))));
                    false
                }
                None if options.without_class => true,
                None => {
                    notes.push(note(&subject, format!("no class (neither spec.ingressClassName nor the {CLASS_ANNOTATION} annotation): skipped, as ingress-nginx skips it unless started with --watch-ingress-without-class (add that flag to import it)")));
                    false
                }
            }
        });
    }
    doc.ingresses = by_id.len();
    let (old, other): (Vec<_>, Vec<_>) = manifests
        .ignored
        .iter()
        .partition(|(kind, _)| kind.ends_with(" Ingress"));
    for (kind, n) in old {
        notes.push(note("input", format!("{n} {kind}: not read; only networking.k8s.io/v1 Ingresses are (Kubernetes 1.22 removed the older APIs)")));
    }
    if !other.is_empty() {
        let list: Vec<String> = other.iter().map(|(k, n)| format!("{n} {k}")).collect();
        notes.push(note(
            "input",
            format!("other kinds ignored: {}", list.join(", ")),
        ));
    }

    let mut candidates = Vec::new();
    let mut shared_names: BTreeMap<String, String> = BTreeMap::new();
    let mut sizes = Vec::new();
    let mut without_size = Vec::new();
    for ((ns, name), ingress) in &by_id {
        let subject = format!("{ns}/{name}");
        let mut plan = annotations::plan(ingress, &subject);
        notes.extend(plan.notes.iter().cloned());
        // One zone per Ingress in ingress-nginx: every path of it counts on one shared policy,
        // named after the Ingress (and unique, should two Ingresses' names clean to one).
        for policy in &mut plan.policies {
            let text = format!("{ns}_{name}_{}", policy.name);
            let mut shared = fit(&text);
            if shared_names.get(&shared).is_some_and(|s| *s != subject) {
                shared = with_digest(&text);
            }
            shared_names.insert(shared.clone(), subject.clone());
            policy.shared = Some(shared);
            policy.comment.push_str(", one budget per Ingress");
        }
        if plan.canary {
            continue;
        }
        if !ingress.spec.tls.is_empty() {
            let secrets: Vec<String> = ingress
                .spec
                .tls
                .iter()
                .filter_map(|t| t.get("secretName").and_then(|s| s.as_str()))
                .map(|s| format!("`{s}`"))
                .collect();
            notes.push(note(&subject, format!("spec.tls (Secret {}): not mapped: Turnstile terminates TLS on `listen_tls` with one certificate from files; mount the Secret and set listen_tls.cert and key (docs/tls.md)", if secrets.is_empty() { "none named".to_string() } else { secrets.join(", ") })));
        }
        match &plan.body_size {
            Some((bytes, text)) => sizes.push((subject.clone(), *bytes, text.clone())),
            None => without_size.push(subject.clone()),
        }
        let mut index = 0;
        for rule in &ingress.spec.rules {
            let host = rule.host.clone().filter(|h| !h.is_empty());
            let paths = rule.http.as_ref().map_or(&[][..], |h| &h.paths[..]);
            let first = index;
            index += paths.len();
            if let Some(h) = host.as_deref().filter(|h| h.starts_with('*')) {
                notes.push(note(&subject, format!("host {h}: Turnstile matches hosts exactly, not wildcards; its paths ({}) are not imported", paths.len())));
                continue;
            }
            if paths.is_empty() {
                let shown = host.as_deref().unwrap_or("(any host)");
                notes.push(note(
                    &subject,
                    format!("rule for {shown} has no http paths; nothing to route"),
                ));
                continue;
            }
            for (i, p) in paths.iter().enumerate() {
                let written = p.path.clone().unwrap_or_else(|| "/".to_string());
                let kind = p.path_type.as_deref().unwrap_or("ImplementationSpecific");
                let shown = format!(
                    "{} {kind} {written}",
                    host.as_deref().unwrap_or("(any host)")
                );
                // ingress-nginx rewrites only when the target differs from the path.
                let rewritten = plan
                    .rewrite_target
                    .as_deref()
                    .filter(|target| *target != written)
                    .map(|target| rewrite(&written, kind, target));
                let (path, rewrite) = match rewritten {
                    Some(Ok((path, template))) => (path, Some(template)),
                    other => {
                        if let Some(Err(why)) = other {
                            notes.push(note(&subject, format!("{shown}: {}rewrite-target={:?}: {why}; not mapped, the path is forwarded unchanged", annotations::PREFIX, plan.rewrite_target.as_deref().unwrap_or_default())));
                        }
                        let (path, why) = match path_match(&written, kind) {
                            Ok(mapped) => mapped,
                            Err(why) => {
                                notes.push(note(&subject, format!("{shown}: {why}; not imported")));
                                continue;
                            }
                        };
                        if let Some(why) = why {
                            notes.push(note(&subject, format!("{shown}: {why}")));
                        }
                        (path, None)
                    }
                };
                if rewrite.is_some() {
                    notes.push(note(&subject, format!("{shown}: rewrite-target: ingress-nginx matches this path as a case-insensitive regular expression (`location ~*`); Turnstile matches it as written, case-sensitively")));
                }
                let Some((upstream, target)) = upstream(
                    &p.backend, ns, manifests, &mut doc, &mut notes, &subject, &plan,
                ) else {
                    continue;
                };
                let mut route = route(
                    format!("{ns}_{name}_{}", first + i),
                    format!("{subject}: {shown} -> {target}"),
                    host.clone(),
                    path,
                    Some(upstream),
                    &plan,
                );
                if rewrite.is_none() && plan.rewrite_target.as_ref().is_some_and(|t| *t != written)
                {
                    route.comments.push("rewrite-target not mapped (see the report): the path is forwarded unchanged".to_string());
                }
                route.rewrite = rewrite;
                candidates.push(Candidate {
                    route,
                    subject: subject.clone(),
                    shown: format!("{shown} -> {target}"),
                    exact: kind == "Exact",
                    written,
                    default_backend: false,
                });
            }
        }
        if let Some(backend) = &ingress.spec.default_backend {
            if let Some((upstream, target)) = upstream(
                backend, ns, manifests, &mut doc, &mut notes, &subject, &plan,
            ) {
                candidates.push(Candidate {
                    route: route(
                        format!("{ns}_{name}_default"),
                        format!("{subject}: defaultBackend -> {target}"),
                        None,
                        PathOut::Prefix("/".to_string()),
                        Some(upstream),
                        &plan,
                    ),
                    subject: subject.clone(),
                    shown: format!("defaultBackend -> {target}"),
                    exact: false,
                    written: "/".to_string(),
                    default_backend: true,
                });
            }
        }
    }

    doc.routes = order(candidates, &mut notes);
    body_size(&mut doc, &sizes, &without_size, &mut notes);
    unique_names(&mut doc.routes);
    let mut seen = BTreeSet::new();
    notes.retain(|n| seen.insert(n.clone()));
    doc.notes = notes;
    doc
}

pub fn note(subject: &str, text: String) -> Note {
    Note {
        subject: subject.to_string(),
        text,
    }
}

fn route(
    name: String,
    comment: String,
    host: Option<String>,
    path: PathOut,
    upstream: Option<String>,
    plan: &annotations::Plan,
) -> RouteOut {
    let mut comments = vec![comment];
    if !plan.unmapped.is_empty() {
        comments.push(format!(
            "not mapped (see the report): {}",
            plan.unmapped.join(", ")
        ));
    }
    RouteOut {
        name: fit(&name),
        comments,
        host,
        path,
        upstream,
        exempt: plan.exempt.clone(),
        policies: plan.policies.clone(),
        rewrite: None,
    }
}

/// A path of an Ingress with `rewrite-target`, as ingress-nginx reads it (`location ~* "^PATH"`,
/// then `rewrite "(?i)PATH" TARGET break;`, which replaces the whole path), mapped to a Turnstile
/// match and `rewrite` template only where the two select and forward the same paths (up to
/// letter case, reported):
///
/// - a literal path `/a` and a target without `$`: `prefix: /a`, `rewrite: TARGET`;
/// - `/a(/|$)(.*)` and a target using only `$2`: `path: /a/{*rest}`, `$2` as `{*rest}` (both the
///   rest after `/a/`, empty for `/a` and `/a/`).
///
/// Any other regular expression is an error saying why.
pub fn rewrite(path: &str, kind: &str, target: &str) -> Result<(PathOut, String), String> {
    let literal = |text: &str| {
        !text.is_empty()
            && text
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'/' | b'-' | b'_'))
    };
    if kind == "Exact" {
        return Err("an Exact path becomes a case-insensitive regular-expression prefix in ingress-nginx once rewrite-target is set, which no Exact match expresses".to_string());
    }
    let (before_captures, with_rest) = match target.find('$') {
        None => (target, false),
        Some(at) => (&target[..at], true),
    };
    let template = if with_rest {
        let parts: Vec<&str> = target.split("$2").collect();
        if parts.iter().any(|p| p.contains('$')) {
            return Err(
                "only `$2` (the rest after `PATH(/|$)`) has an exact Turnstile capture".to_string(),
            );
        }
        parts.join("{*rest}")
    } else {
        target.to_string()
    };
    let target_ok = before_captures.starts_with('/')
        && target.split("$2").all(|p| {
            p.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'/' | b'-' | b'_' | b'.' | b'~'))
        });
    if !target_ok {
        return Err(
            "the target must be a path of letters, digits, `/`, `-`, `_`, `.`, `~` and `$2`"
                .to_string(),
        );
    }
    if let Some(base) = path.strip_suffix("(/|$)(.*)") {
        if literal(base) && base.starts_with('/') && !base.ends_with('/') {
            return Ok((PathOut::Pattern(format!("{base}/{{*rest}}")), template));
        }
    } else if literal(path) && path.starts_with('/') {
        if with_rest {
            return Err("the path has no capture group for the target's `$`".to_string());
        }
        return Ok((PathOut::Prefix(path.to_string()), template));
    }
    Err("the path's regular expression has no exact Turnstile pattern (mapped: a literal path, or `/PREFIX(/|$)(.*)`)".to_string())
}

/// A Kubernetes path and pathType as a Turnstile match, with a note when not exact.
fn path_match(path: &str, kind: &str) -> Result<(PathOut, Option<String>), String> {
    if !path.starts_with('/') {
        return Err("the path must start with `/`".to_string());
    }
    let braces = path.contains(['{', '}']);
    match kind {
        "Exact" if braces => Ok((
            PathOut::Pattern(path.replace('{', "%7B").replace('}', "%7D")),
            Some("`{` and `}` are pattern syntax in Turnstile: written percent-encoded (RFC 3986 §2.1), so a client that sends them raw is not matched".to_string()),
        )),
        "Exact" => Ok((PathOut::Pattern(path.to_string()), None)),
        "Prefix" => {
            let trimmed = path.trim_end_matches('/');
            if trimmed.is_empty() {
                Ok((PathOut::Prefix("/".to_string()), None))
            } else if braces {
                Ok((
                    PathOut::Prefix(path.to_string()),
                    Some("`{` or `}` cannot be in a pattern: mapped to a string prefix, which also matches longer last segments".to_string()),
                ))
            } else {
                Ok((PathOut::Pattern(format!("{trimmed}/{{*rest}}")), None))
            }
        }
        "ImplementationSpecific" => Ok((
            PathOut::Prefix(path.to_string()),
            Some("ImplementationSpecific: mapped to a string prefix, as nginx's `location` without regex reads it".to_string()),
        )),
        other => Err(format!("pathType `{other}` is not Exact, Prefix or ImplementationSpecific")),
    }
}

/// The upstream of a backend (added to `doc`), and how to show it; `None` when it has no Service.
fn upstream(
    backend: &Backend,
    ns: &str,
    manifests: &Manifests,
    doc: &mut Document,
    notes: &mut Vec<Note>,
    subject: &str,
    plan: &annotations::Plan,
) -> Option<(String, String)> {
    let (https, verify) = (plan.https, plan.verify);
    let Some(service) = &backend.service else {
        notes.push(note(
            subject,
            "a resource backend (not a Service) has no Turnstile equivalent; not imported"
                .to_string(),
        ));
        return None;
    };
    let svc = &service.name;
    let port = service.port.as_ref();
    let (number, label, comment) = match (
        port.and_then(|p| p.number),
        port.and_then(|p| p.name.as_ref()),
    ) {
        (Some(n), _) => (n, n.to_string(), None),
        (None, Some(name)) => {
            let key = (ns.to_string(), svc.clone(), name.clone());
            match manifests.named_ports.get(&key) {
                Some(n) => {
                    notes.push(note(subject, format!("service {svc} port `{name}`: a named port, resolved to {n} from the Service in the input")));
                    (*n, n.to_string(), None)
                }
                None => {
                    notes.push(note(subject, format!("service {svc} port `{name}`: a named port and no Service in the input names it; port 80 is written, edit the upstream's url")));
                    (
                        80,
                        name.clone(),
                        Some(format!(
                            "named port `{name}` not found in the input: port 80 assumed, edit it"
                        )),
                    )
                }
            }
        }
        (None, None) => {
            notes.push(note(
                subject,
                format!("service {svc}: no port; port 80 is written"),
            ));
            (
                80,
                "80".to_string(),
                Some("no port in the Ingress: port 80 assumed".to_string()),
            )
        }
    };
    let (scheme, suffix) = match (https, verify) {
        (false, _) => ("http", ""),
        (true, false) => ("https", "_https"),
        (true, true) => ("https", "_https_verified"),
    };
    let name = fit(&format!("{ns}_{svc}_{label}{suffix}"));
    doc.upstreams.entry(name.clone()).or_insert(UpstreamOut {
        url: format!("{scheme}://{svc}.{ns}.svc.cluster.local:{number}"),
        no_verify: https && !verify,
        comment,
    });
    Some((name, format!("{svc}:{label}")))
}

/// `proxy-body-size` is per Ingress in nginx and global in Turnstile: the largest value wins, and
/// every Ingress whose limit changes is reported.
fn body_size(
    doc: &mut Document,
    sizes: &[(String, u64, String)],
    without: &[String],
    notes: &mut Vec<Note>,
) {
    let Some(largest) = sizes.iter().map(|(_, b, _)| *b).max() else {
        return;
    };
    // Ingresses without the annotation had nginx's default: it must fit under the global limit
    // too, so that no body nginx accepted is refused.
    let max = if without.is_empty() {
        largest
    } else {
        largest.max(NGINX_DEFAULT_BODY_SIZE)
    };
    let size = turnstile_size(max);
    let mut from: Vec<String> = sizes
        .iter()
        .filter(|(_, b, _)| *b == max)
        .map(|(s, _, t)| format!("{s} ({t})"))
        .collect();
    if max > largest {
        from.push("the default 1m of the Ingresses without it".to_string());
    }
    for (subject, bytes, text) in sizes {
        if *bytes < max {
            notes.push(note(subject, format!("{}proxy-body-size={text:?}: Turnstile's body limit is global; server.max_body_size is the largest, {size}, so these routes accept larger bodies", annotations::PREFIX)));
        }
    }
    if !without.is_empty() && max > NGINX_DEFAULT_BODY_SIZE {
        notes.push(note("input", format!("Ingresses without proxy-body-size ({}) had the controller's default (1m unless its ConfigMap sets another); with server.max_body_size {size} they accept larger bodies", without.join(", "))));
    }
    doc.max_body_size = Some((size, format!("proxy-body-size of {}", from.join(", "))));
}

/// ingress-nginx's `proxy-body-size` when neither the Ingress nor the ConfigMap sets it.
const NGINX_DEFAULT_BODY_SIZE: u64 = 1 << 20;
