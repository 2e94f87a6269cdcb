//! The `rlqs:` block of `policies.yaml`: the Envoy rate limit quota service (`crate::rlqs`), its
//! listener, its timing and the budgets that bucket ids map to, as plain data.
//!
//! ```yaml
//! rlqs:
//!   listen: 127.0.0.1:18081     # internal: only the proxies' gRPC clients
//!   assignment_ttl: 15s         # whole seconds; more than Envoy's 5 s report interval
//!   reassign_every: 5s          # the least time between two changes of one proxy's bucket
//!   fill_interval: 1s           # the token buckets' fill_interval, whole seconds
//!   abandon_after: 6            # reports in a row without a request, then abandon_action
//!   max_buckets: 10000          # bucket ids tracked at once; more are denied
//!   budgets:                    # first match wins: list the specific (per-key) ones first
//!     - name: vip
//!       bucket: {name: api, user: vip}
//!       token_bucket: {rate: 100/s, burst: 20}
//!     - name: api
//!       bucket: {name: api, user: "*"}    # `*`: any value; each bucket id has its own budget
//!       token_bucket: {rate: 30/s, burst: 6}
//!       floor: 1/s              # each proxy's least share (default: one token per fill)
//!   default:                    # a bucket id no budget matches (without it: denied)
//!     token_bucket: {rate: 5/s, burst: 1}
//! ```

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;

use super::raw::RawTokenBucket;
use super::units::{parse_duration, parse_rate};
use crate::limiter::quota::{Budget, Timing};

/// The block as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRlqs {
    pub listen: String,
    pub assignment_ttl: Option<String>,
    pub reassign_every: Option<String>,
    pub fill_interval: Option<String>,
    pub abandon_after: Option<u32>,
    pub max_buckets: Option<u64>,
    #[serde(default)]
    pub budgets: Vec<RawBudget>,
    pub default: Option<RawDefault>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawBudget {
    pub name: String,
    pub bucket: BTreeMap<String, String>,
    pub token_bucket: RawTokenBucket,
    pub floor: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDefault {
    pub token_bucket: RawTokenBucket,
    pub floor: Option<String>,
}

/// How a rule matches one entry's value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ValueMatch {
    Any,
    Exact(String),
}

/// One budget rule: the bucket ids it takes and the budget each of them gets.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetRule {
    /// Its metric label: the configured name, `default` for the default.
    pub name: String,
    /// Entries a bucket id must have (others may be present too).
    pub bucket: Vec<(String, ValueMatch)>,
    pub budget: Budget,
}

impl BudgetRule {
    /// How many values a per-key override of this budget names: one per `*` entry.
    pub fn key_parts(&self) -> usize {
        self.bucket
            .iter()
            .filter(|(_, m)| *m == ValueMatch::Any)
            .count()
    }

    /// The key a per-key override names for the bucket id `entries` (which this rule matches):
    /// the values of the rule's `*` entries in key order, each escaped as a counter key writes a
    /// value, joined by `|` (`/overrides/rlqs/{budget}/{key}`).
    pub fn override_key(&self, entries: &[(String, String)]) -> String {
        let mut key = String::new();
        for (name, _) in self.bucket.iter().filter(|(_, m)| *m == ValueMatch::Any) {
            if let Some((_, value)) = entries.iter().find(|(k, _)| k == name) {
                if !key.is_empty() {
                    key.push('|');
                }
                crate::keys::push_key_value(value.as_bytes(), &mut key);
            }
        }
        key
    }

    fn matches(&self, entries: &[(String, String)]) -> bool {
        self.bucket.iter().all(|(key, want)| {
            entries.iter().any(|(k, v)| {
                k == key
                    && match want {
                        ValueMatch::Any => true,
                        ValueMatch::Exact(value) => v == value,
                    }
            })
        })
    }
}

/// The quota service's part of a snapshot.
#[derive(Debug, Clone, PartialEq)]
pub struct RlqsSettings {
    pub listen: SocketAddr,
    pub timing: Timing,
    pub max_buckets: usize,
    /// In config order; the default, when set, is last and named `default`.
    pub rules: Vec<BudgetRule>,
    pub has_default: bool,
}

