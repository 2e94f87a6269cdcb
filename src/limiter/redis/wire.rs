//! The wire format between the store and `scripts/decide.lua`: key names, arguments, the reply.

use std::fmt::Write as _;

use fred::prelude::Value;

use crate::limiter::{calendar, Check, Clock, Decision, Outcome, Rule, StoreError, SystemClock};

/// The Redis key of a check: `key_prefix{identity}:kind`. The hash tag puts each counter in
/// one Cluster slot; the kind suffix keeps one data type per key, and for the bucketed window
/// the bucket width too (bucket indexes mean nothing under another width).
pub fn key(prefix: &str, check: &Check<'_>) -> String {
    let mut key = String::with_capacity(prefix.len() + check.key.len() + 24);
    key.push_str(prefix);
    key.push('{');
    escape_tag(check.key, &mut key);
    key.push_str("}:");
    key.push_str(check.rule.kind());
    if let Rule::SlidingWindow(sw) = check.rule {
        if sw.buckets > 0 {
            // Infallible for a String.
            let _ = write!(key, ":{}:{}", sw.window_us, sw.buckets);
        }
    }
    if let Rule::Quota(q) = check.rule {
        // One counter per period length; the period itself is inside (decide.lua's `q_eval`).
        key.push(':');
        key.push_str(q.per.as_str());
    }
    key
}

