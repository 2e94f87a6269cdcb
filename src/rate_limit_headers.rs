//! The rate-limit fields of a response, in the dialect a route asks for (`rate_limit_headers`).
//!
//! - `x-ratelimit`: the de-facto `X-RateLimit-Limit`, `-Remaining` and `-Reset` of the governing
//!   policy (the default: what the gateway always sent).
//! - `ietf`: draft-ietf-httpapi-ratelimit-headers-11, two Structured Fields (RFC 9651 §3.1 Lists
//!   of Items with Parameters): `RateLimit-Policy: "per_user";q=20;w=60, "per_ip";q=100;w=10`,
//!   one item per enforced policy that applied (draft §4), and `RateLimit: "per_user";r=5;t=3` for
//!   the governing policy (draft §5).
//! - `both`, or `none`.
//!
//! A token bucket has no window, so its quota policy is the burst it can spend at once, `q` =
//! burst, over the time it takes to refill from empty, `w` = ceil(burst / rate per second). A
//! sliding window is exactly the draft's model: `q` = limit, `w` = window (seconds, rounded up). A
//! calendar quota is `q` = limit over its period's nominal length (a day, 7 days, 30 days).
//! A concurrency limit has no window: its item is `q` = limit with `qu="concurrent-requests"`.
//!
//! `r` is the quota available now. `t` is the effective window, in seconds rounded up: on an
//! admitted request, the time until the whole quota is available again if nothing more is spent
//! (`X-RateLimit-Reset`; 0 for a concurrency limit, whose slots come back when requests end, not
//! with time); on a refusal, the time until the refused request would fit, which is exactly the
//! response's `Retry-After` (draft §6: `Retry-After` never names a time before the window ends).
//!
//! Every door that answers HTTP (the gateway, forward-auth over HTTP and ext_authz) writes its
//! fields here; the Envoy service keeps its draft-03 wire names but takes its numbers from the
//! same functions ([`ceil_seconds`]).
//!
//! The plan a route's fields follow ([`RateLimitHeaders`], its [`HeaderMode`]) is compiled with
//! the config; this module is below both `config` and `respond` (which re-exports it as
//! `respond::headers`), and holds the numbers' formatting they share.

use std::fmt::Write as _;
use std::sync::OnceLock;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};

use crate::limiter::calendar::Per;
use crate::limiter::{Outcome, Rule};

pub static X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
pub static X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
pub static X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");
/// How long a request admitted for later waited for its slot (`on_limit: delay`), in seconds
/// with three decimals: Turnstile's own field (no standard one exists).
pub static TURNSTILE_DELAY: HeaderName = HeaderName::from_static("turnstile-delay");

/// Whole seconds, rounded up.
pub fn ceil_seconds(us: u64) -> u64 {
    us.div_ceil(1_000_000)
}

/// Numbers below this have their header values made once: the rate-limit headers of most
/// responses (small limits, counts and reset times) then cost no allocation at all.
const SMALL_NUMBERS: usize = 1024;

/// `n` as a header value, as `HeaderValue::from(n)` makes it, but without its two allocations
/// (a growable buffer, then a shared one) on every response.
pub fn number_value(n: u64) -> HeaderValue {
    static SMALL: OnceLock<Vec<HeaderValue>> = OnceLock::new();
    if let Some(value) = usize::try_from(n)
        .ok()
        .and_then(|i| SMALL.get_or_init(small_numbers).get(i))
    {
        return value.clone();
    }
    let mut buf = [0u8; 20];
    HeaderValue::from_bytes(digits(n, &mut buf)).unwrap_or_else(|_| HeaderValue::from(n))
}

/// "00" to "99": two digits a step.
const PAIRS: [u8; 200] = {
    let mut pairs = [0u8; 200];
    let mut i = 0;
    while i < 100 {
        pairs[2 * i] = b'0' + (i / 10) as u8;
        pairs[2 * i + 1] = b'0' + (i % 10) as u8;
        i += 1;
    }
    pairs
};

/// The decimal digits of `n`, written into the end of `buf`, two a step: a loop, where `fmt`
/// would cost several times as much on every response.
pub(crate) fn digits(n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut start = buf.len();
    let mut rest = n;
    while rest >= 100 {
        let pair = (rest % 100) as usize * 2;
        rest /= 100;
        start -= 2;
        buf[start..start + 2].copy_from_slice(&PAIRS[pair..pair + 2]);
    }
    if rest >= 10 {
        let pair = rest as usize * 2;
        start -= 2;
        buf[start..start + 2].copy_from_slice(&PAIRS[pair..pair + 2]);
    } else {
        start -= 1;
        buf[start] = b'0' + rest as u8;
    }
    &buf[start..]
}

