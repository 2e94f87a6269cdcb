//! OpenTelemetry traces (`tracing:`): the spans of a request, exported over OTLP/gRPC.
//!
//! A door asks [`Tracing::begin`] for a [`RequestTrace`] only when tracing is configured: off, it
//! is one branch on an `Option` and no span is made. A trace is a server span per request
//! (continuing the W3C `traceparent` the request brings), a decision span under it with the
//! route, policy, decision and store, the store call under that, and a client span for the
//! upstream call, whose id the upstream receives as its parent in `traceparent`.
//!
//! Spans go to the SDK's batch processor (a queue and a thread of its own), which exports them
//! off the request path; a full queue drops spans, never blocks. [`export::Counted`] counts the
//! spans of every export that failed (`turnstile_trace_export_failed_spans_total`), so an
//! unreachable collector costs requests nothing and shows. [`Exporter::run`], owned by
//! `crate::shutdown::Shutdown`, flushes and stops it.

mod export;

use std::borrow::Cow;
use std::sync::Arc;
use std::time::SystemTime;

use http::{HeaderMap, HeaderValue, Method};
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{
    Span as _, SpanBuilder, SpanContext, SpanKind, Status, TraceContextExt, Tracer as _,
    TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider, Span};
use opentelemetry_sdk::Resource;

use crate::access_log::Decided;
use crate::config::observability::TracingSettings;
use crate::metrics::Metrics;

/// Whether spans are made, and the tracer that makes them. Cloning shares the tracer.
#[derive(Debug, Clone, Default)]
pub struct Tracing(Option<Arc<Inner>>);

#[derive(Debug)]
struct Inner {
    tracer: SdkTracer,
    /// `memory` or `redis`: the decision span's `turnstile.store`.
    store: &'static str,
}

/// Flushes the batch processor and stops its thread (`crate::shutdown::Shutdown` runs it).
#[derive(Debug)]
pub struct Exporter(SdkTracerProvider);

impl Tracing {
    /// No tracing: [`Tracing::begin`] always answers `None`.
    pub fn off() -> Self {
        Tracing(None)
    }

    /// Builds the exporter and the tracer for `settings`. Must run inside the Tokio runtime (the
    /// gRPC channel's connection task is spawned on it; it connects lazily, so a collector that is
    /// down does not stop the gateway from starting).
    pub fn start(
        settings: &TracingSettings,
        store: &'static str,
        metrics: &Metrics,
    ) -> std::io::Result<(Tracing, Exporter)> {
        let exporter = export::Counted::build(settings, metrics)?;
        let sampler =
            Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(settings.sample_ratio)));
        let resource = Resource::builder_empty()
            .with_service_name(settings.service_name.clone())
            .build();
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_sampler(sampler)
            .with_resource(resource)
            .build();
        let tracer = provider.tracer("turnstile");
        let inner = Inner { tracer, store };
        Ok((Tracing(Some(Arc::new(inner))), Exporter(provider)))
    }

    /// Whether requests are traced.
    #[inline]
    pub fn is_on(&self) -> bool {
        self.0.is_some()
    }

    /// Starts the server span of an HTTP request (continuing its `traceparent`), when tracing is
    /// on; nothing is made or copied when it is off.
    #[inline]
    pub fn begin(
        &self,
        method: &Method,
        path: &str,
        headers: &HeaderMap,
    ) -> Option<Box<RequestTrace>> {
        let inner = self.0.as_ref()?;
        let parent = TraceContextPropagator::new().extract(&Fields(headers));
        let mut trace = RequestTrace::start(inner, parent, method.as_str().to_string());
        trace.server_attributes([
            KeyValue::new("http.request.method", method.as_str().to_string()),
            KeyValue::new("url.path", path.to_string()),
        ]);
        Some(Box::new(trace))
    }

    /// [`Tracing::begin`] for a parent given as a `traceparent` value alone (gRPC metadata).
    pub fn begin_from(
        &self,
        traceparent: Option<&str>,
        name: impl Into<Cow<'static, str>>,
    ) -> Option<Box<RequestTrace>> {
        let inner = self.0.as_ref()?;
        let parent = TraceContextPropagator::new().extract(&Traceparent(traceparent));
        Some(Box::new(RequestTrace::start(inner, parent, name)))
    }
}

/// The spans of one request as it goes; dropped unfinished, its open spans end where it drops.
#[derive(Debug)]
pub struct RequestTrace {
    tracer: SdkTracer,
    store: &'static str,
    server: Span,
    /// Filled by admission (`crate::admission`) when the access log does not already.
    pub decided: Decided,
    decision_began: SystemTime,
    client: Option<Span>,
}

impl RequestTrace {
    fn start(inner: &Inner, parent: Context, name: impl Into<Cow<'static, str>>) -> Self {
        let server = inner.tracer.build_with_context(
            SpanBuilder::from_name(name).with_kind(SpanKind::Server),
            &parent,
        );
        RequestTrace {
            tracer: inner.tracer.clone(),
            store: inner.store,
            server,
            decided: Decided::default(),
            decision_began: SystemTime::now(),
            client: None,
        }
    }