/// The script's ARGV: `now` (`None`: the script reads Redis `TIME`), then
/// `kind, p1, p2, p3, cost, shadow` per check; a concurrency check that commits takes `lease`.
/// A calendar quota's period is computed here, at `now` or else at this gateway's wall clock
/// (`docs/algorithms.md` on clock skew).
pub fn args(now: Option<u64>, checks: &[Check<'_>], lease: u64) -> Vec<Value> {
    let mut wall = now;
    let int = |v: u64| Value::Integer(i64::try_from(v).unwrap_or(i64::MAX));
    let mut args = Vec::with_capacity(1 + 6 * checks.len());
    args.push(match now {
        Some(now) => int(now),
        None => Value::from_static_str(""),
    });
    for check in checks {
        match check.rule {
            Rule::TokenBucket(tb) => {
                args.push(Value::from_static_str("tb"));
                // Rust prints the shortest decimal that parses back to the same double.
                args.push(Value::Double(tb.rate));
                args.push(int(tb.burst));
                args.push(Value::Integer(0));
            }
            Rule::SlidingWindow(sw) => {
                args.push(Value::from_static_str("sw"));
                args.push(int(sw.limit));
                args.push(int(sw.window_us));
                args.push(int(u64::from(sw.buckets)));
            }
            Rule::Concurrency(cc) => {
                args.push(Value::from_static_str("cc"));
                args.push(int(cc.limit));
                args.push(int(cc.lease_ttl_us));
                args.push(int(lease));
            }
            Rule::Quota(q) => {
                let at = *wall.get_or_insert_with(|| SystemClock::default().now_us());
                let period = calendar::period(q.per, q.time_zone, at);
                args.push(Value::from_static_str("q"));
                args.push(int(q.limit));
                args.push(int(period.start));
                args.push(int(period.end));
            }
        }
        args.push(int(check.cost));
        args.push(Value::Integer(i64::from(check.shadow)));
    }
    args
}

/// One decision of a packed batch (decide.lua, "Packed batch"): the words [`args`] would send
/// after `"batch"` (`now` or `-`, the number of checks, six per check), each followed by a space,
/// appended to `out`. The numbers are written exactly as the unpacked call writes them.
pub fn pack(now: Option<u64>, checks: &[Check<'_>], lease: u64, out: &mut String) {
    let mut wall = now;
    let int = |out: &mut String, v: u64| push_word(out, v.min(i64::MAX as u64));
    match now {
        Some(now) => int(out, now),
        None => out.push_str("- "),
    }
    int(out, checks.len() as u64);
    for check in checks {
        match check.rule {
            Rule::TokenBucket(tb) => {
                // As the unpacked call: the shortest decimal that parses back to the same double
                // (for a whole number below 2^53, its digits).
                out.push_str("tb ");
                if tb.rate.fract() == 0.0 && (1.0..9_007_199_254_740_992.0).contains(&tb.rate) {
                    push_word(out, tb.rate as u64);
                } else {
                    // Infallible for a String.
                    let _ = write!(out, "{} ", tb.rate);
                }
                int(out, tb.burst);
                out.push_str("0 ");
            }
            Rule::SlidingWindow(sw) => {
                out.push_str("sw ");
                int(out, sw.limit);
                int(out, sw.window_us);
                int(out, u64::from(sw.buckets));
            }
            Rule::Concurrency(cc) => {
                out.push_str("cc ");
                int(out, cc.limit);
                int(out, cc.lease_ttl_us);
                int(out, lease);
            }
            Rule::Quota(q) => {
                let at = *wall.get_or_insert_with(|| SystemClock::default().now_us());
                let period = calendar::period(q.per, q.time_zone, at);
                out.push_str("q ");
                int(out, q.limit);
                int(out, period.start);
                int(out, period.end);
            }
        }
        int(out, check.cost);
        out.push_str(if check.shadow { "1 " } else { "0 " });
    }
}

/// `v` in decimal and a space.
fn push_word(out: &mut String, v: u64) {
    let mut buf = [0u8; 20];
    for &d in crate::decimal::digits(v, &mut buf) {
        out.push(char::from(d));
    }
    out.push(' ');
}

/// One integer of a packed reply: optional `-`, then 1 to 19 digits, within `i64`.
fn parse_word(word: &[u8]) -> Option<i64> {
    let (negative, digits) = match word.split_first()? {
        (b'-', rest) => (true, rest),
        _ => (false, word),
    };
    if digits.is_empty() || digits.len() > 19 {
        return None;
    }
    let mut value: i64 = 0;
    for &d in digits {
        if !d.is_ascii_digit() {
            return None;
        }
        value = value.checked_mul(10)?.checked_add(i64::from(d - b'0'))?;
    }
    Some(if negative { -value } else { value })
}

/// A packed batch's reply: its integers, read from one string.
#[derive(Debug)]
pub struct Packed(pub Vec<i64>);

impl fred::types::FromValue for Packed {
    fn from_value(value: Value) -> Result<Self, fred::error::Error> {
        let bad = || {
            fred::error::Error::new(
                fred::error::ErrorKind::Parse,
                "decide.lua: a packed reply is integers separated by spaces",
            )
        };
        let text = match &value {
            Value::String(s) => s.as_bytes(),
            Value::Bytes(b) => b.as_ref(),
            _ => return Err(bad()),
        };
        let words = text.split(|&b| b == b' ').filter(|w| !w.is_empty());
        let mut numbers = Vec::with_capacity(text.len() / 2);
        for word in words {
            numbers.push(parse_word(word).ok_or_else(bad)?);
        }
        Ok(Packed(numbers))
    }
}

/// Cluster hash tags end at the first `}`: keep braces (and the escape character itself) out of
/// the tag, injectively, so distinct identities stay distinct keys.
fn escape_tag(identity: &str, out: &mut String) {
    if !identity.bytes().any(|b| matches!(b, b'{' | b'}' | b'%')) {
        out.push_str(identity);
        return;
    }
    for c in identity.chars() {
        match c {
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            '%' => out.push_str("%25"),
            c => out.push(c),
        }
    }
}

/// The script's reply: `allowed_all`, five values per check, then a refund stamp per check.
pub fn decode(reply: &[i64], checks: usize) -> Result<Decision, StoreError> {
    if reply.len() != 1 + 7 * checks {
        return Err(StoreError::Script(format!(
            "decide.lua answered {} values for {checks} checks",
            reply.len()
        )));
    }
    let unsigned =
        |v: i64| u64::try_from(v).map_err(|_| StoreError::Script(format!("negative value {v}")));
    let mut outcomes = crate::limiter::Outcomes::with_capacity(checks);
    for o in reply[1..1 + 5 * checks].chunks_exact(5) {
        outcomes.push(Outcome {
            allowed: o[0] != 0,
            limit: unsigned(o[1])?,
            remaining: unsigned(o[2])?,
            reset_us: unsigned(o[3])?,
            retry_after_us: unsigned(o[4])?,
        });
    }
    Ok(Decision {
        allowed: reply[0] != 0,
        outcomes,
    })
}

/// The charge's ARGV: `"charge"`, then [`args`]: every check's cost is consumed whatever the
/// counter holds (cost from the response).
pub fn charge_args(now: Option<u64>, checks: &[Check<'_>]) -> Vec<Value> {
    let mut out = Vec::with_capacity(2 + 6 * checks.len());
    out.push(Value::from_static_str("charge"));
    out.extend(args(now, checks, 0));
    out
}

/// The renewal's ARGV: `"renew"`, `now`, then `lease TTL, lease` per concurrency check.
pub fn renew_args(now: Option<u64>, checks: &[Check<'_>], lease: u64) -> Vec<Value> {
    let int = |v: u64| Value::Integer(i64::try_from(v).unwrap_or(i64::MAX));
    let mut args = Vec::with_capacity(2 + 2 * checks.len());
    args.push(Value::from_static_str("renew"));
    args.push(match now {
        Some(now) => int(now),
        None => Value::from_static_str(""),
    });
    for check in checks {
        let ttl = match check.rule {
            Rule::Concurrency(cc) => cc.lease_ttl_us,
            _ => 0,
        };
        args.push(int(ttl));
        args.push(int(lease));
    }
    args
}

/// The release's ARGV: a refund of lease `lease` on each concurrency check of `checks`.
pub fn release_args(checks: &[Check<'_>], lease: u64) -> Vec<Value> {
    let lease = i64::try_from(lease).unwrap_or(i64::MAX);
    let entries: Vec<(Check<'_>, [i64; 2])> = checks.iter().map(|c| (*c, [lease, 0])).collect();
    refund_args(&entries)
}

/// What identifies the consumption of check `i` for a refund (only after [`decode`] accepted the
/// reply's length).
pub fn stamp(reply: &[i64], checks: usize, i: usize) -> [i64; 2] {
    let at = 1 + 5 * checks + 2 * i;
    [reply[at], reply[at + 1]]
}

/// The refund's ARGV: `"refund"`, then `kind, cost, burst, stamp1, stamp2` per consumption.
pub fn refund_args(entries: &[(Check<'_>, [i64; 2])]) -> Vec<Value> {
    let int = |v: u64| Value::Integer(i64::try_from(v).unwrap_or(i64::MAX));
    let mut args = Vec::with_capacity(1 + 5 * entries.len());
    args.push(Value::from_static_str("refund"));
    for (check, stamp) in entries {
        args.push(Value::from_static_str(check.rule.kind()));
        args.push(int(check.cost));
        args.push(match check.rule {
            Rule::TokenBucket(tb) => int(tb.burst),
            Rule::SlidingWindow(_) | Rule::Concurrency(_) | Rule::Quota(_) => Value::Integer(0),
        });
        args.push(Value::Integer(stamp[0]));
        args.push(Value::Integer(stamp[1]));
    }
    args
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::{Concurrency, SlidingWindow, TokenBucket};

    /// The packed words are the plain call's arguments, number for number.
    #[test]
    fn a_packed_decision_is_the_plain_arguments_as_words() {
        let rules = [
            Rule::TokenBucket(TokenBucket {
                rate: 1.0 / 3.0,
                burst: 7,
            }),
            Rule::TokenBucket(TokenBucket {
                rate: 1e9,
                burst: 1_000_000_000,
            }),
            Rule::SlidingWindow(SlidingWindow {
                limit: u64::MAX,
                window_us: 60_000_000,
                buckets: 6,
            }),
            Rule::Concurrency(Concurrency {
                limit: 3,
                lease_ttl_us: 30_000_000,
            }),
        ];
        let checks: Vec<Check<'_>> = rules
            .iter()
            .enumerate()
            .map(|(i, rule)| Check {
                key: "k",
                rule,
                cost: i as u64 + 1,
                shadow: i == 1,
            })
            .collect();
        for now in [Some(1_763_900_000_123_457), None] {
            let mut packed = String::new();
            pack(now, &checks, 42, &mut packed);
            let plain: Vec<String> = args(now, &checks, 42)
                .into_iter()
                .map(|v| match v {
                    Value::Integer(i) => i.to_string(),
                    Value::Double(f) => f.to_string(),
                    Value::String(s) if s.is_empty() => "-".to_string(),
                    Value::String(s) => s.to_string(),
                    other => panic!("unexpected {other:?}"),
                })
                .collect();
            let words: Vec<&str> = packed.split(' ').filter(|w| !w.is_empty()).collect();
            let mut expected: Vec<&str> = vec![&plain[0], "4"];
            expected.extend(plain[1..].iter().map(String::as_str));
            assert_eq!(words, expected);
            assert!(packed.ends_with(' ') && !packed.contains("  "));
        }
    }

    #[test]
    fn a_packed_reply_reads_back_and_refuses_anything_else() {
        use fred::types::FromValue;
        let Packed(numbers) =
            Packed::from_value(Value::from("1 3 -2 1763900000123457 ")).expect("packed");
        assert_eq!(numbers, vec![1, 3, -2, 1_763_900_000_123_457]);
        assert!(Packed::from_value(Value::from("1 1.5e+15")).is_err());
        for bad in ["--1", "-", "1-", "9223372036854775808", "+1"] {
            assert!(Packed::from_value(Value::from(bad)).is_err(), "{bad}");
        }
        let Packed(extremes) =
            Packed::from_value(Value::from("9223372036854775807 -9223372036854775807 0"))
                .expect("extremes");
        assert_eq!(extremes, vec![i64::MAX, -i64::MAX, 0]);
        assert!(Packed::from_value(Value::Integer(1)).is_err());
    }

    #[test]
    fn tag_escaping_is_injective_and_brace_free() {
        let mut a = String::new();
        escape_tag("r:p:{x}", &mut a);
        let mut b = String::new();
        escape_tag("r:p:%7Bx%7D", &mut b);
        assert_eq!(a, "r:p:%7Bx%7D");
        assert_eq!(b, "r:p:%257Bx%257D");
        assert!(!a.contains(['{', '}']));
    }

    #[test]
    fn decode_rejects_a_short_reply() {
        assert!(matches!(
            decode(&[1, 1, 5, 4, 0, 0], 1),
            Err(StoreError::Script(_))
        ));
        let reply = [0, 1, 5, 4, 1_000_000, 0, 7, 3];
        let d = decode(&reply, 1).unwrap();
        assert_eq!(stamp(&reply, 1, 0), [7, 3]);
        assert!(!d.allowed);
        assert_eq!(d.outcomes[0].remaining, 4);
    }
}
