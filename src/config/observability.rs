//! `request_id:`, `access_log:` and `tracing:`: what a request is called, the line it leaves and
//! the spans it exports, as plain data (the runtime is `crate::request_id`, `crate::access_log`
//! and `crate::otel`).

use std::path::PathBuf;

use http::HeaderName;
use serde::Deserialize;

/// `request_id: {header, trust, enabled}` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRequestId {
    pub enabled: Option<bool>,
    pub header: Option<String>,
    pub trust: Option<String>,
}

/// `access_log: {output, format, fields, sample, buffer}` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAccessLog {
    pub output: Option<String>,
    pub format: Option<String>,
    pub fields: Option<Vec<String>>,
    #[serde(default)]
    pub sample: RawSample,
    pub buffer: Option<u64>,
    pub show_key_values: Option<bool>,
}

/// `access_log.sample: {admitted, refused}`: the fraction of each kept, 0 to 1.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSample {
    pub admitted: Option<f64>,
    pub refused: Option<f64>,
}

/// Whose incoming request id is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RequestIdTrust {
    /// A request from a `client_ip.trusted_proxies` peer keeps its id; anyone else's is replaced.
    #[default]
    TrustedProxies,
    /// Every request keeps the id it brings.
    All,
    /// Every request gets a fresh id.
    None,
}

impl RequestIdTrust {
    pub const NAMES: &'static str = "`trusted_proxies`, `all` or `none`";

    pub fn parse(text: &str) -> Option<Self> {
        Some(match text {
            "trusted_proxies" => RequestIdTrust::TrustedProxies,
            "all" => RequestIdTrust::All,
            "none" => RequestIdTrust::None,
            _ => return None,
        })
    }
}

/// `request_id:` validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestIdSettings {
    /// `false`: no id is read, made, forwarded or returned.
    pub enabled: bool,
    pub header: HeaderName,
    pub trust: RequestIdTrust,
}

impl Default for RequestIdSettings {
    fn default() -> Self {
        RequestIdSettings {
            enabled: true,
            header: HeaderName::from_static("x-request-id"),
            trust: RequestIdTrust::TrustedProxies,
        }
    }
}

/// Where access log lines go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogOutput {
    Stdout,
    /// Appended to; reopened on SIGUSR1 (after logrotate renamed it).
    File(PathBuf),
}

/// How a line is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// One JSON object per line.
    Json,
    /// NGINX-like: space-separated values, strings quoted, `-` for none.
    Text,
}

/// One field of an access log line, in the order [`LogField::ALL`] lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LogField {
    Time,
    Door,
    RequestId,
    TraceId,
    ClientIp,
    Method,
    Host,
    Path,
    Route,
    Status,
    BytesIn,
    BytesOut,
    DurationMs,
    Upstream,
    UpstreamMs,
    Decision,
    /// How long a delayed request waited for its slot (`on_limit: delay`).
    DelayMs,
    Policy,
    Key,
}

impl LogField {
    /// Every field, in the default order.
    pub const ALL: [LogField; 19] = [
        LogField::Time,
        LogField::Door,
        LogField::RequestId,
        LogField::TraceId,
        LogField::ClientIp,
        LogField::Method,
        LogField::Host,
        LogField::Path,
        LogField::Route,
        LogField::Status,
        LogField::BytesIn,
        LogField::BytesOut,
        LogField::DurationMs,
        LogField::Upstream,
        LogField::UpstreamMs,
        LogField::Decision,
        LogField::DelayMs,
        LogField::Policy,
        LogField::Key,
    ];

    /// Its name in `access_log.fields` and in a JSON line.
    pub fn name(self) -> &'static str {
        match self {
            LogField::Time => "time",
            LogField::Door => "door",
            LogField::RequestId => "request_id",
            LogField::TraceId => "trace_id",
            LogField::ClientIp => "client_ip",
            LogField::Method => "method",
            LogField::Host => "host",
            LogField::Path => "path",
            LogField::Route => "route",
            LogField::Status => "status",
            LogField::BytesIn => "bytes_in",
            LogField::BytesOut => "bytes_out",
            LogField::DurationMs => "duration_ms",
            LogField::Upstream => "upstream",
            LogField::UpstreamMs => "upstream_ms",
            LogField::Decision => "decision",
            LogField::DelayMs => "delay_ms",
            LogField::Policy => "policy",
            LogField::Key => "key",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        LogField::ALL.into_iter().find(|f| f.name() == text)
    }
}

/// `access_log:` validated.
#[derive(Debug, Clone, PartialEq)]
pub struct AccessLogSettings {
    pub output: LogOutput,
    pub format: LogFormat,
    /// The fields of a line, in order, each once.
    pub fields: Vec<LogField>,
    /// The fraction of admitted requests logged (0 to 1; default 1).
    pub sample_admitted: f64,
    /// The fraction of refused requests logged (0 to 1; default 1).
    pub sample_refused: f64,
    /// Lines waiting for the writer at most; more are dropped and counted.
    pub buffer: usize,
    /// `key` shows the counter key itself, not its digest.
    pub show_key_values: bool,
}

/// The default of `access_log.buffer`.
pub const DEFAULT_LOG_BUFFER: usize = 16 * 1024;
/// The most `access_log.buffer` may be.
pub const MAX_LOG_BUFFER: u64 = 1 << 20;

/// `tracing: {otlp_endpoint, sample_ratio, service_name}` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTracing {
    pub otlp_endpoint: Option<String>,
    pub sample_ratio: Option<f64>,
    pub service_name: Option<String>,
}

/// `tracing:` validated: spans exported over OTLP/gRPC.
#[derive(Debug, Clone, PartialEq)]
pub struct TracingSettings {
    /// The collector's OTLP/gRPC address, `http://host:port` (`https://` is refused: the
    /// exporter is built without TLS).
    pub otlp_endpoint: http::Uri,
    /// The fraction of new traces sampled (0 to 1); a request continuing a trace follows its
    /// parent's choice.
    pub sample_ratio: f64,
    /// The `service.name` resource attribute.
    pub service_name: String,
}

/// The default of `tracing.service_name`.
pub const DEFAULT_SERVICE_NAME: &str = "turnstile";
