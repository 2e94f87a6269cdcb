//! Access log lines: JSON (one object per line, absent values `null`) or NGINX-like text (values
//! separated by spaces, the time in brackets, strings quoted, `-` for absent), with the fields
//! `access_log.fields` lists, in its order. Runs on the writer thread only.
//!
//! The key is `sha256:` and the first 12 hex digits of the SHA-256 of the counter key
//! (`route:policy:value`), as `/debug/top-limited` shows it, unless `show_key_values`.

use std::io::Write;
use std::time::{Duration, UNIX_EPOCH};

use sha2::{Digest, Sha256};

use super::Record;
use crate::config::observability::{AccessLogSettings, LogField, LogFormat};

/// Hex digits of a key's digest shown (`crate::top_limited::SHORT_DIGEST_HEX`).
const DIGEST_HEX: usize = crate::top_limited::SHORT_DIGEST_HEX;

/// Formats records under one config.
#[derive(Debug, Clone)]
pub struct Formatter {
    format: LogFormat,
    fields: Vec<LogField>,
    show_key_values: bool,
}

/// One value of a line.
enum Value<'a> {
    None,
    Str(&'a str),
    Int(u64),
    Ms(Duration),
    Time(std::time::SystemTime),
    Digest(&'a str),
    Ip(std::net::IpAddr),
}

impl Formatter {
    pub fn new(settings: &AccessLogSettings) -> Self {
        Formatter {
            format: settings.format,
            fields: settings.fields.clone(),
            show_key_values: settings.show_key_values,
        }
    }

    /// Appends `record`'s line, with its newline, to `out`.
    pub fn line(&mut self, record: &Record, out: &mut Vec<u8>) {
        let json = self.format == LogFormat::Json;
        if json {
            out.push(b'{');
        }
        for (i, &field) in self.fields.iter().enumerate() {
            if i > 0 {
                out.push(if json { b',' } else { b' ' });
            }
            if json {
                out.push(b'"');
                out.extend_from_slice(field.name().as_bytes());
                out.extend_from_slice(b"\":");
            }
            let value = self.value(record, field);
            if json {
                write_json(out, &value);
            } else {
                write_text(out, &value);
            }
        }
        if json {
            out.push(b'}');
        }
        out.push(b'\n');
    }

    fn value<'r>(&self, r: &'r Record, field: LogField) -> Value<'r> {
        let opt_str = |s: Option<&'r str>| s.map_or(Value::None, Value::Str);
        match field {
            LogField::Time => Value::Time(r.time),
            LogField::Door => Value::Str(r.door.as_str()),
            LogField::RequestId => opt_str(r.request_id.as_ref().and_then(|v| v.to_str().ok())),
            LogField::TraceId => opt_str(
                r.trace_id
                    .as_ref()
                    .and_then(|id| std::str::from_utf8(id).ok()),
            ),
            LogField::ClientIp => r.client_ip.map_or(Value::None, Value::Ip),
            LogField::Method => opt_str(r.method.as_ref().map(http::Method::as_str)),
            LogField::Host => opt_str(r.host.as_deref()),
            LogField::Path => opt_str(r.path.as_deref()),
            LogField::Route => opt_str(r.decided.route.as_deref()),
            LogField::Status => Value::Int(u64::from(r.status)),
            LogField::BytesIn => r.bytes_in.map_or(Value::None, Value::Int),
            LogField::BytesOut => r.bytes_out.map_or(Value::None, Value::Int),
            LogField::DurationMs => Value::Ms(r.duration),
            LogField::Upstream => opt_str(r.upstream.as_ref().map(|u| u.name.as_str())),
            LogField::UpstreamMs => r.upstream_time.map_or(Value::None, Value::Ms),
            LogField::Decision => Value::Str(r.decided.decision.as_str()),
            LogField::DelayMs => r.decided.delay.map_or(Value::None, Value::Ms),
            LogField::Policy => opt_str(r.decided.policy.as_deref()),
            LogField::Key => match r.decided.key.as_deref() {
                None => Value::None,
                Some(key) if self.show_key_values => Value::Str(key),
                Some(key) => Value::Digest(key),
            },
        }
    }
}