    /// The server span's trace id, as the access log writes it (32 lower-case hex digits).
    pub fn trace_id(&self) -> crate::request_id::TraceId {
        let mut id = [0u8; 32];
        let hex = self.server.span_context().trace_id().to_string();
        for (slot, b) in id.iter_mut().zip(hex.bytes()) {
            *slot = b;
        }
        id
    }

    fn child_of(&self, parent: &SpanContext) -> Context {
        Context::new().with_remote_span_context(parent.clone())
    }

    /// Adds attributes to the server span.
    pub fn server_attributes(&mut self, attributes: impl IntoIterator<Item = KeyValue>) {
        if self.server.is_recording() {
            self.server.set_attributes(attributes);
        }
    }

    /// The decision starts now.
    pub fn begin_decision(&mut self) {
        self.decision_began = SystemTime::now();
    }

    /// The decision ended now, as `decided` says (its store call included).
    pub fn end_decision(&mut self, decided: &Decided) {
        if !self.server.is_recording() {
            return;
        }
        let text = |v: &Option<Arc<str>>| v.as_deref().unwrap_or("").to_string();
        let mut attributes = vec![
            KeyValue::new("turnstile.route", text(&decided.route)),
            KeyValue::new("turnstile.policy", text(&decided.policy)),
            KeyValue::new("turnstile.decision", decided.decision.as_str()),
            KeyValue::new("turnstile.store", self.store),
        ];
        // A delayed request's wait for its slot, in milliseconds (the access log's `delay_ms`).
        if let Some(delay) = decided.delay {
            attributes.push(KeyValue::new(
                "turnstile.delay_ms",
                delay.as_secs_f64() * 1000.0,
            ));
        }
        let parent = self.child_of(self.server.span_context());
        let mut decision = self.tracer.build_with_context(
            SpanBuilder::from_name("turnstile.decision")
                .with_kind(SpanKind::Internal)
                .with_start_time(self.decision_began)
                .with_attributes(attributes),
            &parent,
        );
        if let Some((began, ended)) = decided.store_call {
            let kind = match self.store {
                "redis" => SpanKind::Client,
                _ => SpanKind::Internal,
            };
            let parent = self.child_of(decision.span_context());
            let mut store = self.tracer.build_with_context(
                SpanBuilder::from_name("turnstile.store")
                    .with_kind(kind)
                    .with_start_time(began)
                    .with_attributes([KeyValue::new("turnstile.store", self.store)]),
                &parent,
            );
            store.end_with_timestamp(ended);
        }
        decision.end();
    }

    /// Starts the client span of the upstream call and sets `headers`' `traceparent` to it
    /// (W3C Trace Context §3.2; `tracestate` is passed on as it came).
    pub fn begin_upstream(&mut self, headers: &mut HeaderMap, method: &Method, upstream: &str) {
        let parent = self.child_of(self.server.span_context());
        let client = self.tracer.build_with_context(
            SpanBuilder::from_name(method.as_str().to_string())
                .with_kind(SpanKind::Client)
                .with_attributes([
                    KeyValue::new("http.request.method", method.as_str().to_string()),
                    KeyValue::new("turnstile.upstream", upstream.to_string()),
                ]),
            &parent,
        );
        let cx = client.span_context();
        let value = format!(
            "00-{}-{}-{:02x}",
            cx.trace_id(),
            cx.span_id(),
            cx.trace_flags().to_u8()
        );
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.insert("traceparent", value);
        }
        self.client = Some(client);
    }

    /// The upstream answered with `status`, or failed (`None`).
    pub fn end_upstream(&mut self, status: Option<u16>) {
        if let Some(mut client) = self.client.take() {
            match status {
                Some(status) => {
                    client.set_attribute(KeyValue::new(
                        "http.response.status_code",
                        i64::from(status),
                    ));
                    if status >= 500 {
                        client.set_status(Status::error(""));
                    }
                }
                None => client.set_status(Status::error("upstream call failed")),
            }
            client.end();
        }
    }

    /// Ends the server span with the answer's `status`.
    pub fn finish(mut self, status: u16) {
        self.end_upstream(None);
        self.server.set_attribute(KeyValue::new(
            "http.response.status_code",
            i64::from(status),
        ));
        if status >= 500 {
            self.server.set_status(Status::error(""));
        }
        self.server.end();
    }
}

impl Exporter {
    /// Waits for `stop`, then exports every span queued and stops the processor's thread.
    pub async fn run(self, mut stop: tokio::sync::watch::Receiver<bool>) {
        let _ = stop.wait_for(|stopped| *stopped).await;
        let provider = self.0;
        // Blocking: the processor's thread exports what is queued, over the runtime's channel.
        let done = tokio::task::spawn_blocking(move || provider.shutdown()).await;
        if let Ok(Err(e)) = done {
            tracing::warn!(error = %e, "the trace exporter did not shut down cleanly");
        }
    }
}

/// A request's fields as the W3C propagator reads them.
struct Fields<'a>(&'a HeaderMap);

impl Extractor for Fields<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// One `traceparent` value as the W3C propagator reads it.
struct Traceparent<'a>(Option<&'a str>);

impl Extractor for Traceparent<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.filter(|_| key == "traceparent")
    }

    fn keys(&self) -> Vec<&str> {
        self.0.map(|_| "traceparent").into_iter().collect()
    }
}