/// The values of 0 to `SMALL_NUMBERS - 1`, all slices of one string that lives as long as the
/// process, so cloning one copies a pointer (no reference count).
fn small_numbers() -> Vec<HeaderValue> {
    let mut text = String::new();
    let mut ends = Vec::with_capacity(SMALL_NUMBERS);
    for i in 0..SMALL_NUMBERS {
        text.push_str(&i.to_string());
        ends.push(text.len());
    }
    let text: &'static str = Box::leak(text.into_boxed_str());
    let mut start = 0;
    ends.into_iter()
        .enumerate()
        .map(|(i, end)| {
            let digits = &text[start..end];
            start = end;
            HeaderValue::from_maybe_shared(Bytes::from_static(digits.as_bytes()))
                .unwrap_or_else(|_| HeaderValue::from(i))
        })
        .collect()
}

/// `Retry-After` in whole seconds, at least 1: the time until the request could succeed.
pub fn retry_after_seconds(outcome: &Outcome) -> u64 {
    ceil_seconds(outcome.retry_after_us).max(1)
}

pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");

/// Where a response's rate-limit fields go: its `HeaderMap`, or, on a lean upstream response,
/// beside the upstream's raw fields (`crate::proxy::fields`), where numbers stay unformatted
/// until the writer writes them. Setting a name replaces what the sink has under it.
pub trait FieldSink {
    fn set(&mut self, name: &HeaderName, value: HeaderValue);
    fn set_number(&mut self, name: &HeaderName, n: u64);
}

impl FieldSink for HeaderMap {
    fn set(&mut self, name: &HeaderName, value: HeaderValue) {
        self.insert(name.clone(), value);
    }

    fn set_number(&mut self, name: &HeaderName, n: u64) {
        self.insert(name.clone(), number_value(n));
    }
}

/// `rate_limit_headers:`: which fields a route's responses carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HeaderMode {
    /// `X-RateLimit-Limit`, `-Remaining`, `-Reset`.
    #[default]
    XRateLimit,
    /// `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers-11).
    Ietf,
    Both,
    None,
}

impl HeaderMode {
    pub fn parse(text: &str) -> Result<Self, String> {
        match text {
            "x-ratelimit" => Ok(HeaderMode::XRateLimit),
            "ietf" => Ok(HeaderMode::Ietf),
            "both" => Ok(HeaderMode::Both),
            "none" => Ok(HeaderMode::None),
            other => Err(format!(
                "`{other}` is not a header mode; expected `x-ratelimit`, `ietf`, `both` or `none`"
            )),
        }
    }

    fn x_ratelimit(self) -> bool {
        matches!(self, HeaderMode::XRateLimit | HeaderMode::Both)
    }

    fn ietf(self) -> bool {
        matches!(self, HeaderMode::Ietf | HeaderMode::Both)
    }
}

/// The most policies a route may have: which of them applied to a request is one `u64`.
pub const MAX_POLICIES: usize = 64;

/// What one request's decision gives its rate-limit fields: the governing policy (by index in
/// the route's policies) with its outcome, and the enforced policies that applied (bit `i` for
/// policy `i`). Shadow policies never appear: clients see only what is enforced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Limits {
    pub governing: Option<(usize, Outcome)>,
    pub applied: u64,
    /// Admitted for later (pacing): how long the request waited for its slot, in µs, sent as
    /// `Turnstile-Delay` (seconds, to the millisecond, rounded up).
    pub delayed_us: u64,
}

/// A route's rate-limit fields, prepared at config load: the per-request work is formatting two
/// numbers (and joining items when only some policies applied).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RateLimitHeaders {
    pub mode: HeaderMode,
    /// Per policy, its `RateLimit-Policy` item: `"name";q=Q;w=W`.
    items: Vec<Box<str>>,
    /// Per policy, its name as a Structured Field String: `"name"`.
    names: Vec<Box<str>>,
    /// The enforced policies (bit `i` for policy `i`); shadow policies are never listed.
    enforced: u64,
    /// The concurrency policies (bit `i` for policy `i`): their `t` does not count time.
    concurrent: u64,
    /// The `RateLimit-Policy` value when every enforced policy applied, the common case.
    all: Option<HeaderValue>,
    /// Per policy, its limit (`X-RateLimit-Limit`) as a number and as a value made once: a
    /// limit of 1024 or more would otherwise cost an allocation on every response.
    limits: Vec<(u64, HeaderValue)>,
}

