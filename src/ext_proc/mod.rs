//! Envoy's external processor (`ext_proc:`, `docs/llm.md`, "Through Envoy"): the door that sees
//! both halves of a request going through Envoy, so it admits as the inline gateway does
//! (reservations, leases, keys from the body) and settles from the response as it streams by.
//!
//! One [`Exchange`] per HTTP request (one `Process` stream, [`grpc`]). The request headers pick
//! the route; when the route reads the body, admission waits for it (Envoy buffers it,
//! `BUFFERED_PARTIAL`, so the upstream is not called yet). Admission is
//! [`admission::admit_inline`], the gateway's own; what it owes after (a [`Meter`], a
//! [`LeaseGuard`], a cost from a response header) lives in the exchange, fed the response
//! headers and body chunks as Envoy sends them, and is settled at the response's end, or when
//! the exchange is dropped with its stream (the client went away, Envoy reset the stream).

pub mod grpc;

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};

use crate::admission;
use crate::config::Route;
use crate::inflight::{AfterAdmission, LeaseGuard, Meter};
use crate::keys::{JsonBody, RequestView};
use crate::limiter::{Kind, Rule};
use crate::metrics::ext_proc::{ExtProcMetrics, StreamEnd};
use crate::metrics::CheckResult;
use crate::normalize;
use crate::proxy::body::ResponseBody;
use crate::rate_limit_headers::HeaderMode;
use crate::respond::Refusal;
use crate::route::{Found, PathParams, RequestHead};
use crate::state::{AppState, Live};

/// What Envoy is told after one message.
#[derive(Debug)]
pub enum Answer {
    /// Go on, with these changes to the headers just sent.
    Continue(Changes),
    /// Answer the client with this instead (an `ImmediateResponse`).
    Respond(Response<ResponseBody>),
}

/// Changes to the headers of the message answered, and after the request headers, which
/// messages the rest of the exchange needs.
#[derive(Debug, Default)]
pub struct Changes {
    pub set: HeaderMap,
    pub remove: Vec<HeaderName>,
    pub needs: Option<Needs>,
}

/// The messages a route's exchange needs after the request headers (Envoy's `mode_override`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Needs {
    /// The request body, before admission (keys from the body, a reservation it bounds).
    pub request_body: bool,
    /// The response headers: a cost from the response, a lease, or rate-limit fields to add.
    pub response_headers: bool,
    /// Every response body chunk: a usage cost read from the body, or a lease held to its end.
    pub response_body: bool,
}

impl Needs {
    /// What `route` needs, from its config alone.
    fn of(route: &Route) -> Needs {
        let lease = route
            .policies
            .iter()
            .any(|p| matches!(p.rule, Rule::Concurrency(_)));
        let usage = route.policies.iter().any(|p| {
            p.response_cost
                .as_ref()
                .is_some_and(|rc| rc.usage().is_some())
        });
        let cost = route.policies.iter().any(|p| p.response_cost.is_some());
        let fields = route.rate_limit_headers.mode != HeaderMode::None;
        Needs {
            request_body: route.reads_body(),
            response_headers: lease || cost || fields,
            response_body: lease || usage,
        }
    }

    pub(crate) const NONE: Needs = Needs {
        request_body: false,
        response_headers: false,
        response_body: false,
    };
}

/// The request as Envoy's first message gives it.
#[derive(Debug)]
pub struct RequestStart {
    pub request: Request<()>,
    /// The client (`source.address`, when Envoy sends the attribute).
    pub client: Option<IpAddr>,
    /// No body follows.
    pub end_of_stream: bool,
}

/// The response head as Envoy gives it.
#[derive(Debug)]
pub struct ResponseStart {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub end_of_stream: bool,
    /// Envoy made this response itself (`response.code_details` is not `via_upstream`): the
    /// upstream's response never arrived, settled as the gateway settles a missing response.
    pub local: bool,
}

/// Where one exchange is.
#[derive(Debug)]
enum Phase {
    /// Nothing seen yet.
    Start,
    /// Routed; admission waits for the request body.
    Body(Box<Pending>),
    /// Admitted: what the response owes.
    Owed(Box<Owed>),
    /// Nothing more to do.
    Done,
}

#[derive(Debug)]
struct Pending {
    request: Request<()>,
    index: usize,
    params: PathParams,
    client_ip: IpAddr,
}

#[derive(Debug)]
struct Owed {
    index: usize,
    /// The rate-limit fields the response gets.
    fields: HeaderMap,
    after: AfterAdmission,
    lease: Option<LeaseGuard>,
    meter: Option<Meter>,
}

/// One request through Envoy, message by message. Dropped before the response ended, it
/// settles what it owes (its meter and lease settle on drop).
#[derive(Debug)]
pub struct Exchange {
    state: Arc<AppState>,
    live: Arc<Live>,
    metrics: Arc<ExtProcMetrics>,
    /// The gRPC connection's peer: Envoy.
    peer: IpAddr,
    started: Instant,
    phase: Phase,
}

