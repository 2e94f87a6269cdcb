//! `POST /json` on the admin listener: `ShouldRateLimit` in protojson, as envoyproxy/ratelimit
//! serves it for debugging and non-Envoy clients. 200 when OK, 429 when over the limit, 400 for a
//! request that is not a valid `RateLimitRequest`, 500 when no answer could be given.
//!
//! The mapping is protojson's: lowerCamelCase names (the proto names are accepted too), enums by
//! name, `google.protobuf.Duration` as `"1.5s"`, default values omitted from the response. Unknown
//! fields are rejected, as protojson does by default.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::{Duration, UInt64Value};
use serde_json::{json, Map, Value};

use super::decide::{RlsError, RlsService};
use super::rule::Unit;

/// The `/json` route, with its own state.
pub fn router(service: RlsService) -> Router {
    Router::new()
        .route("/json", post(handle))
        .with_state(service)
}

async fn handle(State(service): State<RlsService>, body: Bytes) -> Response {
    let request = match parse_request(&body) {
        Ok(r) => r,
        Err(message) => return text(StatusCode::BAD_REQUEST, message),
    };
    match service.should_rate_limit(&request).await {
        Ok(response) => {
            let status = if response.overall_code == Code::OverLimit as i32 {
                StatusCode::TOO_MANY_REQUESTS
            } else {
                StatusCode::OK
            };
            let body = response_json(&response).to_string();
            (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
        }
        Err(RlsError::Invalid(message)) => text(StatusCode::BAD_REQUEST, message),
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

fn text(status: StatusCode, message: String) -> Response {
    (status, format!("{message}\n")).into_response()
}

/// The fields of `object`, each under its lowerCamelCase or its proto name; any other is an error.
fn fields<'v>(
    object: &'v Value,
    what: &str,
    known: &[(&str, &str)],
) -> Result<Vec<Option<&'v Value>>, String> {
    let Value::Object(map) = object else {
        return Err(format!("{what} must be a JSON object"));
    };
    let mut out = vec![None; known.len()];
    for (name, value) in map {
        let Some(i) = known
            .iter()
            .position(|(camel, proto)| name == camel || name == proto)
        else {
            return Err(format!("unknown field `{name}` in {what}"));
        };
        if !value.is_null() {
            out[i] = Some(value);
        }
    }
    Ok(out)
}

fn string(value: Option<&Value>, what: &str) -> Result<String, String> {
    match value {
        None => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(format!("{what} must be a string")),
    }
}

/// A uint64: protojson accepts a number or a decimal string.
fn uint64(value: Option<&Value>, what: &str) -> Result<u64, String> {
    let parsed = match value {
        None => return Ok(0),
        Some(Value::Number(n)) => n.as_u64(),
        Some(Value::String(s)) => s.parse::<u64>().ok(),
        Some(_) => None,
    };
    parsed.ok_or_else(|| format!("{what} must be an unsigned integer"))
}

fn uint32(value: Option<&Value>, what: &str) -> Result<u32, String> {
    u32::try_from(uint64(value, what)?)
        .map_err(|_| format!("{what} must be an unsigned 32-bit integer"))
}

fn list<'v>(value: Option<&'v Value>, what: &str) -> Result<&'v [Value], String> {
    match value {
        None => Ok(&[]),
        Some(Value::Array(items)) => Ok(items),
        Some(_) => Err(format!("{what} must be a JSON array")),
    }
}

/// Reads a protojson `RateLimitRequest`.
pub fn parse_request(body: &[u8]) -> Result<RateLimitRequest, String> {
    let value: Value = serde_json::from_slice(body).map_err(|e| format!("invalid JSON: {e}"))?;
    let f = fields(
        &value,
        "the request",
        &[
            ("domain", "domain"),
            ("descriptors", "descriptors"),
            ("hitsAddend", "hits_addend"),
        ],
    )?;
    let mut request = RateLimitRequest {
        domain: string(f[0], "domain")?,
        hits_addend: uint32(f[2], "hitsAddend")?,
        ..Default::default()
    };
    for (i, d) in list(f[1], "descriptors")?.iter().enumerate() {
        let what = format!("descriptors[{i}]");
        let df = fields(
            d,
            &what,
            &[
                ("entries", "entries"),
                ("limit", "limit"),
                ("hitsAddend", "hits_addend"),
            ],
        )?;
        let mut descriptor = RateLimitDescriptor::default();
        for (j, e) in list(df[0], &format!("{what}.entries"))?.iter().enumerate() {
            let what = format!("{what}.entries[{j}]");
            let ef = fields(e, &what, &[("key", "key"), ("value", "value")])?;
            descriptor.entries.push(Entry {
                key: string(ef[0], &format!("{what}.key"))?,
                value: string(ef[1], &format!("{what}.value"))?,
            });
        }
        if let Some(limit) = df[1] {
            let what = format!("{what}.limit");
            let lf = fields(
                limit,
                &what,
                &[("requestsPerUnit", "requests_per_unit"), ("unit", "unit")],
            )?;
            let unit = match lf[1] {
                None => 0,
                Some(Value::String(name)) if name == "UNKNOWN" => 0,
                Some(Value::String(name)) => Unit::parse(name)
                    .filter(|_| name.chars().all(|c| c.is_ascii_uppercase()))
                    .map(Unit::proto)
                    .ok_or_else(|| format!("{what}.unit: unknown unit `{name}`"))?,
                Some(other) => i32::try_from(uint32(Some(other), &format!("{what}.unit"))?)
                    .map_err(|_| format!("{what}.unit is out of range"))?,
            };
            descriptor.limit = Some(RateLimitOverride {
                requests_per_unit: uint32(lf[0], &format!("{what}.requestsPerUnit"))?,
                unit,
            });
        }
        if df[2].is_some() {
            descriptor.hits_addend = Some(UInt64Value {
                value: uint64(df[2], &format!("{what}.hitsAddend"))?,
            });
        }
        request.descriptors.push(descriptor);
    }
    Ok(request)
}

