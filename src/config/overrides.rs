//! Per-key overrides as data: the entries of the `overrides:` file and of the admin API, their
//! validation against the config's routes, and the rule each gives its policy. The runtime (the
//! table in force, the API's copy shared through Redis) is [`crate::overrides`].

use std::collections::HashMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::config::rlqs::RlqsSettings;
use crate::config::{ConfigError, Policy, Route};
use crate::limiter::quota::Budget;
use crate::limiter::{Rule, SlidingWindow, TokenBucket};

/// The `route` an override names to set a budget of the quota service (`rlqs:`): its `policy`
/// is the budget's name, its `key` the values of the budget's `*` entries. A config with an
/// `rlqs:` block may not have a route of this name.
pub const RLQS_ROUTE: &str = "rlqs";

/// The most overrides, from the file and from the API each: bounds memory and the size of every
/// refresh, whatever an admin client sends.
pub const MAX_OVERRIDES: usize = 10_000;

/// The longest key value an override may name, in bytes (a counter key's values are bounded the
/// same way by [`crate::keys`], a long one becoming a digest).
pub const MAX_KEY_BYTES: usize = 1024;

/// The new numbers for one key: the ones the policy's algorithm has.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// `sliding_window` and `quota`: units per window or period.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
    /// `token_bucket`: the refill rate (`100/s`, `5/m`); the policy's when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<String>,
    /// `token_bucket`: the bucket size; the policy's when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u64>,
}

/// One override: route, policy, the key value as it appears after `route:policy:` in the counter
/// key (what `/debug/top-limited` shows with `show_key_values`), and the new limits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Override {
    pub route: String,
    pub policy: String,
    pub key: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u64>,
}

impl Override {
    pub fn new(route: &str, policy: &str, key: &str, limits: Limits) -> Self {
        Override {
            route: route.to_owned(),
            policy: policy.to_owned(),
            key: key.to_owned(),
            limit: limits.limit,
            rate: limits.rate,
            burst: limits.burst,
        }
    }

    fn limits(&self) -> Limits {
        Limits {
            limit: self.limit,
            rate: self.rate.clone(),
            burst: self.burst,
        }
    }

    /// `route:policy:key`: what names this override (in the API and in Redis's copy).
    pub fn counter_key(&self) -> String {
        format!("{}:{}:{}", self.route, self.policy, self.key)
    }

    /// The counter key this override applies to, of `policy` (the one it [`resolve`]s to):
    /// `route:policy:key`, or `shared/policy:key` for a shared policy, whichever of its routes
    /// the override names.
    pub fn counter_key_of(&self, policy: &Policy) -> String {
        format!("{}{}", policy.key_prefix(), self.key)
    }
}

/// What an override applies to.
#[derive(Debug, Clone)]
pub enum Resolved<'r> {
    /// A policy's counters for one key value: the rule they take.
    Policy(&'r Policy, Rule),
    /// The quota service's bucket ids of one budget with these `*` values: `name` is
    /// `budget:key`, what [`crate::overrides::Table::budget`] is asked for.
    Budget { name: String, budget: Budget },
}

/// What `o` applies to: a quota service budget when it names [`RLQS_ROUTE`] and the config has
/// an `rlqs:` block, else a route's policy ([`resolve`]).
pub fn resolve_any<'r>(
    routes: &'r [Route],
    rlqs: Option<&RlqsSettings>,
    o: &Override,
) -> Result<Resolved<'r>, Invalid> {
    match rlqs {
        Some(settings) if o.route == RLQS_ROUTE => {
            let (name, budget) = resolve_budget(settings, o)?;
            Ok(Resolved::Budget { name, budget })
        }
        _ => resolve(routes, o).map(|(policy, rule)| Resolved::Policy(policy, rule)),
    }
}