fn write_json(out: &mut Vec<u8>, value: &Value<'_>) {
    match value {
        Value::None => out.extend_from_slice(b"null"),
        Value::Str(s) => json_string(out, s),
        Value::Int(n) => write_int(out, *n),
        Value::Ms(d) => write_ms(out, *d),
        Value::Time(t) => {
            out.push(b'"');
            write_time(out, *t);
            out.push(b'"');
        }
        Value::Digest(key) => {
            out.push(b'"');
            write_digest(out, key);
            out.push(b'"');
        }
        Value::Ip(ip) => {
            let _ = write!(out, "\"{ip}\"");
        }
    }
}

fn write_text(out: &mut Vec<u8>, value: &Value<'_>) {
    match value {
        Value::None => out.push(b'-'),
        Value::Str(s) if !s.is_empty() && s.bytes().all(plain_text) => {
            out.extend_from_slice(s.as_bytes())
        }
        Value::Str(s) => json_string(out, s),
        Value::Int(n) => write_int(out, *n),
        Value::Ms(d) => write_ms(out, *d),
        Value::Time(t) => {
            out.push(b'[');
            write_time(out, *t);
            out.push(b']');
        }
        Value::Digest(key) => write_digest(out, key),
        Value::Ip(ip) => {
            let _ = write!(out, "{ip}");
        }
    }
}

/// Bytes a text value may carry unquoted.
fn plain_text(b: u8) -> bool {
    b.is_ascii_graphic() && b != b'"' && b != b'\\'
}

/// A JSON string: `"` and `\` escaped, control characters as `\u00XX` (RFC 8259 §7).
fn json_string(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    if s.bytes()
        .all(|b| b >= 0x20 && b != 0x7f && b != b'"' && b != b'\\')
    {
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
        return;
    }
    for &b in s.as_bytes() {
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            0..=0x1f | 0x7f => {
                let _ = write!(out, "\\u{:04x}", b);
            }
            _ => out.push(b),
        }
    }
    out.push(b'"');
}

fn write_int(out: &mut Vec<u8>, n: u64) {
    let mut buf = [0u8; 20];
    out.extend_from_slice(crate::rate_limit_headers::digits(n, &mut buf));
}

/// `n` in `width` digits, zero-padded (`n` has at most `width` digits).
fn write_padded(out: &mut Vec<u8>, n: u64, width: usize) {
    let mut buf = [0u8; 20];
    let digits = crate::rate_limit_headers::digits(n, &mut buf);
    out.extend(std::iter::repeat_n(
        b'0',
        width.saturating_sub(digits.len()),
    ));
    out.extend_from_slice(digits);
}

/// Milliseconds with three decimals (microseconds).
fn write_ms(out: &mut Vec<u8>, d: Duration) {
    let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
    write_int(out, us / 1000);
    out.push(b'.');
    write_padded(out, us % 1000, 3);
}

fn write_digest(out: &mut Vec<u8>, key: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.extend_from_slice(b"sha256:");
    let digest = Sha256::digest(key.as_bytes());
    for byte in digest.iter().take(DIGEST_HEX / 2) {
        out.push(HEX[usize::from(byte >> 4)]);
        out.push(HEX[usize::from(byte & 0xf)]);
    }
}

/// RFC 3339 in UTC with milliseconds: `2026-12-01T21:36:28.123Z`.
fn write_time(out: &mut Vec<u8>, t: std::time::SystemTime) {
    let since = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    write_padded(out, y.max(0) as u64, 4);
    for (sep, n, width) in [
        (b'-', u64::from(m), 2),
        (b'-', u64::from(d), 2),
        (b'T', rem / 3600, 2),
        (b':', rem % 3600 / 60, 2),
        (b':', rem % 60, 2),
        (b'.', u64::from(since.subsec_millis()), 3),
    ] {
        out.push(sep);
        write_padded(out, n, width);
    }
    out.push(b'Z');
}

