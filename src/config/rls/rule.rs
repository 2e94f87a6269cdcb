//! One compiled limit of an envoyproxy/ratelimit config: what it allows, how it is enforced, and
//! how its counters and metrics are named.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::time::Duration;

/// The time unit of a `rate_limit`, numbered as in `envoy.service.ratelimit.v3`'s
/// `RateLimitResponse.RateLimit.Unit`, so the gRPC adapter can pass it through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unit {
    Second = 1,
    Minute = 2,
    Hour = 3,
    Day = 4,
    Month = 5,
    Year = 6,
    Week = 7,
}

impl Unit {
    /// Reads a unit the way envoyproxy/ratelimit does: the proto enum name, in any case.
    pub fn parse(text: &str) -> Option<Unit> {
        Some(match text.to_ascii_uppercase().as_str() {
            "SECOND" => Unit::Second,
            "MINUTE" => Unit::Minute,
            "HOUR" => Unit::Hour,
            "DAY" => Unit::Day,
            "WEEK" => Unit::Week,
            "MONTH" => Unit::Month,
            "YEAR" => Unit::Year,
            _ => return None,
        })
    }

    /// The proto enum value of this unit.
    pub fn proto(self) -> i32 {
        self as i32
    }

    /// The unit from its proto enum value (Envoy's `descriptor.limit` override); `UNKNOWN` and
    /// unassigned numbers have none.
    pub fn from_proto(value: i32) -> Option<Unit> {
        Some(match value {
            1 => Unit::Second,
            2 => Unit::Minute,
            3 => Unit::Hour,
            4 => Unit::Day,
            5 => Unit::Month,
            6 => Unit::Year,
            7 => Unit::Week,
            _ => return None,
        })
    }

    /// The unit's length, as envoyproxy/ratelimit divides time: a month is 30 days and a year
    /// 365, so a window never depends on the calendar.
    pub fn seconds(self) -> u64 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
            Unit::Week => 7 * 86_400,
            Unit::Month => 30 * 86_400,
            Unit::Year => 365 * 86_400,
        }
    }

    /// The unit as a window.
    pub fn duration(self) -> Duration {
        Duration::from_secs(self.seconds())
    }

    /// The lower-case name, as written in configs and used in counter keys.
    pub fn name(self) -> &'static str {
        match self {
            Unit::Second => "second",
            Unit::Minute => "minute",
            Unit::Hour => "hour",
            Unit::Day => "day",
            Unit::Week => "week",
            Unit::Month => "month",
            Unit::Year => "year",
        }
    }
}

/// How a rule is enforced. Envoy only ever sees `requests_per_unit` per `unit` (the
/// `current_limit` of a status); this says what stands behind it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Algorithm {
    /// `unlimited: true`: never counts, reports `u32::MAX` remaining.
    Unlimited,
    /// The default: at most `limit` hits in ANY interval of one unit (an exact sliding log), so
    /// there is no 2x burst across a window boundary.
    SlidingWindow { limit: u32, window: Duration },
    /// `algorithm: fixed_window`: envoyproxy/ratelimit's own behaviour, one counter per
    /// calendar-aligned unit, for strict parity.
    FixedWindow { limit: u32, window: Duration },
    /// `token_bucket:`: refills `rate_per_sec` continuously up to `burst`.
    TokenBucket { rate_per_sec: f64, burst: u32 },
}

impl Algorithm {
    /// A short tag for counter keys, so a reload that changes a rule's algorithm or window never
    /// reads a counter of another shape.
    fn write_tag(&self, out: &mut String) {
        // Writing to a String cannot fail.
        let _ = match self {
            Algorithm::Unlimited => write!(out, "u"),
            Algorithm::SlidingWindow { window, .. } => write!(out, "sw{}", window.as_secs()),
            Algorithm::FixedWindow { window, .. } => write!(out, "fw{}", window.as_secs()),
            Algorithm::TokenBucket {
                rate_per_sec,
                burst,
            } => {
                write!(out, "tb{rate_per_sec}/{burst}")
            }
        };
    }
}