impl Exchange {
    pub fn new(state: Arc<AppState>, metrics: Arc<ExtProcMetrics>, peer: IpAddr) -> Exchange {
        let live = state.live.load_full();
        Exchange {
            state,
            live,
            metrics,
            peer,
            started: crate::now::read(),
            phase: Phase::Start,
        }
    }

    /// The request headers: canonicalized, routed and, unless the route reads the body,
    /// admitted now.
    pub async fn request_headers(&mut self, start: RequestStart) -> Answer {
        if !matches!(self.phase, Phase::Start) {
            return Answer::Continue(Changes::default());
        }
        let RequestStart {
            mut request,
            client,
            end_of_stream,
        } = start;
        let live = self.live.clone();
        let server = &live.config.server;
        if let Err(e) = normalize::canonicalize(&mut request, server.paths) {
            return self.malformed(e.to_string());
        }
        // As the gateway: dropped names are neither keys nor sent upstream.
        let mut remove: Vec<HeaderName> = request
            .headers()
            .keys()
            .filter(|n| n.as_str().contains('_'))
            .cloned()
            .collect();
        let underscores = server.headers_with_underscores;
        if let Err(e) = crate::proxy::headers::apply_underscores(request.headers_mut(), underscores)
        {
            return self.malformed(e.to_string());
        }
        if underscores == crate::config::Underscores::Allow {
            remove.clear();
        }
        let head = RequestHead {
            method: request.method(),
            host: normalize::host::host(request.headers()),
            path: request.uri().path(),
            headers: request.headers(),
        };
        let Found::Route(index, params) = admission::route_for(&live, &head) else {
            self.metrics.door.record(CheckResult::NoRoute);
            live.unmatched.record_response(200, self.seconds());
            self.finish(StreamEnd::Passed);
            return Answer::Continue(Changes {
                remove,
                needs: Some(Needs::NONE),
                ..Changes::default()
            });
        };
        let route = &live.config.routes[index];
        let needs = Needs::of(route);
        if needs.response_body {
            // A compressed body hides its usage (`docs/llm.md`).
            remove.push(http::header::ACCEPT_ENCODING);
        }
        let client_ip = live
            .config
            .trusted_proxies
            .client_ip(client.unwrap_or(self.peer), request.headers());
        let pending = Pending {
            request,
            index,
            params,
            client_ip,
        };
        if needs.request_body && !end_of_stream {
            self.phase = Phase::Body(Box::new(pending));
            return Answer::Continue(Changes {
                remove,
                needs: Some(needs),
                ..Changes::default()
            });
        }
        match self.admit(pending, None).await {
            Answer::Continue(mut changes) => {
                changes.remove = remove;
                changes.needs = Some(needs);
                Answer::Continue(changes)
            }
            refused => refused,
        }
    }

    /// The request body (Envoy's one message of it, `BUFFERED` or `BUFFERED_PARTIAL`): read for
    /// the route's body keys and bound when it is whole and within `server.json_body_limit`.
    pub async fn request_body(&mut self, bytes: &[u8], end_of_stream: bool) -> Answer {
        if !matches!(self.phase, Phase::Body(_)) {
            return Answer::Continue(Changes::default());
        }
        let limit = self.live.config.server.json_body_limit;
        let body = (end_of_stream && bytes.len() as u64 <= limit)
            .then(|| crate::usage::request::parse(bytes))
            .flatten();
        self.admit_pending(body.as_ref()).await
    }

    /// Any later message while admission still waits for the body: no body is coming (Envoy
    /// was not configured to send it), so the request is admitted without it.
    pub async fn no_request_body(&mut self) -> Option<Response<ResponseBody>> {
        if !matches!(self.phase, Phase::Body(_)) {
            return None;
        }
        match self.admit_pending(None).await {
            Answer::Continue(_) => None,
            Answer::Respond(refusal) => Some(refusal),
        }
    }