impl RateLimitHeaders {
    /// `policies` in the route's order, by name, rule and whether it is shadow (at most
    /// [`MAX_POLICIES`]).
    pub fn new<'p>(
        mode: HeaderMode,
        policies: impl IntoIterator<Item = (&'p str, &'p Rule, bool)>,
    ) -> Self {
        let mut items = Vec::new();
        let mut names = Vec::new();
        let mut limits = Vec::new();
        let mut enforced = 0u64;
        let mut concurrent = 0u64;
        for (i, (name, rule, shadow)) in policies.into_iter().enumerate() {
            let name = sf_string(name);
            let item = match (quota_policy(rule), rule) {
                ((q, _), Rule::Concurrency(_)) => {
                    format!("{name};q={q};qu=\"concurrent-requests\"")
                }
                ((q, Some(w)), _) => format!("{name};q={q};w={w}"),
                ((q, None), _) => format!("{name};q={q}"),
            };
            if matches!(rule, Rule::Concurrency(_)) && i < MAX_POLICIES {
                concurrent |= 1 << i;
            }
            items.push(item.into_boxed_str());
            names.push(name.into_boxed_str());
            let limit = quota_units(rule);
            limits.push((limit, number_value(limit)));
            if !shadow && i < MAX_POLICIES {
                enforced |= 1 << i;
            }
        }
        let mut h = RateLimitHeaders {
            mode,
            items,
            names,
            enforced,
            concurrent,
            all: None,
            limits,
        };
        h.all = h.join(enforced);
        h
    }

    /// Writes the fields of `limits` (none when no policy governs: nothing applied, or the store
    /// failed open). `limited`: the request was refused, so nothing remains.
    pub fn insert(&self, headers: &mut impl FieldSink, limits: &Limits, limited: bool) {
        let Some((policy, outcome)) = limits.governing else {
            return;
        };
        if limits.delayed_us > 0 && self.mode != HeaderMode::None {
            let ms = limits.delayed_us.div_ceil(1000);
            let value = format!("{}.{:03}", ms / 1000, ms % 1000);
            if let Ok(value) = HeaderValue::from_str(&value) {
                headers.set(&TURNSTILE_DELAY, value);
            }
        }
        let remaining = if limited { 0 } else { outcome.remaining };
        let reset = ceil_seconds(outcome.reset_us);
        if self.mode.x_ratelimit() {
            match self.limits.get(policy) {
                Some((n, value)) if *n == outcome.limit => {
                    headers.set(&X_RATELIMIT_LIMIT, value.clone());
                }
                _ => headers.set_number(&X_RATELIMIT_LIMIT, outcome.limit),
            }
            headers.set_number(&X_RATELIMIT_REMAINING, remaining);
            headers.set_number(&X_RATELIMIT_RESET, reset);
        }
        if !self.mode.ietf() {
            return;
        }
        if let Some(value) = self.policy_value(limits.applied) {
            headers.set(&RATELIMIT_POLICY, value);
        }
        if let Some(name) = self.names.get(policy) {
            // The effective window (see the module comment): on a refusal, `Retry-After` itself.
            let window = if limited {
                retry_after_seconds(&outcome)
            } else if policy < MAX_POLICIES && self.concurrent & (1 << policy) != 0 {
                0
            } else {
                reset
            };
            let available = outcome.remaining;
            let mut value = String::with_capacity(name.len() + 24);
            let _ = write!(value, "{name};r={available};t={window}");
            if let Ok(value) = HeaderValue::from_str(&value) {
                headers.set(&RATELIMIT, value);
            }
        }
    }

    /// The `RateLimit-Policy` list of the policies in `applied`.
    fn policy_value(&self, applied: u64) -> Option<HeaderValue> {
        if applied == self.enforced {
            return self.all.clone();
        }
        self.join(applied)
    }

    fn join(&self, applied: u64) -> Option<HeaderValue> {
        let mut value = String::with_capacity(64);
        for (i, item) in self.items.iter().enumerate().take(MAX_POLICIES) {
            if applied & (1 << i) != 0 {
                if !value.is_empty() {
                    value.push_str(", ");
                }
                value.push_str(item);
            }
        }
        HeaderValue::from_str(&value).ok()
    }
}