/// How one level of a rule's path names its request entry in counters and metrics.
#[derive(Debug, Clone)]
pub(crate) struct Level {
    pub(crate) key: Box<str>,
    /// The config's value: `None` for a key-only descriptor.
    pub(crate) value: Option<Box<str>>,
    /// A wildcard with `share_threshold: true`: every matching value shares one counter, named
    /// by the pattern.
    pub(crate) shared: bool,
    /// `value_to_metric: true`: the metric names this level by the request's value.
    pub(crate) value_to_metric: bool,
}

/// One `rate_limit` (or `token_bucket`) of the config, at one place in one domain's tree.
#[derive(Debug, Clone)]
pub struct Rule {
    /// The domain this rule belongs to.
    pub domain: Box<str>,
    /// envoyproxy/ratelimit's key path without the domain (`key1_value1.subkey1`): the metric
    /// label when no request value is asked for.
    pub key_path: Box<str>,
    /// `rate_limit.name`: what `replaces` refers to, and `current_limit.name` in responses.
    pub name: Option<Box<str>>,
    /// Names of the limits this one displaces from the same request.
    pub replaces: Box<[Box<str>]>,
    /// What Envoy is told the limit is.
    pub requests_per_unit: u32,
    /// The unit Envoy is told; `None` for an unlimited rule, which has none.
    pub unit: Option<Unit>,
    pub algorithm: Algorithm,
    /// Counts and reports, but never answers OVER_LIMIT.
    pub shadow_mode: bool,
    /// Metrics name the request's values, not just the keys.
    pub detailed_metric: bool,
    /// envoyproxy/ratelimit's `quota_mode`: see `decide.rs`.
    pub quota_mode: bool,
    /// The descriptor's `metadata`, returned in `dynamic_metadata` when it passes.
    pub metadata: Option<envoy_types::pb::google::protobuf::Struct>,
    /// Where the rule was written, for logs and errors: `file:line`.
    pub source: Box<str>,
    pub(crate) levels: Box<[Level]>,
    /// The metric label when no level needs the request's value, computed once.
    static_metric: Option<Box<str>>,
    /// The algorithm's tag that ends every counter key of this rule, formatted once.
    counter_tag: Box<str>,
}

/// A request entry as the rule sees it: key and value.
pub type Entry<'e> = (&'e str, &'e str);

