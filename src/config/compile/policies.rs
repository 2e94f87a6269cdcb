//! A route's policies: key parts, the rule (token bucket, sliding window, quota, concurrency),
//! cost, and shared policies.

use std::collections::HashMap;

use http::HeaderName;

use super::{inflight, valid_name, Errors, NAME_HELP};
use crate::config::raw::*;
use crate::config::snapshot::*;
use crate::config::units::{parse_duration, parse_rate};
use crate::keys::KeyPart;
use crate::limiter::calendar::Per;
use crate::limiter::{Quota, Rule, SlidingWindow, TokenBucket};

/// The longest a token bucket may take to refill from empty (`burst / rate`): 100 years.
const MAX_REFILL_S: f64 = 100.0 * 365.0 * 86_400.0;

const KEY_HELP: &str =
    "key parts are client_ip, header:NAME, path:PARAM, query:NAME, method, host, jwt:CLAIM, \
     body:FIELD (or body:/json/pointer), client_cert:FIELD";

pub(super) fn policy(
    e: &mut Errors,
    path: &str,
    route: &str,
    raw: &RawPolicy,
    params: &[String],
    jwt_block: bool,
) -> Option<Policy> {
    if !valid_name(&raw.name) {
        e.add(format!("{path}.name"), NAME_HELP);
    }
    if raw.key.is_empty() {
        e.add(
            format!("{path}.key"),
            format!("must list at least one part; {KEY_HELP}"),
        );
    }
    let mut key = Vec::new();
    for (k, text) in raw.key.iter().enumerate() {
        let part = key_part(text, params, jwt_block).map_err(|m| format!("`{text}`: {m}"));
        key.extend(e.take(format!("{path}.key[{k}]"), part));
    }
    let cost = inflight::admission_cost(raw);
    if cost == 0 {
        // A zero cost would check without ever consuming: the policy would never limit.
        e.add(
            format!("{path}.cost"),
            "must be at least 1 (and at most the burst or limit)",
        );
    }
    let rule = match (&raw.token_bucket, &raw.sliding_window) {
        _ if raw.concurrency.is_some() => inflight::concurrency(e, path, raw),
        (Some(_), _) | (_, Some(_)) if raw.quota.is_some() => {
            e.add(
                path,
                "give one of `token_bucket`, `sliding_window` or `quota`",
            );
            None
        }
        (None, None) if raw.quota.is_some() => {
            raw.quota.as_ref().and_then(|q| quota(e, path, q, cost))
        }
        (Some(tb), None) => {
            let rate = e.take(format!("{path}.token_bucket.rate"), parse_rate(&tb.rate));
            // The bucket refills from empty in burst / rate, which bounds `Reset` and
            // `Retry-After`: a century keeps them far from overflowing microseconds, and still
            // allows the "never refills during a test" buckets (`1/d`, burst 1000).
            let refill_s = rate.map_or(0.0, |r| tb.burst as f64 / r);
            if refill_s > MAX_REFILL_S * (1.0 + 1e-12) {
                e.add(
                    format!("{path}.token_bucket"),
                    format!(
                        "burst / rate is {refill_s:.0} s: the bucket must refill from empty \
                         within 100 years, 36500d (raise the rate or lower the burst)"
                    ),
                );
            }
            if tb.burst == 0 {
                e.add(format!("{path}.token_bucket.burst"), "must be at least 1");
            } else if cost > tb.burst {
                e.add(
                    format!("{path}.cost"),
                    format!(
                        "{cost} is more than the burst ({}): no request could ever pass",
                        tb.burst
                    ),
                );
            }
            rate.map(|rate| {
                Rule::TokenBucket(TokenBucket {
                    rate,
                    burst: tb.burst,
                })
            })
        }
        (None, Some(sw)) => {
            let window = e.take(
                format!("{path}.sliding_window.window"),
                parse_duration(&sw.window),
            );
            if sw.limit == 0 {
                e.add(format!("{path}.sliding_window.limit"), "must be at least 1");
            } else if cost > sw.limit {
                e.add(
                    format!("{path}.cost"),
                    format!(
                        "{cost} is more than the limit ({}): no request could ever pass",
                        sw.limit
                    ),
                );
            }
            let buckets = sw.buckets.unwrap_or(0);
            window.and_then(|window| {
                let window_us = window.as_micros() as u64;
                if window_us == 0 {
                    e.add(
                        format!("{path}.sliding_window.window"),
                        "must be more than 0ms",
                    );
                    return None;
                }
                if buckets > 0 && (!window_us.is_multiple_of(u64::from(buckets)) || buckets > 3600)
                {
                    e.add(
                        format!("{path}.sliding_window.buckets"),
                        format!("must be 1-3600 and divide the window ({window_us} µs) evenly"),
                    );
                    return None;
                }
                Some(Rule::SlidingWindow(SlidingWindow {
                    limit: sw.limit,
                    window_us,
                    buckets,
                }))
            })
        }
        (Some(_), Some(_)) => {
            e.add(
                path,
                "give either `token_bucket` or `sliding_window`, not both",
            );
            None
        }
        (None, None) => {
            e.add(
                path,
                "needs `token_bucket: {rate, burst}`, `sliding_window: {limit, window}`, \
                 `quota: {limit, per}` or `concurrency: {limit}`",
            );
            None
        }
    };
    if key.len() != raw.key.len() {
        return None;
    }
    let mut policy = Policy::new(route, &raw.name, key, rule?, cost);
    if raw.shared == Some(true) {
        policy.share();
    }
    inflight::finish(e, path, raw, &mut policy);
    super::pacing::on_limit(e, path, raw, &mut policy);
    Some(policy)
}

