//! The access log: one line per request on every door (`access_log:`).
//!
//! A door fills a small [`Record`] on the request path (copies of what it read, no formatting)
//! and hands it to [`AccessLog::submit`], which only tries to put it in a bounded queue: when the
//! queue is full the record is dropped and counted (`turnstile_access_log_dropped_total`), and the
//! request never waits, nor wakes anything. A writer thread of its own ([`writer`]) takes the
//! queued records every few milliseconds,
//! formats them ([`format`]: JSON or NGINX-like text, the configured fields) and writes them to
//! stdout or a file, which it reopens when asked (SIGUSR1, for logrotate). The thread is stopped
//! through [`crate::shutdown::Shutdown`], after the listeners, and writes every queued line
//! before it ends.
//!
//! Sampling ([`AccessLog::wants`]) keeps a fraction of admitted requests and another of refused
//! ones; a sampled-out request costs one random number.

pub mod format;
pub mod writer;

use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::{HeaderValue, Method};
use prometheus::IntCounter;

use crate::config::observability::AccessLogSettings;
use crate::config::Upstream;
use crate::metrics::Metrics;
use crate::request_id::TraceId;

/// Which door a line is from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Door {
    Gateway,
    /// forward-auth's HTTP `/check`.
    Check,
    /// Envoy ext_authz.
    ExtAuthz,
    /// The Envoy rate limit service.
    Rls,
}

impl Door {
    pub fn as_str(self) -> &'static str {
        match self {
            Door::Gateway => "gateway",
            Door::Check => "check",
            Door::ExtAuthz => "ext_authz",
            Door::Rls => "rls",
        }
    }
}

/// What the rate limit made of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Decision {
    /// Nothing decided: refused before any policy (400, 404, 405, 401, 413), or no policy applied.
    #[default]
    None,
    Allowed,
    /// Admitted for a later slot (`on_limit: delay`): held for [`Decided::delay`] first.
    Delayed,
    Limited,
    /// Admitted, and a shadow policy would have refused it.
    Shadow,
    /// Matched `exempt:`: no policy applied.
    Exempt,
    FailedOpen,
    FailedClosed,
}

impl Decision {
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::None => "none",
            Decision::Allowed => "allowed",
            Decision::Delayed => "delayed",
            Decision::Limited => "limited",
            Decision::Shadow => "shadow",
            Decision::Exempt => "exempt",
            Decision::FailedOpen => "failed_open",
            Decision::FailedClosed => "failed_closed",
        }
    }
}

/// What admission learnt that a line shows: the route, the decision, the policy that governed it and the
/// counter key it was decided on (the shadow policy's, for [`Decision::Shadow`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Decided {
    /// The route's name (the Envoy service: the domain).
    pub route: Option<Arc<str>>,
    pub decision: Decision,
    pub policy: Option<Arc<str>>,
    pub key: Option<String>,
    /// Admitted for later: how long the request was to wait for its slot (`None`: it was not
    /// delayed). Shown as `delay_ms`, also on a [`Decision::Shadow`] line.
    pub delay: Option<Duration>,
    /// When the engine's store call began and ended (the trace's store span, `crate::otel`).
    pub store_call: Option<(SystemTime, SystemTime)>,
}

/// One request, as a door saw it. Every field is optional but the time, door and status: a door
/// fills what it knows.
#[derive(Debug, Clone)]
pub struct Record {
    /// When the request arrived.
    pub time: SystemTime,
    pub door: Door,
    pub request_id: Option<HeaderValue>,
    pub trace_id: Option<TraceId>,
    pub client_ip: Option<IpAddr>,
    pub method: Option<Method>,
    /// The canonical host and path (`crate::normalize`).
    pub host: Option<String>,
    pub path: Option<String>,
    pub status: u16,
    /// The request body's declared length.
    pub bytes_in: Option<u64>,
    /// The response body's length, when known at its head (`Content-Length`).
    pub bytes_out: Option<u64>,
    /// From arrival to the response head.
    pub duration: Duration,
    pub upstream: Option<Arc<Upstream>>,
    /// From sending upstream to its response head.
    pub upstream_time: Option<Duration>,
    pub decided: Decided,
}

impl Record {
    /// A record of `door` for a request that arrived at `time`, everything else unknown.
    pub fn new(door: Door, time: SystemTime) -> Self {
        Record {
            time,
            door,
            request_id: None,
            trace_id: None,
            client_ip: None,
            method: None,
            host: None,
            path: None,
            status: 0,
            bytes_in: None,
            bytes_out: None,
            duration: Duration::ZERO,
            upstream: None,
            upstream_time: None,
            decided: Decided::default(),
        }
    }
}

/// The handle every door holds: off, or the queue to a running writer.
#[derive(Debug, Clone, Default)]
pub struct AccessLog(Option<Arc<Queue>>);

#[derive(Debug)]
struct Queue {
    /// Boxed: the queue's slots are a pointer each, and a record is never copied into one.
    tx: SyncSender<Box<Record>>,
    sample_admitted: f64,
    sample_refused: f64,
    dropped: IntCounter,
    reopen: Arc<AtomicBool>,
}

impl AccessLog {
    /// No access log: [`AccessLog::wants`] is always false.
    pub fn off() -> Self {
        AccessLog(None)
    }

    /// Opens the output and starts the writer thread; the [`writer::Writer`] stops it.
    pub fn start(
        settings: &AccessLogSettings,
        metrics: &Metrics,
    ) -> std::io::Result<(AccessLog, writer::Writer)> {
        let counter = |name: &str, help: &str| {
            let c = IntCounter::new(name, help).unwrap_or_else(|e| panic!("metric {name}: {e}"));
            metrics.register(Box::new(c.clone()));
            c
        };
        let dropped = counter(
            "turnstile_access_log_dropped_total",
            "Access log lines dropped because the writer's queue was full.",
        );
        let written = counter(
            "turnstile_access_log_lines_total",
            "Access log lines written.",
        );
        let (tx, writer) = writer::Writer::start(settings, written)?;
        let queue = Queue {
            tx,
            sample_admitted: settings.sample_admitted,
            sample_refused: settings.sample_refused,
            dropped,
            reopen: writer.reopen_flag(),
        };
        Ok((AccessLog(Some(Arc::new(queue))), writer))
    }

    /// Whether any line may be written: a door builds no record when not.
    #[inline]
    pub fn is_on(&self) -> bool {
        self.0.is_some()
    }

    /// Whether a request, admitted or refused, is to be logged (its sampling drawn here).
    #[inline]
    pub fn wants(&self, refused: bool) -> bool {
        let Some(queue) = &self.0 else {
            return false;
        };
        let fraction = if refused {
            queue.sample_refused
        } else {
            queue.sample_admitted
        };
        fraction >= 1.0 || (fraction > 0.0 && crate::request_id::random_fraction() < fraction)
    }

    /// Queues `record` for the writer, or drops and counts it when the queue is full. Never
    /// blocks.
    pub fn submit(&self, record: Box<Record>) {
        let Some(queue) = &self.0 else {
            return;
        };
        match queue.tx.try_send(record) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => queue.dropped.inc(),
            // The writer has stopped (shutdown): nothing more is written.
            Err(TrySendError::Disconnected(_)) => {}
        }
    }

    /// Asks the writer to reopen its file (after logrotate renamed it); stdout is kept.
    pub fn reopen(&self) {
        if let Some(queue) = &self.0 {
            queue.reopen.store(true, Ordering::Relaxed);
        }
    }
}