impl Rule {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        domain: &str,
        levels: Vec<Level>,
        name: Option<String>,
        replaces: Vec<String>,
        requests_per_unit: u32,
        unit: Option<Unit>,
        algorithm: Algorithm,
        shadow_mode: bool,
        detailed_metric: bool,
        source: String,
    ) -> Rule {
        let key_path = levels
            .iter()
            .map(|l| match &l.value {
                Some(v) => format!("{}_{}", l.key, v),
                None => l.key.to_string(),
            })
            .collect::<Vec<_>>()
            .join(".");
        let dynamic = detailed_metric || levels.iter().any(|l| l.value_to_metric && !l.shared);
        let mut counter_tag = String::new();
        algorithm.write_tag(&mut counter_tag);
        Rule {
            counter_tag: counter_tag.into(),
            domain: domain.into(),
            static_metric: (!dynamic).then(|| key_path.clone().into()),
            key_path: key_path.into(),
            name: name.map(Into::into),
            replaces: replaces.into_iter().map(Into::into).collect(),
            requests_per_unit,
            unit,
            algorithm,
            shadow_mode,
            detailed_metric,
            quota_mode: false,
            metadata: None,
            source: source.into(),
            levels: levels.into(),
        }
    }

    /// The metric label when it needs no request value (resolved once at load), else `None`.
    pub fn static_metric(&self) -> Option<&str> {
        self.static_metric.as_deref()
    }

    /// How deep the rule sits: a request matches it only with exactly this many entries.
    pub fn depth(&self) -> usize {
        self.levels.len()
    }

    /// Appends the counter key of `entries` (which matched this rule) to `out`. One counter per
    /// distinct request value, as in envoyproxy/ratelimit, except at `share_threshold`
    /// wildcards, where all matching values share the pattern's counter. Separators inside keys
    /// and values are escaped, so two different descriptors never share a key by accident.
    pub fn write_counter_key(&self, entries: &[Entry<'_>], out: &mut String) {
        escape(&self.domain, out);
        for (level, (key, value)) in self.levels.iter().zip(entries) {
            out.push('|');
            escape(key, out);
            out.push('=');
            match (&level.value, level.shared) {
                (Some(pattern), true) => {
                    out.push('*');
                    escape(pattern, out);
                }
                _ => escape(value, out),
            }
        }
        out.push('|');
        out.push_str(&self.counter_tag);
    }

    /// The `descriptor` label of this rule's metrics for `entries`: the key path, naming the
    /// request's values where `detailed_metric` or `value_to_metric` ask for them.
    pub fn metric_descriptor(&self, entries: &[Entry<'_>]) -> Cow<'_, str> {
        if let Some(name) = &self.static_metric {
            return Cow::Borrowed(name);
        }
        let mut out = String::with_capacity(self.key_path.len() + 16);
        for (i, (level, (_, value))) in self.levels.iter().zip(entries).enumerate() {
            if i > 0 {
                out.push('.');
            }
            out.push_str(&level.key);
            let wildcard_or_key_only = level.value.as_deref().is_none_or(|v| v.contains('*'));
            if level.shared {
                out.push('_');
                out.push_str(level.value.as_deref().unwrap_or_default());
            } else if level.value_to_metric || (self.detailed_metric && wildcard_or_key_only) {
                out.push('_');
                out.push_str(value);
            } else if let Some(v) = &level.value {
                out.push('_');
                out.push_str(v);
            }
        }
        Cow::Owned(out)
    }
}

/// Appends `domain|key=value|...` with separators escaped: the counter name of a descriptor that
/// has no config rule to name it (Envoy's `limit` override).
pub(crate) fn write_entries_key(domain: &str, entries: &[Entry<'_>], out: &mut String) {
    escape(domain, out);
    for (key, value) in entries {
        out.push('|');
        escape(key, out);
        out.push('=');
        escape(value, out);
    }
}

/// Writes `text` into a counter key: bounded (long descriptor values come from requests and are
/// hashed, as the gateway's key values are) and escaped so that distinct entries stay distinct.
fn escape(text: &str, out: &mut String) {
    if crate::keys::push_digest_if_long(text.as_bytes(), out) {
        return;
    }
    let special = |b: u8| matches!(b, b'\\' | b'|' | b'=' | b'*' | b'#');
    if !text.bytes().any(special) {
        // The common case, copied at once.
        out.push_str(text);
        return;
    }
    for c in text.chars() {
        if matches!(c, '\\' | '|' | '=' | '*' | '#') {
            out.push('\\');
        }
        out.push(c);
    }
}

#[cfg(test)]
mod key_tests {
    use super::escape;
    use crate::keys::MAX_KEY_VALUE_BYTES;

    #[test]
    fn long_descriptor_values_are_bounded_and_stay_distinct() {
        let key = |v: &str| {
            let mut out = String::new();
            escape(v, &mut out);
            out
        };
        let a = key(&("x".repeat(MAX_KEY_VALUE_BYTES) + "1"));
        let b = key(&("x".repeat(MAX_KEY_VALUE_BYTES) + "2"));
        assert_eq!(a.len(), 33, "a digest, not the value: {a}");
        assert_ne!(a, b);
        // A literal value that looks like a digest is escaped, so it never collides with one.
        assert!(key(&a).starts_with("\\#"));
        assert_eq!(key("a|b"), "a\\|b");
    }
}
