//! One Ingress's ingress-nginx annotations: the rate limits become policies, the allowlists
//! exemptions, `proxy-body-size` a candidate for the global body limit; every other annotation
//! under `nginx.ingress.kubernetes.io/` becomes a note, never silently dropped.

use std::collections::BTreeSet;

use ipnet::IpNet;

use super::manifest::{annotation_text, Ingress};
use super::nginx::{go_duration, nginx_key, nginx_size};
use super::Note;

pub const PREFIX: &str = "nginx.ingress.kubernetes.io/";

/// ingress-nginx's `limit-burst-multiplier` default.
const DEFAULT_BURST_MULTIPLIER: u64 = 5;

/// A policy to attach to every route of the Ingress.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyOut {
    pub name: &'static str,
    pub key: Vec<String>,
    pub rule: RuleOut,
    /// Which annotations it came from.
    pub comment: String,
    /// The name of the one counter every route of the Ingress shares (`shared: true`), as
    /// ingress-nginx's one zone per Ingress; set by the translation.
    pub shared: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RuleOut {
    TokenBucket { rate: String, burst: u64 },
    SlidingWindow { limit: u64, window: String },
    Concurrency { limit: u64 },
}

/// What the annotations of one Ingress mean for Turnstile.
#[derive(Debug, Default)]
pub struct Plan {
    pub policies: Vec<PolicyOut>,
    /// CIDRs (normalised), for the routes' `exempt.client_ips`.
    pub exempt: Vec<String>,
    /// `proxy-body-size` in bytes, with the text as written.
    pub body_size: Option<(u64, String)>,
    /// `canary: "true"`: the Ingress only splits traffic off another one.
    pub canary: bool,
    /// `backend-protocol: HTTPS`: the upstreams are `https://`.
    pub https: bool,
    /// `proxy-ssl-verify: "on"`: ingress-nginx verifies the upstream's certificate (off by
    /// default, then the upstreams get `tls_verify: false`).
    pub verify: bool,
    /// `rewrite-target`, as written.
    pub rewrite_target: Option<String>,
    /// The short names of annotations not mapped, for the routes' comments.
    pub unmapped: Vec<String>,
    pub notes: Vec<Note>,
}

