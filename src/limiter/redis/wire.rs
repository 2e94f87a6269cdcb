//! The wire format between the store and `scripts/decide.lua`: key names, arguments, the reply.

use std::io::Write as _;

use fred::prelude::Value;

use crate::limiter::{calendar, Check, Clock, Decision, Outcome, Rule, StoreError, SystemClock};

/// The Redis key of a check: `key_prefix{identity}:kind`. The hash tag puts each counter in
/// one Cluster slot; the kind suffix keeps one data type per key, and for the bucketed window
/// the bucket width too (bucket indexes mean nothing under another width).
pub fn key(prefix: &str, check: &Check<'_>) -> String {
    let mut key = Vec::with_capacity(key_len(prefix, check));
    push_key(prefix, check, &mut key);
    // Every part pushed is a `str` (an escape is ASCII): always UTF-8.
    String::from_utf8(key).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

/// Room for [`key`]'s bytes (enough for every kind's suffix).
pub fn key_len(prefix: &str, check: &Check<'_>) -> usize {
    prefix.len() + check.key.len() + 48
}

/// Appends [`key`] to `out`: a batch writes every key of a request into one buffer, without a
/// `String` per key (`batch.rs`).
pub fn push_key(prefix: &str, check: &Check<'_>, out: &mut Vec<u8>) {
    out.extend_from_slice(prefix.as_bytes());
    out.push(b'{');
    escape_tag(check.key, out);
    out.extend_from_slice(b"}:");
    out.extend_from_slice(check.rule.kind().as_bytes());
    if let Rule::SlidingWindow(sw) = check.rule {
        if sw.buckets == 0 {
            // decide.lua's layout of one member per time with units (docs/redis.md, Keys).
            out.extend_from_slice(b":2");
        } else {
            // Infallible for a Vec.
            let _ = write!(out, ":{}:{}", sw.window_us, sw.buckets);
        }
    }
    if let Rule::Quota(q) = check.rule {
        // One counter per period length; the period itself is inside (decide.lua's `q_eval`).
        out.push(b':');
        out.extend_from_slice(q.per.as_str().as_bytes());
    }
}

/// The script's ARGV: `now` (`None`: the script reads Redis `TIME`), then
/// `kind, p1, p2, p3, cost, shadow` per check; a concurrency check that commits takes `lease`.
/// A calendar quota's period is computed here, at `now` or else at this gateway's wall clock
/// (`docs/algorithms.md` on clock skew); a paced quota's kind is the negated end of the period
/// after it ([`quota_kind`]).
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
                args.push(match quota_kind(check, period) {
                    Some(kind) => Value::Integer(kind),
                    None => Value::from_static_str("q"),
                });
                args.push(int(q.limit));
                args.push(int(period.start));
                args.push(int(period.end));
            }
        }
        args.push(int(check.cost));
        args.push(int(mode(check)));
    }
    args
}

/// A paced quota's kind on the wire (decide.lua's `q_eval`): the end of the period after
/// `period` (epoch µs), negated, which the script needs to reserve there and no other argument
/// has room for. `None` for a quota that does not pace, or whose next period does not start
/// where this one ends (`pacing::next_period`): its kind is `q`.
pub fn quota_kind(check: &Check<'_>, period: calendar::Period) -> Option<i64> {
    let Rule::Quota(q) = check.rule else {
        return None;
    };
    if check.max_delay_us.is_none() || check.shadow {
        return None;
    }
    let next = crate::limiter::pacing::next_period(q, period)?;
    Some(-i64::try_from(next.end).ok()?)
}

/// A check's last argument (decide.lua's `mode`): 0 enforced, 1 shadow, or for a paced check
/// [`PACED`] plus its `max_delay` in µs.
pub fn mode(check: &Check<'_>) -> u64 {
    match check.max_delay_us {
        Some(max) if !check.shadow => PACED.saturating_add(max.min(MAX_DELAY_US)),
        _ => u64::from(check.shadow),
    }
}

