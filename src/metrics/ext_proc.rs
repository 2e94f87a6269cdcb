//! The counters of Envoy's external processor (`crate::ext_proc`): how each processing stream
//! ended, beside the door's answers in `turnstile_door_checks_total{door="ext_proc"}`.

use prometheus::{IntCounter, IntCounterVec, Opts};

use super::{DoorMetrics, Metrics};

/// How one ext_proc stream (one HTTP request through Envoy) ended, as counted by
/// `turnstile_ext_proc_streams_total{end}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamEnd {
    /// Admitted, and nothing was owed after: no response cost, lease or rate-limit field.
    Decided,
    /// Refused: Envoy answered the client itself (`ImmediateResponse`).
    Refused,
    /// The response was seen to its end, then settled.
    Complete,
    /// The stream ended before the response did (the client went away, Envoy reset the stream,
    /// the upstream failed): settled as the gateway settles a cut response.
    Cut,
    /// No route matched, or the request was malformed: nothing counted.
    Passed,
}

impl StreamEnd {
    const ALL: [StreamEnd; 5] = [
        StreamEnd::Decided,
        StreamEnd::Refused,
        StreamEnd::Complete,
        StreamEnd::Cut,
        StreamEnd::Passed,
    ];

    fn as_str(self) -> &'static str {
        match self {
            StreamEnd::Decided => "decided",
            StreamEnd::Refused => "refused",
            StreamEnd::Complete => "complete",
            StreamEnd::Cut => "cut",
            StreamEnd::Passed => "passed",
        }
    }
}

/// The door's handles, resolved once when its listener starts.
#[derive(Debug, Clone)]
pub struct ExtProcMetrics {
    pub door: DoorMetrics,
    ends: [IntCounter; 5],
}

impl ExtProcMetrics {
    /// Registers `turnstile_ext_proc_streams_total` in `metrics` (once per process's metrics).
    pub fn register(metrics: &Metrics) -> Self {
        let name = "turnstile_ext_proc_streams_total";
        let ends = IntCounterVec::new(
            Opts::new(
                name,
                "Envoy ext_proc streams (one per HTTP request) by how they ended: decided, \
                 refused, complete (the response seen to its end), cut (ended before the \
                 response did) or passed (no route).",
            ),
            &["end"],
        )
        .unwrap_or_else(|e| panic!("metric {name}: {e}"));
        metrics.register(Box::new(ends.clone()));
        ExtProcMetrics {
            door: metrics.door("ext_proc"),
            ends: StreamEnd::ALL.map(|end| ends.with_label_values(&[end.as_str()])),
        }
    }

    pub fn ended(&self, end: StreamEnd) {
        self.ends[end as usize].inc();
    }
}