/// Reads the annotations of `ingress` (`subject` is its `namespace/name`).
pub fn plan(ingress: &Ingress, subject: &str) -> Plan {
    let mut plan = Plan::default();
    let note = |plan: &mut Plan, text: String| {
        plan.notes.push(Note {
            subject: subject.to_string(),
            text,
        })
    };
    let mut ours = std::collections::BTreeMap::new();
    for (name, value) in &ingress.metadata.annotations {
        let Some(short) = name.strip_prefix(PREFIX) else {
            continue;
        };
        match annotation_text(value) {
            Some(text) => {
                ours.insert(short, text.trim().to_string());
            }
            None => note(
                &mut plan,
                format!("{name}: not a string; ignored, as ingress-nginx would reject it"),
            ),
        }
    }
    let get = |short: &str| ours.get(short).map(String::as_str);

    let multiplier = match get("limit-burst-multiplier").map(positive) {
        None => DEFAULT_BURST_MULTIPLIER,
        Some(Some(m)) => m,
        Some(None) => {
            note(
                &mut plan,
                format!(
                    "{PREFIX}limit-burst-multiplier={:?}: not a positive integer; written with the default {DEFAULT_BURST_MULTIPLIER}: check the bursts",
                    get("limit-burst-multiplier").unwrap_or_default()
                ),
            );
            DEFAULT_BURST_MULTIPLIER
        }
    };
    for (short, unit, policy) in [("limit-rps", "s", "rps"), ("limit-rpm", "m", "rpm")] {
        let Some(text) = get(short) else { continue };
        let Some(n) = positive(text) else {
            note(
                &mut plan,
                format!("{PREFIX}{short}={text:?}: not a positive integer; not mapped"),
            );
            continue;
        };
        plan.policies.push(PolicyOut {
            name: policy,
            key: vec!["client_ip".to_string()],
            rule: RuleOut::TokenBucket {
                rate: format!("{n}/{unit}"),
                burst: n.saturating_mul(multiplier),
            },
            comment: format!("{short}: {n} x limit-burst-multiplier: {multiplier}, per client IP"),
            shared: None,
        });
    }
    if let Some(text) = get("limit-connections") {
        match positive(text) {
            Some(n) => plan.policies.push(PolicyOut {
                name: "connections",
                key: vec!["client_ip".to_string()],
                rule: RuleOut::Concurrency { limit: n },
                comment: format!("limit-connections: {n} requests in flight per client IP"),
                shared: None,
            }),
            None => note(
                &mut plan,
                format!("{PREFIX}limit-connections={text:?}: not a positive integer; not mapped"),
            ),
        }
    }
    let local = !plan.policies.is_empty();

    let mut allow = BTreeSet::new();
    for short in ["limit-whitelist", "limit-allowlist"] {
        if let Some(text) = get(short) {
            let cidrs = cidr_list(text, &format!("{PREFIX}{short}"), &mut plan, subject);
            if local {
                allow.extend(cidrs);
            } else {
                note(
                    &mut plan,
                    format!("{PREFIX}{short}: no limit-rps, limit-rpm or limit-connections on this Ingress, so it has no effect; not mapped"),
                );
            }
        }
    }

    let mut ignored = BTreeSet::new();
    let mut global = false;
    if let Some(text) = get("global-rate-limit") {
        let window = get("global-rate-limit-window");
        match (positive(text), window.map(go_duration)) {
            (Some(limit), Some(Some(window))) => {
                let key_text = get("global-rate-limit-key").unwrap_or("$remote_addr");
                match nginx_key(key_text) {
                    Ok(key) => {
                        global = true;
                        plan.policies.push(PolicyOut {
                            name: "global",
                            key,
                            rule: RuleOut::SlidingWindow {
                                limit,
                                window: window.clone(),
                            },
                            comment: format!(
                                "global-rate-limit: {limit} per global-rate-limit-window: {}, key {key_text}",
                                window_text(window.as_str(), get("global-rate-limit-window"))
                            ),
                            shared: None,
                        });
                    }
                    Err(why) => note(
                        &mut plan,
                        format!("{PREFIX}global-rate-limit-key={key_text:?}: {why}; the global rate limit is not mapped"),
                    ),
                }
            }
            (None, _) => note(
                &mut plan,
                format!("{PREFIX}global-rate-limit={text:?}: not a positive integer; not mapped"),
            ),
            (_, None) => note(
                &mut plan,
                format!("{PREFIX}global-rate-limit: no global-rate-limit-window, so ingress-nginx applies no limit; not mapped"),
            ),
            (_, Some(None)) => note(
                &mut plan,
                format!(
                    "{PREFIX}global-rate-limit-window={:?}: not a whole number of milliseconds from 1ms to 365d (e.g. 1m, 30s, 1h30m); not mapped",
                    window.unwrap_or_default()
                ),
            ),
        }
        if let Some(text) = get("global-rate-limit-ignored-cidrs") {
            let name = format!("{PREFIX}global-rate-limit-ignored-cidrs");
            ignored.extend(cidr_list(text, &name, &mut plan, subject));
        }
    }
    if global && local && allow != ignored {
        note(
            &mut plan,
            "limit-whitelist and global-rate-limit-ignored-cidrs differ: Turnstile's exempt skips every policy of a route, so each list now exempts from both limits".to_string(),
        );
    }
    plan.exempt = allow.union(&ignored).cloned().collect();

    if let Some(text) = get("proxy-body-size") {
        match nginx_size(text) {
            Some(0) => note(
                &mut plan,
                format!("{PREFIX}proxy-body-size=\"0\": unlimited has no Turnstile equivalent; not mapped (server.max_body_size applies)"),
            ),
            Some(bytes) => plan.body_size = Some((bytes, text.to_string())),
            None => note(
                &mut plan,
                format!("{PREFIX}proxy-body-size={text:?}: not an nginx size (e.g. 8m); not mapped"),
            ),
        }
    }
    plan.canary = get("canary") == Some("true");
    plan.https = get("backend-protocol").is_some_and(|p| p.eq_ignore_ascii_case("HTTPS"));
    plan.verify = get("proxy-ssl-verify") == Some("on");
    plan.rewrite_target = get("rewrite-target").map(str::to_string);

    for (short, value) in &ours {
        if handled(short) || equivalent(short, value) {
            continue;
        }
        if plan.canary && short.starts_with("canary") {
            continue;
        }
        // rewrite-target reads the paths as regular expressions anyway: see translate::rewrite.
        if plan.rewrite_target.is_some() && *short == "use-regex" {
            continue;
        }
        plan.unmapped.push(short.to_string());
        note(
            &mut plan,
            format!(
                "{PREFIX}{short}={:?}: not mapped: {}",
                clip(value),
                reason(short)
            ),
        );
    }
    if plan.canary {
        note(
            &mut plan,
            format!("{PREFIX}canary=\"true\": Turnstile does not split traffic; this canary Ingress's routes are not imported (its main Ingress serves all requests)"),
        );
    }
    plan
}