/// The mode of a paced check with no delay allowed (decide.lua's `PACED`).
pub const PACED: u64 = 2;

/// The longest `max_delay` the wire carries (a day; the config allows less): the mode stays an
/// exact double.
pub const MAX_DELAY_US: u64 = 86_400_000_000;

/// One decision of a packed batch (decide.lua, "Packed batch"): the numbers [`args`] would send
/// after `"batch"`, each a little-endian double appended to `out`: `now` (-1 for Redis `TIME`), the
/// number of checks, then per check its kind (1 tb, 2 sw, 3 cc, 4 q, or a paced quota's negated
/// next period end, [`quota_kind`]), `p1`, `p2`, `p3`, `cost` and `shadow` (1 or 0). A double is what the script makes of every number: an integer goes as
/// the double Lua's `tonumber` reads from its decimal (both round to nearest, ties to even), and
/// a rate is its own double.
pub fn pack(now: Option<u64>, checks: &[Check<'_>], lease: u64, out: &mut Vec<u8>) {
    let mut wall = now;
    let int = |v: u64| v.min(i64::MAX as u64) as f64;
    let mut put = |v: f64| out.extend_from_slice(&v.to_le_bytes());
    put(now.map_or(-1.0, int));
    put(checks.len() as f64);
    for check in checks {
        let (kind, p1, p2, p3) = match check.rule {
            Rule::TokenBucket(tb) => (1.0, tb.rate, int(tb.burst), 0.0),
            Rule::SlidingWindow(sw) => {
                (2.0, int(sw.limit), int(sw.window_us), f64::from(sw.buckets))
            }
            Rule::Concurrency(cc) => (3.0, int(cc.limit), int(cc.lease_ttl_us), int(lease)),
            Rule::Quota(q) => {
                let at = *wall.get_or_insert_with(|| SystemClock::default().now_us());
                let period = calendar::period(q.per, q.time_zone, at);
                let kind = quota_kind(check, period).map_or(4.0, |k| k as f64);
                (kind, int(q.limit), int(period.start), int(period.end))
            }
        };
        for v in [kind, p1, p2, p3, int(check.cost), int(mode(check))] {
            put(v);
        }
    }
}

/// A packed batch's reply, one string of little-endian doubles, kept whole: each decision of the
/// batch reads its own part with [`decode_packed`].
#[derive(Debug)]
pub struct Packed(pub bytes::Bytes);

impl fred::types::FromValue for Packed {
    fn from_value(value: Value) -> Result<Self, fred::error::Error> {
        let bytes = match value {
            Value::Bytes(b) => b,
            Value::String(s) => s.into_inner(),
            _ => {
                return Err(fred::error::Error::new(
                    fred::error::ErrorKind::Parse,
                    "decide.lua: a packed reply is one string",
                ))
            }
        };
        Ok(Packed(bytes))
    }
}

/// The integer a packed reply's double (at `chunk`) stands for, as Redis makes a Lua number an
/// integer reply: truncated toward zero (`as` does). `None` for what no `i64` holds (NaN,
/// infinities, beyond ±2^63): 2^63 is exact as a double, and no double lies strictly between
/// -2^63 - 1 and -2^63, so checking the value itself is checking its truncation.
fn packed_integer(chunk: &[u8]) -> Option<i64> {
    let mut le = [0u8; 8];
    le.copy_from_slice(chunk);
    let v = f64::from_le_bytes(le);
    (-9_223_372_036_854_775_808.0..9_223_372_036_854_775_808.0)
        .contains(&v)
        .then_some(v as i64)
}

/// One decision's part of a packed reply (`1 + 7 * checks` doubles), read as [`decode`] reads
/// the integers, straight from the bytes, the refund stamps included (a reservation is settled
/// against them; a delayed decision's slot is the second stamp).
pub fn decode_packed(bytes: &[u8], checks: usize) -> Result<Decision, StoreError> {
    if bytes.len() != 8 * (1 + 7 * checks) {
        return Err(StoreError::Script(format!(
            "decide.lua answered {} bytes for {checks} checks",
            bytes.len()
        )));
    }
    outcomes(checks, |i| {
        packed_integer(&bytes[8 * i..8 * i + 8]).ok_or_else(|| {
            StoreError::Script(
                "decide.lua: a packed reply is whole doubles, each within i64".into(),
            )
        })
    })
}

/// Cluster hash tags end at the first `}`: keep braces (and the escape character itself) out of
/// the tag, injectively, so distinct identities stay distinct keys. Byte by byte: the three are
/// ASCII, which no byte of a multi-byte UTF-8 character equals.
fn escape_tag(identity: &str, out: &mut Vec<u8>) {
    if !identity.bytes().any(|b| matches!(b, b'{' | b'}' | b'%')) {
        out.extend_from_slice(identity.as_bytes());
        return;
    }
    for b in identity.bytes() {
        match b {
            b'{' => out.extend_from_slice(b"%7B"),
            b'}' => out.extend_from_slice(b"%7D"),
            b'%' => out.extend_from_slice(b"%25"),
            b => out.push(b),
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
    outcomes(checks, |i| Ok(reply[i]))
}

/// The decision in a reply whose `i`th integer is `value(i)`: `allowed_all`, five per check,
/// then two stamp values per check, of which the first is the stamp ([`Decision::stamps`]).
fn outcomes(
    checks: usize,
    value: impl Fn(usize) -> Result<i64, StoreError>,
) -> Result<Decision, StoreError> {
    let unsigned = |i: usize| {
        let v = value(i)?;
        u64::try_from(v).map_err(|_| StoreError::Script(format!("negative value {v}")))
    };
    let mut outcomes = crate::limiter::Outcomes::with_capacity(checks);
    for at in (1..1 + 5 * checks).step_by(5) {
        outcomes.push(Outcome {
            allowed: value(at)? != 0,
            limit: unsigned(at + 1)?,
            remaining: unsigned(at + 2)?,
            reset_us: unsigned(at + 3)?,
            retry_after_us: unsigned(at + 4)?,
        });
    }
    // allowed_all is 1 + the delay for an admission held for later, with its slot in the
    // second stamp of every check (decide.lua's `paced`).
    let all = unsigned(0)?;
    let (delay_us, slot_us) = if all > 1 && checks > 0 {
        (all - 1, unsigned(1 + 5 * checks + 1)?)
    } else {
        (0, 0)
    };
    let mut stamps = crate::limiter::Stamps::with_capacity(checks);
    for i in 0..checks {
        stamps.push(unsigned(1 + 5 * checks + 2 * i)?);
    }
    Ok(Decision {
        allowed: all != 0,
        outcomes,
        delay_us,
        slot_us,
        stamps,
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

/// The peek's ARGV: `"peek"`, then [`args`]: every check is evaluated and nothing is written.
pub fn peek_args(now: Option<u64>, checks: &[Check<'_>]) -> Vec<Value> {
    let mut out = Vec::with_capacity(2 + 6 * checks.len());
    out.push(Value::from_static_str("peek"));
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

/// What a concurrency key's waiter queue adds to its key (decide.lua's "Waiting for a lease"):
/// the same hash tag, so the same Cluster slot.
pub const QUEUE_SUFFIX: &str = ":wq";

/// The limit and lease TTL of a concurrency check (0, 0 for another kind).
fn lease_rule(check: &Check<'_>) -> (u64, u64) {
    match check.rule {
        Rule::Concurrency(cc) => (cc.limit, cc.lease_ttl_us),
        _ => (0, 0),
    }
}

fn now_value(now: Option<u64>) -> Value {
    match now {
        Some(now) => Value::Integer(i64::try_from(now).unwrap_or(i64::MAX)),
        None => Value::from_static_str(""),
    }
}

/// The release's ARGV (decide.lua's `release`): lease `lease` on each concurrency check of
/// `checks`, with the waiter's `ticket` ("" for a request that held its lease), hand-offs
/// published on `channels` and the waiter's instance.
pub fn release_args(
    now: Option<u64>,
    channels: &str,
    checks: &[Check<'_>],
    lease: u64,
    ticket: &str,
) -> Vec<Value> {
    let int = |v: u64| Value::Integer(i64::try_from(v).unwrap_or(i64::MAX));
    let mut args = Vec::with_capacity(3 + 4 * checks.len());
    args.push(Value::from_static_str("release"));
    args.push(now_value(now));
    args.push(Value::from(channels));
    for check in checks {
        let (limit, ttl) = lease_rule(check);
        args.extend([int(limit), int(ttl), int(lease), Value::from(ticket)]);
    }
    args
}

/// The enqueue's ARGV (decide.lua's `enqueue`): a ticket for lease `lease` on `check`, for
/// `max_delay_us`, of the waiter on `instance`.
pub fn enqueue_args(
    now: Option<u64>,
    channels: &str,
    check: &Check<'_>,
    lease: u64,
    max_delay_us: u64,
    instance: &str,
) -> Vec<Value> {
    let int = |v: u64| Value::Integer(i64::try_from(v).unwrap_or(i64::MAX));
    let (limit, ttl) = lease_rule(check);
    vec![
        Value::from_static_str("enqueue"),
        now_value(now),
        Value::from(channels),
        int(limit),
        int(ttl),
        int(lease),
        int(max_delay_us),
        Value::from(instance),
    ]
}

/// What identifies the consumption of check `i` for a refund (only after [`decode`] accepted the
/// reply's length).
pub fn stamp(reply: &[i64], checks: usize, i: usize) -> [i64; 2] {
    let at = 1 + 5 * checks + 2 * i;
    [reply[at], reply[at + 1]]
}

/// The refund stamp of check `check` in a decision delayed to slot `at` (decide.lua's
/// `paced`), `stamp` its own in the decision: a bucket needs none, an exact window's member is at
/// `at`, a bucketed window's bucket is the one `at` falls in, a paced quota's period is its
/// stamp's. `None` for the kinds a delayed reservation does not give back.
pub fn unreserve_stamp(check: &Check<'_>, stamp: u64, at: u64) -> Option<[i64; 2]> {
    let at_i = i64::try_from(at).unwrap_or(i64::MAX);
    match check.rule {
        // A paced bucket only while its reservation is the latest (decide.lua's refund).
        Rule::TokenBucket(_) if check.max_delay_us.is_some() => Some([at_i, 0]),
        Rule::TokenBucket(_) => Some([0, 0]),
        // Stamp 2 is 1: the member or bucket stays, emptied (decide.lua's refund).
        Rule::SlidingWindow(sw) if sw.buckets == 0 => Some([at_i, 1]),
        Rule::SlidingWindow(sw) => {
            let width = (sw.window_us / u64::from(sw.buckets)).max(1);
            Some([i64::try_from(at / width).unwrap_or(i64::MAX), 1])
        }
        Rule::Quota(_) if check.max_delay_us.is_some() => {
            Some([i64::try_from(stamp).unwrap_or(i64::MAX), 0])
        }
        Rule::Concurrency(_) | Rule::Quota(_) => None,
    }
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

    /// The reading of a reply double before `packed_integer`: truncated, then range-checked.
    fn integer(v: f64) -> Option<i64> {
        let t = v.trunc();
        (-9_223_372_036_854_775_808.0..9_223_372_036_854_775_808.0)
            .contains(&t)
            .then_some(t as i64)
    }

    /// The packed doubles are the plain call's arguments, number for number, as decide.lua's
    /// `tonumber` reads them (the kind as its number).
    #[test]
    fn a_packed_decision_is_the_plain_arguments_as_doubles() {
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
                max_delay_us: None,
            })
            .collect();
        for now in [Some(1_763_900_000_123_457), None] {
            let mut packed = Vec::new();
            pack(now, &checks, 42, &mut packed);
            assert_eq!(packed.len(), 8 * (2 + 6 * checks.len()));
            let doubles: Vec<f64> = packed
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect();
            // What the script's tonumber makes of each plain argument's decimal.
            let plain: Vec<f64> = args(now, &checks, 42)
                .into_iter()
                .map(|v| match v {
                    Value::Integer(i) => i.to_string().parse().expect("integer"),
                    Value::Double(f) => f.to_string().parse().expect("double"),
                    Value::String(s) if s.is_empty() => -1.0,
                    Value::String(s) => match &*s {
                        "tb" => 1.0,
                        "sw" => 2.0,
                        "cc" => 3.0,
                        "q" => 4.0,
                        other => panic!("unexpected kind {other}"),
                    },
                    other => panic!("unexpected {other:?}"),
                })
                .collect();
            let mut expected = vec![plain[0], 4.0];
            expected.extend(&plain[1..]);
            assert_eq!(doubles, expected);
        }
    }

    #[test]
    fn a_packed_reply_reads_back_and_refuses_anything_else() {
        let packed =
            |values: &[f64]| -> Vec<u8> { values.iter().flat_map(|v| v.to_le_bytes()).collect() };
        let read = |values: &[f64]| -> Vec<Option<i64>> {
            packed(values).chunks_exact(8).map(packed_integer).collect()
        };
        // Truncated toward zero, as Redis returns a Lua number; what no i64 holds is refused.
        assert_eq!(
            read(&[1.0, 3.0, -2.0, 1_763_900_000_123_457.0, 2.9, -2.9, -0.5]),
            [1, 3, -2, 1_763_900_000_123_457, 2, -2, 0].map(Some)
        );
        assert_eq!(
            read(&[
                f64::NAN,
                f64::INFINITY,
                f64::NEG_INFINITY,
                9_223_372_036_854_775_808.0,
                -1e19
            ]),
            [None; 5]
        );
        assert_eq!(
            read(&[-9_223_372_036_854_775_808.0, 4_611_686_018_427_387_904.0]),
            [Some(i64::MIN), Some(1 << 62)]
        );
        // The same integers as `integer`, the reply's reading before.
        for v in [
            0.0,
            -0.0,
            1e300,
            -9.2e18,
            9.2e18,
            123.999,
            -7.5,
            f64::MIN_POSITIVE,
        ] {
            assert_eq!(read(&[v])[0], integer(v), "{v}");
        }
        let decision = decode_packed(&packed(&[0.0, 1.0, 5.0, 4.0, 1e6, 0.0, 7.0, 3.0]), 1)
            .expect("one decision");
        assert!(!decision.allowed);
        assert_eq!(decision.outcomes[0].remaining, 4);
        assert_eq!(decision.outcomes[0].retry_after_us, 0);
        assert!(decode_packed(&packed(&[1.0, 1.0, 5.0]), 1).is_err());
        assert!(decode_packed(&packed(&[0.0; 9]), 1).is_err());
        assert!(decode_packed(&packed(&[1.0, f64::NAN, 5.0, 4.0, 0.0, 0.0, 0.0, 0.0]), 1).is_err());
        assert!(decode_packed(&packed(&[1.0, 1.0, -5.0, 4.0, 0.0, 0.0, 0.0, 0.0]), 1).is_err());
        use fred::types::FromValue;
        let Packed(bytes) = Packed::from_value(Value::Bytes(packed(&[1.0]).into())).expect("bytes");
        assert_eq!(bytes.len(), 8);
        assert!(Packed::from_value(Value::Integer(1)).is_err());
    }

    #[test]
    fn tag_escaping_is_injective_and_brace_free() {
        let mut a = Vec::new();
        escape_tag("r:p:{x}", &mut a);
        let mut b = Vec::new();
        escape_tag("r:p:%7Bx%7D", &mut b);
        assert_eq!(a, b"r:p:%7Bx%7D");
        assert_eq!(b, b"r:p:%257Bx%257D");
        assert!(!a.contains(&b'{') && !a.contains(&b'}'));
        let mut c = Vec::new();
        escape_tag("é{ü}%", &mut c);
        assert_eq!(c, "é%7Bü%7D%25".as_bytes());
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