impl RlqsSettings {
    /// The rule a bucket id falls under (first match, then the default) and its index in
    /// [`RlqsSettings::rules`]; `None`: no budget, the bucket is denied.
    pub fn rule_for(&self, entries: &[(String, String)]) -> Option<(usize, &BudgetRule)> {
        let own = self.rules.len() - usize::from(self.has_default);
        self.rules[..own]
            .iter()
            .enumerate()
            .find(|(_, r)| r.matches(entries))
            .or_else(|| self.has_default.then(|| (own, &self.rules[own])))
    }
}

/// The defaults of the timing fields.
pub const DEFAULT_TTL: Duration = Duration::from_secs(15);
pub const DEFAULT_REASSIGN_EVERY: Duration = Duration::from_secs(5);
pub const DEFAULT_ABANDON_AFTER: u32 = 6;
pub const DEFAULT_MAX_BUCKETS: u64 = 10_000;

fn whole_seconds(
    errors: &mut Vec<(String, String)>,
    path: &str,
    text: Option<&str>,
    default: Duration,
    min: u64,
) -> u64 {
    let Some(text) = text else {
        return default.as_secs();
    };
    match parse_duration(text) {
        Ok(d) if d.subsec_nanos() == 0 && (min..=3600).contains(&d.as_secs()) => d.as_secs(),
        Ok(_) => {
            let message = format!(
                "`{text}` must be whole seconds, {min}s to 1h (Envoy reads only the seconds)"
            );
            errors.push((path.to_owned(), message));
            default.as_secs()
        }
        Err(m) => {
            errors.push((path.to_owned(), m));
            default.as_secs()
        }
    }
}

fn budget(
    errors: &mut Vec<(String, String)>,
    path: &str,
    tb: &RawTokenBucket,
    floor: Option<&str>,
    fill_s: u64,
) -> Option<Budget> {
    let mut err = |field: &str, message: String| errors.push((format!("{path}.{field}"), message));
    let rate = match parse_rate(&tb.rate) {
        Ok(rate) if rate * fill_s as f64 >= 1.0 => Some(rate),
        Ok(_) => {
            let message = format!(
                "`{}` is less than one token per fill_interval ({fill_s}s): no proxy could be \
                 given a token",
                tb.rate
            );
            err("token_bucket.rate", message);
            None
        }
        Err(m) => {
            err("token_bucket.rate", m);
            None
        }
    };
    if !(1..=u64::from(u32::MAX)).contains(&tb.burst) {
        err("token_bucket.burst", "must be at least 1".to_owned());
    }
    let floor = match floor {
        None => Some(1.0 / fill_s as f64),
        Some(text) => parse_rate(text).map_err(|m| err("floor", m)).ok(),
    };
    Some(Budget {
        rate: rate?,
        burst: u32::try_from(tb.burst).unwrap_or(u32::MAX),
        floor: floor?,
    })
}

