//! The response's `dynamic_metadata` (`rls.response_dynamic_metadata`), shaped as
//! envoyproxy/ratelimit shapes it: `domain`; `descriptors`, one per request descriptor with its
//! `entries` (`key=value`), its `limit` override and its `hitsAddend`; the request's `hitsAddend`;
//! and `metadata`, the descriptors' own `metadata` merged over every descriptor that was not over
//! its limit (the first writer of a key wins; mappings merge).

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value};

use super::ask::Ask;
use super::plan::Plan;

fn value(kind: Kind) -> Value {
    Value { kind: Some(kind) }
}

fn text(s: impl Into<String>) -> Value {
    value(Kind::StringValue(s.into()))
}

pub(crate) fn response_metadata(
    request: &Ask<'_>,
    plans: &[Plan<'_>],
    statuses: &[DescriptorStatus],
) -> Struct {
    let mut fields = std::collections::HashMap::new();
    fields.insert("domain".to_owned(), text(request.domain));
    let descriptors = request
        .descriptors
        .iter()
        .map(|d| {
            let mut f = std::collections::HashMap::new();
            let entries = d
                .entries
                .iter()
                .map(|(key, value)| text(format!("{key}={value}")))
                .collect();
            f.insert(
                "entries".to_owned(),
                value(Kind::ListValue(ListValue { values: entries })),
            );
            if let Some(limit) = &d.limit {
                f.insert(
                    "limit".to_owned(),
                    text(format!(
                        "requests_per_unit:{} unit:{}",
                        limit.requests_per_unit, limit.unit
                    )),
                );
            }
            if let Some(hits) = d.hits_addend {
                f.insert(
                    "hitsAddend".to_owned(),
                    value(Kind::NumberValue(hits as f64)),
                );
            }
            value(Kind::StructValue(Struct { fields: f }))
        })
        .collect();
    fields.insert(
        "descriptors".to_owned(),
        value(Kind::ListValue(ListValue {
            values: descriptors,
        })),
    );
    if request.hits_addend != 0 {
        fields.insert(
            "hitsAddend".to_owned(),
            value(Kind::NumberValue(f64::from(request.hits_addend))),
        );
    }
    let mut passed = Struct::default();
    for (plan, status) in plans.iter().zip(statuses) {
        let Plan::Limited(l) = plan else { continue };
        if status.code == Code::OverLimit as i32 {
            continue;
        }
        if let Some(metadata) = l.rule.and_then(|r| r.metadata.as_ref()) {
            merge(&mut passed, metadata);
        }
    }
    if !passed.fields.is_empty() {
        fields.insert("metadata".to_owned(), value(Kind::StructValue(passed)));
    }
    Struct { fields }
}

/// Adds `src`'s keys to `dest`: a key already there stays, unless both are mappings, which merge.
fn merge(dest: &mut Struct, src: &Struct) {
    for (key, v) in &src.fields {
        match dest.fields.get_mut(key) {
            Some(Value {
                kind: Some(Kind::StructValue(d)),
            }) => {
                if let Some(Kind::StructValue(s)) = &v.kind {
                    merge(d, s);
                }
            }
            Some(_) => {}
            None => {
                dest.fields.insert(key.clone(), v.clone());
            }
        }
    }
}
