//! `concurrency:` and `cost: {response_header}` on a policy: the parts of
//! [`super::policies::policy`] for requests in flight and costs known only from the response
//! (`docs/algorithms.md`).

use std::time::Duration;

use http::{HeaderName, StatusCode};

use super::{parse_duration, Errors};
use crate::config::raw::{RawCost, RawPolicy};
use crate::config::snapshot::{Action, Policy, ResponseCost};
use crate::limiter::{Concurrency, Rule};

/// A lease outlives its request by at most this when the instance holding it dies.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(60);

/// The units taken at admission: the fixed `cost`, or a response cost's `min_cost` (default 1).
pub(super) fn admission_cost(raw: &RawPolicy) -> u64 {
    match &raw.cost {
        None => 1,
        Some(RawCost::Fixed(cost)) => *cost,
        Some(RawCost::Response(rc)) => rc.min_cost.unwrap_or(1),
    }
}

/// `concurrency: {limit, lease_ttl, refuse_with}` as the policy's rule.
pub(super) fn concurrency(e: &mut Errors, path: &str, raw: &RawPolicy) -> Option<Rule> {
    let cc = raw.concurrency.as_ref()?;
    if raw.token_bucket.is_some() || raw.sliding_window.is_some() || raw.quota.is_some() {
        e.add(
            path,
            "give one of `token_bucket`, `sliding_window`, `quota` or `concurrency`",
        );
        return None;
    }
    if raw.cost.is_some() {
        e.add(
            format!("{path}.cost"),
            "a concurrency policy counts requests in flight: each holds one lease, so `cost` \
             does not apply",
        );
    }
    if cc.limit == 0 {
        e.add(format!("{path}.concurrency.limit"), "must be at least 1");
    }
    if let Some(status) = cc.refuse_with {
        if status != 429 && status != 503 {
            e.add(
                format!("{path}.concurrency.refuse_with"),
                format!("`{status}`: must be 429 or 503"),
            );
        }
    }
    let ttl = match &cc.lease_ttl {
        None => Some(DEFAULT_LEASE_TTL),
        Some(text) => e.take(
            format!("{path}.concurrency.lease_ttl"),
            parse_duration(text),
        ),
    }?;
    let lease_ttl_us = ttl.as_micros() as u64;
    if lease_ttl_us < 1000 {
        e.add(
            format!("{path}.concurrency.lease_ttl"),
            "must be at least 1ms",
        );
        return None;
    }
    (cc.limit > 0).then_some(Rule::Concurrency(Concurrency {
        limit: cc.limit,
        lease_ttl_us,
    }))
}

/// The fields that only some kinds have: `refuse_with`, and a cost from the response (on a token
/// bucket or a sliding window only).
pub(super) fn finish(e: &mut Errors, path: &str, raw: &RawPolicy, policy: &mut Policy) {
    if let Some(cc) = &raw.concurrency {
        if cc.refuse_with == Some(503) {
            policy.refuse_with = StatusCode::SERVICE_UNAVAILABLE;
        }
    }
    let Some(RawCost::Response(rc)) = &raw.cost else {
        return;
    };
    if !matches!(policy.rule, Rule::TokenBucket(_) | Rule::SlidingWindow(_)) {
        e.add(
            format!("{path}.cost.response_header"),
            "a cost from the response applies to a token bucket or a sliding window only",
        );
        return;
    }
    let header = e.take(
        format!("{path}.cost.response_header"),
        HeaderName::from_bytes(rc.response_header.as_bytes())
            .map_err(|_| format!("`{}` is not a header name", rc.response_header)),
    );
    let limit = policy.rule.limit();
    let max_cost = rc.max_cost.unwrap_or(limit);
    if max_cost == 0 || max_cost > limit {
        e.add(
            format!("{path}.cost.max_cost"),
            format!("must be 1 to the burst or limit ({limit})"),
        );
    }
    let fallback = rc.fallback.unwrap_or(1);
    if max_cost < policy.cost {
        e.add(
            format!("{path}.cost.max_cost"),
            format!("{max_cost} is less than min_cost ({})", policy.cost),
        );
    }
    if let Some(header) = header {
        policy.response_cost = Some(ResponseCost {
            header,
            fallback,
            min_cost: policy.cost,
            max_cost,
        });
    }
}