/// protojson's Duration: seconds with 0, 3, 6 or 9 fractional digits.
fn duration(d: &Duration) -> String {
    let nanos = d.nanos.unsigned_abs();
    if nanos == 0 {
        format!("{}s", d.seconds)
    } else if nanos.is_multiple_of(1_000_000) {
        format!("{}.{:03}s", d.seconds, nanos / 1_000_000)
    } else if nanos.is_multiple_of(1_000) {
        format!("{}.{:06}s", d.seconds, nanos / 1_000)
    } else {
        format!("{}.{:09}s", d.seconds, nanos)
    }
}

fn code_name(code: i32) -> &'static str {
    match Code::try_from(code) {
        Ok(Code::Ok) => "OK",
        Ok(Code::OverLimit) => "OVER_LIMIT",
        _ => "UNKNOWN",
    }
}

/// Writes a `RateLimitResponse` as protojson (default values omitted).
pub fn response_json(response: &RateLimitResponse) -> Value {
    let mut out = Map::new();
    out.insert(
        "overallCode".into(),
        json!(code_name(response.overall_code)),
    );
    let statuses: Vec<Value> = response
        .statuses
        .iter()
        .map(|s| {
            let mut status = Map::new();
            status.insert("code".into(), json!(code_name(s.code)));
            if let Some(limit) = &s.current_limit {
                let mut l = Map::new();
                if !limit.name.is_empty() {
                    l.insert("name".into(), json!(limit.name));
                }
                if limit.requests_per_unit != 0 {
                    l.insert("requestsPerUnit".into(), json!(limit.requests_per_unit));
                }
                let unit = Unit::from_proto(limit.unit).map_or("UNKNOWN", |u| match u {
                    Unit::Second => "SECOND",
                    Unit::Minute => "MINUTE",
                    Unit::Hour => "HOUR",
                    Unit::Day => "DAY",
                    Unit::Week => "WEEK",
                    Unit::Month => "MONTH",
                    Unit::Year => "YEAR",
                });
                l.insert("unit".into(), json!(unit));
                status.insert("currentLimit".into(), Value::Object(l));
            }
            if s.limit_remaining != 0 {
                status.insert("limitRemaining".into(), json!(s.limit_remaining));
            }
            if let Some(d) = &s.duration_until_reset {
                status.insert("durationUntilReset".into(), json!(duration(d)));
            }
            Value::Object(status)
        })
        .collect();
    if !statuses.is_empty() {
        out.insert("statuses".into(), Value::Array(statuses));
    }
    if !response.response_headers_to_add.is_empty() {
        let headers: Vec<Value> = response
            .response_headers_to_add
            .iter()
            .map(|h| json!({"key": h.key, "value": h.value}))
            .collect();
        out.insert("responseHeadersToAdd".into(), Value::Array(headers));
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_camel_and_proto_names() {
        let r = parse_request(
            br#"{"domain":"d","hits_addend":"3","descriptors":[
                {"entries":[{"key":"k","value":"v"}],"limit":{"requestsPerUnit":5,"unit":"MINUTE"},"hitsAddend":0}]}"#,
        )
        .unwrap();
        assert_eq!(r.domain, "d");
        assert_eq!(r.hits_addend, 3);
        let d = &r.descriptors[0];
        assert_eq!(
            (d.entries[0].key.as_str(), d.entries[0].value.as_str()),
            ("k", "v")
        );
        assert_eq!(
            d.limit.as_ref().map(|l| (l.requests_per_unit, l.unit)),
            Some((5, 2))
        );
        assert_eq!(d.hits_addend.map(|h| h.value), Some(0));
    }

    #[test]
    fn rejects_what_protojson_rejects() {
        for bad in [
            &b"not json"[..],
            br#"{"domain":"d","extra":1}"#,
            br#"{"domain":5}"#,
            br#"{"domain":"d","descriptors":[{"entries":[{"key":"k","val":"v"}]}]}"#,
            br#"{"domain":"d","hitsAddend":-1}"#,
            br#"{"domain":"d","descriptors":[{"limit":{"unit":"FORTNIGHT"}}]}"#,
        ] {
            assert!(
                parse_request(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn durations_use_protojson_precision() {
        let d = |seconds, nanos| duration(&Duration { seconds, nanos });
        assert_eq!(d(60, 0), "60s");
        assert_eq!(d(1, 500_000_000), "1.500s");
        assert_eq!(d(0, 1_000), "0.000001s");
        assert_eq!(d(0, 1), "0.000000001s");
    }
}
