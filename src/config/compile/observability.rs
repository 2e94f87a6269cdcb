//! `request_id:`, `access_log:` and `tracing:`.

use std::path::Path;

use http::HeaderName;

use super::Errors;
use crate::config::observability::*;

pub(super) fn request_id(e: &mut Errors, raw: &RawRequestId) -> RequestIdSettings {
    let defaults = RequestIdSettings::default();
    let header = match raw.header.as_deref() {
        None => defaults.header,
        Some(text) => match HeaderName::from_bytes(text.as_bytes()) {
            Ok(name) => name,
            Err(_) => {
                e.add(
                    "request_id.header",
                    format!("`{text}` is not a header name"),
                );
                defaults.header
            }
        },
    };
    let trust = match raw.trust.as_deref() {
        None => defaults.trust,
        Some(text) => RequestIdTrust::parse(text).unwrap_or_else(|| {
            e.add(
                "request_id.trust",
                format!(
                    "`{text}` is not a choice; expected {}",
                    RequestIdTrust::NAMES
                ),
            );
            defaults.trust
        }),
    };
    RequestIdSettings {
        enabled: raw.enabled.unwrap_or(true),
        header,
        trust,
    }
}

pub(super) fn access_log(e: &mut Errors, raw: &RawAccessLog, source: &Path) -> AccessLogSettings {
    let output = match raw.output.as_deref() {
        None | Some("stdout") => LogOutput::Stdout,
        Some("") => {
            e.add("access_log.output", "must be `stdout` or a file name");
            LogOutput::Stdout
        }
        Some(file) => LogOutput::File(match source.parent() {
            Some(dir) => dir.join(file),
            None => file.into(),
        }),
    };
    let format = match raw.format.as_deref() {
        None | Some("json") => LogFormat::Json,
        Some("text") => LogFormat::Text,
        Some(other) => {
            e.add(
                "access_log.format",
                format!("`{other}` is not a format; expected `json` or `text`"),
            );
            LogFormat::Json
        }
    };
    let fields = match &raw.fields {
        None => LogField::ALL.to_vec(),
        Some(names) => {
            let mut fields = Vec::with_capacity(names.len());
            for (i, name) in names.iter().enumerate() {
                match LogField::parse(name) {
                    Some(field) if fields.contains(&field) => e.add(
                        format!("access_log.fields[{i}]"),
                        format!("`{name}` is listed twice"),
                    ),
                    Some(field) => fields.push(field),
                    None => e.add(
                        format!("access_log.fields[{i}]"),
                        format!(
                            "`{name}` is not a field; expected one of {}",
                            LogField::ALL.map(LogField::name).join(", ")
                        ),
                    ),
                }
            }
            if names.is_empty() {
                e.add("access_log.fields", "lists no field: a line would be empty");
            }
            fields
        }
    };
    let mut fraction = |path: &str, value: Option<f64>| match value {
        None => 1.0,
        Some(v) if (0.0..=1.0).contains(&v) => v,
        Some(v) => {
            e.add(path, format!("`{v}` is not a fraction from 0 to 1"));
            1.0
        }
    };
    let sample_admitted = fraction("access_log.sample.admitted", raw.sample.admitted);
    let sample_refused = fraction("access_log.sample.refused", raw.sample.refused);
    let buffer = match raw.buffer {
        None => DEFAULT_LOG_BUFFER,
        Some(n) if (1..=MAX_LOG_BUFFER).contains(&n) => n as usize,
        Some(_) => {
            e.add(
                "access_log.buffer",
                format!("must be between 1 and {MAX_LOG_BUFFER} lines"),
            );
            DEFAULT_LOG_BUFFER
        }
    };
    AccessLogSettings {
        output,
        format,
        fields,
        sample_admitted,
        sample_refused,
        buffer,
        show_key_values: raw.show_key_values.unwrap_or(false),
    }
}

pub(super) fn tracing(e: &mut Errors, raw: &RawTracing) -> Option<TracingSettings> {
    let endpoint = match raw.otlp_endpoint.as_deref() {
        None => {
            e.add(
                "tracing.otlp_endpoint",
                "is required: the collector's `http://host:port`",
            );
            None
        }
        Some(text) => match text.parse::<http::Uri>() {
            Ok(uri)
                if uri.scheme_str() == Some("http")
                    && uri.authority().is_some_and(|a| a.port_u16().is_some()) =>
            {
                Some(uri)
            }
            Ok(uri) if uri.scheme_str() == Some("https") => {
                e.add(
                    "tracing.otlp_endpoint",
                    format!("`{text}`: https is not supported; export over a local collector's `http://host:port`"),
                );
                None
            }
            _ => {
                e.add(
                    "tracing.otlp_endpoint",
                    format!("`{text}` is not an `http://host:port` address"),
                );
                None
            }
        },
    };
    let sample_ratio = match raw.sample_ratio {
        None => 1.0,
        Some(v) if (0.0..=1.0).contains(&v) => v,
        Some(v) => {
            e.add(
                "tracing.sample_ratio",
                format!("`{v}` is not a fraction from 0 to 1"),
            );
            1.0
        }
    };
    let service_name = match raw.service_name.as_deref() {
        None => DEFAULT_SERVICE_NAME.to_string(),
        Some(name) if !name.is_empty() && name.len() <= 255 => name.to_string(),
        Some(_) => {
            e.add("tracing.service_name", "must be 1 to 255 characters");
            DEFAULT_SERVICE_NAME.to_string()
        }
    };
    Some(TracingSettings {
        otlp_endpoint: endpoint?,
        sample_ratio,
        service_name,
    })
}