/// The budget `o` gives the bucket ids it names: the budget's own with `o`'s `rate` and
/// `burst`, validated as the `rlqs:` block validates them.
fn resolve_budget(settings: &RlqsSettings, o: &Override) -> Result<(String, Budget), Invalid> {
    let rule = settings
        .rules
        .iter()
        .find(|r| r.name == o.policy)
        .ok_or_else(|| Invalid {
            field: "policy",
            message: format!("the quota service has no budget `{}`", o.policy),
            missing: true,
        })?;
    let parts = rule.key_parts();
    if parts == 0 {
        return Err(invalid(
            "policy",
            format!(
                "budget `{}` has no `*` entry, so no key to override: change its `token_bucket` \
                 in the config",
                rule.name
            ),
        ));
    }
    if o.key.is_empty() || o.key.len() > MAX_KEY_BYTES {
        return Err(invalid(
            "key",
            format!("must be 1 to {MAX_KEY_BYTES} bytes"),
        ));
    }
    let given = o.key.split('|').count();
    if given != parts {
        return Err(invalid(
            "key",
            format!(
                "`{}` names {given} value(s) but budget `{}` has {parts} `*` entr{} (values \
                 joined by `|`, in the order of their keys): it could never match a bucket id",
                o.key,
                rule.name,
                if parts == 1 { "y" } else { "ies" },
            ),
        ));
    }
    for part in o.key.split('|') {
        if let Err(canonical) = crate::keys::check_key_value(part) {
            return Err(invalid(
                "key",
                format!("`{part}` is never a value as an override names it: write `{canonical}`"),
            ));
        }
    }
    if o.limit.is_some() {
        return Err(invalid(
            "limit",
            "a budget is a token bucket: give `rate`, `burst` or both",
        ));
    }
    if o.rate.is_none() && o.burst.is_none() {
        return Err(invalid("rate", "give `rate`, `burst` or both"));
    }
    let fill_s = f64::from(settings.timing.fill_interval_s);
    let rate = match &o.rate {
        Some(text) => crate::config::units::parse_rate(text).map_err(|m| invalid("rate", m))?,
        None => rule.budget.rate,
    };
    if rate * fill_s < 1.0 {
        return Err(invalid(
            "rate",
            format!("less than one token per fill_interval ({fill_s}s): no proxy could be given a token"),
        ));
    }
    let burst = match o.burst {
        None => rule.budget.burst,
        Some(0) => return Err(invalid("burst", "must be at least 1")),
        Some(b) => u32::try_from(b).map_err(|_| invalid("burst", "must be at most 4294967295"))?,
    };
    let budget = Budget {
        rate,
        burst,
        ..rule.budget
    };
    Ok((format!("{}:{}", rule.name, o.key), budget))
}

/// Why an override cannot apply, with the field at fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    pub field: &'static str,
    pub message: String,
    /// The route or policy does not exist (404 from the API, not 400).
    pub missing: bool,
}

fn invalid(field: &'static str, message: impl Into<String>) -> Invalid {
    Invalid {
        field,
        message: message.into(),
        missing: false,
    }
}

/// The policy `o` names in `routes`, and the rule it gives that policy for its key.
pub fn resolve<'r>(routes: &'r [Route], o: &Override) -> Result<(&'r Policy, Rule), Invalid> {
    let missing = |field, message: String| Invalid {
        field,
        message,
        missing: true,
    };
    let route = routes
        .iter()
        .find(|r| *r.name == *o.route)
        .ok_or_else(|| missing("route", format!("no route `{}`", o.route)))?;
    let policy = route
        .policies
        .iter()
        .find(|p| *p.name == *o.policy)
        .ok_or_else(|| {
            missing(
                "policy",
                format!("route `{}` has no policy `{}`", o.route, o.policy),
            )
        })?;
    if o.key.is_empty() || o.key.len() > MAX_KEY_BYTES {
        return Err(invalid(
            "key",
            format!("must be 1 to {MAX_KEY_BYTES} bytes"),
        ));
    }
    key_fits(policy, &o.key)?;
    Ok((policy, rule_for(policy, &o.limits())?))
}

/// Whether `key` can be a key value of `policy`'s counters: one value per part of its `key`,
/// joined by `|`, each as a counter key holds it (escaped, [`crate::keys`]). Anything else could
/// never match a request.
pub fn key_fits(policy: &Policy, key: &str) -> Result<(), Invalid> {
    let parts = policy.key.len();
    let given = key.split('|').count();
    if given != parts {
        let plural = |n: usize| if n == 1 { "" } else { "s" };
        return Err(invalid(
            "key",
            format!(
                "`{key}` names {given} value{} but policy `{}` keys on {parts} part{} \
                 (values joined by `|`): it could never match a request",
                plural(given),
                policy.name,
                plural(parts),
            ),
        ));
    }
    for part in key.split('|') {
        if let Err(canonical) = crate::keys::check_key_value(part) {
            return Err(invalid(
                "key",
                format!(
                    "`{part}` is never a key value: a counter key writes that value as \
                     `{canonical}` (as `/debug/top-limited` shows it)"
                ),
            ));
        }
    }
    Ok(())
}