    async fn admit_pending(&mut self, body: Option<&JsonBody>) -> Answer {
        match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::Body(pending) => self.admit(*pending, body).await,
            other => {
                self.phase = other;
                Answer::Continue(Changes::default())
            }
        }
    }

    /// Admits `pending` as the gateway would; sets the phase.
    async fn admit(&mut self, pending: Pending, body: Option<&JsonBody>) -> Answer {
        let live = self.live.clone();
        let Pending {
            request,
            index,
            params,
            client_ip,
        } = pending;
        let (route, resources) = (&live.config.routes[index], &live.routes[index]);
        let view = RequestView {
            method: request.method(),
            host: normalize::host::host(request.headers()),
            path: request.uri().path(),
            query: request.uri().query(),
            headers: request.headers(),
            params: &params,
            client_ip,
            client_prefix: live.config.client_prefix,
            // Envoy's connection is the client here: the end client's certificate is not seen.
            client_cert: None,
            body,
        };
        let admitted =
            match admission::admit_inline(&self.state, route, resources, &view, None).await {
                // A delayed request (`on_limit: delay`) is answered at its slot, as forward-auth's is.
                Ok((admitted, after, Some(wait))) => {
                    Box::pin(wait.hold(route)).await.map(|()| (admitted, after))
                }
                Ok((admitted, after, None)) => Ok((admitted, after)),
                Err(refusal) => Err(refusal),
            };
        let seconds = self.seconds();
        match admitted {
            Ok((admitted, mut after)) => {
                self.metrics.door.record(match admitted.kind {
                    Kind::FailedOpen => CheckResult::FailedOpen,
                    _ => CheckResult::Allowed,
                });
                resources.metrics.record_response(200, seconds);
                let lease = after.lease(&self.state, resources.metrics.in_flight());
                let meter = after.meter(&self.state, route, resources);
                let mut fields = HeaderMap::new();
                route
                    .rate_limit_headers
                    .insert(&mut fields, &admitted.limits, false);
                let owes = lease.is_some() || meter.is_some() || after.reads_response();
                if owes || !fields.is_empty() {
                    self.phase = Phase::Owed(Box::new(Owed {
                        index,
                        fields,
                        after,
                        lease,
                        meter,
                    }));
                } else {
                    self.finish(StreamEnd::Decided);
                }
                Answer::Continue(Changes::default())
            }
            Err(refusal) => {
                self.metrics.door.record(result_of(&refusal));
                let response = crate::inflight::refusal(route, &refusal, None);
                resources
                    .metrics
                    .record_response(response.status().as_u16(), seconds);
                self.finish(StreamEnd::Refused);
                Answer::Respond(response)
            }
        }
    }

    /// The response head: the cost of a response header charged, the meter told the framing,
    /// the rate-limit fields added.
    pub fn response_headers(&mut self, start: ResponseStart) -> Answer {
        let Phase::Owed(owed) = &mut self.phase else {
            return Answer::Continue(Changes::default());
        };
        let (route, resources) = (
            &self.live.config.routes[owed.index],
            &self.live.routes[owed.index],
        );
        owed.after
            .charge(&self.state, route, resources, &start.headers);
        if let (Some(meter), false) = (&mut owed.meter, start.local) {
            meter.head(start.status, &start.headers);
        }
        let set = std::mem::take(&mut owed.fields);
        if start.end_of_stream || (owed.meter.is_none() && owed.lease.is_none()) {
            self.complete();
        }
        Answer::Continue(Changes {
            set,
            ..Changes::default()
        })
    }

    /// One chunk of the response body, on its way to the client.
    pub fn response_body(&mut self, bytes: &[u8], end_of_stream: bool) {
        if let Phase::Owed(owed) = &mut self.phase {
            if let Some(meter) = &mut owed.meter {
                meter.feed(bytes);
            }
            if end_of_stream {
                self.complete();
            }
        }
    }

    /// The response's trailers: its body is whole.
    pub fn response_trailers(&mut self) {
        if matches!(self.phase, Phase::Owed(_)) {
            self.complete();
        }
    }

    /// The response ended whole: a JSON body is read, every cost settled, the lease released.
    fn complete(&mut self) {
        if let Phase::Owed(owed) = std::mem::replace(&mut self.phase, Phase::Done) {
            let Owed { meter, lease, .. } = *owed;
            if let Some(mut meter) = meter {
                meter.finish();
            }
            drop(lease);
            self.metrics.ended(StreamEnd::Complete);
        }
    }

    fn malformed(&mut self, message: String) -> Answer {
        self.metrics.door.record(CheckResult::BadRequest);
        self.live.unmatched.record_response(400, self.seconds());
        self.finish(StreamEnd::Passed);
        Answer::Respond(crate::respond::refusal(&Refusal::BadRequest(message)))
    }

    /// Since the request headers arrived.
    fn seconds(&self) -> f64 {
        crate::now::read()
            .saturating_duration_since(self.started)
            .as_secs_f64()
    }

    fn finish(&mut self, end: StreamEnd) {
        self.phase = Phase::Done;
        self.metrics.ended(end);
    }
}

impl Drop for Exchange {
    fn drop(&mut self) {
        // The meter and the lease settle as they drop with the phase.
        if matches!(self.phase, Phase::Owed(_)) {
            self.metrics.ended(StreamEnd::Cut);
        }
    }
}

/// How a refusal is counted in `turnstile_door_checks_total`.
fn result_of(refusal: &Refusal<'_>) -> CheckResult {
    match refusal {
        Refusal::RateLimited { .. } => CheckResult::Limited,
        Refusal::StoreUnavailable(_) => CheckResult::FailedClosed,
        Refusal::Unauthorized { .. } => CheckResult::Unauthorized,
        _ => CheckResult::BadRequest,
    }
}

/// A header value Envoy sent, as a field value (`raw_value` bytes, else `value`).
pub(crate) fn field_value(raw: &[u8], text: &str) -> Option<HeaderValue> {
    let bytes = if raw.is_empty() { text.as_bytes() } else { raw };
    HeaderValue::from_bytes(bytes).ok()
}
