//! The OTLP/gRPC span exporter, with its failures counted.

use std::time::Duration;

use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SpanData, SpanExporter};
use prometheus::IntCounter;

use crate::config::observability::TracingSettings;
use crate::metrics::Metrics;

/// How long one export may take before it counts as failed.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// The OTLP exporter, counting the spans of every export that failed.
#[derive(Debug)]
pub(super) struct Counted {
    inner: opentelemetry_otlp::SpanExporter,
    failed: IntCounter,
}

impl Counted {
    pub(super) fn build(settings: &TracingSettings, metrics: &Metrics) -> std::io::Result<Self> {
        let inner = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(settings.otlp_endpoint.to_string())
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(std::io::Error::other)?;
        let name = "turnstile_trace_export_failed_spans_total";
        let failed = IntCounter::new(
            name,
            "Spans the OTLP exporter failed to deliver (collector unreachable, refused or slow).",
        )
        .unwrap_or_else(|e| panic!("metric {name}: {e}"));
        metrics.register(Box::new(failed.clone()));
        Ok(Counted { inner, failed })
    }
}

impl SpanExporter for Counted {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let spans = batch.len() as u64;
        let result = self.inner.export(batch).await;
        if result.is_err() {
            self.failed.inc_by(spans);
        }
        result
    }

    fn shutdown_with_timeout(&mut self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&mut self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}
