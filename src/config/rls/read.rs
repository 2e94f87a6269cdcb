//! Reading the nodes of one envoyproxy/ratelimit file into raw descriptors, with its error
//! messages. Checks that need only one descriptor (keys, types, units, `replaces`) live here;
//! checks across descriptors and files live in `tree.rs`.

use super::config::{invalid, join, RawDescriptor, RawKind, RawLimit, RlsConfigError, WindowKind};
use super::rule::Unit;
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{ListValue, Struct as ProtoStruct, Value as ProtoValue};

use super::yaml::{Node, ScalarKind, Value};

/// The longest window `unit_multiplier` may make: 100 years of 365 days.
const MAX_WINDOW_S: u64 = 100 * 365 * 86_400;

/// Reads nodes of one file, turning every mistake into an error that names the file.
pub(crate) struct Reader<'a> {
    pub(crate) file: &'a str,
}

impl Reader<'_> {
    fn err(&self, node: &Node, field: &str, message: String) -> RlsConfigError {
        invalid(self.file, node.line, field, message)
    }

    /// The entries of a mapping, checking every key is a string, known here, and not repeated.
    pub(crate) fn map<'n>(
        &self,
        node: &'n Node,
        field: &str,
        allowed: &[&str],
    ) -> Result<Vec<(&'n str, &'n Node)>, RlsConfigError> {
        let Value::Map(entries) = &node.value else {
            return Err(self.err(node, field, "config error, expected a mapping".to_owned()));
        };
        let mut out: Vec<(&str, &Node)> = Vec::with_capacity(entries.len());
        for (key, value) in entries {
            let name = match &key.value {
                Value::Scalar {
                    text,
                    kind: ScalarKind::Str,
                } => text.as_str(),
                other => {
                    let shown = match other {
                        Value::Scalar { text, .. } => text.as_str(),
                        Value::Null => "<nil>",
                        _ => "<collection>",
                    };
                    let message = format!("config error, key is not of type string: {shown}");
                    return Err(self.err(key, field, message));
                }
            };
            let path = join(field, name);
            if !allowed.contains(&name) {
                let message = format!("config error, unknown key '{name}'");
                return Err(self.err(key, &path, message));
            }
            if out.iter().any(|(seen, _)| *seen == name) {
                let message = format!("config error, duplicate key '{name}'");
                return Err(self.err(key, &path, message));
            }
            out.push((name, value));
        }
        Ok(out)
    }

    /// The items of a list of mappings (`descriptors`, `replaces`); null is an empty list.
    fn list_of_maps<'n>(&self, node: &'n Node, field: &str) -> Result<&'n [Node], RlsConfigError> {
        match &node.value {
            Value::Null => Ok(&[]),
            Value::Seq(items) => {
                for item in items {
                    if !matches!(item.value, Value::Map(_)) {
                        let shown = item.value.as_text().unwrap_or("<collection>");
                        let message = format!(
                            "config error, yaml file contains list of type other than map: {shown}"
                        );
                        return Err(self.err(item, field, message));
                    }
                }
                Ok(items)
            }
            _ => Err(self.err(node, field, "config error, expected a list".to_owned())),
        }
    }

    /// A string field: any scalar, as written (yaml.v2 does the same); null is empty.
    pub(crate) fn string(&self, node: &Node, field: &str) -> Result<String, RlsConfigError> {
        match &node.value {
            Value::Null => Ok(String::new()),
            Value::Scalar { text, .. } => Ok(text.clone()),
            _ => Err(self.err(node, field, "config error, expected a string".to_owned())),
        }
    }

    /// A boolean field: YAML 1.1's spellings, as yaml.v2 reads them; null is false.
    fn boolean(&self, node: &Node, field: &str) -> Result<bool, RlsConfigError> {
        let text = match &node.value {
            Value::Null => return Ok(false),
            Value::Scalar { text, .. } => text.to_ascii_lowercase(),
            _ => String::new(),
        };
        match text.as_str() {
            "true" | "yes" | "on" | "y" => Ok(true),
            "false" | "no" | "off" | "n" => Ok(false),
            _ => Err(self.err(
                node,
                field,
                "config error, expected true or false".to_owned(),
            )),
        }
    }

    /// An unsigned 32-bit field; null is 0.
    fn count(&self, node: &Node, field: &str) -> Result<u32, RlsConfigError> {
        match &node.value {
            Value::Null => Ok(0),
            Value::Scalar {
                text,
                kind: ScalarKind::Int,
            } => text.parse::<u32>().map_err(|_| {
                let message = format!("config error, {text} is not an unsigned 32-bit integer");
                self.err(node, field, message)
            }),
            other => {
                let shown = other.as_text().unwrap_or("<collection>");
                let message = format!("config error, {shown} is not an unsigned 32-bit integer");
                Err(self.err(node, field, message))
            }
        }
    }

    pub(crate) fn window_kind(
        &self,
        node: &Node,
        field: &str,
    ) -> Result<WindowKind, RlsConfigError> {
        match self.string(node, field)?.as_str() {
            "sliding_window" => Ok(WindowKind::Sliding),
            "fixed_window" => Ok(WindowKind::Fixed),
            other => {
                let message = format!(
                    "invalid algorithm '{other}' (expected sliding_window or fixed_window)"
                );
                Err(self.err(node, field, message))
            }
        }
    }

    pub(crate) fn descriptors(
        &self,
        node: &Node,
        field: &str,
    ) -> Result<Vec<RawDescriptor>, RlsConfigError> {
        let items = self.list_of_maps(node, field)?;
        let mut out = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            out.push(self.descriptor(item, &format!("{field}[{i}]"))?);
        }
        Ok(out)
    }
}