/// The draft-03 fields (`RateLimit-Limit`, `-Remaining`, `-Reset` in delta seconds rounded up)
/// that Envoy's rate limit service returns in `response_headers_to_add`: its protocol's names,
/// with the numbers computed as the gateway's `X-RateLimit-*` are.
pub fn draft03(limit: u64, remaining: u64, reset_us: u64) -> [(&'static str, String); 3] {
    [
        ("RateLimit-Limit", limit.to_string()),
        ("RateLimit-Remaining", remaining.to_string()),
        ("RateLimit-Reset", ceil_seconds(reset_us).to_string()),
    ]
}

/// A Structured Field String (RFC 9651 §3.3.3): quoted, with `"` and `\` escaped. Policy names
/// are letters, digits, `_` and `-`, so this only quotes them.
fn sf_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars().filter(|c| (' '..='~').contains(c)) {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// `q` and `w` of a rule's quota policy (see the module comment).
pub fn quota_policy(rule: &Rule) -> (u64, Option<u64>) {
    (quota_units(rule), window(rule))
}

fn quota_units(rule: &Rule) -> u64 {
    match rule {
        Rule::TokenBucket(tb) => tb.burst,
        Rule::SlidingWindow(sw) => sw.limit,
        Rule::Quota(q) => q.limit,
        Rule::Concurrency(c) => c.limit,
    }
}

/// `w`: none for a concurrency limit, which has no window (the draft makes `w` optional).
fn window(rule: &Rule) -> Option<u64> {
    Some(match rule {
        Rule::TokenBucket(tb) => {
            let refill_s = (tb.burst as f64 / tb.rate).ceil();
            (refill_s as u64).max(1)
        }
        Rule::SlidingWindow(sw) => ceil_seconds(sw.window_us).max(1),
        // A calendar quota's period, at its nominal length (a DST day is 23 or 25 h, a month
        // 28 to 31 days: `t` in `RateLimit` gives the exact time to the boundary).
        Rule::Quota(q) => match q.per {
            Per::Second => 1,
            Per::Minute => 60,
            Per::Hour => 3_600,
            Per::Day => 86_400,
            Per::Week => 7 * 86_400,
            Per::Month => 30 * 86_400,
        },
        Rule::Concurrency(_) => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::{SlidingWindow, TokenBucket};

    #[test]
    fn digits_are_the_formatters_for_every_length() {
        let mut n = 0u64;
        let mut cases = vec![0, 9, 10, 99, 100, 101, 999, 1000, u64::MAX];
        for _ in 0..2000 {
            n = n
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            cases.push(n >> (n % 64));
        }
        for n in cases {
            let mut buf = [0u8; 20];
            assert_eq!(digits(n, &mut buf), n.to_string().as_bytes(), "{n}");
        }
    }

    fn outcome(remaining: u64, reset_us: u64) -> Outcome {
        Outcome {
            allowed: true,
            limit: 20,
            remaining,
            reset_us,
            retry_after_us: 0,
        }
    }

    #[test]
    fn token_bucket_quota_is_the_burst_over_its_refill_time_rounded_up() {
        let tb = |rate, burst| Rule::TokenBucket(TokenBucket { rate, burst });
        assert_eq!(quota_policy(&tb(20.0 / 60.0, 20)), (20, Some(60)));
        assert_eq!(quota_policy(&tb(3.0, 10)), (10, Some(4)));
        assert_eq!(quota_policy(&tb(1000.0, 1)), (1, Some(1)));
        let sw = Rule::SlidingWindow(SlidingWindow {
            limit: 100,
            window_us: 1_500_000,
            buckets: 0,
        });
        assert_eq!(quota_policy(&sw), (100, Some(2)));
    }

    #[test]
    fn ietf_fields_list_the_applied_policies_and_the_governing_one() {
        let a = Rule::TokenBucket(TokenBucket {
            rate: 1.0 / 3.0,
            burst: 20,
        });
        let b = Rule::SlidingWindow(SlidingWindow {
            limit: 100,
            window_us: 10_000_000,
            buckets: 0,
        });
        let h = RateLimitHeaders::new(
            HeaderMode::Ietf,
            [
                ("per_user", &a, false),
                ("per_ip", &b, false),
                ("shadowed", &b, true),
            ],
        );
        let mut headers = HeaderMap::new();
        let limits = Limits {
            governing: Some((0, outcome(5, 2_000_001))),
            applied: 0b11,
            delayed_us: 0,
        };
        h.insert(&mut headers, &limits, false);
        assert_eq!(
            headers[&RATELIMIT_POLICY],
            r#""per_user";q=20;w=60, "per_ip";q=100;w=10"#
        );
        assert_eq!(headers[&RATELIMIT], r#""per_user";r=5;t=3"#);
        assert!(headers.get("x-ratelimit-limit").is_none());

        let mut headers = HeaderMap::new();
        let limits = Limits {
            governing: Some((1, outcome(7, 0))),
            applied: 0b10,
            delayed_us: 0,
        };
        h.insert(&mut headers, &limits, true);
        assert_eq!(headers[&RATELIMIT_POLICY], r#""per_ip";q=100;w=10"#);
        // Refused: `r` is what is available, `t` is `Retry-After` (at least 1 s).
        assert_eq!(headers[&RATELIMIT], r#""per_ip";r=7;t=1"#);
    }

    /// The limit's value is made once per policy; an outcome with another limit (an override)
    /// still reports its own.
    #[test]
    fn x_ratelimit_limit_is_the_outcome_s_own() {
        let a = Rule::TokenBucket(TokenBucket {
            rate: 1.0,
            burst: 5_000,
        });
        let h = RateLimitHeaders::new(HeaderMode::XRateLimit, [("p", &a, false)]);
        for limit in [5_000, 20, 70_000, 5_000] {
            let limits = Limits {
                governing: Some((
                    0,
                    Outcome {
                        limit,
                        ..outcome(3, 0)
                    },
                )),
                applied: 1,
                delayed_us: 0,
            };
            let mut headers = HeaderMap::new();
            h.insert(&mut headers, &limits, false);
            assert_eq!(headers["x-ratelimit-limit"], limit.to_string().as_str());
            assert_eq!(headers["x-ratelimit-remaining"], "3");
        }
    }

    #[test]
    fn modes_choose_the_dialects() {
        let a = Rule::TokenBucket(TokenBucket {
            rate: 1.0,
            burst: 20,
        });
        let limits = Limits {
            governing: Some((0, outcome(5, 1_000_000))),
            applied: 1,
            delayed_us: 0,
        };
        for (mode, x, ietf) in [
            (HeaderMode::XRateLimit, true, false),
            (HeaderMode::Ietf, false, true),
            (HeaderMode::Both, true, true),
            (HeaderMode::None, false, false),
        ] {
            let mut headers = HeaderMap::new();
            RateLimitHeaders::new(mode, [("p", &a, false)]).insert(&mut headers, &limits, false);
            assert_eq!(headers.contains_key("x-ratelimit-remaining"), x, "{mode:?}");
            assert_eq!(headers.contains_key(&RATELIMIT), ietf, "{mode:?}");
            assert_eq!(headers.contains_key(&RATELIMIT_POLICY), ietf, "{mode:?}");
        }
        assert_eq!(sf_string(r#"a"b\c"#), r#""a\"b\\c""#);
    }

    /// The lean writer's sink (fields kept unformatted beside a lean upstream response's) ends
    /// as the same fields as the `HeaderMap` sink, in every mode, limited or not, whatever the
    /// upstream sent under the same names.
    #[test]
    fn both_sinks_give_the_same_fields() {
        use crate::proxy::fields::RawFields;
        let a = Rule::TokenBucket(TokenBucket {
            rate: 1.0,
            burst: 5_000,
        });
        let head = bytes::Bytes::from_static(
            b"HTTP/1.1 200 OK\r\nx-ratelimit-limit: 1\r\nRateLimit: x\r\nServer: up\r\n\r\n",
        );
        let spans = [[17, 34, 36, 37], [39, 48, 50, 51], [53, 59, 61, 63]];
        for mode in [
            HeaderMode::XRateLimit,
            HeaderMode::Ietf,
            HeaderMode::Both,
            HeaderMode::None,
        ] {
            for limited in [false, true] {
                let h = RateLimitHeaders::new(mode, [("p", &a, false)]);
                let limits = Limits {
                    governing: Some((0, outcome(1_234_567, 2_500_000))),
                    applied: 1,
                    delayed_us: 0,
                };
                let mut raw = RawFields::new(head.clone(), spans.to_vec());
                h.insert(&mut raw, &limits, limited);
                let mut via_raw = HeaderMap::new();
                raw.merge_into(&mut via_raw);

                let mut via_map = HeaderMap::new();
                RawFields::new(head.clone(), spans.to_vec()).merge_into(&mut via_map);
                h.insert(&mut via_map, &limits, limited);

                let sorted = |m: &HeaderMap| {
                    let mut v: Vec<String> = m
                        .iter()
                        .map(|(n, v)| format!("{n}={}", v.to_str().unwrap_or("?")))
                        .collect();
                    v.sort();
                    v
                };
                assert_eq!(
                    sorted(&via_raw),
                    sorted(&via_map),
                    "{mode:?} limited={limited}"
                );
                assert_eq!(via_map["server"], "up");
            }
        }
    }
}