/// `policy`'s rule with `limits` in place of its numbers, validated as the config validates them.
pub fn rule_for(policy: &Policy, limits: &Limits) -> Result<Rule, Invalid> {
    let too_small = |field, what: u64| {
        invalid(
            field,
            format!(
                "{what} is less than the policy's cost ({}): no request could ever pass",
                policy.cost
            ),
        )
    };
    let limit = || -> Result<u64, Invalid> {
        match limits.limit {
            None => Err(invalid("limit", "is required for this policy's algorithm")),
            Some(0) => Err(invalid("limit", "must be at least 1")),
            Some(n) if n < policy.cost => Err(too_small("limit", n)),
            Some(n) => Ok(n),
        }
    };
    match policy.rule {
        Rule::TokenBucket(tb) => {
            if limits.limit.is_some() {
                return Err(invalid(
                    "limit",
                    "a token bucket policy takes `rate` and `burst`",
                ));
            }
            if limits.rate.is_none() && limits.burst.is_none() {
                return Err(invalid("rate", "give `rate`, `burst` or both"));
            }
            let rate = match &limits.rate {
                Some(text) => {
                    crate::config::units::parse_rate(text).map_err(|m| invalid("rate", m))?
                }
                None => tb.rate,
            };
            let burst = limits.burst.unwrap_or(tb.burst);
            if burst == 0 {
                return Err(invalid("burst", "must be at least 1"));
            }
            if burst < policy.cost {
                return Err(too_small("burst", burst));
            }
            if burst as f64 / rate > MAX_REFILL_S {
                return Err(invalid(
                    "rate",
                    "burst / rate must be at most 100 years (the bucket must refill)",
                ));
            }
            Ok(Rule::TokenBucket(TokenBucket { rate, burst }))
        }
        Rule::SlidingWindow(sw) => {
            no_bucket_fields(limits)?;
            Ok(Rule::SlidingWindow(SlidingWindow {
                limit: limit()?,
                ..sw
            }))
        }
        Rule::Quota(q) => {
            no_bucket_fields(limits)?;
            Ok(Rule::Quota(crate::limiter::Quota {
                limit: limit()?,
                ..q
            }))
        }
        // More (or fewer) requests in flight for one key; the lease TTL stays the policy's.
        Rule::Concurrency(cc) => {
            no_bucket_fields(limits)?;
            Ok(Rule::Concurrency(crate::limiter::Concurrency {
                limit: limit()?,
                ..cc
            }))
        }
        #[allow(unreachable_patterns)]
        _ => Err(invalid(
            "policy",
            "this policy's algorithm has no overrides",
        )),
    }
}

/// 100 years, as the config allows a bucket to take to refill.
const MAX_REFILL_S: f64 = 100.0 * 365.0 * 86_400.0 * (1.0 + 1e-12);

fn no_bucket_fields(limits: &Limits) -> Result<(), Invalid> {
    if limits.rate.is_some() || limits.burst.is_some() {
        return Err(invalid(
            "rate",
            "`rate` and `burst` are for token bucket policies; give `limit`",
        ));
    }
    Ok(())
}

/// Reads and validates the overrides file against the config's routes, and returns its entries
/// with the SHA-256 of the bytes read. Errors name the file, line and column of the field at
/// fault.
pub fn load_file(
    path: &Path,
    routes: &[Route],
    rlqs: Option<&RlqsSettings>,
) -> Result<(Vec<Override>, [u8; 32]), Vec<ConfigError>> {
    let error = |line, column, field, message| ConfigError::at(path, line, column, field, message);
    let text = std::fs::read_to_string(path).map_err(|e| {
        vec![error(
            0,
            0,
            String::new(),
            format!("cannot read the overrides file: {e}"),
        )]
    })?;
    let list: Vec<Override> = if text.trim().is_empty() {
        Vec::new()
    } else {
        serde_norway::from_str(&text).map_err(|e| {
            let (line, column) = e.location().map_or((1, 1), |l| (l.line(), l.column()));
            vec![error(line, column, String::new(), e.to_string())]
        })?
    };
    let positions = crate::config::locate::Positions::index(&text);
    let at = |field: String, message: String| {
        let pos = positions.find(&field);
        error(
            pos.map_or(1, |p| p.line),
            pos.map_or(1, |p| p.column),
            field,
            message,
        )
    };
    let mut errors = Vec::new();
    if list.len() > MAX_OVERRIDES {
        errors.push(at(
            String::new(),
            format!(
                "{} overrides; at most {MAX_OVERRIDES} are allowed",
                list.len()
            ),
        ));
    }
    let mut seen = HashMap::new();
    for (i, o) in list.iter().enumerate() {
        let (counter, shared) = match resolve_any(routes, rlqs, o) {
            Ok(Resolved::Policy(policy, _)) => (o.counter_key_of(policy), policy.shared),
            Ok(Resolved::Budget { .. }) => (o.counter_key(), false),
            Err(e) => {
                errors.push(at(format!("[{i}].{}", e.field), e.message));
                (o.counter_key(), false)
            }
        };
        if let Some(first) = seen.insert(counter, i) {
            let message = if shared {
                format!(
                    "overrides[{first}] already sets this key of shared policy `{}` (its \
                     routes count on one counter; name it through one of them)",
                    o.policy
                )
            } else {
                format!("overrides[{first}] already sets this key")
            };
            errors.push(at(format!("[{i}].key"), message));
        }
    }
    if errors.is_empty() {
        Ok((list, crate::watch::digest(text.as_bytes())))
    } else {
        Err(errors)
    }
}