impl Reader<'_> {
    fn descriptor(&self, node: &Node, field: &str) -> Result<RawDescriptor, RlsConfigError> {
        const KEYS: &[&str] = &[
            "key",
            "value",
            "rate_limit",
            "token_bucket",
            "descriptors",
            "shadow_mode",
            "quota_mode",
            "detailed_metric",
            "share_threshold",
            "value_to_metric",
            "metadata",
        ];
        let mut out = RawDescriptor {
            line: node.line,
            field: field.to_owned(),
            key: String::new(),
            value: None,
            limit: None,
            shadow_mode: false,
            quota_mode: false,
            metadata: None,
            detailed_metric: false,
            share_threshold: false,
            value_to_metric: false,
            descriptors: Vec::new(),
        };
        let mut rate_limit = None;
        let mut token_bucket = None;
        for (key, value) in self.map(node, field, KEYS)? {
            let path = join(field, key);
            match key {
                "key" => out.key = self.string(value, &path)?,
                "value" => out.value = Some(self.string(value, &path)?).filter(|v| !v.is_empty()),
                "rate_limit" => rate_limit = Some((value, path)),
                "token_bucket" => token_bucket = Some((value, path)),
                "descriptors" => out.descriptors = self.descriptors(value, &path)?,
                "shadow_mode" => out.shadow_mode = self.boolean(value, &path)?,
                "quota_mode" => out.quota_mode = self.boolean(value, &path)?,
                // Returned in the response's dynamic_metadata when the descriptor passes
                // (`rls.response_dynamic_metadata`).
                "metadata" => match proto_value(value).kind {
                    Some(Kind::StructValue(s)) => out.metadata = Some(s),
                    Some(Kind::NullValue(_)) => {}
                    _ => {
                        let message = "metadata must be a mapping".to_owned();
                        return Err(self.err(value, &path, message));
                    }
                },
                "detailed_metric" => out.detailed_metric = self.boolean(value, &path)?,
                "share_threshold" => out.share_threshold = self.boolean(value, &path)?,
                "value_to_metric" => out.value_to_metric = self.boolean(value, &path)?,
                _ => {}
            }
        }
        if out.key.is_empty() {
            let message = "descriptor has empty key".to_owned();
            return Err(self.err(node, &join(field, "key"), message));
        }
        out.limit = match (rate_limit, token_bucket) {
            (Some(_), Some((tb, path))) => {
                let message = "a descriptor has either rate_limit or token_bucket, not both";
                return Err(self.err(tb, &path, message.to_owned()));
            }
            (Some((node, path)), None) => self.rate_limit(node, &path, false)?,
            (None, Some((node, path))) => self.rate_limit(node, &path, true)?,
            (None, None) => None,
        };
        Ok(out)
    }

    /// A `rate_limit` block, or (`bucket`) a `token_bucket` block; null is no limit, as in
    /// envoyproxy/ratelimit.
    fn rate_limit(
        &self,
        node: &Node,
        field: &str,
        bucket: bool,
    ) -> Result<Option<RawLimit>, RlsConfigError> {
        if matches!(node.value, Value::Null) {
            return Ok(None);
        }
        let keys: &[&str] = if bucket {
            &["unit", "requests_per_unit", "burst", "name", "replaces"]
        } else {
            &[
                "unit",
                "requests_per_unit",
                "unlimited",
                "name",
                "replaces",
                "algorithm",
                "unit_multiplier",
            ]
        };
        let mut unit = (String::new(), node, join(field, "unit"));
        let mut requests_per_unit = None;
        let mut unlimited = false;
        let mut name = None;
        let mut replaces = Vec::new();
        let mut algorithm = None;
        let mut burst = None;
        let mut multiplier = None;
        for (key, value) in self.map(node, field, keys)? {
            let path = join(field, key);
            match key {
                "unit" => unit = (self.string(value, &path)?, value, path),
                "requests_per_unit" => requests_per_unit = Some(self.count(value, &path)?),
                "unlimited" => unlimited = self.boolean(value, &path)?,
                "name" => name = Some(self.string(value, &path)?).filter(|n| !n.is_empty()),
                "algorithm" => algorithm = Some(self.window_kind(value, &path)?),
                "burst" => burst = Some((self.count(value, &path)?, value, path)),
                "unit_multiplier" => multiplier = Some((self.count(value, &path)?, value, path)),
                _ => {
                    for (i, item) in self.list_of_maps(value, &path)?.iter().enumerate() {
                        let item_path = format!("{path}[{i}]");
                        let mut entry = String::new();
                        for (_, v) in self.map(item, &item_path, &["name"])? {
                            entry = self.string(v, &join(&item_path, "name"))?;
                        }
                        if entry.is_empty() {
                            let message = "should not have an empty replaces entry".to_owned();
                            return Err(self.err(item, &item_path, message));
                        }
                        if name.as_deref() == Some(entry.as_str()) {
                            let message =
                                "replaces should not contain name of same descriptor".to_owned();
                            return Err(self.err(item, &item_path, message));
                        }
                        replaces.push(entry);
                    }
                }
            }
        }
        // `name` may follow `replaces` in the file: check the self-reference again.
        if let Some(n) = &name {
            if replaces.contains(n) {
                let message = "replaces should not contain name of same descriptor".to_owned();
                return Err(self.err(node, &join(field, "replaces"), message));
            }
        }
        let (unit_text, unit_node, unit_path) = unit;
        let parsed_unit = Unit::parse(&unit_text);
        let requests_per_unit = requests_per_unit.unwrap_or(0);
        let unit_multiplier = match multiplier {
            None => 1,
            Some((_, value, path)) if unlimited => {
                let message = "should not specify unit_multiplier when unlimited".to_owned();
                return Err(self.err(value, &path, message));
            }
            Some((0, value, path)) => {
                let message = "unit_multiplier must be at least 1".to_owned();
                return Err(self.err(value, &path, message));
            }
            Some((n, value, path)) => {
                // A century bounds every reset and TTL, as the gateway's own policies.
                let seconds = parsed_unit.map_or(0, |u| u.seconds()) * u64::from(n);
                if seconds > MAX_WINDOW_S {
                    let message = format!(
                        "unit_multiplier {n} makes a window of {seconds} s, more than 100 years"
                    );
                    return Err(self.err(value, &path, message));
                }
                n
            }
        };
        let kind = if unlimited {
            if parsed_unit.is_some() {
                let message = "should not specify rate limit unit when unlimited".to_owned();
                return Err(self.err(unit_node, &unit_path, message));
            }
            RawKind::Unlimited
        } else if parsed_unit.is_none() {
            let message = format!("invalid rate limit unit '{unit_text}'");
            return Err(self.err(unit_node, &unit_path, message));
        } else if bucket {
            if requests_per_unit == 0 {
                let message = "a token bucket needs requests_per_unit of at least 1".to_owned();
                return Err(self.err(node, &join(field, "requests_per_unit"), message));
            }
            let burst = match burst {
                None => requests_per_unit,
                Some((0, value, path)) => {
                    let message = "a token bucket needs a burst of at least 1".to_owned();
                    return Err(self.err(value, &path, message));
                }
                Some((b, _, _)) => b,
            };
            RawKind::TokenBucket { burst }
        } else {
            RawKind::Window(algorithm)
        };
        Ok(Some(RawLimit {
            line: node.line,
            name,
            replaces,
            requests_per_unit,
            unit: if unlimited { None } else { parsed_unit },
            unit_multiplier,
            kind,
        }))
    }
}

/// A YAML node as a protobuf `Value`, as envoyproxy/ratelimit converts `metadata` (scalars by
/// their YAML type).
fn proto_value(node: &Node) -> ProtoValue {
    let kind = match &node.value {
        Value::Null => Kind::NullValue(0),
        Value::Scalar { text, kind } => match kind {
            ScalarKind::Bool => Kind::BoolValue(matches!(text.as_str(), "true" | "True" | "TRUE")),
            ScalarKind::Int | ScalarKind::Float => match text.parse::<f64>() {
                Ok(n) => Kind::NumberValue(n),
                Err(_) => Kind::StringValue(text.clone()),
            },
            ScalarKind::Str => Kind::StringValue(text.clone()),
        },
        Value::Seq(items) => Kind::ListValue(ListValue {
            values: items.iter().map(proto_value).collect(),
        }),
        Value::Map(entries) => Kind::StructValue(ProtoStruct {
            fields: entries
                .iter()
                .filter_map(|(k, v)| Some((k.value.as_text()?.to_owned(), proto_value(v))))
                .collect(),
        }),
    };
    ProtoValue { kind: Some(kind) }
}
