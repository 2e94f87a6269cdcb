//! `concurrency:` and `cost: {response_header}` / `cost: {usage}` on a policy: the parts of
//! [`super::policies::policy`] for requests in flight and costs known only from the response
//! (`docs/algorithms.md`, `docs/llm.md`).

use std::time::Duration;

use http::{HeaderName, StatusCode};

use super::{parse_duration, Errors};
use crate::config::raw::{RawCost, RawPolicy, RawResponseCost};
use crate::config::snapshot::{Action, CostSource, Policy, ResponseCost};
use crate::config::units::parse_size;
use crate::config::usage::{self, UsageCost, DEFAULT_MAX_BODY, MAX_MAX_BODY};
use crate::limiter::{Concurrency, Rule};

/// A lease outlives its request by at most this when the instance holding it dies.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(60);

/// The units taken at admission: the fixed `cost`, or a response cost's `min_cost` (default 1),
/// or with `reserve: true` its `max_cost` (default: the burst or limit).
pub(super) fn admission_cost(raw: &RawPolicy) -> u64 {
    match &raw.cost {
        None => 1,
        Some(RawCost::Fixed(cost)) => *cost,
        Some(RawCost::Response(rc)) if rc.reserve == Some(true) => rc
            .max_cost
            .or(raw.token_bucket.as_ref().map(|tb| tb.burst))
            .or(raw.sliding_window.as_ref().map(|sw| sw.limit))
            .or(raw.quota.as_ref().map(|q| q.limit))
            .unwrap_or(1),
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
/// bucket, a sliding window or a quota).
pub(super) fn finish(e: &mut Errors, path: &str, raw: &RawPolicy, policy: &mut Policy) {
    if let Some(cc) = &raw.concurrency {
        if cc.refuse_with == Some(503) {
            policy.refuse_with = StatusCode::SERVICE_UNAVAILABLE;
        }
    }
    let Some(RawCost::Response(rc)) = &raw.cost else {
        return;
    };
    let at = |field: &str| format!("{path}.cost.{field}");
    let source = source(e, path, rc);
    if matches!(policy.rule, Rule::Concurrency(_)) {
        e.add(
            at(source_field(rc)),
            "a cost from the response applies to a token bucket, a sliding window or a quota",
        );
        return;
    }
    let reserve = rc.reserve == Some(true);
    if reserve && rc.min_cost.is_some() {
        e.add(
            at("min_cost"),
            "with reserve: true admission takes max_cost; min_cost does not apply",
        );
    }
    let limit = policy.rule.limit();
    let max_cost = rc.max_cost.unwrap_or(limit);
    if max_cost == 0 || max_cost > limit {
        e.add(
            at("max_cost"),
            format!("must be 1 to the burst or limit ({limit})"),
        );
    }
    // A reservation settles down to `min_cost` (1) at least; admission took `max_cost`.
    let min_cost = if reserve { 1 } else { policy.cost };
    if max_cost < min_cost {
        e.add(
            at("max_cost"),
            format!("{max_cost} is less than min_cost ({min_cost})"),
        );
    }
    // No usage in the body: charged in full, the conservative reading (docs/llm.md).
    let usage = rc.usage.is_some();
    let fallback = match usage {
        false => rc.fallback.unwrap_or(1),
        true => rc.fallback.unwrap_or(max_cost),
    };
    if usage && fallback > max_cost {
        e.add(
            at("fallback"),
            format!("{fallback} is more than max_cost ({max_cost})"),
        );
    }
    let Some(source) = source else {
        return;
    };
    policy.response_cost = Some(ResponseCost {
        source,
        fallback,
        min_cost,
        max_cost,
        reserve,
    });
}

/// The field a response cost names its source in, for errors.
fn source_field(rc: &RawResponseCost) -> &'static str {
    if rc.response_header.is_some() {
        "response_header"
    } else {
        "usage"
    }
}

/// `response_header` or `usage` (with its `weights` and `max_body`): exactly one.
fn source(e: &mut Errors, path: &str, rc: &RawResponseCost) -> Option<CostSource> {
    let at = |field: &str| format!("{path}.cost.{field}");
    match (&rc.response_header, &rc.usage) {
        (Some(_), Some(_)) | (None, None) => {
            e.add(
                format!("{path}.cost"),
                "give one of `response_header` or `usage`",
            );
            None
        }
        (Some(header), None) => {
            for (field, given) in [
                ("weights", rc.weights.is_some()),
                ("max_body", rc.max_body.is_some()),
            ] {
                if given {
                    e.add(at(field), "applies to `usage` only");
                }
            }
            e.take(
                at("response_header"),
                HeaderName::from_bytes(header.as_bytes())
                    .map_err(|_| format!("`{header}` is not a header name")),
            )
            .map(CostSource::Header)
        }
        (None, Some(raw)) => {
            let format = e.take(at("usage"), usage::format(raw));
            let weights = e.take(at("weights"), usage::weights(rc.weights.as_ref()));
            let max_body = match &rc.max_body {
                None => Some(DEFAULT_MAX_BODY),
                Some(text) => e.take(
                    at("max_body"),
                    parse_size(text).and_then(|n| {
                        if n == 0 || n > MAX_MAX_BODY {
                            Err(format!("`{text}`: must be 1 byte to 64MiB"))
                        } else {
                            Ok(n as usize)
                        }
                    }),
                ),
            };
            Some(CostSource::Usage(UsageCost {
                format: format?,
                weights: weights?,
                max_body: max_body?,
            }))
        }
    }
}

/// A concurrency lease lives until the response ends, which only the inline gateway and Envoy's
/// external processor see: on a check-only route, without `ext_proc:` (decided by
/// `forward_auth` alone), it could never be released, and a cost from the response never read.
pub(super) fn check_door(
    e: &mut Errors,
    path: &str,
    policy: &Policy,
    action: Option<&Action>,
    ext_proc: bool,
) {
    if ext_proc {
        return;
    }
    if matches!(policy.rule, Rule::Concurrency(_)) && matches!(action, Some(Action::CheckOnly)) {
        e.add(
            format!("{path}.concurrency"),
            "a check-only route is decided by forward_auth, which never sees the response end: \
             concurrency needs `upstream` or `respond`, or `ext_proc:` (forward_auth does not \
             apply concurrency policies)",
        );
    }
    if policy.response_cost.is_some() && matches!(action, Some(Action::CheckOnly)) {
        e.add(
            format!("{path}.cost.response_header"),
            "a check-only route is decided by forward_auth, which never sees the response: \
             the cost can only be a number there (unless `ext_proc:` decides it)",
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
        assert_eq!(rc.header().map(|h| h.as_str()), Some("x-usage-tokens"));
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

    #[test]
    fn a_usage_cost_reserves_max_cost_and_weighs_its_tokens() {
        let s = parse(
            &format!(
                "{BASE}        token_bucket: {{ rate: 1000/m, burst: 20000 }}\n        \
                 cost: {{ usage: openai, reserve: true, max_cost: 4000, \
                 weights: {{ output: 4, cached_input: 0.5 }} }}\n"
            ),
            Path::new("p.yaml"),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let p = &s.routes[0].policies[0];
        assert_eq!(p.cost, 4000, "admission reserves max_cost");
        let rc = p.response_cost.as_ref().expect("response cost");
        assert!(rc.reserve);
        assert_eq!((rc.min_cost, rc.max_cost, rc.fallback), (1, 4000, 4000));
        let usage = rc.usage().expect("usage");
        assert_eq!(usage.format, crate::config::usage::UsageFormat::OpenAi);
        assert_eq!(usage.max_body, 1 << 20);
        let w = usage.weights;
        assert_eq!(
            (w.input, w.output, w.cached_input, w.reasoning),
            (1.0, 4.0, 0.5, 4.0)
        );
    }

    /// `reserve: true` and the optimistic `min_cost` apply to windows (exact and bucketed) and to
    /// calendar quotas as to a bucket: admission reserves `max_cost`, by default the limit.
    #[test]
    fn a_window_or_a_quota_takes_a_reserving_or_an_optimistic_usage_cost() {
        for rule in [
            "sliding_window: { limit: 5000, window: 1h }",
            "sliding_window: { limit: 5000, window: 1h, buckets: 60 }",
            "quota: { limit: 5000, per: month, time_zone: Europe/Berlin }",
        ] {
            let load = |cost: &str| {
                parse(
                    &format!("{BASE}        {rule}\n        cost: {cost}\n"),
                    Path::new("p.yaml"),
                )
                .unwrap_or_else(|e| panic!("{rule}: {e}"))
            };
            let s = load("{ usage: openai, reserve: true }");
            let p = &s.routes[0].policies[0];
            assert_eq!(p.cost, 5000, "{rule}: admission reserves the limit");
            let rc = p.response_cost.as_ref().expect("response cost");
            assert!(
                rc.reserve && rc.max_cost == 5000 && rc.min_cost == 1,
                "{rule}"
            );
            let s = load("{ usage: anthropic, min_cost: 10, max_cost: 800 }");
            let p = &s.routes[0].policies[0];
            let rc = p.response_cost.as_ref().expect("response cost");
            assert_eq!((p.cost, rc.min_cost, rc.max_cost), (10, 10, 800), "{rule}");
            assert!(!rc.reserve);
        }
    }

    #[test]
    fn usage_cost_mistakes_are_errors_at_their_field() {
        let tb = "        token_bucket: { rate: 1/s, burst: 50 }\n";
        for (rule, cost, want) in [
            (
                tb,
                "{ usage: openai, reserve: true, min_cost: 2 }",
                "cost.min_cost: with reserve: true",
            ),
            (
                tb,
                "{ usage: gemini }",
                "cost.usage: `gemini`: give `openai`, `anthropic`",
            ),
            (
                tb,
                "{ usage: { output: usage.out } }",
                "cost.usage: `usage.out` is not a JSON pointer",
            ),
            (
                tb,
                "{ usage: openai, weights: { output: -1 } }",
                "cost.weights: output: `-1` must be a number at least 0",
            ),
            (
                tb,
                "{ usage: openai, response_header: x-cost }",
                "cost: give one of `response_header` or `usage`",
            ),
            (
                tb,
                "{ response_header: x-cost, weights: { output: 2 } }",
                "cost.weights: applies to `usage` only",
            ),
            (
                tb,
                "{ usage: openai, fallback: 60 }",
                "cost.fallback: 60 is more than max_cost (50)",
            ),
            (
                tb,
                "{ usage: openai, max_body: 1GiB }",
                "cost.max_body: `1GiB`: must be 1 byte to 64MiB",
            ),
        ] {
            let e = errors(&format!("{rule}        cost: {cost}\n"));
            assert!(e.iter().any(|m| m.contains(want)), "{cost}: {e:?}");
            assert!(e.iter().all(|m| m.starts_with("p.yaml:")), "{e:?}");
        }
    }
}