/// Validates the block. Errors are `(field path, message)` pairs.
pub fn compile(raw: &RawRlqs) -> Result<RlqsSettings, Vec<(String, String)>> {
    let mut errors: Vec<(String, String)> = Vec::new();
    let listen = raw.listen.parse::<SocketAddr>().map_err(|_| {
        let message = format!(
            "`{}` is not an address; expected IP:PORT (e.g. 127.0.0.1:18081)",
            raw.listen
        );
        errors.push(("rlqs.listen".to_owned(), message));
    });
    let e = &mut errors;
    let ttl_s = whole_seconds(
        e,
        "rlqs.assignment_ttl",
        raw.assignment_ttl.as_deref(),
        DEFAULT_TTL,
        2,
    );
    let one = Duration::from_secs(1);
    let fill_s = whole_seconds(
        e,
        "rlqs.fill_interval",
        raw.fill_interval.as_deref(),
        one,
        1,
    );
    let reassign_every = whole_seconds(
        e,
        "rlqs.reassign_every",
        raw.reassign_every.as_deref(),
        DEFAULT_REASSIGN_EVERY,
        1,
    );
    let abandon_after = raw.abandon_after.unwrap_or(DEFAULT_ABANDON_AFTER);
    if abandon_after == 0 {
        e.push((
            "rlqs.abandon_after".into(),
            "must be at least 1 report".into(),
        ));
    }
    let max_buckets = raw.max_buckets.unwrap_or(DEFAULT_MAX_BUCKETS);
    if !(1..=1_000_000).contains(&max_buckets) {
        e.push((
            "rlqs.max_buckets".into(),
            "must be between 1 and 1000000".into(),
        ));
    }
    let mut rules = Vec::new();
    let mut names: Vec<&str> = Vec::new();
    for (i, b) in raw.budgets.iter().enumerate() {
        let path = format!("rlqs.budgets[{i}]");
        let mut err = |field: &str, message: String| e.push((format!("{path}.{field}"), message));
        let valid = (1..=64).contains(&b.name.len())
            && b.name
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-');
        if !valid || b.name == "default" {
            err(
                "name",
                format!(
                    "`{}`: names are 1-64 letters, digits, `_` or `-`, and not `default`",
                    b.name
                ),
            );
        } else if names.contains(&b.name.as_str()) {
            err(
                "name",
                format!("`{}` is already the name of another budget", b.name),
            );
        }
        names.push(&b.name);
        if b.bucket.is_empty() {
            err(
                "bucket",
                "needs at least one `key: value` (`*` for any value)".to_owned(),
            );
        }
        let bucket = b
            .bucket
            .iter()
            .map(|(k, v)| {
                let m = if v == "*" {
                    ValueMatch::Any
                } else {
                    ValueMatch::Exact(v.clone())
                };
                (k.clone(), m)
            })
            .collect();
        if let Some(budget) = budget(e, &path, &b.token_bucket, b.floor.as_deref(), fill_s) {
            rules.push(BudgetRule {
                name: b.name.clone(),
                bucket,
                budget,
            });
        }
    }
    let has_default = raw.default.is_some();
    if let Some(d) = &raw.default {
        let floor = d.floor.as_deref();
        if let Some(budget) = budget(e, "rlqs.default", &d.token_bucket, floor, fill_s) {
            rules.push(BudgetRule {
                name: "default".to_owned(),
                bucket: Vec::new(),
                budget,
            });
        }
    }
    if raw.budgets.is_empty() && !has_default {
        let message = "no budget and no default: every bucket would be denied";
        e.push(("rlqs.budgets".to_owned(), message.to_owned()));
    }
    match listen {
        Ok(listen) if errors.is_empty() => Ok(RlqsSettings {
            listen,
            timing: Timing {
                ttl_s: ttl_s as u32,
                reassign_every: Duration::from_secs(reassign_every),
                fill_interval_s: fill_s as u32,
                abandon_after,
            },
            max_buckets: max_buckets as usize,
            rules,
            has_default,
        }),
        _ => Err(errors),
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    fn load(rlqs: &str) -> Result<crate::config::Snapshot, String> {
        let text = format!("listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\n{rlqs}");
        crate::config::parse(&text, Path::new("policies.yaml")).map_err(|e| e.to_string())
    }

    const GOOD: &str = "rlqs:
  listen: 127.0.0.1:0
  budgets:
    - name: vip
      bucket: {name: api, user: vip}
      token_bucket: {rate: 100/s, burst: 20}
    - name: api
      bucket: {name: api, user: \"*\"}
      token_bucket: {rate: 30/s, burst: 6}
      floor: 2/s
  default:
    token_bucket: {rate: 5/s, burst: 1}
";

    fn entries(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_bucket_id_takes_the_first_matching_budget_then_the_default() {
        let snapshot = load(GOOD).unwrap();
        let rlqs = snapshot.rlqs.as_ref().unwrap();
        let name = |pairs: &[(&str, &str)]| {
            rlqs.rule_for(&entries(pairs))
                .map(|(i, r)| (i, r.name.clone()))
        };
        assert_eq!(
            name(&[("name", "api"), ("user", "vip")]),
            Some((0, "vip".into()))
        );
        assert_eq!(
            name(&[("name", "api"), ("user", "ann")]),
            Some((1, "api".into()))
        );
        assert_eq!(name(&[("name", "other")]), Some((2, "default".into())));
        assert_eq!(rlqs.rules[1].budget.floor, 2.0);
        assert_eq!(rlqs.timing.ttl_s, 15);
        // Without a default, an unmatched bucket id has no budget (it is denied).
        let strict = load(&GOOD[..GOOD.find("  default:").unwrap()]).unwrap();
        let rlqs = strict.rlqs.as_ref().unwrap();
        assert!(rlqs.rule_for(&entries(&[("name", "other")])).is_none());
    }

    #[test]
    fn errors_name_the_line_and_the_field() {
        let bad = GOOD.replace("rate: 30/s", "rate: 30/x").replace(
            "listen: 127.0.0.1:0\n  budgets",
            "listen: 127.0.0.1:0\n  assignment_ttl: 1500ms\n  budgets",
        );
        let errors = load(&bad).unwrap_err();
        assert!(
            errors.contains("policies.yaml:5:")
                && errors.contains("rlqs.assignment_ttl: `1500ms` must be whole seconds"),
            "{errors}"
        );
        assert!(
            errors.contains("policies.yaml:12:")
                && errors.contains("rlqs.budgets[1].token_bucket.rate"),
            "{errors}"
        );
        let too_slow = GOOD.replace("rate: 5/s", "rate: 0.5/s");
        let errors = load(&too_slow).unwrap_err();
        assert!(
            errors.contains("rlqs.default.token_bucket.rate"),
            "{errors}"
        );
    }

    #[test]
    fn an_override_names_a_budget_by_its_star_values_and_no_route_is_named_rlqs() {
        let snapshot = load(GOOD).unwrap();
        let rlqs = snapshot.rlqs.as_ref().unwrap();
        let api = &rlqs.rules[1];
        assert_eq!(api.key_parts(), 1);
        assert_eq!(
            api.override_key(&entries(&[("name", "api"), ("user", "a b|c")])),
            "a%20b%7Cc"
        );
        use crate::config::overrides::{resolve_any, Override, Resolved};
        let o = |policy: &str, key: &str, rate: Option<&str>| Override {
            route: "rlqs".into(),
            policy: policy.into(),
            key: key.into(),
            limit: None,
            rate: rate.map(str::to_owned),
            burst: None,
        };
        let resolved = resolve_any(
            &snapshot.routes,
            Some(rlqs),
            &o("api", "acme", Some("50/s")),
        );
        match resolved {
            Ok(Resolved::Budget { name, budget }) => {
                assert_eq!(name, "api:acme");
                assert_eq!((budget.rate, budget.burst, budget.floor), (50.0, 6, 2.0));
            }
            other => panic!("{other:?}"),
        }
        let field = |r: Result<Resolved<'_>, crate::config::overrides::Invalid>| {
            r.map(|_| ()).unwrap_err().field
        };
        assert_eq!(
            field(resolve_any(
                &snapshot.routes,
                Some(rlqs),
                &o("api", "a|b", Some("5/s"))
            )),
            "key"
        );
        assert_eq!(
            field(resolve_any(
                &snapshot.routes,
                Some(rlqs),
                &o("api", "a b", Some("5/s"))
            )),
            "key"
        );
        assert_eq!(
            field(resolve_any(
                &snapshot.routes,
                Some(rlqs),
                &o("api", "acme", None)
            )),
            "rate"
        );
        assert_eq!(
            field(resolve_any(
                &snapshot.routes,
                Some(rlqs),
                &o("api", "acme", Some("0.5/s"))
            )),
            "rate"
        );
        // The default has no `*` entry: nothing to name.
        assert_eq!(
            field(resolve_any(
                &snapshot.routes,
                Some(rlqs),
                &o("default", "x", Some("5/s"))
            )),
            "policy"
        );
        let named = format!("{GOOD}routes:\n  - name: rlqs\n    respond: {{status: 200}}\n");
        let errors = load(&named).unwrap_err();
        assert!(
            errors.contains("routes[0].name") && errors.contains("names the quota service"),
            "{errors}"
        );
    }
}