/// A concurrency lease lives until the response ends, which only the inline gateway sees: on a
/// check-only route (decided by `forward_auth` alone) it could never be released.
pub(super) fn check_door(e: &mut Errors, path: &str, policy: &Policy, action: Option<&Action>) {
    if matches!(policy.rule, Rule::Concurrency(_)) && matches!(action, Some(Action::CheckOnly)) {
        e.add(
            format!("{path}.concurrency"),
            "a check-only route is decided by forward_auth, which never sees the response end: \
             concurrency needs `upstream` or `respond` (forward_auth does not apply concurrency \
             policies)",
        );
    }
    if policy.response_cost.is_some() && matches!(action, Some(Action::CheckOnly)) {
        e.add(
            format!("{path}.cost.response_header"),
            "a check-only route is decided by forward_auth, which never sees the response: \
             the cost can only be a number there",
        );
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use http::{HeaderValue, StatusCode};

    use crate::config::parse;
    use crate::limiter::{Concurrency, Rule};

    const BASE: &str =
        "upstreams:\n  api:\n    url: http://127.0.0.1:3000\nroutes:\n  - name: a\n    \
                        upstream: api\n    policies:\n      - name: p\n        key: [client_ip]\n";

    fn errors(policy: &str) -> Vec<String> {
        match parse(&format!("{BASE}{policy}"), Path::new("p.yaml")) {
            Ok(_) => panic!("expected errors for:\n{policy}"),
            Err(e) => e.0.iter().map(ToString::to_string).collect(),
        }
    }

    #[test]
    fn concurrency_has_a_lease_ttl_and_a_refusal_status() {
        let s = parse(
            &format!("{BASE}        concurrency: {{ limit: 3, refuse_with: 503 }}\n"),
            Path::new("p.yaml"),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let p = &s.routes[0].policies[0];
        assert_eq!(
            p.rule,
            Rule::Concurrency(Concurrency {
                limit: 3,
                lease_ttl_us: 60_000_000
            })
        );
        assert_eq!(p.refuse_with, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(p.cost, 1);
    }

    #[test]
    fn concurrency_mistakes_are_errors_at_their_field() {
        let e = errors("        concurrency: { limit: 3, refuse_with: 418 }\n");
        assert_eq!(
            e,
            ["p.yaml:10:47: routes[0].policies[0].concurrency.refuse_with: `418`: must be 429 or 503"]
        );
        let e = errors("        concurrency: { limit: 0, lease_ttl: 0s }\n");
        assert!(
            e[0].contains("concurrency.limit: must be at least 1"),
            "{e:?}"
        );
        let e = errors("        cost: 2\n        concurrency: { limit: 3 }\n");
        assert!(
            e[0].contains("policies[0].cost: a concurrency policy"),
            "{e:?}"
        );
        let e = errors(
            "        concurrency: { limit: 3 }\n        token_bucket: { rate: 1/s, burst: 5 }\n",
        );
        assert!(e[0].contains("give one of"), "{e:?}");
    }

    #[test]
    fn concurrency_on_a_check_only_route_is_an_error() {
        let yaml = "routes:\n  - name: a\n    policies:\n      - name: p\n        key: [client_ip]\n        \
                    concurrency: { limit: 3 }\n";
        let e = parse(yaml, Path::new("p.yaml")).expect_err("check-only");
        assert!(
            e.to_string()
                .contains("routes[0].policies[0].concurrency: a check-only route"),
            "{e}"
        );
    }

    #[test]
    fn a_cost_from_the_response_is_clamped_to_min_and_max() {
        let s = parse(
            &format!(
                "{BASE}        token_bucket: {{ rate: 1/s, burst: 50 }}\n        \
                 cost: {{ response_header: X-Usage-Tokens, fallback: 4, min_cost: 2 }}\n"
            ),
            Path::new("p.yaml"),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let p = &s.routes[0].policies[0];
        assert_eq!(p.cost, 2, "admission takes min_cost");
        let rc = p.response_cost.as_ref().expect("response cost");
        assert_eq!(rc.header, "x-usage-tokens");
        assert_eq!(rc.max_cost, 50, "max_cost defaults to the burst");
        let total = |v: Option<&'static str>| rc.total(v.map(HeaderValue::from_static).as_ref());
        assert_eq!(total(Some("17")), 17);
        assert_eq!(total(Some(" 17 ")), 17);
        assert_eq!(total(Some("0")), 2);
        assert_eq!(total(Some("9999")), 50);
        // A number below zero is below min_cost; a fraction is rounded up.
        assert_eq!(total(Some("-3")), 2);
        assert_eq!(total(Some("1.5")), 2);
        assert_eq!(total(Some("17.2")), 18);
        assert_eq!(total(None), 4);
    }

    /// Issue 33 item 12: a whole number too large for a u64 was not a number to the parser and was
    /// charged the fallback (1 by default). Every spelling of a number is read as the number it
    /// writes; only what is not one gets the fallback.
    #[test]
    fn a_reported_cost_above_u64_is_charged_max_cost_not_the_fallback() {
        let s = parse(
            &format!(
                "{BASE}        sliding_window: {{ limit: 1000000, window: 1m }}\n        \
                 cost: {{ response_header: X-Usage-Tokens, fallback: 7, min_cost: 3, \
                 max_cost: 900000 }}\n"
            ),
            Path::new("p.yaml"),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let rc = s.routes[0].policies[0]
            .response_cost
            .as_ref()
            .expect("response cost");
        let total = |v: &'static str| rc.total(Some(&HeaderValue::from_static(v)));
        for (value, want) in [
            // Whole numbers past u64::MAX, however spelled: max_cost.
            ("99999999999999999999999", 900_000),
            ("18446744073709551616", 900_000),
            ("+99999999999999999999999", 900_000),
            (" \t99999999999999999999999\t ", 900_000),
            ("1e+23", 900_000),
            ("1E400", 900_000),
            ("123456789012345678901234567890.5", 900_000),
            // Exact below it, leading zeros and a plus sign too.
            ("18446744073709551615", 900_000),
            ("000000000000000000000000000042", 42),
            ("+42", 42),
            (" 42\t", 42),
            ("42.000001", 43),
            ("4.2e1", 42),
            ("0.1", 3),
            // Below zero: min_cost.
            ("-42", 3),
            ("-99999999999999999999999", 3),
            ("-0", 3),
            ("-1e400", 3),
            // Not a number: the fallback.
            ("", 7),
            ("  ", 7),
            ("0x2a", 7),
            ("1_000", 7),
            ("1 000", 7),
            ("42, 43", 7),
            ("+-42", 7),
            ("--42", 7),
            ("1e", 7),
            (".", 7),
            ("NaN", 7),
            ("inf", 7),
            ("Infinity", 7),
            ("42 tokens", 7),
        ] {
            assert_eq!(total(value), want, "{value:?}");
        }
    }

    #[test]
    fn response_cost_mistakes_are_errors_at_their_field() {
        let e = errors(
            "        token_bucket: { rate: 1/s, burst: 5 }\n        \
             cost: { response_header: \"bad header\", max_cost: 6 }\n",
        );
        assert!(
            e.iter()
                .any(|m| m.contains("cost.response_header: `bad header` is not a header name")),
            "{e:?}"
        );
        assert!(
            e.iter()
                .any(|m| m.contains("cost.max_cost: must be 1 to the burst or limit (5)")),
            "{e:?}"
        );
    }
}