/// Annotations read above.
fn handled(short: &str) -> bool {
    matches!(
        short,
        "limit-rps"
            | "limit-rpm"
            | "limit-burst-multiplier"
            | "limit-connections"
            | "limit-whitelist"
            | "limit-allowlist"
            | "global-rate-limit"
            | "global-rate-limit-window"
            | "global-rate-limit-key"
            | "global-rate-limit-ignored-cidrs"
            | "proxy-body-size"
            | "rewrite-target"
    )
}

/// Values that ask for what Turnstile does anyway: nothing changes, nothing to report.
fn equivalent(short: &str, value: &str) -> bool {
    matches!(
        (short, value),
        (
            "ssl-redirect" | "force-ssl-redirect" | "use-regex" | "enable-cors",
            "false"
        ) | ("backend-protocol", "HTTP" | "HTTPS" | "http" | "https")
            | ("proxy-ssl-verify", "off")
    )
}

/// Why an annotation is not mapped, for the report.
fn reason(short: &str) -> &'static str {
    match short {
        "app-root" | "x-forwarded-prefix" => {
            "Turnstile has no equivalent; the path is forwarded as rewritten by the route, if at all"
        }
        "use-regex" => {
            "nginx read these paths as regular expressions; Turnstile matched them literally"
        }
        "ssl-redirect" | "force-ssl-redirect" => {
            "Turnstile does not answer redirects: plain HTTP is served, not redirected to HTTPS"
        }
        "ssl-passthrough" => "Turnstile terminates TLS itself (listen_tls); it does not pass TLS through",
        "limit-rate" | "limit-rate-after" => "Turnstile does not limit bandwidth",
        "whitelist-source-range" | "allowlist-source-range" | "denylist-source-range" => {
            "Turnstile does not deny by client IP: every client reaches these routes"
        }
        "backend-protocol" => {
            "Turnstile's upstreams speak HTTP or HTTPS (HTTP/1.1); gRPC, FastCGI and AUTO_HTTP are not mapped"
        }
        "proxy-ssl-verify" => {
            "the upstream's certificate is verified against the system's CAs; point the upstream's `ca` at the CA of proxy-ssl-secret"
        }
        s if s.starts_with("proxy-ssl-") => {
            "the upstream's TLS settings come from a Kubernetes Secret; set `ca`, `client_cert` or `tls_verify` on the upstream by hand"
        }
        "proxy-connect-timeout" | "proxy-read-timeout" | "proxy-send-timeout" => {
            "the upstream keeps Turnstile's timeouts (connect 1s, response head 30s); set them under upstreams"
        }
        "configuration-snippet" | "server-snippet" | "stream-snippet" => {
            "raw nginx configuration cannot be translated"
        }
        "permanent-redirect" | "temporal-redirect" => "Turnstile does not answer redirects",
        s if s.starts_with("auth-") || s == "satisfy" => {
            "Turnstile does not authenticate: requests reach the upstream unauthenticated"
        }
        s if s.starts_with("cors-") || s == "enable-cors" => {
            "Turnstile adds no CORS headers; the upstream must"
        }
        s if s.starts_with("affinity") || s.starts_with("session-cookie") => {
            "Turnstile does not pin sessions to a pod; it sends to the Service"
        }
        _ => "Turnstile has no equivalent",
    }
}

/// A value short enough for one report line, without control characters.
fn clip(value: &str) -> String {
    let mut out: String = value
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(60)
        .collect();
    if value.chars().count() > 60 {
        out.push_str("...");
    }
    out
}

fn positive(text: &str) -> Option<u64> {
    text.trim().parse().ok().filter(|n| *n > 0)
}

/// A comma-separated list of CIDRs or IPs (`10.0.0.0/8, 192.0.2.7`), normalised; bad entries are
/// reported and skipped.
fn cidr_list(text: &str, name: &str, plan: &mut Plan, subject: &str) -> Vec<String> {
    let mut out = Vec::new();
    for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let net = item
            .parse::<IpNet>()
            .or_else(|_| item.parse::<std::net::IpAddr>().map(IpNet::from));
        match net {
            Ok(net) => out.push(net.to_string()),
            Err(_) => plan.notes.push(Note {
                subject: subject.to_string(),
                text: format!("{name}: `{}` is not a CIDR or IP; skipped", clip(item)),
            }),
        }
    }
    out
}

fn window_text(turnstile: &str, written: Option<&str>) -> String {
    match written {
        Some(w) if w != turnstile => format!("{w} ({turnstile})"),
        _ => turnstile.to_string(),
    }
}