/// Every shared policy of one name must be defined the same wherever it appears: its routes count
/// on one counter, which has one limit. A difference is an error at the first field that differs,
/// in each place after the first.
pub(super) fn shared_policies(e: &mut Errors, routes: &[RawRoute]) {
    let mut first: HashMap<&str, (usize, usize, &RawPolicy)> = HashMap::new();
    for (i, route) in routes.iter().enumerate() {
        for (j, p) in route.policies.iter().enumerate() {
            if p.shared != Some(true) {
                continue;
            }
            let Some(&(fi, fj, f)) = first.get(p.name.as_str()) else {
                first.insert(&p.name, (i, j, p));
                continue;
            };
            let differs = [
                ("key", p.key != f.key),
                ("token_bucket", p.token_bucket != f.token_bucket),
                ("sliding_window", p.sliding_window != f.sliding_window),
                ("quota", p.quota != f.quota),
                ("concurrency", p.concurrency != f.concurrency),
                ("cost", p.cost != f.cost),
                ("mode", p.mode != f.mode),
                ("on_limit", p.on_limit != f.on_limit),
                ("max_delay", p.max_delay != f.max_delay),
            ];
            if let Some((field, _)) = differs.iter().find(|(_, d)| *d) {
                e.add(
                    format!("routes[{i}].policies[{j}].{field}"),
                    format!(
                        "shared policy `{}` has another `{field}` in route `{}` \
                         (routes[{fi}].policies[{fj}]): the routes that share it count on one \
                         counter, so each must define it the same",
                        p.name, routes[fi].name
                    ),
                );
            }
        }
    }
}

/// A calendar quota: `{limit, per: second | minute | hour | day | week | month, time_zone}`.
fn quota(e: &mut Errors, path: &str, raw: &RawQuota, cost: u64) -> Option<Rule> {
    if raw.limit == 0 {
        e.add(format!("{path}.quota.limit"), "must be at least 1");
    } else if cost > raw.limit {
        e.add(
            format!("{path}.cost"),
            format!(
                "{cost} is more than the limit ({}): no request could ever pass",
                raw.limit
            ),
        );
    }
    let per = Per::parse(&raw.per);
    if per.is_none() {
        e.add(
            format!("{path}.quota.per"),
            format!(
                "`{}`: expected second, minute, hour, day, week or month",
                raw.per
            ),
        );
    }
    let zone = raw.time_zone.as_deref().unwrap_or("UTC");
    let time_zone = zone.parse::<chrono_tz::Tz>().ok();
    if time_zone.is_none() {
        e.add(
            format!("{path}.quota.time_zone"),
            format!("`{zone}` is not an IANA time zone (such as UTC or Europe/Berlin)"),
        );
    }
    Some(Rule::Quota(Quota {
        limit: raw.limit,
        per: per?,
        time_zone: time_zone?,
    }))
}

fn key_part(text: &str, params: &[String], jwt_block: bool) -> Result<KeyPart, String> {
    let (kind, arg) = text.split_once(':').unwrap_or((text, ""));
    match (kind, arg) {
        ("client_ip", "") => Ok(KeyPart::ClientIp),
        ("method", "") => Ok(KeyPart::Method),
        ("host", "") => Ok(KeyPart::Host),
        ("header", name) if !name.is_empty() => HeaderName::from_bytes(name.as_bytes())
            .map(KeyPart::Header)
            .map_err(|_| format!("`{name}` is not a header name")),
        ("query", name) if !name.is_empty() => Ok(KeyPart::Query(name.into())),
        ("jwt", _) if !jwt_block => Err(
            "needs a top-level `jwt:` block with the keys that verify tokens: an unverified \
             claim would let anyone mint a bucket (docs/jwt.md)"
                .to_string(),
        ),
        ("jwt", claim) if !claim.is_empty() => Ok(KeyPart::Jwt(claim.into())),
        ("body", field) if field.starts_with('/') => Ok(KeyPart::Body(field.into())),
        ("body", field) if !field.is_empty() => Ok(KeyPart::Body(format!("/{field}").into())),
        ("client_cert", field) => crate::keys::CertField::parse(field)
            .map(KeyPart::ClientCert)
            .ok_or_else(|| {
                format!(
                    "`client_cert:{field}` is not a certificate field; use `client_cert:` and {}",
                    crate::keys::CertField::NAMES
                )
            }),
        ("path", name) if !name.is_empty() => match params.iter().position(|p| p == name) {
            Some(index) => Ok(KeyPart::PathParam(index)),
            None if params.is_empty() => Err(format!(
                "the route's `match.path` has no parameters; add `{{{name}}}` to it"
            )),
            None => Err(format!(
                "the route's `match.path` has no `{{{name}}}` (it has: {})",
                params.join(", ")
            )),
        },
        _ => Err(KEY_HELP.to_string()),
    }
}