/// The proleptic Gregorian date of a day count since 1970-01-01 (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::access_log::{Decided, Decision, Door};
    use crate::config::observability::{LogOutput, DEFAULT_LOG_BUFFER};

    fn settings(format: LogFormat, fields: &[LogField]) -> AccessLogSettings {
        AccessLogSettings {
            output: LogOutput::Stdout,
            format,
            fields: fields.to_vec(),
            sample_admitted: 1.0,
            sample_refused: 1.0,
            buffer: DEFAULT_LOG_BUFFER,
            show_key_values: false,
        }
    }

    fn record() -> Record {
        let mut r = Record::new(
            Door::Gateway,
            UNIX_EPOCH + Duration::from_millis(1_764_624_988_123),
        );
        r.client_ip = Some("2001:db8::1".parse().unwrap());
        r.method = Some(http::Method::GET);
        r.path = Some("/a \"b\"\\\u{1}".to_string());
        r.status = 429;
        r.duration = Duration::from_micros(1_234_567);
        r.decided = Decided {
            route: Some("api".into()),
            decision: Decision::Limited,
            policy: Some("per_key".into()),
            key: Some("api:per_key:k1".to_string()),
            delay: None,
            store_call: None,
        };
        r
    }

    fn line(format: LogFormat, fields: &[LogField]) -> String {
        let mut out = Vec::new();
        Formatter::new(&settings(format, fields)).line(&record(), &mut out);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn a_json_line_parses_back_to_the_record() {
        let text = line(LogFormat::Json, &LogField::ALL);
        assert!(text.ends_with("}\n") && text.matches('\n').count() == 1);
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["time"], "2025-12-01T21:36:28.123Z");
        assert_eq!(v["client_ip"], "2001:db8::1");
        assert_eq!(v["path"], "/a \"b\"\\\u{1}");
        assert_eq!(v["status"], 429);
        assert_eq!(v["duration_ms"].as_f64(), Some(1234.567));
        assert_eq!(v["bytes_out"], serde_json::Value::Null);
        assert_eq!(v["decision"], "limited");
        assert_eq!(v["delay_ms"], serde_json::Value::Null);
        // `printf %s api:per_key:k1 | sha256sum`
        assert_eq!(v["key"], "sha256:84bfacd985f0");
        assert_eq!(v.as_object().unwrap().len(), LogField::ALL.len());
    }

    #[test]
    fn a_text_line_quotes_only_what_needs_it() {
        use LogField::*;
        let text = line(
            LogFormat::Text,
            &[ClientIp, Time, Method, Path, Status, Upstream, Key],
        );
        assert_eq!(
            text,
            "2001:db8::1 [2025-12-01T21:36:28.123Z] GET \"/a \\\"b\\\"\\\\\\u0001\" 429 - sha256:84bfacd985f0\n"
        );
    }

    #[test]
    fn a_delayed_request_shows_its_decision_and_wait_in_both_formats() {
        use LogField::*;
        let mut r = record();
        r.status = 200;
        r.decided.decision = crate::access_log::Decision::Delayed;
        r.decided.delay = Some(Duration::from_micros(1_500_250));
        let fields = [Status, Decision, DelayMs, Policy];
        let mut json = Vec::new();
        Formatter::new(&settings(LogFormat::Json, &fields)).line(&r, &mut json);
        assert_eq!(
            String::from_utf8(json).unwrap(),
            "{\"status\":200,\"decision\":\"delayed\",\"delay_ms\":1500.250,\"policy\":\"per_key\"}\n"
        );
        let mut text = Vec::new();
        Formatter::new(&settings(LogFormat::Text, &fields)).line(&r, &mut text);
        assert_eq!(
            String::from_utf8(text).unwrap(),
            "200 delayed 1500.250 per_key\n"
        );
    }

    #[test]
    fn dates_are_gregorian() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(20_423), (2025, 12, 1));
    }
}
